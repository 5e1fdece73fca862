// The pass-Q scheme (queries travel, partial results come back) over MPI against a
// single-process run of the whole batch, at the rank count mpiexec gives (CTest: 2, 3, 4).
#include "cp_test_helpers.hpp"

#include <cpattn/comm.hpp>
#include <cpattn/cp.hpp>
#include <cpattn/error.hpp>

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

namespace cpattn {
namespace {

constexpr CpScheme kPassQ = CpScheme::pass_q;

TEST_F(CpAttentionTest, PassQMatchesSingleProcessEveryShapeAndDtype) {
  for (const Shape& s : kShapes)
    for (const DType t : {DType::f32, DType::f16, DType::bf16}) {
      run_and_compare(comm, s, t, KvMode::runs, MaskType::causal, 0.0f, kPassQ);
      if (HasFailure()) return;
    }
  run_and_compare(comm, kShapes[1], DType::f32, KvMode::runs, MaskType::none, 0.0f, kPassQ);
  run_and_compare(comm, kShapes[2], DType::bf16, KvMode::runs, MaskType::none, 0.0f, kPassQ);
}

TEST_F(CpAttentionTest, PassQMatchesSingleProcessOnTinyAndShortDocuments) {
  // 1-token documents, documents shorter than 2 * cp (3, 5: every cp >= 3), many tiny ones
  // (most steps have no visible pair: empty partials come back) and one long one.
  std::vector<int64_t> tiny(40, 1);
  for (std::size_t i = 0; i < tiny.size(); i += 3) tiny[i] = 2;
  const std::vector<int64_t> mixed{1, 3, 1, 5, 130, 1, 2, 7};
  for (const MaskType m : {MaskType::causal, MaskType::none}) {
    run_and_compare(comm, kShapes[1], DType::f32, KvMode::runs, m, 0.0f, kPassQ, tiny);
    run_and_compare(comm, kShapes[2], DType::bf16, KvMode::runs, m, 0.0f, kPassQ, mixed);
    if (HasFailure()) return;
  }
}

TEST_F(CpAttentionTest, PassQMatchesSingleProcessWithWindowSoftcapAlibiAndDropout) {
  // Windows smaller than a chunk (whole visiting blocks hidden) and longer ones, with causal
  // and without; the soft cap and ALiBi; dropout keyed by the owner's document positions.
  const Masks causal[] = {{.left = 10}, {.left = 0}, {.left = 30, .softcap = 5.0f, .alibi = true}};
  for (const Masks& mk : causal)
    run_and_compare(comm, kShapes[1], DType::f32, KvMode::runs, MaskType::causal, 0.0f, kPassQ, kLengths, mk);
  run_and_compare(comm, kShapes[2], DType::bf16, KvMode::runs, MaskType::none, 0.0f, kPassQ, kLengths,
                  {.left = 15, .right = 15});
  run_and_compare(comm, kShapes[1], DType::f32, KvMode::runs, MaskType::causal, 0.2f, kPassQ);
  run_and_compare(comm, kShapes[2], DType::bf16, KvMode::runs, MaskType::none, 0.2f, kPassQ);
}

TEST_F(CpAttentionTest, PassQRepeatedRunsAreBitwiseEqual) { expect_repeated_runs_bitwise_equal(comm, kPassQ, 8); }

TEST_F(CpAttentionTest, PassQAndAllGatherAgree) { expect_schemes_agree(comm, CpScheme::allgather, kPassQ); }

TEST_F(CpAttentionTest, PassQMovesQueriesOutAndPartialsBack) {
  // Without a mask every rank's queries see keys on every rank (both documents of SmallBatch
  // have real tokens in every rank's chunks), so every partial is full. Forward: cp - 1 shifts
  // of q and cp - 1 partials [lse | out] in fp32; backward: cp - 1 shifts of
  // [lse | q | out | dout] and cp - 1 partial dQ in fp32. Counted by the communicator (the
  // agreement's all-gathers on top); K/V never move.
  SmallBatch b(comm.size(), comm.rank());
  CpAttnConfig c = b.config();
  c.scheme = kPassQ;
  c.options.mask = MaskType::none;
  CpAttention attn(comm, c);
  const int64_t cp = comm.size(), rows = b.t_loc * b.s.hq;
  const int64_t q = rows * b.s.dqk * 4, o = rows * b.s.dv * 4, lse = rows * 4;
  const int64_t forward = q + lse + o, backward = lse + q + 2 * o + q;
  const int64_t s0 = comm.bytes_sent(), r0 = comm.bytes_received();
  CpContext ctx = attn.forward(b.fwd());
  attn.backward(ctx, b.bwd());
  const int64_t sent = comm.bytes_sent() - s0, recv = comm.bytes_received() - r0;
  const int64_t payload = (cp - 1) * (forward + backward);
  EXPECT_GE(sent, payload);
  EXPECT_LT(sent, payload + 4096 * cp);  // agreement fingerprints are small
  EXPECT_EQ(sent, recv);
}

TEST_F(CpAttentionTest, PassQNameAndIndexModeRejected) {
  SmallBatch b(comm.size(), comm.rank());
  CpAttnConfig c = b.config();
  c.scheme = kPassQ;
  c.kv_mode = KvMode::index;
  EXPECT_THROW(CpAttention(comm, c), Error);
  EXPECT_EQ(to_string(kPassQ), "pass-q");
}

}  // namespace
}  // namespace cpattn
