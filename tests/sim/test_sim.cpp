// The simulator (include/cpattn/sim.hpp) against hand-worked cases, the planner, and its
// monotonicity; bad profiles and meshes. No MPI (tests/sim/test_sim_bytes.cpp holds the bytes
// against the real schemes).
#include <cpattn/error.hpp>
#include <cpattn/layout.hpp>
#include <cpattn/pipeline.hpp>
#include <cpattn/plan.hpp>
#include <cpattn/sim.hpp>

#include <gtest/gtest.h>

#include "sim/sim_profile.hpp"

#include <cmath>
#include <string>
#include <tuple>
#include <vector>

namespace cpattn {
namespace {

using cpattn::testing::hand_profile;

// docs/design.md section 4's batch: [0, 16, 40] at cp = 2, 218 visible pairs on each rank,
// T_loc = 20. Two heads of dim 4, fp32. The all-gather's overlap off: the hand-worked cases
// below are the non-overlapped order (AllGatherOverlap... turn it on).
const std::vector<int64_t> kCu{0, 16, 40};
SimInput hand_input() {
  return {.cu_seqlens = kCu,
          .model = {.num_heads_q = 2, .num_heads_k = 2, .head_dim_qk = 4, .head_dim_v = 4, .dtype = DType::f32},
          .mesh = {.cp = 2},
          .profile = hand_profile(),
          .find_breakeven = false,
          .overlap = false};
}

TEST(Sim, AllGatherOnOneLinkClassWithoutOverlapMatchesTheHandWorkedTimes) {
  const SchemePrediction p = simulate_scheme(hand_input(), CpScheme::allgather);
  // Forward: 218 pairs x 2 heads x 2 (4 + 4) = 6976 FLOP at 1 GFLOP/s = 6.976 us. Agreement: one
  // ring step of 408 bytes, 10 us + 0.408 us; K then V: one step of 20 x 2 x 4 x 4 = 640 bytes
  // each, 10.64 us. Nothing overlaps.
  EXPECT_NEAR(p.forward[0].compute_s, 6.976e-6, 1e-15);
  EXPECT_NEAR(p.forward[0].exposed_s, 10.408e-6 + 2 * 10.64e-6, 1e-15);
  EXPECT_EQ(p.forward[0].hidden_s, 0.0);
  // Backward: 218 x 2 x 2 (3*4 + 2*4) = 17440 FLOP at 0.5 GFLOP/s = 34.88 us; the fp32 dK and
  // dV reduce-scatters are again one step of 640 bytes each.
  EXPECT_NEAR(p.backward[1].compute_s, 34.88e-6, 1e-15);
  EXPECT_NEAR(p.backward[1].exposed_s, 10.408e-6 + 2 * 10.64e-6, 1e-15);
  // One layer, one micro-batch, no pipeline: the step is the two calls.
  EXPECT_NEAR(p.step_s, 6.976e-6 + 34.88e-6 + 2 * (10.408e-6 + 21.28e-6), 1e-14);
  EXPECT_NEAR(p.compute_s, 6.976e-6 + 34.88e-6, 1e-14);
  EXPECT_NEAR(p.exposed_comm_s, 2 * (10.408e-6 + 21.28e-6), 1e-14);
  EXPECT_NEAR(p.bubble_s, 0.0, 1e-15);
  // Bytes: all on the one intra-node link, none inter-node.
  EXPECT_EQ(p.forward[0].payload.sent_intra, 2 * 640);
  EXPECT_EQ(p.forward[0].payload.sent_inter, 0);
  EXPECT_EQ(p.forward[0].agreement.sent_intra, 408);
}

// The all-gather's overlap (SimInput::overlap): Hkv = 2 gives two KV-head groups, and the
// forward's first is cut in two groups of documents: document 0 holds 136 of the 436 causal
// pairs (0.31, the share nearest 1/4 within [1/16, 1/2]); the backward's last document holds
// 300 (over 1/2: no cut). Forward units: group 0 over document 0 (8 rows a rank: K then V of
// 8 x 1 head x 4 dims x 4 bytes), over document 1 (12 rows), group 1 (20 rows); their calls
// take 3.488 us x 136 / 436 = 1.088 us, 2.4 us and 3.488 us. Each unit's call starts once its
// K/V are in and the call before has ended. Backward: group 0's dK/dV under group 1's call,
// group 1's exposed.
TEST(Sim, AllGatherOverlapHidesTheLaterUnitsUnderTheEarlierCalls) {
  SimInput in = hand_input();
  in.overlap = true;
  in.profile.intra = {.bandwidth_gbs = 1, .latency_us = 0};  // 20 rows' K + V: 0.64 us; agreement 0.408 us
  SchemePrediction p = simulate_scheme(in, CpScheme::allgather);
  // Forward: document 0's 0.256 us exposed; document 1's 0.384 us in by 0.64 us, before the
  // first call ends (1.344 us); group 1's in by 1.28 us, before the second ends.
  EXPECT_NEAR(p.forward[0].compute_s, 6.976e-6, 1e-15);
  EXPECT_NEAR(p.forward[0].exposed_s, 0.408e-6 + 0.256e-6, 1e-15);
  EXPECT_NEAR(p.forward[0].hidden_s, 0.384e-6 + 0.64e-6, 1e-15);
  // Backward: 0.64 us under half of 34.88 us.
  EXPECT_NEAR(p.backward[1].exposed_s, 0.408e-6 + 0.64e-6, 1e-15);
  EXPECT_NEAR(p.backward[1].hidden_s, 0.64e-6, 1e-15);
  EXPECT_NEAR(p.exposed_comm_s, 2 * 0.408e-6 + 0.256e-6 + 0.64e-6, 1e-14);
  EXPECT_NEAR(p.hidden_comm_s, 0.384e-6 + 2 * 0.64e-6, 1e-14);
  // The same bytes as without overlap (the units' rows and heads tile the payload).
  EXPECT_EQ(p.forward[0].payload.sent_intra, 2 * 640);
  EXPECT_EQ(p.backward[0].payload.received_intra, 2 * 640);
  // A slow link: the units' K + V take 2.56, 3.84 and 6.4 us, in by 2.56, 6.4 and 12.8 us; the
  // calls end at 3.648, 8.8 and 16.288 us: 16.288 - 6.976 us exposed (group 1's gather, longer
  // than the calls before it). The backward's 17.44 us still hide group 0's dK/dV.
  in.profile.intra = {.bandwidth_gbs = 0.1, .latency_us = 0};
  p = simulate_scheme(in, CpScheme::allgather);
  EXPECT_NEAR(p.forward[0].exposed_s, 4.08e-6 + (16.288e-6 - 6.976e-6), 1e-14);
  EXPECT_NEAR(p.forward[0].hidden_s, 12.8e-6 - (16.288e-6 - 6.976e-6), 1e-14);
  EXPECT_NEAR(p.backward[0].exposed_s, 4.08e-6 + 6.4e-6, 1e-14);
  EXPECT_NEAR(p.backward[0].hidden_s, 6.4e-6, 1e-14);
}

// The mirror batch [0, 24, 40]: the backward's last document holds 136 of the 436 pairs
// (0.31), the forward's first 300 (no cut). Backward units (fp32 dK + dV of 32 bytes a row):
// group 0 (20 rows, 17.44 us of the 34.88 us call), group 1 over document 0 (12 rows, 17.44 x
// 300 / 436 = 12 us), over document 1 (8 rows, 5.44 us), the small one last.
TEST(Sim, AllGatherOverlapCutsTheBackwardsLastGroupSmallLast) {
  SimInput in = hand_input();
  const std::vector<int64_t> cu{0, 24, 40};
  in.cu_seqlens = cu;
  in.overlap = true;
  in.profile.intra = {.bandwidth_gbs = 1, .latency_us = 0};
  SchemePrediction p = simulate_scheme(in, CpScheme::allgather);
  ASSERT_NEAR(p.backward[0].compute_s, 34.88e-6, 1e-15);
  // 0.64 us out by 18.08 us, 0.384 by 29.824, before the last call ends (34.88): the last
  // unit's 0.256 us exposed.
  EXPECT_NEAR(p.backward[0].exposed_s, 0.408e-6 + 0.256e-6, 1e-15);
  EXPECT_NEAR(p.backward[0].hidden_s, 0.64e-6 + 0.384e-6, 1e-15);
  EXPECT_NEAR(p.forward[0].exposed_s, 0.408e-6 + 0.64e-6, 1e-15);  // no forward cut: group 0 whole
  EXPECT_EQ(p.backward[0].payload.received_intra, 2 * 640);
  // 0.05 GB/s: 12.8, 7.68 and 5.12 us; out by 30.24 and 37.92 us, past the last call's end
  // (34.88) by 3.04 us before the last unit's own 5.12.
  in.profile.intra = {.bandwidth_gbs = 0.05, .latency_us = 0};
  p = simulate_scheme(in, CpScheme::allgather);
  EXPECT_NEAR(p.backward[0].exposed_s, 8.16e-6 + 3.04e-6 + 5.12e-6, 1e-14);
  EXPECT_NEAR(p.backward[0].hidden_s, 25.6e-6 - 3.04e-6 - 5.12e-6, 1e-14);
}

// One KV head: the forward overlaps by its groups of documents alone (document 0's K/V, 8 of
// 20 rows: 0.256 us, exposed; document 1's, 0.384 us, under document 0's call of 2.176 us),
// the backward not (no cut). cp = 1 (nothing to gather): overlap on predicts the time off
// does. At cp > 1 the memory is the overlapped path's: the receive blocks of every rank's
// dK/dV rows and one group's lse on top.
TEST(Sim, AllGatherOverlapWithOneKvHeadOverlapsByDocuments) {
  SimInput off = hand_input();
  off.model.num_heads_k = 1;
  off.profile.intra = {.bandwidth_gbs = 1, .latency_us = 0};
  SimInput on = off;
  on.overlap = true;
  SchemePrediction a = simulate_scheme(on, CpScheme::allgather), b = simulate_scheme(off, CpScheme::allgather);
  EXPECT_NEAR(a.forward[0].exposed_s, 0.408e-6 + 0.256e-6, 1e-15);
  EXPECT_NEAR(a.forward[0].hidden_s, 0.384e-6, 1e-15);
  EXPECT_NEAR(b.forward[0].exposed_s, 0.408e-6 + 0.64e-6, 1e-15);
  EXPECT_DOUBLE_EQ(a.backward[1].exposed_s, b.backward[1].exposed_s);
  EXPECT_EQ(a.backward[1].hidden_s, 0.0);
  EXPECT_NEAR(b.step_s - a.step_s, 0.384e-6, 1e-14);
  for (const int cp : {2, 3}) {
    on.mesh.cp = off.mesh.cp = cp;
    EXPECT_GT(simulate_scheme(on, CpScheme::allgather).peak_memory_gb,
              simulate_scheme(off, CpScheme::allgather).peak_memory_gb)
        << cp;
  }
  on.mesh.cp = off.mesh.cp = 1;
  a = simulate_scheme(on, CpScheme::allgather);
  b = simulate_scheme(off, CpScheme::allgather);
  EXPECT_DOUBLE_EQ(a.step_s, b.step_s);
  EXPECT_DOUBLE_EQ(a.peak_memory_gb, b.peak_memory_gb);
  EXPECT_EQ(a.hidden_comm_s, 0.0);
  // Two KV heads at cp = 1: no gather, one group.
  on = hand_input();
  on.mesh.cp = 1;
  on.overlap = true;
  off = on;
  off.overlap = false;
  EXPECT_DOUBLE_EQ(simulate_scheme(on, CpScheme::allgather).step_s, simulate_scheme(off, CpScheme::allgather).step_s);
}

TEST(Sim, TheSameCallAcrossNodesUsesTheInterNodeLink) {
  SimInput in = hand_input();
  in.profile.ranks_per_node = 1;  // the two CP ranks on two nodes: 0.1 GB/s, 100 us
  const SchemePrediction p = simulate_scheme(in, CpScheme::allgather);
  EXPECT_NEAR(p.forward[0].exposed_s, (100e-6 + 408e-8) + 2 * (100e-6 + 640e-8), 1e-14);
  EXPECT_EQ(p.forward[0].payload.sent_inter, 2 * 640);
  EXPECT_EQ(p.forward[0].payload.sent_intra, 0);
}

TEST(Sim, AllToAllPeersSplitByLinkClass) {
  // cp 4 on nodes of 2 ranks: each rank has one peer on its node and two on the other. a2a with
  // Hq = 4 (one head per rank), Hkv = 4: per peer q, k, v of T_loc = 10 rows x 1 head x 4 dims
  // x 4 bytes = 160 bytes each, out the same, lse 10 x 4 = 40 bytes: 680 bytes per peer forward.
  SimInput in = hand_input();
  in.model.num_heads_q = in.model.num_heads_k = 4;
  in.mesh.cp = 4;
  const SchemePrediction p = simulate_scheme(in, CpScheme::a2a);
  ASSERT_TRUE(p.valid) << p.reason;
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(p.forward[r].payload.sent_intra, 680) << r;
    EXPECT_EQ(p.forward[r].payload.sent_inter, 2 * 680) << r;
    EXPECT_EQ(p.forward[r].payload.received_inter, 2 * 680) << r;
  }
  // The slower class decides each all-to-all: two inter-node messages of 100 us + 160 B / 0.1 GB/s.
  const double q = 2 * (100e-6 + 160 / 0.1e9), lse = 2 * (100e-6 + 40 / 0.1e9);
  const double ring_agreement = 3 * (100e-6 + 408 / 0.1e9);  // the ring crosses nodes
  EXPECT_NEAR(p.forward[0].exposed_s, ring_agreement + 4 * q + lse, 1e-12);
}

TEST(Sim, RingHidesItsShiftsWhenComputeIsLonger) {
  SimInput in = hand_input();
  in.profile.intra = {.bandwidth_gbs = 1000, .latency_us = 0};  // a 1280-byte shift takes 1.28 ns
  const SchemePrediction p = simulate_scheme(in, CpScheme::ring);
  // Forward: two steps of 3.488 us compute; the one K/V shift (2 x 640 bytes) fully hidden.
  EXPECT_NEAR(p.forward[0].hidden_s, 1.28e-9, 1e-18);
  EXPECT_NEAR(p.forward[0].exposed_s, 408e-12, 1e-18);  // the agreement alone
  EXPECT_NEAR(p.forward[0].time_s(), 6.976e-6 + 408e-12, 1e-15);
  // Backward: the K/V shift hidden too; the one partial dK/dV going home (20 x 2 x 8 x 4 =
  // 1280 bytes), sent after the last step, is exposed.
  EXPECT_NEAR(p.backward[0].hidden_s, 1.28e-9, 1e-18);
  EXPECT_NEAR(p.backward[0].exposed_s, 408e-12 + 1.28e-9, 1e-18);
}

// Pass-Q at cp = 2: one step after the local one; rank 0's Q block (20 x 2 x 4 x 4 = 640 bytes)
// travels under it, and its one partial coming home (O and lse: 40 x 5 x 4 = 800 bytes), sent
// after the last step, is exposed. cp - 1 partials, not cp: the hidden time counted the partial
// a second time (1.44 ns).
TEST(Sim, PassQHidesItsBlocksAndExposesTheLastPartial) {
  SimInput in = hand_input();
  in.profile.intra = {.bandwidth_gbs = 1000, .latency_us = 0};
  const SchemePrediction p = simulate_scheme(in, CpScheme::pass_q);
  EXPECT_NEAR(p.forward[0].hidden_s, 0.64e-9, 1e-18);
  EXPECT_NEAR(p.forward[0].exposed_s, 408e-12 + 0.8e-9, 1e-18);
  // At cp = 3 two steps each carry a block and, under the second, the first partial.
  in.mesh.cp = 3;
  in.profile.ranks_per_node = 3;  // (one node: every transfer on the intra link)
  const std::vector<int64_t> one{0, 60};
  in.cu_seqlens = one;
  const SchemePrediction q = simulate_scheme(in, CpScheme::pass_q);
  const double block = 20 * 2 * 4 * 4 * 1e-12, part = 40 * 5 * 4 * 1e-12;  // T_loc 20 at cp 3
  EXPECT_NEAR(q.forward[1].hidden_s, 2 * (block + part / 2), 1e-18);
}

// The CP overhead (MachineProfile::fwd_overhead / bwd_overhead, a fraction of the kernel time)
// adds to compute: with it 0 the hand-worked cases above hold (the profile leaves it 0); with
// it set, each call's compute grows by exactly the fraction of its kernel time, and a step
// without overlap by exactly that over its calls and layers.
TEST(Sim, CpOverheadAddsItsFractionOfTheKernelTimeToCompute) {
  const std::size_t f32 = static_cast<std::size_t>(DType::f32);
  for (const CpScheme s : kCpSchemes) {
    SimInput in = hand_input();
    in.model.layers = 3;
    in.profile.intra = {.bandwidth_gbs = 1000, .latency_us = 0};  // the ring hides its shifts, before and after
    const SchemePrediction base = simulate_scheme(in, s);
    ASSERT_TRUE(base.valid) << base.reason;
    for (const SimCall& c : base.forward) EXPECT_EQ(c.overhead_s, 0.0);
    const auto si = static_cast<std::size_t>(s);
    in.profile.fwd_overhead[f32][si] = 0.25;
    in.profile.bwd_overhead[f32][si] = 0.5;
    in.profile.fwd_overhead[f32][(si + 1) % 5] = 7;  // another scheme's: no effect on this one
    in.profile.fwd_overhead[static_cast<std::size_t>(DType::bf16)][si] = 9;  // another dtype's: none either
    const SchemePrediction p = simulate_scheme(in, s);
    SCOPED_TRACE(std::string(to_string(s)));
    double added = 0;
    for (int r = 0; r < 2; ++r) {
      const double kf = base.forward[r].compute_s, kb = base.backward[r].compute_s;
      EXPECT_NEAR(p.forward[r].overhead_s, 0.25 * kf, 1e-18);
      EXPECT_NEAR(p.forward[r].compute_s, 1.25 * kf, 1e-18);
      EXPECT_NEAR(p.backward[r].overhead_s, 0.5 * kb, 1e-18);
      EXPECT_NEAR(p.backward[r].compute_s, 1.5 * kb, 1e-18);
      EXPECT_NEAR(p.forward[r].exposed_s, base.forward[r].exposed_s, 1e-18);
      EXPECT_NEAR(p.backward[r].exposed_s, base.backward[r].exposed_s, 1e-18);
      if (r == 0) added = 3 * (0.25 * kf + 0.5 * kb);  // both ranks do the same work here
    }
    EXPECT_NEAR(p.step_s, base.step_s + added, 1e-15);
    EXPECT_NEAR(p.compute_s, base.compute_s + added, 1e-15);
    EXPECT_NEAR(p.exposed_comm_s, base.exposed_comm_s, 1e-15);
  }
  // By hand, the all-gather of the first case: forward kernel 6.976 us, backward 34.88 us; a
  // quarter and a half of them on top.
  SimInput in = hand_input();
  in.profile.fwd_overhead[f32][static_cast<std::size_t>(CpScheme::allgather)] = 0.25;
  in.profile.bwd_overhead[f32][static_cast<std::size_t>(CpScheme::allgather)] = 0.5;
  const SchemePrediction p = simulate_scheme(in, CpScheme::allgather);
  EXPECT_NEAR(p.forward[0].compute_s, 6.976e-6 + 1.744e-6, 1e-15);
  EXPECT_NEAR(p.backward[1].compute_s, 34.88e-6 + 17.44e-6, 1e-15);
  EXPECT_NEAR(p.step_s, 6.976e-6 + 34.88e-6 + 1.744e-6 + 17.44e-6 + 2 * (10.408e-6 + 21.28e-6), 1e-14);
}

// With overlap, the overhead is compute too: the ring hides more of a transfer longer than its
// steps' compute, so the step grows by less than the overhead (never by more, never shrinks).
TEST(Sim, CpOverheadHidesMoreOfTheRingsTransfers) {
  SimInput in = hand_input();
  in.profile.intra = {.bandwidth_gbs = 0.1, .latency_us = 0};  // a 1280-byte shift: 12.8 us > 3.488 us of compute
  const SchemePrediction base = simulate_scheme(in, CpScheme::ring);
  in.profile.fwd_overhead[static_cast<std::size_t>(DType::f32)][static_cast<std::size_t>(CpScheme::ring)] = 1;
  const SchemePrediction p = simulate_scheme(in, CpScheme::ring);
  // Forward: one step's compute 3.488 us (6.976 us over 2 steps) becomes 6.976 us, hiding that
  // much more of the 12.8 us shift: the call time grows by 6.976 - 3.488 us.
  EXPECT_NEAR(p.forward[0].hidden_s, base.forward[0].hidden_s + 3.488e-6, 1e-15);
  EXPECT_NEAR(p.forward[0].time_s(), base.forward[0].time_s() + 3.488e-6, 1e-15);
  EXPECT_GT(p.step_s, base.step_s);
  EXPECT_LT(p.step_s, base.step_s + 6.976e-6);
}

// The stage transfers of the busiest stage, alone at cp = 1 (T_loc 40 x hidden 8 x 4 bytes =
// 1280 per activation): a middle stage sends an activation down and a gradient up per chunk and
// micro-batch (2 V), a stage of two sends 2 V - 1 (stage 0 receives no activation for the
// model's first chunk; stage 1 sends none from its last), sent and received alike.
TEST(Sim, StageTransfersAreTheBusiestStagesSendsAndReceives) {
  for (const auto& [pp, v, per_micro] : {std::tuple{2, 1, 1}, std::tuple{2, 2, 3}, std::tuple{2, 3, 5},
                                         std::tuple{3, 1, 2}, std::tuple{4, 2, 4}}) {
    SimInput in = hand_input();
    in.mesh.cp = 1;
    in.mesh.pp = pp;
    in.mesh.micro = 4;
    in.model.layers = 2 * pp * v;
    if (v > 1) {
      in.mesh.schedule = PipelineSchedule::interleaved;
      in.mesh.virtual_stages = v;
    }
    const SchemePrediction p = simulate_scheme(in, CpScheme::allgather);
    SCOPED_TRACE(::testing::Message() << "pp " << pp << " V " << v);
    EXPECT_EQ(p.step_bytes.sent(), 4 * per_micro * 1280);
    EXPECT_EQ(p.step_bytes.received(), 4 * per_micro * 1280);
  }
}

TEST(Sim, EqualPipelineStagesGiveTheFillDrainBubble) {
  for (const PipelineSchedule sched : {PipelineSchedule::gpipe, PipelineSchedule::one_f_one_b}) {
    for (const auto& [stages, micro] : {std::pair{4, 8}, std::pair{3, 1}, std::pair{2, 5}}) {
      SimInput in = hand_input();
      in.model.layers = 2 * stages;
      in.mesh.pp = stages;
      in.mesh.micro = micro;
      in.mesh.schedule = sched;
      in.profile.inter = {.bandwidth_gbs = 1e12, .latency_us = 0};  // stage transfers ~0
      const SchemePrediction p = simulate_scheme(in, CpScheme::allgather);
      const double f = 2 * p.forward[0].time_s(), b = 2 * p.backward[0].time_s();  // two layers a stage
      SCOPED_TRACE(::testing::Message() << pipeline_schedule_name(sched) << " S " << stages << " M " << micro);
      EXPECT_NEAR(p.bubble_fraction, (stages - 1.0) / (micro + stages - 1.0), 1e-6);
      EXPECT_NEAR(p.step_s, (micro + stages - 1) * (f + b), 1e-6 * p.step_s);
      EXPECT_NEAR(p.bubble_s, (stages - 1) * (f + b), 1e-6 * p.step_s);
    }
  }
}

// Interleaved 1F1B (SimMesh::virtual_stages): each of a stage's V chunks runs a V-th of its
// layers, so the step is pipeline.hpp's simulate() of the interleaved schedule at chunk costs;
// the work is 1F1B's, the bubble smaller, and every chunk's activation crosses to the next
// stage (V times 1F1B's stage transfers per micro-batch).
TEST(Sim, InterleavedChunksRunAVthOfAStagesLayers) {
  const int stages = 2, micro = 4, layers = 8;
  SimInput in = hand_input();
  in.model.layers = layers;
  in.mesh.pp = stages;
  in.mesh.micro = micro;
  in.profile.inter = {.bandwidth_gbs = 1e12, .latency_us = 0};  // stage transfers ~0
  const SchemePrediction base = simulate_scheme(in, CpScheme::allgather);  // 1F1B
  for (const int v : {0, 2, 4}) {  // (0: interleaved's default, 2)
    SCOPED_TRACE(::testing::Message() << "V " << v);
    in.mesh.schedule = PipelineSchedule::interleaved;
    in.mesh.virtual_stages = v;
    const SchemePrediction p = simulate_scheme(in, CpScheme::allgather);
    const int chunks = v == 0 ? 2 : v;
    EXPECT_EQ(in.mesh.chunks(), chunks);
    const double per_chunk = static_cast<double>(layers) / (stages * chunks);
    const double f = per_chunk * p.forward[0].time_s(), b = per_chunk * p.backward[0].time_s();
    const Simulation want = simulate(make_schedule({.stages = stages, .micro = micro,
                                                    .schedule = PipelineSchedule::interleaved, .virtual_stages = chunks}),
                                     uniform_costs(stages, f, b, 0.0, 0.0));
    EXPECT_NEAR(p.step_s, want.makespan, 1e-6 * p.step_s);
    EXPECT_NEAR(p.bubble_fraction, want.bubble_fraction, 1e-6);
    EXPECT_LT(p.bubble_fraction, base.bubble_fraction);
    EXPECT_NEAR(p.compute_s, base.compute_s, 1e-9 * base.compute_s);
    // Stage transfers: T_loc 20 x hidden 8 x 4 bytes = 640 per activation, down and up, per
    // micro-batch and chunk, sent and received.
    const int64_t extra = 2 * int64_t{micro} * (chunks - 1) * 640;
    EXPECT_EQ(p.step_bytes.sent() - base.step_bytes.sent(), extra);
    EXPECT_EQ(p.step_bytes.received() - base.step_bytes.received(), extra);
  }
  // With TP, every layer's all-reduces move the same bytes whatever the chunks: the difference
  // is again the stage transfers alone (they were counted for one chunk of the V).
  in.mesh.tp = 2;
  in.mesh.schedule = PipelineSchedule::one_f_one_b;
  in.mesh.virtual_stages = 0;
  const SchemePrediction tp_base = simulate_scheme(in, CpScheme::allgather);
  in.mesh.schedule = PipelineSchedule::interleaved;
  in.mesh.virtual_stages = 2;
  const SchemePrediction tp_v2 = simulate_scheme(in, CpScheme::allgather);
  EXPECT_EQ(tp_v2.step_bytes.sent() - tp_base.step_bytes.sent(), 2 * int64_t{micro} * 640);
}

TEST(Sim, PerRankWorkIsThePlannersAndSetsTheComputeTime) {
  const std::vector<int64_t> lengths{37, 100, 1, 64, 23, 9, 2};
  const std::vector<int64_t> cu = cu_seqlens_from_lengths(lengths);
  for (int cp = 1; cp <= 5; ++cp) {
    SimInput in = hand_input();
    in.cu_seqlens = cu;
    in.mesh.cp = cp;
    in.model.head_dim_qk = 7;
    in.model.head_dim_v = 3;
    const SimReport rep = simulate_step(in);
    ASSERT_EQ(rep.visible_pairs.size(), static_cast<std::size_t>(cp));
    int64_t sum = 0;
    for (int r = 0; r < cp; ++r) {
      const RankPlan plan = get_thd_load_balanced_cp_metadata(cu, cp, r);
      EXPECT_EQ(rep.visible_pairs[r], plan.workload.visible_pairs) << "cp " << cp << " rank " << r;
      sum += plan.workload.visible_pairs;
      // allgather's and ring's forward compute: those pairs x 2 heads x 2 (7 + 3) FLOP at 1 GFLOP/s.
      const double want = static_cast<double>(plan.workload.visible_pairs) * 2 * 2 * (7 + 3) / 1e9;
      EXPECT_NEAR(rep.schemes[0].forward[r].compute_s, want, 1e-15);
      EXPECT_NEAR(rep.schemes[1].forward[r].compute_s, want, 1e-15);
    }
    int64_t whole = 0;
    for (const int64_t l : lengths) whole += l * (l + 1) / 2;
    EXPECT_EQ(sum, whole);
    // a2a: every rank runs Hq / cp heads over whole documents (Hq = 2: cp 1 and 2 only).
    if (cp <= 2) {
      const SchemePrediction& a2a = rep.schemes[3];
      ASSERT_TRUE(a2a.valid);
      EXPECT_NEAR(a2a.forward[0].compute_s, static_cast<double>(whole) * (2 / cp) * 2 * 10 / 1e9, 1e-15);
    } else {
      EXPECT_FALSE(rep.schemes[3].valid);
      EXPECT_NE(rep.schemes[3].reason.find("num_heads_q"), std::string::npos) << rep.schemes[3].reason;
    }
  }
}

TEST(Sim, MoreBandwidthOrComputeNeverPredictsASlowerStep) {
  const std::vector<int64_t> cu = cu_seqlens_from_lengths(std::vector<int64_t>{4000, 1, 300, 2500, 17, 900});
  for (const int cp : {2, 3, 4, 8, 16})
    for (const int rpn : {1, 2, 8}) {
      SimInput in{.cu_seqlens = cu,
                  .model = {.layers = 4, .num_heads_q = 16, .num_heads_k = 4, .head_dim_qk = 128, .head_dim_v = 128},
                  .mesh = {.cp = cp, .pp = 2, .micro = 4},
                  .profile = {.name = "m", .fwd_gflops = {50, 100, 100}, .bwd_gflops = {25, 50, 50},
                              .intra = {.bandwidth_gbs = 50, .latency_us = 3},
                              .inter = {.bandwidth_gbs = 5, .latency_us = 10},
                              .ranks_per_node = rpn, .memory_gb = 80},
                  .find_breakeven = false};
      const SimReport base = simulate_step(in);
      for (const double k : {1.5, 4.0, 100.0}) {
        SimInput faster_links = in, faster_compute = in;
        faster_links.profile.intra.bandwidth_gbs *= k;
        faster_links.profile.inter.bandwidth_gbs *= k;
        for (auto* r : {&faster_compute.profile.fwd_gflops, &faster_compute.profile.bwd_gflops})
          for (double& x : *r) x *= k;
        const SimReport a = simulate_step(faster_links), b = simulate_step(faster_compute);
        for (std::size_t s = 0; s < base.schemes.size(); ++s) {
          if (!base.schemes[s].valid) continue;
          SCOPED_TRACE(::testing::Message() << to_string(base.schemes[s].scheme) << " cp " << cp << " rpn " << rpn
                                            << " x" << k);
          EXPECT_LE(a.schemes[s].step_s, base.schemes[s].step_s * (1 + 1e-12));
          EXPECT_LE(b.schemes[s].step_s, base.schemes[s].step_s * (1 + 1e-12));
          EXPECT_LT(b.schemes[s].compute_s, base.schemes[s].compute_s);
        }
      }
    }
}

TEST(Sim, ExpertImbalanceIsTheRoutersSkewOverTheEpRanks) {
  SimInput in = hand_input();
  in.model.experts = 4;
  in.model.top_k = 1;
  in.mesh.ep = 2;
  EXPECT_NEAR(simulate_scheme(in, CpScheme::allgather).expert_imbalance, 1.0, 1e-15);  // uniform router
  in.model.expert_skew = 1;  // shares 1, 1/2, 1/3, 1/4: EP rank 0 holds 1.5, rank 1 7/12
  EXPECT_NEAR(simulate_scheme(in, CpScheme::allgather).expert_imbalance, 1.5 / ((1.5 + 7.0 / 12) / 2), 1e-12);
}

TEST(Sim, WhereCpStopsPaying) {
  // Without latency, the all-gather's bytes grow
  // with the lengths and its compute with their squares, so a length scale and a bandwidth scale
  // exist at which cp 4 and cp 8 cost the same.
  SimInput in = hand_input();
  in.mesh.cp = 8;
  in.profile.ranks_per_node = 8;
  // With 10 us per message, 40 tokens run fastest on one rank.
  EXPECT_EQ(simulate_scheme(in, CpScheme::allgather).faster_smaller_cp, 1);
  in.profile.intra.latency_us = 0;
  in.find_breakeven = true;
  const SchemePrediction p = simulate_scheme(in, CpScheme::allgather);
  ASSERT_GT(p.breakeven_length_scale, 0.0);
  ASSERT_GT(p.breakeven_bandwidth_scale, 0.0);
  const auto ratio = [&](double length, double bandwidth) {
    const std::vector<int64_t> cu{0, static_cast<int64_t>(std::llround(16 * length)),
                                  static_cast<int64_t>(std::llround(40 * length))};
    SimInput at = in;
    at.cu_seqlens = cu;
    at.profile.intra.bandwidth_gbs *= bandwidth;
    at.find_breakeven = false;
    const double t8 = simulate_scheme(at, CpScheme::allgather).step_s;
    at.mesh.cp = 4;
    return t8 / simulate_scheme(at, CpScheme::allgather).step_s;
  };
  // Slower links favour cp 4; at the crossing the two cost the same; faster links favour cp 8.
  EXPECT_GT(ratio(1, p.breakeven_bandwidth_scale / 2), 1.0);
  EXPECT_NEAR(ratio(1, p.breakeven_bandwidth_scale), 1.0, 0.01);
  EXPECT_LT(ratio(1, p.breakeven_bandwidth_scale * 2), 1.0);
  // Longer documents favour cp 8 (lengths rounded to tokens: a looser crossing).
  const double x = p.breakeven_length_scale;
  EXPECT_GT(ratio(x / 2, 1), 1.0);
  EXPECT_LT(ratio(x * 2, 1), 1.0);
}

void expect_error(const SimInput& in, const std::string& what) {
  try {
    (void)simulate_step(in);
    ADD_FAILURE() << "no error, expected one naming " << what;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
  }
}

TEST(Sim, BadProfilesAndMeshesAreRejectedNamingTheField) {
  SimInput in = hand_input();
  in.profile.inter.bandwidth_gbs = -1;
  expect_error(in, "profile.inter_node.bandwidth_gbs");
  in = hand_input();
  in.profile.intra.latency_us = -2;
  expect_error(in, "profile.intra_node.latency_us");
  in = hand_input();
  in.profile.ranks_per_node = 0;
  expect_error(in, "profile.ranks_per_node");
  in = hand_input();
  in.profile.memory_gb = 0;
  expect_error(in, "profile.memory_gb");
  in = hand_input();
  in.model.dtype = DType::bf16;
  in.profile.bwd_gflops[static_cast<int>(DType::bf16)] = 0;  // unknown for this dtype
  expect_error(in, "profile.compute.bwd.bf16");
  in = hand_input();
  in.profile.fwd_gflops[0] = -3;
  expect_error(in, "profile.compute.fwd.fp32");
  in = hand_input();
  in.profile.bwd_overhead[static_cast<std::size_t>(DType::f16)][static_cast<std::size_t>(CpScheme::pass_q)] = -0.1;
  expect_error(in, "profile.cp_overhead.bwd.fp16.pass-q must be a finite number >= 0");
  in = hand_input();
  in.profile.fwd_overhead[0][0] = std::nan("");
  expect_error(in, "profile.cp_overhead.fwd.fp32.allgather");
  in = hand_input();
  in.mesh.cp = 4;
  in.mesh.cp_inner = 3;
  expect_error(in, "SimMesh::cp_inner = 3 must divide SimMesh::cp = 4");
  in = hand_input();
  in.model.experts = 6;
  in.mesh.ep = 4;
  expect_error(in, "SimMesh::ep = 4 must divide SimModel::experts = 6");
  in = hand_input();
  in.mesh.ep = 2;
  expect_error(in, "needs SimModel::experts");
  in = hand_input();
  in.mesh.pp = 2;
  in.model.layers = 3;
  expect_error(in, "SimModel::layers = 3 must be >= 1 and a multiple of SimMesh::pp = 2");
  in.mesh.schedule = PipelineSchedule::interleaved;
  in.mesh.virtual_stages = 2;
  in.model.layers = 6;
  expect_error(in, "SimModel::layers = 6 must be >= 1 and a multiple of SimMesh::pp = 2 x SimMesh::virtual_stages = 2");
  in.mesh.schedule = PipelineSchedule::one_f_one_b;
  in.model.layers = 4;
  expect_error(in, "SimMesh::virtual_stages = 2 needs the interleaved schedule (SimMesh::schedule), not 1f1b");
  in.mesh.virtual_stages = -1;
  expect_error(in, "SimMesh::virtual_stages must be in 0..1024 (0: 2 with interleaved, else 1), got -1");
  in.mesh.virtual_stages = 0;  // interleaved's default: 2 chunks, so 6 layers over 2 stages do not divide
  in.mesh.schedule = PipelineSchedule::interleaved;
  in.model.layers = 6;
  expect_error(in, "SimModel::layers = 6 must be >= 1 and a multiple of SimMesh::pp = 2 x SimMesh::virtual_stages = 2 "
                   "(its default with interleaved)");
  in = hand_input();
  in.mesh.tp = 4;  // 2 KV heads
  expect_error(in, "SimModel::num_heads_k = 2 must be divisible by SimMesh::tp = 4");
  in = hand_input();
  in.mesh.cp = 0;
  expect_error(in, "mesh sizes must be >= 1");
  in = hand_input();
  const std::vector<int64_t> bad{0, 5, 5};
  in.cu_seqlens = bad;
  expect_error(in, "cu_seqlens");
}

TEST(Sim, NamedLengthDistributionsFillTheTokens) {
  for (const char* d : {"fixed", "uniform", "lognormal"}) {
    const std::vector<int64_t> cu = sim_lengths(d, 10000, 300, 1.0, 7);
    EXPECT_EQ(cu.back(), 10000) << d;
    EXPECT_NO_THROW(check_cu_seqlens(cu)) << d;
    EXPECT_EQ(cu, sim_lengths(d, 10000, 300, 1.0, 7)) << d;  // deterministic in the seed
  }
  EXPECT_EQ(sim_lengths("fixed", 1000, 300, 0, 1), (std::vector<int64_t>{0, 300, 600, 900, 1000}));
  try {
    (void)sim_lengths("zipf", 10, 3, 0, 1);
    ADD_FAILURE() << "no error for an unknown distribution";
  } catch (const Error& e) {
    EXPECT_NE(e.message().find("sim_lengths: distribution must be one of"), std::string::npos) << e.what();
  }
}

// ---- review fixes (issue #18) -------------------------------------------------------------

// The link class of every message, against a naive count over the peers (the closed forms of
// src/sim count intervals of CP indices): the all-to-all's peers, pass-Q's ring and partials
// (to every owner whose queries see the rank's block, from every helper whose block its
// queries see: the rule of sim.cpp's visible sets, written out), and the agreement's ring.
TEST(Sim, PeersByLinkClassMatchANaiveCountOnEveryRank) {
  const std::vector<std::vector<int64_t>> batches = {{37, 1, 64, 23, 9, 2, 300}, {37, 1, 23, 9, 2}, {1}};
  for (const auto& lengths : batches)
    for (const MaskType mask : {MaskType::causal, MaskType::none})
      for (const int cp : {3, 6, 8, 12})
        for (const int tp : {1, 2, 3})
          for (const int rpn : {1, 2, 3, 4, 8, 64}) {
            SCOPED_TRACE(::testing::Message() << "documents " << lengths.size() << " mask " << int(mask) << " cp "
                                              << cp << " tp " << tp << " ranks_per_node " << rpn);
            const std::vector<int64_t> cu = cu_seqlens_from_lengths(lengths);
            SimInput in = hand_input();
            in.cu_seqlens = cu;
            in.model.num_heads_q = in.model.num_heads_k = 24 * tp;  // 24 heads per TP rank
            in.model.head_dim_qk = 5;
            in.model.head_dim_v = 3;
            in.model.mask = mask;
            in.mesh.tp = tp;
            in.mesh.cp = cp;
            in.profile.ranks_per_node = rpn;
            const SchemePrediction a2a = simulate_scheme(in, CpScheme::a2a);
            const SchemePrediction pq = simulate_scheme(in, CpScheme::pass_q);
            ASSERT_TRUE(a2a.valid && pq.valid) << a2a.reason;
            // Each priced group begins at a TP coordinate (the only groups of a tp x cp mesh),
            // the one whose slowest rank is slowest for that scheme.
            ASSERT_LT(pq.cp_group_offset, std::min(tp, rpn));
            ASSERT_LT(a2a.cp_group_offset, std::min(tp, rpn));
            const auto node_at = [&](int64_t offset) { return [=](int i) { return (offset + tp * i) / rpn; }; };
            const auto node = node_at(pq.cp_group_offset);
            // The padded split's chunks and the most real ones of any document.
            int64_t t_loc = 0, n = 0;
            for (const int64_t len : lengths) {
              const int64_t padded = padded_length(len, cp), chunk = padded / chunks_per_document(cp);
              t_loc += padded / cp;
              n = std::max(n, (len + chunk - 1) / chunk);
            }
            const auto visible = [&](int q, int b) {
              if (mask == MaskType::none) return q < n && b < n;
              return b < n && q < n && (2 * cp - 1 - q < n || b <= q);
            };
            const int64_t block = t_loc * 24 * 5 * 4, part = t_loc * 24 * (1 + 3) * 4;  // pass-Q forward, fp32
            for (int r = 0; r < cp; ++r) {
              int64_t inter_peers = 0;
              SimBytes want;
              const bool right_inter = node((r + 1) % cp) != node(r), left_inter = node((r + cp - 1) % cp) != node(r);
              (right_inter ? want.sent_inter : want.sent_intra) += (cp - 1) * block;
              (left_inter ? want.received_inter : want.received_intra) += (cp - 1) * block;
              for (int j = 0; j < cp; ++j) {
                if (j == r) continue;
                const bool inter = node(j) != node(r);
                inter_peers += inter;
                if (visible(j, r)) (inter ? want.sent_inter : want.sent_intra) += part;
                if (visible(r, j)) (inter ? want.received_inter : want.received_intra) += part;
              }
              const SimBytes& got = pq.forward[r].payload;
              EXPECT_EQ(got.sent_intra, want.sent_intra) << "pass-q rank " << r;
              EXPECT_EQ(got.sent_inter, want.sent_inter) << "pass-q rank " << r;
              EXPECT_EQ(got.received_intra, want.received_intra) << "pass-q rank " << r;
              EXPECT_EQ(got.received_inter, want.received_inter) << "pass-q rank " << r;
              // a2a: every all-to-all sends one equal block to each of the cp - 1 peers.
              const auto a2a_node = node_at(a2a.cp_group_offset);
              inter_peers = 0;
              for (int j = 0; j < cp; ++j) inter_peers += j != r && a2a_node(j) != a2a_node(r);
              const bool a2a_right = a2a_node((r + 1) % cp) != a2a_node(r);
              const bool a2a_left = a2a_node((r + cp - 1) % cp) != a2a_node(r);
              const SimBytes& x = a2a.forward[r].payload;
              EXPECT_EQ(x.sent_inter * (cp - 1), x.sent() * inter_peers) << "a2a rank " << r;
              EXPECT_EQ(x.received_inter * (cp - 1), x.received() * inter_peers) << "a2a rank " << r;
              EXPECT_EQ(a2a.forward[r].agreement.sent_inter > 0, a2a_right) << "agreement rank " << r;
              EXPECT_EQ(a2a.forward[r].agreement.received_inter > 0, a2a_left) << "agreement rank " << r;
            }
          }
}

TEST(Sim, ExpertPeersByLinkClassMatchANaiveCount) {
  // cp 1, so the only traffic beside TP's (within nodes here: tp divides the node) is EP's
  // dispatch and combine: four
  // all-to-alls a layer of block = T_loc x top_k x hidden x es / ep bytes to each EP peer, EP rank
  // j being world rank j x tp.
  for (const int tp : {1, 2, 3})
    for (const int ep : {2, 3, 4, 6})
      for (const int rpn : {3, 4, 6, 12}) {
        if (rpn % tp != 0) continue;
        SCOPED_TRACE(::testing::Message() << "tp " << tp << " ep " << ep << " ranks_per_node " << rpn);
        SimInput in = hand_input();
        in.model.num_heads_q = in.model.num_heads_k = 6;
        in.model.experts = 12;
        in.mesh = {.tp = tp, .cp = 1, .dp = ep, .ep = ep};
        in.profile.ranks_per_node = rpn;
        const SchemePrediction p = simulate_scheme(in, CpScheme::allgather);
        int64_t inter = 0;
        for (int j = 1; j < ep; ++j) inter += (j * tp) / rpn != 0;
        const int64_t block = 40 * 1 * (6 * 4) * 4 / ep;  // T_loc 40, hidden Hq x Dv, fp32
        EXPECT_EQ(p.step_bytes.sent_inter, 4 * inter * block);
        EXPECT_EQ(p.step_bytes.received_inter, 4 * inter * block);  // a uniform router
      }
}

// The groups that do not line up with the nodes: cp 3 on nodes of 4 ranks at dp 2 (group 0 is
// ranks 0-2 on node 0, group 1 ranks 3-5 across nodes 0 and 1: its links are priced, where only
// group 0's were), TP groups of 2 on nodes of 3 (ranks 2 and 3 straddle), and a pipeline whose
// stages are 3 ranks apart on nodes of 4 (ranks 1 and 4 cross).
TEST(Sim, GroupsAcrossNodeBoundariesArePricedOnTheInterNodeLink) {
  SimInput in = hand_input();
  const std::vector<int64_t> cu{0, 4096, 8192};
  in.cu_seqlens = cu;
  in.mesh.cp = 3;
  in.profile.ranks_per_node = 4;
  const SchemePrediction one = simulate_scheme(in, CpScheme::ring);
  EXPECT_EQ(one.cp_group_offset, 0);
  EXPECT_EQ(one.step_bytes.sent_inter, 0);
  in.mesh.dp = 2;
  const SchemePrediction two = simulate_scheme(in, CpScheme::ring);
  EXPECT_EQ(two.cp_group_offset, 3);  // group 1: world ranks 3, 4, 5
  EXPECT_GT(two.step_bytes.sent_inter, 0);
  EXPECT_GT(two.step_s, one.step_s);  // the inter link is the slow one
  // TP of 2 on nodes of 3, one CP rank, two replicas: ranks 2 and 3 form a TP group across nodes.
  SimInput t = hand_input();
  t.mesh = {.tp = 2, .cp = 1, .dp = 2};
  t.profile.ranks_per_node = 3;
  EXPECT_GT(simulate_scheme(t, CpScheme::allgather).step_bytes.sent_inter, 0);
  t.profile.ranks_per_node = 4;  // the groups line up
  EXPECT_EQ(simulate_scheme(t, CpScheme::allgather).step_bytes.sent_inter, 0);
  // Stages of 3 ranks on nodes of 4: stage 0 is ranks 0-2, stage 1 ranks 3-5; 1 -> 4 crosses.
  SimInput s = hand_input();
  s.mesh = {.cp = 3, .pp = 2};
  s.model.layers = 2;
  s.cu_seqlens = cu;
  s.profile.ranks_per_node = 4;
  const SchemePrediction pp = simulate_scheme(s, CpScheme::allgather);
  EXPECT_GT(pp.step_bytes.sent_inter, 0);
}

TEST(Sim, OneDocumentOf16MTokensCountsAndStopsTheLengthSweepBeforeOverflow) {
  // 16M tokens: L (L + 1) / 2 fits int64 up to L ~ 4.3e9, so the sweep's 256x (4.1e9 tokens,
  // L (L + 1) ~ 1.7e19) overflowed; it now stops at the largest scale that counts.
  const std::vector<int64_t> cu{0, 16'000'000};
  SimInput in{.cu_seqlens = cu,
              .model = {.num_heads_q = 64, .num_heads_k = 8},
              .mesh = {.cp = 8, .cp_inner = 0},
              .profile = {.name = "gpu", .fwd_gflops = {3e4, 4e5, 4e5}, .bwd_gflops = {3e4, 4e5, 4e5},
                          .intra = {.bandwidth_gbs = 450, .latency_us = 3},
                          .inter = {.bandwidth_gbs = 50, .latency_us = 5},
                          .ranks_per_node = 8, .memory_gb = 80},
              .find_breakeven = true};
  const SimReport rep = simulate_step(in);
  EXPECT_EQ(rep.tokens, 16'000'000);
  int valid = 0;
  for (const SchemePrediction& p : rep.schemes) {
    if (!p.valid) continue;
    ++valid;
    EXPECT_GT(p.step_s, 0.0) << to_string(p.scheme);
    const double top = p.breakeven_length_scale * 16e6;  // 0, or a length whose pairs count
    EXPECT_LT(top * (top + 1), 9.3e18) << to_string(p.scheme);
  }
  EXPECT_EQ(valid, 5);
  // The whole sweep overflowing is no error either: 2^31 tokens in one document fit, 256x not.
  const std::vector<int64_t> huge{0, int64_t{1} << 31};
  in.cu_seqlens = huge;
  EXPECT_NO_THROW((void)simulate_scheme(in, CpScheme::ring));
}

TEST(Sim, SmallerCpSizesTheMeshCannotTakeAreNeverRecommended) {
  // Tiny documents on slow links: one rank is fastest (faster_smaller_cp 1) ...
  SimInput in = hand_input();
  in.mesh.cp = 8;
  in.profile.ranks_per_node = 8;
  in.model.experts = 8;
  ASSERT_EQ(simulate_scheme(in, CpScheme::allgather).faster_smaller_cp, 1);
  // ... but with --ep 8 the stage needs tp x cp x dp a multiple of 8: no smaller CP runs.
  in.mesh.ep = 8;
  EXPECT_EQ(simulate_scheme(in, CpScheme::allgather).faster_smaller_cp, 0);
  in.mesh.ep = 4;  // cp 4 still runs, cp 1 and 2 do not
  EXPECT_EQ(simulate_scheme(in, CpScheme::allgather).faster_smaller_cp, 4);
}

TEST(Sim, StepBytesAreTheBusiestRanks) {
  // Ranks differ in bytes (pass-Q's partials, node edges) and in time (the planner's work); the
  // step's bytes are the rank with the most bytes sent + received, not the slowest one.
  const std::vector<std::vector<int64_t>> batches = {{1000}, {37, 1, 64, 23}, {5}, {300, 2, 2}};
  for (const auto& lengths : batches)
    for (const int cp : {3, 4, 5, 6, 8})
      for (const int rpn : {1, 2, 3})
        for (const CpScheme s : {CpScheme::ring, CpScheme::pass_q}) {
          const std::vector<int64_t> cu = cu_seqlens_from_lengths(lengths);
          SimInput in = hand_input();
          in.cu_seqlens = cu;
          in.mesh.cp = cp;
          in.profile.ranks_per_node = rpn;
          const SchemePrediction p = simulate_scheme(in, s);
          int64_t most = 0;
          for (int r = 0; r < cp; ++r) {
            const SimCall &f = p.forward[r], &b = p.backward[r];
            most = std::max(most, f.payload.sent() + f.payload.received() + f.agreement.sent() +
                                      f.agreement.received() + b.payload.sent() + b.payload.received() +
                                      b.agreement.sent() + b.agreement.received());
          }
          EXPECT_EQ(p.step_bytes.sent() + p.step_bytes.received(), most)
              << to_string(s) << " cp " << cp << " ranks_per_node " << rpn << " documents " << lengths.size();
        }
}

TEST(Sim, HeadsThatCannotSplitNameTheFieldsAndCpAttentionsRule) {
  SimInput in = hand_input();
  in.mesh.cp = 3;  // 2 query heads over an all-to-all of 3
  const SchemePrediction p = simulate_scheme(in, CpScheme::a2a);
  EXPECT_FALSE(p.valid);
  EXPECT_EQ(p.reason, "a2a: per TP rank (SimModel::num_heads_q / SimMesh::tp query heads, SimModel::num_heads_k / "
                      "SimMesh::tp KV heads): " + head_split_error(2, 2, 3));
  EXPECT_NE(p.reason.find("num_heads_q = 2 must be divisible by the all-to-all group size 3"), std::string::npos);
  EXPECT_EQ(head_split_error(8, 2, 4), "");
  EXPECT_EQ(head_split_error(8, 2, 8), "");  // replicated KV heads
  EXPECT_NE(head_split_error(12, 4, 6).find("num_heads_k = 4"), std::string::npos);
  EXPECT_THROW((void)head_split(12, 4, 6, "x"), Error);
  const HeadSplit h = head_split(8, 2, 8, "x");
  EXPECT_EQ(h.hq_loc(), 1);
  EXPECT_EQ(h.kv_loc(), 1);
}

}  // namespace
}  // namespace cpattn
