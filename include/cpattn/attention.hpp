// Fused varlen attention over packed (THD) batches on the CPU: forward and backward.
//
// Math and conventions are docs/design.md sections 1 and 5. A call gets a WorkList (worklist.hpp):
// each task is a run of query rows of one document, and its keys are runs of rows of k/v with
// their positions in the document. varlen_worklist() builds the usual FlashAttention varlen
// list from cu_seqlens. Tensors are views (tensor.hpp); the sizes of a call (total_q,
// num_heads_k, head_dim_qk, ...) are those of its views, checked against each other.
//
// Tiny example, two documents of 2 and 3 tokens, MHA with 1 head of dim 4, fp32, causal:
//
//   std::vector<int64_t> cu = {0, 2, 5};
//   cpattn::WorkList wl = cpattn::varlen_worklist(cu, cu);
//   const cpattn::AttnInputs in{.q = cpattn::contiguous(q, 5, 1, 4),    // q [5, 1, 4]
//                               .k = cpattn::contiguous(k, 5, 1, 4),    // k [5, 1, 4]
//                               .v = cpattn::contiguous(v, 5, 1, 4),    // v [5, 1, 4]
//                               .work = &wl,
//                               .options = {.mask = cpattn::MaskType::causal}};
//   cpattn::attention_forward({.in = in, .out = cpattn::contiguous(out, 5, 1, 4), .lse = lse});
//   cpattn::attention_backward({.in = in, .out = cpattn::contiguous(out, 5, 1, 4), .lse = lse,
//                               .dout = ..., .dq = ..., .dk = ..., .dv = ...});
//
// Every argument is checked before any work (cpattn::Error names the argument, the rule and
// the values). Only the query rows of the tasks are written (out, lse, dq); dk/dv are written
// (or added to) on every row of the key tensors, rows no task reads getting zero gradient.
//
// Results are deterministic: the same inputs give bitwise-equal outputs on every run and for
// every num_threads, on one kernel path (paths differ from each other in rounding).
#pragma once

#include <cpattn/dtype.hpp>
#include <cpattn/tensor.hpp>
#include <cpattn/worklist.hpp>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace cpattn {


enum class MaskType {
  none,    // every key of a task is visible to every query of it
  causal,  // key position kp is visible to query position qp iff kp <= qp
};

// Which implementation runs. `automatic` picks the fastest one this CPU supports for the
// call's storage dtype (best_kernel_path(dtype), by the measured preference order of
// docs/kernels.md), unless the environment variable CPATTN_KERNEL_PATH names a path; the
// others force a path and throw cpattn::Error if the CPU lacks it. All paths compute the same
// function; they differ in rounding.
enum class KernelPath {
  automatic,
  portable,       // plain C++ (GCC vector extensions lowered to the x86-64 baseline, SSE2)
  avx2,           // AVX2 + FMA + F16C, 8-wide
  avx512,         // AVX-512F/BW/DQ/VL, 16-wide (same source as avx2)
  avx512_bf16,    // avx512 + AVX512_BF16: bf16 storage's products as bf16 dot products
                  // (vdpbf16ps) with fp32 accumulation, P and dS rounded to bf16; fp32/fp16
                  // storage as avx512
  bf16_emulated,  // avx512_bf16's algorithm with vdpbf16ps emulated exactly on AVX2 (for
                  // testing it on any AVX2 CPU; slow, never chosen automatically)
  amx,            // avx512 + AMX tiles: bf16 storage's products as TDPBF16PS tile products
                  // (P and dS rounded to bf16, as avx512_bf16), fp16 storage's as TDPFP16PS
                  // where the CPU has AMX-FP16 (else as avx512), fp32 as avx512; needs Linux's
                  // permission for tile data (asked for once per process)
  amx_emulated,   // amx's algorithm with the tile instructions emulated exactly in plain C++
                  // (for testing it on any AVX2 CPU; slow, never chosen automatically)
};

// How attention_backward delivers dK and dV.
enum class GradMode {
  write,       // dk/dv are written, in the storage dtype or fp32 (the views' dtype)
  accumulate,  // dk/dv are fp32 views that get dK/dV added (+=) to their contents
  // dq, dk and dv are fp32 views that get dQ, dK and dV added: a caller that splits the key
  // set over calls (the ring CP scheme: one call per visiting K/V block) sums dQ in the
  // kernel, in call order, instead of in a separate buffer.
  accumulate_all,
};

