// The checking library itself (check/): tensors round through their dtype, the comparison
// and its pass rule, and reproducible batches.
#include <cpattn/check/batch.hpp>
#include <cpattn/check/compare.hpp>
#include <cpattn/check/tensor.hpp>
#include <cpattn/check/tolerance.hpp>

#include <cpattn/layout.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace cpattn::check {
namespace {

TEST(check_tensor, ValuesAreTheStoredOnes) {
  for (DType t : {DType::f32, DType::f16, DType::bf16}) {
    Tensor x(t, {2, 1, 3});
    x.set(0, 0.1f);
    x.set(5, -3.3f);
    EXPECT_EQ(x.f[0], round_to_dtype(t, 0.1f));
    EXPECT_EQ(x.values(), x.f);
    EXPECT_EQ(x.view().rows, 2);
    EXPECT_EQ(x.view().dtype, t);
    EXPECT_EQ(x.as(DType::f32).f, x.f);  // exact in fp32
  }
}

TEST(check_compare, PassRulePerDtypeAndWorstRow) {
  const std::vector<float> ref{1.0f, 2.0f, 3.0f, 4.0f};
  std::vector<float> got = ref;
  got[3] += 0.03f;  // row 1 of 2-element rows
  const TensorReport f32 = compare("x", got, ref, DType::f32, 2);
  EXPECT_FALSE(f32.pass);
  EXPECT_EQ(f32.worst_row, 1);
  EXPECT_NEAR(f32.max_abs, 0.03, 1e-6);
  EXPECT_NEAR(f32.max_rel, 0.03 / 4.0, 1e-6);
  EXPECT_TRUE(compare("x", got, ref, DType::bf16, 2).pass);   // 0.03 <= 2.5e-2 + 2.5e-2 * 4
  EXPECT_FALSE(compare("x", got, ref, DType::f16, 2).pass);   // 0.03 > 5e-3 + 5e-3 * 4
  EXPECT_TRUE(compare("x", ref, ref, DType::f32).pass);
  got[0] = std::numeric_limits<float>::quiet_NaN();
  const TensorReport nan = compare("x", got, ref, DType::bf16, 2);
  EXPECT_FALSE(nan.pass);
  EXPECT_FALSE(nan.finite);
  EXPECT_EQ(nan.worst_row, 0);
  EXPECT_NE(nan.describe().find("x (bf16): FAIL"), std::string::npos) << nan.describe();
}

// Half dtypes also bound the relative L2 error: gradients of a loss averaged over tokens sit
// below atol everywhere, where zeros (or a sign flip) passed |diff| <= atol + rtol |ref|.
TEST(check_compare, SmallReferencesAreHeldToTheRelativeError) {
  std::vector<float> ref(64);
  for (std::size_t i = 0; i < ref.size(); ++i) ref[i] = 3e-4f * static_cast<float>(static_cast<int>(i % 7) - 3);
  const std::vector<float> zeros(ref.size(), 0.0f);
  std::vector<float> flipped(ref), close(ref);
  for (float& x : flipped) x = -x;
  for (float& x : close) x *= 1.001f;
  for (const DType t : {DType::f16, DType::bf16}) {
    EXPECT_FALSE(compare("dk", zeros, ref, t).pass) << to_string(t);
    EXPECT_FALSE(compare("dk", flipped, ref, t).pass) << to_string(t);
    EXPECT_TRUE(compare("dk", close, ref, t).pass) << to_string(t);
  }
  // allclose_excess: a NaN is not close (std::max dropped it: -1e300, "close")
  EXPECT_GT(allclose_excess(std::vector<float>{std::numeric_limits<float>::quiet_NaN()}, std::vector<float>{1.0f},
                            0.0, 0.0),
            0.0);
}

// lse is fp32 whatever the storage: a CP run's lse 1e-3 off (an lse rounded through fp16 at 9
// is 4e-3 off) fails in every dtype (fp16/bf16 allowed 1e-2).
TEST(check_compare, LseIsHeldToTheFp32BoundInEveryDtype) {
  const std::vector<float> ref{9.0f, -2.5f, 0.75f};
  std::vector<float> off(ref);
  off[1] += 1e-3f;
  // One fp32 ulp at lse 200 (1.5e-5, past the absolute 1e-5) is rounding, not an error.
  const std::vector<float> big{200.0f}, big_ulp{std::nextafter(200.0f, 300.0f)};
  for (const DType t : {DType::f32, DType::f16, DType::bf16}) {
    EXPECT_TRUE(compare_lse(ref, ref, t, 1).pass) << to_string(t);
    EXPECT_FALSE(compare_lse(off, ref, t, 1).pass) << to_string(t);
    EXPECT_TRUE(compare_lse(big_ulp, big, t, 1).pass) << to_string(t);
  }
}

TEST(check_compare, ExactInfinitiesAreSkipped) {
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> ref{-inf, 1.0f}, got{-inf, 1.0f};
  EXPECT_TRUE(compare_lse(got, ref, DType::f32, 1).pass);  // a row that saw no key: lse -inf on both sides
  EXPECT_EQ(rel_norm_error(got, ref), 0.0);
  EXPECT_LE(allclose_excess(got, ref, 0.0, 0.0), 0.0);
  EXPECT_FALSE(compare_lse(std::vector<float>{0.0f, 1.0f}, ref, DType::f32, 1).pass);
  // Elsewhere an infinity is an overflow even where the reference overflows the same way (a
  // CP run and one process alike): not finite, not a pass.
  const std::vector<float> both{inf, 1.0f};
  const TensorReport r = compare("dv", both, both, DType::f16);
  EXPECT_FALSE(r.finite);
  EXPECT_FALSE(r.pass);
}

TEST(check_tolerance, TheTable) {
  EXPECT_EQ(tolerance(DType::f32).rel_norm, 1e-5);
  EXPECT_EQ(tolerance(DType::f16).atol, 5e-3);
  EXPECT_EQ(tolerance(DType::f16).rtol, 5e-3);
  EXPECT_EQ(tolerance(DType::bf16).atol, 2.5e-2);
  EXPECT_EQ(tolerance(DType::bf16).naive_factor, 2.0);
  EXPECT_EQ(kLseRelNorm, 1e-5);
}

TEST(check_batch, RandomBatchIsOneReproducibleStream) {
  const std::vector<int64_t> cu = cu_seqlens_from_lengths(std::vector<int64_t>{5, 3});
  const BatchShape s{.heads_q = 2, .heads_k = 1, .head_dim_qk = 4, .head_dim_v = 3};
  const Batch a = random_batch(cu, s, DType::bf16, 7), b = random_batch(cu, s, DType::bf16, 7);
  EXPECT_EQ(a.q.f, b.q.f);
  EXPECT_EQ(a.dout.f, b.dout.f);
  EXPECT_EQ(a.v.shape.dim, 3);
  EXPECT_EQ(a.dout.shape.heads, 2);
  // q, then k from the same stream, each with a fresh distribution
  std::mt19937_64 rng(7);
  const Tensor q = random_tensor(DType::bf16, a.q_shape(), rng), k = random_tensor(DType::bf16, a.k_shape(), rng);
  EXPECT_EQ(q.f, a.q.f);
  EXPECT_EQ(k.f, a.k.f);
  EXPECT_NE(random_batch(cu, s, DType::bf16, 8).q.f, a.q.f);
  const std::vector<int64_t> mix = document_mix(1000, 3);
  int64_t total = 0;
  for (int64_t l : mix) total += l;
  EXPECT_EQ(total, 1000);
  // (cpattn run's memory estimate sizes the longest document's buffers by this bound)
  const std::vector<int64_t> big = document_mix(200000, 5);
  EXPECT_LE(std::ranges::max(big), kDocumentMixLongest);
  EXPECT_GE(std::ranges::min(big), 1);
}

TEST(check_batch, LocalRowsAndPadding) {
  const std::vector<int64_t> cu = cu_seqlens_from_lengths(std::vector<int64_t>{5, 3});
  const Batch b = random_batch(cu, {.heads_q = 1, .heads_k = 1, .head_dim_qk = 2, .head_dim_v = 2},
                               DType::f16, 1);
  const RankPlan p = get_thd_load_balanced_cp_metadata(cu, 2, 0);
  Tensor l = local_rows(b.q, p);
  ASSERT_EQ(l.shape.rows, p.local_tokens);
  EXPECT_EQ(nonzero_padding_rows(l.view(), p), 0);
  for (int64_t i = 0; i < p.local_tokens; ++i) {
    if (p.real_token_index[i] >= 0) {
      EXPECT_EQ(l.f[i * 2], b.q.f[p.real_token_index[i] * 2]);
    } else {
      l.set(static_cast<std::size_t>(i * 2), 1.0f);
      EXPECT_EQ(nonzero_padding_rows(l.view(), p), 1);
      break;
    }
  }
}

}  // namespace
}  // namespace cpattn::check
