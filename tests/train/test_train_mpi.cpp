// The training model end to end over MPI (include/cpattn/train.hpp), at the rank count mpiexec
// gives (CTest runs 1, 2 and 4): a gradient check of the hand-written backward, CP=N against
// CP=1 (run on MPI_COMM_SELF by rank 0 in the same job), bf16 attention, RoPE positions,
// learning, checkpoints and bad input. Rank 0's CP=1 results reach the others by plain
// MPI_Bcast on the world (<mpi.h> through cpattn/comm.hpp), outside the model under test.
#include "mpi_world.hpp"
#include "sanitize.hpp"
#include <cpattn/comm.hpp>
#include <cpattn/error.hpp>
#include <cpattn/train.hpp>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace cpattn::train {
namespace {

using ::testing::HasSubstr;

using ::cpattn::test::kSanitize;  // about 10x slower under a sanitizer: fewer and smaller steps

using ::cpattn::mpi_test::world_rank;
using ::cpattn::mpi_test::world_size;

const std::vector<Document>& default_docs() {
  static const std::vector<Document> docs = load_documents({});
  return docs;
}

// The small configuration of the CP comparisons.
const ModelConfig kSmall{.layers = 2, .dim = 64, .heads = 4, .kv_heads = 2};
constexpr int64_t kSmallSeq = 256;

struct Curve {
  std::vector<double> loss, gnorm;
};

// `steps` steps from the start of the default data on `comm`; the trainer is kept for callers
// that look at its weights.
Curve run(MPI_Comm mpi, const ModelConfig& m, const RunOptions& ro, int64_t seq_len, int steps,
          std::vector<float>* final_params = nullptr) {
  Communicator comm(mpi);
  Trainer t(comm, m, {}, ro, 7);
  DataStream data(default_docs());
  Curve c;
  for (int s = 0; s < steps; ++s) {
    const StepStats st = t.step(data.next(seq_len));
    c.loss.push_back(st.loss);
    c.gnorm.push_back(st.grad_norm);
  }
  if (final_params) final_params->assign(t.params().begin(), t.params().end());
  return c;
}

// The same run at CP=1 on rank 0, broadcast to every rank.
Curve reference(const ModelConfig& m, const RunOptions& ro, int64_t seq_len, int steps) {
  Curve c;
  if (world_rank() == 0) c = run(MPI_COMM_SELF, m, ro, seq_len, steps);
  c.loss.resize(steps);
  c.gnorm.resize(steps);
  MPI_Bcast(c.loss.data(), steps, MPI_DOUBLE, 0, MPI_COMM_WORLD);
  MPI_Bcast(c.gnorm.data(), steps, MPI_DOUBLE, 0, MPI_COMM_WORLD);
  return c;
}

double rel(double x, double ref) { return std::abs(x - ref) / std::abs(ref); }

// A path every rank agrees on (rank 0's pid), removed at the end.
struct SharedPath {
  std::string path;
  explicit SharedPath(const std::string& name) {
    long pid = static_cast<long>(getpid());
    MPI_Bcast(&pid, 1, MPI_LONG, 0, MPI_COMM_WORLD);
    path = (std::filesystem::temp_directory_path() /
            ("cpattn-train-test-" + std::to_string(pid) + "-" + name))
               .string();
  }
  ~SharedPath() {
    MPI_Barrier(MPI_COMM_WORLD);
    if (world_rank() == 0) std::filesystem::remove(path);
  }
};

// ---- Gradient check ------------------------------------------------------------------------------

// Central finite differences of t's loss on `seq` against its hand-written backward, for
// sampled elements and a random direction of every parameter tensor. `mine(pt)`: whether this
// rank's elements of pt are perturbed and checked (false for the experts another rank checks:
// an expert-parallel rank holds its own experts, so a perturbation on several ranks at once
// would move several experts); every rank runs the same forwards either way.
void check_gradients(Trainer& t, const PackedSequence& seq, int dim,
                     const std::function<bool(const ParamTensor&)>& mine) {
  t.loss_and_grad(seq);
  const std::vector<float> g(t.grads().begin(), t.grads().end());
  std::span<float> p = t.params();
  const double h = 1e-2;
  const auto loss_at = [&](int64_t i, double delta, bool perturb) {
    const float keep = p[i];
    if (perturb) p[i] = static_cast<float>(keep + delta);
    const double l = t.loss(seq);
    p[i] = keep;
    return l;
  };
  std::mt19937_64 rng(11);
  double worst = 0;
  for (const ParamTensor& pt : t.tensors()) {
    const bool own = mine(pt);
    // Three elements: the largest gradient and two random ones (rows of tokens in the batch
    // for the embedding, whose other rows have no gradient).
    std::vector<int64_t> idx;
    int64_t big = pt.offset;
    for (int64_t i = pt.offset; i < pt.offset + pt.size; ++i)
      if (std::abs(g[i]) > std::abs(g[big])) big = i;
    idx.push_back(big);
    for (int k = 0; k < 2; ++k) {
      if (pt.name == "wte")
        idx.push_back(pt.offset + seq.tokens[rng() % seq.tokens.size()] * dim + static_cast<int64_t>(rng() % dim));
      else
        idx.push_back(pt.offset + static_cast<int64_t>(rng() % pt.size));
    }
    for (const int64_t i : idx) {
      const double fd = (loss_at(i, h, own) - loss_at(i, -h, own)) / (2 * h);
      if (!own) continue;
      const double err = std::abs(fd - g[i]);
      worst = std::max(worst, err / (1e-3 + std::abs(fd)));
      EXPECT_LE(err, 2e-4 + 3e-2 * std::abs(fd))
          << pt.name << "[" << i - pt.offset << "]: backward " << g[i] << ", finite differences " << fd;
    }
    // A random unit direction over the whole tensor.
    std::normal_distribution<double> nd;
    std::vector<double> dir(pt.size);
    double nn = 0, gd = 0;
    for (double& x : dir) {
      x = nd(rng);
      nn += x * x;
    }
    for (int64_t i = 0; i < pt.size; ++i) gd += (dir[i] /= std::sqrt(nn)) * g[pt.offset + i];
    const std::vector<float> keep(p.begin() + pt.offset, p.begin() + pt.offset + pt.size);
    double l[2];
    for (int s = 0; s < 2; ++s) {
      for (int64_t i = 0; own && i < pt.size; ++i)
        p[pt.offset + i] = static_cast<float>(keep[i] + (s == 0 ? h : -h) * dir[i]);
      l[s] = t.loss(seq);
    }
    std::copy(keep.begin(), keep.end(), p.begin() + pt.offset);
    const double fd = (l[0] - l[1]) / (2 * h);
    if (own) {
      EXPECT_LE(std::abs(fd - gd), 2e-4 + 3e-2 * std::abs(fd))
          << pt.name << " along a random direction: backward " << gd << ", finite differences " << fd;
    }
  }
  if (world_rank() == 0) std::printf("[ info ] worst relative gradient error %.3e\n", worst);
}

// Two documents of random letters (29 and 21 bytes), packed into one sequence of 48 tokens:
// segments of 30 and 18, both padded by the planner at every cp.
PackedSequence two_documents() {
  std::mt19937_64 text(5);
  std::string a(29, ' '), b(21, ' ');
  for (char& ch : a) ch = static_cast<char>('a' + text() % 26);
  for (char& ch : b) ch = static_cast<char>('a' + text() % 26);
  DataStream data({{"a", {a.begin(), a.end()}}, {"b", {b.begin(), b.end()}}});
  return data.next(48);
}

// The dense model at CP = world size (so the distributed attention backward and the gradient
// all-reduce are checked too).
TEST(TrainGrad, BackwardMatchesFiniteDifferences) {
  Communicator comm(MPI_COMM_WORLD);
  const ModelConfig m{.layers = 2, .dim = 16, .heads = 4, .kv_heads = 2, .ffn = 24, .init_std = 0.2f};
  Trainer t(comm, m, {}, {}, 3);
  const PackedSequence seq = two_documents();
  ASSERT_EQ(seq.cu_seqlens.size(), 3u);
  check_gradients(t, seq, m.dim, [](const ParamTensor&) { return true; });
}

// Every block's MLP a mixture of 4 experts, each token routed to all 4 (top_k = E), with the
// Switch auxiliary loss (whose gradient the objective includes), at CP = EP = world size: each
// rank holds 4 / world of the experts, rank 0's checked (the others' are the same code on
// other rows). Odd widths: head dim 6, expert width 10. top_k = E and no capacity factor
// because a change of the chosen experts, like a drop, is a jump in the loss, which central
// differences with h = 1e-2 cannot step over; the routing with top_k < E and with drops is
// checked against one process in cli.train_moe.
TEST(TrainGrad, MixtureOfExpertsBackwardMatchesFiniteDifferences) {
  Communicator comm(MPI_COMM_WORLD);
  const ModelConfig m{.layers = 2, .dim = 12, .heads = 2, .kv_heads = 1, .ffn = 10, .init_std = 0.2f,
                      .experts = 4, .top_k = 4, .aux_loss_coeff = 0.05};
  Trainer t(comm, m, {}, {}, 3, {.ep = world_size()});
  check_gradients(t, two_documents(), m.dim,
                  [](const ParamTensor& pt) { return world_rank() == 0 || pt.name.find(".moe.w") == std::string::npos; });
}

// loss() (every block on every rank, no pipeline) and loss_and_grad() (through the pipeline)
// of a model with experts and the aux loss equal one process's on a DP x PP mesh (cp = 1, so
// the routing groups are one process's): the aux loss is counted once per block, whichever
// stage or replica computed it. 1 rank: the reference itself; 2: PP = 2; 4: DP = EP = 2 x PP = 2.
TEST(TrainMoe, LossWithAuxIsOneProcesssOnADpPpMesh) {
  const ModelConfig m{.layers = 3, .dim = 16, .heads = 2, .kv_heads = 1, .ffn = 12, .init_std = 0.2f,
                      .experts = 4, .top_k = 2, .capacity_factor = 1.0, .aux_loss_coeff = 0.1};
  const PackedSequence seq = two_documents();
  double ref[2] = {0, 0};
  if (world_rank() == 0) {
    Communicator self(MPI_COMM_SELF);
    Trainer one(self, m, {}, {}, 3);
    ref[0] = one.loss(seq);
    ref[1] = one.loss_and_grad(seq);
  }
  MPI_Bcast(ref, 2, MPI_DOUBLE, 0, MPI_COMM_WORLD);
  Communicator comm(MPI_COMM_WORLD);
  const int pp = world_size() >= 2 ? 2 : 1, dp = world_size() / pp;
  Trainer t(comm, m, {}, {}, 3, {.dp = dp, .pp = pp, .ep = dp});
  const std::vector<PackedSequence> micro(static_cast<std::size_t>(dp), seq);
  EXPECT_LE(rel(t.loss(seq), ref[0]), 1e-6);
  const StepStats st = t.step(micro);  // dp copies of seq: the same mean loss and aux loss
  EXPECT_LE(rel(st.loss + st.aux_loss, ref[1]), 1e-6) << "loss " << st.loss << " + aux " << st.aux_loss;
  EXPECT_GT(st.aux_loss, 0.0);
}

// ---- CP = N against CP = 1 -------------------------------------------------------------------------

// A step's activations are reused by the next (Model::spare_acts): a sequence after a longer
// one (buffers larger than it needs), then the longer one again, give bitwise the loss and
// gradients of a fresh trainer, on the CP group of the whole world.
TEST(TrainCp, ActivationsKeptBetweenStepsLeaveNoTrace) {
  Communicator comm(MPI_COMM_WORLD);
  DataStream data(default_docs());
  const PackedSequence longer = data.next(kSmallSeq), shorter = data.next(kSmallSeq / 2);
  const auto grads_of = [](Trainer& t, const PackedSequence& seq) {
    const double loss = t.loss_and_grad(seq);
    std::vector<double> r{loss};
    r.insert(r.end(), t.grads().begin(), t.grads().end());
    return r;
  };
  Trainer kept(comm, kSmall, {}, {}, 7);
  const std::vector<double> long_first = grads_of(kept, longer);
  const std::vector<double> short_after = grads_of(kept, shorter);
  const std::vector<double> long_again = grads_of(kept, longer);
  Trainer fresh(comm, kSmall, {}, {}, 7);
  const std::vector<double> short_fresh = grads_of(fresh, shorter);
  EXPECT_EQ(short_after, short_fresh);
  EXPECT_EQ(long_again, long_first);
  EXPECT_NE(short_after, long_first);
}

TEST(TrainCp, Fp32CurveMatchesCp1Within1e5AndWeightsStayReplicated) {
  const int steps = kSanitize ? 6 : 20;
  std::vector<float> params;
  const Curve got = run(MPI_COMM_WORLD, kSmall, {}, kSmallSeq, steps, &params);
  const Curve ref = reference(kSmall, {}, kSmallSeq, steps);
  double dl = 0, dg = 0;
  for (int s = 0; s < steps; ++s) {
    dl = std::max(dl, rel(got.loss[s], ref.loss[s]));
    dg = std::max(dg, rel(got.gnorm[s], ref.gnorm[s]));
    if (world_size() == 1) {
      EXPECT_EQ(got.loss[s], ref.loss[s]) << "step " << s;  // the same computation: bitwise
      EXPECT_EQ(got.gnorm[s], ref.gnorm[s]) << "step " << s;
    }
  }
  EXPECT_LE(dl, 1e-5);
  EXPECT_LE(dg, 1e-5);
  EXPECT_LT(got.loss.back(), got.loss.front());
  if (world_rank() == 0)
    std::printf("[ info ] cp %d vs cp 1 over %d steps: max relative difference loss %.3e, grad norm %.3e\n",
                world_size(), steps, dl, dg);
  // Every rank holds bitwise the same weights.
  std::vector<float> rank0 = params;
  MPI_Bcast(rank0.data(), static_cast<int>(rank0.size()), MPI_FLOAT, 0, MPI_COMM_WORLD);
  EXPECT_EQ(std::memcmp(rank0.data(), params.data(), params.size() * sizeof(float)), 0);
}

// The 200 steps, on the small model at the default learning rate (docs/benchmarks.md
// has the default model's curves).
TEST(TrainCp, Bf16AttentionStaysWithin2PercentOfFp32Cp1) {
  const int steps = kSanitize ? 5 : 200;
  const Curve got = run(MPI_COMM_WORLD, kSmall, {.attn_dtype = DType::bf16}, kSmallSeq, steps);
  const Curve ref = reference(kSmall, {}, kSmallSeq, steps);
  double worst = 0;
  for (int s = 0; s < steps; ++s) worst = std::max(worst, rel(got.loss[s], ref.loss[s]));
  EXPECT_LE(worst, 0.02);
  if (world_rank() == 0)
    std::printf("[ info ] bf16 cp %d vs fp32 cp 1 over %d steps: max relative loss difference %.3e\n",
                world_size(), steps, worst);
}

// RoPE must use each token's global position in its document. With local offsets the model
// sees other positions as soon as a document is split over ranks (cp > 1), and the curve
// leaves the CP=1 one; at cp = 1 local offsets are the global positions.
TEST(TrainCp, RopeUsesGlobalPositions) {
  // Larger initial weights: attention is sharp from the first step, so positions matter at once.
  ModelConfig m = kSmall;
  m.init_std = 0.2f;
  const int steps = kSanitize ? 3 : 6;
  const Curve local = run(MPI_COMM_WORLD, m, {.rope_local_offsets = true}, kSmallSeq, steps);
  const Curve global = run(MPI_COMM_WORLD, m, {}, kSmallSeq, steps);
  const Curve ref = reference(m, {}, kSmallSeq, steps);
  double d_local = 0, d_global = 0;
  for (int s = 0; s < steps; ++s) {
    d_local = std::max(d_local, rel(local.loss[s], ref.loss[s]));
    d_global = std::max(d_global, rel(global.loss[s], ref.loss[s]));
  }
  EXPECT_LE(d_global, 1e-5);
  if (world_size() == 1)
    EXPECT_EQ(d_local, 0.0);
  else
    EXPECT_GT(d_local, 1e-3) << "RoPE positions made no difference";
  if (world_rank() == 0)
    std::printf("[ info ] cp %d: max relative loss difference to cp 1: global positions %.3e, local offsets %.3e\n",
                world_size(), d_global, d_local);
}

// The ring scheme and the attention masks (window, soft cap, ALiBi at once) at CP = world size
// train to the CP=1 curve of the same model (all-gather, one process). The masks change the
// curve, so they reach every rank's attention.
TEST(TrainCp, RingSchemeWithMasksMatchesCp1Within1e5) {
  ModelConfig m = kSmall;
  m.window_left = 24;
  m.softcap = 5.0f;
  m.alibi = true;
  const int steps = kSanitize ? 2 : 4;
  const Curve got = run(MPI_COMM_WORLD, m, {.cp_scheme = CpScheme::ring}, kSmallSeq, steps);
  const Curve ref = reference(m, {}, kSmallSeq, steps);
  const Curve plain = reference(kSmall, {}, kSmallSeq, steps);
  double d = 0, d_plain = 0;
  for (int s = 0; s < steps; ++s) {
    d = std::max({d, rel(got.loss[s], ref.loss[s]), rel(got.gnorm[s], ref.gnorm[s])});
    d_plain = std::max(d_plain, rel(plain.loss[s], ref.loss[s]));
  }
  EXPECT_LE(d, 1e-5);
  EXPECT_GT(d_plain, 1e-4) << "the masks made no difference";
  if (world_rank() == 0)
    std::printf("[ info ] cp %d ring with masks vs cp 1: max relative difference %.3e (masks vs none: %.3e)\n",
                world_size(), d, d_plain);
}

// Every CP scheme trains to the CP=1 curve (all-gather, one process) of the same model: the
// all-gather, the ring, pass-Q, all-to-all (Hkv = 2 replicated at cp 4) and the hybrid, whose
// all-to-all groups are 2 ranks where the world size is even (2 x 2 at 4 ranks).
TEST(TrainCp, EverySchemeMatchesCp1Within1e5) {
  const int steps = kSanitize ? 2 : 3;
  const Curve ref = reference(kSmall, {}, kSmallSeq, steps);
  for (const CpScheme scheme : kCpSchemes) {
    RunOptions ro{.cp_scheme = scheme};
    if (scheme == CpScheme::hybrid) ro.cp_inner = world_size() % 2 == 0 ? 2 : 1;
    const Curve got = run(MPI_COMM_WORLD, kSmall, ro, kSmallSeq, steps);
    double d = 0;
    for (int s = 0; s < steps; ++s) d = std::max({d, rel(got.loss[s], ref.loss[s]), rel(got.gnorm[s], ref.gnorm[s])});
    EXPECT_LE(d, 1e-5) << to_string(scheme);
    if (world_rank() == 0)
      std::printf("[ info ] cp %d %s vs cp 1: max relative difference %.3e\n", world_size(),
                  std::string(to_string(scheme)).c_str(), d);
  }
}

// Hidden dropout (ModelConfig::dropout) draws its masks by document and global position, so
// CP training with dropout follows the CP=1 curve with dropout: at cp = world size, and at
// 4 ranks also cp = 3 on ranks 0..2 (so 2, 3 and 4 are covered by the 2- and 4-rank runs).
// The dropout changes the curve (it reaches every block).
TEST(TrainCp, HiddenDropoutMatchesCp1Within1e5) {
  ModelConfig m = kSmall;
  m.dropout = 0.2f;
  const int steps = kSanitize ? 2 : 4;
  const Curve ref = reference(m, {}, kSmallSeq, steps);
  const Curve plain = reference(kSmall, {}, kSmallSeq, steps);
  const auto worst = [&](const Curve& got) {
    double d = 0;
    for (int s = 0; s < steps; ++s) d = std::max({d, rel(got.loss[s], ref.loss[s]), rel(got.gnorm[s], ref.gnorm[s])});
    return d;
  };
  double d_plain = 0;
  for (int s = 0; s < steps; ++s) d_plain = std::max(d_plain, rel(plain.loss[s], ref.loss[s]));
  EXPECT_GT(d_plain, 1e-4) << "dropout made no difference";
  const double d = worst(run(MPI_COMM_WORLD, m, {}, kSmallSeq, steps));
  EXPECT_LE(d, 1e-5);
  if (world_size() == 1) {
    EXPECT_EQ(d, 0.0);
  }
  if (world_rank() == 0)
    std::printf("[ info ] cp %d with dropout vs cp 1: max relative difference %.3e (dropout vs none: %.3e)\n",
                world_size(), d, d_plain);
  if (world_size() == 4) {  // cp = 3 on ranks 0..2 (odd cp: chunks of 6 per document)
    MPI_Comm three = MPI_COMM_NULL;
    MPI_Comm_split(MPI_COMM_WORLD, world_rank() < 3 ? 0 : MPI_UNDEFINED, world_rank(), &three);
    if (three != MPI_COMM_NULL) {
      const double d3 = worst(run(three, m, {.cp_scheme = CpScheme::ring}, kSmallSeq, steps));
      EXPECT_LE(d3, 1e-5);
      if (world_rank() == 0)
        std::printf("[ info ] cp 3 (ring) with dropout vs cp 1: max relative difference %.3e\n", d3);
      MPI_Comm_free(&three);
    }
    MPI_Barrier(MPI_COMM_WORLD);
  }
}

// ---- Learning --------------------------------------------------------------------------------------

// The default model on the default data: the loss falls from ln 257 = 5.55 well below it.
TEST(TrainLearning, LossFallsWellBelowLn257) {
  const ModelConfig m = kSanitize ? kSmall : ModelConfig{};
  const int steps = kSanitize ? 100 : 40;  // the small model learns more slowly
  const int64_t seq = kSanitize ? 256 : 1024;
  const Curve c = run(MPI_COMM_WORLD, m, {}, seq, steps);
  EXPECT_NEAR(c.loss.front(), std::log(257.0), 0.1);
  double tail = 0;
  for (int s = steps - 5; s < steps; ++s) tail += c.loss[s] / 5;
  EXPECT_LT(tail, 3.5);  // at the default lr 5e-4: measured 3.02 (small, 100 steps), 3.10 (default, 40)
  if (world_rank() == 0)
    std::printf("[ info ] cp %d: loss %.4f -> mean of the last 5 steps %.4f after %d steps\n", world_size(),
                c.loss.front(), tail, steps);
}

// ---- Checkpoints -----------------------------------------------------------------------------------

// n steps on `comm`, optionally resuming from / saving to `path`. Returns the losses.
std::vector<double> steps_with_checkpoint(MPI_Comm mpi, int n, const std::string& resume, const std::string& save,
                                          std::vector<float>* params = nullptr, const RunOptions& ro = {},
                                          int64_t* skipped = nullptr) {
  Communicator comm(mpi);
  Trainer t(comm, kSmall, {.warmup = 3}, ro, 7);
  DataStream data(default_docs());
  if (!resume.empty()) data.seek(t.load(resume));
  std::vector<double> losses;
  for (int s = 0; s < n; ++s) losses.push_back(t.step(data.next(kSmallSeq)).loss);
  if (!save.empty()) t.save(save, data.position());
  if (params) params->assign(t.params().begin(), t.params().end());
  if (skipped) *skipped = t.skipped_steps();
  return losses;
}

TEST(TrainCheckpoint, ResumedRunIsBitwiseTheUninterruptedOne) {
  const SharedPath ck("resume.ckpt");
  std::vector<float> p_straight, p_resumed;
  const std::vector<double> straight = steps_with_checkpoint(MPI_COMM_WORLD, 6, "", "", &p_straight);
  std::vector<double> resumed = steps_with_checkpoint(MPI_COMM_WORLD, 3, "", ck.path);
  const std::vector<double> rest = steps_with_checkpoint(MPI_COMM_WORLD, 3, ck.path, "", &p_resumed);
  resumed.insert(resumed.end(), rest.begin(), rest.end());
  EXPECT_EQ(resumed, straight);  // bitwise, at every cp (the gradient reduction is deterministic)
  ASSERT_EQ(p_resumed.size(), p_straight.size());
  EXPECT_EQ(std::memcmp(p_resumed.data(), p_straight.data(), p_straight.size() * sizeof(float)), 0);
}

// With a step skipped as non-finite before the save: the resumed run's updates count as the
// uninterrupted run's (AdamW's bias correction counts updates, and the checkpoint keeps the
// skipped steps), bitwise, and the count goes on.
TEST(TrainCheckpoint, ResumedRunAfterASkippedStepIsBitwiseTheUninterruptedOne) {
  const SharedPath ck("resume-skip.ckpt");
  const RunOptions skip{.skip_nonfinite = true, .testing_nan_at_step = 1};
  std::vector<float> p_straight, p_resumed;
  int64_t skipped_straight = 0, skipped_resumed = 0;
  const std::vector<double> straight = steps_with_checkpoint(MPI_COMM_WORLD, 6, "", "", &p_straight, skip,
                                                             &skipped_straight);
  std::vector<double> resumed = steps_with_checkpoint(MPI_COMM_WORLD, 3, "", ck.path, nullptr, skip);
  const std::vector<double> rest = steps_with_checkpoint(MPI_COMM_WORLD, 3, ck.path, "", &p_resumed, {},
                                                         &skipped_resumed);
  resumed.insert(resumed.end(), rest.begin(), rest.end());
  ASSERT_EQ(resumed.size(), straight.size());
  for (std::size_t i = 0; i < straight.size(); ++i) {  // (step 1's loss is NaN in both)
    if (i != 1) {
      EXPECT_EQ(resumed[i], straight[i]) << "step " << i;
    }
  }
  EXPECT_EQ(skipped_straight, 1);
  EXPECT_EQ(skipped_resumed, 1);
  ASSERT_EQ(p_resumed.size(), p_straight.size());
  EXPECT_EQ(std::memcmp(p_resumed.data(), p_straight.data(), p_straight.size() * sizeof(float)), 0);
}

TEST(TrainCheckpoint, ResumesAcrossCpSizes) {
  const SharedPath ck1("from-cp1.ckpt"), ckn("from-cpn.ckpt");
  // Uninterrupted CP=1 reference, and a CP=1 checkpoint after 3 steps (rank 0 alone).
  std::vector<double> ref(6);
  if (world_rank() == 0) {
    ref = steps_with_checkpoint(MPI_COMM_SELF, 6, "", "");
    steps_with_checkpoint(MPI_COMM_SELF, 3, "", ck1.path);
  }
  MPI_Bcast(ref.data(), 6, MPI_DOUBLE, 0, MPI_COMM_WORLD);
  // CP=1 checkpoint resumed at CP=N.
  const std::vector<double> up = steps_with_checkpoint(MPI_COMM_WORLD, 3, ck1.path, "");
  // CP=N checkpoint resumed at CP=1.
  const std::vector<double> first = steps_with_checkpoint(MPI_COMM_WORLD, 3, "", ckn.path);
  std::vector<double> down(3);
  if (world_rank() == 0) down = steps_with_checkpoint(MPI_COMM_SELF, 3, ckn.path, "");
  MPI_Bcast(down.data(), 3, MPI_DOUBLE, 0, MPI_COMM_WORLD);
  for (int s = 0; s < 3; ++s) {
    EXPECT_LE(rel(first[s], ref[s]), 1e-5) << "step " << s;
    EXPECT_LE(rel(up[s], ref[s + 3]), 1e-5) << "step " << s + 3 << ", resumed at cp " << world_size();
    EXPECT_LE(rel(down[s], ref[s + 3]), 1e-5) << "step " << s + 3 << ", resumed at cp 1";
  }
}

// ---- Bad input: the same clear error on every rank ----------------------------------------------

TEST(TrainErrors, SequenceTooShortForTheRanks) {
  Communicator comm(MPI_COMM_WORLD);
  Trainer t(comm, kSmall, {}, {}, 1);
  DataStream data(default_docs());
  const int64_t n = min_seq_len(comm.size()) - 1;
  try {
    t.step(data.next(std::max<int64_t>(n, 1)));
    if (n >= 1) FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_THAT(e.message(), HasSubstr("min_seq_len(cp)"));
  }
}

TEST(TrainErrors, CheckpointOfAnotherModelOrMissing) {
  const SharedPath ck("other.ckpt");
  {
    Communicator comm(MPI_COMM_WORLD);
    Trainer other(comm, ModelConfig{.layers = 1, .dim = 32, .heads = 4, .kv_heads = 2}, {}, {}, 1);
    other.save(ck.path, {});
  }
  Communicator comm(MPI_COMM_WORLD);
  Trainer t(comm, kSmall, {}, {}, 1);
  try {
    t.load(ck.path);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_THAT(e.message(), HasSubstr("holds a model with layers = 1"));
  }
  try {
    t.load(ck.path + ".missing");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_THAT(e.message(), HasSubstr("cannot read"));
  }
}

TEST(TrainErrors, AnErrorOnOneRankReachesEveryRank) {
  Communicator comm(MPI_COMM_WORLD);
  const int last = comm.size() - 1;
  try {
    on_every_rank(comm, [&] { CPATTN_CHECK(comm.rank() != last, "rank ", comm.rank(), " broke"); });
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.message(), "rank " + std::to_string(last) + " broke");
  }
  EXPECT_NO_THROW(on_every_rank(comm, [] {}));
}

