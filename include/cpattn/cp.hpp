// Load-balanced KV all-gather context parallelism (DESIGN.md sections 4 and 7).
//
// Every rank holds its local THD tokens of one packed batch, in the symmetric split's order
// (get_batch_on_this_cp_rank / take_local_rows), and all ranks pass the batch's global real
// boundaries. CpAttention is driven like an autograd function:
//
//   cpattn::Communicator comm(MPI_COMM_WORLD);
//   cpattn::CpAttention attn(comm, {.num_heads_q = 8, .num_heads_k = 2, .head_dim_qk = 128,
//                                   .head_dim_v = 128, .dtype = cpattn::DType::bf16});
//   attn.forward({.cu_seqlens = cu, .local_tokens = t_loc, .q = q, .k = k, .v = v, .out = out});
//   ...
//   attn.backward({.dout = dout, .dq = dq, .dk = dk, .dv = dv});
//
// Forward: validate locally; agree across ranks on a fingerprint (shapes, dtype, heads, cp,
// the boundaries' hash, options and the call counters) so that a disagreement fails on every
// rank with the same message before any payload moves; all-gather K and V rank-major; one
// fused kernel call for both local query chunks of every document. Backward: one fused
// backward call, dK/dV accumulated in a rank-major fp32 buffer, reduce-scattered to each
// rank's local tokens. Padding tokens take no part: their out rows and all their gradients
// are exactly zero.
#pragma once

#include <cpattn/attention.hpp>
#include <cpattn/comm.hpp>
#include <cpattn/plan.hpp>

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

namespace cpattn {

// How the kernel reads the gathered keys.
enum class KvMode {
  runs,   // in place, through the planner's runs of the rank-major buffer (no copy)
  index,  // the reference design: index_select copy by kv_gather_index, index_add_ in backward
};

struct CpAttnConfig {
  int num_heads_q = 0;   // Hq, a multiple of num_heads_k
  int num_heads_k = 0;   // Hkv
  int head_dim_qk = 0;   // Dqk
  int head_dim_v = 0;    // Dv
  DType dtype = DType::f32;
  // causal: each task reads chunks 0..j of its document; none: every chunk of it (both
  // exact against a single-process run; attention never crosses a document either way).
  MaskType mask = MaskType::causal;
  float softmax_scale = 0.0f;  // 0 means 1/sqrt(head_dim_qk)
  float dropout_p = 0.0f;      // in [0, 1); masks keyed by global document and positions
  uint64_t seed = 0;
  // Deterministic: repeated runs are bitwise equal. The kernels always are; true also
  // requires the communicator's fixed-order ring reduce-scatter (the default), false permits
  // a communicator configured with CommAlgorithm::mpi.
  bool deterministic = true;
  KvMode kv_mode = KvMode::runs;
  int num_threads = 1;  // kernel threads per rank
  KernelPath path = KernelPath::automatic;
  bool check_finite = false;      // reject non-finite q/k/v/dout on every rank (costs a pass)
  std::size_t plan_cache_capacity = 8;
};

struct CpForwardArgs {
  std::span<const int64_t> cu_seqlens;  // the batch's global real boundaries, leading 0
  int64_t local_tokens = 0;             // rows of q/k/v/out on this rank (the plan's T_loc)
  const void* q = nullptr;              // [local_tokens, Hq, Dqk] contiguous, cfg.dtype
  const void* k = nullptr;              // [local_tokens, Hkv, Dqk]
  const void* v = nullptr;              // [local_tokens, Hkv, Dv]
  void* out = nullptr;                  // [local_tokens, Hq, Dv], written
  float* lse = nullptr;                 // optional [local_tokens, Hq] fp32; -inf for padding
};

struct CpBackwardArgs {
  const void* dout = nullptr;  // [local_tokens, Hq, Dv] contiguous, cfg.dtype
  void* dq = nullptr;          // [local_tokens, Hq, Dqk], written
  void* dk = nullptr;          // [local_tokens, Hkv, Dqk], written
  void* dv = nullptr;          // [local_tokens, Hkv, Dv], written
};

// Seconds spent, accumulated over calls.
struct CpStats {
  double compute_s = 0;  // kernels, copies and conversions
  double comm_s = 0;     // agreement, all-gather, reduce-scatter
  int64_t forward_calls = 0;
  int64_t backward_calls = 0;
  // The largest the saved state and the layer's own buffers have been (the kernels' internal
  // scratch, see attention_backward_scratch_bytes, comes on top).
  std::size_t peak_buffer_bytes = 0;
};

class CpAttention {
 public:
  // Borrows `comm` (which must outlive this object); cp = comm.size(). Checks `cfg`.
  CpAttention(Communicator& comm, const CpAttnConfig& cfg);
  ~CpAttention();
  CpAttention(const CpAttention&) = delete;
  CpAttention& operator=(const CpAttention&) = delete;

  void forward(const CpForwardArgs& args);
  // Needs the forward just before it (one backward per forward).
  void backward(const CpBackwardArgs& args);

  const CpAttnConfig& config() const;
  // The plan of the last forward (valid until the next one).
  const RankPlan& plan() const;
  const CpStats& stats() const;
  const PlanCache& plan_cache() const;
  void reset_stats();

 private:
  struct State;
  std::unique_ptr<State> s_;
};

}  // namespace cpattn
