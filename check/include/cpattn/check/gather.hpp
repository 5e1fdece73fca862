// The cross-rank side of a CP check: every rank's local results gathered into the batch's
// global order (fp32, real tokens), so that batch.hpp's single-process results and compare.hpp
// apply. Collective over the communicator: needs MPI (cpattn's comm and cp layers).
#pragma once

#include <cpattn/check/tensor.hpp>

#include <cpattn/comm.hpp>
#include <cpattn/plan.hpp>
#include <cpattn/tensor.hpp>

#include <functional>
#include <string>
#include <vector>

namespace cpattn::check {

// This rank's outputs of one CP forward + backward (local rows under `plan`).
struct LocalResults {
  ConstTensorView out, dq, dk, dv;
  const float* lse = nullptr;  // [local_tokens, Hq] fp32, contiguous; Hq = out.heads
};

// Collective: every rank gets the global results (gather_global_rows of each tensor).
Results gather_results(Communicator& comm, const RankPlan& plan, const LocalResults& local);

// Collective: runs `f` on this rank and returns, on every rank, the message of the
// cpattn::Error each rank's `f` threw ("" where it threw none), so that a check of errors that
// must be the same on every rank can compare them.
std::vector<std::string> error_on_every_rank(Communicator& comm, const std::function<void()>& f);

}  // namespace cpattn::check
