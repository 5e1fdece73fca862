// The simulator's communication volumes against the bytes the real schemes move: every scheme
// (and the hybrid at every cp_inner dividing cp), forward and backward, on every rank, exactly.
// CpStats::bytes_sent/bytes_received count the payload of the layer's calls (the hybrid's outer
// agreement included); the world communicator's own counter adds the call's agreement.
// CTest runs it at 2, 3 and 4 ranks.
#include <cpattn/comm.hpp>
#include <cpattn/cp.hpp>
#include <cpattn/layout.hpp>
#include <cpattn/plan.hpp>
#include <cpattn/sim.hpp>

#include <gtest/gtest.h>

#include "sim/sim_profile.hpp"

#include <cstddef>
#include <vector>

namespace cpattn {
namespace {

struct Case {
  int hq, hkv, dqk, dv;
  DType dtype;
  MaskType mask;
  std::vector<int64_t> lengths;
};

void expect_bytes_match(Communicator& comm, const Case& k, CpScheme scheme, int cp_inner, bool overlap) {
  const int cp = comm.size(), rank = comm.rank();
  SCOPED_TRACE(::testing::Message() << "scheme " << to_string(scheme) << " cp_inner " << cp_inner << " cp " << cp
                                    << " hq " << k.hq << " hkv " << k.hkv << " dqk " << k.dqk << " dv " << k.dv
                                    << " dtype " << to_string(k.dtype) << " documents " << k.lengths.size()
                                    << " overlap " << overlap);
  const std::vector<int64_t> cu = cu_seqlens_from_lengths(k.lengths);
  SimInput in{.cu_seqlens = cu,
              .model = {.num_heads_q = k.hq, .num_heads_k = k.hkv, .head_dim_qk = k.dqk, .head_dim_v = k.dv,
                        .dtype = k.dtype, .mask = k.mask},
              .mesh = {.cp = cp, .cp_inner = scheme == CpScheme::hybrid ? cp_inner : 0},
              .profile = cpattn::testing::hand_profile(),
              .find_breakeven = false,
              .overlap = overlap};
  const SchemePrediction p = simulate_scheme(in, scheme);
  ASSERT_TRUE(p.valid) << p.reason;
  ASSERT_EQ(p.forward.size(), static_cast<std::size_t>(cp));

  CpAttnConfig cfg{.num_heads_q = k.hq, .num_heads_k = k.hkv, .head_dim_qk = k.dqk, .head_dim_v = k.dv,
                   .dtype = k.dtype, .options = {.mask = k.mask}, .scheme = scheme,
                   .cp_inner = scheme == CpScheme::hybrid ? cp_inner : 0, .overlap = overlap,
                   .shared_memory = false};  // the simulator models messages (ranks past one host)
  CpAttention attn(comm, cfg);
  const auto plan = attn.plan(cu);
  const int64_t t = plan->local_tokens;
  const std::size_t es = dtype_size(k.dtype);
  // Values do not change what moves: zeros (finite) of the storage dtype.
  std::vector<std::byte> q(t * k.hq * k.dqk * es), kk(t * k.hkv * k.dqk * es), v(t * k.hkv * k.dv * es),
      out(t * k.hq * k.dv * es), dout(out.size()), dq(q.size()), dk(kk.size()), dv(v.size());
  const CpForwardArgs fa{.plan = plan,
                         .q = contiguous(q.data(), t, k.hq, k.dqk, k.dtype),
                         .k = contiguous(kk.data(), t, k.hkv, k.dqk, k.dtype),
                         .v = contiguous(v.data(), t, k.hkv, k.dv, k.dtype),
                         .out = contiguous(out.data(), t, k.hq, k.dv, k.dtype)};
  const CpBackwardArgs ba{.q = fa.q, .out = fa.out, .dout = contiguous(dout.data(), t, k.hq, k.dv, k.dtype),
                          .dq = contiguous(dq.data(), t, k.hq, k.dqk, k.dtype),
                          .dk = contiguous(dk.data(), t, k.hkv, k.dqk, k.dtype),
                          .dv = contiguous(dv.data(), t, k.hkv, k.dv, k.dtype)};
  {  // warm-up: the a2a and hybrid schemes split their sub-groups at the first forward
    CpContext ctx = attn.forward(fa);
    attn.backward(ctx, ba);
  }
  const bool payload_on_world = scheme != CpScheme::a2a && scheme != CpScheme::hybrid;
  const SimCall& f = p.forward[rank];
  const SimCall& b = p.backward[rank];
  int64_t s0 = attn.stats().bytes_sent, r0 = attn.stats().bytes_received;
  int64_t w0 = comm.bytes_sent(), v0 = comm.bytes_received();
  CpContext ctx = attn.forward(fa);
  EXPECT_EQ(attn.stats().bytes_sent - s0, f.payload.sent()) << "forward bytes sent";
  EXPECT_EQ(attn.stats().bytes_received - r0, f.payload.received()) << "forward bytes received";
  EXPECT_EQ(comm.bytes_sent() - w0, f.agreement.sent() + (payload_on_world ? f.payload.sent() : 0))
      << "forward bytes sent on the CP communicator (agreement included)";
  EXPECT_EQ(comm.bytes_received() - v0, f.agreement.received() + (payload_on_world ? f.payload.received() : 0));
  s0 = attn.stats().bytes_sent;
  r0 = attn.stats().bytes_received;
  w0 = comm.bytes_sent();
  v0 = comm.bytes_received();
  attn.backward(ctx, ba);
  EXPECT_EQ(attn.stats().bytes_sent - s0, b.payload.sent()) << "backward bytes sent";
  EXPECT_EQ(attn.stats().bytes_received - r0, b.payload.received()) << "backward bytes received";
  EXPECT_EQ(comm.bytes_sent() - w0, b.agreement.sent() + (payload_on_world ? b.payload.sent() : 0))
      << "backward bytes sent on the CP communicator (agreement included)";
  EXPECT_EQ(comm.bytes_received() - v0, b.agreement.received() + (payload_on_world ? b.payload.received() : 0));
  // Memory: past the caller's q, k, v and out, the simulator's peak (one layer, one micro-batch)
  // is the layer's estimate without the kernel's scratch, which bounds what the layer held.
  const CpMemoryEstimate e = cp_memory_estimate(attn.config(), *plan);
  const double caller = static_cast<double>(t) * (k.hq + k.hkv) * (k.dqk + k.dv) * static_cast<double>(es);
  const auto layer = static_cast<double>(e.context + e.buffers);
  EXPECT_NEAR(p.peak_memory_gb * 1e9, caller + layer, 1e-9 * layer) << "simulated peak memory, " << e.describe();
  EXPECT_LE(attn.stats().peak_buffer_bytes, e.context + e.buffers) << "measured buffers, " << e.describe();
}

class SimBytesTest : public ::testing::Test {
 protected:
  Communicator comm{MPI_COMM_WORLD, CommOptions{.timeout_s = 120.0, .on_timeout = TimeoutAction::abort}};
};

// Heads that every scheme takes at cp = 2, 3, 4: 12 query heads; KV heads split (12) or one
// replicated (1). Odd head dims, a 1-token document, documents shorter than 2 * cp.
const Case kCases[] = {
    {12, 1, 7, 5, DType::f32, MaskType::causal, {37, 1, 64, 23, 9, 2}},
    {12, 12, 8, 3, DType::bf16, MaskType::causal, {5, 40}},
    {12, 1, 4, 4, DType::f16, MaskType::none, {1, 19, 3}},
    // Many tiny documents: most pass-Q steps see no pair (empty partials come back).
    {12, 1, 4, 4, DType::f32, MaskType::causal, {1, 1, 2, 1, 1, 3, 1}},
};

// Both settings of the all-gather's overlap (CpAttnConfig::overlap, SimInput::overlap; the
// 12-KV-head case runs 4 groups with it, the others one): the same bytes, and the simulator's
// memory follows the layer's estimate of each.
TEST_F(SimBytesTest, EverySchemeMatchesTheCommunicatorsCountsExactly) {
  for (const bool overlap : {true, false})
    for (const Case& k : kCases)
      for (const CpScheme s : kCpSchemes) {
        if (s == CpScheme::hybrid) {
          for (int inner = 1; inner <= comm.size(); ++inner)
            if (comm.size() % inner == 0) expect_bytes_match(comm, k, s, inner, overlap);
        } else {
          expect_bytes_match(comm, k, s, 0, overlap);
        }
        if (HasFailure()) return;
      }
}

}  // namespace
}  // namespace cpattn