// How attention_forward delivers out and lse.
enum class OutMode {
  write,  // out (in.dtype()) and the optional lse are written
  // out (fp32) and lse (required) hold the result of earlier calls over other keys of the same
  // queries (lse -inf, out 0: none yet); this call's keys join them, as merge_partial_softmax
  // of the two parts would, through the kernel's online softmax: out and lse start its running
  // state (max = lse, sum = 1), so no partial result is stored and no merge runs. Rows of no
  // task, and rows that see none of this call's keys (mask or window), keep out and lse bit for
  // bit. A key set split over calls in a fixed order gives a fixed result.
  accumulate,
};

// How a call runs, apart from its tensors: what forward and backward must agree on.
struct AttnOptions {
  MaskType mask = MaskType::causal;
  // S = softmax_scale * q.k. Unset: 1/sqrt(head_dim_qk) (FlashAttention's softmax_scale=None).
  std::optional<float> softmax_scale = std::nullopt;
  float dropout_p = 0.0f;  // probability of dropping a P entry, in [0, 1)
  uint64_t seed = 0;       // dropout seed (see dropout_keep)
  // Query head h draws the dropout mask of head h + dropout_head_offset: a caller that runs a
  // slice of the heads (the all-to-all CP scheme) passes the slice's first head, so that it
  // drops what a run of every head drops. In [0, INT_MAX - num_heads_q].
  int dropout_head_offset = 0;
  int num_threads = 1;     // >= 1; results do not depend on it
  KernelPath path = KernelPath::automatic;
  // FlashAttention's sliding window, on positions (bottom-right aligned, as the work list's):
  // query position qp sees key position kp iff qp - left <= kp <= qp + right; -1 = unbounded
  // on that side. Intersected with the mask: under causal kp <= qp as well (so right has no
  // effect); with MaskType::none, (left, right) is a two-sided window. A query that sees no
  // key gets out 0, lse -inf and zero gradients. Each >= -1 and <= 2^48 (kMaxTokens).
  int64_t window_size_left = -1;
  int64_t window_size_right = -1;
  // Logit soft-capping (FlashAttention / Gemma 2): S = softcap * tanh(S / softcap) before the
  // softmax (after the scale). 0 = off; finite and >= 0.
  float softcap = 0.0f;
  // Optional ALiBi slopes, [num_heads_q] fp32 (finite), read during the call: query head h
  // adds -alibi_slopes[h] * |qp - kp| to its scores (after the soft cap), with the
  // bottom-right-aligned positions qp, kp, i.e. FlashAttention's non-causal form
  // -slope * |i + seqlen_k - seqlen_q - j|; under causal it equals FlashAttention's causal bias
  // up to a per-row constant, which the softmax cancels. nullptr = off.
  const float* alibi_slopes = nullptr;
};

// The standard ALiBi slopes for `num_heads` query heads, for AttnOptions::alibi_slopes: the
// ALiBi paper's geometric sequence slope_h = 2^(-8 (h + 1) / num_heads), h = 0..num_heads-1.
// (For a head count that is not a power of 2 the ALiBi code and BLOOM interleave two such
// sequences instead; pass their slopes to match them.)
std::vector<float> alibi_slopes(int num_heads);

// The sizes of a call, named as in FlashAttention; derived from its views (AttnInputs::shape).
struct AttnShape {
  int64_t total_q = 0;  // rows of q/out/lse/dout/dq
  int64_t total_k = 0;  // rows of k/v/dk/dv
  int num_heads_q = 0;  // Hq, a multiple of num_heads_k (GQA: head h reads kv head h/(Hq/Hkv))
  int num_heads_k = 0;  // Hkv
  int head_dim_qk = 0;  // Dqk in [1, 256]
  int head_dim_v = 0;   // Dv in [1, 256]
};

