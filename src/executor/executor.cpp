// run_pipeline (include/cpattn/executor.hpp): walks this stage's actions, receiving each
// action's input just before it runs and sending its output without waiting.
#include <cpattn/error.hpp>
#include <cpattn/executor.hpp>

#include <chrono>
#include <algorithm>
#include <deque>
#include <string>
#include <vector>

namespace cpattn {

namespace {

// Tags: two streams (activations, gradients) per receiving chunk; start_send allows < 1000.
constexpr int kMaxChunkTags = 500;
int activation_tag(int chunk) { return 2 * chunk; }
int gradient_tag(int chunk) { return 2 * chunk + 1; }

class StageRunner {
 public:
  StageRunner(Communicator& pp, const Schedule& schedule, PipelineStage& stage)
      : pp_(pp), stage_(stage), S_(schedule.spec.stages), V_(schedule.spec.virtual_stages),
        s_(pp.rank()), defer_weights_(schedule.spec.schedule == PipelineSchedule::zb_h1) {}

  void run(const Action& a) {
    switch (a.kind) {
      case ActionKind::forward: return forward(a);
      case ActionKind::backward: return backward(a);
      case ActionKind::weight: return stage_.weight(a.chunk, a.micro);
    }
  }

  // Sends are waited on last: a rank never blocks on a send, only on the input it needs next.
  void finish() {
    for (CommRequest& r : sends_) pp_.wait(r);
    sends_.clear();
    buffers_.clear();
  }

 private:
  int vstage(int chunk) const { return chunk * S_ + s_; }
  bool first(int chunk) const { return vstage(chunk) == 0; }
  bool last(int chunk) const { return vstage(chunk) == S_ * V_ - 1; }
  // The rank of virtual stage v and its chunk there.
  int rank_of(int v) const { return v % S_; }
  int chunk_of(int v) const { return v / S_; }

  std::vector<float> receive(int micro, int source, int tag) {
    std::vector<float> buf(static_cast<std::size_t>(stage_.boundary_floats(micro)));
    CommRequest r = pp_.start_recv<float>(buf, source, tag);
    pp_.wait(r);
    return buf;
  }
  // Moves `buf` into the list of buffers in flight (a deque: its elements never move).
  void send(std::vector<float>&& buf, int dest, int tag) {
    buffers_.push_back(std::move(buf));
    sends_.push_back(pp_.start_send<float>(buffers_.back(), dest, tag));
  }
  // A stage sends to itself when S = 1 and V > 1: the output is the next chunk's input.
  std::vector<float> take_local(std::deque<std::vector<float>>& q) {
    std::vector<float> b = std::move(q.front());
    q.pop_front();
    return b;
  }

  void forward(const Action& a) {
    const int v = vstage(a.chunk);
    std::vector<float> in;
    if (!first(a.chunk))
      in = rank_of(v - 1) == s_ ? take_local(local_acts_) : receive(a.micro, rank_of(v - 1), activation_tag(a.chunk));
    std::vector<float> out(last(a.chunk) ? 0 : static_cast<std::size_t>(stage_.boundary_floats(a.micro)));
    stage_.forward(a.chunk, a.micro, in, out);
    if (last(a.chunk)) return;
    if (rank_of(v + 1) == s_)
      local_acts_.push_back(std::move(out));
    else
      send(std::move(out), rank_of(v + 1), activation_tag(chunk_of(v + 1)));
  }

  void backward(const Action& a) {
    const int v = vstage(a.chunk);
    std::vector<float> dout;
    if (!last(a.chunk))
      dout = rank_of(v + 1) == s_ ? take_local(local_grads_) : receive(a.micro, rank_of(v + 1), gradient_tag(a.chunk));
    std::vector<float> din(first(a.chunk) ? 0 : static_cast<std::size_t>(stage_.boundary_floats(a.micro)));
    stage_.backward(a.chunk, a.micro, dout, din, defer_weights_);
    if (first(a.chunk)) return;
    if (rank_of(v - 1) == s_)
      local_grads_.push_back(std::move(din));
    else
      send(std::move(din), rank_of(v - 1), gradient_tag(chunk_of(v - 1)));
  }

  Communicator& pp_;
  PipelineStage& stage_;
  int S_, V_, s_;
  bool defer_weights_;
  std::deque<std::vector<float>> buffers_;  // payloads of the sends in flight
  std::vector<CommRequest> sends_;
  std::deque<std::vector<float>> local_acts_, local_grads_;  // S = 1: chunk to chunk
};

}  // namespace

namespace {

// check_schedule's message, or the simulator's when the order waits on itself (ranks would
// wait for each other until the deadline), or the executor's own rule: on every stage, each
// chunk's forwards, backwards and weight gradients each in increasing micro-batch order (the
// i-th message of a stream is the i-th micro-batch's); empty when the schedule runs.
std::string order_error(const Schedule& schedule) {
  try {
    (void)simulate(schedule, uniform_costs(schedule.spec.stages));  // check_schedule's rules first
  } catch (const Error& e) {
    return e.message();
  }
  const int V = schedule.spec.virtual_stages;
  std::vector<int> last(static_cast<std::size_t>(3 * V));
  for (std::size_t st = 0; st < schedule.actions.size(); ++st) {
    std::fill(last.begin(), last.end(), -1);
    for (const Action& a : schedule.actions[st]) {
      int& l = last[static_cast<std::size_t>(static_cast<int>(a.kind) * V + a.chunk)];
      if (a.micro < l)
        return "run_pipeline: stage " + std::to_string(st) + " runs " + action_label(a, V > 1) + " after " +
               action_label({.kind = a.kind, .micro = l, .chunk = a.chunk}, V > 1) +
               ": each chunk's actions of a kind must run in increasing micro-batch order";
      l = a.micro;
    }
  }
  return {};
}

}  // namespace

std::vector<TimedAction> run_pipeline(Communicator& pp, const Schedule& schedule, PipelineStage& stage) {
  const PipelineSpec& spec = schedule.spec;
  std::string err;
  if (spec.stages != pp.size())
    err = "the schedule has " + std::to_string(spec.stages) + " stages but the pipeline axis has " +
          std::to_string(pp.size()) + " ranks";
  else if (spec.virtual_stages > kMaxChunkTags)
    err = "run_pipeline supports at most " + std::to_string(kMaxChunkTags) + " virtual stages, got " +
          std::to_string(spec.virtual_stages);
  else
    err = order_error(schedule);
  agree(pp,
        Fingerprint{}
            .add("stages", spec.stages)
            .add("micro", spec.micro)
            .add("schedule", static_cast<int64_t>(spec.schedule))
            .add("virtual_stages", spec.virtual_stages),
        "pipeline schedule", err);

  StageRunner runner(pp, schedule, stage);
  std::vector<TimedAction> ran;
  pp.barrier();
  const auto t0 = std::chrono::steady_clock::now();
  const auto since = [t0] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
  for (const Action& a : schedule.actions[static_cast<std::size_t>(pp.rank())]) {
    const double start = since();
    runner.run(a);
    ran.push_back({a, start, since()});
  }
  runner.finish();
  return ran;
}

}  // namespace cpattn