// ---- Non-finite steps -----------------------------------------------------------------------------

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.message();
  }
  return "no error";
}

TEST(TrainNonFinite, ANanLossStopsEveryRankNamingTheStepAndKeepsTheWeights) {
  Communicator comm(MPI_COMM_WORLD);
  Trainer t(comm, kSmall, {}, {.testing_nan_at_step = 2}, 7);
  DataStream data(default_docs());
  t.step(data.next(kSmallSeq));
  t.step(data.next(kSmallSeq));
  const std::vector<float> before(t.params().begin(), t.params().end());
  const std::string msg = error_of([&] { t.step(data.next(kSmallSeq)); });
  EXPECT_THAT(msg, HasSubstr("step 2: loss is nan, gradient norm"));  // on every rank alike
  EXPECT_EQ(std::memcmp(before.data(), t.params().data(), before.size() * sizeof(float)), 0);
  EXPECT_EQ(t.steps_done(), 2);
}

TEST(TrainNonFinite, SkipNonfiniteSkipsTheUpdateAndCountsIt) {
  Communicator comm(MPI_COMM_WORLD);
  Trainer t(comm, kSmall, {}, {.skip_nonfinite = true, .testing_nan_at_step = 1}, 7);
  DataStream data(default_docs());
  EXPECT_FALSE(t.step(data.next(kSmallSeq)).skipped);
  const std::vector<float> before(t.params().begin(), t.params().end());
  const StepStats st = t.step(data.next(kSmallSeq));
  EXPECT_TRUE(st.skipped);
  EXPECT_TRUE(std::isnan(st.loss));
  EXPECT_EQ(std::memcmp(before.data(), t.params().data(), before.size() * sizeof(float)), 0);
  EXPECT_EQ(t.skipped_steps(), 1);
  EXPECT_EQ(t.steps_done(), 2);
  const StepStats next = t.step(data.next(kSmallSeq));
  EXPECT_FALSE(next.skipped);
  EXPECT_TRUE(std::isfinite(next.loss));
}

