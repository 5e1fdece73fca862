// Partial softmax merge (docs/design.md 6): merging attention over key parts equals attention over
// all keys; empty parts (-inf) carry no weight and never make NaN.
#include <cpattn/check/compare.hpp>
#include <cpattn/check/problem.hpp>

#include <cpattn/attention.hpp>

#include <cpattn/error.hpp>
#include <cpattn/merge.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

namespace cpattn::testing {
namespace {

using namespace cpattn::check;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

TEST(kernel_merge, WeightsGuardEmptyParts) {
  std::vector<float> w(3);
  const float lse = merge_weights(std::vector<float>{kNegInf, 0.0f, kNegInf}, w);
  EXPECT_EQ(lse, 0.0f);
  EXPECT_EQ(w[0], 0.0f);
  EXPECT_EQ(w[1], 1.0f);
  EXPECT_EQ(w[2], 0.0f);
  const float none = merge_weights(std::vector<float>{kNegInf, kNegInf}, std::span(w).first(2));
  EXPECT_EQ(none, kNegInf);
  EXPECT_EQ(w[0], 0.0f);
  EXPECT_EQ(w[1], 0.0f);
  // log(e^1 + e^1) = 1 + log 2, weights 1/2
  const float two = merge_weights(std::vector<float>{1.0f, 1.0f}, std::span(w).first(2));
  EXPECT_NEAR(two, 1.0f + std::log(2.0f), 1e-6);
  EXPECT_NEAR(w[0], 0.5f, 1e-7);
}

// A NaN lse (a part computed from NaN inputs) makes the merge NaN, beside empty parts too
// (fmax skipped it: alone or beside empty parts it read as empty, lse -inf and out 0), as the
// kernels' accumulate mode does.
TEST(kernel_merge, ANanPartIsNanEvenBesideEmptyOnes) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (const std::vector<float>& lse_parts : {std::vector<float>{nan}, std::vector<float>{nan, kNegInf},
                                              std::vector<float>{kNegInf, nan}, std::vector<float>{0.5f, nan}}) {
    SCOPED_TRACE(::testing::Message() << lse_parts.size() << " parts");
    std::vector<float> w(lse_parts.size());
    EXPECT_TRUE(std::isnan(merge_weights(lse_parts, w)));
    std::vector<std::vector<float>> outs(lse_parts.size(), std::vector<float>{1.0f, 2.0f});
    std::vector<const float*> out_ptrs, lse_ptrs;
    for (std::size_t a = 0; a < lse_parts.size(); ++a) {
      out_ptrs.push_back(outs[a].data());
      lse_ptrs.push_back(&lse_parts[a]);
    }
    float lse = 0.0f;
    std::vector<float> out(2, 0.0f);
    merge_partial_softmax({.num_parts = static_cast<int>(lse_parts.size()), .rows = 1, .num_heads = 1, .head_dim = 2,
                           .lse_parts = lse_ptrs.data(), .out_parts = out_ptrs.data(), .lse = &lse, .out = out.data()});
    EXPECT_TRUE(std::isnan(lse));
    EXPECT_TRUE(std::isnan(out[0]) && std::isnan(out[1]));
  }
}

TEST(kernel_merge, KeyPartsMergeToFullAttention) {
  // one document, no mask, keys split in three parts, the last part empty for task 0
  const AttnCase c{"merge", {40}, {90}, 2, 1, 32, 24, MaskType::none};
  const Problem pb(c, DType::f32, 17);
  auto part = [&](std::vector<KeyRun> runs) {
    WorkList w;
    w.runs = std::move(runs);
    w.tasks.push_back({.q_row = 0, .q_len = 40, .q_pos = 50, .doc = 0, .run_begin = 0,
                       .run_end = static_cast<int64_t>(w.runs.size())});
    Tensor out(DType::f32, pb.out_shape());
    std::vector<float> lse(pb.lse_size());
    attention_forward(pb.fwd(pb.q, pb.k, pb.v, out, lse.data(), KernelPath::automatic, 1, &w));
    return std::make_pair(out.f, lse);
  };
  const auto full = part({{.row = 0, .len = 90, .pos = 0}});
  const auto a = part({{.row = 0, .len = 30, .pos = 0}});
  const auto b = part({{.row = 30, .len = 60, .pos = 30}});
  auto e = part({});
  for (float& x : e.first) x = std::numeric_limits<float>::quiet_NaN();  // never read
  for (float x : e.second) ASSERT_EQ(x, kNegInf);
  const float* lses[] = {a.second.data(), b.second.data(), e.second.data()};
  const float* outs[] = {a.first.data(), b.first.data(), e.first.data()};
  std::vector<float> out(pb.out_size()), lse(pb.lse_size());
  merge_partial_softmax({.num_parts = 3, .rows = 40, .num_heads = 2, .head_dim = 24,
                         .lse_parts = lses, .out_parts = outs, .lse = lse.data(), .out = out.data()});
  EXPECT_LE(rel_norm_error(out, full.first), 1e-6);
  EXPECT_LE(rel_norm_error(lse, full.second), 1e-6);
}

TEST(kernel_merge, RejectsBadArguments) {
  MergeParams p;
  EXPECT_THROW(merge_partial_softmax(p), Error);
}


// ---- float64: the merge of a split key set against dense float64 attention ----------------

constexpr int kRows = 7, kHeads = 3, kDim = 5, kKeys = 23;
constexpr double kNegInf64 = -std::numeric_limits<double>::infinity();

// One part's (lse, out) in float64: [kRows, kHeads] and [kRows, kHeads, kDim].
struct Part64 {
  std::vector<double> lse, out;
};

struct Dense64 {
  std::vector<double> q, k, v;  // [kRows, kHeads, kDim], [kKeys, kHeads, kDim] x 2
  Dense64() {
    std::mt19937 rng(5);
    std::normal_distribution<double> d;
    for (auto* x : {&q, &k, &v}) {
      x->resize(static_cast<std::size_t>((x == &q ? kRows : kKeys) * kHeads * kDim));
      for (double& e : *x) e = 2.0 * d(rng);
    }
  }
  // Plain softmax attention of every row over keys [begin, end) (none: lse -inf, out NaN,
  // which a merge must never read).
  Part64 attend(int begin, int end) const {
    Part64 p{std::vector<double>(kRows * kHeads), std::vector<double>(kRows * kHeads * kDim)};
    for (int i = 0; i < kRows; ++i)
      for (int h = 0; h < kHeads; ++h) {
        const int rh = i * kHeads + h;
        std::vector<double> s;
        for (int j = begin; j < end; ++j) {
          double dot = 0;
          for (int e = 0; e < kDim; ++e) dot += q[rh * kDim + e] * k[(j * kHeads + h) * kDim + e];
          s.push_back(dot / std::sqrt(double{kDim}));
        }
        const double mx = s.empty() ? 0.0 : *std::max_element(s.begin(), s.end());
        double sum = 0;
        for (const double x : s) sum += std::exp(x - mx);
        p.lse[rh] = s.empty() ? kNegInf64 : mx + std::log(sum);
        for (int e = 0; e < kDim; ++e) {
          double o = s.empty() ? std::numeric_limits<double>::quiet_NaN() : 0.0;
          for (int j = begin; j < end; ++j) o += std::exp(s[j - begin] - mx) / sum * v[(j * kHeads + h) * kDim + e];
          p.out[rh * kDim + e] = o;
        }
      }
    return p;
  }
};

Part64 merged(const std::vector<const Part64*>& parts) {
  std::vector<const double*> lses, outs;
  for (const Part64* p : parts) lses.push_back(p->lse.data()), outs.push_back(p->out.data());
  Part64 m{std::vector<double>(kRows * kHeads), std::vector<double>(kRows * kHeads * kDim)};
  merge_partial_softmax(MergeParams64{.num_parts = static_cast<int>(parts.size()), .rows = kRows,
                                      .num_heads = kHeads, .head_dim = kDim, .lse_parts = lses.data(),
                                      .out_parts = outs.data(), .lse = m.lse.data(), .out = m.out.data()});
  return m;
}

double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(a[i] - b[i]));
  return m;
}

