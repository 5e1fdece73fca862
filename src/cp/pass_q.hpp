// The pass-Q scheme (docs/cp.md): the queries travel around the ring of CP ranks instead of
// K/V. At step s rank r holds the query block of rank (r - s) mod cp (the next one in flight
// while this one is computed) and computes only its pairs with r's own K/V; the partial
// (out, lse) goes straight back to the queries' owner, which merges its cp parts in the fixed
// order of the steps 0, 1, ..., cp-1, whatever the timing. Backward: the visiting block
// carries (lse, q, out, dout); dK/dV accumulate where K/V live (steps in order), and each
// partial dQ goes back to its owner, summed in step order.
//
// Every step sends and receives one partial on every rank, an empty message when the step
// has no visible pair: the ranks then issue the same communicator calls, as the agreement of
// the next call checks.
#pragma once

#include "cp_internal.hpp"

#include <cpattn/cp.hpp>
#include <cpattn/plan.hpp>
#include <cpattn/worklist.hpp>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

namespace cpattn::cp_detail {

// What pass-Q computes on one rank for one plan, made once per plan.
struct PassQWork {
  // [s]: the tasks of rank (rank - s) mod cp's queries (rows of that rank's local block) over
  // this rank's K/V (rows of its local block); empty when no pair is visible.
  std::vector<WorkList> visiting;
  // [s]: whether rank (rank + s) mod cp has a visible pair for this rank's queries at step s,
  // i.e. whether the partial it sends back is full or empty.
  std::vector<char> returns;
};
PassQWork pass_q_work(const RankPlan& plan, const AttnOptions& o);

// The buffers of a ring whose partials go home: pass-Q both ways, and the ring scheme's
// backward (visiting K/V, partial dK/dV).
struct HomeRingBuffers {
  std::vector<std::byte> visit[2];    // the visiting block, storage dtype, double buffered
  std::vector<float> part[2];         // this rank's partial for the visiting block's owner
  std::vector<float> back[2];         // an owner's partial coming back
  std::size_t bytes() const;
};

// At step s = 0 .. cp-1 the visiting block visit[s % 2] (rank (r - s) mod cp's; visit[0] is
// this rank's own, filled by the caller) is shifted on while `compute(s, block, part)` writes
// this rank's partial (n_part floats) for its owner, only when visiting[s] has a task; the
// partial goes to the owner (an empty message when there was none), and the owner hands its
// own part (step 0) and the parts coming back (steps 1..cp-1, full where returns[s]) to `take`
// in step order, whatever the timing. With own_in_place, step 0 gets part = nullptr (the
// caller adds its own block's part straight into its result) and is not taken. compute runs
// inside env.compute_moving: its kernel calls must pass env.progress as AttnInputs::progress
// (step_inputs does), or the step's transfers move only in the waits after it.
void run_home_ring(SchemeEnv& env, HomeRingBuffers& b, std::span<const WorkList> visiting,
                   std::span<const char> returns, std::size_t n_part, bool own_in_place,
                   const std::function<void(int, const std::byte*, float*)>& compute,
                   const std::function<void(const float*)>& take);

// The scheme's buffers, kept across calls (one forward or backward runs at a time).
struct PassQBuffers : HomeRingBuffers {
  std::vector<float> acc;             // the owner's running result: [lse | out] or dQ
  std::vector<float> dk, dv;          // dK/dV sums
  std::size_t bytes() const;
};

// Forward on this rank's local rows: out and lse ([local_tokens, Hq] fp32) written; padding
// rows get out 0 and lse -inf. k and v are contiguous.
void pass_q_forward(SchemeEnv& env, PassQBuffers& b, const PassQWork& w, uint64_t seed, ConstTensorView q,
                    ConstTensorView k, ConstTensorView v, TensorView out, std::span<float> lse);

// Backward: the forward's q, out and lse with dout; dq, dk and dv written (padding rows 0).
void pass_q_backward(SchemeEnv& env, PassQBuffers& b, const PassQWork& w, uint64_t seed,
                     const CpBackwardArgs& a, ConstTensorView k, ConstTensorView v, std::span<const float> lse);

}  // namespace cpattn::cp_detail