// What forward and backward share: the inputs, which keys each query sees, and the options.
// All views have one storage dtype.
// K/V packed once for several callers that map one buffer (CpAttention's ranks over a node's
// shared memory, docs/cp.md "Shared memory"): every caller's call has the same k, v, key_rows
// and shapes; each packs the share `part` of `parts` of the packed K/V operands into `buffer`,
// calls `sync` (which returns once every caller has packed its share: a barrier) and then
// reads all of them. A call whose path and dtype have no KvPackLayout (alone) packs its own
// operands as without it, and calls `sync` at the same point. Every caller must pack in the
// same layout (attention_kv_pack_layout).
struct KvPackShare {
  std::byte* buffer = nullptr;  // 64-byte aligned, at least attention_kv_pack_bytes(...)
  std::size_t bytes = 0;
  int part = 0, parts = 1;
  std::function<void()> sync;
};
// How a call packs K/V into a KvPackShare, by its kernel path and storage dtype:
//   fp32:       float panels (K^T, V or K^T, K, V^T): every call that packs floats alone,
//               fp32 and fp16 storage on every path (fp16 tiles included: they pack floats),
//               bf16 on portable, avx2 and avx512;
//   bf16_tiles: the tiles' bf16 pairs alone: bf16 on the tile paths (amx, amx_emulated);
//   alone:      no share (bf16 on the bf16 dot-product paths, avx512_bf16 and bf16_emulated,
//               which pack floats and their pairs), and for bf16 when `path` does not resolve
//               (a bad CPATTN_KERNEL_PATH: the call itself reports it).
// Ranks of one host that pack together must all see the same layout.
enum class KvPackLayout { alone = 0, fp32 = 1, bf16_tiles = 2 };
KvPackLayout attention_kv_pack_layout(KernelPath path, DType dtype);
// The bytes of KvPackShare::buffer for K/V of total_k rows in `layout` (forward and backward
// alike; 0 for alone); throws cpattn::Error for negative sizes and sizes whose bytes would
// wrap size_t.
std::size_t attention_kv_pack_bytes(int64_t total_k, int num_heads_k, int head_dim_qk, int head_dim_v,
                                    KvPackLayout layout);

// The least time between two calls of AttnInputs::progress within one kernel call.
inline constexpr double kProgressInterval = 100e-6;  // seconds

struct AttnInputs {
  ConstTensorView q = {};  // [total_q, num_heads_q, head_dim_qk]
  ConstTensorView k = {};  // [total_k, num_heads_k, head_dim_qk]
  ConstTensorView v = {};  // [total_k, num_heads_k, head_dim_v]
  const WorkList* work = nullptr;  // which keys each query sees
  AttnOptions options = {};
  // Optional [total_k] permutation of [0, total_k): key row r, as the work list's runs address
  // it, is row key_rows[r] of k and v (and of dk and dv in backward). Null: row r itself. It
  // lets a caller keep K/V where they arrived and still give the kernel each document's keys
  // as one run: CpAttention reads the all-gather's rank-major buffer in document order through
  // it, where it copied the rows into that order before (docs/cp.md).
  const int64_t* key_rows = nullptr;
  // Optional: K/V packed together with other callers (KvPackShare). Null: this call packs alone.
  const KvPackShare* kv_pack_share = nullptr;
  // Optional: called while the call computes, on the calling thread only (never on the
  // kernel's other threads), between pieces of its work (a forward's key piece of one query
  // block, a backward's query block of one piece), at most once per kProgressInterval. What a
  // caller does there runs beside the math: CpAttention moves its transfers in flight along (the overlapped all-gather's, each ring and pass-Q step's)
  // (MPI moves a message only while a rank is inside an MPI call; docs/cp.md "Overlap"). It
  // must not touch the call's tensors; what it throws ends the call (the kernel's other
  // threads stop at their next unit) and leaves out, lse, dq, dk and dv unspecified.
  const std::function<void()>* progress = nullptr;
  // (The kernels read only the K/V rows that the work list's tasks' runs name: the others may
  // hold anything, a transfer still landing in them included; but with kv_pack_share every row
  // is packed, for all the callers.)

  // The stored row of key row r: key_rows[r], or r without a map.
  constexpr int64_t stored_key_row(int64_t r) const { return key_rows ? key_rows[r] : r; }
  constexpr AttnShape shape() const { return {q.rows, k.rows, q.heads, k.heads, q.dim, v.dim}; }
  constexpr DType dtype() const { return q.dtype; }
  // options.softmax_scale, or 1/sqrt(head_dim_qk) when unset.
  float softmax_scale() const;
};

struct AttnFwdParams {
  AttnInputs in = {};
  // [total_q, num_heads_q, head_dim_v]: out_mode write: in.dtype(), written; accumulate: fp32,
  // read and updated (see OutMode).
  TensorView out = {};
  // Optional [total_q, num_heads_q] fp32, contiguous, token-major (NOT FlashAttention's
  // [num_heads, total_q] softmax_lse): natural log; -inf for a query that sees no key (its out
  // row is 0). Required in OutMode::accumulate, where it is read and updated.
  float* lse = nullptr;
  OutMode out_mode = OutMode::write;
};

// A backward's dK/dV left where another process can finish them (CpAttention's ranks over a
// node's shared memory, docs/cp.md "Shared memory"): the kernel's own fp32 partial sums (per
// KV head and query-head set, in its layout, with a header that describes it), so that each
// rank reads every rank's partials of its own rows once, instead of each kernel writing fp32
// dK/dV of every row for its peers to read back.
struct KvGradShare {
  std::byte* buffer = nullptr;  // 64-byte aligned, at least attention_grad_share_bytes(params)
  std::size_t bytes = 0;
};

