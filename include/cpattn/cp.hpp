// Context parallelism over MPI (docs/design.md sections 4 and 7, docs/cp.md): the load-balanced
// KV all-gather, ring, pass-Q, all-to-all and hybrid schemes behind one interface.
//
// Every rank holds its local THD tokens of one packed batch, in the symmetric split's order
// (get_batch_on_this_cp_rank / take_local_rows), and all ranks pass the batch's global real
// boundaries (or the plan made from them). CpAttention is driven like an autograd function:
// forward returns a CpContext, what backward needs, which the caller keeps (one per layer)
// and hands back. One CpAttention serves every layer of a model; it copies no caller tensor.
//
//   cpattn::Communicator comm(MPI_COMM_WORLD);
//   cpattn::CpAttention attn(comm, {.num_heads_q = 8, .num_heads_k = 2, .head_dim_qk = 128,
//                                   .head_dim_v = 128, .dtype = cpattn::DType::bf16});
//   auto plan = attn.plan(cu_seqlens);          // lay the inputs out with it (plan->local_tokens)
//   cpattn::CpContext ctx = attn.forward({.plan = plan, .q = q, .k = k, .v = v, .out = out});
//   ...
//   attn.backward(ctx, {.q = q, .out = out, .dout = dout, .dq = dq, .dk = dk, .dv = dv});
//
// Forward: validate locally; agree across ranks on a fingerprint (shapes, dtype, heads, cp,
// the boundaries' hash, options and the call counters) so that a disagreement fails on every
// rank with the same message before any payload moves; all-gather K and V rank-major; one
// fused kernel call for both local query chunks of every document (CpAttnConfig::overlap: one
// per group of KV heads; shared_memory, every rank on one host: every rank's K/V read in place,
// nothing gathered). Backward: one fused
// backward call, dK/dV accumulated in a rank-major fp32 buffer, reduce-scattered to each
// rank's local tokens (CpAttnConfig::overlap: the same per group of KV heads, each group's
// communication under another group's compute, bitwise the same results). Padding tokens
// take no part: their out rows and all their gradients are exactly zero.
#pragma once

#include <cpattn/attention.hpp>
#include <cpattn/comm.hpp>
#include <cpattn/cp_scheme.hpp>
#include <cpattn/plan.hpp>
#include <cpattn/tensor.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace cpattn {


// How the kernel reads the gathered keys.
enum class KvMode {
  runs,   // in place, in document order through a row map onto the rank-major buffer
          // (AttnInputs::key_rows; no copy)
  index,  // the reference design: index_select copy by kv_gather_index, index_add_ in backward
};

// The most plans a CpAttention's cache keeps (CpAttnConfig::plan_cache_capacity).
inline constexpr std::size_t kMaxPlanCacheCapacity = 4096;