TEST(kernel_merge, Float64MergeOfSplitKeysEqualsDenseAttention) {
  const Dense64 d;
  const Part64 full = d.attend(0, kKeys);
  // Uneven parts, a 1-key part and an empty one anywhere in the list.
  const Part64 a = d.attend(0, 9), b = d.attend(9, 10), c = d.attend(10, kKeys), e = d.attend(4, 4);
  const Part64 m = merged({&a, &e, &b, &c});
  EXPECT_LE(max_abs_diff(m.out, full.out), 1e-10);
  EXPECT_LE(max_abs_diff(m.lse, full.lse), 1e-10);
}

TEST(kernel_merge, MergingIsAssociativeInAnyGrouping) {
  const Dense64 d;
  const Part64 a = d.attend(0, 6), b = d.attend(6, 15), c = d.attend(15, kKeys);
  const Part64 ab = merged({&a, &b}), bc = merged({&b, &c}), ca = merged({&c, &a});
  const Part64 flat = merged({&a, &b, &c});
  for (const Part64& g : {merged({&ab, &c}), merged({&a, &bc}), merged({&ca, &b}), merged({&c, &b, &a})}) {
    EXPECT_LE(max_abs_diff(g.out, flat.out), 1e-13);
    EXPECT_LE(max_abs_diff(g.lse, flat.lse), 1e-13);
  }
}

