// Sequence parallelism of the training model's token-wise layers (src/train/layers.hpp), without
// MPI: each rank's local rows under the symmetric split (the planner's plan for cp ranks) run
// through RMSNorm and RoPE exactly as a single process's rows do. RMSNorm forward and backward
// are bitwise the dense result row by row; RoPE with the plan's global positions is bitwise the
// dense result, and with local offsets it is not (the test shows both); so does hidden dropout's
// mask; RoPE's backward against finite differences. And the expert-sharded parameter layout's
// alignment.
#include "layers.hpp"
#include "model.hpp"
#include "optimizer.hpp"

#include <cpattn/attention.hpp>
#include <cpattn/error.hpp>
#include <cpattn/plan.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

namespace cpattn::train {
namespace {

// Awkward documents: two of one token, one shorter than 2 * cp for every cp tested (5), odd
// lengths; 53 tokens in all.
const std::vector<int64_t> kCuSeqlens = {0, 1, 6, 7, 40, 53};
constexpr int64_t kT = 53;
constexpr int kCps[] = {1, 2, 3, 4};

std::vector<float> normals(std::size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist;
  std::vector<float> v(n);
  for (float& x : v) x = dist(gen);
  return v;
}

// Each token's position in its document, from 0 (what DataStream gives a packed sequence).
std::vector<int64_t> document_positions() {
  std::vector<int64_t> pos(kT);
  for (std::size_t d = 0; d + 1 < kCuSeqlens.size(); ++d)
    for (int64_t t = kCuSeqlens[d]; t < kCuSeqlens[d + 1]; ++t) pos[t] = t - kCuSeqlens[d];
  return pos;
}

// This rank's rows of a dense [kT, width] tensor; padding rows get `pad` (the training model's
// padding rows hold real values: the end-of-document token's embedding).
std::vector<float> local_rows(const std::vector<float>& dense, int width, const RankPlan& plan, float pad) {
  std::vector<float> local(plan.local_tokens * width);
  take_local_rows(dense.data(), static_cast<int64_t>(sizeof(float)) * width, plan, local.data());
  for (int64_t i = 0; i < plan.local_tokens; ++i)
    if (plan.real_token_index[i] < 0) std::fill_n(local.begin() + i * width, width, pad);
  return local;
}

// This rank's part of a batch with these positions (tokens, labels and loss mask unused).
TokenBatch local_positions(const std::vector<int64_t>& positions, const RankPlan& plan) {
  return get_batch_on_this_cp_rank({.tokens = std::vector<int64_t>(kT), .labels = std::vector<int64_t>(kT),
                                    .position_ids = positions, .loss_mask = std::vector<float>(kT)},
                                   plan);
}

// Local row i is bitwise dense row plan.real_token_index[i], for every real row.
void expect_rows_bitwise(const std::vector<float>& local, const std::vector<float>& dense, int width,
                         const RankPlan& plan, const char* what) {
  for (int64_t i = 0; i < plan.local_tokens; ++i) {
    const int64_t g = plan.real_token_index[i];
    if (g < 0) continue;
    EXPECT_EQ(std::memcmp(local.data() + i * width, dense.data() + g * width, sizeof(float) * width), 0)
        << what << ": cp " << plan.cp << " rank " << plan.rank << " local row " << i << " (token " << g << ")";
  }
}

TEST(SequenceParallel, ShardedRmsNormForwardAndBackwardAreTheDenseResultBitwise) {
  constexpr int D = 24;
  constexpr float eps = 1e-5f;
  const std::vector<float> x = normals(kT * D, 1), g = normals(D, 2), dout = normals(kT * D, 3);
  std::vector<float> out(kT * D), rstd(kT), dx(kT * D, 0.0f), dg(D, 0.0f);
  rmsnorm_forward(out.data(), rstd.data(), x.data(), g.data(), kT, D, eps);
  rmsnorm_backward(dx.data(), dg.data(), dout.data(), x.data(), rstd.data(), g.data(), kT, D);

  for (const int cp : kCps) {
    std::vector<float> dg_sum(D, 0.0f);  // the gradient all-reduce's sum over the ranks
    for (int rank = 0; rank < cp; ++rank) {
      const RankPlan plan = get_thd_load_balanced_cp_metadata(kCuSeqlens, cp, rank);
      const int64_t T = plan.local_tokens;
      // Padding rows: real values in, no gradient back (no label, no attention), as in training.
      const std::vector<float> xl = local_rows(x, D, plan, 0.75f), dl = local_rows(dout, D, plan, 0.0f);
      std::vector<float> ol(T * D), rl(T), dxl(T * D, 0.0f), dgl(D, 0.0f);
      rmsnorm_forward(ol.data(), rl.data(), xl.data(), g.data(), T, D, eps);
      rmsnorm_backward(dxl.data(), dgl.data(), dl.data(), xl.data(), rl.data(), g.data(), T, D);
      expect_rows_bitwise(ol, out, D, plan, "rmsnorm out");
      expect_rows_bitwise(rl, rstd, 1, plan, "rmsnorm rstd");
      expect_rows_bitwise(dxl, dx, D, plan, "rmsnorm dx");
      // The rank's dg is its real rows' alone: padding rows add exactly zero.
      std::vector<float> dg_real(D, 0.0f), dx_row(D);
      for (int64_t i = 0; i < T; ++i)  // the rank's real rows, one at a time in its order
        if (const int64_t t = plan.real_token_index[i]; t >= 0)
          rmsnorm_backward(dx_row.data(), dg_real.data(), dout.data() + t * D, x.data() + t * D, rstd.data() + t,
                           g.data(), 1, D);
      EXPECT_EQ(dgl, dg_real) << "cp " << cp << " rank " << rank;
      for (int i = 0; i < D; ++i) dg_sum[i] += dgl[i];
    }
    // dg is a sum over tokens: the ranks' partial sums add up in another order than the dense
    // loop's, so it equals the dense dg to rounding, not bitwise.
    for (int i = 0; i < D; ++i) {
      double scale = 0;
      for (int64_t t = 0; t < kT; ++t) scale += std::abs(dout[t * D + i] * x[t * D + i] * rstd[t]);
      EXPECT_NEAR(dg_sum[i], dg[i], 1e-6 * scale) << "cp " << cp << " dg[" << i << "]";
    }
  }
}

TEST(SequenceParallel, RopeOnShardedTokensNeedsTheGlobalPositionsOfThePlan) {
  constexpr int H = 3, hd = 8, W = H * hd;
  constexpr float theta = 10000.0f;
  const std::vector<float> q = normals(kT * W, 4);
  const std::vector<int64_t> positions = document_positions();
  std::vector<float> cos_t, sin_t, dense = q;
  rope_tables(cos_t, sin_t, positions, hd, theta);
  rope(dense.data(), cos_t.data(), sin_t.data(), kT, H, hd, false);

  for (const int cp : kCps) {
    float worst_local = 0;  // largest difference local offsets make on a real row
    for (int rank = 0; rank < cp; ++rank) {
      const RankPlan plan = get_thd_load_balanced_cp_metadata(kCuSeqlens, cp, rank);
      const int64_t T = plan.local_tokens;
      const TokenBatch local = local_positions(positions, plan);
      for (const bool local_offsets : {false, true}) {
        std::vector<float> ql = local_rows(q, W, plan, 0.0f);
        rope_tables(cos_t, sin_t, rope_positions(plan, local.position_ids, local_offsets), hd, theta);
        rope(ql.data(), cos_t.data(), sin_t.data(), T, H, hd, false);
        if (!local_offsets) {
          expect_rows_bitwise(ql, dense, W, plan, "rope with global positions");
          continue;
        }
        for (int64_t i = 0; i < T; ++i)
          if (const int64_t t = plan.real_token_index[i]; t >= 0)
            for (int j = 0; j < W; ++j) worst_local = std::max(worst_local, std::abs(ql[i * W + j] - dense[t * W + j]));
      }
    }
    if (cp == 1)
      EXPECT_EQ(worst_local, 0.0f) << "one rank: a local offset is the global position";
    else
      EXPECT_GT(worst_local, 0.1f) << "cp " << cp << ": local offsets should rotate split documents wrongly";
  }
}

// Hidden dropout (dropout_rows) on each rank's rows with the plan's documents and global
// positions drops bitwise what the dense run drops; with local offsets in place of the
// positions it does not (at cp > 1). The mask itself is attention dropout's generator
// (cpattn::dropout_keep), checked element by element, and a dropped share near p.
TEST(SequenceParallel, ShardedDropoutMaskIsTheDenseMaskWithGlobalPositionsOnly) {
  constexpr int D = 20;
  constexpr float p = 0.3f;
  constexpr uint64_t seed = 99;
  constexpr int64_t site = 3;
  const std::vector<float> x = normals(kT * D, 7);
  const std::vector<int64_t> positions = document_positions();
  std::vector<int64_t> doc(kT);
  for (std::size_t d = 0; d + 1 < kCuSeqlens.size(); ++d)
    for (int64_t t = kCuSeqlens[d]; t < kCuSeqlens[d + 1]; ++t) doc[t] = static_cast<int64_t>(d);
  std::vector<float> dense = x;
  dropout_rows(dense.data(), doc, positions, D, p, seed, site);
  int64_t dropped = 0;
  for (int64_t t = 0; t < kT; ++t)
    for (int j = 0; j < D; ++j) {
      const bool keep = dropout_keep(seed, site, doc[t], positions[t], j, p);
      EXPECT_EQ(dense[t * D + j], keep ? x[t * D + j] * (1.0f / (1.0f - p)) : 0.0f) << "token " << t << " feature " << j;
      dropped += !keep;
    }
  EXPECT_NEAR(static_cast<double>(dropped) / (kT * D), p, 0.06);

  for (const int cp : kCps) {
    int64_t differ = 0;  // real elements local offsets drop differently
    for (int rank = 0; rank < cp; ++rank) {
      const RankPlan plan = get_thd_load_balanced_cp_metadata(kCuSeqlens, cp, rank);
      const int64_t T = plan.local_tokens;
      const TokenBatch local = local_positions(positions, plan);
      std::vector<int64_t> local_doc(T, -1);  // padding rows: -1, left alone
      for (int64_t i = 0; i < T; ++i)
        if (const int64_t t = plan.real_token_index[i]; t >= 0) local_doc[i] = doc[t];
      for (const bool local_offsets : {false, true}) {
        std::vector<float> xl = local_rows(x, D, plan, 0.5f);
        const std::vector<float> padded = xl;
        dropout_rows(xl.data(), local_doc, rope_positions(plan, local.position_ids, local_offsets), D, p, seed, site);
        for (int64_t i = 0; i < T; ++i) {
          if (plan.real_token_index[i] >= 0) continue;
          EXPECT_EQ(std::memcmp(xl.data() + i * D, padded.data() + i * D, sizeof(float) * D), 0) << "padding row";
        }
        if (!local_offsets) {
          expect_rows_bitwise(xl, dense, D, plan, "dropout with global positions");
          continue;
        }
        for (int64_t i = 0; i < T; ++i)
          if (const int64_t t = plan.real_token_index[i]; t >= 0)
            for (int j = 0; j < D; ++j) differ += xl[i * D + j] != dense[t * D + j];
      }
    }
    if (cp == 1)
      EXPECT_EQ(differ, 0) << "one rank: a local offset is the global position";
    else
      EXPECT_GT(differ, 20) << "cp " << cp << ": local offsets should draw another mask for split documents";
  }
}

// RoPE is a rotation: its backward is the inverse rotation (what block_backward applies to dq
// and dk). Against central differences of L = sum(w * rope(x)), in double.
TEST(SequenceParallel, RopeBackwardMatchesFiniteDifferences) {
  constexpr int H = 2, hd = 6, W = H * hd;
  constexpr int64_t T = 7;
  const std::vector<int64_t> pos = {0, 1, 2, 0, 5, 17, 1000};
  std::vector<float> cos_t, sin_t;
  rope_tables(cos_t, sin_t, pos, hd, 10000.0f);
  const std::vector<float> x = normals(T * W, 5), w = normals(T * W, 6);
  const auto loss = [&](const std::vector<float>& in) {
    std::vector<float> y = in;
    rope(y.data(), cos_t.data(), sin_t.data(), T, H, hd, false);
    double s = 0;
    for (std::size_t i = 0; i < y.size(); ++i) s += static_cast<double>(w[i]) * y[i];
    return s;
  };
  std::vector<float> grad = w;
  rope(grad.data(), cos_t.data(), sin_t.data(), T, H, hd, true);
  constexpr float h = 1e-2f;  // L is linear in x: the differences are exact up to rounding
  for (std::size_t i = 0; i < x.size(); ++i) {
    std::vector<float> xp = x, xm = x;
    xp[i] += h;
    xm[i] -= h;
    const double fd = (loss(xp) - loss(xm)) / (static_cast<double>(xp[i]) - xm[i]);
    EXPECT_NEAR(grad[i], fd, 1e-4) << "element " << i;
  }
}

// The expert-sharded parameter layout aligned for the gradient all-reduce: both regions are
// multiples of `align` (so they reduce in place), the tensors are those of the unaligned
// layout, and take_local_experts / put_gathered_experts move every value between the whole
// model and the shards with the padding left zero. Odd sizes: dim 6, ffn 5, 3 experts per rank.
TEST(ParamLayoutAlign, RegionsAreMultiplesAndShardsRoundTrip) {
  const ModelConfig mc{.layers = 2, .dim = 6, .heads = 3, .kv_heads = 1, .ffn = 5, .experts = 6, .top_k = 2};
  const Dims d = model_dims(mc);
  const ParamLayout whole = param_layout(d, mc);
  std::vector<float> all(static_cast<std::size_t>(whole.count));
  for (std::size_t i = 0; i < all.size(); ++i) all[i] = static_cast<float>(i + 1);  // every value distinct, none 0
  for (const int64_t align : {1, 4, 7}) {
    std::vector<ParamLayout> shards;
    std::vector<std::vector<float>> mine;
    for (int r = 0; r < 2; ++r) {
      const ParamLayout plain = param_layout(d, mc, 3 * r, 3), local = param_layout(d, mc, 3 * r, 3, align);
      EXPECT_EQ(local.experts_begin % align, 0) << align;
      EXPECT_EQ((local.count - local.experts_begin) % align, 0) << align;
      EXPECT_EQ(local.replicated, plain.experts_begin);
      ASSERT_EQ(local.tensors.size(), plain.tensors.size());
      for (std::size_t i = 0; i < local.tensors.size(); ++i) {
        EXPECT_EQ(local.tensors[i].name, plain.tensors[i].name);
        EXPECT_EQ(local.tensors[i].size, plain.tensors[i].size);
        const int64_t shift = plain.tensors[i].offset >= plain.experts_begin ? local.experts_begin - plain.experts_begin : 0;
        EXPECT_EQ(local.tensors[i].offset, plain.tensors[i].offset + shift) << local.tensors[i].name;
      }
      std::vector<float> m(static_cast<std::size_t>(local.count), 0.0f);
      take_local_experts(whole, local, all, m);
      int64_t in_tensors = 0;
      for (const ParamTensor& t : local.tensors) in_tensors += t.size;
      EXPECT_EQ(std::count(m.begin(), m.end(), 0.0f), local.count - in_tensors) << "the padding stays zero";
      shards.push_back(local);
      mine.push_back(std::move(m));
    }
    std::vector<float> gathered;
    for (const std::vector<float>& m : mine) gathered.insert(gathered.end(), m.begin() + shards[0].experts_begin, m.end());
    std::vector<float> back(all.size(), 0.0f);
    put_gathered_experts(whole, shards[0], mine[0], gathered, back);
    EXPECT_EQ(back, all) << "align " << align;
  }
}

}  // namespace
// AdamW's settings, each rule named: beta = 1 made the bias correction divide by 0 (NaN
// weights), eps = 0 divided by 0 where a gradient and its moment are 0.
TEST(OptimConfigCheck, RejectsBetasOutsideZeroToOneAndANonPositiveEps) {
  const auto message = [](const OptimConfig& oc) {
    try {
      check_optim_config(oc);
    } catch (const Error& e) {
      return e.message();
    }
    return std::string("no error");
  };
  EXPECT_EQ(message(OptimConfig{}), "no error");
  EXPECT_EQ(message(OptimConfig{.beta1 = 1.0f}), "OptimConfig::beta1 and beta2 must be in [0, 1), got 1 and 0.95");
  EXPECT_EQ(message(OptimConfig{.beta2 = -0.5f}), "OptimConfig::beta1 and beta2 must be in [0, 1), got 0.9 and -0.5");
  EXPECT_EQ(message(OptimConfig{.eps = 0.0f}), "OptimConfig::eps must be finite and > 0, got 0");
  EXPECT_EQ(message(OptimConfig{.beta1 = 0.0f, .beta2 = 0.0f}), "no error");
}

// A skipped step (non-finite) advances the schedule but not the updates: the first update
// after it is a first update (bias correction t = 1), bitwise; t counted the skipped step (2)
// and shrank it to 0.73 of one.
TEST(AdamWUpdate, TheBiasCorrectionCountsUpdatesNotSkippedSteps) {
  const OptimConfig oc{.lr = 1e-2f, .warmup = 0, .weight_decay = 0.0f};
  const std::vector<ParamTensor> tensors = {{.name = "w", .offset = 0, .size = 3, .shape = {3}, .decay = false}};
  const std::vector<float> grads = {0.5f, -1.0f, 2.0f};
  std::vector<float> fresh = {1.0f, 2.0f, 3.0f}, after_skip = fresh;
  AdamW a{.m = std::vector<float>(3), .v = std::vector<float>(3), .step = 0, .skipped = 0};
  AdamW b{.m = std::vector<float>(3), .v = std::vector<float>(3), .step = 1, .skipped = 1};
  adamw_update(oc, tensors, fresh, grads, 1.0, a);
  adamw_update(oc, tensors, after_skip, grads, 1.0, b);
  EXPECT_EQ(after_skip, fresh);
  EXPECT_EQ(b.step, 2);
  EXPECT_NEAR(fresh[0], 1.0f - 1e-2f, 1e-6f);  // the first update moves each weight by about lr
}

}  // namespace cpattn::train