TEST(TrainNonFinite, AHugeLearningRateDivergesIntoAnErrorNotANanRun) {
  Communicator comm(MPI_COMM_WORLD);
  Trainer t(comm, kSmall, {.lr = 1e30f, .warmup = 0}, {}, 7);
  DataStream data(default_docs());
  const std::string msg = error_of([&] {
    for (int s = 0; s < 10; ++s) t.step(data.next(kSmallSeq));
  });
  EXPECT_THAT(msg, ::testing::MatchesRegex("step [0-9]+: loss is .*, gradient norm .*"));
}

// ---- Checkpoint verification ----------------------------------------------------------------------

// The format's checksum (FNV-1a 64), rewritten into a corrupted copy so that the field checks
// behind it are reached. Offsets: magic 8, version and count 16, 36 fields, checksum, payload.
// (version 6: 33 configuration fields, then step, data doc, offset, epoch, skipped steps)
constexpr std::size_t kStepAt = 8 + 16 + 33 * 8, kChecksumAt = 8 + 16 + 38 * 8, kPayloadAt = kChecksumAt + 8;

uint64_t fnv(const std::string& b, std::size_t from, std::size_t to, uint64_t h = 14695981039346656037ull) {
  for (std::size_t i = from; i < to; ++i) h = (h ^ static_cast<uint8_t>(b[i])) * 1099511628211ull;
  return h;
}

