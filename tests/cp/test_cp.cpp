// CP attention over MPI against a single-process run of the whole batch (docs/design.md 7), at
// the rank count mpiexec gives (CTest runs 1 to 5), and the agreement failures.
#include "cp_test_helpers.hpp"
#include "../error_of.hpp"

#include <cpattn/check/batch.hpp>
#include <cpattn/check/cases.hpp>
#include <cpattn/check/compare.hpp>
#include <cpattn/check/gather.hpp>
#include <cpattn/check/tensor.hpp>

#include <cpattn/comm.hpp>
#include <cpattn/cp.hpp>
#include <cpattn/dtype.hpp>
#include <cpattn/error.hpp>
#include <cpattn/layout.hpp>
#include <cpattn/plan.hpp>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace cpattn {
namespace {

using ::testing::HasSubstr;

TEST_F(CpAttentionTest, MatchesSingleProcessEveryShapeDtypeAndMode) {
  for (const Shape& s : kShapes)
    for (const DType t : {DType::f32, DType::f16, DType::bf16})
      for (const KvMode m : {KvMode::runs, KvMode::index}) {
        run_and_compare(comm, s, t, m);
        if (HasFailure()) return;
      }
}

TEST_F(CpAttentionTest, MatchesSingleProcessWithoutMask) {
  // Every query sees its whole document: each task reads all 2*cp chunks.
  for (const DType t : {DType::f32, DType::bf16})
    for (const KvMode m : {KvMode::runs, KvMode::index}) {
      run_and_compare(comm, kShapes[1], t, m, MaskType::none);
      if (HasFailure()) return;
    }
}

// FlashAttention's masks through CP (documents of 1..100 tokens over 2*cp chunks): windows
// smaller and larger than chunks and documents, with and without causal; soft cap; ALiBi.
TEST_F(CpAttentionTest, MatchesSingleProcessWithWindowSoftcapAlibi) {
  const Masks all[] = {{.left = 10}, {.left = 40}, {.left = 0}, {.left = 200},
                       {.softcap = 2.0f}, {.alibi = true}, {.left = 30, .softcap = 5.0f, .alibi = true}};
  for (const KvMode m : {KvMode::runs, KvMode::index})
    for (const Masks& mk : all) {
      run_and_compare(comm, kShapes[1], DType::f32, m, MaskType::causal, 0.0f, CpScheme::allgather, kLengths, mk);
      if (HasFailure()) return;
    }
  // The ring computes each visiting block's pairs with the same options and merges them.
  for (const Masks& mk : all) {
    run_and_compare(comm, kShapes[1], DType::f32, KvMode::runs, MaskType::causal, 0.0f, CpScheme::ring, kLengths, mk);
    if (HasFailure()) return;
  }
  const Masks none[] = {{.left = 15, .right = 15}, {.left = 30, .right = -1}, {.left = -1, .right = 3},
                        {.left = 20, .right = 5, .softcap = 3.0f, .alibi = true}};
  for (const Masks& mk : none) {
    run_and_compare(comm, kShapes[2], DType::f32, KvMode::runs, MaskType::none, 0.0f, CpScheme::allgather, kLengths, mk);
    run_and_compare(comm, kShapes[1], DType::bf16, KvMode::index, MaskType::none, 0.0f, CpScheme::allgather, kLengths, mk);
    run_and_compare(comm, kShapes[2], DType::bf16, KvMode::runs, MaskType::none, 0.0f, CpScheme::ring, kLengths, mk);
    if (HasFailure()) return;
  }
  run_and_compare(comm, kShapes[1], DType::f32, KvMode::runs, MaskType::causal, 0.2f, CpScheme::allgather, kLengths,
                  {.left = 25, .softcap = 4.0f});
}

// cp smaller than the world, as in data parallel x context parallel: the world split into
// CP groups of every size that divides it (at 4 ranks: 1, 2 and 4), each group exact.
TEST(CpGroups, EveryDivisorOfTheWorldSplitIntoGroupsMatchesSingleProcess) {
  Communicator world(MPI_COMM_WORLD, CommOptions{.timeout_s = 120.0});
  for (int cp = 1; cp <= world.size(); ++cp) {
    if (world.size() % cp != 0) continue;
    Communicator comm = world.split(world.rank() / cp, world.rank());
    ASSERT_EQ(comm.size(), cp);
    run_and_compare(comm, kShapes[1], DType::f32, KvMode::runs);
    run_and_compare(comm, kShapes[2], DType::bf16, KvMode::index);
  }
}

// One CpAttention serves every layer: two layers' forwards, then their backwards in reverse
// order (as autograd runs them), each equal to its own single-process run. The contexts hold
// each layer's gathered K/V; the layer copies no caller tensor.
TEST_F(CpAttentionTest, OneLayerObjectRunsTwoLayersForwardsThenBackwardsInReverse) {
  const Shape& s = kShapes[1];
  const DType t = DType::f32;
  const AttnOptions options{.path = best_kernel_path()};
  CpAttention attn(comm, {.num_heads_q = s.hq, .num_heads_k = s.hkv, .head_dim_qk = s.dqk, .head_dim_v = s.dv,
                          .dtype = t, .options = options});
  struct Layer {
    check::Batch b;
    check::Results want;
    check::Tensor q, k, v, dout, out, dq, dk, dv;
    CpContext ctx;
  };
  Layer layers[2];
  const auto plan = attn.plan(cu_seqlens_from_lengths(kLengths));  // lays the inputs out
  const RankPlan& p = *plan;
  for (int l = 0; l < 2; ++l) {
    Layer& L = layers[l];
    L.b = check::random_batch(cu_seqlens_from_lengths(kLengths), s.batch(), t, 100 * (l + 1));
    L.want = check::single_process(L.b, options);
    L.q = check::local_rows(L.b.q, p), L.k = check::local_rows(L.b.k, p), L.v = check::local_rows(L.b.v, p);
    L.dout = check::local_rows(L.b.dout, p);
    L.out = check::Tensor(t, {p.local_tokens, s.hq, s.dv});
    L.dq = check::Tensor(t, L.q.shape), L.dk = check::Tensor(t, L.k.shape), L.dv = check::Tensor(t, L.v.shape);
  }
  for (Layer& L : layers)
    L.ctx = attn.forward({.plan = plan, .q = L.q.view(), .k = L.k.view(), .v = L.v.view(), .out = L.out.view()});
  EXPECT_GT(layers[0].ctx.bytes(), 0u);
  EXPECT_EQ(&layers[0].ctx.plan(), &p);  // no second plan
  for (int l = 1; l >= 0; --l) {
    Layer& L = layers[l];
    attn.backward(L.ctx, {.q = L.q.view(), .out = L.out.view(), .dout = L.dout.view(), .dq = L.dq.view(),
                          .dk = L.dk.view(), .dv = L.dv.view()});
  }
  for (int l = 0; l < 2; ++l) {
    SCOPED_TRACE(::testing::Message() << "layer " << l);
    const Layer& L = layers[l];
    const struct {
      const char* name;
      const check::Tensor* got;
      const std::vector<float>* want;
    } tensors[] = {{"out", &L.out, &L.want.out}, {"dq", &L.dq, &L.want.dq}, {"dk", &L.dk, &L.want.dk},
                   {"dv", &L.dv, &L.want.dv}};
    for (const auto& x : tensors)
      expect_pass(check::compare(x.name, gather_global_rows(comm, p, x.got->view()), *x.want, t,
                                 x.got->shape.row_elements()));
  }
  EXPECT_EQ(attn.plan_cache().misses(), 1);  // planned once, for both layers
  EXPECT_EQ(attn.plan_cache().hits(), 0);    // the forwards took the plan, not the boundaries
}

// deterministic = true asks for the fixed-order ring reduce-scatter only where dK/dV are
// reduce-scattered over more than one rank (every all-gather configuration was refused with
// MPI's reduce-scatter before: cp = 1, a2a, the padding-free split).
TEST_F(CpAttentionTest, DeterministicNeedsTheRingReduceScatterOnlyWhereOneRuns) {
  Communicator mpi(MPI_COMM_WORLD, {.reduce_scatter_algorithm = CommAlgorithm::mpi});
  const int cp = mpi.size();
  SmallBatch b(cp, mpi.rank());
  const auto makes = [&](CpScheme scheme, CpSplit split, int inner = 0) {
    CpAttnConfig c = b.config();
    c.num_heads_q = c.num_heads_k = 4 * cp;  // (heads the all-to-all can split)
    c.scheme = scheme;
    c.split = split;
    c.cp_inner = inner;
    try {
      CpAttention attn(mpi, c);
      return std::string();
    } catch (const Error& e) {
      return e.message();
    }
  };
  const std::string refused = "deterministic CP attention needs the communicator's fixed-order ring reduce-scatter";
  EXPECT_EQ(makes(CpScheme::allgather, CpSplit::padded), cp > 1 ? refused : "");
  EXPECT_EQ(makes(CpScheme::allgather, CpSplit::padding_free), "");
  EXPECT_EQ(makes(CpScheme::ring, CpSplit::padded), "");
  EXPECT_EQ(makes(CpScheme::a2a, CpSplit::padded), "");
  EXPECT_EQ(makes(CpScheme::hybrid, CpSplit::padded, 1), cp > 1 ? refused : "");  // cp groups of one
  EXPECT_EQ(makes(CpScheme::hybrid, CpSplit::padded, cp), "");                   // one group
}

// gather_global_rows is the inverse of take_local_rows on the real tokens: exact.
TEST_F(CpAttentionTest, GatherGlobalRowsRestoresTheGlobalOrder) {
  const std::vector<int64_t> cu = cu_seqlens_from_lengths(kLengths);
  const RankPlan p = get_thd_load_balanced_cp_metadata(cu, comm.size(), comm.rank());
  const check::Tensor g = check::random_tensor(DType::bf16, {cu.back(), 3, 5}, 9);
  const check::Tensor l = check::local_rows(g, p);
  EXPECT_EQ(gather_global_rows(comm, p, l.view()), g.values());
  if (comm.size() == 1) return;
  // Another rank's plan, or another batch's of the same token count on one rank: every rank
  // fails naming it (wrong rows came back without a word).
  const RankPlan other = get_thd_load_balanced_cp_metadata(cu, comm.size(), (comm.rank() + 1) % comm.size());
  for (const std::string& m : check::error_on_every_rank(comm, [&] { (void)gather_global_rows(comm, other, l.view()); }))
    EXPECT_THAT(m, ::testing::HasSubstr("gather_global_rows: the plan is rank "));
  std::vector<int64_t> moved = cu;
  if (comm.rank() == 0) moved[1] += 1;  // one boundary one token later, the same total
  const RankPlan shifted = get_thd_load_balanced_cp_metadata(moved, comm.size(), comm.rank());
  const check::Tensor ls = check::local_rows(g, shifted);
  for (const std::string& m : check::error_on_every_rank(comm, [&] { (void)gather_global_rows(comm, shifted, ls.view()); }))
    EXPECT_THAT(m, ::testing::HasSubstr("cu_seqlens hash"));
}

TEST_F(CpAttentionTest, DropoutDropsTheSameEntriesAsASingleProcess) {
  // Masks are keyed by the global document and positions, so CP changes nothing.
  for (const KvMode m : {KvMode::runs, KvMode::index}) {
    run_and_compare(comm, kShapes[1], DType::f32, m, MaskType::causal, 0.2f);
    run_and_compare(comm, kShapes[1], DType::f32, m, MaskType::none, 0.2f);
  }
}

// Runs `f` on every rank, expects cpattn::Error on every rank, checks that every rank got the
// same message, and returns it.
std::string same_error_everywhere(Communicator& comm, const std::function<void()>& f) {
  std::string msg;
  try {
    f();
    ADD_FAILURE() << "rank " << comm.rank() << ": no cpattn::Error";
  } catch (const Error& e) {
    msg = e.message();
  }
  const std::vector<int64_t> lens = comm.all_gather_counts(static_cast<int64_t>(msg.size()));
  std::vector<std::byte> all(std::accumulate(lens.begin(), lens.end(), std::size_t{0}));
  comm.all_gather_v<std::byte>(std::as_bytes(std::span(msg)), lens, all);
  for (std::size_t r = 0, at = 0; r < lens.size(); at += lens[r], ++r)
    EXPECT_EQ(std::string(reinterpret_cast<const char*>(all.data()) + at, lens[r]), msg)
        << "rank " << r << " got another message";
  return msg;
}

TEST_F(CpAttentionTest, DisagreementFailsOnEveryRankNamingFieldAndRanks) {
  if (comm.size() < 2) GTEST_SKIP() << "needs two ranks";
  const int last = comm.size() - 1;
  const std::string last_s = std::to_string(last);
  {  // other boundaries, same token count
    SmallBatch b(comm.size(), comm.rank());
    if (comm.rank() == last) b.cu = {0, 20, 30};
    CpAttention attn(comm, b.config());
    const std::string m = same_error_everywhere(comm, [&] { (void)attn.forward(b.fwd()); });
    EXPECT_THAT(m, HasSubstr("cu_seqlens hash"));
    EXPECT_THAT(m, HasSubstr("rank " + last_s));
  }
  {  // a head count
    SmallBatch b(comm.size(), comm.rank());
    CpAttnConfig c = b.config();
    if (comm.rank() == last) c.num_heads_q = b.s.hq = 2;  // its views agree with its configuration
    CpAttention attn(comm, c);
    EXPECT_THAT(same_error_everywhere(comm, [&] { (void)attn.forward(b.fwd()); }), HasSubstr("num_heads_q"));
  }
  {  // a head dim
    SmallBatch b(comm.size(), comm.rank());
    CpAttnConfig c = b.config();
    if (comm.rank() == last) c.head_dim_v = b.s.dv = 8;
    CpAttention attn(comm, c);
    EXPECT_THAT(same_error_everywhere(comm, [&] { (void)attn.forward(b.fwd()); }), HasSubstr("head_dim_v"));
  }
  {  // a dtype (the buffers are large enough for either)
    SmallBatch b(comm.size(), comm.rank());
    CpAttnConfig c = b.config();
    if (comm.rank() == last) c.dtype = DType::bf16;
    CpAttention attn(comm, c);
    CpForwardArgs f = b.fwd();
    for (auto* v : {&f.q, &f.k, &f.v}) v->dtype = c.dtype;
    f.out.dtype = c.dtype;
    EXPECT_THAT(same_error_everywhere(comm, [&] { (void)attn.forward(f); }), HasSubstr("dtype"));
  }
  {  // another token count: the plan's local count no longer matches on that rank
    SmallBatch b(comm.size(), comm.rank());
    if (comm.rank() == last) b.cu = {0, 10, 40};
    CpAttention attn(comm, b.config());
    const std::string m = same_error_everywhere(comm, [&] { (void)attn.forward(b.fwd()); });
    EXPECT_THAT(m, HasSubstr("[rank " + last_s + "]"));
    EXPECT_THAT(m, HasSubstr("must be [local_tokens = "));
  }
}

TEST_F(CpAttentionTest, BadArgumentsOnOneRankFailEveryRank) {
  SmallBatch b(comm.size(), comm.rank());
  CpAttention attn(comm, b.config());
  CpForwardArgs f = b.fwd();
  if (comm.rank() == 0) f.q.data = nullptr;
  EXPECT_THAT(same_error_everywhere(comm, [&] { (void)attn.forward(f); }),
              HasSubstr("[rank 0] CpAttention::forward: q must not be null"));
  std::vector<int64_t> bad{0, 10, 10, 30};
  CpForwardArgs g = b.fwd();
  g.cu_seqlens = bad;
  EXPECT_THAT(same_error_everywhere(comm, [&] { (void)attn.forward(g); }), HasSubstr("strictly increasing"));
  CpContext none;
  EXPECT_THAT(same_error_everywhere(comm, [&] { attn.backward(none, b.bwd()); }),
              HasSubstr("the context holds no forward"));
  EXPECT_THROW(CpAttention(comm, {.num_heads_q = 3, .num_heads_k = 2, .head_dim_qk = 8, .head_dim_v = 8}), Error);
  // Enums out of their range: refused, not run as another value (a dtype 9 wrote no output).
  CpAttnConfig c = b.config();
  c.dtype = static_cast<DType>(9);
  EXPECT_THAT(cpattn::testing::error_of([&] { CpAttention bad_layer(comm, c); }), HasSubstr("dtype must be fp32, fp16 or bf16, got 9"));
  c = b.config();
  c.options.mask = static_cast<MaskType>(7);
  EXPECT_THAT(cpattn::testing::error_of([&] { CpAttention bad_layer(comm, c); }), HasSubstr("mask must be none or causal, got 7"));
}

// A wrapper's own failed check on one rank (CpForwardArgs / CpBackwardArgs::caller_error): every
// rank fails with its message at the call's agreement, and the layer's next calls agree.
TEST_F(CpAttentionTest, ACallersErrorOnOneRankFailsEveryRank) {
  SmallBatch b(comm.size(), comm.rank());
  CpAttention attn(comm, b.config());
  const int last = comm.size() - 1;
  const std::string last_s = std::to_string(last);
  CpForwardArgs f = b.fwd();
  if (comm.rank() == last) f = {.caller_error = "q must have unit stride in head_dim"};
  const std::string m = same_error_everywhere(comm, [&] { (void)attn.forward(f); });
  EXPECT_THAT(m, HasSubstr("[rank " + last_s + "] q must have unit stride in head_dim"));
  CpContext ctx = attn.forward(b.fwd());
  CpBackwardArgs g = b.bwd();
  if (comm.rank() == last) g = {.caller_error = "dout: not viewable"};
  EXPECT_THAT(same_error_everywhere(comm, [&] { attn.backward(ctx, g); }),
              HasSubstr("[rank " + last_s + "] dout: not viewable"));
  ctx = attn.forward(b.fwd());
  attn.backward(ctx, b.bwd());  // the counters still agree
}

TEST_F(CpAttentionTest, ADifferentCodePathIsCaughtByTheCallCounters) {
  if (comm.size() < 2) GTEST_SKIP() << "needs two ranks";
  SmallBatch b(comm.size(), comm.rank());
  CpAttention attn(comm, b.config());
  CpContext ctx = attn.forward(b.fwd());
  // Rank 0 skips backward and runs forward again; the others run backward.
  const std::string m = same_error_everywhere(comm, [&] {
    if (comm.rank() == 0)
      (void)attn.forward(b.fwd());
    else
      attn.backward(ctx, b.bwd());
  });
  EXPECT_THAT(m, HasSubstr("phase"));
  EXPECT_THAT(m, HasSubstr("calls"));
}

TEST_F(CpAttentionTest, RepeatedBackwardIsBitwiseEqual) {
  SmallBatch b(comm.size(), comm.rank());
  std::mt19937 rng(11 + comm.rank());
  std::normal_distribution<float> d;
  for (auto* vec : {&b.q, &b.k, &b.v, &b.dout})
    for (float& x : *vec) x = d(rng);
  CpAttention attn(comm, b.config());
  std::vector<float> first_dq, first_dk, first_dv;
  for (int i = 0; i < 50; ++i) {
    CpContext ctx = attn.forward(b.fwd());
    attn.backward(ctx, b.bwd());
    if (i == 0) {
      first_dq = b.dq, first_dk = b.dk, first_dv = b.dv;
    } else {
      ASSERT_EQ(std::memcmp(first_dq.data(), b.dq.data(), b.dq.size() * 4), 0);
      ASSERT_EQ(std::memcmp(first_dk.data(), b.dk.data(), b.dk.size() * 4), 0);
      ASSERT_EQ(std::memcmp(first_dv.data(), b.dv.data(), b.dv.size() * 4), 0);
    }
  }
  EXPECT_EQ(attn.plan_cache().misses(), 1);  // one plan, reused by every call
  EXPECT_EQ(attn.plan_cache().hits(), 49);
}

TEST_F(CpAttentionTest, NanInOneDocumentsKeysStaysInsideIt) {
  // Documents of 10 and 20 tokens; a NaN in a key of document 1 must not touch document 0.
  const Shape s{"gqa", 4, 2, 16, 16};
  check::Batch g = check::random_batch({0, 10, 30}, s.batch(), DType::f32, kSeed);
  g.k.set(static_cast<std::size_t>((15 * s.hkv + 1) * s.dqk + 3), NAN);  // doc 1, token 15
  const RankPlan p = get_thd_load_balanced_cp_metadata(g.cu_seqlens, comm.size(), comm.rank());
  const check::Tensor q = check::local_rows(g.q, p), k = check::local_rows(g.k, p), v = check::local_rows(g.v, p);
  check::Tensor out(DType::f32, {p.local_tokens, s.hq, s.dv});
  CpAttention attn(comm, {.num_heads_q = s.hq, .num_heads_k = s.hkv, .head_dim_qk = s.dqk, .head_dim_v = s.dv});
  const CpForwardArgs args{.cu_seqlens = g.cu_seqlens, .q = q.view(), .k = k.view(), .v = v.view(),
                           .out = out.view()};
  (void)attn.forward(args);
  // Document 0 alone, in one process, is the reference for its rows: finite, and equal up to
  // fp32 blocking order.
  const auto first_rows = [](const check::Tensor& x, int64_t rows) {
    const std::span<const float> f = std::span(x.f).first(static_cast<std::size_t>(rows * x.shape.row_elements()));
    return check::Tensor::from(x.dtype, {rows, x.shape.heads, x.shape.dim}, f);
  };
  const check::Batch doc0{.cu_seqlens = {0, 10}, .shape = g.shape, .dtype = g.dtype, .q = first_rows(g.q, 10),
                          .k = first_rows(g.k, 10), .v = first_rows(g.v, 10), .dout = first_rows(g.dout, 10)};
  const check::Results ref = check::single_process(doc0, {});
  const std::vector<float> got = gather_global_rows(comm, p, out.view());
  const int64_t row = doc0.out_shape().row_elements();
  const std::span<const float> got0 = std::span(got).first(static_cast<std::size_t>(10 * row));
  expect_pass(check::compare("out (document 0)", got0, ref.out, DType::f32, row));
  // The opt-in finite check turns the NaN into an error on every rank (the rank holding it
  // is named), before any payload moves.
  CpAttention checked(comm, {.num_heads_q = s.hq, .num_heads_k = s.hkv, .head_dim_qk = s.dqk,
                             .head_dim_v = s.dv, .check_finite = true});
  EXPECT_THAT(same_error_everywhere(comm, [&] {
                (void)checked.forward(args);
              }),
              HasSubstr("k holds nan at token 15, head 1, dim 3"));
}

TEST_F(CpAttentionTest, LargeScoresInHalfPrecisionStayFiniteAndMatchFp32) {
  const Shape s{"gqa", 4, 2, 32, 32};
  const std::vector<int64_t> cu{0, 40, 77};
  const int64_t n = 77;
  const RankPlan p = get_thd_load_balanced_cp_metadata(cu, comm.size(), comm.rank());
  // The global out of a CP forward of q, k, v (in their dtype).
  const auto run = [&](const check::Tensor& q, const check::Tensor& k, const check::Tensor& v) {
    const DType t = q.dtype;
    const check::Tensor lq = check::local_rows(q, p), lk = check::local_rows(k, p), lv = check::local_rows(v, p);
    check::Tensor out(t, {p.local_tokens, s.hq, s.dv});
    CpAttention attn(comm, {.num_heads_q = s.hq, .num_heads_k = s.hkv, .head_dim_qk = s.dqk,
                            .head_dim_v = s.dv, .dtype = t});
    (void)attn.forward({.cu_seqlens = cu, .q = lq.view(), .k = lk.view(), .v = lv.view(), .out = out.view()});
    EXPECT_EQ(check::nonzero_padding_rows(out.view(), p), 0) << to_string(t) << " out: padding rows that are not zero";
    return gather_global_rows(comm, p, out.view());
  };
  const check::BatchShape b = s.batch();
  for (const DType t : {DType::f16, DType::bf16}) {
    SCOPED_TRACE(to_string(t));
    // Scores of magnitude in the thousands: exp overflows fp32 unless the max is shifted out.
    const check::Tensor q = check::random_tensor(t, {n, b.heads_q, b.head_dim_qk}, 1, 30.0f),
                        k = check::random_tensor(t, {n, b.heads_k, b.head_dim_qk}, 2, 30.0f),
                        v = check::random_tensor(t, {n, b.heads_k, b.head_dim_v}, 3);
    const std::vector<float> half = run(q, k, v);
    const std::vector<float> full = run(q.as(DType::f32), k.as(DType::f32), v.as(DType::f32));  // the same values
    // Finite, and elementwise within the half dtype's tolerance of the fp32 run.
    expect_pass(check::compare("out", half, full, t, int64_t{s.hq} * s.dv));
  }
}

// A context is consumed by its backward, belongs to the CpAttention that made it, and a plan
// handed in must be this rank's: each misuse fails on every rank with one message.
TEST_F(CpAttentionTest, ContextAndPlanMisuseFailsOnEveryRank) {
  SmallBatch b(comm.size(), comm.rank());
  CpAttention attn(comm, b.config()), other(comm, b.config());
  CpContext ctx = attn.forward(b.fwd());
  attn.backward(ctx, b.bwd());
  EXPECT_THAT(same_error_everywhere(comm, [&] { attn.backward(ctx, b.bwd()); }),
              HasSubstr("the context holds no forward"));
  CpContext mine = other.forward(b.fwd());
  EXPECT_THAT(same_error_everywhere(comm, [&] { attn.backward(mine, b.bwd()); }),
              HasSubstr("made by another CpAttention"));
  other.backward(mine, b.bwd());
  CpForwardArgs f = b.fwd();
  f.plan = std::make_shared<RankPlan>(get_thd_load_balanced_cp_metadata(b.cu, comm.size() + 1, comm.size()));
  EXPECT_THAT(same_error_everywhere(comm, [&] { (void)attn.forward(f); }), HasSubstr("plan is for rank"));
  CpForwardArgs g = b.fwd();
  g.plan = attn.plan(b.cu);
  const std::vector<int64_t> other_cu{0, 5, 30};
  g.cu_seqlens = other_cu;
  EXPECT_THAT(same_error_everywhere(comm, [&] { (void)attn.forward(g); }), HasSubstr("differ"));
  CpForwardArgs strided = b.fwd();
  strided.k.row_stride = 2 * strided.k.row_step();
  EXPECT_THAT(same_error_everywhere(comm, [&] { (void)attn.forward(strided); }), HasSubstr("k must be contiguous"));
}

// ---- The ring scheme (pass-KV) ----------------------------------------------------------------

TEST_F(CpAttentionTest, RingMatchesSingleProcessEveryShapeDtypeAndMask) {
  for (const Shape& s : kShapes)
    for (const DType t : {DType::f32, DType::f16, DType::bf16})
      for (const MaskType m : {MaskType::causal, MaskType::none}) {
        run_and_compare(comm, s, t, KvMode::runs, m, 0.0f, CpScheme::ring);
        if (HasFailure()) return;
      }
}

TEST_F(CpAttentionTest, RingMatchesSingleProcessOnTinyAndShortDocuments) {
  // 1-token documents, documents shorter than 2 * cp (3, 5: every cp >= 3), many tiny ones
  // (whose blocks leave most steps without a visible pair) and one long one.
  std::vector<int64_t> tiny(40, 1);
  for (std::size_t i = 0; i < tiny.size(); i += 3) tiny[i] = 2;
  const std::vector<int64_t> mixed{1, 3, 1, 5, 130, 1, 2, 7};
  const std::vector<int64_t>* lists[] = {&tiny, &mixed};
  for (const std::vector<int64_t>* lengths : lists)
    for (const MaskType m : {MaskType::causal, MaskType::none}) {
      run_and_compare(comm, kShapes[1], DType::f32, KvMode::runs, m, 0.0f, CpScheme::ring, *lengths);
      run_and_compare(comm, kShapes[2], DType::bf16, KvMode::runs, m, 0.0f, CpScheme::ring, *lengths);
      if (HasFailure()) return;
    }
}

TEST_F(CpAttentionTest, RingDropoutDropsTheSameEntriesAsASingleProcess) {
  run_and_compare(comm, kShapes[1], DType::f32, KvMode::runs, MaskType::causal, 0.2f, CpScheme::ring);
  run_and_compare(comm, kShapes[1], DType::f32, KvMode::runs, MaskType::none, 0.2f, CpScheme::ring);
  run_and_compare(comm, kShapes[2], DType::bf16, KvMode::runs, MaskType::causal, 0.2f, CpScheme::ring);
}

TEST_F(CpAttentionTest, RingRepeatedRunsAreBitwiseEqual) { expect_repeated_runs_bitwise_equal(comm, CpScheme::ring, 20); }

TEST_F(CpAttentionTest, RingAndAllGatherAgree) { expect_schemes_agree(comm, CpScheme::allgather, CpScheme::ring); }

TEST_F(CpAttentionTest, SchemeDisagreementFailsOnEveryRank) {
  if (comm.size() < 2) GTEST_SKIP() << "needs two ranks";
  SmallBatch b(comm.size(), comm.rank());
  CpAttnConfig c = b.config();
  if (comm.rank() == comm.size() - 1) c.scheme = CpScheme::ring;
  CpAttention attn(comm, c);
  const std::string m = same_error_everywhere(comm, [&] { (void)attn.forward(b.fwd()); });
  EXPECT_THAT(m, HasSubstr("scheme"));
  EXPECT_THAT(m, HasSubstr("rank " + std::to_string(comm.size() - 1)));
}

TEST_F(CpAttentionTest, RingRejectsIndexMode) {
  SmallBatch b(comm.size(), comm.rank());
  CpAttnConfig c = b.config();
  c.scheme = CpScheme::ring;
  c.kv_mode = KvMode::index;
  EXPECT_THROW(CpAttention(comm, c), Error);
  EXPECT_EQ(to_string(CpScheme::ring), "ring");
  EXPECT_EQ(to_string(CpScheme::allgather), "allgather");
}

// Whether rank q's real queries see a real key of rank b's block (causal), counted naively
// from the plans' tokens: what decides whether the ring's partial dK/dV of that pair is full.
bool sees_block(const std::vector<int64_t>& cu, int cp, int q, int b) {
  const RankPlan pq = get_thd_load_balanced_cp_metadata(cu, cp, q), pb = get_thd_load_balanced_cp_metadata(cu, cp, b);
  const auto doc_of = [&](int64_t g) { return std::upper_bound(cu.begin(), cu.end(), g) - cu.begin() - 1; };
  for (const int64_t gq : pq.real_token_index)
    for (const int64_t gk : pb.real_token_index)
      if (gq >= 0 && gk >= 0 && doc_of(gq) == doc_of(gk) && gk <= gq) return true;
  return false;
}

TEST_F(CpAttentionTest, RingMovesOnlyNeighbourBlocks) {
  // Forward: cp - 1 shifts of the K/V blocks; backward: the same plus, per step s >= 1, the
  // partial fp32 dK/dV of the visiting block going home to rank r - s: full when r's queries
  // see that block, else an empty message; counted by the communicator (the agreement's
  // all-gathers on top).
  SmallBatch b(comm.size(), comm.rank());
  CpAttnConfig c = b.config();
  c.scheme = CpScheme::ring;
  CpAttention attn(comm, c);
  const int cp = comm.size(), r = comm.rank();
  const int64_t kv = b.t_loc * b.s.hkv * (b.s.dqk + b.s.dv) * 4;
  int64_t sends = 0, receives = 0;
  for (int st = 1; st < cp; ++st) {
    sends += sees_block(b.cu, cp, r, (r - st + cp) % cp);
    receives += sees_block(b.cu, cp, (r + st) % cp, r);
  }
  const int64_t s0 = comm.bytes_sent(), r0 = comm.bytes_received();
  CpContext ctx = attn.forward(b.fwd());
  attn.backward(ctx, b.bwd());
  const int64_t sent = comm.bytes_sent() - s0, recv = comm.bytes_received() - r0;
  const int64_t shifts = cp == 1 ? 0 : 2 * (cp - 1) * kv;
  EXPECT_GE(sent, shifts + sends * kv);
  EXPECT_LT(sent, shifts + sends * kv + 4096 * cp);  // agreement fingerprints are small
  EXPECT_EQ(sent - sends * kv, recv - receives * kv);
}

}  // namespace
}  // namespace cpattn
