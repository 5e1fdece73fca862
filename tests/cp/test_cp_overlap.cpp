// The all-gather scheme's three ways to move K/V and dK/dV: the overlap by KV-head groups
// (CpAttnConfig::overlap, docs/cp.md "Overlap": the kernels run per group of KV heads while the
// later groups' K/V, and the earlier groups' dK/dV, are in flight), the node's shared memory
// (CpAttnConfig::shared_memory, docs/cp.md "Shared memory": every rank's rows read in place after
// a barrier), and neither (one all-gather, one fused kernel call, one reduce-scatter). All three
// are bitwise equal (out, lse, dq, dk, dv) for every dtype and mask, at the rank count mpiexec
// gives (CTest runs 2, 3 and 4), on documents of 1 to 1100 tokens (400 under a sanitizer) with
// odd head dims, for 2 and 3 KV-head groups; and the overlapped and shared runs match a single
// process.
#include "cp_test_helpers.hpp"
#include "sanitize.hpp"

#include <cpattn/cp_scheme.hpp>
#include <cpattn/error.hpp>

#include <sys/resource.h>

#include <csignal>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace cpattn {
namespace {

// Two KV-head groups (Hkv = 2) and three (Hkv = 3, GQA of 2), odd head dims; and Hkv = 4 with
// GQA of 5, whose backward head sets (3, 2 per kv head) must not change when the call is
// split over kv-head groups (a rule that looked at the call's kv-head count gave the groups
// sets of 1 and broke bitwise equality; blocking.hpp's bwd_set_heads).
constexpr Shape kGroupShapes[] = {{"gqa-odd", 4, 2, 17, 9}, {"kv3-odd", 6, 3, 11, 7}, {"kv4-gqa5", 20, 4, 9, 5}};
// Documents that cut into groups of about a quarter of the work both ways (by their causal
// pairs: the forward's first group is documents 0 and 1, 6.5% of the work; the backward's
// last documents 6..8, 34%; the same cuts under the masks of kMasks), and one KV head with odd
// head dims.
const std::vector<int64_t> kDocGroupLengths{120, 1, 300, 45, 200, 9, 260, 77, 33};
constexpr Shape kMqa{"mqa-odd", 4, 1, 17, 9};
// A 1-token document, short ones that need padding at cp = 2..4, and one of 1100 tokens: several
// key blocks per task on every path (FBK_TILES = 256 keys). Under a sanitizer 400 (still two
// such blocks): the emulated tiles took 26 s per case at 1100 under ASan, and where the CPU has
// no AMX every case of KvPackedOncePerNodeIsBitwiseEachRankPackingAlone runs on them.
const std::vector<int64_t> kOverlapLengths{1, 37, test::kSanitize ? 400 : 1100, 9, 1, 64};

// The units the documents of `lengths` add to the overlapped all-gather under `o`'s mask and
// window: one for each direction whose end they cut (overlap_document_cut, the public rule).
int64_t cut_units(const std::vector<int64_t>& lengths, const AttnOptions& o) {
  std::vector<double> work;
  for (const int64_t len : lengths)
    work.push_back(document_pairs(len, o.mask == MaskType::causal, o.window_size_left, o.window_size_right));
  return (overlap_document_cut(work, true).cut > 0) + (overlap_document_cut(work, false).cut > 0);
}

struct MaskCase {
  const char* name;
  MaskType mask;
  int64_t left, right;
};
constexpr MaskCase kMasks[] = {{"causal", MaskType::causal, -1, -1},
                               {"none", MaskType::none, -1, -1},
                               {"window", MaskType::causal, 40, -1}};

// One rank's outputs of a forward + backward.
struct Outputs {
  check::Tensor out, dq, dk, dv;
  std::vector<float> lse;
  CpStats stats;
  uint64_t estimate = 0;  // cp_memory_estimate(...).total()
  int64_t calls = 0;      // communicator calls the forward and backward made
};

// How K/V and dK/dV move: messages in one piece (plain), messages per KV-head group
// (overlapped), the node's shared memory (shared).
enum class Path { plain, overlapped, shared };

Outputs run_on(CpAttention& attn, Communicator& comm, const check::Batch& b, const RankPlan& p, const Shape& s,
               DType t);

Outputs run(Communicator& comm, const check::Batch& b, const RankPlan& p, const Shape& s, DType t,
            const AttnOptions& o, CpSplit split, Path path) {
  const CpAttnConfig cfg{.num_heads_q = s.hq, .num_heads_k = s.hkv, .head_dim_qk = s.dqk, .head_dim_v = s.dv,
                         .dtype = t, .options = o, .split = split, .overlap = path == Path::overlapped,
                         .shared_memory = path == Path::shared};
  CpAttention attn(comm, cfg);
  return run_on(attn, comm, b, p, s, t);
}

// One forward + backward of `attn` (kept by the caller over calls); stats are the layer's so far.
Outputs run_on(CpAttention& attn, Communicator& comm, const check::Batch& b, const RankPlan& p, const Shape& s,
               DType t) {
  const check::Tensor q = check::local_rows(b.q, p), k = check::local_rows(b.k, p), v = check::local_rows(b.v, p),
                      dout = check::local_rows(b.dout, p);
  Outputs r{.out = check::Tensor(t, {p.local_tokens, s.hq, s.dv}), .dq = check::Tensor(t, q.shape),
            .dk = check::Tensor(t, k.shape), .dv = check::Tensor(t, v.shape),
            .lse = std::vector<float>(static_cast<std::size_t>(p.local_tokens * s.hq)), .stats = {},
            .estimate = cp_memory_estimate(attn.config(), p).total()};
  const int64_t calls0 = comm.calls();
  CpContext ctx = attn.forward({.cu_seqlens = b.cu_seqlens, .q = q.view(), .k = k.view(), .v = v.view(),
                                .out = r.out.view(), .lse = r.lse.data()});
  attn.backward(ctx, {.q = q.view(), .out = r.out.view(), .dout = dout.view(), .dq = r.dq.view(),
                      .dk = r.dk.view(), .dv = r.dv.view()});
  r.stats = attn.stats();
  r.calls = comm.calls() - calls0;
  return r;
}

bool same_bytes(const check::Tensor& a, const check::Tensor& b) {
  const ConstTensorView x = a.view(), y = b.view();
  const std::size_t n = static_cast<std::size_t>(x.rows) * x.heads * x.dim * dtype_size(x.dtype);
  return x.rows == y.rows && std::memcmp(x.data, y.data, n) == 0;
}

void expect_bitwise_equal(const Outputs& on, const Outputs& off) {
  EXPECT_TRUE(same_bytes(on.out, off.out)) << "out";
  EXPECT_TRUE(same_bytes(on.dq, off.dq)) << "dq";
  EXPECT_TRUE(same_bytes(on.dk, off.dk)) << "dk";
  EXPECT_TRUE(same_bytes(on.dv, off.dv)) << "dv";
  EXPECT_EQ(std::memcmp(on.lse.data(), off.lse.data(), on.lse.size() * sizeof(float)), 0) << "lse";
}

// Not equal by being wrong alike: the overlapped run against one process of the whole batch.
void expect_matches_single_process(Communicator& comm, const check::Batch& b, const RankPlan& p, const Shape& s,
                                   DType t, const AttnOptions& o, const Outputs& got_local) {
  const check::Results want = check::single_process(b, o);
  const check::Results got = check::gather_results(
      comm, p, {.out = got_local.out.view(), .dq = got_local.dq.view(), .dk = got_local.dk.view(),
                .dv = got_local.dv.view(), .lse = got_local.lse.data()});
  expect_pass(check::compare("out", got.out, want.out, t, b.out_shape().row_elements()));
  expect_pass(check::compare("dq", got.dq, want.dq, t, b.q_shape().row_elements()));
  expect_pass(check::compare("dk", got.dk, want.dk, t, b.k_shape().row_elements()));
  expect_pass(check::compare("dv", got.dv, want.dv, t, b.v_shape().row_elements()));
  expect_pass(check::compare_lse(got.lse, want.lse, t, s.hq));
}

TEST(CpOverlapGroups, LargestDivisorOfTheKvHeadsUpToFour) {
  const auto groups = [](int hkv, int cp, bool overlap = true, KvMode mode = KvMode::runs,
                         CpScheme scheme = CpScheme::allgather) {
    return cp_overlap_groups({.num_heads_q = 2 * hkv, .num_heads_k = hkv, .head_dim_qk = 8, .head_dim_v = 8,
                              .kv_mode = mode, .scheme = scheme, .overlap = overlap},
                             cp);
  };
  EXPECT_EQ(groups(4, 2), 4);
  EXPECT_EQ(groups(8, 2), 4);
  EXPECT_EQ(groups(6, 3), 3);
  EXPECT_EQ(groups(3, 4), 3);
  EXPECT_EQ(groups(2, 2), 2);
  EXPECT_EQ(groups(5, 2), 1);  // no divisor in 2..4: one group
  EXPECT_EQ(groups(1, 2), 1);  // MQA cannot split
  EXPECT_EQ(groups(4, 1), 1);  // nothing to gather
  EXPECT_EQ(groups(4, 2, false), 1);
  EXPECT_EQ(groups(4, 2, true, KvMode::index), 1);
  EXPECT_EQ(groups(4, 2, true, KvMode::runs, CpScheme::ring), 1);
}

// With shared memory the ranks pack the kernels' K/V once per node, each its share of the
// (KV head, key block) units (AttnInputs::kv_pack_share), from a layer's second shared call on
// (its first backward): in the tiles' bf16 pairs for bf16 on the tile paths (amx_emulated on
// every CPU with AVX2, amx where the CPU has it), in fp32 panels for fp16 there and for fp32
// on the FMA paths (avx2, avx512). That is bitwise what each rank packing alone gives (for
// both splits and the causal mask with and without a window on one tile path, head dims padded
// past 32, MLA 48/40, on both), and matches a single process; bf16 on the bf16 dot-product
// paths packs alone.
TEST_F(CpAttentionTest, KvPackedOncePerNodeIsBitwiseEachRankPackingAlone) {
  int ran = 0;
  const Shape mla{"mla-48-40", 4, 2, 48, 40};
  // the tiles' pairs in every case on one tile path: amx where the CPU has it (amx_emulated packs
  // the same pairs with code of its own, run here at both head dims, and its products are the
  // instructions' bitwise, kernel_amx_tiles)
  const KernelPath full = kernel_path_supported(KernelPath::amx) ? KernelPath::amx : KernelPath::amx_emulated;
  for (const KernelPath path : {KernelPath::amx_emulated, KernelPath::amx, KernelPath::avx2, KernelPath::avx512,
                                KernelPath::avx512_bf16}) {
    if (!kernel_path_supported(path)) continue;
    const bool tiles = path == KernelPath::amx_emulated || path == KernelPath::amx;
    for (const Shape& s : {kGroupShapes[0], mla})
      for (const DType t : {DType::bf16, DType::f16, DType::f32})
        for (const CpSplit split : {CpSplit::padded, CpSplit::padding_free})
          for (const MaskCase& m : {kMasks[0], kMasks[2]}) {
            // that path's bf16 in every case; the other tile path's bf16 at both head dims, one case
            // of the rest (the emulated tiles and every path's fp32 and fp16 are slow under sanitizers)
            const bool both_dims = tiles && t == DType::bf16;
            if (!(path == full && t == DType::bf16) &&
                (split != CpSplit::padded || m.left >= 0 || (s.dqk != kGroupShapes[0].dqk && !both_dims)))
              continue;
            if (!tiles && t == DType::f16) continue;  // (fp16 is fp32's packing; the tiles' case shows it)
            SCOPED_TRACE(::testing::Message() << to_string(path) << " " << s.name << " dtype " << to_string(t)
                                              << " split " << to_string(split) << " mask " << m.name << " cp "
                                              << comm.size());
            const AttnOptions o{.mask = m.mask, .path = path, .window_size_left = m.left,
                                .window_size_right = m.right};
            const check::Batch b = check::random_batch(cu_seqlens_from_lengths(kOverlapLengths), s.batch(), t, 21);
            const RankPlan p = get_thd_load_balanced_cp_metadata(b.cu_seqlens, comm.size(), comm.rank(),
                                                                 PlanOptions{.split = split});
            CpAttention attn(comm, {.num_heads_q = s.hq, .num_heads_k = s.hkv, .head_dim_qk = s.dqk,
                                    .head_dim_v = s.dv, .dtype = t, .options = o, .split = split});
            const Outputs plain = run(comm, b, p, s, t, o, split, Path::plain);
            const Outputs first = run_on(attn, comm, b, p, s, t);  // its backward shares already
            expect_bitwise_equal(first, plain);
            const Outputs second = run_on(attn, comm, b, p, s, t);
            expect_bitwise_equal(second, plain);
            EXPECT_EQ(second.stats.shared_forwards, 2);
            EXPECT_EQ(second.stats.shared_packs, attention_kv_pack_layout(path, t) != KvPackLayout::alone ? 3 : 0);
            if (m.mask == MaskType::causal && m.left < 0) expect_matches_single_process(comm, b, p, s, t, o, second);
            ++ran;
          }
  }
  if (ran == 0) GTEST_SKIP() << "none of the paths on this CPU (amx_emulated and avx2 need AVX2, FMA and F16C)";
}

// Ranks of one host whose kernels would not pack K/V alike (bf16: rank 0 on a tile path, which
// packs the tiles' pairs, the others on avx2, which pack fp32 panels): the first forward packs alone on
// every rank (shared memory is not made yet), and from its backward on the agreement fails on
// every rank alike, naming the field, before any rank packs or waits in the pack's barrier.
TEST_F(CpAttentionTest, RanksOfOneHostOnPathsThatPackApartFailAtTheAgreement) {
  if (!kernel_path_supported(KernelPath::amx_emulated) || !kernel_path_supported(KernelPath::avx2))
    GTEST_SKIP() << "needs the amx_emulated and avx2 paths (AVX2, FMA and F16C)";
  const Shape& s = kGroupShapes[0];
  const DType t = DType::bf16;
  const AttnOptions o{.path = comm.rank() == 0 ? KernelPath::amx_emulated : KernelPath::avx2};
  ASSERT_NE(attention_kv_pack_layout(KernelPath::amx_emulated, t), attention_kv_pack_layout(KernelPath::avx2, t));
  const check::Batch b = check::random_batch(cu_seqlens_from_lengths(kOverlapLengths), s.batch(), t, 23);
  const RankPlan p = get_thd_load_balanced_cp_metadata(b.cu_seqlens, comm.size(), comm.rank());
  CpAttention attn(comm, {.num_heads_q = s.hq, .num_heads_k = s.hkv, .head_dim_qk = s.dqk, .head_dim_v = s.dv,
                          .dtype = t, .options = o, .shared_memory = true});
  LocalRows rows(b, p, s, t);
  auto& [q, k, v, dout, out, dq, dk, dv, lse] = rows;
  CpContext ctx = attn.forward({.cu_seqlens = b.cu_seqlens, .q = q.view(), .k = k.view(), .v = v.view(),
                                .out = out.view(), .lse = lse.data()});
  EXPECT_EQ(attn.stats().shared_forwards, 1);
  EXPECT_EQ(attn.stats().shared_packs, 0);
  std::string error = "no error";
  try {
    attn.backward(ctx, {.q = q.view(), .out = out.view(), .dout = dout.view(), .dq = dq.view(), .dk = dk.view(),
                        .dv = dv.view()});
  } catch (const Error& e) {
    error = e.message();
  }
  EXPECT_NE(error.find("packs K/V with its peers in layout"), std::string::npos) << error;
  EXPECT_EQ(attn.stats().shared_packs, 0);
  EXPECT_EQ(attn.stats().shared_backwards, 0);
}

TEST_F(CpAttentionTest, OverlappedAndNonOverlappedRunsAreBitwiseEqual) {
  for (const Shape& s : kGroupShapes)
    for (const DType t : {DType::f32, DType::f16, DType::bf16})
      for (const MaskCase& m : kMasks) {
        SCOPED_TRACE(::testing::Message() << s.name << " dtype " << to_string(t) << " mask " << m.name << " cp "
                                          << comm.size());
        const AttnOptions o{.mask = m.mask, .path = best_kernel_path(t), .window_size_left = m.left,
                            .window_size_right = m.right};
        const check::Batch b = check::random_batch(cu_seqlens_from_lengths(kOverlapLengths), s.batch(), t, 5);
        const RankPlan p = get_thd_load_balanced_cp_metadata(b.cu_seqlens, comm.size(), comm.rank());
        const Outputs on = run(comm, b, p, s, t, o, CpSplit::padded, Path::overlapped);
        const Outputs off = run(comm, b, p, s, t, o, CpSplit::padded, Path::plain);
        const Outputs shm = run(comm, b, p, s, t, o, CpSplit::padded, Path::shared);
        expect_bitwise_equal(on, off);
        {
          SCOPED_TRACE("shared memory");
          expect_bitwise_equal(shm, off);
        }
        // Shared memory ran (this test's ranks share a host): the agreements and one barrier
        // per call, and the two buffers' creation (an all-gather of the host names, a
        // broadcast of where to find the file, an all-gather of who could map it, each), no
        // payload message; where the backward packs K/V with the peers (its layout is not alone),
        // a third buffer for it and one more barrier.
        EXPECT_EQ(shm.stats.shared_forwards, 1);
        EXPECT_EQ(shm.stats.shared_backwards, 1);
        const bool packs = attention_kv_pack_layout(o.path, t) != KvPackLayout::alone;
        EXPECT_EQ(shm.stats.shared_packs, packs ? 1 : 0);
        EXPECT_EQ(shm.calls, 2 + 2 + 2 * 3 + (packs ? 3 + 1 : 0));
        EXPECT_LE(shm.stats.peak_buffer_bytes, shm.estimate);
        // The overlapped path ran: per unit and peer, a send and a receive of K and V, and of dK
        // and dV (4 calls a direction) beside the two agreements, where the other makes 2 + 2 + 2
        // collectives. A unit per group, and one more in a direction whose end the batch's
        // documents cut (with the window the short sanitizer batch has a backward cut).
        const int groups = cp_overlap_groups({.num_heads_q = s.hq, .num_heads_k = s.hkv, .overlap = true}, comm.size());
        EXPECT_EQ(groups, s.hkv);
        EXPECT_EQ(on.calls, 2 + 4 * (2 * int64_t{groups} + cut_units(kOverlapLengths, o)) * (comm.size() - 1));
        EXPECT_EQ(off.calls, 6);
        EXPECT_GE(on.stats.comm_total_s, on.stats.comm_s);  // in flight >= waited
        EXPECT_DOUBLE_EQ(off.stats.comm_total_s, off.stats.comm_s);
        EXPECT_EQ(on.stats.bytes_sent, off.stats.bytes_sent);  // the same payload, point to point
        EXPECT_LE(on.stats.peak_buffer_bytes, on.estimate);
        if (t == DType::bf16) expect_matches_single_process(comm, b, p, s, t, o, on);
        if (t == DType::f16) expect_matches_single_process(comm, b, p, s, t, o, shm);
        if (HasFailure()) return;
      }
}

// The padding-free split's blocks differ in size (and its reduce-scatter sums in rank order):
// the same bitwise equality, and the overlapped run against one process.
TEST_F(CpAttentionTest, OverlapIsBitwiseNeutralWithThePaddingFreeSplit) {
  const Shape& s = kGroupShapes[1];
  for (const DType t : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(::testing::Message() << "dtype " << to_string(t) << " cp " << comm.size());
    const AttnOptions o{.path = best_kernel_path(t)};
    const check::Batch b = check::random_batch(cu_seqlens_from_lengths(kOverlapLengths), s.batch(), t, 6);
    const RankPlan p = get_thd_load_balanced_cp_metadata(b.cu_seqlens, comm.size(), comm.rank(),
                                                         PlanOptions{.split = CpSplit::padding_free});
    const Outputs on = run(comm, b, p, s, t, o, CpSplit::padding_free, Path::overlapped);
    const Outputs off = run(comm, b, p, s, t, o, CpSplit::padding_free, Path::plain);
    const Outputs shm = run(comm, b, p, s, t, o, CpSplit::padding_free, Path::shared);
    expect_bitwise_equal(on, off);
    expect_bitwise_equal(shm, off);
    EXPECT_EQ(shm.stats.shared_forwards, 1);
    EXPECT_EQ(shm.stats.shared_backwards, 1);
    EXPECT_LE(on.stats.peak_buffer_bytes, on.estimate);
    EXPECT_LE(shm.stats.peak_buffer_bytes, shm.estimate);
    expect_matches_single_process(comm, b, p, s, t, o, on);
    expect_matches_single_process(comm, b, p, s, t, o, shm);
  }
}

// Dropout, ALiBi and the soft cap are per query head: each group reads its heads' slopes and
// draws its heads' dropout masks (dropout_head_offset), so the group calls drop and bias what
// the fused call does.
TEST_F(CpAttentionTest, OverlapKeepsEachHeadsDropoutAndAlibi) {
  const Shape& s = kGroupShapes[1];
  const DType t = DType::f32;
  const std::vector<float> slopes = check::alibi_slopes(s.hq);
  const AttnOptions o{.dropout_p = 0.2f, .seed = 77, .path = best_kernel_path(t), .softcap = 20.0f,
                      .alibi_slopes = slopes.data()};
  const check::Batch b = check::random_batch(cu_seqlens_from_lengths(std::vector<int64_t>{37, 1, 200, 9}), s.batch(), t, 7);
  const RankPlan p = get_thd_load_balanced_cp_metadata(b.cu_seqlens, comm.size(), comm.rank());
  const Outputs on = run(comm, b, p, s, t, o, CpSplit::padded, Path::overlapped);
  const Outputs off = run(comm, b, p, s, t, o, CpSplit::padded, Path::plain);
  expect_bitwise_equal(on, off);
  const Outputs shm = run(comm, b, p, s, t, o, CpSplit::padded, Path::shared);
  EXPECT_EQ(shm.stats.shared_forwards + shm.stats.shared_backwards, 2);
  expect_bitwise_equal(shm, off);
  expect_matches_single_process(comm, b, p, s, t, o, on);
}

// Groups of documents (docs/cp.md "Overlap"): where the batch's documents cut into a group of
// about a quarter of the work, the forward's first KV-head group and the backward's last run
// as one call per group of documents, each moving its documents' rows (the kernels read and
// write no other row), so one KV head (MQA) overlaps too. Bitwise the fused call for every dtype
// and mask, with one and two KV-head groups, both splits (the padding-free split leaves some
// ranks no rows of a short document: they send nothing for it); and against one process.
TEST_F(CpAttentionTest, OverlapByGroupsOfDocumentsIsBitwiseTheFusedCall) {
  const std::vector<int64_t>& lengths = kDocGroupLengths;
  for (const Shape& s : {kMqa, kGroupShapes[0]})
    for (const DType t : {DType::f32, DType::f16, DType::bf16})
      for (const MaskCase& m : kMasks)
        for (const CpSplit split : {CpSplit::padded, CpSplit::padding_free}) {
          if (split == CpSplit::padding_free && (m.mask != MaskType::causal || t == DType::f16)) continue;
          SCOPED_TRACE(::testing::Message() << s.name << " dtype " << to_string(t) << " mask " << m.name << " split "
                                            << to_string(split) << " cp " << comm.size());
          const AttnOptions o{.mask = m.mask, .path = best_kernel_path(t), .window_size_left = m.left,
                              .window_size_right = m.right};
          const check::Batch b = check::random_batch(cu_seqlens_from_lengths(lengths), s.batch(), t, 9);
          const RankPlan p = get_thd_load_balanced_cp_metadata(b.cu_seqlens, comm.size(), comm.rank(),
                                                               PlanOptions{.split = split});
          const Outputs on = run(comm, b, p, s, t, o, split, Path::overlapped);
          const Outputs off = run(comm, b, p, s, t, o, split, Path::plain);
          expect_bitwise_equal(on, off);
          // Per unit (a KV-head group, or a group of its documents) and peer a send and a receive
          // of K and V, and of dK and dV (empty where a rank holds none of the unit's rows): one
          // unit more than the groups in each direction.
          const int groups = cp_overlap_groups({.num_heads_q = s.hq, .num_heads_k = s.hkv, .overlap = true}, comm.size());
          EXPECT_EQ(groups, s.hkv);
          EXPECT_EQ(on.calls, 2 + 4 * int64_t{2 * (groups + 1)} * (comm.size() - 1));
          if (split == CpSplit::padded) {  // (padding-free: per rank, blocks of differing sizes: CpStats::bytes_sent)
            EXPECT_EQ(on.stats.bytes_sent, off.stats.bytes_sent);  // the same payload, point to point
          }
          EXPECT_GE(on.stats.comm_total_s, on.stats.comm_s);
          EXPECT_LE(on.stats.peak_buffer_bytes, on.estimate);
          if (t == DType::bf16 && m.left < 0) expect_matches_single_process(comm, b, p, s, t, o, on);
          if (HasFailure()) return;
        }
}

// A sliding window moves the backward's cut (by the pairs it leaves: documents 3 and 4 of
// these, where len^2 gave 1..4; tests/cp/test_cp_worklists.cpp), and the forward has none
// (its first document holds over half): still bitwise the fused call, and one process.
TEST_F(CpAttentionTest, AWindowsCutOfDocumentsIsBitwiseTheFusedCall) {
  for (const Shape& s : {kMqa, kGroupShapes[0]})
    for (const DType t : {DType::f32, DType::bf16}) {
      SCOPED_TRACE(::testing::Message() << s.name << " dtype " << to_string(t) << " cp " << comm.size());
      const AttnOptions o{.mask = MaskType::causal, .path = best_kernel_path(t), .window_size_left = 15};
      const check::Batch b =
          check::random_batch(cu_seqlens_from_lengths(std::vector<int64_t>{400, 100, 100, 100, 100}), s.batch(), t, 5);
      const RankPlan p = get_thd_load_balanced_cp_metadata(b.cu_seqlens, comm.size(), comm.rank());
      const Outputs on = run(comm, b, p, s, t, o, CpSplit::padded, Path::overlapped);
      const Outputs off = run(comm, b, p, s, t, o, CpSplit::padded, Path::plain);
      expect_bitwise_equal(on, off);
      if (t == DType::bf16) expect_matches_single_process(comm, b, p, s, t, o, on);
      if (HasFailure()) return;
    }
}

// The memory accounting holds the overlapped path's buffers, the forward's included: the
// second step's forward holds the layer's kept buffers (dK/dV, receive blocks, one group's
// lse) beside its context (the gathered K/V, received and packed in place), and that peak is
// exactly the estimate's context + buffers (so an estimate that left out any backward buffer
// fails here, as would a measurement that missed one).
TEST_F(CpAttentionTest, TheOverlapsPeakBuffersAreItsEstimateExactly) {
  for (const Shape& s : kGroupShapes)
    for (const CpSplit split : {CpSplit::padded, CpSplit::padding_free}) {
      SCOPED_TRACE(::testing::Message() << s.name << " split " << to_string(split) << " cp " << comm.size());
      const DType t = DType::bf16;
      const check::Batch b = check::random_batch(cu_seqlens_from_lengths(kOverlapLengths), s.batch(), t, 8);
      const RankPlan p = get_thd_load_balanced_cp_metadata(b.cu_seqlens, comm.size(), comm.rank(),
                                                           PlanOptions{.split = split});
      const CpAttnConfig cfg{.num_heads_q = s.hq, .num_heads_k = s.hkv, .head_dim_qk = s.dqk, .head_dim_v = s.dv,
                             .dtype = t, .options = {.path = best_kernel_path(t)}, .split = split, .overlap = true,
                             .shared_memory = false};
      ASSERT_GT(cp_overlap_groups(cfg, comm.size()), 1);
      CpAttention attn(comm, cfg);
      const check::Tensor q = check::local_rows(b.q, p), k = check::local_rows(b.k, p), v = check::local_rows(b.v, p),
                          dout = check::local_rows(b.dout, p);
      check::Tensor out(t, {p.local_tokens, s.hq, s.dv}), dq(t, q.shape), dk(t, k.shape), dv(t, v.shape);
      uint64_t after_first = 0;
      for (int step = 0; step < 2; ++step) {
        CpContext ctx = attn.forward({.cu_seqlens = b.cu_seqlens, .q = q.view(), .k = k.view(), .v = v.view(),
                                      .out = out.view()});
        attn.backward(ctx, {.q = q.view(), .out = out.view(), .dout = dout.view(), .dq = dq.view(), .dk = dk.view(),
                            .dv = dv.view()});
        if (step == 0) after_first = attn.stats().peak_buffer_bytes;
      }
      const CpMemoryEstimate e = cp_memory_estimate(cfg, p);
      EXPECT_EQ(attn.stats().peak_buffer_bytes, e.context + e.buffers) << e.describe();
      // The backward's buffers are kept: the first step's backward holds the context beside
      // all of them, the steady state.
      EXPECT_EQ(after_first, e.context + e.buffers) << e.describe();
    }
}

// One layer kept over calls (its buffers and consumed contexts' K/V reused, State::spare_kv;
// with shared memory, a K/V buffer of the layer's pool per context alive) gives bitwise what
// a fresh layer gives for each call: two
// contexts alive at once (two layers' forwards, then their backwards in reverse), a batch with
// fewer tokens between two with more (buffers resized down, then up), for both splits.
TEST_F(CpAttentionTest, ALayerKeptOverCallsGivesWhatFreshLayersGive) {
  const Shape& s = kGroupShapes[0];
  const DType t = DType::f32;
  const AttnOptions o{.mask = MaskType::causal, .path = best_kernel_path(t)};
  for (const bool shared : {false, true})
  for (const CpSplit split : {CpSplit::padded, CpSplit::padding_free}) {
    SCOPED_TRACE(::testing::Message() << "split " << to_string(split) << " shared memory " << shared << " cp "
                                      << comm.size());
    const check::Batch big = check::random_batch(cu_seqlens_from_lengths(kOverlapLengths), s.batch(), t, 11);
    const check::Batch small = check::random_batch(cu_seqlens_from_lengths(std::vector<int64_t>{3, 90, 1, 25}), s.batch(), t, 12);
    const check::Batch* batches[] = {&big, &small};
    std::vector<RankPlan> plans;
    std::vector<Outputs> fresh;
    for (const check::Batch* b : batches) {
      plans.push_back(get_thd_load_balanced_cp_metadata(b->cu_seqlens, comm.size(), comm.rank(),
                                                        PlanOptions{.split = split}));
      fresh.push_back(run(comm, *b, plans.back(), s, t, o, split, Path::overlapped));
    }
    const CpAttnConfig cfg{.num_heads_q = s.hq, .num_heads_k = s.hkv, .head_dim_qk = s.dqk, .head_dim_v = s.dv,
                           .dtype = t, .options = o, .split = split, .overlap = true, .shared_memory = shared};
    ASSERT_GT(cp_overlap_groups(cfg, comm.size()), 1);
    CpAttention attn(comm, cfg);
    int64_t shared_forwards = 0;
    struct Call {
      check::Tensor q, k, v, dout;
      Outputs r;
      CpContext ctx;
    };
    const auto start = [&](int i) {
      const check::Batch& b = *batches[i];
      const RankPlan& p = plans[static_cast<std::size_t>(i)];
      auto c = std::make_unique<Call>();
      c->q = check::local_rows(b.q, p);
      c->k = check::local_rows(b.k, p);
      c->v = check::local_rows(b.v, p);
      c->dout = check::local_rows(b.dout, p);
      c->r = Outputs{.out = check::Tensor(t, {p.local_tokens, s.hq, s.dv}), .dq = check::Tensor(t, c->q.shape),
                     .dk = check::Tensor(t, c->k.shape), .dv = check::Tensor(t, c->v.shape),
                     .lse = std::vector<float>(static_cast<std::size_t>(p.local_tokens * s.hq)), .stats = {}};
      c->ctx = attn.forward({.cu_seqlens = b.cu_seqlens, .q = c->q.view(), .k = c->k.view(), .v = c->v.view(),
                             .out = c->r.out.view(), .lse = c->r.lse.data()});
      return c;
    };
    const auto finish = [&](Call& c) {
      attn.backward(c.ctx, {.q = c.q.view(), .out = c.r.out.view(), .dout = c.dout.view(), .dq = c.r.dq.view(),
                            .dk = c.r.dk.view(), .dv = c.r.dv.view()});
    };
    // Step 1: big and small alive at once, backwards in reverse. Step 2: small, then big
    // (the small context takes the big one's K/V; the big one then grows the small one's).
    // Step 3: big again.
    for (const std::vector<int>& step : {std::vector<int>{0, 1}, std::vector<int>{1, 0}, std::vector<int>{0}}) {
      std::vector<std::unique_ptr<Call>> calls;
      for (const int i : step) {
        calls.push_back(start(i));
        // Shared: each context alive holds a K/V buffer of the layer's pool (a second one is
        // made for the second context of step 1, and both are reused after).
        EXPECT_EQ(attn.stats().shared_forwards, shared_forwards += shared ? 1 : 0);
      }
      for (std::size_t j = calls.size(); j-- > 0;) {
        finish(*calls[j]);
        SCOPED_TRACE(::testing::Message() << "batch " << step[j]);
        expect_bitwise_equal(calls[j]->r, fresh[static_cast<std::size_t>(step[j])]);
      }
      if (HasFailure()) return;
    }
  }
}

// A context one rank still holds while the others have dropped theirs (no backward): its K/V
// buffer is not free on every rank, so every rank's next forward takes another (the
// agreement's minimum; none waits in a collective the others skip), with the same results;
// once the last holder lets go, the first buffer is taken again, nothing made.
TEST_F(CpAttentionTest, ARankStillHoldingAContextSendsTheNextForwardToAnotherBuffer) {
  SmallBatch b(comm.size(), comm.rank());
  randomize(b, comm.rank());
  CpAttention attn(comm, b.config());
  CpContext first = attn.forward(b.fwd());
  ASSERT_EQ(attn.stats().shared_forwards, 1);
  const std::vector<float> out1 = b.out;
  if (comm.rank() != 0) first = CpContext{};  // dropped
  // fp32 packs the kernels' K/V with the peers (KvPackLayout::fp32, on every path) from the
  // second shared call on: its buffer's 3 collectives, once, and a barrier per call
  ASSERT_EQ(attention_kv_pack_layout(KernelPath::automatic, DType::f32), KvPackLayout::fp32);
  int64_t calls = comm.calls();
  CpContext second = attn.forward(b.fwd());
  // the agreement, a new K/V buffer's 3 collectives, the pack buffer's 3, the pack's barrier, the barrier
  EXPECT_EQ(comm.calls() - calls, 9);
  EXPECT_EQ(attn.stats().shared_forwards, 2);
  EXPECT_EQ(b.out, out1);
  attn.backward(second, b.bwd());
  EXPECT_EQ(attn.stats().shared_backwards, 1);
  const std::vector<float> dk2 = b.dk;
  first = CpContext{};  // rank 0 lets go too
  calls = comm.calls();
  CpContext third = attn.forward(b.fwd());
  EXPECT_EQ(comm.calls() - calls, 3);  // the agreement and the two barriers: no buffer made
  EXPECT_EQ(attn.stats().shared_forwards, 3);
  EXPECT_EQ(b.out, out1);
  attn.backward(third, b.bwd());
  EXPECT_EQ(attn.stats().shared_backwards, 2);
  EXPECT_EQ(b.dk, dk2);
}

// The shared buffers are made for the first batch and made again, larger, for a batch past
// them, then kept for a small batch again: every call bitwise what the message path gives.
TEST_F(CpAttentionTest, SharedBuffersGrowWithTheBatch) {
  const Shape& s = kGroupShapes[0];
  const DType t = DType::f32;
  const AttnOptions o{.mask = MaskType::causal, .path = best_kernel_path(t)};
  const check::Batch small = check::random_batch(cu_seqlens_from_lengths(std::vector<int64_t>{5, 17}), s.batch(), t, 13);
  const check::Batch big = check::random_batch(cu_seqlens_from_lengths(std::vector<int64_t>(12, 100)), s.batch(), t, 14);
  CpAttention attn(comm, {.num_heads_q = s.hq, .num_heads_k = s.hkv, .head_dim_qk = s.dqk, .head_dim_v = s.dv,
                          .dtype = t, .options = o});
  int64_t n = 0;
  // made, made again larger, kept: 2 x (agreement, barrier) + 2 x 3 per making; and fp32 packs
  // K/V with the peers (KvPackLayout::fp32, from the first backward on): that buffer's 3 per
  // making and a barrier per call
  ASSERT_EQ(attention_kv_pack_layout(o.path, t), KvPackLayout::fp32);
  const int64_t calls[] = {14, 15, 6};
  for (const check::Batch* b : {&small, &big, &small}) {
    SCOPED_TRACE(::testing::Message() << b->tokens() << " tokens, cp " << comm.size());
    const RankPlan p = get_thd_load_balanced_cp_metadata(b->cu_seqlens, comm.size(), comm.rank());
    const Outputs got = run_on(attn, comm, *b, p, s, t);
    EXPECT_EQ(attn.stats().shared_forwards, ++n);
    EXPECT_EQ(attn.stats().shared_backwards, n);
    EXPECT_EQ(got.calls, calls[n - 1]);
    expect_bitwise_equal(got, run(comm, *b, p, s, t, o, CpSplit::padded, Path::plain));
  }
}

// Rank 0 cannot grow a file while it lives (RLIMIT_FSIZE 0, SIGXFSZ ignored: EFBIG instead of
// the signal's end): its posix_fallocate of a shared buffer fails. Restores both on the way out,
// also when the call throws.
class NoFileGrowthOnRank0 {
 public:
  explicit NoFileGrowthOnRank0(Communicator& comm) : rank0_(comm.rank() == 0) {
    handler_ = std::signal(SIGXFSZ, SIG_IGN);
    ok_ = handler_ != SIG_ERR && getrlimit(RLIMIT_FSIZE, &saved_) == 0;
    if (ok_ && rank0_) {
      const rlimit none{0, saved_.rlim_max};
      ok_ = setrlimit(RLIMIT_FSIZE, &none) == 0;
    }
    // Every rank learns whether every rank could, before any collective of the test.
    const int64_t mine = ok_ ? 1 : 0;
    std::vector<int64_t> all(static_cast<std::size_t>(comm.size()));
    comm.all_gather<int64_t>(std::span(&mine, 1), all);
    for (const int64_t x : all) ok_ = ok_ && x == 1;
  }
  ~NoFileGrowthOnRank0() {
    if (rank0_) setrlimit(RLIMIT_FSIZE, &saved_);
    if (handler_ != SIG_ERR) std::signal(SIGXFSZ, handler_);
  }
  NoFileGrowthOnRank0(const NoFileGrowthOnRank0&) = delete;
  NoFileGrowthOnRank0& operator=(const NoFileGrowthOnRank0&) = delete;
  bool ok() const { return ok_; }

