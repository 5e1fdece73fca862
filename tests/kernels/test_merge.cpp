// Partial softmax merge (docs/design.md 6): merging attention over key parts equals attention over
// all keys; empty parts (-inf) carry no weight and never make NaN.
#include <cpattn/check/compare.hpp>
#include <cpattn/check/problem.hpp>

#include <cpattn/attention.hpp>

#include <cpattn/error.hpp>
#include <cpattn/merge.hpp>

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

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

}  // namespace
}  // namespace cpattn::testing
