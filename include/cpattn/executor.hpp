// The pipeline executor (issue 12 item 6): runs a Schedule (pipeline.hpp) over the ranks of
// the pipeline axis, one rank per stage, moving each micro-batch's activation forward and its
// gradient backward with Communicator::start_send/start_recv under the deadlines. What a stage
// computes is the caller's (PipelineStage); the executor owns the order and the messages.
//
// Deadlock freedom. Every send is non-blocking and is waited on only after the rank's last
// action, so a rank blocks only on a receive of the input of its next action. That input is
// the output of an action that precedes it in the schedule's dependency order (F(mb, v-1)
// before F(mb, v), B(mb, v+1) before B(mb, v)); every schedule of make_schedule() is one
// that the simulator completes under these dependencies, so the rank that owes the input
// never waits, transitively, on the rank waiting for it.
//
// Message matching. Between two ranks, messages of one tag match in the order they were
// started. Tags name the stream: activations or gradients, and the receiving chunk. On every
// stage each chunk runs its F's, and its B's, in increasing micro-batch order (all schedules
// of make_schedule() do), so the i-th message of a stream is the i-th micro-batch's.
//
// A schedule built by hand is checked first, on every rank and agreed before any message:
// check_schedule's rules, an order that the simulator finds waiting on itself, and the
// increasing micro-batch order above are refused with one message on every rank.
#pragma once

#include <cpattn/comm.hpp>
#include <cpattn/pipeline.hpp>

#include <cstdint>
#include <span>
#include <vector>

namespace cpattn {

// One pipeline stage's computation: chunk c of stage s is virtual stage v = c * S + s
// (pipeline.hpp). "First" and "last" below are virtual stages 0 and S*V - 1.
class PipelineStage {
 public:
  virtual ~PipelineStage() = default;
  // Floats of the tensor that crosses every virtual-stage boundary for micro-batch `micro`
  // (the activation forward, its gradient backward: the same shape), on every rank alike.
  virtual int64_t boundary_floats(int micro) const = 0;
  // F: `in` is the previous virtual stage's output (empty on the first); write `out` (empty
  // on the last).
  virtual void forward(int chunk, int micro, std::span<const float> in, std::span<float> out) = 0;
  // B: `dout` is the gradient of this virtual stage's output (empty on the last); write the
  // gradient of its input into `din` (empty on the first). Under a schedule without W actions
  // it also accumulates the weight gradients.
  virtual void backward(int chunk, int micro, std::span<const float> dout, std::span<float> din,
                        bool defer_weights) = 0;
  // W (zb-h1): the weight gradients of a backward run with defer_weights.
  virtual void weight(int chunk, int micro) = 0;
};

// Runs this rank's actions of `schedule`, the rank being stage pp.rank() (pp: the ranks of the
// pipeline axis, pp.size() == schedule.spec.stages). Collective over `pp`. Returns the
// actions in the order they ran, each with its start and end in seconds since the call
// (steady clock, after a barrier, so that the ranks' clocks start together). Throws
// cpattn::Error, on every rank before any message, when the schedule's stage count is not
// pp.size(): "the schedule has 3 stages but the pipeline axis has 2 ranks".
std::vector<TimedAction> run_pipeline(Communicator& pp, const Schedule& schedule, PipelineStage& stage);

}  // namespace cpattn
