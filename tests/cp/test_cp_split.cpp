// CP attention with the padding-free split (docs/planner.md, docs/cp.md) against a
// single-process run of the whole batch, at the rank count mpiexec gives (CTest: 2, 3, 4).
#include <cpattn/check/batch.hpp>
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

#include <cstring>
#include <tuple>
#include <vector>

namespace cpattn {
namespace {

using ::testing::HasSubstr;

struct Shape {
  const char* name;
  int hq, hkv, dqk, dv;
  check::BatchShape batch() const { return {.heads_q = hq, .heads_k = hkv, .head_dim_qk = dqk, .head_dim_v = dv}; }
};
constexpr Shape kGqa{"gqa", 4, 2, 32, 32};
constexpr Shape kMla{"mla", 4, 1, 48, 32};

// Lengths that are no multiple of 2*cp at cp = 2..4, 1- and 2-token documents (empty chunks on
// most ranks): the ranks' local token counts differ.
const std::vector<int64_t> kLengths{37, 1, 100, 2, 23, 9, 1, 64};

class CpSplitTest : public ::testing::Test {
 protected:
  Communicator comm{MPI_COMM_WORLD, CommOptions{.timeout_s = 120.0, .on_timeout = TimeoutAction::abort}};
};

struct SplitRun {
  check::Results got;
  std::vector<std::byte> bytes;  // out, dq, dk, dv and lse of this rank, for bitwise repeats
};

// How the all-gather moves K/V and dK/dV (runs mode): shared memory (the default on one host),
// or messages, overlapped by KV-head groups or not.
struct Transport {
  bool shared_memory = true, overlap = true;
};

SplitRun run_split(Communicator& comm, const check::Batch& b, const Shape& s, DType t, const AttnOptions& options,
              KvMode mode, Transport tr = {}) {
  CpAttention attn(comm, {.num_heads_q = s.hq, .num_heads_k = s.hkv, .head_dim_qk = s.dqk, .head_dim_v = s.dv,
                          .dtype = t, .options = options, .kv_mode = mode, .split = CpSplit::padding_free,
                          .overlap = tr.overlap, .shared_memory = tr.shared_memory});
  const std::shared_ptr<const RankPlan> plan = attn.plan(b.cu_seqlens);
  const RankPlan& p = *plan;
  EXPECT_EQ(p.split, CpSplit::padding_free);
  EXPECT_EQ(p.padding_tokens, 0);
  const check::Tensor q = check::local_rows(b.q, p), k = check::local_rows(b.k, p), v = check::local_rows(b.v, p),
                      dout = check::local_rows(b.dout, p);
  check::Tensor out(t, {p.local_tokens, s.hq, s.dv}), dq(t, q.shape), dk(t, k.shape), dv(t, v.shape);
  std::vector<float> lse(static_cast<std::size_t>(p.local_tokens * s.hq));
  CpContext ctx = attn.forward({.plan = plan, .q = q.view(), .k = k.view(), .v = v.view(), .out = out.view(),
                                .lse = lse.data()});
  attn.backward(ctx, {.q = q.view(), .out = out.view(), .dout = dout.view(), .dq = dq.view(), .dk = dk.view(),
                      .dv = dv.view()});
  SplitRun r;
  r.got = check::gather_results(comm, p,
                                {.out = out.view(), .dq = dq.view(), .dk = dk.view(), .dv = dv.view(), .lse = lse.data()});
  for (const check::Tensor* x : {&out, &dq, &dk, &dv}) {
    const auto* d = static_cast<const std::byte*>(x->data());
    r.bytes.insert(r.bytes.end(), d, d + x->size() * dtype_size(x->dtype));
  }
  const auto* l = reinterpret_cast<const std::byte*>(lse.data());
  r.bytes.insert(r.bytes.end(), l, l + lse.size() * sizeof(float));
  return r;
}

void compare_split(Communicator& comm, const Shape& s, DType t, MaskType mask, KvMode mode,
                   const std::vector<int64_t>& lengths = kLengths, Transport tr = {}) {
  SCOPED_TRACE(::testing::Message() << s.name << " dtype " << to_string(t) << " mask "
                                    << (mask == MaskType::causal ? "causal" : "none") << " mode "
                                    << (mode == KvMode::runs ? "runs" : "index") << " cp " << comm.size()
                                    << " shared memory " << tr.shared_memory << " overlap " << tr.overlap);
  const AttnOptions options{.mask = mask, .seed = 7, .path = best_kernel_path()};
  const check::Batch b = check::random_batch(cu_seqlens_from_lengths(lengths), s.batch(), t, 3);
  const check::Results want = check::single_process(b, options);
  const SplitRun r = run_split(comm, b, s, t, options, mode, tr);
  for (const auto& [name, got, ref, row] :
       {std::tuple{"out", &r.got.out, &want.out, b.out_shape().row_elements()},
        std::tuple{"dq", &r.got.dq, &want.dq, b.q_shape().row_elements()},
        std::tuple{"dk", &r.got.dk, &want.dk, b.k_shape().row_elements()},
        std::tuple{"dv", &r.got.dv, &want.dv, b.v_shape().row_elements()}}) {
    const check::TensorReport rep = check::compare(name, *got, *ref, t, row);
    EXPECT_TRUE(rep.pass) << rep.describe();
  }
  const check::TensorReport lse = check::compare_lse(r.got.lse, want.lse, t, s.hq);
  EXPECT_TRUE(lse.pass) << lse.describe();
}

TEST_F(CpSplitTest, MatchesSingleProcessEveryDtypeGqaAndMla) {
  for (const Shape& s : {kGqa, kMla})
    for (const DType t : {DType::f32, DType::f16, DType::bf16}) {
      compare_split(comm, s, t, MaskType::causal, KvMode::runs);
      if (HasFailure()) return;
    }
}

TEST_F(CpSplitTest, NoMaskAndIndexModeMatchToo) {
  compare_split(comm, kGqa, DType::f32, MaskType::none, KvMode::runs);
  compare_split(comm, kMla, DType::bf16, MaskType::causal, KvMode::index);
}

// One 1-token document: every rank but one holds no token, and its views have no rows (null
// data): the call, the plan's row copies and the results' gather take them. (1 + 2 tokens: at
// cp = 4 one rank holds none.)
TEST_F(CpSplitTest, RanksWithNoTokenTakePart) {
  for (const std::vector<int64_t>& lengths : {std::vector<int64_t>{1}, std::vector<int64_t>{1, 2}}) {
    const SplitLayout l = split_layout(cu_seqlens_from_lengths(lengths), comm.size(), CpSplit::padding_free);
    int empty = 0;
    for (int r = 0; r < comm.size(); ++r) empty += l.rank_tokens(r) == 0 ? 1 : 0;
    if (lengths.size() == 1) {
      EXPECT_EQ(empty, comm.size() - 1) << "ranks that hold no token";
    }
    compare_split(comm, kGqa, DType::f32, MaskType::causal, KvMode::runs, lengths);
    compare_split(comm, kMla, DType::bf16, MaskType::causal, KvMode::index, lengths);
    compare_split(comm, kGqa, DType::f32, MaskType::causal, KvMode::index, lengths);
    // through messages: overlapped by KV-head groups (GQA's two), and in one call
    compare_split(comm, kGqa, DType::f32, MaskType::causal, KvMode::runs, lengths, {.shared_memory = false});
    compare_split(comm, kGqa, DType::bf16, MaskType::causal, KvMode::runs, lengths,
                  {.shared_memory = false, .overlap = false});
    if (HasFailure()) return;
  }
}

TEST_F(CpSplitTest, LocalCountsDifferAndRepeatsAreBitwiseEqual) {
  const check::Batch b = check::random_batch(cu_seqlens_from_lengths(kLengths), kGqa.batch(), DType::f32, 5);
  const AttnOptions options{.path = best_kernel_path()};
  const SplitRun first = run_split(comm, b, kGqa, DType::f32, options, KvMode::runs);
  const SplitRun second = run_split(comm, b, kGqa, DType::f32, options, KvMode::runs);
  ASSERT_EQ(first.bytes.size(), second.bytes.size());
  EXPECT_EQ(std::memcmp(first.bytes.data(), second.bytes.data(), first.bytes.size()), 0);
  // The batch really exercises the varying all-gather: the ranks' counts are not all equal.
  const SplitLayout l = split_layout(b.cu_seqlens, comm.size(), CpSplit::padding_free);
  bool differ = false;
  for (int r = 1; r < comm.size(); ++r) differ = differ || l.rank_tokens(r) != l.rank_tokens(0);
  EXPECT_TRUE(differ);
}

TEST_F(CpSplitTest, RingAndMismatchedPlansAreRefused) {
  const CpAttnConfig cfg{.num_heads_q = 4, .num_heads_k = 2, .head_dim_qk = 32, .head_dim_v = 32,
                         .scheme = CpScheme::ring, .split = CpSplit::padding_free};
  try {
    CpAttention ring(comm, cfg);
    ADD_FAILURE() << "the ring scheme took the padding-free split";
  } catch (const Error& e) {
    EXPECT_THAT(e.message(), HasSubstr("padding-free split needs scheme allgather"));
  }
  // A padded plan handed to a padding-free layer: every rank fails with the same message.
  CpAttnConfig free_cfg = cfg;
  free_cfg.scheme = CpScheme::allgather;
  CpAttention attn(comm, free_cfg);
  const std::vector<int64_t> cu{0, 7, 12};
  auto plan = std::make_shared<const RankPlan>(get_thd_load_balanced_cp_metadata(cu, comm.size(), comm.rank()));
  check::Tensor q(DType::f32, {plan->local_tokens, 4, 32}), k(DType::f32, {plan->local_tokens, 2, 32}),
      v(DType::f32, {plan->local_tokens, 2, 32}), out(DType::f32, {plan->local_tokens, 4, 32});
  try {
    (void)attn.forward({.plan = plan, .q = q.view(), .k = k.view(), .v = v.view(), .out = out.view()});
    ADD_FAILURE() << "a padded plan ran on a padding-free layer";
  } catch (const Error& e) {
    EXPECT_THAT(e.message(), HasSubstr("plan is of the padded split, the layer's is padding-free"));
  }
}

}  // namespace
}  // namespace cpattn