TEST(kernel_merge, EmptyPartsAreExactlyNeutralAndAllEmptyGivesZeroAndMinusInf) {
  const Dense64 d;
  const Part64 a = d.attend(2, 11), e = d.attend(0, 0);  // e: lse -inf, out NaN
  for (const Part64& m : {merged({&e, &a}), merged({&a, &e, &e})}) {
    EXPECT_EQ(m.out, a.out);  // weight exactly 1 for a, 0 for e: bitwise a
    EXPECT_EQ(m.lse, a.lse);
  }
  const Part64 none = merged({&e, &e, &e});
  for (const double x : none.lse) EXPECT_EQ(x, kNegInf64);
  for (const double x : none.out) EXPECT_EQ(x, 0.0);  // never NaN
  std::vector<double> w(2);
  EXPECT_EQ(merge_weights(std::vector<double>{kNegInf64, kNegInf64}, w), kNegInf64);
  EXPECT_EQ(w, std::vector<double>(2, 0.0));
}

TEST(kernel_merge, Fp32MergeIsAssociativeToRounding) {
  const Dense64 d;
  const Part64 parts64[] = {d.attend(0, 6), d.attend(6, 15), d.attend(15, kKeys)};
  std::vector<float> lse[3], out[3];
  for (int i = 0; i < 3; ++i) {
    lse[i].assign(parts64[i].lse.begin(), parts64[i].lse.end());
    out[i].assign(parts64[i].out.begin(), parts64[i].out.end());
  }
  const auto merge2 = [](const float* l0, const float* o0, const float* l1, const float* o1, std::vector<float>& l,
                         std::vector<float>& o) {
    l.resize(kRows * kHeads), o.resize(kRows * kHeads * kDim);
    const float* ls[] = {l0, l1};
    const float* os[] = {o0, o1};
    merge_partial_softmax({.num_parts = 2, .rows = kRows, .num_heads = kHeads, .head_dim = kDim, .lse_parts = ls,
                           .out_parts = os, .lse = l.data(), .out = o.data()});
  };
  std::vector<float> l_ab, o_ab, l_left, o_left, l_bc, o_bc, l_right, o_right;
  merge2(lse[0].data(), out[0].data(), lse[1].data(), out[1].data(), l_ab, o_ab);
  merge2(l_ab.data(), o_ab.data(), lse[2].data(), out[2].data(), l_left, o_left);
  merge2(lse[1].data(), out[1].data(), lse[2].data(), out[2].data(), l_bc, o_bc);
  merge2(lse[0].data(), out[0].data(), l_bc.data(), o_bc.data(), l_right, o_right);
  const Part64 full = d.attend(0, kKeys);
  for (std::size_t i = 0; i < o_left.size(); ++i) {
    EXPECT_NEAR(o_left[i], o_right[i], 1e-5);
    EXPECT_NEAR(o_left[i], full.out[i], 1e-5);
  }
  for (std::size_t i = 0; i < l_left.size(); ++i) EXPECT_NEAR(l_left[i], l_right[i], 1e-5);
}

}  // namespace
}  // namespace cpattn::testing