struct AttnBwdParams {
  AttnInputs in = {};               // as in the forward
  ConstTensorView out = {};         // [total_q, num_heads_q, head_dim_v], the forward's out
  const float* lse = nullptr;  // [total_q, num_heads_q] fp32 contiguous, the forward's lse
  ConstTensorView dout = {};        // [total_q, num_heads_q, head_dim_v]
  // [total_q, num_heads_q, head_dim_qk]: in.dtype(), written; grad_mode accumulate_all: fp32, added to.
  TensorView dq = {};
  // [total_k, num_heads_k, head_dim_qk] and [total_k, num_heads_k, head_dim_v]: grad_mode
  // write: in.dtype() or fp32 (both of the same), written in it; accumulate, accumulate_all:
  // fp32, dK and dV added (+=) to their contents.
  TensorView dk = {};
  TensorView dv = {};
  GradMode grad_mode = GradMode::write;
  // Optional (KvGradShare): the call leaves its dK/dV unsummed in this buffer, for any process
  // that maps it to finish with attention_grad_share_rows, and writes neither dk nor dv (which
  // may then be empty views; grad_mode must be write). Null: dk and dv are written.
  const KvGradShare* grad_share = nullptr;
  // For a caller that splits one call's tasks over several calls into the same dk and dv (the
  // overlapped CP backward, per group of documents: docs/cp.md "Overlap"). named_rows_only:
  // the dk/dv rows that no task's key runs name are left as they are (false: every row is
  // written, zeros where no task reads). longest_task: 0, or at least the longest task (q_len)
  // of this call, taken as its longest: the longest of all the calls, so that each sizes and
  // orders its sums as the one call over all their tasks would (on the bf16 tile paths the
  // backward's head sets follow the longest task) and their dK/dV are that call's, bitwise.
  bool named_rows_only = false;
  int64_t longest_task = 0;
};

// The bytes of KvGradShare::buffer that a backward with these params needs (its shapes, work
// list, dtype and kernel path: the layout of the kernel's partial sums); with no work list
// (in.work null), the most that any work list over these shapes needs. Throws cpattn::Error
// for sizes whose bytes would wrap size_t.
std::size_t attention_grad_share_bytes(const AttnBwdParams& p);
// Key rows [r0, r0 + n) (rows as the work list addresses them, before AttnInputs::key_rows) of
// the dK and dV that the backward which left `buffer` (a KvGradShare's of `bytes`, filled by a
// call that has returned) would have written into fp32 views with grad_mode write: fp32 rows
// [n][num_heads_k][head_dim_qk] into dk and [n][num_heads_k][head_dim_v] into dv, bitwise. On
// the calling thread, on the vector path automatic (or CPATTN_KERNEL_PATH) picks. The layout
// comes from the buffer's header, which is checked (sizes within `bytes`, head dims, counts)
// and must hold `shape`'s num_heads_k, head_dim_qk and head_dim_v (the widths of the rows
// written; its other fields are not read): throws cpattn::Error for a buffer no backward
// filled, another shape, or rows outside the call's keys.
void attention_grad_share_rows(const std::byte* buffer, std::size_t bytes, const AttnShape& shape, int64_t r0,
                               int64_t n, float* dk, float* dv);

// The checks of a call's sizes and options alone (heads, head dims, dropout, scale, threads,
// kernel path), as attention_forward/backward make them: for layers that hold a configuration
// before any tensor exists (CpAttention). Rows (total_q, total_k) are not checked when 0.
// Throws cpattn::Error whose message starts with `fn`.
void check_attention_config(const AttnShape& shape, const AttnOptions& options, std::string_view fn);

// out, lse = attention(q, k, v) over the work list.
void attention_forward(const AttnFwdParams& p);

// dq, dk, dv from dout (docs/design.md 5). Needs the forward's out and lse.
void attention_backward(const AttnBwdParams& p);

