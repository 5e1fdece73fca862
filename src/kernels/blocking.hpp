// The blocking of the fast kernels (kernel_impl.hpp): the constants that do not depend on the
// vector width, and the scratch they imply. One place, so that attention.cpp's
// attention_backward_scratch_bytes and the kernels cannot disagree.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>

namespace cpattn::kernels {

constexpr int PAD = 16;   // head dims and key columns are padded to this (multiple of W)
constexpr int BQ = 64;    // query rows per forward unit
constexpr int BQB = 64;   // query rows per backward step: its Q and dO blocks are 32 KiB each
                          // at D = 128, beside the 128-key piece's 128 KiB of dK/dV tiles
                          // (64, 96 and 128 rows measured within the noise of each other)
constexpr int BQB_TILES = 128;  // the same on bf16 tiles (the amx paths): dK^T and dV^T run over the
                                // step's query rows, so 128 of them give each 2 x 2 block of C tiles
                                // four 32-element steps per load and store of its tiles instead of two
constexpr int BK = 64;    // key rows per packed block
constexpr int BBK = 128;  // key rows per backward piece: two blocks (K^T, V^T and K are
                          // contiguous across blocks), so that dQ accumulates over 128 keys
                          // per load and store of its rows and the query side streams from
                          // L3 once per 128 keys instead of 64
constexpr int FBK = 128;  // key rows per forward piece: two blocks (K^T and V are
                          // contiguous across blocks), halving per-row softmax costs
constexpr int FBK_TILES = 256;  // the same on bf16 tiles: P V then has eight 32-key steps per load and
                                // store of each 2 x 2 block of O's tiles, and the softmax's per-row
                                // work (max, rescale of O) comes half as often
constexpr int GH = 4;     // query heads of one kv head per forward unit (GQA): their
                          // Q and O blocks (4 x 2 x 32 KiB at D = 128) and a K^T/V piece
                          // (128 KiB) fit a 512 KiB L2
constexpr int MR = 6;     // micro-kernel rows
constexpr int FSB = 24;   // forward sub-block rows (vector paths): a unit's rows run through
                          // S = Q K^T, the softmax and O += P V FSB rows at a time, so that a
                          // sub-block's S rows (24 x FBK floats, 12 KiB) are read back by its
                          // softmax soon after they are written. A multiple of MR: 24 was
                          // chosen on Zen 3's avx2 path against 12 and 36, and 18 and 48 ran
                          // no faster on the Intel Xeon with AMX's avx512 path (fp32). With
                          // fp32 products on AVX-512 the set's heads run each product together
                          // (gemm_groups), a B column tile staying in L1 while the heads' A
                          // and C rows stream
constexpr int BWD_SETS = 2;       // backward head sets per kv head, at least (but see BWD_LONG_TASK)
constexpr int BWD_SET_HEADS = 4;  // query heads per backward head set, at most
constexpr int64_t BWD_LONG_TASK = 4096;  // bf16 tiles: query rows of a task past which BWD_SETS applies
static_assert(BK % PAD == 0 && FBK % BK == 0 && FBK_TILES % BK == 0 && BBK % BK == 0 && FSB % MR == 0 && FSB <= BQ);

constexpr int pad_up(int x) { return (x + PAD - 1) / PAD * PAD; }

// Query heads per backward unit. A unit is (kv head, set of consecutive query heads of its
// group): for each key piece its heads' dK/dV add into one tile, which goes into the set's
// fp32 buffer once; the sets' buffers are summed in set order at the end. A kv head's group of
// G query heads runs as max(min(G, s), ceil(G / BWD_SET_HEADS)) sets of ceil(G / sets) heads
// (the last one smaller), s = BWD_SETS, but s = 1 on bf16 tiles (the amx paths) when the
// call's longest task (max_q) has at most BWD_LONG_TASK query rows. The fewer the sets, the
// less the buffers and their final sum move, and the fewer times the unit loops stream the
// packed K/V (a CP rank's, over all gathered keys, were a quarter of its bf16 backward on AMX
// with 4 sets of one head; on packed batches of short documents one set of 4 heads runs the
// bf16 tile backward 16-17% faster than 2 sets of 2); the more, the more units threads share,
// and per-thread scratch grows with the set's heads (one set of 4 heads was slower with one
// 8192-row task on bf16 tiles, 15% on two threads, and with 2048- and 4096-row tasks on the
// fp32 path, 2-6%, whose per-row buffers are larger). A function of the group size, max_q and
// the products alone: never of num_threads (the summation order, and so the result, do not
// depend on the thread count), nor of how many kv heads the call has, so that a call split
// into calls over groups of kv heads (the overlapped CP backward, whose calls share one work
// list) sums every gradient in the same order as the whole call, bitwise.
constexpr int bwd_set_heads(int num_heads_q, int num_heads_k, int64_t max_q, bool bf16_tiles) {
  const int group = std::max(1, num_heads_q / std::max(num_heads_k, 1));
  const int at_least = bf16_tiles && max_q <= BWD_LONG_TASK ? 1 : BWD_SETS;
  // (ceilings as (group - 1) / n + 1: group + n - 1 overflowed int for groups near INT_MAX)
  const int sets = std::max(std::min(group, at_least), (group - 1) / BWD_SET_HEADS + 1);
  return (group - 1) / sets + 1;
}
constexpr int bwd_sets(int num_heads_q, int num_heads_k, int64_t max_q, bool bf16_tiles) {
  const int group = std::max(1, num_heads_q / std::max(num_heads_k, 1));
  const int per = bwd_set_heads(num_heads_q, num_heads_k, max_q, bf16_tiles);
  return (group - 1) / per + 1;
}
// The shapes docs/kernels.md and the head-set tests name: the rule of BWD_SETS (any task
// on the fp32-product paths, long tasks on bf16 tiles), then short tasks on bf16 tiles.
constexpr bool bwd_sets_rule(int hq, int hkv, int per, int sets) {
  return bwd_set_heads(hq, hkv, 100, false) == per && bwd_sets(hq, hkv, 100, false) == sets &&
         bwd_set_heads(hq, hkv, 8192, true) == per && bwd_sets(hq, hkv, 8192, true) == sets;
}
static_assert(bwd_sets_rule(16, 4, 2, 2) && bwd_sets_rule(64, 8, 4, 2) && bwd_sets_rule(32, 8, 2, 2) &&
              bwd_sets_rule(40, 4, 4, 3) && bwd_sets_rule(16, 1, 4, 4) && bwd_sets_rule(8, 8, 1, 1) &&
              bwd_sets_rule(16, 8, 1, 2) && bwd_sets_rule(20, 4, 3, 2) && bwd_sets_rule(3, 1, 2, 2) &&
              bwd_set_heads(20, 4, 1, false) == bwd_set_heads(10, 2, 1, false));
static_assert(bwd_set_heads(16, 4, 4096, true) == 4 && bwd_sets(16, 4, 4096, true) == 1 &&
              bwd_set_heads(16, 4, 4097, true) == 2 && bwd_set_heads(32, 8, 1, true) == 4 &&
              bwd_sets(64, 8, 4096, true) == 2 && bwd_sets(40, 4, 300, true) == 3 &&
              bwd_set_heads(16, 8, 4096, true) == 2 && bwd_sets(16, 8, 4096, true) == 1 &&
              bwd_set_heads(3, 1, 200, true) == 3 && bwd_sets(16, 1, 100, true) == 4 &&
              bwd_set_heads(8, 8, 100, true) == 1 && bwd_set_heads(20, 4, 4096, true) == 3);
// The largest group (Hq = INT_MAX over one kv head): a constant expression only without overflow.
static_assert(bwd_sets(std::numeric_limits<int>::max(), 1, 100, false) >= 1 &&
              bwd_set_heads(std::numeric_limits<int>::max(), 1, 100, true) >= 1);

constexpr int64_t kFinalSumRows = 256;  // key rows per item of the backward's final sum (not on tiles)
// Items of the backward's final sum over `total_k` key rows: blocks of BBK on bf16 tiles, else
// of kFinalSumRows (backward_impl's loop, and its scratch bound in attention_backward_scratch_bytes).
constexpr int64_t bwd_final_items(int64_t total_k, bool bf16_tiles) {
  const int64_t rows = bf16_tiles ? BBK : kFinalSumRows;
  return (total_k + rows - 1) / rows;
}

// fp32 scratch of backward_impl, in floats, for a call with these sizes; max_q is the
// longest task. Every buffer backward_impl allocates is counted here (it checks that it
// stays within this bound).
// In floats, of U: size_t for the kernels' allocations, double for attention_backward_scratch_bytes'
// check that a shape-only request's sizes stay far inside size_t.
template <class U = size_t>
struct BwdScratch {
  U packed_kv;       // K^T, K and V^T (the backward's operands) packed per kv head in blocks of BK rows
  U per_set_grads;   // dK, dV per (kv head, head set)
  U per_thread;      // one thread's buffers
  U fin_row;         // one thread's buffers of the final sum over the head sets
  // With `unit_threads` threads over the (kv head, head set) units and `fin_threads` in the final
  // sum (each at least 1): backward_impl checks what it allocated against this, and
  // attention_backward_scratch_bytes returns it for the threads such a call starts.
  U total(int64_t unit_threads, int64_t fin_threads) const {
    return packed_kv + per_set_grads + per_thread * static_cast<U>(std::max<int64_t>(unit_threads, 1)) +
           fin_row * static_cast<U>(std::max<int64_t>(fin_threads, 1));
  }
};
using BwdScratchFloats = BwdScratch<size_t>;

// bf16_pairs: the call's products are bf16 dot products (bf16 storage on avx512_bf16 or
// bf16_emulated), whose packed K/V also hold their bf16 pairs (half as many 4-byte words).
// bf16_tiles: bf16 storage on the amx paths, which pack the same pairs alone (pack_kv_tiles: no
// float buffers) and keep bf16 copies of the query side.
template <class U = size_t>
constexpr BwdScratch<U> backward_scratch_floats(int64_t total_k, int num_heads_q,
                                                   int num_heads_k, int head_dim_qk,
                                                   int head_dim_v, int64_t max_q,
                                                   bool bf16_pairs = false, bool bf16_tiles = false) {
  const U dp = static_cast<U>(pad_up(head_dim_qk));
  const U dvp = static_cast<U>(pad_up(head_dim_v));
  const U tk = static_cast<U>((total_k + BK - 1) / BK * BK);
  const U mq = static_cast<U>(max_q);
  BwdScratch<U> f{};
  // (fp32: 2 dp + dvp floats a row; bf16 tiles: their pairs alone, half; bf16 pairs: both, 1.5 times)
  f.packed_kv = static_cast<U>(num_heads_k) * tk * (bf16_tiles ? 1 : bf16_pairs ? 3 : 2) * (2 * dp + dvp) / 2;
  // (bf16 tiles: per block of BBK rows, the last one whole)
  const U g_rows = static_cast<U>(bf16_tiles ? (total_k + BBK - 1) / BBK * BBK : total_k);
  f.per_set_grads = static_cast<U>(num_heads_k) * bwd_sets(num_heads_q, num_heads_k, max_q, bf16_tiles) * g_rows * (dp + dvp);
  // the sets' pointers (2 x sets, two floats each) and, on rows, the sums of a key row
  f.fin_row = 4 * static_cast<U>(bwd_sets(num_heads_q, num_heads_k, max_q, bf16_tiles)) + dp + dvp;
  // Per head of a set: dq [max_q][dp], q and its panels [max_q][dp]; dout and its panels
  // [max_q][dvp]; lse, delta. Shared: S, P, dP blocks [BQB or BQB_TILES][BBK]; the piece's dK, dV tiles
  // [BBK][dp + dvp]; row buffers (an out row, the dK/dV sums of a key row) of at most 2 (dp + dvp);
  // the final sum's pointers to the sets' buffers (2 x sets, two floats each). (The packing's
  // panel of 16 rows per thread is gone before these are made.)
  const U bq = bf16_tiles ? BQB_TILES : BQB;
  const auto per = static_cast<U>(bwd_set_heads(num_heads_q, num_heads_k, max_q, bf16_tiles));
  // (bf16 tiles: q and dout are one row each, their task rows held in bf16 below, no panels)
  const U q_rows = bf16_tiles ? 1 : mq, panel_rows = bf16_tiles ? 0 : mq;
  f.per_thread = per * (mq * (dp + 2) + (q_rows + panel_rows) * (dp + dvp)) + 3 * bq * BBK + BBK * (dp + dvp) +
                 2 * (dp + dvp) + 4 * static_cast<U>(bwd_sets(num_heads_q, num_heads_k, max_q, bf16_tiles));
  if (bf16_tiles) {  // per head: bf16 copies of Q, dO and their transposes (4-byte units); pairs of P and dS, dS in bf16
    const U mq32 = (mq + 31) / 32 * 32, dq32 = (dp + 31) / 32 * 32, dv32 = (dvp + 31) / 32 * 32;
    const U mq128 = (mq + BQB_TILES - 1) / BQB_TILES * BQB_TILES;  // the transposes, per step
    f.per_thread += per * ((mq32 * (dq32 + dv32) + mq128 * (dp + dvp)) / 2) + bq * BBK * 3 / 2;
  }
  return f;
}

// The layout of a KvGradShare's buffer (attention_grad_share_bytes and _rows in attention.cpp;
// backward_impl fills it): this header (kHeader bytes), then the unscaled dK partial sums of
// every unit (KV head hk, head set st: unit hk * sets + st) over g_rows rows of dp floats
// ([g_rows][dp] per unit, or with `transposed` (bf16 tiles) [nbb][dp][BBK]: per block of BBK
// rows, transposed), then dV's likewise with dvp, then `touched`, one byte per (unit, block of
// BBK rows): 0 where no piece reached the block, whose floats were never written and count as
// zeros. The sum over a row's sets and the scale are the reader's, as backward_impl's own
// final sum does them.
struct GradShareLayout {
  static constexpr uint64_t kMagic = 0x63706174'6e475348ull;  // "cpatnGSH"
  static constexpr std::size_t kHeader = 64;
  uint64_t magic = kMagic;
  int64_t total_k = 0, nbb = 0, g_rows = 0;
  int32_t hkv = 0, sets = 0, dqk = 0, dv = 0, dp = 0, dvp = 0, transposed = 0;
  float scale = 1.0f;  // dK's (the softmax scale); dV's is 1
  std::size_t units() const { return static_cast<std::size_t>(hkv) * static_cast<std::size_t>(sets); }
  std::size_t gk_floats() const { return units() * static_cast<std::size_t>(g_rows) * static_cast<std::size_t>(dp); }
  std::size_t gv_floats() const { return units() * static_cast<std::size_t>(g_rows) * static_cast<std::size_t>(dvp); }
  std::size_t gv_offset() const { return kHeader + gk_floats() * sizeof(float); }
  std::size_t touched_offset() const { return gv_offset() + gv_floats() * sizeof(float); }
  std::size_t bytes() const { return touched_offset() + units() * static_cast<std::size_t>(nbb); }
  // bytes(), or nothing when it would wrap size_t (every count non-negative)
  std::optional<std::size_t> checked_bytes() const {
    const auto u = static_cast<std::size_t>(hkv), rows = static_cast<std::size_t>(g_rows);
    std::size_t units_n = 0, per_row = 0, floats = 0, all = 0, flags = 0;
    if (__builtin_mul_overflow(u, static_cast<std::size_t>(sets), &units_n) ||
        __builtin_add_overflow(static_cast<std::size_t>(dp), static_cast<std::size_t>(dvp), &per_row) ||
        __builtin_mul_overflow(units_n, rows, &floats) || __builtin_mul_overflow(floats, per_row, &floats) ||
        __builtin_mul_overflow(floats, sizeof(float), &all) ||
        __builtin_mul_overflow(units_n, static_cast<std::size_t>(nbb), &flags) ||
        __builtin_add_overflow(all, flags, &all) || __builtin_add_overflow(all, kHeader, &all))
      return std::nullopt;
    return all;
  }
};
static_assert(sizeof(GradShareLayout) <= GradShareLayout::kHeader);
// The layout for a backward of these sizes (max_q: its longest task; bf16_tiles: bf16 on a
// tile path), as backward_impl lays its partial sums out.
constexpr GradShareLayout grad_share_layout(int64_t total_k, int num_heads_q, int num_heads_k, int head_dim_qk,
                                            int head_dim_v, int64_t max_q, bool bf16_tiles, float scale) {
  GradShareLayout L;
  L.total_k = total_k;
  L.nbb = (total_k + BBK - 1) / BBK;
  L.g_rows = bf16_tiles ? L.nbb * BBK : total_k;
  L.hkv = num_heads_k;
  L.sets = bwd_sets(num_heads_q, num_heads_k, max_q, bf16_tiles);
  L.dqk = head_dim_qk;
  L.dv = head_dim_v;
  L.dp = pad_up(head_dim_qk);
  L.dvp = pad_up(head_dim_v);
  L.transposed = bf16_tiles ? 1 : 0;
  L.scale = scale;
  return L;
}

}  // namespace cpattn::kernels
