// The all-to-all (Ulysses) and hybrid (a2a x all-gather/ring) CP schemes over MPI against a
// single-process run of the whole batch (docs/cp.md), at the rank count mpiexec gives (CTest
// runs 2, 3 and 4): shapes, dtypes, masks, dropout, KV-head replication, padding, repeatability,
// bytes moved, and the head counts and cp_inner values that must be refused.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cpattn/attention.hpp>
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
#include <cstring>
#include <string>
#include <vector>

namespace cpattn {
namespace {

using ::testing::HasSubstr;

// A batch shape with a name for the traces.
struct Shape : check::BatchShape {
  const char* name = "";
};
Shape shape(const char* name, int hq, int hkv, int dqk, int dv) { return {{hq, hkv, dqk, dv}, name}; }

// Hq = 12 splits over 2, 3 and 4 ranks. GQA: 2 KV heads are split at cp = 2 and replicated
// (2 ranks per head) at cp = 4; at cp = 3 one KV head is replicated on all 3.
std::vector<Shape> shapes(int cp) {
  return {shape("mha", 12, 12, 16, 16), shape("gqa", 12, cp == 3 ? 1 : 2, 16, 16), shape("mla", 12, 12, 24, 16)};
}

// Documents of which some need padding at every cp in 2..4, a 1-token document and one
// shorter than 2*cp.
const std::vector<int64_t> kLengths{37, 50, 1, 5, 23, 9};

// What a run varies besides shape and dtype.
struct Variant {
  CpScheme scheme = CpScheme::a2a;
  int cp_inner = 0;
  CpScheme outer = CpScheme::allgather;
  MaskType mask = MaskType::causal;
  float dropout_p = 0.0f;
  int64_t window_left = -1;
  float softcap = 0.0f;
  bool alibi = false;
};

void expect_pass(const check::TensorReport& r) { EXPECT_TRUE(r.pass) << r.describe(); }

CpAttnConfig config(const Shape& s, DType t, const Variant& r, const AttnOptions& o) {
  return {.num_heads_q = s.heads_q,
          .num_heads_k = s.heads_k,
          .head_dim_qk = s.head_dim_qk,
          .head_dim_v = s.head_dim_v,
          .dtype = t,
          .options = o,
          .scheme = r.scheme,
          .cp_inner = r.cp_inner,
          .hybrid_outer = r.outer};
}

// One forward + backward of `r` against the single-process run: out, lse, dq, dk, dv within
// the all-gather scheme's tolerances, padding rows exactly zero (lse -inf).
void run_and_compare(Communicator& comm, const Shape& s, DType t, const Variant& r,
                     const std::vector<int64_t>& lengths = kLengths) {
  SCOPED_TRACE(::testing::Message() << s.name << " dtype " << to_string(t) << " scheme " << to_string(r.scheme)
                                    << " cp_inner " << r.cp_inner << " outer " << to_string(r.outer) << " mask "
                                    << (r.mask == MaskType::causal ? "causal" : "none") << " dropout " << r.dropout_p
                                    << " window " << r.window_left << " softcap " << r.softcap << " alibi " << r.alibi
                                    << " documents " << lengths.size() << " cp " << comm.size());
  const std::vector<float> slopes = check::alibi_slopes(s.heads_q);
  const AttnOptions options{.mask = r.mask,
                            .dropout_p = r.dropout_p,
                            .seed = 77,
                            .path = best_kernel_path(),
                            .window_size_left = r.window_left,
                            .softcap = r.softcap,
                            .alibi_slopes = r.alibi ? slopes.data() : nullptr};
  const check::Batch b = check::random_batch(cu_seqlens_from_lengths(lengths), s, t, 1);
  const check::Results want = check::single_process(b, options);
  CpAttention attn(comm, config(s, t, r, options));
  const auto p = attn.plan(b.cu_seqlens);
  const check::Tensor q = check::local_rows(b.q, *p), k = check::local_rows(b.k, *p), v = check::local_rows(b.v, *p),
                      dout = check::local_rows(b.dout, *p);
  check::Tensor out(t, {p->local_tokens, s.heads_q, s.head_dim_v}), dq(t, q.shape), dk(t, k.shape), dv(t, v.shape);
  std::vector<float> lse(static_cast<std::size_t>(p->local_tokens * s.heads_q));
  CpContext ctx =
      attn.forward({.plan = p, .q = q.view(), .k = k.view(), .v = v.view(), .out = out.view(), .lse = lse.data()});
  EXPECT_EQ(std::memcmp(ctx.lse().data(), lse.data(), lse.size() * sizeof(float)), 0);
  attn.backward(
      ctx, {.q = q.view(), .out = out.view(), .dout = dout.view(), .dq = dq.view(), .dk = dk.view(), .dv = dv.view()});
  EXPECT_FALSE(ctx.valid());

  for (const check::Tensor* x : {&out, &dq, &dk, &dv})
    EXPECT_EQ(check::nonzero_padding_rows(x->view(), *p), 0) << "padding rows that are not zero";
  EXPECT_EQ(check::padding_rows_not_equal(contiguous(lse.data(), p->local_tokens, s.heads_q, 1), *p, -INFINITY), 0);
  const check::Results got = check::gather_results(
      comm, *p, {.out = out.view(), .dq = dq.view(), .dk = dk.view(), .dv = dv.view(), .lse = lse.data()});
  expect_pass(check::compare("out", got.out, want.out, t, b.out_shape().row_elements()));
  expect_pass(check::compare("dq", got.dq, want.dq, t, b.q_shape().row_elements()));
  expect_pass(check::compare("dk", got.dk, want.dk, t, b.k_shape().row_elements()));
  expect_pass(check::compare("dv", got.dv, want.dv, t, b.v_shape().row_elements()));
  expect_pass(check::compare_lse(got.lse, want.lse, t, s.heads_q));
  EXPECT_GT(attn.stats().peak_buffer_bytes, 0u);
}

// The hybrid runs of this rank count: 2 x 2 at cp = 4, and at every cp the degenerate splits
// cp_inner = 1 (the outer scheme alone, over the group plan) and cp_inner = cp (a2a alone).
std::vector<Variant> hybrids(int cp) {
  std::vector<Variant> runs{{.scheme = CpScheme::hybrid, .cp_inner = 1}, {.scheme = CpScheme::hybrid, .cp_inner = cp}};
  if (cp == 4) runs.push_back({.scheme = CpScheme::hybrid, .cp_inner = 2});
  return runs;
}

class CpA2aTest : public ::testing::Test {
 protected:
  Communicator comm{MPI_COMM_WORLD, CommOptions{.timeout_s = 120.0, .on_timeout = TimeoutAction::abort}};
};

TEST_F(CpA2aTest, A2aMatchesSingleProcessEveryShapeAndDtype) {
  for (const Shape& s : shapes(comm.size()))
    for (const DType t : {DType::f32, DType::f16, DType::bf16}) {
      run_and_compare(comm, s, t, {});
      if (HasFailure()) return;
    }
}

TEST_F(CpA2aTest, HybridMatchesSingleProcessEveryShapeAndDtype) {
  const int cp = comm.size();
  const Variant two_by_two{.scheme = CpScheme::hybrid, .cp_inner = cp == 4 ? 2 : 1};
  for (const Shape& s : shapes(cp))
    for (const DType t : {DType::f32, DType::f16, DType::bf16}) {
      run_and_compare(comm, s, t, two_by_two);
      if (HasFailure()) return;
    }
  for (const Variant& r : hybrids(cp)) run_and_compare(comm, shapes(cp)[1], DType::f32, r);
}

TEST_F(CpA2aTest, HybridOverTheRing) {
  const int cp = comm.size();
  for (const Variant& base : hybrids(cp)) {
    Variant r = base;
    r.outer = CpScheme::ring;
    run_and_compare(comm, shapes(cp)[1], DType::f32, r);
    run_and_compare(comm, shapes(cp)[2], DType::bf16, r);
  }
}

// No mask, windows, soft cap, ALiBi (each rank reads its slice of the slopes) and dropout
// (each rank keys its heads by their global index): the same as one process.
TEST_F(CpA2aTest, MasksAndDropoutMatchSingleProcess) {
  const int cp = comm.size();
  const Shape s = shapes(cp)[1];
  for (const Variant& base : {Variant{}, Variant{.scheme = CpScheme::hybrid, .cp_inner = cp == 4 ? 2 : 1}}) {
    for (Variant r :
         {Variant{.mask = MaskType::none}, Variant{.window_left = 7}, Variant{.mask = MaskType::none, .window_left = 3},
          Variant{.softcap = 2.0f}, Variant{.alibi = true}, Variant{.dropout_p = 0.2f},
          Variant{.mask = MaskType::none, .dropout_p = 0.2f}}) {
      r.scheme = base.scheme;
      r.cp_inner = base.cp_inner;
      run_and_compare(comm, s, DType::f32, r);
    }
    run_and_compare(comm, s, DType::bf16, {.scheme = base.scheme, .cp_inner = base.cp_inner, .dropout_p = 0.2f});
  }
}

TEST_F(CpA2aTest, TinyAndShortDocuments) {
  const int cp = comm.size();
  const std::vector<int64_t> tiny{1}, ones{1, 1, 1}, many_tiny_one_long{1, 2, 1, 3, 1, 1, 2, 1, 150, 1};
  for (const auto* lengths : {&tiny, &ones, &many_tiny_one_long})
    for (const Variant& r : {Variant{}, Variant{.scheme = CpScheme::hybrid, .cp_inner = cp == 4 ? 2 : 1}})
      for (const MaskType m : {MaskType::causal, MaskType::none}) {
        Variant x = r;
        x.mask = m;
        run_and_compare(comm, shapes(cp)[1], DType::f32, x, *lengths);
        if (lengths == &many_tiny_one_long) run_and_compare(comm, shapes(cp)[2], DType::bf16, x, *lengths);
      }
}

// Fewer KV heads than ranks: one KV head (MQA) on every rank, its replicas' dK/dV summed back.
TEST_F(CpA2aTest, ReplicatedKvHeadsMatchSingleProcess) {
  const Shape mqa = shape("mqa", 4 * comm.size(), 1, 16, 16);
  for (const DType t : {DType::f32, DType::bf16}) run_and_compare(comm, mqa, t, {.dropout_p = 0.1f});
}

TEST_F(CpA2aTest, RepeatedRunsAreBitwiseEqual) {
  const int cp = comm.size();
  const Shape s = shapes(cp)[1];
  const check::Batch b = check::random_batch(cu_seqlens_from_lengths(kLengths), s, DType::f32, 3);
  for (const Variant& r : {Variant{}, Variant{.scheme = CpScheme::hybrid, .cp_inner = cp == 4 ? 2 : 1}}) {
    CpAttention attn(comm, config(s, DType::f32, r, {.dropout_p = 0.1f, .seed = 5}));
    const auto p = attn.plan(b.cu_seqlens);
    const check::Tensor q = check::local_rows(b.q, *p), k = check::local_rows(b.k, *p), v = check::local_rows(b.v, *p),
                        dout = check::local_rows(b.dout, *p);
    std::vector<std::vector<float>> first;
    for (int i = 0; i < 3; ++i) {
      check::Tensor out(DType::f32, {p->local_tokens, s.heads_q, s.head_dim_v}), dq(DType::f32, q.shape),
          dk(DType::f32, k.shape), dv(DType::f32, v.shape);
      CpContext ctx = attn.forward({.plan = p, .q = q.view(), .k = k.view(), .v = v.view(), .out = out.view()});
      std::vector<float> lse(ctx.lse().begin(), ctx.lse().end());
      attn.backward(
          ctx,
          {.q = q.view(), .out = out.view(), .dout = dout.view(), .dq = dq.view(), .dk = dk.view(), .dv = dv.view()});
      std::vector<std::vector<float>> now{out.values(), dq.values(), dk.values(), dv.values(), lse};
      if (i == 0) first = now;
      for (std::size_t j = 0; j < now.size(); ++j)
        ASSERT_EQ(std::memcmp(first[j].data(), now[j].data(), now[j].size() * sizeof(float)), 0)
            << to_string(r.scheme) << " run " << i << " tensor " << j;
    }
  }
}

// Two batches with other boundaries (two micro-batches of a pipeline): both forwards, then
// the backwards in reverse order, each equal to its own single-process run. Backward must move
// rows by its own context's plan, not by the last forward's.
TEST_F(CpA2aTest, TwoBatchesForwardThenBackwardsInReverse) {
  const int cp = comm.size();
  const Shape s = shapes(cp)[1];
  for (const Variant& r : {Variant{}, Variant{.scheme = CpScheme::hybrid, .cp_inner = cp == 4 ? 2 : 1}}) {
    CpAttention attn(comm, config(s, DType::f32, r, {}));
    struct Run {
      check::Batch b;
      std::shared_ptr<const RankPlan> p;
      check::Tensor q, k, v, dout, out, dq, dk, dv;
      std::vector<float> lse;
      CpContext ctx;
    };
    std::vector<Run> runs;
    for (const std::vector<int64_t>& lengths : {std::vector<int64_t>{5, 1, 30}, std::vector<int64_t>{17, 9, 2, 40}}) {
      Run x;
      x.b = check::random_batch(cu_seqlens_from_lengths(lengths), s, DType::f32, 7);
      x.p = attn.plan(x.b.cu_seqlens);
      x.q = check::local_rows(x.b.q, *x.p);
      x.k = check::local_rows(x.b.k, *x.p);
      x.v = check::local_rows(x.b.v, *x.p);
      x.dout = check::local_rows(x.b.dout, *x.p);
      x.out = check::Tensor(DType::f32, {x.p->local_tokens, s.heads_q, s.head_dim_v});
      x.dq = check::Tensor(DType::f32, x.q.shape);
      x.dk = check::Tensor(DType::f32, x.k.shape);
      x.dv = check::Tensor(DType::f32, x.v.shape);
      x.lse.resize(static_cast<std::size_t>(x.p->local_tokens * s.heads_q));
      runs.push_back(std::move(x));
    }
    for (Run& x : runs)
      x.ctx = attn.forward(
          {.plan = x.p, .q = x.q.view(), .k = x.k.view(), .v = x.v.view(), .out = x.out.view(), .lse = x.lse.data()});
    for (auto it = runs.rbegin(); it != runs.rend(); ++it)
      attn.backward(it->ctx, {.q = it->q.view(), .out = it->out.view(), .dout = it->dout.view(), .dq = it->dq.view(),
                              .dk = it->dk.view(), .dv = it->dv.view()});
    for (Run& x : runs) {
      SCOPED_TRACE(::testing::Message() << to_string(r.scheme) << " batch of " << x.b.cu_seqlens.back() << " tokens");
      const check::Results want = check::single_process(x.b, {});
      const check::Results got = check::gather_results(
          comm, *x.p,
          {.out = x.out.view(), .dq = x.dq.view(), .dk = x.dk.view(), .dv = x.dv.view(), .lse = x.lse.data()});
      expect_pass(check::compare("out", got.out, want.out, DType::f32, x.b.out_shape().row_elements()));
      expect_pass(check::compare("dq", got.dq, want.dq, DType::f32, x.b.q_shape().row_elements()));
      expect_pass(check::compare("dk", got.dk, want.dk, DType::f32, x.b.k_shape().row_elements()));
      expect_pass(check::compare("dv", got.dv, want.dv, DType::f32, x.b.v_shape().row_elements()));
    }
  }
}

// q, out, dout and dq may be strided views (PyTorch's slices of a fused qkv): the same bits
// as contiguous tensors.
TEST_F(CpA2aTest, StridedViewsGiveTheContiguousResult) {
  const int cp = comm.size();
  const Shape s = shapes(cp)[1];
  const check::Batch b = check::random_batch(cu_seqlens_from_lengths(kLengths), s, DType::f32, 3);
  CpAttention attn(comm, config(s, DType::f32, {.scheme = CpScheme::hybrid, .cp_inner = cp == 4 ? 2 : cp}, {}));
  const auto p = attn.plan(b.cu_seqlens);
  const int64_t t = p->local_tokens;
  const check::Tensor q = check::local_rows(b.q, *p), k = check::local_rows(b.k, *p), v = check::local_rows(b.v, *p),
                      dout = check::local_rows(b.dout, *p);
  // Each tensor of `heads` x `dim` as rows of a buffer twice as wide, the heads 3 dims apart.
  const auto wide = [&](std::vector<float>& buf, int heads, int dim, const float* from) {
    const int64_t head_stride = dim + 3, row_stride = 2 * heads * head_stride;
    buf.assign(static_cast<std::size_t>(t * row_stride), NAN);
    TensorView view{.data = buf.data(),
                    .rows = t,
                    .heads = heads,
                    .dim = dim,
                    .dtype = DType::f32,
                    .row_stride = row_stride,
                    .head_stride = head_stride};
    for (int64_t i = 0; i < t; ++i)
      for (int h = 0; h < heads; ++h)
        for (int e = 0; e < dim; ++e)
          buf[static_cast<std::size_t>(view.offset(i, h) + e)] = from ? from[(i * heads + h) * dim + e] : 0.0f;
    return view;
  };
  std::vector<float> qw, ow, dow, dqw;
  const TensorView qv = wide(qw, s.heads_q, s.head_dim_qk, q.f.data()), ov = wide(ow, s.heads_q, s.head_dim_v, nullptr),
                   dov = wide(dow, s.heads_q, s.head_dim_v, dout.f.data()),
                   dqv = wide(dqw, s.heads_q, s.head_dim_qk, nullptr);
  check::Tensor out(DType::f32, {t, s.heads_q, s.head_dim_v}), dq(DType::f32, q.shape), dk(DType::f32, k.shape),
      dv(DType::f32, v.shape), dk2(DType::f32, k.shape), dv2(DType::f32, v.shape);
  CpContext c1 = attn.forward({.plan = p, .q = q.view(), .k = k.view(), .v = v.view(), .out = out.view()});
  attn.backward(
      c1, {.q = q.view(), .out = out.view(), .dout = dout.view(), .dq = dq.view(), .dk = dk.view(), .dv = dv.view()});
  CpContext c2 = attn.forward({.plan = p, .q = qv, .k = k.view(), .v = v.view(), .out = ov});
  attn.backward(c2, {.q = qv, .out = ov, .dout = dov, .dq = dqv, .dk = dk2.view(), .dv = dv2.view()});
  for (int64_t i = 0; i < t; ++i)
    for (int h = 0; h < s.heads_q; ++h) {
      ASSERT_EQ(std::memcmp(&ow[static_cast<std::size_t>(ov.offset(i, h))], &out.f[(i * s.heads_q + h) * s.head_dim_v],
                            s.head_dim_v * sizeof(float)),
                0)
          << "out row " << i << " head " << h;
      ASSERT_EQ(std::memcmp(&dqw[static_cast<std::size_t>(dqv.offset(i, h))],
                            &dq.f[(i * s.heads_q + h) * s.head_dim_qk], s.head_dim_qk * sizeof(float)),
                0)
          << "dq row " << i << " head " << h;
    }
  EXPECT_EQ(dk.f, dk2.f);
  EXPECT_EQ(dv.f, dv2.f);
}

// The a2a forward moves, per rank and peer, its tokens' share of q, k, v (the peer's heads)
// one way and of out and lse back: (cp - 1) * T_loc * (hq/cp (Dqk + Dv) es + kv_loc (Dqk + Dv) es + 4 hq/cp).
TEST_F(CpA2aTest, A2aForwardMovesExactlyEachPeersHeads) {
  const int cp = comm.size();
  const Shape s = shapes(cp)[1];
  const check::Batch b = check::random_batch(cu_seqlens_from_lengths(kLengths), s, DType::bf16, 3);
  CpAttention attn(comm, config(s, DType::bf16, {}, {}));
  const auto p = attn.plan(b.cu_seqlens);
  const check::Tensor q = check::local_rows(b.q, *p), k = check::local_rows(b.k, *p), v = check::local_rows(b.v, *p);
  check::Tensor out(DType::bf16, {p->local_tokens, s.heads_q, s.head_dim_v});
  const CpForwardArgs f{.plan = p, .q = q.view(), .k = k.view(), .v = v.view(), .out = out.view()};
  (void)attn.forward(f);  // the first call also splits the sub-groups
  attn.reset_stats();
  (void)attn.forward(f);
  const int64_t hq = s.heads_q / cp, hk = s.heads_k >= cp ? s.heads_k / cp : 1, es = 2;
  const int64_t want = (cp - 1) * p->local_tokens *
                       (hq * (s.head_dim_qk + s.head_dim_v) * es + hk * (s.head_dim_qk + s.head_dim_v) * es + 4 * hq);
  EXPECT_EQ(attn.stats().bytes_sent, want);
  EXPECT_EQ(attn.stats().bytes_received, want);
}

// The hybrid's outer all-gather overlaps by KV-head groups (cp_inner = 1: the outer layer spans
// every rank and holds all 12 KV heads, 4 groups): its transfers' time in flight under compute
// reaches the layer's comm_total_s (it equalled comm_s: the outer layer's hidden time was
// dropped), and with shared memory on, its packs count.
TEST_F(CpA2aTest, HybridCountsItsOuterLayersHiddenTransfersAndPacks) {
  if (comm.size() < 2) GTEST_SKIP() << "needs 2 ranks";
  const Shape s = shapes(comm.size())[0];
  const check::Batch b = check::random_batch(cu_seqlens_from_lengths(std::vector<int64_t>{300, 200}), s, DType::bf16, 3);
  for (const bool shm : {false, true}) {
    SCOPED_TRACE(::testing::Message() << "shared memory " << shm);
    CpAttnConfig cfg = config(s, DType::bf16, {.scheme = CpScheme::hybrid, .cp_inner = 1}, {});
    cfg.shared_memory = shm;
    CpAttention attn(comm, cfg);
    const auto p = attn.plan(b.cu_seqlens);
    const check::Tensor q = check::local_rows(b.q, *p), k = check::local_rows(b.k, *p), v = check::local_rows(b.v, *p),
                        dout = check::local_rows(b.dout, *p);
    check::Tensor out(DType::bf16, {p->local_tokens, s.heads_q, s.head_dim_v}), dq(DType::bf16, q.shape),
        dk(DType::bf16, k.shape), dv(DType::bf16, v.shape);
    for (int call = 0; call < 2; ++call) {  // (the first shared call packs alone: docs/cp.md)
      CpContext ctx = attn.forward({.plan = p, .q = q.view(), .k = k.view(), .v = v.view(), .out = out.view()});
      attn.backward(ctx, {.q = q.view(), .out = out.view(), .dout = dout.view(), .dq = dq.view(), .dk = dk.view(),
                          .dv = dv.view()});
    }
    const CpStats& st = attn.stats();
    if (shm) {
      EXPECT_EQ(st.shared_forwards, 2);
      EXPECT_EQ(st.shared_packs > 0,
                attention_kv_pack_layout(best_kernel_path(), DType::bf16) != KvPackLayout::alone);
    } else {
      EXPECT_EQ(st.shared_forwards, 0);
      EXPECT_GT(st.comm_total_s, st.comm_s);  // the outer groups' transfers in flight, beyond the waits
    }
  }
}

// Head counts that cannot be split, and cp_inner values that do not fit: one message, the
// same on every rank, from the constructor (before any communication), and the same message
// from check_cp_attn_config without a communicator (what the Python module calls first).
TEST_F(CpA2aTest, BadHeadCountsAndCpInnerAreRejectedOnEveryRank) {
  const int cp = comm.size();
  const auto expect_same_error = [&](const CpAttnConfig& c, const std::string& part) {
    const std::vector<std::string> m = check::error_on_every_rank(comm, [&] { CpAttention attn(comm, c); });
    for (const std::string& x : m) EXPECT_EQ(x, m[0]);
    EXPECT_THAT(m[0], HasSubstr(part));
    std::string local = "no error";
    try {
      check_cp_attn_config(c, cp);
    } catch (const Error& e) {
      local = e.message();
    }
    EXPECT_THAT(local, HasSubstr(part));
  };
  const CpAttnConfig base{
      .num_heads_q = 12, .num_heads_k = 12, .head_dim_qk = 16, .head_dim_v = 16, .scheme = CpScheme::a2a};
  CpAttnConfig c = base;
  c.num_heads_q = c.num_heads_k = 5;  // divisible by none of 2, 3, 4
  expect_same_error(c, "num_heads_q = 5 must be divisible by the all-to-all group size " + std::to_string(cp));
  c = base;
  c.num_heads_k = cp == 3 ? 2 : 3;  // neither a multiple nor a divisor of cp
  expect_same_error(
      c, "num_heads_k = " + std::to_string(c.num_heads_k) + " must be divisible by the all-to-all group size");
  c = base;
  c.scheme = CpScheme::hybrid;
  c.cp_inner = cp + 1;
  expect_same_error(c, "cp_inner = " + std::to_string(cp + 1) + " must divide cp = " + std::to_string(cp));
  c.cp_inner = 0;
  expect_same_error(c, "cp_inner = 0 must divide cp");
  c = base;
  c.cp_inner = 1;
  expect_same_error(c, "cp_inner is the hybrid scheme's and must be 0 for scheme a2a");
  c = base;  // (0 failed in the plan cache's constructor under its own name; a huge one threw length_error)
  c.plan_cache_capacity = 0;
  expect_same_error(c, "CpAttnConfig::plan_cache_capacity must be in 1..4096, got 0");
  c.plan_cache_capacity = std::size_t{1} << 62;
  expect_same_error(c, "CpAttnConfig::plan_cache_capacity must be in 1..4096, got 4611686018427387904");
  c = base;
  c.scheme = CpScheme::hybrid;
  c.cp_inner = 1;
  c.hybrid_outer = CpScheme::a2a;
  expect_same_error(c, "hybrid_outer must be allgather or ring, got a2a");
}

// cp_inner is part of the agreement: a rank with another value fails every rank, naming it.
TEST_F(CpA2aTest, RanksThatDisagreeOnCpInnerFailTogether) {
  const int cp = comm.size();
  const Shape s = shapes(cp)[0];
  const check::Batch b = check::random_batch(cu_seqlens_from_lengths(kLengths), s, DType::f32, 3);
  const Variant r{.scheme = CpScheme::hybrid, .cp_inner = comm.rank() == cp - 1 ? cp : 1};
  CpAttention attn(comm, config(s, DType::f32, r, {}));
  const auto p = attn.plan(b.cu_seqlens);
  const check::Tensor q = check::local_rows(b.q, *p), k = check::local_rows(b.k, *p), v = check::local_rows(b.v, *p);
  check::Tensor out(DType::f32, {p->local_tokens, s.heads_q, s.head_dim_v});
  const std::vector<std::string> m = check::error_on_every_rank(
      comm, [&] { (void)attn.forward({.plan = p, .q = q.view(), .k = k.view(), .v = v.view(), .out = out.view()}); });
  for (const std::string& x : m) EXPECT_EQ(x, m[0]);
  EXPECT_THAT(m[0], HasSubstr("cp_inner"));
  EXPECT_THAT(m[0], HasSubstr("rank " + std::to_string(cp - 1)));
}

// The kernels' dropout_head_offset (what the a2a scheme's head slices rely on): a call over
// query heads [2, 4) with offset 2 drops what a call over all 4 heads drops for them; a
// negative offset is refused.
TEST(DropoutHeadOffset, ASliceOfTheHeadsDropsWhatTheFullRunDrops) {
  const std::vector<int64_t> cu{0, 9, 30};
  const check::Batch b =
      check::random_batch(cu, {.heads_q = 4, .heads_k = 4, .head_dim_qk = 8, .head_dim_v = 8}, DType::f32, 9);
  const WorkList w = varlen_worklist(cu, cu);
  const AttnOptions o{.dropout_p = 0.5f, .seed = 3};
  const int64_t t = b.tokens();
  std::vector<float> full(static_cast<std::size_t>(t * 4 * 8)), part(static_cast<std::size_t>(t * 2 * 8));
  attention_forward({.in = {.q = b.q.view(), .k = b.k.view(), .v = b.v.view(), .work = &w, .options = o},
                     .out = contiguous(full.data(), t, 4, 8)});
  // Heads 2 and 3 of q, k, v as strided views (head_dim contiguous, rows of 4 heads).
  const auto heads_2_3 = [&](const check::Tensor& x) {
    ConstTensorView v = x.view();
    v.data = static_cast<const float*>(v.data) + 2 * 8;
    v.heads = 2;
    v.head_stride = 8;
    v.row_stride = 4 * 8;
    return v;
  };
  AttnOptions sliced = o;
  sliced.dropout_head_offset = 2;
  const AttnInputs in{.q = heads_2_3(b.q), .k = heads_2_3(b.k), .v = heads_2_3(b.v), .work = &w, .options = sliced};
  attention_forward({.in = in, .out = contiguous(part.data(), t, 2, 8)});
  for (int64_t i = 0; i < t; ++i)
    for (int e = 0; e < 2 * 8; ++e)
      ASSERT_EQ(part[static_cast<std::size_t>(i * 16 + e)], full[static_cast<std::size_t>(i * 32 + 16 + e)])
          << "row " << i << " element " << e;
  AttnOptions zero = sliced;  // and without the offset the slice draws other masks
  zero.dropout_head_offset = 0;
  AttnInputs in0 = in;
  in0.options = zero;
  attention_forward({.in = in0, .out = contiguous(part.data(), t, 2, 8)});
  EXPECT_NE(std::memcmp(part.data(), full.data() + 16, 16 * sizeof(float)), 0);
  AttnInputs bad = in;
  bad.options.dropout_head_offset = -1;
  EXPECT_THROW(attention_forward({.in = bad, .out = contiguous(part.data(), t, 2, 8)}), Error);
}

TEST_F(CpA2aTest, SchemeNames) {
  EXPECT_EQ(to_string(CpScheme::a2a), "a2a");
  EXPECT_EQ(to_string(CpScheme::hybrid), "hybrid");
}

}  // namespace
}  // namespace cpattn