struct CpAttnConfig {
  int num_heads_q = 0;   // Hq, a multiple of num_heads_k
  int num_heads_k = 0;   // Hkv
  int head_dim_qk = 0;   // Dqk
  int head_dim_v = 0;    // Dv
  DType dtype = DType::f32;
  // Mask, scale, dropout, threads and kernel path, as for attention_forward. causal: each
  // task reads chunks 0..j of its document; none: every chunk of it (both exact against a
  // single-process run; attention never crosses a document either way). Dropout masks are
  // keyed by global document and positions, so they equal a single process's.
  AttnOptions options = {};
  // Deterministic: repeated runs are bitwise equal. The kernels always are; true also
  // requires the communicator's fixed-order ring reduce-scatter (the default), false permits
  // a communicator configured with CommAlgorithm::mpi.
  bool deterministic = true;
  KvMode kv_mode = KvMode::runs;  // where K/V are all-gathered (allgather, a2a, hybrid over allgather)
  bool check_finite = false;      // reject non-finite q/k/v/dout on every rank (costs a pass)
  std::size_t plan_cache_capacity = 8;  // 1..kMaxPlanCacheCapacity
  CpScheme scheme = CpScheme::allgather;  // part of the ranks' agreement
  // hybrid only (docs/cp.md): ranks of one all-to-all group, 1 <= cp_inner <= cp, dividing
  // cp; the groups are consecutive ranks. Hq and Hkv split as for a2a at cp = cp_inner.
  int cp_inner = 0;
  CpScheme hybrid_outer = CpScheme::allgather;  // hybrid only: allgather or ring
  // The split plan() makes (docs/planner.md). padding_free: no padding, local token counts
  // differ between ranks; the all-gather scheme gathers with all_gather_v and reduce-scatters
  // dK/dV by all_to_all_v summed in rank order (deterministic). The other schemes refuse it.
  CpSplit split = CpSplit::padded;
  // The all-gather scheme in runs mode at cp > 1 (docs/cp.md "Overlap"): true (the default) runs the kernels
  // per group of KV heads (cp_overlap_groups: the largest divisor of Hkv that is at most 4):
  // every group's receives posted at once, group g's sends to a peer once group g-1's to it have
  // completed (from the kernels' progress callback, the polls, at the latest before this rank
  // waits for group g), so that group 0 has the link to itself and group g is computed while
  // groups g+1.. travel; backward sends group g's dK/dV while group g+1's are computed. Heads are independent
  // and every sum keeps its order, so the results are bitwise those of false (one all-gather,
  // one fused call, one reduce-scatter) when the communicator's reduce-scatter is its own
  // fixed-order ring (CommAlgorithm::ring, the default) or the split is padding-free; with
  // CommAlgorithm::mpi the fused path sums in MPI's order and the two may differ in rounding. The
  // first group's forward and the last group's backward also run by two groups of documents
  // where the batch cuts into one of about a quarter of the work (Hkv = 1: its one group;
  // docs/cp.md "Overlap"), bitwise the same; Hkv = 1 without a cut: no overlap. Part of
  // the ranks' agreement; index mode, cp = 1 and the ring, pass-Q and a2a schemes ignore it (the
  // hybrid's outer all-gather follows it).
  bool overlap = true;
  // The all-gather scheme in runs mode at cp > 1 (the hybrid's outer all-gather too), when every
  // rank runs on one host (docs/cp.md "Shared memory"): true (the default) moves K/V and the
  // dK/dV partials through shared-memory buffers instead of messages. Every rank writes its own
  // rows there and reads its peers' in place after a barrier: no copy, no transfer to hide
  // (and no KV-head groups: overlap is moot); the kernels' packed K/V too, each rank packing
  // a share, in a third buffer (where the path and dtype have a KvPackLayout: all but bf16 on
  // the bf16 dot-product paths). Each context alive holds one K/V buffer of the
  // layer's pool (up to 256); ranks on several hosts take the message path. Sums keep the
  // ring reduce-scatter's order: bitwise the results of false (with CommAlgorithm::mpi, which
  // sums in MPI's order, they may differ in rounding). Part of the ranks' agreement.
  bool shared_memory = true;
};

// How many KV-head groups the all-gather scheme's forward and backward run one after the
// other for `cfg` at `cp` ranks (1: no overlap): the largest divisor of num_heads_k that is at
// most 4 when cfg.overlap holds for the all-gather scheme in runs mode at cp > 1, else 1.
int cp_overlap_groups(const CpAttnConfig& cfg, int cp);

// The scheme that to_string spells `name`, for front ends that take it as text (the Python
// package passes its `scheme` string through, so a new scheme needs no binding change).
// Throws cpattn::Error listing the names when there is none.
CpScheme parse_cp_scheme(std::string_view name);