// The FlashAttention varlen work list: document d's queries are rows
// [cu_seqlens_q[d], cu_seqlens_q[d+1]) and its keys rows [cu_seqlens_k[d], cu_seqlens_k[d+1]),
// one task per document with one key run. Bottom-right alignment: with q_len queries and
// kv_len keys the queries are the last q_len positions, q_pos = kv_len - q_len, so that under
// a causal mask query row i sees keys 0 .. kv_len - q_len + i. Rules: both lists start at 0,
// have the same number (>= 2) of entries and do not decrease; a document is empty in both
// (no task: a padded batch's, as FlashAttention takes them) or in neither. Any q_len goes
// against any kv_len: a document with more queries than keys has q_pos = 0 and its key run at
// position q_len - kv_len (the same differences query - key, which masks, windows and ALiBi
// read, as FlashAttention's bottom-right alignment), so under a causal mask its first
// q_len - kv_len queries see no key (out 0, lse -inf), as in FlashAttention 2.1 and later.
// The task of document d has doc = d. The list is the same under every mask (`mask`, kept for
// callers' code, is read by nothing: the kernels take the mask from AttnOptions).
// int32 boundaries (what PyTorch users hold) are accepted as they are.
WorkList varlen_worklist(std::span<const int64_t> cu_seqlens_q,
                         std::span<const int64_t> cu_seqlens_k,
                         MaskType mask = MaskType::causal);
WorkList varlen_worklist(std::span<const int32_t> cu_seqlens_q,
                         std::span<const int32_t> cu_seqlens_k,
                         MaskType mask = MaskType::causal);

// The fastest path this CPU supports for `dtype` storage: the first this CPU runs of the
// measured preference order (docs/kernels.md, "Paths and dispatch"): bf16: amx > avx512_bf16 >
// avx512 > avx2 > portable (on Intel CPUs amx > avx512 > avx512_bf16 > ...); fp16 and fp32:
// avx512 > avx2 > portable. Never automatic, bf16_emulated nor amx_emulated. Ignores
// CPATTN_KERNEL_PATH (resolve_kernel_path reads it).
KernelPath best_kernel_path(DType dtype = DType::f32);
// Whether `path` can run here (automatic and portable: always; amx: AMX-TILE, AMX-BF16 and
// the OS's permission for tile data).
bool kernel_path_supported(KernelPath path);
std::string_view to_string(KernelPath path);
// The KernelPath called `name` (to_string's spelling); throws cpattn::Error listing the names.
KernelPath parse_kernel_path(std::string_view name);

// The path a call runs and why.
struct KernelChoice {
  KernelPath path = KernelPath::portable;  // never automatic
  // In words, for reports: "forced by AttnOptions::path", "forced by the environment
  // (CPATTN_KERNEL_PATH=avx2)" or "chosen automatically: ..." naming the order and what
  // this CPU lacks for each path it skipped.
  std::string reason;
  bool forced_by_env = false;
};
// What attention_forward/backward run for options.path = `requested` and `dtype` storage:
// `requested` unless it is automatic; automatic is CPATTN_KERNEL_PATH when that is set to a
// path name other than "automatic" (read at every call), else best_kernel_path(dtype).
// Throws cpattn::Error naming CPATTN_KERNEL_PATH when its value is no path name or a path this
// CPU cannot run (attention_forward/backward and check_attention_config check it first).
KernelChoice resolve_kernel_path(KernelPath requested, DType dtype);

// The dropout decision for one (query, key) pair: a counter-based hash of (seed, query head,
// document, query position, key position) compared with p, so that any split of a batch into
// tasks keeps the same pairs. Kept entries of P are scaled by 1 / (1 - p).
bool dropout_keep(uint64_t seed, int64_t head, int64_t doc, int64_t q_pos, int64_t k_pos,
                  float p);

// fp32 scratch that attention_backward allocates internally (dK/dV per head set, packed
// K/V, per-thread blocks), so that callers can budget memory. Forward needs about half.
// The per-thread blocks grow with the longest task's queries, read from p.in.work (at most
// p.in.q.rows, as a valid work list has): without a work list they are counted for tasks of no
// rows (an underestimate). Shapes may come without data (a budget); sizes whose bytes would
// pass 2^62 give SIZE_MAX.
size_t attention_backward_scratch_bytes(const AttnBwdParams& p);
// The same for a call whose longest task has `longest_task` query rows (clamped to
// [0, p.in.q.rows]; p.in.work is not read): for budgets made before the work list exists.
size_t attention_backward_scratch_bytes(const AttnBwdParams& p, int64_t longest_task);

// The kernels keep the large scratch blocks a call freed for the next call (no page faults
// and fresh zeroing of the same pages in every step of a training loop), never more than the
// most scratch that was in use at once. kernel_scratch_cached_bytes says how much is kept now;
// release_kernel_scratch gives it all back (a later call allocates afresh). Thread-safe.
size_t kernel_scratch_cached_bytes();
void release_kernel_scratch();

}  // namespace cpattn