std::string read_all(const std::string& p) {
  std::FILE* f = std::fopen(p.c_str(), "rb");
  std::string s;
  char buf[65536];
  for (std::size_t n; f && (n = std::fread(buf, 1, sizeof buf, f)) > 0;) s.append(buf, n);
  if (f) std::fclose(f);
  return s;
}

void write_all_to(const std::string& p, const std::string& b, bool fix_checksum = false) {
  std::string c = b;
  if (fix_checksum) {
    const uint64_t h = fnv(c, kPayloadAt, c.size(), fnv(c, 8, kChecksumAt));
    c.replace(kChecksumAt, 8, reinterpret_cast<const char*>(&h), 8);
  }
  std::FILE* f = std::fopen(p.c_str(), "wb");
  std::fwrite(c.data(), 1, c.size(), f);
  std::fclose(f);
}

std::string flip(std::string b, std::size_t at) {
  const char c = static_cast<char>(b.at(at) ^ 1);
  return b.replace(at, 1, 1, c);
}

TEST(TrainCheckpoint, CorruptOrForeignCheckpointsAreRefusedNamingTheProblem) {
  const SharedPath good("good.ckpt"), bad("bad.ckpt");
  const RunIdentity id{.seq_len = kSmallSeq, .data_hash = data_identity(default_docs())};
  {
    Communicator comm(MPI_COMM_WORLD);
    Trainer t(comm, kSmall, {.warmup = 3}, {}, 7);
    DataStream data(default_docs());
    t.step(data.next(kSmallSeq));
    t.save(good.path, data.position(), id);
  }
  const auto refused = [&](const std::function<std::string(std::string)>& corrupt, bool fix, const char* want,
                           const OptimConfig& oc = {.warmup = 3}, uint64_t seed = 7, RunIdentity rid = {}) {
    if (rid.seq_len == 0) rid = id;
    if (world_rank() == 0) write_all_to(bad.path, corrupt(read_all(good.path)), fix);
    MPI_Barrier(MPI_COMM_WORLD);
    Communicator comm(MPI_COMM_WORLD);
    Trainer t(comm, kSmall, oc, {}, seed);
    EXPECT_THAT(error_of([&] { t.load(bad.path, rid); }), HasSubstr(want)) << want;
    MPI_Barrier(MPI_COMM_WORLD);
  };
  const auto same = [](std::string b) { return b; };
  refused(same, false, "no error");  // the good copy loads
  refused([](std::string b) { return b.substr(0, b.size() - 5); }, false, "is truncated");
  refused([](std::string b) { return b.substr(0, 100); }, false, "is truncated");
  refused([](std::string b) { return b + "xyz"; }, false, "has 3 trailing bytes");
  refused([](std::string b) { return flip(b, kPayloadAt + 17); }, false, "fails its checksum");
  refused([](std::string b) { return flip(b, kStepAt - 40); }, false, "fails its checksum");
  refused([](std::string b) {
    const float nan = std::nanf("");
    b.replace(kPayloadAt + 4 * 5, 4, reinterpret_cast<const char*>(&nan), 4);
    return b;
  }, true, "has a non-finite weight at parameter 5");
  refused([](std::string b) {
    const int64_t step = -1;
    b.replace(kStepAt, 8, reinterpret_cast<const char*>(&step), 8);
    return b;
  }, true, "has a negative step (-1)");
  refused([](std::string b) {
    const int64_t v1 = 1;
    b.replace(8, 8, reinterpret_cast<const char*>(&v1), 8);
    return b;
  }, false, "has version 1, this cpattn reads versions 3 to 6");
  // Version 5 (no micro, no skipped steps), version 4 (no dropout field either) and version 3
  // (no mixture-of-experts fields either; this file's model has neither, its run records no
  // micro and skipped no step): the same run resumes. The fields of `cut` ([at, at + bytes),
  // in descending order) go, which are zeros here.
  const auto older = [](int64_t version, std::vector<std::pair<std::size_t, std::size_t>> cut) {
    return [=](std::string b) {
      std::size_t gone = 0;
      for (const auto& [at, bytes] : cut) {
        for (std::size_t i = at; i < at + bytes; ++i) EXPECT_EQ(b[i], 0) << "a field version " << version << " lacks";
        b.erase(at, bytes);
        gone += bytes;
      }
      const int64_t head[2] = {version, 38 - static_cast<int64_t>(gone / 8)};
      b.replace(8, 16, reinterpret_cast<const char*>(head), 16);
      const std::size_t sum_at = kChecksumAt - gone;
      const uint64_t h = fnv(b, sum_at + 8, b.size(), fnv(b, 8, sum_at));
      return b.replace(sum_at, 8, reinterpret_cast<const char*>(&h), 8);
    };
  };
  // The MoE fields, then dropout; micro before the step; the skipped steps after the epoch.
  constexpr std::size_t moe_at = 8 + 16 + 13 * 8, dropout_at = moe_at + 7 * 8, micro_at = kStepAt - 8,
                        skipped_at = kStepAt + 4 * 8;
  const std::pair<std::size_t, std::size_t> skipped{skipped_at, 8}, micro{micro_at, 8}, dropout{dropout_at, 8},
      moe{moe_at, 7 * 8};
  refused(older(5, {skipped, micro}), false, "no error");
  refused(older(4, {skipped, micro, dropout}), false, "no error");
  refused(older(3, {skipped, micro, dropout, moe}), false, "no error");
  // micro, where both record it: another is refused (RunIdentity::micro); not recorded on
  // one side (this file, 0), any.
  const auto micro_1 = [](std::string b) {
    const int64_t one = 1;
    return b.replace(kStepAt - 8, 8, reinterpret_cast<const char*>(&one), 8);
  };
  const RunIdentity micro_2{.seq_len = kSmallSeq, .data_hash = id.data_hash, .micro = 2};
  refused(micro_1, true, "has micro 1, this run 2", {.warmup = 3}, 7, micro_2);
  refused(same, false, "no error", {.warmup = 3}, 7, micro_2);
  refused(same, false, "has lr 0.0005, this run 0.001", {.lr = 1e-3f, .warmup = 3});
  refused(same, false, "has warmup 3, this run 10", {});
  refused(same, false, "has seed 7, this run 8", {.warmup = 3}, 8);
  refused(same, false, "has seq_len 256, this run 128", {.warmup = 3}, 7, {.seq_len = 128, .data_hash = id.data_hash});
  refused(same, false, "has data ", {.warmup = 3}, 7, {.seq_len = kSmallSeq, .data_hash = id.data_hash + 1});
}

}  // namespace
}  // namespace cpattn::train
