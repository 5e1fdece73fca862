// The cross-rank side of a CP check: every rank's local results gathered into the batch's
// global order (fp32, real tokens), so that batch.hpp's single-process results and compare.hpp
// apply. Collective over the communicator: needs MPI (cpattn's comm and cp layers).
#pragma once

#include <cpattn/check/tensor.hpp>

#include <cpattn/comm.hpp>
#include <cpattn/plan.hpp>
#include <cpattn/tensor.hpp>

namespace cpattn::check {

// This rank's outputs of one CP forward + backward (local rows under `plan`).
struct LocalResults {
  ConstTensorView out, dq, dk, dv;
  const float* lse = nullptr;  // [local_tokens, Hq] fp32, contiguous; Hq = out.heads
};

// Collective: every rank gets the global results (gather_global_rows of each tensor).
Results gather_results(Communicator& comm, const RankPlan& plan, const LocalResults& local);

}  // namespace cpattn::check