// The checks CpAttention's constructor makes, for a communicator of `cp` ranks, without one:
// a front end calls them before any collective (e.g. the communicator's duplicate), so that
// bad arguments fail every rank alike with nothing sent. check_cp_scheme: the scheme's own
// fields (scheme, cp_inner, hybrid_outer, kv_mode, split), heads and options aside;
// check_cp_attn_config: all of cfg (heads, head dims and options too, and the a2a and hybrid
// schemes' head-count rules). The constructor adds one rule of the communicator's own: a
// deterministic all-gather needs its ring reduce-scatter. Throw cpattn::Error naming the field.
void check_cp_scheme(const CpAttnConfig& cfg, int cp);
void check_cp_attn_config(const CpAttnConfig& cfg, int cp);

// What one rank's CpAttention forward + backward allocates, in bytes, from the configuration
// and the plan's shapes, so that a caller can budget memory before the first call (the layer
// itself refuses a new plan whose estimate exceeds available_memory(), on every rank, before
// any payload moves: see memory.hpp). Upper estimates; the caller's own tensors (q, k, v, out,
// dout, dq, dk, dv: local_tokens rows each) come on top.
// Per scheme: allgather (cp blocks gathered, the padding-free split's global tokens), ring
// and pass-Q (a copy of the local K/V kept, visiting blocks double-buffered), a2a and hybrid
// (this member's heads of its group's tokens, plus the outer all-gather or ring over them).
struct CpMemoryEstimate {
  uint64_t context = 0;         // each CpContext until its backward: gathered K/V (allgather;
                                // ring, pass-Q: a copy of the local block), lse, and a2a/hybrid's
                                // group-layout q and out with the outer layer's context
  uint64_t buffers = 0;         // the layer's reused buffers: fp32 dK/dV of every gathered row
                                // (index mode: and of the copy; padding-free: the reduce-scatter's
                                // blocks; the overlap: one group's sums and lse, and its receive
                                // blocks, kept too), the ring's
                                // and pass-Q's blocks and fp32 sums, the all-to-all's blocks and
                                // the outer layer's buffers. Runs mode (message path) also keeps
                                // consumed contexts' K/V for the next forwards: in `context`, not here
  uint64_t kernel_scratch = 0;  // attention_backward's own (attention_backward_scratch_bytes)
  // One forward + backward with `contexts` contexts alive at once (a model's layers).
  uint64_t total(int64_t contexts = 1) const;
  std::string describe() const;  // "context X, buffers Y, kernel scratch Z", for messages
};
// Before a plan exists: `local_tokens` as the plan will have (at least ceil(tokens / cp));
// the kernel's per-thread blocks are left out (they need the plan's longest task).
CpMemoryEstimate cp_memory_estimate(const CpAttnConfig& cfg, int cp, int64_t local_tokens);
// (a2a and hybrid: throws cpattn::Error for a plan the scheme cannot run, padding-free or of a
// cp that cp_inner does not divide.)
CpMemoryEstimate cp_memory_estimate(const CpAttnConfig& cfg, const RankPlan& plan);


// Tensors are this rank's local rows, [local_tokens, heads, dim] in cfg.dtype. q, out, dout
// and dq may be strided views (head_dim contiguous); k, v, dk and dv must be contiguous (they
// travel through the communicator as they are).
struct CpForwardArgs {
  // The batch: its global real boundaries (leading 0; int64) or a plan for this rank made by
  // CpAttention::plan or get_thd_load_balanced_cp_metadata (then cu_seqlens may be empty),
  // of the config's split.
  std::span<const int64_t> cu_seqlens = {};
  std::shared_ptr<const RankPlan> plan = nullptr;
  ConstTensorView q = {};     // [local_tokens, Hq, Dqk]
  ConstTensorView k = {};     // [local_tokens, Hkv, Dqk], contiguous
  ConstTensorView v = {};     // [local_tokens, Hkv, Dv], contiguous
  TensorView out = {};        // [local_tokens, Hq, Dv], written (padding rows: 0)
  float* lse = nullptr;  // optional [local_tokens, Hq] fp32 (token-major, unlike FlashAttention's
                         // [Hq, total] softmax_lse); -inf for padding rows
  // This call's dropout seed (e.g. one per layer and step); unset: cfg.options.seed. Kept in
  // the context, so that backward drops the same entries.
  std::optional<uint64_t> dropout_seed = std::nullopt;
  // A wrapper's own check of this rank's arguments failed with this message (e.g. a binding that
  // could not view an array): the call sends nothing and fails on every rank with it, at its
  // agreement, as with the layer's own checks (the other fields are then not read).
  std::string_view caller_error = {};
};

