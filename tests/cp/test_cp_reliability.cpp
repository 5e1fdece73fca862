// CP attention's honesty checks at cp = 3 (tests/cp/CMakeLists.txt): check_finite names the
// tensor and the first bad element by global token, head and dim; the memory estimate bounds
// what the layer holds (and counts a rank's share of the packed K/V over shared memory), and a
// request past the available memory is refused on every rank with both sizes; 200
// forward/backward calls over changing batches keep RSS flat and the plan cache bounded (the
// short soak; bench/soak.py is the long one). Also the MPI-free helpers behind them
// (first_overflow, format_bytes, check_memory).
#include <cpattn/attention.hpp>
#include <cpattn/check/batch.hpp>
#include <cpattn/check/tensor.hpp>
#include <cpattn/comm.hpp>
#include <cpattn/cp.hpp>
#include <cpattn/dtype.hpp>
#include <cpattn/error.hpp>
#include <cpattn/layout.hpp>
#include <cpattn/memory.hpp>
#include <cpattn/plan.hpp>
#include <cpattn/tensor.hpp>

#include "error_of.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <limits>
#include <string>
#include <vector>

namespace cpattn {
namespace {

using ::testing::HasSubstr;

constexpr check::BatchShape kShape{.heads_q = 4, .heads_k = 2, .head_dim_qk = 16, .head_dim_v = 8};

using cpattn::testing::error_of;

// One rank's tensors of a batch (the inputs under `plan`, the outputs zero).
struct Local {
  RankPlan plan;
  check::Tensor q, k, v, dout, out, dq, dk, dv;
  Local(const check::Batch& b, int cp, int rank, CpSplit split = CpSplit::padded)
      : plan(get_thd_load_balanced_cp_metadata(b.cu_seqlens, cp, rank, PlanOptions{.split = split})),
        q(check::local_rows(b.q, plan)), k(check::local_rows(b.k, plan)), v(check::local_rows(b.v, plan)),
        dout(check::local_rows(b.dout, plan)), out(b.dtype, {plan.local_tokens, b.shape.heads_q, b.shape.head_dim_v}),
        dq(b.dtype, q.shape), dk(b.dtype, k.shape), dv(b.dtype, v.shape) {}
  CpForwardArgs fwd(std::span<const int64_t> cu) { return {.cu_seqlens = cu, .q = q.view(), .k = k.view(), .v = v.view(), .out = out.view()}; }
  CpBackwardArgs bwd() {
    return {.q = q.view(), .out = out.view(), .dout = dout.view(), .dq = dq.view(), .dk = dk.view(), .dv = dv.view()};
  }
};

CpAttnConfig config(bool check_finite = false, CpScheme scheme = CpScheme::allgather, KvMode mode = KvMode::runs,
                    DType dtype = DType::f32) {
  return {.num_heads_q = kShape.heads_q, .num_heads_k = kShape.heads_k, .head_dim_qk = kShape.head_dim_qk,
          .head_dim_v = kShape.head_dim_v, .dtype = dtype, .kv_mode = mode, .check_finite = check_finite, .scheme = scheme};
}

class CpReliabilityTest : public ::testing::Test {
 protected:
  Communicator comm{MPI_COMM_WORLD, CommOptions{.timeout_s = 120.0}};
};

TEST_F(CpReliabilityTest, ANanQueryIsNamedByTokenHeadAndDimOnEveryRank) {
  // A 1-token document first; the NaN sits in document 1 (global token 5).
  check::Batch b = check::random_batch({0, 1, 11, 18}, kShape, DType::bf16, 3);
  b.q.set(static_cast<std::size_t>((5 * kShape.heads_q + 2) * kShape.head_dim_qk + 3), NAN);
  Local l(b, comm.size(), comm.rank());
  CpAttention attn(comm, config(true, CpScheme::allgather, KvMode::runs, DType::bf16));
  EXPECT_THAT(error_of([&] { (void)attn.forward(l.fwd(b.cu_seqlens)); }),
              HasSubstr("q holds nan at token 5, head 2, dim 3"));
}

TEST_F(CpReliabilityTest, EverySchemeAndTheSplitNameTheBadElement) {
  // 6 / 3 heads: the a2a group of 3 ranks splits them. The inf sits in k of document 2 (global
  // token 30), the NaN in dout of the 1-token document (global token 0).
  constexpr check::BatchShape shape{.heads_q = 6, .heads_k = 3, .head_dim_qk = 5, .head_dim_v = 3};
  const struct {
    CpScheme scheme;
    CpSplit split;
  } cases[] = {{CpScheme::ring, CpSplit::padded},   {CpScheme::pass_q, CpSplit::padded},
               {CpScheme::a2a, CpSplit::padded},    {CpScheme::hybrid, CpSplit::padded},
               {CpScheme::allgather, CpSplit::padding_free}};
  for (const auto& c : cases) {
    SCOPED_TRACE(std::string(to_string(c.scheme)) + " " + std::string(to_string(c.split)));
    check::Batch b = check::random_batch({0, 1, 12, 40}, shape, DType::f32, 8);
    b.k.set(static_cast<std::size_t>((30 * shape.heads_k + 2) * shape.head_dim_qk + 4), INFINITY);
    b.dout.set(static_cast<std::size_t>((0 * shape.heads_q + 5) * shape.head_dim_v + 1), NAN);
    Local l(b, comm.size(), comm.rank(), c.split);
    CpAttention attn(comm, {.num_heads_q = shape.heads_q, .num_heads_k = shape.heads_k,
                            .head_dim_qk = shape.head_dim_qk, .head_dim_v = shape.head_dim_v, .check_finite = true,
                            .scheme = c.scheme, .cp_inner = c.scheme == CpScheme::hybrid ? 1 : 0, .split = c.split});
    EXPECT_THAT(error_of([&] { (void)attn.forward(l.fwd(b.cu_seqlens)); }),
                HasSubstr("k holds inf at token 30, head 2, dim 4"));
    b.k.set(static_cast<std::size_t>((30 * shape.heads_k + 2) * shape.head_dim_qk + 4), 0.5f);
    Local fixed(b, comm.size(), comm.rank(), c.split);
    CpContext ctx = attn.forward(fixed.fwd(b.cu_seqlens));
    EXPECT_THAT(error_of([&] { attn.backward(ctx, fixed.bwd()); }), HasSubstr("dout holds nan at token 0, head 5, dim 1"));
  }
}

TEST_F(CpReliabilityTest, AnInfiniteGradientIsNamedInBackward) {
  check::Batch b = check::random_batch({0, 1, 11, 18}, kShape, DType::f32, 4);
  b.dout.set(static_cast<std::size_t>((17 * kShape.heads_q + 1) * kShape.head_dim_v + 7), -INFINITY);
  Local l(b, comm.size(), comm.rank());
  CpAttention attn(comm, config(true));
  CpContext ctx = attn.forward(l.fwd(b.cu_seqlens));
  EXPECT_THAT(error_of([&] { attn.backward(ctx, l.bwd()); }), HasSubstr("dout holds -inf at token 17, head 1, dim 7"));
}

// Over shared memory a rank counts its 1/cp of the kernels' packed K/V (KvPackShare), rounded
// up, where its path and dtype pack with the peers, and nothing where they pack alone: bf16 on
// the portable path (KvPackLayout::fp32) against bf16 on the emulated dot products (alone),
// whose dK/dV slots and every other buffer are the same. On the message path neither shares.
TEST(CpMemoryEstimate, OverSharedMemoryARankCountsItsShareOfThePackedKv) {
  for (const int cp : {2, 3, 4})
    for (const int64_t local : {int64_t{1}, int64_t{37}, int64_t{4096}}) {
      SCOPED_TRACE(::testing::Message() << "cp " << cp << ", " << local << " local tokens");
      CpAttnConfig cfg{.num_heads_q = 8, .num_heads_k = 2, .head_dim_qk = 72, .head_dim_v = 40, .dtype = DType::bf16};
      auto buffers = [&](KernelPath path, bool shared) {
        cfg.options.path = path;
        cfg.shared_memory = shared;
        return cp_memory_estimate(cfg, cp, local).buffers;
      };
      ASSERT_EQ(attention_kv_pack_layout(KernelPath::bf16_emulated, DType::bf16), KvPackLayout::alone);
      ASSERT_EQ(attention_kv_pack_layout(KernelPath::portable, DType::bf16), KvPackLayout::fp32);
      const uint64_t whole = attention_kv_pack_bytes(cp * local, 2, 72, 40, KvPackLayout::fp32);
      EXPECT_EQ(buffers(KernelPath::portable, true) - buffers(KernelPath::bf16_emulated, true),
                (whole + static_cast<uint64_t>(cp) - 1) / static_cast<uint64_t>(cp));
      EXPECT_EQ(buffers(KernelPath::portable, false), buffers(KernelPath::bf16_emulated, false));
    }
}

TEST_F(CpReliabilityTest, TheEstimateBoundsWhatEverySchemeHolds) {
  // 6 query and 3 KV heads of odd dims: the a2a group of the 3 ranks splits them (2 and 1 per
  // rank); hybrid at cp_inner 1 runs a ring over the 3 ranks behind its all-to-all level. And
  // MHA (one head set: no slack in the shared backward's slot) for the all-gather over shared
  // memory, whose ranks each hold a share of the kernels' packed K/V (fp32 panels, bf16 pairs).
  constexpr check::BatchShape gqa{.heads_q = 6, .heads_k = 3, .head_dim_qk = 13, .head_dim_v = 7};
  constexpr check::BatchShape mha{.heads_q = 3, .heads_k = 3, .head_dim_qk = 13, .head_dim_v = 7};
  const struct {
    CpScheme scheme;
    KvMode mode;
    CpSplit split;
    DType dtype;
    check::BatchShape shape = gqa;
  } cases[] = {{CpScheme::allgather, KvMode::runs, CpSplit::padded, DType::f32},
               {CpScheme::allgather, KvMode::index, CpSplit::padded, DType::f32},
               {CpScheme::allgather, KvMode::runs, CpSplit::padding_free, DType::f32},
               {CpScheme::allgather, KvMode::index, CpSplit::padding_free, DType::bf16},
               {CpScheme::allgather, KvMode::runs, CpSplit::padded, DType::f32, mha},
               {CpScheme::allgather, KvMode::runs, CpSplit::padded, DType::bf16, mha},
               {CpScheme::ring, KvMode::runs, CpSplit::padded, DType::f32},
               {CpScheme::pass_q, KvMode::runs, CpSplit::padded, DType::f32},
               {CpScheme::pass_q, KvMode::runs, CpSplit::padded, DType::bf16},
               {CpScheme::a2a, KvMode::runs, CpSplit::padded, DType::f32},
               {CpScheme::a2a, KvMode::index, CpSplit::padded, DType::bf16},
               {CpScheme::hybrid, KvMode::runs, CpSplit::padded, DType::f32}};
  for (const auto& c : cases) {
    const check::BatchShape& shape = c.shape;
    SCOPED_TRACE(std::string(to_string(c.scheme)) + (c.mode == KvMode::index ? " index" : " runs") +
                 (c.split == CpSplit::padded ? " padded " : " padding-free ") + std::string(to_string(c.dtype)) +
                 (shape.heads_q == shape.heads_k ? " MHA" : " GQA"));
    const check::Batch b = check::random_batch({0, 1, 37, 38, 138, 161}, shape, c.dtype, 5);
    Local l(b, comm.size(), comm.rank(), c.split);
    CpAttnConfig cfg{.num_heads_q = shape.heads_q, .num_heads_k = shape.heads_k, .head_dim_qk = shape.head_dim_qk,
                     .head_dim_v = shape.head_dim_v, .dtype = c.dtype, .kv_mode = c.mode, .scheme = c.scheme,
                     .cp_inner = c.scheme == CpScheme::hybrid ? 1 : 0, .hybrid_outer = CpScheme::ring, .split = c.split};
    CpAttention attn(comm, cfg);
    CpContext ctx = attn.forward(l.fwd(b.cu_seqlens));
    const CpMemoryEstimate e = cp_memory_estimate(attn.config(), ctx.plan());
    EXPECT_LE(ctx.bytes(), e.context);
    attn.backward(ctx, l.bwd());
    const uint64_t held = attn.stats().peak_buffer_bytes;
    EXPECT_LE(held, e.context + e.buffers);
    EXPECT_GE(held, (e.context + e.buffers) / 3) << "an estimate far above what is used refuses good requests";
    EXPECT_GT(e.kernel_scratch, 0u);
    if (c.split == CpSplit::padding_free) continue;  // its ranks' local counts differ: no early form
    // Before a plan: the same but for the kernel's per-thread blocks.
    const CpMemoryEstimate early = cp_memory_estimate(attn.config(), comm.size(), l.plan.local_tokens);
    EXPECT_EQ(early.context, e.context);
    EXPECT_EQ(early.buffers, e.buffers);
    EXPECT_LE(early.kernel_scratch, e.kernel_scratch);
  }
}

TEST_F(CpReliabilityTest, ARequestPastTheAvailableMemoryIsRefusedWithBothSizes) {
  const check::Batch b = check::random_batch({0, 37, 38, 138}, kShape, DType::f32, 6);
  Local l(b, comm.size(), comm.rank());
  CpAttention attn(comm, config());
  ::setenv("CPATTN_MEMORY_LIMIT_BYTES", "1000", 1);
  const std::string m = error_of([&] { (void)attn.forward(l.fwd(b.cu_seqlens)); });
  ::unsetenv("CPATTN_MEMORY_LIMIT_BYTES");
  const CpMemoryEstimate e = cp_memory_estimate(attn.config(), l.plan);
  EXPECT_THAT(m, HasSubstr("needs " + format_bytes(e.total()) + " (" + e.describe() + ")"));
  EXPECT_THAT(m, HasSubstr("more than the 1000 B available (CPATTN_MEMORY_LIMIT_BYTES)"));
  EXPECT_THAT(m, HasSubstr("[ranks 0-2]"));  // every rank refused, before any payload moved
  // With the limit gone the same layer runs (the refusal left it usable).
  CpContext ctx = attn.forward(l.fwd(b.cu_seqlens));
  attn.backward(ctx, l.bwd());
}

// Resident set size, bytes (/proc/self/statm's second field, in pages).
uint64_t rss_bytes() {
  std::ifstream in("/proc/self/statm");
  uint64_t size = 0, resident = 0;
  in >> size >> resident;
  return resident * static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
}

// The a2a and hybrid schemes count their outer layer's kernel blocks, which need its plan's
// longest task (they were estimated without a work list: ~168 MB per thread missing for one
// 32K document at head dim 128). a2a at cp = 3 runs its outer layer as one process over a third
// of the heads, on the whole documents; hybrid at cp_inner = 1 is a ring over the same plan.
TEST(CpMemoryEstimate, TheAllToAllSchemesCountTheOuterLayersKernelBlocks) {
  const std::vector<int64_t> cu{0, 6, 4806};  // multiples of 2 cp: no padding at cp = 3
  const RankPlan plan = get_thd_load_balanced_cp_metadata(cu, 3, 1);
  const RankPlan whole = get_thd_load_balanced_cp_metadata(cu, 1, 0);
  CpAttnConfig cfg{.num_heads_q = 6, .num_heads_k = 3, .head_dim_qk = 128, .head_dim_v = 128, .dtype = DType::bf16,
                   .scheme = CpScheme::a2a};
  const AttnBwdParams outer{
      .in = {.q = {nullptr, whole.local_tokens, 2, 128, DType::bf16},
             .k = {nullptr, whole.local_tokens, 1, 128, DType::bf16},
             .v = {nullptr, whole.local_tokens, 1, 128, DType::bf16},
             .work = &whole.work,
             .options = cfg.options}};
  EXPECT_GE(cp_memory_estimate(cfg, plan).kernel_scratch, attention_backward_scratch_bytes(outer));
  cfg.scheme = CpScheme::hybrid;
  cfg.cp_inner = 1;
  cfg.hybrid_outer = CpScheme::ring;
  CpAttnConfig ring = cfg;
  ring.scheme = CpScheme::ring;
  EXPECT_GE(cp_memory_estimate(cfg, plan).kernel_scratch, cp_memory_estimate(ring, plan).kernel_scratch);
}

// One rank short of memory fails every rank at the agreement, the outer layer's share counted:
// with the limit just under the estimate on rank 1 alone, the a2a and hybrid layers refuse on
// every rank, naming it (the outer layer's own check, agreed over its group only, could fail
// there alone and leave the other members in the all-to-all until the deadline).
TEST_F(CpReliabilityTest, TheAllToAllSchemesRefuseOnEveryRankWhenOneLacksMemory) {
  constexpr check::BatchShape shape{.heads_q = 6, .heads_k = 3, .head_dim_qk = 64, .head_dim_v = 64};
  const check::Batch b = check::random_batch({0, 5, 1805}, shape, DType::f32, 12);
  for (const CpScheme scheme : {CpScheme::a2a, CpScheme::hybrid}) {
    SCOPED_TRACE(to_string(scheme));
    Local l(b, comm.size(), comm.rank());
    CpAttention attn(comm, {.num_heads_q = shape.heads_q, .num_heads_k = shape.heads_k,
                            .head_dim_qk = shape.head_dim_qk, .head_dim_v = shape.head_dim_v, .scheme = scheme,
                            .cp_inner = scheme == CpScheme::hybrid ? 1 : 0});
    const CpMemoryEstimate e = cp_memory_estimate(attn.config(), l.plan);
    if (comm.rank() == 1) ::setenv("CPATTN_MEMORY_LIMIT_BYTES", std::to_string(e.total() - 1).c_str(), 1);
    const std::string m = error_of([&] { (void)attn.forward(l.fwd(b.cu_seqlens)); });
    ::unsetenv("CPATTN_MEMORY_LIMIT_BYTES");
    EXPECT_THAT(m, HasSubstr("[rank 1]"));
    EXPECT_THAT(m, HasSubstr("needs " + format_bytes(e.total())));
    CpContext ctx = attn.forward(l.fwd(b.cu_seqlens));  // the refusal left the layer usable
    attn.backward(ctx, l.bwd());
  }
}

TEST_F(CpReliabilityTest, TwoHundredCallsOverChangingBatchesKeepMemoryFlat) {
  // 12 batch layouts in turn (more than the plan cache's 8): every call after the first round
  // replans some, evicting others.
  std::vector<check::Batch> batches;
  for (int i = 0; i < 12; ++i)
    batches.push_back(check::random_batch({0, 1, 20 + i, 45 + 2 * i}, kShape, DType::bf16, 10 + static_cast<uint64_t>(i)));
  std::vector<Local> locals;
  for (const check::Batch& b : batches) locals.emplace_back(b, comm.size(), comm.rank());
  CpAttention attn(comm, config(false, CpScheme::allgather, KvMode::runs, DType::bf16));
  uint64_t warm = 0;
  for (int call = 0; call < 200; ++call) {
    const std::size_t i = static_cast<std::size_t>(call) % batches.size();
    CpContext ctx = attn.forward(locals[i].fwd(batches[i].cu_seqlens));
    attn.backward(ctx, locals[i].bwd());
    if (call == 47) warm = rss_bytes();  // after four rounds: every buffer at its largest
  }
  EXPECT_LE(attn.plan_cache().size(), attn.config().plan_cache_capacity);
  EXPECT_EQ(attn.stats().forward_calls, 200);
#if !defined(__SANITIZE_ADDRESS__)  // ASan's quarantine grows RSS by design; LSan checks leaks there
  EXPECT_LE(rss_bytes(), warm + (uint64_t{2} << 20)) << "RSS grew past 2 MiB over 152 calls";
#else
  (void)warm;
#endif
}

TEST(Honesty, OverflowOnConversionIsFoundAtItsIndex) {
  const float x[] = {1.0f, 65504.0f, -65519.0f, 65520.0f, INFINITY};
  EXPECT_EQ(first_overflow(x, 5, DType::f16), std::optional<std::size_t>(3));  // 65519 still rounds to 65504
  EXPECT_EQ(first_overflow(x, 5, DType::bf16), std::nullopt);
  EXPECT_EQ(first_overflow(x, 5, DType::f32), std::nullopt);
  const float big[] = {3.0e38f, 3.4e38f};
  EXPECT_EQ(first_overflow(big, 2, DType::bf16), std::optional<std::size_t>(1));
}

TEST(Honesty, FirstNonfiniteWalksRowsHeadsDimsOfAStridedView) {
  std::vector<float> buf(3 * 4 * 2, 0.0f);
  buf[(2 * 4 + 3) * 2 + 1] = NAN;  // row 2, head 3, dim 1: outside the view's heads 0..1
  buf[(1 * 4 + 1) * 2 + 0] = INFINITY;
  const ConstTensorView v{buf.data(), 3, 2, 2, DType::f32, 8, 0};
  const std::optional<ElementIndex> at = first_nonfinite(v);
  ASSERT_TRUE(at.has_value());
  EXPECT_EQ(at->row, 1);
  EXPECT_EQ(at->head, 1);
  EXPECT_EQ(at->dim, 0);
  buf[(1 * 4 + 1) * 2 + 0] = 0;
  EXPECT_FALSE(first_nonfinite(v).has_value());
}

TEST(Honesty, MemoryChecksNameBothSizes) {
  EXPECT_EQ(format_bytes(17), "17 B");
  EXPECT_EQ(format_bytes(3 << 20), "3.0 MiB");
  EXPECT_EQ(saturating_mul(uint64_t{1} << 40, uint64_t{1} << 40), std::numeric_limits<uint64_t>::max());
  const AvailableMemory small{.bytes = 1024, .source = "a test"};
  EXPECT_NO_THROW(check_memory(1024, "x", "y", small));
  EXPECT_THAT(error_of([&] { check_memory(2048, "the job", "all of it", small); }),
              HasSubstr("the job needs 2.0 KiB (all of it), more than the 1.0 KiB available (a test)"));
  const AvailableMemory here = available_memory();
  EXPECT_GT(here.bytes, 0u);
  EXPECT_FALSE(here.source.empty());
}

}  // namespace
}  // namespace cpattn
