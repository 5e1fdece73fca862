// What the CP attention tests share: the shapes, the document mix, the comparison of one CP
// run (forward and backward) with a single-process run of the whole batch, and a small batch
// for the bitwise and agreement checks. Included by one test file per scheme family.
#pragma once

#include <cpattn/check/batch.hpp>
#include <cpattn/check/cases.hpp>
#include <cpattn/check/compare.hpp>
#include <cpattn/check/gather.hpp>
#include <cpattn/check/tensor.hpp>

#include <cpattn/comm.hpp>
#include <cpattn/cp.hpp>
#include <cpattn/dtype.hpp>
#include <cpattn/layout.hpp>
#include <cpattn/plan.hpp>

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

namespace cpattn {
namespace {

struct Shape {
  const char* name;
  int hq, hkv, dqk, dv;
  check::BatchShape batch() const { return {.heads_q = hq, .heads_k = hkv, .head_dim_qk = dqk, .head_dim_v = dv}; }
};
constexpr Shape kShapes[] = {{"mha", 8, 8, 64, 64}, {"gqa", 8, 2, 64, 64}, {"mla", 8, 2, 192, 128}};

// Documents of which some need padding at every cp in 2..5, and a 1-token document (whose
// chunks past the first are all padding).
const std::vector<int64_t> kLengths{37, 100, 1, 64, 23, 9};

constexpr uint64_t kSeed = 1;  // the batch of every single-process comparison

// One rank's rows of a batch (plan p), and buffers for its outputs and gradients.
struct LocalRows {
  check::Tensor q, k, v, dout, out, dq, dk, dv;
  std::vector<float> lse;
  LocalRows(const check::Batch& b, const RankPlan& p, const Shape& s, DType t)
      : q(check::local_rows(b.q, p)), k(check::local_rows(b.k, p)), v(check::local_rows(b.v, p)),
        dout(check::local_rows(b.dout, p)), out(t, {p.local_tokens, s.hq, s.dv}), dq(t, q.shape), dk(t, k.shape),
        dv(t, v.shape), lse(static_cast<std::size_t>(p.local_tokens * s.hq)) {}
};

// Asserts the pass rule of check/tolerance.hpp; the message names the tensor and its worst row.
void expect_pass(const check::TensorReport& r) { EXPECT_TRUE(r.pass) << r.describe(); }

// Every padding row of a rank's output exactly zero, of its lse exactly -inf.
void expect_padding_rows_zero(const RankPlan& p, const check::Tensor& out, const check::Tensor& dq,
                              const check::Tensor& dk, const check::Tensor& dv, const float* lse) {
  const std::pair<const char*, const check::Tensor*> tensors[] = {{"out", &out}, {"dq", &dq}, {"dk", &dk}, {"dv", &dv}};
  for (const auto& [name, x] : tensors)
    EXPECT_EQ(check::nonzero_padding_rows(x->view(), p), 0) << name << ": padding rows that are not zero";
  EXPECT_EQ(check::padding_rows_not_equal(contiguous(lse, p.local_tokens, out.shape.heads, 1), p, -INFINITY), 0)
      << "lse: padding rows that are not -inf";
}

class CpAttentionTest : public ::testing::Test {
 protected:
  Communicator comm{MPI_COMM_WORLD, CommOptions{.timeout_s = 120.0, .on_timeout = TimeoutAction::abort}};
};

// AttnOptions' window, soft cap and ALiBi for run_and_compare.
struct Masks {
  int64_t left = -1, right = -1;
  float softcap = 0.0f;
  bool alibi = false;
};

[[maybe_unused]] void run_and_compare(Communicator& comm, const Shape& s, DType t, KvMode mode,
                     MaskType mask = MaskType::causal, float dropout_p = 0.0f,
                     CpScheme scheme = CpScheme::allgather, const std::vector<int64_t>& lengths = kLengths,
                     Masks mk = {}) {
  SCOPED_TRACE(::testing::Message() << s.name << " dtype " << to_string(t) << " mode "
                                    << (mode == KvMode::runs ? "runs" : "index") << " mask "
                                    << (mask == MaskType::causal ? "causal" : "none") << " dropout "
                                    << dropout_p << " scheme " << to_string(scheme) << " documents "
                                    << lengths.size() << " window " << mk.left << "," << mk.right
                                    << " softcap " << mk.softcap << " alibi " << mk.alibi << " cp " << comm.size());
  const std::vector<float> slopes = check::alibi_slopes(s.hq);
  const AttnOptions options{.mask = mask, .dropout_p = dropout_p, .seed = 77, .path = best_kernel_path(),
                            .window_size_left = mk.left, .window_size_right = mk.right,
                            .softcap = mk.softcap, .alibi_slopes = mk.alibi ? slopes.data() : nullptr};
  const check::Batch b = check::random_batch(cu_seqlens_from_lengths(lengths), s.batch(), t, kSeed);
  const check::Results want = check::single_process(b, options);
  CpAttention attn(comm, {.num_heads_q = s.hq, .num_heads_k = s.hkv, .head_dim_qk = s.dqk,
                          .head_dim_v = s.dv, .dtype = t, .options = options, .kv_mode = mode,
                          .scheme = scheme});
  const RankPlan p = get_thd_load_balanced_cp_metadata(b.cu_seqlens, comm.size(), comm.rank());
  LocalRows rows(b, p, s, t);
  auto& [q, k, v, dout, out, dq, dk, dv, lse] = rows;
  CpContext ctx = attn.forward({.cu_seqlens = b.cu_seqlens, .q = q.view(), .k = k.view(), .v = v.view(),
                                .out = out.view(), .lse = lse.data()});
  attn.backward(ctx, {.q = q.view(), .out = out.view(), .dout = dout.view(), .dq = dq.view(), .dk = dk.view(),
                      .dv = dv.view()});
  EXPECT_FALSE(ctx.valid());  // consumed

  expect_padding_rows_zero(p, out, dq, dk, dv, lse.data());
  // Every rank's real rows, gathered into the global order on every rank.
  const check::Results got = check::gather_results(
      comm, p, {.out = out.view(), .dq = dq.view(), .dk = dk.view(), .dv = dv.view(), .lse = lse.data()});
  expect_pass(check::compare("out", got.out, want.out, t, b.out_shape().row_elements()));
  expect_pass(check::compare("dq", got.dq, want.dq, t, b.q_shape().row_elements()));
  expect_pass(check::compare("dk", got.dk, want.dk, t, b.k_shape().row_elements()));
  expect_pass(check::compare("dv", got.dv, want.dv, t, b.v_shape().row_elements()));
  expect_pass(check::compare_lse(got.lse, want.lse, t, s.hq));
  EXPECT_GE(attn.stats().comm_s, 0.0);
  EXPECT_EQ(attn.stats().forward_calls, 1);
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

// Random values for a SmallBatch (the same on every call for a rank).
void randomize(SmallBatch& b, int rank) {
  std::mt19937 rng(31 + rank);
  std::normal_distribution<float> d;
  for (auto* vec : {&b.q, &b.k, &b.v, &b.dout})
    for (float& x : *vec) x = d(rng);
}


// `runs` forward+backward calls of `scheme` (dropout on) on one SmallBatch: out, lse, dq, dk,
// dv bitwise equal to the first call's every time.
[[maybe_unused]] void expect_repeated_runs_bitwise_equal(Communicator& comm, CpScheme scheme, int runs) {
  SmallBatch b(comm.size(), comm.rank());
  randomize(b, comm.rank());
  CpAttnConfig c = b.config();
  c.scheme = scheme;
  c.options.dropout_p = 0.1f;
  CpAttention attn(comm, c);
  std::vector<float> out0, dq0, dk0, dv0, lse0, lse(static_cast<std::size_t>(b.t_loc * b.s.hq));
  for (int i = 0; i < runs; ++i) {
    CpForwardArgs f = b.fwd();
    f.lse = lse.data();
    CpContext ctx = attn.forward(f);
    attn.backward(ctx, b.bwd());
    if (i == 0) {
      out0 = b.out, dq0 = b.dq, dk0 = b.dk, dv0 = b.dv, lse0 = lse;
      continue;
    }
    ASSERT_EQ(std::memcmp(out0.data(), b.out.data(), b.out.size() * 4), 0);
    ASSERT_EQ(std::memcmp(lse0.data(), lse.data(), lse.size() * 4), 0);
    ASSERT_EQ(std::memcmp(dq0.data(), b.dq.data(), b.dq.size() * 4), 0);
    ASSERT_EQ(std::memcmp(dk0.data(), b.dk.data(), b.dk.size() * 4), 0);
    ASSERT_EQ(std::memcmp(dv0.data(), b.dv.data(), b.dv.size() * 4), 0);
  }
}

// Schemes `a` and `b` on the same SmallBatch, causal and without a mask: out, dq, dk and dv
// within fp32 rounding of each other.
[[maybe_unused]] void expect_schemes_agree(Communicator& comm, CpScheme a, CpScheme b) {
  for (const MaskType m : {MaskType::causal, MaskType::none}) {
    SCOPED_TRACE(m == MaskType::causal ? "causal" : "none");
    std::vector<float> res[2][4];
    for (int i = 0; i < 2; ++i) {
      SmallBatch x(comm.size(), comm.rank());
      randomize(x, comm.rank());
      CpAttnConfig c = x.config();
      c.scheme = i == 0 ? a : b;
      c.options.mask = m;
      CpAttention attn(comm, c);
      CpContext ctx = attn.forward(x.fwd());
      attn.backward(ctx, x.bwd());
      res[i][0] = x.out, res[i][1] = x.dq, res[i][2] = x.dk, res[i][3] = x.dv;
    }
    for (int j = 0; j < 4; ++j) {
      ASSERT_EQ(res[0][j].size(), res[1][j].size());
      for (std::size_t e = 0; e < res[0][j].size(); ++e)
        ASSERT_NEAR(res[0][j][e], res[1][j][e], 1e-4f * (1.0f + std::fabs(res[0][j][e])))
            << "tensor " << j << " element " << e;
    }
  }
}

}  // namespace
}  // namespace cpattn