struct CpBackwardArgs {
  ConstTensorView q = {};     // the forward's q (unchanged since)
  ConstTensorView out = {};   // the forward's out (unchanged since)
  ConstTensorView dout = {};  // [local_tokens, Hq, Dv]
  TensorView dq = {};         // [local_tokens, Hq, Dqk], written
  TensorView dk = {};         // [local_tokens, Hkv, Dqk], contiguous, written
  TensorView dv = {};         // [local_tokens, Hkv, Dv], contiguous, written
  std::string_view caller_error = {};  // as CpForwardArgs'
};

// What a forward hands its backward, like an autograd context: the plan, the gathered K/V
// (or their index_select copy; the ring and pass-q schemes: a copy of the local K/V only) and lse. Move-only; the caller keeps one per forward and hands
// it to backward, which consumes it (releases its buffers; the all-gather's backward in runs mode (message path)
// hands its gathered K/V to the CpAttention, for the next forward's context). Not tied to the CpAttention's
// lifetime in memory, but only that CpAttention's backward accepts it.
class CpContext {
 public:
  CpContext();
  ~CpContext();
  CpContext(CpContext&&) noexcept;
  CpContext& operator=(CpContext&&) noexcept;
  CpContext(const CpContext&) = delete;
  CpContext& operator=(const CpContext&) = delete;

  bool valid() const;             // holds a forward's state (not yet consumed by backward)
  const RankPlan& plan() const;   // the forward's plan
  std::span<const float> lse() const;  // [local_tokens, Hq], the forward's lse
  std::size_t bytes() const;      // memory held (gathered K/V, lse; a shared-memory K/V buffer is the layer's)

 private:
  friend class CpAttention;
  struct State;
  std::shared_ptr<State> s_;
};

// Seconds spent, accumulated over calls.
struct CpStats {
  double compute_s = 0;  // kernels, copies and conversions
  // Exposed communication: time inside communication calls (the agreement, blocking
  // collectives, posting, polling, waiting for a transfer still in flight): what this rank
  // waited and overlap did not hide.
  double comm_s = 0;
  // Total communication: comm_s plus the time the overlapped all-gather's and reduce-scatter's
  // transfers were in flight while this rank computed (from the post to the poll or wait
  // that found them done: an upper bound). Without overlap it equals comm_s.
  double comm_total_s = 0;
  // Of comm_s, by part (docs/cp.md "Exposed and total"): the ranks' agreement before every call
  // (where a rank that arrives first waits for the last: it absorbs the ranks' skew); the
  // all-gather scheme's forward wait for its first K/V (the whole all-gather; overlapped: the
  // posts and group 0's blocks); the rest of its forward's communication (overlapped: the
  // later groups' waits, the polls, the sends' completion; else 0); its backward's (the
  // reduce-scatter; overlapped: the posts, the polls and the wait for the last group's dK/dV).
  // The other schemes count their agreement only.
  double agree_s = 0, first_kv_s = 0, later_kv_s = 0, dkv_s = 0;
  int64_t forward_calls = 0;
  int64_t backward_calls = 0;
  // Of those, the calls whose K/V (forward) or dK/dV partials (backward) went through the
  // node's shared memory (CpAttnConfig::shared_memory) instead of messages.
  int64_t shared_forwards = 0;
  int64_t shared_backwards = 0;
  // Of those, the calls whose kernels packed K/V together with the peers, each rank a share
  // (attention_kv_pack_layout not alone, from the layer's second shared call on: docs/cp.md).
  int64_t shared_packs = 0;
  // Why the layer gave up the node's shared memory and took the message path for good, as the
  // ranks found it when they tried to map a buffer (the ranks on several hosts, a rank in
  // another pid namespace, no memory for the buffer; NodeBuffer::create's `why`); empty while
  // it has not. Kept by reset_stats.
  std::string shared_memory_off;
  // The largest the layer's own buffers plus the contexts it handed out and that are still
  // alive have been, a forward's own transients included (the non-overlapped all-gather's
  // gathered K/V beside their index-mode copy; runs mode (message path) keeps consumed contexts'
  // K/V for the next forwards; the shared-memory K/V buffers in full on every rank, the dK/dV buffer as
  // one slot) (the kernels' internal scratch,
  // see attention_backward_scratch_bytes, comes on top).
  std::size_t peak_buffer_bytes = 0;
  // Payload bytes this layer's calls sent and received, over every communicator it uses (the
  // a2a and hybrid schemes' sub-groups too; Communicator::bytes_sent counts its own only); not
  // the agreements', but the one-time setup of the shared-memory buffers in the call that makes
  // them (their host names and handles, tens of bytes per rank) is counted. Per rank they are
  // what the algorithm that moved the payload sent: a ring sends every block but its right
  // neighbour's (its own and those it forwards), the overlapped all-gather sends its own block to
  // each peer (cp - 1 times its own); where the ranks' blocks differ in size (the padding-free
  // split) the two differ per rank, and their sums over the ranks are the same.
  int64_t bytes_sent = 0;
  int64_t bytes_received = 0;
};