 private:
  bool rank0_ = false, ok_ = false;
  rlimit saved_{};
  void (*handler_)(int) = SIG_ERR;
};

// A shared buffer that rank 0 cannot make sends every rank to the message path for good,
// bitwise what it gives anyway, and every rank's stats say why; the hybrid's outer all-gather
// reports its own reason as the layer's.
TEST_F(CpAttentionTest, ABufferThatCannotBeMadeSendsEveryRankToMessagesSayingWhy) {
  const Shape& s = kGroupShapes[0];
  const DType t = DType::f32;
  const AttnOptions o{.mask = MaskType::causal, .path = best_kernel_path(t)};
  const check::Batch b = check::random_batch(cu_seqlens_from_lengths(kOverlapLengths), s.batch(), t, 15);
  const RankPlan p = get_thd_load_balanced_cp_metadata(b.cu_seqlens, comm.size(), comm.rank());
  const auto expect_reason = [&](const std::string& why) {
    EXPECT_NE(why.find("rank 0 could not map the buffer"), std::string::npos) << why;
    if (comm.rank() == 0) {
      EXPECT_NE(why.find("posix_fallocate"), std::string::npos) << why;
    }
  };
  CpAttention attn(comm, {.num_heads_q = s.hq, .num_heads_k = s.hkv, .head_dim_qk = s.dqk, .head_dim_v = s.dv,
                          .dtype = t, .options = o, .overlap = false});
  ASSERT_TRUE(attn.stats().shared_memory_off.empty());
  Outputs first;
  {
    const NoFileGrowthOnRank0 limit(comm);
    ASSERT_TRUE(limit.ok());
    first = run_on(attn, comm, b, p, s, t);
  }
  const std::string why = attn.stats().shared_memory_off;  // a copy: reset_stats must keep it
  expect_reason(why);
  EXPECT_EQ(first.stats.shared_forwards + first.stats.shared_backwards, 0);
  const Outputs plain = run(comm, b, p, s, t, o, CpSplit::padded, Path::plain);
  expect_bitwise_equal(first, plain);
  // Given up for good: the next call tries no buffer (the limit is back), and the reason stays.
  attn.reset_stats();
  const Outputs second = run_on(attn, comm, b, p, s, t);
  EXPECT_EQ(second.stats.shared_forwards, 0);
  EXPECT_EQ(second.calls, plain.calls);
  EXPECT_EQ(second.stats.shared_memory_off, why);
  expect_bitwise_equal(second, plain);

  // The hybrid with all-to-all groups of one rank: its outer all-gather spans every rank.
  CpAttention hybrid(comm, {.num_heads_q = s.hq, .num_heads_k = s.hkv, .head_dim_qk = s.dqk, .head_dim_v = s.dv,
                            .dtype = t, .options = o, .scheme = CpScheme::hybrid, .cp_inner = 1});
  Outputs h;
  {
    const NoFileGrowthOnRank0 limit(comm);
    ASSERT_TRUE(limit.ok());
    h = run_on(hybrid, comm, b, p, s, t);
  }
  EXPECT_EQ(h.stats.shared_forwards + h.stats.shared_backwards, 0);
  expect_reason(h.stats.shared_memory_off);
}

// A forward over shared memory whose backward cannot make its shared dK/dV buffer: the backward
// takes the message path with the context's K/V still in the node's buffer, by groups of
// documents with one KV head, and reads them there (bitwise the plain run).
TEST_F(CpAttentionTest, ABackwardSentToMessagesReadsTheSharedKv) {
  const Shape& s = kMqa;
  const DType t = DType::f32;
  const AttnOptions o{.mask = MaskType::causal, .path = best_kernel_path(t)};
  const check::Batch b = check::random_batch(cu_seqlens_from_lengths(kDocGroupLengths), s.batch(), t, 16);
  const RankPlan p = get_thd_load_balanced_cp_metadata(b.cu_seqlens, comm.size(), comm.rank());
  CpAttention attn(comm, {.num_heads_q = s.hq, .num_heads_k = s.hkv, .head_dim_qk = s.dqk, .head_dim_v = s.dv,
                          .dtype = t, .options = o});
  LocalRows rows(b, p, s, t);
  auto& [q, k, v, dout, out, dq, dk, dv, lse] = rows;
  CpContext ctx = attn.forward({.cu_seqlens = b.cu_seqlens, .q = q.view(), .k = k.view(), .v = v.view(),
                                .out = out.view(), .lse = lse.data()});
  ASSERT_EQ(attn.stats().shared_forwards, 1);
  {
    const NoFileGrowthOnRank0 limit(comm);
    ASSERT_TRUE(limit.ok());
    attn.backward(ctx, {.q = q.view(), .out = out.view(), .dout = dout.view(), .dq = dq.view(), .dk = dk.view(),
                        .dv = dv.view()});
  }
  EXPECT_EQ(attn.stats().shared_backwards, 0);
  EXPECT_FALSE(attn.stats().shared_memory_off.empty());
  const Outputs plain = run(comm, b, p, s, t, o, CpSplit::padded, Path::plain);
  expect_bitwise_equal({.out = out, .dq = dq, .dk = dk, .dv = dv, .lse = lse, .stats = {}, .estimate = 0, .calls = 0}, plain);
}

// Ranks that disagree on overlap, or on shared_memory, fail every rank, naming the field,
// before any payload moves.
TEST_F(CpAttentionTest, RanksThatDisagreeOnOverlapOrSharedMemoryFailNamingIt) {
  for (bool CpAttnConfig::*flag : {&CpAttnConfig::overlap, &CpAttnConfig::shared_memory}) {
    const std::string want = flag == &CpAttnConfig::overlap ? "overlap: rank 0 has 0" : "shared_memory: rank 0 has 0";
    SmallBatch b(comm.size(), comm.rank());
    CpAttnConfig c = b.config();
    c.*flag = comm.rank() != 0;
    CpAttention attn(comm, c);
    try {
      (void)attn.forward(b.fwd());
      ADD_FAILURE() << "no error for " << want;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.message()).find(want), std::string::npos) << e.message();
    }
  }
}

}  // namespace
}  // namespace cpattn
