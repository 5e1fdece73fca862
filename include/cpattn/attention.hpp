// Fused varlen attention over packed (THD) batches on the CPU: forward and backward.
//
// Math and conventions are DESIGN.md sections 1 and 5. A call gets a WorkList (worklist.hpp):
// each task is a run of query rows of one document, and its keys are runs of rows of k/v with
// their positions in the document. varlen_worklist() builds the usual FlashAttention varlen
// list from cu_seqlens.
//
// Tiny example, two documents of 2 and 3 tokens, MHA with 1 head of dim 4, fp32, causal:
//
//   std::vector<int64_t> cu = {0, 2, 5};
//   cpattn::WorkList wl = cpattn::varlen_worklist(cu, cu);
//   cpattn::attention_forward({
//       .q = q, .q_row_stride = 4, .q_head_stride = 4,        // q [5, 1, 4]
//       .k = k, .k_row_stride = 4, .k_head_stride = 4,        // k [5, 1, 4]
//       .v = v, .v_row_stride = 4, .v_head_stride = 4,        // v [5, 1, 4]
//       .out = out, .out_row_stride = 4, .out_head_stride = 4, // out [5, 1, 4]
//       .lse = lse,                                           // lse [5, 1]
//       .total_q = 5, .total_k = 5, .num_heads_q = 1, .num_heads_k = 1,
//       .head_dim_qk = 4, .head_dim_v = 4, .dtype = cpattn::DType::f32,
//       .mask = cpattn::MaskType::causal, .work = &wl});
//
// Every argument is checked before any work (cpattn::Error names the argument, the rule and
// the values). Only the query rows of the tasks are written (out, lse, dq); dk/dv are written
// (or added to) on every row of the key tensors, rows no task reads getting zero gradient.
//
// Results are deterministic: the same inputs give bitwise-equal outputs on every run and for
// every num_threads, on one kernel path (paths differ from each other in rounding).
#pragma once

#include <cpattn/dtype.hpp>
#include <cpattn/worklist.hpp>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

namespace cpattn {


enum class MaskType {
  none,    // every key of a task is visible to every query of it
  causal,  // key position kp is visible to query position qp iff kp <= qp
};

// Which implementation runs. `automatic` picks the fastest one this CPU supports
// (best_kernel_path()); the others force a path and throw cpattn::Error if the CPU lacks it.
enum class KernelPath {
  automatic,
  portable,  // plain C++ (GCC vector extensions lowered to the x86-64 baseline, SSE2)
  avx2,      // AVX2 + FMA + F16C, 8-wide
  avx512,    // AVX-512F/BW/DQ/VL, 16-wide (same source as avx2)
  amx,       // listed for the dispatch table; not implemented: forcing it throws
};

// How attention_backward delivers dK and dV.
enum class GradMode {
  write,       // dk/dv are written in the storage dtype with their strides
  accumulate,  // dk_accum/dv_accum (fp32, contiguous) get dK/dV added (+=) to their contents
};

struct AttnFwdParams {
  // Inputs, THD. Strides are in elements; head_dim is contiguous.
  const void* q = nullptr;  // [total_q, num_heads_q, head_dim_qk]
  int64_t q_row_stride = 0;
  int64_t q_head_stride = 0;
  const void* k = nullptr;  // [total_k, num_heads_k, head_dim_qk]
  int64_t k_row_stride = 0;
  int64_t k_head_stride = 0;
  const void* v = nullptr;  // [total_k, num_heads_k, head_dim_v]
  int64_t v_row_stride = 0;
  int64_t v_head_stride = 0;
  // Outputs.
  void* out = nullptr;  // [total_q, num_heads_q, head_dim_v], storage dtype
  int64_t out_row_stride = 0;
  int64_t out_head_stride = 0;
  float* lse = nullptr;  // [total_q, num_heads_q] fp32, contiguous; natural log; -inf for a
                         // query that sees no key (its out row is 0)