// The name of every CpAttention call's agreement (cpattn::agree): its first collective, where
// each rank's argument errors and fingerprint meet (a wrapper's own meetings may take it too,
// so that their messages read the same).
inline constexpr std::string_view kCpAgreement = "CP attention";

class CpAttention {
 public:
  // Borrows `comm` (which must outlive this object, unmoved); cp = comm.size(). Checks `cfg`
  // (check_cp_attn_config) and throws cpattn::Error on this rank alone: not collective, so that
  // a front end can make its layers among its other local preparations and share any rank's
  // error in one agreement of its own before the first call (cpattn run does; a rank that
  // throws here and goes on alone leaves the others waiting in their first call's agreement
  // until the communicator's deadline).
  CpAttention(Communicator& comm, const CpAttnConfig& cfg);
  ~CpAttention();
  CpAttention(const CpAttention&) = delete;
  CpAttention& operator=(const CpAttention&) = delete;

  // This rank's plan for `cu_seqlens` (from the layer's cache: every layer of a step shares
  // it). Not collective. Throws cpattn::Error for invalid boundaries.
  std::shared_ptr<const RankPlan> plan(std::span<const int64_t> cu_seqlens);
  std::shared_ptr<const RankPlan> plan(std::span<const int32_t> cu_seqlens);  // PyTorch's int32

  // Collective over the communicator. Forwards and backwards may interleave in any order that
  // is the same on every rank (e.g. every layer's forward, then the backwards in reverse).
  // In throw_error timeout mode, a timed-out forward may leave requests that still read the
  // caller's k and v: keep them alive until Communicator::drain() succeeds or the job ends.
  [[nodiscard]] CpContext forward(const CpForwardArgs& args);
  // Consumes `ctx` (made by this object's forward); collective.
  void backward(CpContext& ctx, const CpBackwardArgs& args);

  const CpAttnConfig& config() const;
  const CpStats& stats() const;
  const PlanCache& plan_cache() const;
  void reset_stats();

 private:
  struct State;
  std::unique_ptr<State> s_;
};

// Every rank's real rows of a local tensor (this rank's `local` under `plan`), in the batch's
// global order as fp32: [plan.global_tokens, local.heads, local.dim] on every rank. Collective:
// the inverse of take_local_rows, for checks and for collecting outputs. The ranks first agree
// on the shape (a rank that differs fails every rank with one message).
std::vector<float> gather_global_rows(Communicator& comm, const RankPlan& plan,
                                      ConstTensorView local);

}  // namespace cpattn
