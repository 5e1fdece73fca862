// The pipeline executor (include/cpattn/executor.hpp) driving the training model's blocks
// (src/train/pipeline_model.hpp), at the rank count mpiexec gives (CTest: 2 and 3), every
// rank one stage of one pipeline and CP = 1 on each stage. For every schedule, micro-batch
// counts below and above the stage count, 5 blocks (uneven over 2 and 3 stages; interleaved
// over 4 and 6 virtual stages, one of them empty) and micro-batches of different lengths:
//   - the order each rank ran equals the schedule's list for its stage;
//   - the loss and every parameter gradient equal, bitwise, the same micro-batches run by
//     one process as one stage (the same products summed in the same micro-batch order), and
//     within 1e-5 of the largest gradient a plain per-micro-batch model_forward/model_backward
//     summed in float64 (the reference that shares no pipeline code);
//   - bad arguments fail on every rank with the same message.
#include "mpi_world.hpp"
#include "model.hpp"
#include "pipeline_model.hpp"
#include "sanitize.hpp"

#include <cpattn/comm.hpp>
#include <cpattn/error.hpp>
#include <cpattn/executor.hpp>
#include <cpattn/train.hpp>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

namespace cpattn::train {
namespace {

using ::cpattn::mpi_test::world_rank;
using ::cpattn::mpi_test::world_size;
using ::testing::HasSubstr;

const ModelConfig kTiny{.layers = 5, .dim = 16, .heads = 2, .kv_heads = 1, .ffn = 24};
constexpr uint64_t kSeed = 3;

// Documents of awkward lengths (a 1-byte one: a 2-token segment) cut into micro-batches of
// different lengths, so that boundary sizes differ from one micro-batch to the next.
std::vector<PackedSequence> micro_batches(int M) {
  std::mt19937 rng(11);
  std::vector<Document> docs;
  for (const int n : {1, 9, 40, 2, 23, 61, 5}) {
    Document d{"doc" + std::to_string(n), std::vector<uint8_t>(static_cast<std::size_t>(n))};
    for (uint8_t& b : d.bytes) b = static_cast<uint8_t>(rng() % 256);
    docs.push_back(std::move(d));
  }
  DataStream data(std::move(docs));
  std::vector<PackedSequence> seqs;
  for (int mb = 0; mb < M; ++mb) seqs.push_back(data.next(17 + 6 * mb));
  return seqs;
}

struct Outcome {
  std::vector<float> grads;  // the full gradient (summed over the pipeline's stages)
  double loss_sum = 0;       // row losses of all micro-batches
  std::vector<Action> ran;   // this rank's actions in the order they ran
};

// Runs `spec` over `pp` (one stage per rank), CP = 1 on every stage.
Outcome run_pipelined(Communicator& pp, const PipelineSpec& spec, const std::vector<PackedSequence>& seqs) {
  Communicator cp(MPI_COMM_SELF);
  Model m(cp, kTiny, {}, kSeed);
  PipelineModel stage(m, spec, pp.rank(), seqs, labeled_rows(seqs));
  Outcome o;
  for (const TimedAction& t : run_pipeline(pp, make_schedule(spec), stage)) o.ran.push_back(t.action);
  // Each stage holds its own layers' gradients and zeros elsewhere: x + 0 is exact, so the sum
  // is the full gradient bit for bit.
  o.grads.assign(m.grads.begin(), m.grads.begin() + m.layout.count);
  pp.all_reduce<float>(o.grads, ReduceOp::sum);
  double loss = stage.loss_sum();
  pp.all_reduce<double>(std::span(&loss, 1), ReduceOp::sum);
  o.loss_sum = loss;
  return o;
}

// The same micro-batches as one stage on one process.
Outcome run_single(PipelineSpec spec, const std::vector<PackedSequence>& seqs) {
  Communicator self(MPI_COMM_SELF);
  spec.stages = 1;
  if (spec.schedule == PipelineSchedule::interleaved) spec.virtual_stages = 1;
  if (spec.schedule != PipelineSchedule::fill_drain) spec.schedule = PipelineSchedule::gpipe;
  return run_pipelined(self, spec, seqs);
}

// No pipeline code: model_forward and model_backward per micro-batch, summed in float64.
struct Reference {
  std::vector<double> grads;
  double loss_sum = 0;
};
Reference run_reference(const std::vector<PackedSequence>& seqs) {
  Communicator self(MPI_COMM_SELF);
  Model m(self, kTiny, {}, kSeed);
  Reference r;
  r.grads.assign(static_cast<std::size_t>(m.layout.count), 0.0);
  const int64_t total = labeled_rows(seqs);
  for (const PackedSequence& s : seqs) {
    prepare_batch(m, s);
    int64_t scored = 0;
    r.loss_sum += model_forward(m, scored);
    model_backward(m, total);
    for (std::size_t i = 0; i < r.grads.size(); ++i) r.grads[i] += m.grads[i];
  }
  return r;
}

struct Case {
  PipelineSchedule schedule;
  int micro;
  int virtual_stages = 1;
};

void check_case(const Case& c) {
  Communicator pp(MPI_COMM_WORLD);
  const PipelineSpec spec{.stages = pp.size(), .micro = c.micro, .schedule = c.schedule,
                          .virtual_stages = c.virtual_stages};
  SCOPED_TRACE(std::string(pipeline_schedule_name(c.schedule)) + " S=" + std::to_string(spec.stages) +
               " M=" + std::to_string(c.micro) + " V=" + std::to_string(c.virtual_stages));
  const std::vector<PackedSequence> seqs = micro_batches(c.micro);
  const Outcome got = run_pipelined(pp, spec, seqs);
  EXPECT_EQ(got.ran, make_schedule(spec).actions[static_cast<std::size_t>(pp.rank())]);

  const Outcome one = run_single(spec, seqs);
  EXPECT_EQ(got.loss_sum, one.loss_sum);
  const Reference ref = run_reference(seqs);
  EXPECT_NEAR(got.loss_sum, ref.loss_sum, 1e-5 * std::abs(ref.loss_sum));
  if (c.schedule == PipelineSchedule::fill_drain) return;  // forward only: no gradient

  ASSERT_EQ(got.grads.size(), one.grads.size());
  EXPECT_TRUE(got.grads == one.grads) << "the pipelined gradient differs from one stage's";
  double scale = 0, err = 0;
  for (std::size_t i = 0; i < ref.grads.size(); ++i) {
    scale = std::max(scale, std::abs(ref.grads[i]));
    err = std::max(err, std::abs(got.grads[i] - ref.grads[i]));
  }
  EXPECT_GT(scale, 0.0);
  EXPECT_LE(err, 1e-5 * scale);
}

using ::cpattn::test::kSanitize;  // under a sanitizer M = 1 and S + 2 only (M < S and M > S still)

TEST(Executor, EverySchedule) {
  const int S = world_size();
  std::vector<Case> cases;
  for (const PipelineSchedule s : {PipelineSchedule::fill_drain, PipelineSchedule::gpipe,
                                   PipelineSchedule::one_f_one_b, PipelineSchedule::zb_h1})
    for (const int M : {1, S - 1, S + 2})
      if (M >= 1 && !(kSanitize && M == S - 1)) cases.push_back({s, M});
  cases.push_back({PipelineSchedule::interleaved, S, 2});
  if (!kSanitize) cases.push_back({PipelineSchedule::interleaved, 2 * S, 2});
  for (const Case& c : cases) check_case(c);
}

TEST(Executor, LayerAssignment) {
  EXPECT_EQ(stage_layers(5, 2, 0).begin, 0);
  EXPECT_EQ(stage_layers(5, 2, 0).end, 3);
  EXPECT_EQ(stage_layers(5, 2, 1).end, 5);
  std::vector<int> sizes;
  for (int v = 0; v < 6; ++v) sizes.push_back(stage_layers(5, 6, v).end - stage_layers(5, 6, v).begin);
  EXPECT_EQ(sizes, (std::vector<int>{1, 1, 1, 1, 1, 0}));
  EXPECT_EQ(stage_layers(5, 6, 5).begin, 5);
}

// Every rank throws, with the same text, naming both numbers.
TEST(Executor, MoreStagesThanRanks) {
  Communicator pp(MPI_COMM_WORLD);
  const PipelineSpec spec{.stages = pp.size() + 1, .micro = 2, .schedule = PipelineSchedule::one_f_one_b};
  const std::vector<PackedSequence> seqs = micro_batches(2);
  Communicator cp(MPI_COMM_SELF);
  Model m(cp, kTiny, {}, kSeed);
  PipelineModel stage(m, spec, pp.rank(), seqs, labeled_rows(seqs));
  try {
    (void)run_pipeline(pp, make_schedule(spec), stage);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_THAT(e.message(), HasSubstr("the schedule has " + std::to_string(pp.size() + 1) +
                                       " stages but the pipeline axis has " + std::to_string(pp.size()) + " ranks"));
  }
}

// A hand-built schedule is refused on every rank before any message, with stage 0's fault:
// micro-batches out of order (their messages would match other micro-batches'), or a
// backward missing (the next stage would wait for its gradient until the deadline).
TEST(Executor, AHandBuiltScheduleIsCheckedOnEveryRank) {
  Communicator pp(MPI_COMM_WORLD);
  const PipelineSpec spec{.stages = pp.size(), .micro = 2, .schedule = PipelineSchedule::one_f_one_b};
  const std::vector<PackedSequence> seqs = micro_batches(2);
  Communicator cp(MPI_COMM_SELF);
  Model m(cp, kTiny, {}, kSeed);
  PipelineModel stage(m, spec, pp.rank(), seqs, labeled_rows(seqs));
  Schedule swapped = make_schedule(spec);
  std::vector<Action>& first = swapped.actions[0];
  std::swap(*std::find(first.begin(), first.end(), Action{.kind = ActionKind::forward, .micro = 0}),
            *std::find(first.begin(), first.end(), Action{.kind = ActionKind::forward, .micro = 1}));
  Schedule missing = make_schedule(spec);
  missing.actions[0].pop_back();  // its last backward
  const std::pair<const Schedule*, std::string> cases[] = {
      {&swapped, "stage 0 runs F0 after F1: each chunk's actions of a kind must run in increasing micro-batch order"},
      {&missing, "schedule: stage 0 lacks B1"}};
  for (const auto& [schedule, want] : cases) {
    try {
      (void)run_pipeline(pp, *schedule, stage);
      ADD_FAILURE() << "no error for " << want;
    } catch (const Error& e) {
      EXPECT_THAT(e.message(), HasSubstr(want));
      EXPECT_THAT(e.message(), HasSubstr(pp.size() == 1 ? "[rank 0]" : "[ranks 0"));
    }
  }
  pp.barrier();  // nothing was sent: the ranks are in step
}

TEST(Executor, ZeroStagesAndMicroBatches) {
  try {
    (void)make_schedule({.stages = 0, .micro = 2});
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_THAT(e.message(), HasSubstr("stages must be >= 1, got 0"));
  }
  try {
    (void)make_schedule({.stages = 2, .micro = 0});
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_THAT(e.message(), HasSubstr("micro (micro-batches) must be >= 1, got 0"));
  }
}

}  // namespace
}  // namespace cpattn::train
