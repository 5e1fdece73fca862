// The pipeline executor's measured makespan against the simulator's prediction
// (docs/benchmarks.md, "Pipeline executor"). A plain MPI program: mpirun -np 2
// bench/pipeline_bench [reps]. Each rank is one stage of the training model (CP = 1 on
// every stage). Per schedule, it first times every F, B and W of one step with its compute
// alone (TimedStage: the receive wait excluded), takes each stage's medians as the
// simulator's costs and a ping-pong of one boundary tensor as the transfer, then runs `reps`
// more steps and prints the median measured makespan (the last rank to finish) next to the
// simulated one.
#include "gflops.hpp"
#include "model.hpp"
#include "pipeline_model.hpp"

#include <cpattn/comm.hpp>
#include <cpattn/executor.hpp>
#include <cpattn/pipeline.hpp>
#include <cpattn/train.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

namespace {

using namespace cpattn;
using namespace cpattn::train;
using cpattn::bench::median;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// Forwards to a stage and records how long each action's computation took.
class TimedStage final : public PipelineStage {
 public:
  explicit TimedStage(PipelineStage& inner) : inner_(inner) {}
  int64_t boundary_floats(int micro) const override { return inner_.boundary_floats(micro); }
  void forward(int chunk, int micro, std::span<const float> in, std::span<float> out) override {
    const auto t = Clock::now();
    inner_.forward(chunk, micro, in, out);
    f.push_back(seconds_since(t));
  }
  void backward(int chunk, int micro, std::span<const float> dout, std::span<float> din, bool defer) override {
    const auto t = Clock::now();
    inner_.backward(chunk, micro, dout, din, defer);
    b.push_back(seconds_since(t));
  }
  void weight(int chunk, int micro) override {
    const auto t = Clock::now();
    inner_.weight(chunk, micro);
    w.push_back(seconds_since(t));
  }
  std::vector<double> f, b, w;

 private:
  PipelineStage& inner_;
};

constexpr ModelConfig kModel{.layers = 4, .dim = 128, .heads = 4, .kv_heads = 2};
constexpr int64_t kSeqLen = 512;
constexpr int kMicro = 8;

std::vector<PackedSequence> step_data() {
  DataStream data(load_documents({}));
  std::vector<PackedSequence> seqs;
  for (int i = 0; i < kMicro; ++i) seqs.push_back(data.next(kSeqLen));
  return seqs;
}

struct StepTimes {
  double makespan = 0;               // the latest end over the ranks, seconds
  std::vector<double> f, b, w;       // this rank's actions' compute times
};

StepTimes one_step(Communicator& pp, Model& m, const Schedule& schedule, const std::vector<PackedSequence>& seqs) {
  PipelineModel stage(m, schedule.spec, pp.rank(), seqs, labeled_rows(seqs));
  TimedStage timed(stage);
  const std::vector<TimedAction> ran = run_pipeline(pp, schedule, timed);
  std::vector<double> end{ran.empty() ? 0.0 : ran.back().end};
  pp.all_reduce<double>(end, ReduceOp::max);
  return {end[0], std::move(timed.f), std::move(timed.b), std::move(timed.w)};
}

// Every stage's medians, gathered: [stage] values.
std::vector<double> gathered(Communicator& pp, double mine) {
  std::vector<double> all(static_cast<std::size_t>(pp.size()));
  pp.all_gather<double>(std::span(&mine, 1), all);
  return all;
}

double ping_pong(Communicator& pp, int64_t floats) {
  std::vector<float> buf(static_cast<std::size_t>(floats));
  std::vector<double> t;
  for (int i = 0; i < 20; ++i) {
    pp.barrier();
    const auto t0 = Clock::now();
    if (pp.rank() == 0) {
      CommRequest s = pp.start_send<float>(buf, 1);
      pp.wait(s);
      CommRequest r = pp.start_recv<float>(buf, 1);
      pp.wait(r);
    } else if (pp.rank() == 1) {
      CommRequest r = pp.start_recv<float>(buf, 0);
      pp.wait(r);
      CommRequest s = pp.start_send<float>(buf, 0);
      pp.wait(s);
    }
    t.push_back(seconds_since(t0) / 2);
  }
  std::vector<double> mine{median(t)};
  pp.broadcast<double>(mine, 0);
  return mine[0];
}

}  // namespace

int main(int argc, char** argv) {
  const MpiSession mpi(argc, argv);
  Communicator pp(MPI_COMM_WORLD);
  Communicator self(MPI_COMM_SELF);
  const int reps = argc > 1 ? std::atoi(argv[1]) : 5;
  const std::vector<PackedSequence> seqs = step_data();
  Model m(self, kModel, {}, 1);
  const double transfer = ping_pong(pp, kSeqLen * kModel.dim);
  if (pp.rank() == 0)
    std::printf("S = %d, M = %d, %d blocks, dim %d, seq-len %lld, transfer %.3f ms\n%-12s %12s %12s %8s\n", pp.size(),
                kMicro, kModel.layers, kModel.dim, static_cast<long long>(kSeqLen), transfer * 1e3, "schedule",
                "measured ms", "simulated ms", "ratio");
  for (const PipelineSchedule kind : {PipelineSchedule::gpipe, PipelineSchedule::one_f_one_b,
                                      PipelineSchedule::interleaved, PipelineSchedule::zb_h1}) {
    const int V = kind == PipelineSchedule::interleaved ? 2 : 1;
    const Schedule schedule = make_schedule({.stages = pp.size(), .micro = kMicro, .schedule = kind, .virtual_stages = V});
    const StepTimes warm = one_step(pp, m, schedule, seqs);  // warm-up, and the costs
    // Without W actions a B is backward + weight: the simulator adds weight[s] (0 here) to it.
    const PipelineCosts costs{.forward = gathered(pp, median(warm.f)), .backward = gathered(pp, median(warm.b)),
                              .weight = gathered(pp, median(warm.w)), .transfer = transfer};
    const double predicted = simulate(schedule, costs).makespan;
    std::vector<double> measured;
    for (int r = 0; r < reps; ++r) measured.push_back(one_step(pp, m, schedule, seqs).makespan);
    if (pp.rank() == 0)
      std::printf("%-12s %12.2f %12.2f %8.3f\n", std::string(pipeline_schedule_name(kind)).c_str(),
                  median(measured) * 1e3, predicted * 1e3, median(measured) / predicted);
  }
  return 0;
}