  int64_t total_q = 0;  // rows of q/out/lse
  int64_t total_k = 0;  // rows of k/v
  int num_heads_q = 0;  // Hq, a multiple of num_heads_k (GQA: head h reads kv head h/(Hq/Hkv))
  int num_heads_k = 0;  // Hkv
  int head_dim_qk = 0;  // Dqk in [1, 256]
  int head_dim_v = 0;   // Dv in [1, 256]
  DType dtype = DType::f32;
  MaskType mask = MaskType::causal;
  float softmax_scale = 0.0f;  // S = softmax_scale * q.k; 0 means 1/sqrt(head_dim_qk)
  float dropout_p = 0.0f;      // probability of dropping a P entry, in [0, 1)
  uint64_t seed = 0;           // dropout seed (see dropout_keep)
  const WorkList* work = nullptr;  // which keys each query sees
  int num_threads = 1;             // >= 1; results do not depend on it
  KernelPath path = KernelPath::automatic;
};

struct AttnBwdParams {
  // Forward inputs and results, as in AttnFwdParams.
  const void* q = nullptr;  // [total_q, num_heads_q, head_dim_qk]
  int64_t q_row_stride = 0;
  int64_t q_head_stride = 0;
  const void* k = nullptr;  // [total_k, num_heads_k, head_dim_qk]
  int64_t k_row_stride = 0;
  int64_t k_head_stride = 0;
  const void* v = nullptr;  // [total_k, num_heads_k, head_dim_v]
  int64_t v_row_stride = 0;
  int64_t v_head_stride = 0;
  const void* out = nullptr;  // [total_q, num_heads_q, head_dim_v], the forward's out
  int64_t out_row_stride = 0;
  int64_t out_head_stride = 0;
  const float* lse = nullptr;  // [total_q, num_heads_q] fp32 contiguous, the forward's lse
  const void* dout = nullptr;  // [total_q, num_heads_q, head_dim_v]
  int64_t dout_row_stride = 0;
  int64_t dout_head_stride = 0;

  // Gradients.
  void* dq = nullptr;  // [total_q, num_heads_q, head_dim_qk], storage dtype, written
  int64_t dq_row_stride = 0;
  int64_t dq_head_stride = 0;
  GradMode grad_mode = GradMode::write;
  void* dk = nullptr;  // grad_mode write: [total_k, num_heads_k, head_dim_qk], storage dtype
  int64_t dk_row_stride = 0;
  int64_t dk_head_stride = 0;
  void* dv = nullptr;  // grad_mode write: [total_k, num_heads_k, head_dim_v], storage dtype
  int64_t dv_row_stride = 0;
  int64_t dv_head_stride = 0;
  float* dk_accum = nullptr;  // grad_mode accumulate: [total_k, num_heads_k, head_dim_qk] fp32,
                              // contiguous, += dK
  float* dv_accum = nullptr;  // grad_mode accumulate: [total_k, num_heads_k, head_dim_v] fp32,
                              // contiguous, += dV

  int64_t total_q = 0;
  int64_t total_k = 0;
  int num_heads_q = 0;
  int num_heads_k = 0;
  int head_dim_qk = 0;
  int head_dim_v = 0;
  DType dtype = DType::f32;
  MaskType mask = MaskType::causal;
  float softmax_scale = 0.0f;  // 0 means 1/sqrt(head_dim_qk); must match the forward
  float dropout_p = 0.0f;      // must match the forward
  uint64_t seed = 0;           // must match the forward
  const WorkList* work = nullptr;
  int num_threads = 1;
  KernelPath path = KernelPath::automatic;
};

// out, lse = attention(q, k, v) over the work list.
void attention_forward(const AttnFwdParams& p);

// dq, dk, dv from dout (DESIGN.md 5). Needs the forward's out and lse.
void attention_backward(const AttnBwdParams& p);

// The FlashAttention varlen work list: document d's queries are rows
// [cu_seqlens_q[d], cu_seqlens_q[d+1]) and its keys rows [cu_seqlens_k[d], cu_seqlens_k[d+1]),
// one task per document with one key run. Bottom-right alignment: with q_len queries and
// kv_len keys the queries are the last q_len positions, q_pos = kv_len - q_len, so that under
// a causal mask query row i sees keys 0 .. kv_len - q_len + i. Rules: both lists start at 0,
// have the same number (>= 2) of entries and are strictly increasing (no empty documents);
// q_len <= kv_len for every document (needed for causal; also required without a mask so the
// positions are meaningful). Task d has doc = d.
WorkList varlen_worklist(std::span<const int64_t> cu_seqlens_q,
                         std::span<const int64_t> cu_seqlens_k);

// The fastest path this CPU supports (never `automatic`, never `amx`).
KernelPath best_kernel_path();
// Whether `path` can run here (automatic and portable: always; amx: never, not implemented).
bool kernel_path_supported(KernelPath path);
std::string_view to_string(KernelPath path);
std::string_view to_string(DType dtype);

// The dropout decision for one (query, key) pair: a counter-based hash of (seed, query head,
// document, query position, key position) compared with p, so that any split of a batch into
// tasks keeps the same pairs. Kept entries of P are scaled by 1 / (1 - p).
bool dropout_keep(uint64_t seed, int64_t head, int64_t doc, int64_t q_pos, int64_t k_pos,
                  float p);

// fp32 scratch that attention_backward allocates internally (dK/dV per query head, packed
// K/V, per-thread blocks), so that callers can budget memory. Forward needs about half.
size_t attention_backward_scratch_bytes(const AttnBwdParams& p);

}  // namespace cpattn
