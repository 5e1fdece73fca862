// CP attention over MPI against a single-process run of the whole batch (docs/design.md 7), at
// the rank count mpiexec gives (CTest runs 1 to 5), and the agreement failures.
#include <cpattn/comm.hpp>
#include <cpattn/cp.hpp>
#include <cpattn/dtype.hpp>
#include <cpattn/error.hpp>
#include <cpattn/layout.hpp>
#include <cpattn/plan.hpp>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

namespace cpattn {
namespace {

using ::testing::HasSubstr;

struct Shape {
  const char* name;
  int hq, hkv, dqk, dv;
};
constexpr Shape kShapes[] = {{"mha", 8, 8, 64, 64}, {"gqa", 8, 2, 64, 64}, {"mla", 8, 2, 192, 128}};

// Documents of which some need padding at every cp in 2..5, and a 1-token document (whose
// chunks past the first are all padding).
const std::vector<int64_t> kLengths{37, 100, 1, 64, 23, 9};

// A THD tensor in storage type `t`, and its values as float (rounded through the storage).
struct Tensor {
  DType t;
  std::vector<std::byte> bytes;
  std::vector<float> values() const {
    std::vector<float> f(bytes.size() / dtype_size(t));
    to_float(bytes.data(), t, f.size(), f.data());
    return f;
  }
  TensorView view(int64_t rows, int heads, int dim) { return contiguous(bytes.data(), rows, heads, dim, t); }
  ConstTensorView view(int64_t rows, int heads, int dim) const { return contiguous(bytes.data(), rows, heads, dim, t); }
};

Tensor random_tensor(DType t, std::size_t n, uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> f(n);
  for (float& x : f) x = dist(rng);
  Tensor out{t, std::vector<std::byte>(n * dtype_size(t))};
  from_float(f.data(), n, t, out.bytes.data());
  return out;
}

struct Global {  // the whole batch and its single-process results
  std::vector<int64_t> cu;
  Tensor q, k, v, dout;
  Tensor out, dq, dk, dv;
  std::vector<float> lse;
};

Global single_process(const Shape& s, DType t, KernelPath path, MaskType mask = MaskType::causal,
                      float dropout_p = 0.0f, uint64_t seed = 0) {
  Global g;
  g.cu = cu_seqlens_from_lengths(kLengths);
  const int64_t n = g.cu.back();
  g.q = random_tensor(t, n * s.hq * s.dqk, seed + 1);
  g.k = random_tensor(t, n * s.hkv * s.dqk, seed + 2);
  g.v = random_tensor(t, n * s.hkv * s.dv, seed + 3);
  g.dout = random_tensor(t, n * s.hq * s.dv, seed + 4);
  const std::size_t es = dtype_size(t);
  g.out = {t, std::vector<std::byte>(n * s.hq * s.dv * es)};
  g.dq = {t, std::vector<std::byte>(n * s.hq * s.dqk * es)};
  g.dk = {t, std::vector<std::byte>(n * s.hkv * s.dqk * es)};
  g.dv = {t, std::vector<std::byte>(n * s.hkv * s.dv * es)};
  g.lse.resize(n * s.hq);
  const WorkList wl = varlen_worklist(g.cu, g.cu, mask);
  const AttnInputs in{.q = g.q.view(n, s.hq, s.dqk), .k = g.k.view(n, s.hkv, s.dqk), .v = g.v.view(n, s.hkv, s.dv),
                      .work = &wl, .options = {.mask = mask, .dropout_p = dropout_p, .seed = 77, .path = path}};
  attention_forward({.in = in, .out = g.out.view(n, s.hq, s.dv), .lse = g.lse.data()});
  attention_backward({.in = in, .out = g.out.view(n, s.hq, s.dv), .lse = g.lse.data(),
                      .dout = g.dout.view(n, s.hq, s.dv), .dq = g.dq.view(n, s.hq, s.dqk),
                      .dk = g.dk.view(n, s.hkv, s.dqk), .dv = g.dv.view(n, s.hkv, s.dv)});
  return g;
}

// The reference design's tolerances: fp32 1e-5 relative in norm; fp16 and bf16 elementwise
// |a - b| <= atol + rtol * |b| with atol = rtol = 5e-3 and 2.5e-2.
void expect_close(const std::vector<float>& got, const std::vector<float>& want, DType t,
                  const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double diff2 = 0, ref2 = 0;
  int64_t bad = 0;
  const double tol = t == DType::f16 ? 5e-3 : 2.5e-2;
  for (std::size_t i = 0; i < got.size(); ++i) {
    ASSERT_TRUE(std::isfinite(got[i])) << what << " element " << i;
    diff2 += (double{got[i]} - want[i]) * (double{got[i]} - want[i]);
    ref2 += double{want[i]} * want[i];
    if (t != DType::f32 && std::abs(double{got[i]} - want[i]) > tol + tol * std::abs(double{want[i]})) ++bad;
  }
  if (t == DType::f32) {
    EXPECT_LE(std::sqrt(diff2 / std::max(ref2, 1e-30)), 1e-5) << what;
  } else {
    EXPECT_EQ(bad, 0) << what << ": elements outside atol = rtol = " << tol;
  }
}

// Rows of the global tensor `g` in the rank's local order, padding rows zero.
Tensor local_rows(const Tensor& g, int64_t row_elems, const RankPlan& p) {
  Tensor l{g.t, std::vector<std::byte>(p.local_tokens * row_elems * dtype_size(g.t))};
  take_local_rows(g.bytes.data(), row_elems * static_cast<int64_t>(dtype_size(g.t)), p, l.bytes.data());
  return l;
}

// The real rows of a local result, in global order (padding rows checked to be exactly zero).
std::vector<float> to_global(const Tensor& local, int64_t row_elems, const RankPlan& p,
                             const std::vector<float>& into, const std::string& what) {
  std::vector<float> out = into;
  const std::vector<float> lv = local.values();
  for (int64_t i = 0; i < p.local_tokens; ++i) {
    const int64_t g = p.real_token_index[i];
    for (int64_t e = 0; e < row_elems; ++e) {
      if (g < 0)
        EXPECT_EQ(lv[i * row_elems + e], 0.0f) << what << ": padding row " << i << " is not zero";
      else
        out[g * row_elems + e] = lv[i * row_elems + e];
    }
  }
  return out;
}

class CpAttentionTest : public ::testing::Test {
 protected:
  Communicator comm{MPI_COMM_WORLD, CommOptions{.timeout_s = 120.0, .on_timeout = TimeoutAction::abort}};
};

void run_and_compare(Communicator& comm, const Shape& s, DType t, KvMode mode,
                     MaskType mask = MaskType::causal, float dropout_p = 0.0f) {
  SCOPED_TRACE(::testing::Message() << s.name << " dtype " << to_string(t) << " mode "
                                    << (mode == KvMode::runs ? "runs" : "index") << " mask "
                                    << (mask == MaskType::causal ? "causal" : "none") << " dropout "
                                    << dropout_p << " cp " << comm.size());
  const KernelPath path = best_kernel_path();
  const Global g = single_process(s, t, path, mask, dropout_p);
  CpAttention attn(comm, {.num_heads_q = s.hq, .num_heads_k = s.hkv, .head_dim_qk = s.dqk,
                          .head_dim_v = s.dv, .dtype = t,
                          .options = {.mask = mask, .dropout_p = dropout_p, .seed = 77, .path = path},
                          .kv_mode = mode});
  const RankPlan p = get_thd_load_balanced_cp_metadata(g.cu, comm.size(), comm.rank());
  const int64_t qr = s.hq * s.dqk, kr = s.hkv * s.dqk, vr = s.hkv * s.dv, orow = s.hq * s.dv;
  const Tensor q = local_rows(g.q, qr, p), k = local_rows(g.k, kr, p), v = local_rows(g.v, vr, p);
  const Tensor dout = local_rows(g.dout, orow, p);
  const std::size_t es = dtype_size(t);
  Tensor out{t, std::vector<std::byte>(p.local_tokens * orow * es)};
  std::vector<float> lse(p.local_tokens * s.hq);
  const int64_t tl = p.local_tokens;
  CpContext ctx = attn.forward({.cu_seqlens = g.cu, .q = q.view(tl, s.hq, s.dqk), .k = k.view(tl, s.hkv, s.dqk),
                                .v = v.view(tl, s.hkv, s.dv), .out = out.view(tl, s.hq, s.dv), .lse = lse.data()});
  Tensor dq{t, std::vector<std::byte>(q.bytes.size())}, dk{t, std::vector<std::byte>(k.bytes.size())},
      dv{t, std::vector<std::byte>(v.bytes.size())};
  attn.backward(ctx, {.q = q.view(tl, s.hq, s.dqk), .out = out.view(tl, s.hq, s.dv),
                      .dout = dout.view(tl, s.hq, s.dv), .dq = dq.view(tl, s.hq, s.dqk),
                      .dk = dk.view(tl, s.hkv, s.dqk), .dv = dv.view(tl, s.hkv, s.dv)});
  EXPECT_FALSE(ctx.valid());  // consumed

  // Every rank's real rows, gathered into the global order on every rank.
  const auto gather = [&](const Tensor& local, int64_t row, const Tensor& want, const std::string& what) {
    std::vector<float> mine = to_global(local, row, p, std::vector<float>(want.values().size(), 0.0f), what);
    comm.all_reduce<float>(mine, ReduceOp::sum);  // disjoint rows: the sum is the union
    expect_close(mine, want.values(), t, what);
  };
  gather(out, orow, g.out, "out");
  gather(dq, qr, g.dq, "dq");
  gather(dk, kr, g.dk, "dk");
  gather(dv, vr, g.dv, "dv");
  for (int64_t i = 0; i < p.local_tokens; ++i)
    for (int h = 0; h < s.hq; ++h) {
      const float want = p.real_token_index[i] < 0 ? -INFINITY : g.lse[p.real_token_index[i] * s.hq + h];
      if (p.real_token_index[i] < 0)
        ASSERT_EQ(lse[i * s.hq + h], want);
      else
        ASSERT_NEAR(lse[i * s.hq + h], want, t == DType::f32 ? 1e-5 : 1e-2);
    }
  EXPECT_GE(attn.stats().comm_s, 0.0);
  EXPECT_EQ(attn.stats().forward_calls, 1);
}

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
  const KernelPath path = best_kernel_path();
  CpAttention attn(comm, {.num_heads_q = s.hq, .num_heads_k = s.hkv, .head_dim_qk = s.dqk, .head_dim_v = s.dv,
                          .dtype = t, .options = {.path = path}});
  struct Layer {
    Global g;
    Tensor q, k, v, dout, out, dq, dk, dv;
    CpContext ctx;
  };
  Layer layers[2];
  const auto plan = attn.plan(cu_seqlens_from_lengths(kLengths));  // lays the inputs out
  const RankPlan& p = *plan;
  const int64_t tl = p.local_tokens, qr = s.hq * s.dqk, kr = s.hkv * s.dqk, vr = s.hkv * s.dv, orow = s.hq * s.dv;
  for (int l = 0; l < 2; ++l) {
    Layer& L = layers[l];
    L.g = single_process(s, t, path, MaskType::causal, 0.0f, 100 * (l + 1));
    L.q = local_rows(L.g.q, qr, p), L.k = local_rows(L.g.k, kr, p), L.v = local_rows(L.g.v, vr, p);
    L.dout = local_rows(L.g.dout, orow, p);
    L.out = {t, std::vector<std::byte>(tl * orow * 4)};
    L.dq = {t, std::vector<std::byte>(L.q.bytes.size())}, L.dk = {t, std::vector<std::byte>(L.k.bytes.size())};
    L.dv = {t, std::vector<std::byte>(L.v.bytes.size())};
  }
  for (Layer& L : layers)
    L.ctx = attn.forward({.plan = plan, .q = L.q.view(tl, s.hq, s.dqk), .k = L.k.view(tl, s.hkv, s.dqk),
                          .v = L.v.view(tl, s.hkv, s.dv), .out = L.out.view(tl, s.hq, s.dv)});
  EXPECT_GT(layers[0].ctx.bytes(), 0u);
  EXPECT_EQ(&layers[0].ctx.plan(), &p);  // no second plan
  for (int l = 1; l >= 0; --l) {
    Layer& L = layers[l];
    attn.backward(L.ctx, {.q = L.q.view(tl, s.hq, s.dqk), .out = L.out.view(tl, s.hq, s.dv),
                          .dout = L.dout.view(tl, s.hq, s.dv), .dq = L.dq.view(tl, s.hq, s.dqk),
                          .dk = L.dk.view(tl, s.hkv, s.dqk), .dv = L.dv.view(tl, s.hkv, s.dv)});
  }
  for (int l = 0; l < 2; ++l) {
    SCOPED_TRACE(::testing::Message() << "layer " << l);
    const Layer& L = layers[l];
    const std::pair<const Tensor*, const Tensor*> pairs[] = {
        {&L.out, &L.g.out}, {&L.dq, &L.g.dq}, {&L.dk, &L.g.dk}, {&L.dv, &L.g.dv}};
    const char* names[] = {"out", "dq", "dk", "dv"};
    for (int i = 0; i < 4; ++i) {
      const Tensor& got = *pairs[i].first;
      const int heads = i == 0 || i == 1 ? s.hq : s.hkv, dim = i == 1 || i == 2 ? s.dqk : s.dv;
      expect_close(gather_global_rows(comm, p, got.view(tl, heads, dim)), pairs[i].second->values(), t, names[i]);
    }
  }
  EXPECT_EQ(attn.plan_cache().misses(), 1);  // planned once, for both layers
  EXPECT_EQ(attn.plan_cache().hits(), 0);    // the forwards took the plan, not the boundaries
}

// gather_global_rows is the inverse of take_local_rows on the real tokens: exact.
TEST_F(CpAttentionTest, GatherGlobalRowsRestoresTheGlobalOrder) {
  const std::vector<int64_t> cu = cu_seqlens_from_lengths(kLengths);
  const RankPlan p = get_thd_load_balanced_cp_metadata(cu, comm.size(), comm.rank());
  const Tensor g = random_tensor(DType::bf16, cu.back() * 3 * 5, 9);
  const Tensor l = local_rows(g, 15, p);
  EXPECT_EQ(gather_global_rows(comm, p, l.view(p.local_tokens, 3, 5)), g.values());
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

struct SmallBatch {
  Shape s{"gqa", 4, 2, 16, 16};
  std::vector<int64_t> cu{0, 10, 30};
  std::vector<float> q, k, v, out, dout, dq, dk, dv;
  int64_t t_loc;
  SmallBatch(int cp, int rank) {
    t_loc = get_thd_load_balanced_cp_metadata(cu, cp, rank).local_tokens;
    q.assign(t_loc * s.hq * s.dqk, 0.1f);
    k.assign(t_loc * s.hkv * s.dqk, 0.2f);
    v.assign(t_loc * s.hkv * s.dv, 0.3f);
    out.resize(t_loc * s.hq * s.dv);
    dout.assign(out.size(), 1.0f);
    dq.resize(q.size());
    dk.resize(k.size());
    dv.resize(v.size());
  }
  CpAttnConfig config() const {
    return {.num_heads_q = s.hq, .num_heads_k = s.hkv, .head_dim_qk = s.dqk, .head_dim_v = s.dv};
  }
  CpForwardArgs fwd() {
    return {.cu_seqlens = cu, .q = contiguous(q.data(), t_loc, s.hq, s.dqk), .k = contiguous(k.data(), t_loc, s.hkv, s.dqk),
            .v = contiguous(v.data(), t_loc, s.hkv, s.dv), .out = contiguous(out.data(), t_loc, s.hq, s.dv)};
  }
  CpBackwardArgs bwd() {
    return {.q = contiguous(q.data(), t_loc, s.hq, s.dqk), .out = contiguous(out.data(), t_loc, s.hq, s.dv),
            .dout = contiguous(dout.data(), t_loc, s.hq, s.dv), .dq = contiguous(dq.data(), t_loc, s.hq, s.dqk),
            .dk = contiguous(dk.data(), t_loc, s.hkv, s.dqk), .dv = contiguous(dv.data(), t_loc, s.hkv, s.dv)};
  }
};

TEST_F(CpAttentionTest, DisagreementFailsOnEveryRankNamingFieldAndRanks) {
  if (comm.size() < 2) GTEST_SKIP() << "needs two ranks";
  const int last = comm.size() - 1;
  const std::string last_s = std::to_string(last);
  {  // other boundaries, same token count
    SmallBatch b(comm.size(), comm.rank());
    if (comm.rank() == last) b.cu = {0, 20, 30};
    CpAttention attn(comm, b.config());
    const std::string m = same_error_everywhere(comm, [&] { attn.forward(b.fwd()); });
    EXPECT_THAT(m, HasSubstr("cu_seqlens hash"));
    EXPECT_THAT(m, HasSubstr("rank " + last_s));
  }
  {  // a head count
    SmallBatch b(comm.size(), comm.rank());
    CpAttnConfig c = b.config();
    if (comm.rank() == last) c.num_heads_q = b.s.hq = 2;  // its views agree with its configuration
    CpAttention attn(comm, c);
    EXPECT_THAT(same_error_everywhere(comm, [&] { attn.forward(b.fwd()); }), HasSubstr("num_heads_q"));
  }
  {  // a head dim
    SmallBatch b(comm.size(), comm.rank());
    CpAttnConfig c = b.config();
    if (comm.rank() == last) c.head_dim_v = b.s.dv = 8;
    CpAttention attn(comm, c);
    EXPECT_THAT(same_error_everywhere(comm, [&] { attn.forward(b.fwd()); }), HasSubstr("head_dim_v"));
  }
  {  // a dtype (the buffers are large enough for either)
    SmallBatch b(comm.size(), comm.rank());
    CpAttnConfig c = b.config();
    if (comm.rank() == last) c.dtype = DType::bf16;
    CpAttention attn(comm, c);
    CpForwardArgs f = b.fwd();
    for (auto* v : {&f.q, &f.k, &f.v}) v->dtype = c.dtype;
    f.out.dtype = c.dtype;
    EXPECT_THAT(same_error_everywhere(comm, [&] { attn.forward(f); }), HasSubstr("dtype"));
  }
  {  // another token count: the plan's local count no longer matches on that rank
    SmallBatch b(comm.size(), comm.rank());
    if (comm.rank() == last) b.cu = {0, 10, 40};
    CpAttention attn(comm, b.config());
    const std::string m = same_error_everywhere(comm, [&] { attn.forward(b.fwd()); });
    EXPECT_THAT(m, HasSubstr("[rank " + last_s + "]"));
    EXPECT_THAT(m, HasSubstr("must be [local_tokens = "));
  }
}

TEST_F(CpAttentionTest, BadArgumentsOnOneRankFailEveryRank) {
  SmallBatch b(comm.size(), comm.rank());
  CpAttention attn(comm, b.config());
  CpForwardArgs f = b.fwd();
  if (comm.rank() == 0) f.q.data = nullptr;
  EXPECT_THAT(same_error_everywhere(comm, [&] { attn.forward(f); }),
              HasSubstr("[rank 0] CpAttention::forward: q must not be null"));
  std::vector<int64_t> bad{0, 10, 10, 30};
  CpForwardArgs g = b.fwd();
  g.cu_seqlens = bad;
  EXPECT_THAT(same_error_everywhere(comm, [&] { attn.forward(g); }), HasSubstr("strictly increasing"));
  CpContext none;
  EXPECT_THAT(same_error_everywhere(comm, [&] { attn.backward(none, b.bwd()); }),
              HasSubstr("the context holds no forward"));
  EXPECT_THROW(CpAttention(comm, {.num_heads_q = 3, .num_heads_k = 2, .head_dim_qk = 8, .head_dim_v = 8}), Error);
}

TEST_F(CpAttentionTest, ADifferentCodePathIsCaughtByTheCallCounters) {
  if (comm.size() < 2) GTEST_SKIP() << "needs two ranks";
  SmallBatch b(comm.size(), comm.rank());
  CpAttention attn(comm, b.config());
  CpContext ctx = attn.forward(b.fwd());
  // Rank 0 skips backward and runs forward again; the others run backward.
  const std::string m = same_error_everywhere(comm, [&] {
    if (comm.rank() == 0)
      attn.forward(b.fwd());
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
  const std::vector<int64_t> cu{0, 10, 30};
  Global g;
  g.cu = cu;
  const int64_t n = 30;
  g.q = random_tensor(DType::f32, n * s.hq * s.dqk, 1);
  g.k = random_tensor(DType::f32, n * s.hkv * s.dqk, 2);
  g.v = random_tensor(DType::f32, n * s.hkv * s.dv, 3);
  reinterpret_cast<float*>(g.k.bytes.data())[(15 * s.hkv + 1) * s.dqk + 3] = NAN;  // doc 1, token 15
  const RankPlan p = get_thd_load_balanced_cp_metadata(cu, comm.size(), comm.rank());
  const Tensor q = local_rows(g.q, s.hq * s.dqk, p), k = local_rows(g.k, s.hkv * s.dqk, p),
               v = local_rows(g.v, s.hkv * s.dv, p);
  std::vector<float> out(p.local_tokens * s.hq * s.dv);
  CpAttention attn(comm, {.num_heads_q = s.hq, .num_heads_k = s.hkv, .head_dim_qk = s.dqk, .head_dim_v = s.dv});
  const int64_t tl = p.local_tokens;
  const CpForwardArgs args{.cu_seqlens = cu, .q = q.view(tl, s.hq, s.dqk), .k = k.view(tl, s.hkv, s.dqk),
                           .v = v.view(tl, s.hkv, s.dv), .out = contiguous(out.data(), tl, s.hq, s.dv)};
  attn.forward(args);
  // Document 0 alone, in one process, is the reference for its rows.
  std::vector<float> ref(10 * s.hq * s.dv), lse(10 * s.hq);
  const std::vector<int64_t> cu0{0, 10};
  const WorkList wl = varlen_worklist(cu0, cu0);
  attention_forward({.in = {.q = g.q.view(10, s.hq, s.dqk), .k = g.k.view(10, s.hkv, s.dqk),
                            .v = g.v.view(10, s.hkv, s.dv), .work = &wl},
                     .out = contiguous(ref.data(), 10, s.hq, s.dv), .lse = lse.data()});
  for (int64_t i = 0; i < p.local_tokens; ++i) {
    const int64_t gi = p.real_token_index[i];
    if (gi < 0 || gi >= 10) continue;
    for (int64_t e = 0; e < s.hq * s.dv; ++e) {  // finite, and equal up to fp32 blocking order
      const float want = ref[gi * s.hq * s.dv + e];
      ASSERT_TRUE(std::isfinite(out[i * s.hq * s.dv + e])) << "token " << gi;
      ASSERT_NEAR(out[i * s.hq * s.dv + e], want, 1e-5f * (1.0f + std::abs(want))) << "token " << gi;
    }
  }
  // The opt-in finite check turns the NaN into an error on every rank (the rank holding it
  // is named), before any payload moves.
  CpAttention checked(comm, {.num_heads_q = s.hq, .num_heads_k = s.hkv, .head_dim_qk = s.dqk,
                             .head_dim_v = s.dv, .check_finite = true});
  EXPECT_THAT(same_error_everywhere(comm, [&] {
                checked.forward(args);
              }),
              HasSubstr("k holds a non-finite value"));
}

TEST_F(CpAttentionTest, LargeScoresInHalfPrecisionStayFiniteAndMatchFp32) {
  const Shape s{"gqa", 4, 2, 32, 32};
  const std::vector<int64_t> cu{0, 40, 77};
  const int64_t n = 77;
  const RankPlan p = get_thd_load_balanced_cp_metadata(cu, comm.size(), comm.rank());
  const auto run = [&](const Tensor& q, const Tensor& k, const Tensor& v) {
    const DType t = q.t;
    const Tensor lq = local_rows(q, s.hq * s.dqk, p), lk = local_rows(k, s.hkv * s.dqk, p),
                 lv = local_rows(v, s.hkv * s.dv, p);
    Tensor out{t, std::vector<std::byte>(p.local_tokens * s.hq * s.dv * dtype_size(t))};
    CpAttention attn(comm, {.num_heads_q = s.hq, .num_heads_k = s.hkv, .head_dim_qk = s.dqk,
                            .head_dim_v = s.dv, .dtype = t});
    const int64_t tl = p.local_tokens;
    attn.forward({.cu_seqlens = cu, .q = lq.view(tl, s.hq, s.dqk), .k = lk.view(tl, s.hkv, s.dqk),
                  .v = lv.view(tl, s.hkv, s.dv), .out = out.view(tl, s.hq, s.dv)});
    return out.values();
  };
  const auto as_f32 = [](const Tensor& x) {
    const std::vector<float> f = x.values();
    Tensor out{DType::f32, std::vector<std::byte>(f.size() * 4)};
    std::memcpy(out.bytes.data(), f.data(), out.bytes.size());
    return out;
  };
  for (const DType t : {DType::f16, DType::bf16}) {
    // Scores of magnitude in the thousands: exp overflows fp32 unless the max is shifted out.
    const Tensor q = random_tensor(t, n * s.hq * s.dqk, 1, 30.0f), k = random_tensor(t, n * s.hkv * s.dqk, 2, 30.0f),
                 v = random_tensor(t, n * s.hkv * s.dv, 3);
    const std::vector<float> half = run(q, k, v);
    const std::vector<float> full = run(as_f32(q), as_f32(k), as_f32(v));  // the same values in fp32
    const double tol = t == DType::f16 ? 5e-3 : 2.5e-2;
    for (std::size_t i = 0; i < half.size(); ++i) {
      ASSERT_TRUE(std::isfinite(half[i])) << to_string(t) << " element " << i;
      ASSERT_NEAR(half[i], full[i], tol + tol * std::abs(full[i])) << to_string(t) << " element " << i;
    }
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
  EXPECT_THAT(same_error_everywhere(comm, [&] { attn.forward(f); }), HasSubstr("plan is for rank"));
  CpForwardArgs g = b.fwd();
  g.plan = attn.plan(b.cu);
  const std::vector<int64_t> other_cu{0, 5, 30};
  g.cu_seqlens = other_cu;
  EXPECT_THAT(same_error_everywhere(comm, [&] { attn.forward(g); }), HasSubstr("differ"));
  CpForwardArgs strided = b.fwd();
  strided.k.row_stride = 2 * strided.k.row_step();
  EXPECT_THAT(same_error_everywhere(comm, [&] { attn.forward(strided); }), HasSubstr("k must be contiguous"));
}

}  // namespace
}  // namespace cpattn
