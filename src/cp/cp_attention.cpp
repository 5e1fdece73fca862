// CpAttention: docs/design.md section 7, KV all-gather with the symmetric split.
#include <cpattn/cp.hpp>

#include "a2a.hpp"
#include <cpattn/dtype.hpp>
#include <cpattn/error.hpp>
#include <cpattn/layout.hpp>
#include <cpattn/memory.hpp>
#include <cpattn/node_buffer.hpp>
#include <cpattn/tensor.hpp>

#include "cp_internal.hpp"
#include "pass_q.hpp"

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>

namespace cpattn {

namespace {

// What moves K/V between ranks: the hybrid's outer scheme; a2a runs the all-gather layer at cp_outer = 1.
CpScheme kv_scheme(const CpAttnConfig& cfg) {
  return cfg.scheme == CpScheme::hybrid ? cfg.hybrid_outer
         : cfg.scheme == CpScheme::a2a  ? CpScheme::allgather
                                        : cfg.scheme;
}

using namespace cp_detail;

// The overlapped all-gather's and reduce-scatter's start_send/start_recv streams (pass-Q's
// partials use 11 on their own layers).
constexpr int kTagGather = 20, kTagScatter = 21;

// Every rank's local rows, rank-major: rank s's at layout.rank_begin[s]. The padded split's
// equal blocks go through all_gather; the padding-free split's, of differing sizes, through
// all_gather_v. `row` is elements per token row.
template <class T>
void all_gather_rows(Communicator& comm, const RankPlan& plan, const void* local, int64_t row, void* all) {
  const auto mine = static_cast<std::size_t>(plan.local_tokens * row);
  const std::span<const T> send{static_cast<const T*>(local), mine};
  const std::span<T> recv{static_cast<T*>(all), static_cast<std::size_t>(plan.layout.rank_begin.back() * row)};
  if (plan.split == CpSplit::padded) return comm.all_gather<T>(send, recv);
  std::vector<int64_t> counts(static_cast<std::size_t>(plan.cp));
  for (int r = 0; r < plan.cp; ++r) counts[r] = plan.layout.rank_tokens(r) * row;
  comm.all_gather_v<T>(send, counts, recv);
}

void all_gather_rows(Communicator& comm, DType t, const RankPlan& plan, const void* local, int64_t row, void* all) {
  if (t == DType::f32)
    all_gather_rows<float>(comm, plan, local, row, all);
  else
    all_gather_rows<uint16_t>(comm, plan, local, row, all);
}

// The reduce-scatter of per-gathered-row sums: local[i] = sum over ranks of their all[rank_begin[rank()] + i].
// The padded split's equal blocks use the communicator's fixed-order reduce-scatter; the
// padding-free split's differing blocks travel by all_to_all_v and are added here in rank
// order 0..cp-1, so the sum never depends on timing either.
void reduce_scatter_rows(Communicator& comm, const RankPlan& plan, const std::vector<float>& all, int64_t row,
                         std::vector<float>& local, std::vector<float>& scratch) {
  local.resize(static_cast<std::size_t>(plan.local_tokens * row));
  if (plan.split == CpSplit::padded) return comm.reduce_scatter_sum(all, local);
  const int cp = plan.cp;
  std::vector<int64_t> send_counts(static_cast<std::size_t>(cp)), recv_counts(static_cast<std::size_t>(cp));
  for (int r = 0; r < cp; ++r) {
    send_counts[r] = plan.layout.rank_tokens(r) * row;
    recv_counts[r] = static_cast<int64_t>(local.size());
  }
  scratch.resize(local.size() * static_cast<std::size_t>(cp));
  comm.all_to_all_v<float>(all, send_counts, scratch, recv_counts);
  std::fill(local.begin(), local.end(), 0.0f);
  for (int r = 0; r < cp; ++r) {
    const float* part = scratch.data() + r * local.size();
    for (std::size_t i = 0; i < local.size(); ++i) local[i] += part[i];
  }
}

// out[i] = the sum over ranks q of part(q)[i], i < n, in reduce_scatter_rows' order (so that
// the sums are bitwise its): the padded split's ring order ((x[me+1] + x[me+2]) + ...) + x[me],
// the padding-free split's 0 + x[0] + x[1] + ... .
template <class Part>
void sum_rank_parts(CpSplit split, int cp, int me, const Part& part, std::size_t n, float* out) {
  if (split == CpSplit::padded) {
    std::copy_n(part((me + 1) % cp), n, out);
    for (int st = 2; st <= cp; ++st) {
      const float* x = part((me + st) % cp);
      for (std::size_t i = 0; i < n; ++i) out[i] += x[i];
    }
  } else {
    std::fill_n(out, n, 0.0f);
    for (int q = 0; q < cp; ++q) {
      const float* x = part(q);
      for (std::size_t i = 0; i < n; ++i) out[i] += x[i];
    }
  }
}

// ALiBi slopes as one number for the fingerprint (0 without ALiBi): FNV-1a over their bits.
uint64_t hash_slopes(const float* slopes, int n) {
  if (!slopes) return 0;
  uint64_t h = 1469598103934665603ull;
  for (int i = 0; i < n; ++i) {
    h ^= std::bit_cast<uint32_t>(slopes[i]);
    h *= 1099511628211ull;
  }
  return h | 1;
}

// The reference design's index_select form of `w`: every task's keys copied, in order, into
// one contiguous run of a new buffer; index[i] is the gathered row that copy row i holds.
// For causal tasks, index is the plan's kv_gather_index without padding keys.
void copy_form(const WorkList& w, std::vector<int64_t>& index, WorkList& copy) {
  index.clear();
  copy.tasks = w.tasks;
  copy.runs.clear();
  for (std::size_t t = 0; t < w.tasks.size(); ++t) {
    const auto begin = static_cast<int64_t>(index.size());
    for (int64_t r = w.tasks[t].run_begin; r < w.tasks[t].run_end; ++r)
      for (int64_t e = 0; e < w.runs[r].len; ++e) index.push_back(w.runs[r].row + e);
    // The runs of a task hold consecutive positions, so one run with the first position is exact.
    copy.runs.push_back(KeyRun{.row = begin, .len = static_cast<int64_t>(index.size()) - begin,
                               .pos = w.runs[w.tasks[t].run_begin].pos});
    copy.tasks[t].run_begin = static_cast<int64_t>(t);
    copy.tasks[t].run_end = static_cast<int64_t>(t) + 1;
  }
}

// `keys` (tasks over the rank-major gathered buffer) over the document-ordered buffer: a run
// at position pos of document d is at row docs[d].padded_begin + pos there, so a task's runs,
// consecutive positions, become one run (as one process's varlen call has it).
WorkList in_document_order(const RankPlan& plan, const WorkList& keys) {
  WorkList w;
  w.tasks = keys.tasks;
  for (AttnTask& t : w.tasks) {
    const int64_t base = plan.docs[t.doc].padded_begin;
    const int64_t begin = static_cast<int64_t>(w.runs.size());
    for (int64_t r = t.run_begin; r < t.run_end; ++r) {
      const KeyRun k{.row = base + keys.runs[r].pos, .len = keys.runs[r].len, .pos = keys.runs[r].pos};
      if (static_cast<int64_t>(w.runs.size()) > begin && w.runs.back().row + w.runs.back().len == k.row)
        w.runs.back().len += k.len;
      else
        w.runs.push_back(k);
    }
    t.run_begin = begin;
    t.run_end = static_cast<int64_t>(w.runs.size());
  }
  return w;
}

// Heads [h0, h0 + n) of `t`: the same rows and strides, `n` heads from head h0 (a view of no
// rows keeps its data, which may be null).
template <class Ptr>
BasicTensorView<Ptr> head_slice(BasicTensorView<Ptr> t, int h0, int n) {
  using Byte = std::conditional_t<std::is_const_v<std::remove_pointer_t<Ptr>>, const std::byte, std::byte>;
  BasicTensorView<Ptr> s = t;
  if (t.rows > 0)
    s.data = static_cast<Byte*>(t.data) + static_cast<std::size_t>(h0 * t.head_step()) * dtype_size(t.dtype);
  s.heads = n;
  s.row_stride = t.row_step();
  s.head_stride = t.head_step();
  return s;
}

// Columns [col, col + width) of every one of `rows` rows of `row` bytes, into (or, `unpack`,
// from) a contiguous [rows, width] buffer: one KV-head group of a [rows, Hkv, D] tensor.
void copy_columns(const std::byte* src, std::byte* dst, int64_t rows, std::size_t row, std::size_t col,
                  std::size_t width, bool unpack) {
  for (int64_t i = 0; i < rows; ++i) {
    const auto r = static_cast<std::size_t>(i);
    if (unpack)
      std::memcpy(dst + r * row + col, src + r * width, width);
    else
      std::memcpy(dst + r * width, src + r * row + col, width);
  }
}

// Transfers in flight, completed one by one (the overlapped all-gather and reduce-scatter),
// and when the last of them was seen complete, for CpStats::comm_total_s.
struct InFlight {
  Communicator& comm;
  std::vector<CommRequest> reqs;
  Clock::time_point posted = Clock::now(), last_done = posted;
  // Moves every transfer along (MPI progresses them only inside its calls); never waits.
  void poll() {
    bool any = false;
    for (CommRequest& r : reqs) any = (r.active() && comm.test(r)) || any;
    if (any) last_done = Clock::now();
  }
  // One step of MPI's progress, for the kernels' progress callback (test_first_active).
  void advance() {
    if (test_first_active(comm, reqs)) last_done = Clock::now();
  }
  // Waits for reqs[i0, i1) under the communicator's deadline, calling `between` (if given)
  // while they are in flight (Communicator::wait). Each is moved out first: `between` may add
  // requests (and reallocate reqs).
  void wait(std::size_t i0, std::size_t i1, const std::function<void()>* between = nullptr) {
    bool any = false;
    for (std::size_t i = i0; i < i1; ++i)
      if (reqs[i].active()) {
        CommRequest r = std::move(reqs[i]);
        if (between)
          comm.wait(r, *between);
        else
          comm.wait(r);
        any = true;
      }
    if (any) last_done = Clock::now();
  }
  double span() const { return std::chrono::duration<double>(last_done - posted).count(); }
};

// rows[i] = all[index[i]], rows of `row_bytes`.
void index_select(const std::byte* all, const std::vector<int64_t>& index, std::size_t row_bytes,
                  std::vector<std::byte>& rows) {
  rows.resize(index.size() * row_bytes);
  for (std::size_t i = 0; i < index.size(); ++i)
    std::memcpy(rows.data() + i * row_bytes, all + index[i] * row_bytes, row_bytes);
}

// check_finite: throws naming `name`, the first bad element and its global token (local rows
// of a plan; padding rows are the layer's own zeros, never bad).
void check_finite(const char* fn, const char* name, ConstTensorView t, const RankPlan& plan) {
  const std::optional<ElementIndex> bad = first_nonfinite(t);
  if (!bad) return;
  float value = 0;
  to_float(static_cast<const std::byte*>(t.data) + (t.offset(bad->row, bad->head) + bad->dim) * dtype_size(t.dtype),
           t.dtype, 1, &value);
  CPATTN_CHECK(false, fn, ": ", describe_element(name, value, plan.real_token_index[bad->row], *bad),
               " (local row ", bad->row, "; check_finite)");
}

// One tensor argument of forward/backward: present, [local_tokens, heads, dim] with the
// configured heads and head dim, the configured dtype; `contiguous` for the tensors that travel
// through the communicator as they are. `heads_name`/`dim_name` name the configuration's fields.
struct Expected {
  int64_t rows;
  int heads;
  const char* heads_name;
  int dim;
  const char* dim_name;
  DType dtype;
};
void check_view(const char* fn, const char* name, ConstTensorView t, const Expected& e, bool contiguous) {
  CPATTN_CHECK(t.addressable(), fn, ": ", name, " must not be null");
  CPATTN_CHECK(t.rows == e.rows && t.heads == e.heads && t.dim == e.dim, fn, ": ", name,
               " must be [local_tokens = ", e.rows, ", ", e.heads_name, " = ", e.heads, ", ", e.dim_name, " = ",
               e.dim, "] (the plan's local tokens, the configuration's heads and head dim), got [", t.rows, ", ",
               t.heads, ", ", t.dim, "]");
  CPATTN_CHECK(t.dtype == e.dtype, fn, ": ", name, " has dtype ", to_string(t.dtype), ", the configuration's is ",
               to_string(e.dtype));
  CPATTN_CHECK(t.head_step() >= t.dim && (t.rows <= 1 || t.row_step() >= t.head_step() * (t.heads - 1) + t.dim),
               fn, ": ", name, "'s strides overlap its heads or rows: head_stride ", t.head_step(),
               " must be >= dim ", t.dim, " and row_stride ", t.row_step(), " >= head_stride * (heads - 1) + dim = ",
               t.head_step() * (t.heads - 1) + t.dim);
  CPATTN_CHECK(!contiguous || t.is_contiguous(), fn, ": ", name, " must be contiguous (row_stride ",
               int64_t{e.heads} * e.dim, ", head_stride ", e.dim, "), got row_stride ", t.row_step(),
               ", head_stride ", t.head_step());
}

// This rank's error for a call's agreement: the caller's own (CpForwardArgs::caller_error), or
// else the first check of `checks` that failed; empty when all passed. Any exception becomes the
// error (bad_alloc and the like must fail on every rank too, not on this one alone).
template <class Checks>
std::string local_error(const char* fn, std::string_view caller_error, Checks&& checks) {
  if (!caller_error.empty()) return std::string(caller_error);
  try {
    checks();
  } catch (const Error& e) {
    return e.message();
  } catch (const std::exception& e) {
    return std::string(fn) + ": " + e.what();
  }
  return {};
}

// Zero the rows of `t` that hold padding tokens (the kernel writes only real rows).
void zero_padding_rows(TensorView t, const RankPlan& plan) {
  const std::size_t es = dtype_size(t.dtype);
  for (int64_t i = 0; i < plan.local_tokens; ++i)
    if (plan.real_token_index[i] < 0)
      for (int h = 0; h < t.heads; ++h)
        std::memset(static_cast<std::byte*>(t.data) + t.offset(i, h) * es, 0, static_cast<std::size_t>(t.dim) * es);
}

// What the kernel runs for one plan: the tasks without padding, and in index mode their
// index_select form. Shared by every context made from the same plan.
struct PreparedWork {
  std::shared_ptr<const RankPlan> plan;  // held, so that its address is never reused
  WorkList work;
  std::vector<int64_t> copy_index;  // index mode: gathered row of each copied key row
  // Runs mode: `work` reads the gathered K/V in document order (one key run per task) through
  // this row map, document-order row r being gathered row key_rows[r] (document_order_moves
  // row by row; AttnInputs::key_rows), and the kernel writes dK/dV at the gathered rows: no
  // copy of the K/V or of their gradients moves rows. Empty when the all-gather leaves them
  // in that order (cp = 1).
  std::vector<int64_t> key_rows;
  // Ring: per step s, the tasks over the visiting block of rank (rank - s) mod cp, key rows
  // local to that block; a step with no task is skipped. returns[s]: whether rank
  // (rank + s) mod cp's queries see this rank's block, i.e. whether the partial dK/dV it sends
  // home in backward is full (else empty).
  std::vector<WorkList> steps;
  std::vector<char> returns;
  PassQWork passq;  // pass-Q: the visiting query blocks' tasks over this rank's K/V
  // The overlapped all-gather (runs mode, cp > 1; docs/cp.md "Overlap"): the forward's first
  // KV-head group and the backward's last run as one call per group of documents, cut so that
  // the first group (forward: a short first wait) or the last (backward: a short last
  // transfer) holds about a quarter of the work (overlap_doc_cut); empty: one call.
  struct DocPart {
    WorkList work;                // `work`'s tasks of the part's documents, with their runs
    std::vector<int64_t> lo, hi;  // per rank: its local rows [lo, hi) of those documents
  };
  std::vector<DocPart> fwd_parts, bwd_parts;
  int64_t fwd_cut = 0, bwd_cut = 0;  // the parts' overlap_doc_cut (0: no parts), agreed on
  int64_t longest_task = 0;  // of `work`: the parts' backward calls size and sum as the whole call
  // Rows of the rank-major gathered buffer that no task of `work` reads (padding, keys the
  // window leaves out): the parts' backward calls leave them alone, and they are zeroed first.
  std::vector<std::pair<int64_t, int64_t>> unnamed;
};

// The parts of documents [0, cut) and [cut, documents) of `w` (its tasks in document order)
// under `plan`'s layout.
std::vector<PreparedWork::DocPart> doc_parts(const RankPlan& plan, const WorkList& w, int64_t cut) {
  if (cut <= 0) return {};
  const SplitLayout& layout = plan.layout;
  const int cp = plan.cp;
  const int64_t per_doc = chunks_per_document(cp);
  const auto docs = static_cast<int64_t>(plan.docs.size());
  std::vector<PreparedWork::DocPart> parts(2);
  for (int p = 0; p < 2; ++p) {
    PreparedWork::DocPart& part = parts[static_cast<std::size_t>(p)];
    const int64_t d0 = p == 0 ? 0 : cut, d1 = p == 0 ? cut : docs;
    int64_t from = -1, to = -1;  // the runs of the last task copied (tasks may share them)
    for (const AttnTask& t : w.tasks) {
      if (t.doc < d0 || t.doc >= d1) continue;
      AttnTask& u = part.work.tasks.emplace_back(t);
      if (t.run_begin != from || t.run_end != to) {
        from = t.run_begin;
        to = t.run_end;
        part.work.runs.insert(part.work.runs.end(), w.runs.begin() + from, w.runs.begin() + to);
      }
      u.run_end = static_cast<int64_t>(part.work.runs.size());
      u.run_begin = u.run_end - (to - from);
    }
    part.lo.assign(static_cast<std::size_t>(cp), std::numeric_limits<int64_t>::max());
    part.hi.assign(static_cast<std::size_t>(cp), 0);
    for (int64_t d = d0; d < d1; ++d)
      for (int64_t j = 0; j < per_doc; ++j) {
        const DocChunk& ch = layout.chunks[static_cast<std::size_t>(d * per_doc + j)];
        if (ch.len == 0) continue;
        auto& lo = part.lo[static_cast<std::size_t>(ch.rank)];
        auto& hi = part.hi[static_cast<std::size_t>(ch.rank)];
        lo = std::min(lo, ch.local_row);
        hi = std::max(hi, ch.local_row + ch.len);
      }
    for (int s = 0; s < cp; ++s)
      if (part.hi[static_cast<std::size_t>(s)] == 0) part.lo[static_cast<std::size_t>(s)] = 0;
  }
  return parts;
}

// The ring's per-step work lists from `keys` (the tasks over the rank-major gathered buffer,
// without padding, restricted to the mask): step s holds rank (rank - s) mod cp's block.
std::vector<WorkList> ring_steps(const RankPlan& plan, const WorkList& keys, const AttnOptions& o) {
  const int cp = plan.cp;
  std::vector<WorkList> steps;
  for (int st = 0; st < cp; ++st) steps.push_back(work_on_block(plan, keys, o, (plan.rank - st + cp) % cp));
  return steps;
}

// Whether rank (rank + s) mod cp has work on this rank's block at its step s, for s = 0 .. cp-1:
// from the chunk table, without planning the other ranks.
std::vector<char> ring_returns(const RankPlan& plan, const AttnOptions& o) {
  const int cp = plan.cp;
  const std::vector<char> sees = ranks_seeing_block(plan, o, plan.rank);
  std::vector<char> returns;
  for (int st = 0; st < cp; ++st) returns.push_back(sees[static_cast<std::size_t>((plan.rank + st) % cp)]);
  return returns;
}

}  // namespace

namespace cp_detail {

// Where every chunk's rows go when the rank-major gathered buffer is put in document order:
// document d's rows at docs[d].padded_begin (its padded rows under the padded split, its real
// ones under the padding-free split), each chunk at its position. Chunks adjacent in both
// buffers are one move. Empty when the gathered buffer already is in document order (cp = 1).
std::vector<RowMove> document_order_moves(const RankPlan& plan) {
  const SplitLayout& layout = plan.layout;
  const int64_t n = chunks_per_document(plan.cp);
  std::vector<RowMove> moves;
  bool identity = true;
  for (std::size_t d = 0; d < plan.docs.size(); ++d)
    for (int64_t m = 0; m < n; ++m) {
      const DocChunk& c = layout.chunks[d * n + m];
      if (c.len == 0) continue;  // an empty padding-free chunk
      const RowMove mv{.gathered = layout.gathered_row(c), .ordered = plan.docs[d].padded_begin + c.pos, .len = c.len};
      identity = identity && mv.gathered == mv.ordered;
      if (!moves.empty() && moves.back().gathered + moves.back().len == mv.gathered &&
          moves.back().ordered + moves.back().len == mv.ordered)
        moves.back().len += mv.len;
      else
        moves.push_back(mv);
    }
  if (identity) moves.clear();
  return moves;
}

}  // namespace cp_detail

struct CpContext::State {
  uint64_t owner = 0;           // the id of the CpAttention whose forward made it
  uint64_t seed = 0;            // the dropout seed of its forward
  int64_t forward_call = 0;     // which forward (1, 2, ...) made it: part of the agreement
  std::shared_ptr<const RankPlan> plan;
  std::shared_ptr<const PreparedWork> work;
  // What the kernel reads as keys: the rank-major gathered K/V (runs mode) or their
  // index_select copy (index mode), `total_k` rows; and the forward's lse.
  std::vector<std::byte> k, v;
  int64_t total_k = 0;
  // KV-head groups of k and v (cp_overlap_groups): > 1, group-major, [groups][total_k,
  // Hkv / groups, D], each group rank-major as gathered (read in document order through the
  // plan's key_rows); 1: [total_k, Hkv, D].
  int groups = 1;
  // Not null: k and v are empty and the K/V are in this node-shared buffer (CpAttnConfig::
  // shared_memory), [total_k, Hkv, D_qk] then [total_k, Hkv, D_v], every rank's rows written
  // by that rank. Held here so that the layer's next forward knows the buffer is taken.
  std::shared_ptr<NodeBuffer> shared;
  const std::byte* k_data() const { return shared ? shared->data() : k.data(); }
  const std::byte* v_data() const {
    return shared ? shared->data() + shared_v_offset : v.data();
  }
  std::size_t shared_v_offset = 0;  // bytes from the shared buffer's start to V
  std::vector<float> lse;
  std::unique_ptr<detail::A2aContext> a2a;  // the a2a and hybrid schemes' state
  // The live-context byte count of the CpAttention that made it (for its peak figure).
  std::shared_ptr<std::size_t> live_bytes;

  std::size_t bytes() const {
    return k.capacity() + v.capacity() + lse.capacity() * sizeof(float) + (a2a ? a2a->bytes() : 0);
  }
  ~State() {
    if (live_bytes) *live_bytes -= std::min(*live_bytes, counted);
  }
  std::size_t counted = 0;  // what this context added to *live_bytes
};

CpContext::CpContext() = default;
CpContext::~CpContext() = default;
CpContext::CpContext(CpContext&&) noexcept = default;
CpContext& CpContext::operator=(CpContext&&) noexcept = default;
bool CpContext::valid() const { return s_ != nullptr; }
const RankPlan& CpContext::plan() const {
  CPATTN_CHECK(s_ != nullptr, "CpContext::plan(): the context holds no forward (consumed or never made)");
  return *s_->plan;
}
std::span<const float> CpContext::lse() const {
  CPATTN_CHECK(s_ != nullptr, "CpContext::lse(): the context holds no forward (consumed or never made)");
  return s_->lse;
}
std::size_t CpContext::bytes() const { return s_ ? s_->bytes() : 0; }

// Ids of CpAttention objects (never reused, unlike addresses): a context names its maker.
std::atomic<uint64_t> next_attention_id{1};

struct CpAttention::State {
  const uint64_t id = next_attention_id.fetch_add(1);
  Communicator& comm;
  CpAttnConfig cfg;
  PlanCache cache;
  CpStats stats;
  std::shared_ptr<const PreparedWork> prepared;  // of the last plan seen
  // The a2a level's outer layer (A2aLevel::connect): its maker counts it in its memory check.
  bool nested = false;
  std::shared_ptr<std::size_t> live_bytes = std::make_shared<std::size_t>(0);
  // Backward's buffers, kept across calls (one backward runs at a time): fp32 dK/dV of every
  // key row the kernel reads, the gathered rows' sums in index mode, this rank's share.
  std::vector<float> dk_all, dv_all, dkx, dvx, dk_loc, dv_loc;
  // The overlapped backward's (by KV-head groups or groups of documents): every peer's dK/dV
  // blocks of this rank's rows, [group][rank][local_tokens, group's row] (the own rank's slot
  // unused; also the padding-free split's non-overlapped reduce-scatter's), and one group's lse,
  // [local_tokens, Hq / groups].
  std::vector<float> rs_k, rs_v, lse_group;
  // The ring's buffers: the visiting [K | V] blocks (storage dtype, double buffered) and the
  // partial dK/dV (fp32) going home and coming back; the running result (fp32 out and lse, the
  // kernel's accumulate mode), dQ (fp32, accumulated by the kernel) and this rank's dK/dV sums.
  HomeRingBuffers ring;
  std::vector<float> acc_out, acc_lse, dq_acc, dkv_home;

  PassQBuffers passq;  // the pass-Q scheme's
  // The K/V of the contexts that runs-mode backwards on the message path consumed, which the
  // next forwards' contexts on it take, last in first out (every row of theirs is received or packed,
  // so none is zeroed first). One entry per backward, one taken per forward: never more entries than
  // contexts were alive at once (a model's layers share a CpAttention: one per layer).
  struct SpareKv {
    std::vector<std::byte> k, v;
  };
  std::vector<SpareKv> spare_kv;
  // CpAttnConfig::shared_memory's buffers (docs/cp.md "Shared memory"), made by the first call
  // that needs each and remade larger when a plan needs more. kv_pool: the gathered K/V of
  // the contexts alive, one entry each (a context holding one shares its ownership: free when
  // use_count() == 1 on every rank; a model's layers share this layer, so there are as many
  // entries as contexts were alive at once, at most kKvPool); dkv_shared every rank's slot of
  // grad_slot_bytes, where its backward kernel leaves its fp32 partial sums of dK/dV
  // (KvGradShare, in the kernel's layout). shm_off: a creation failed on some rank (ranks on
  // several hosts), and every rank keeps to messages.
  static constexpr std::size_t kKvPool = 256, kFlagsPerField = 63;
  std::vector<std::shared_ptr<NodeBuffer>> kv_pool;
  std::unique_ptr<NodeBuffer> dkv_shared;
  // The K/V packed for the kernels once per node (KvPackShare: each rank packs its share of
  // the units), read by every rank's call; rewritten by every shared call.
  std::unique_ptr<NodeBuffer> pack_shared;
  // Whether this call's shared forward or backward packs the kernels' K/V with its peers
  // (a layout other than alone, once shared memory has been made on this host), and how
  // (attention_kv_pack_layout): agreed.
  bool share_pack = false;
  KvPackLayout pack_layout = KvPackLayout::alone;
  bool shm_off = false;
  std::vector<float> sum_rows;  // a few rows' dK or dV sums on their way out
  std::vector<float> share_rows;  // the shared backward: those rows' dK and dV from each rank's partial sums
  std::vector<int64_t> share_src;  // the shared backward: the key row (work-list order) of each local row
  // The shared backward's slot per rank in dkv_shared: the largest attention_grad_share_bytes
  // over the ranks (agreed), rounded up to 64 bytes.
  std::size_t grad_slot_bytes = 0;
  // CpStats::comm_total_s - comm_s: the overlapped transfers' time in flight beyond the waits,
  // accumulated (a sum of its own, so that without overlap comm_total_s is comm_s exactly;
  // reset with the stats).
  double hidden_s = 0;

  std::vector<float> slopes;  // the configuration's ALiBi slopes, owned (cfg points here)
  std::unique_ptr<detail::A2aLevel> a2a;  // the a2a and hybrid schemes (after slopes: points there)

  State(Communicator& c, const CpAttnConfig& config)
      : comm(c), cfg(config), cache(config.plan_cache_capacity) {
    if (cfg.options.alibi_slopes != nullptr) {
      slopes.assign(cfg.options.alibi_slopes, cfg.options.alibi_slopes + cfg.num_heads_q);
      cfg.options.alibi_slopes = slopes.data();
    }
    if (cfg.scheme == CpScheme::a2a || cfg.scheme == CpScheme::hybrid)
      a2a = std::make_unique<detail::A2aLevel>(c, cfg, detail::a2a_group_size(cfg, c.size()));
  }

  bool uses_a2a() const { return a2a != nullptr; }
  // After a timeout (throw mode) in the a2a or hybrid level's inner or outer group, that group's
  // communicator is poisoned while this layer's own still works: a later call fails here, on
  // this rank, and at its agreement on every rank, before any group is used.
  void check_groups(const char* fn) const {
    CPATTN_CHECK(!a2a || !a2a->poisoned(), fn, ": the ", to_string(cfg.scheme), " scheme's inner or outer group "
                 "timed out in an earlier call (its communicator is poisoned): make a new CpAttention");
  }
  // Whether this layer's calls may use the node's shared memory (the same on every rank:
  // configuration, communicator size and shm_off are agreed).
  bool shm_enabled() const {
    return cfg.shared_memory && cfg.scheme == CpScheme::allgather && !indexed() && comm.size() > 1 && !shm_off;
  }
  static bool held(const std::shared_ptr<NodeBuffer>& b) { return b && b.use_count() > 1; }
  // FNV-1a over the shared buffers' sizes (0 for none): the same on every rank.
  uint64_t shared_sizes_hash() const {
    uint64_t h = 1469598103934665603ull;
    const auto mix = [&](std::size_t v) { h = (h ^ v) * 1099511628211ull; };
    for (const auto& b : kv_pool) mix(b ? b->size() : 0);
    mix(dkv_shared ? dkv_shared->size() : 0);
    mix(pack_shared ? pack_shared->size() : 0);
    return h;
  }
  // Bytes of the shared buffers for a plan: one context's gathered K/V, every rank's partials.
  std::size_t kv_shared_bytes(const RankPlan& p) const {
    return static_cast<std::size_t>(p.layout.rank_begin.back() * (k_row() + v_row())) * dtype_size(cfg.dtype);
  }
  std::size_t pack_shared_bytes(const RankPlan& p) const {
    return attention_kv_pack_bytes(p.layout.rank_begin.back(), cfg.num_heads_k, cfg.head_dim_qk, cfg.head_dim_v,
                                   pack_layout);
  }
  // A shared call's kernel inputs with the K/V packed once per node: this rank packs its share,
  // then a barrier (its wait counted in comm_s and `part`; returned in `waited` so that the
  // caller can take it out of the call's compute time).
  struct PackShare {
    PackShare() = default;
    PackShare(const PackShare&) = delete;  // share.sync refers to this object
    PackShare& operator=(const PackShare&) = delete;
    KvPackShare share;
    double waited = 0;
  };
  // When this call shares its packing (share_pack): `in` packs through `ps`, counted.
  void attach_pack_share(PackShare& ps, AttnInputs& in, double& part) {
    if (!share_pack) return;
    in.kv_pack_share = &ps.share;
    ++stats.shared_packs;
    ps.share = {.buffer = pack_shared->data(),
                .bytes = pack_shared->size(),
                .part = comm.rank(),
                .parts = comm.size(),
                .sync = [this, &ps, &part] {
                  const double c0 = stats.comm_s;
                  shared_barrier(part);
                  ps.waited += stats.comm_s - c0;
                }};
  }
  std::size_t dkv_shared_bytes() const { return static_cast<std::size_t>(comm.size()) * grad_slot_bytes; }
  // Whether a backward of context c takes shared_backward (when its buffers can be made): the
  // one place that says so, for its agreement (the slot size) and for the call itself.
  bool takes_shared_backward(const CpContext::State& c) const {
    return cfg.scheme == CpScheme::allgather && !uses_a2a() && c.groups == 1 && shm_enabled();
  }
  // Makes `buf` hold at least `bytes` (remade at that size when it is smaller: the largest plan
  // so far sets it, which cp_memory_estimate counts: whole for the K/V pool's entries, this
  // rank's share for the others). Collective: every rank calls it at
  // the same point with the same arguments (agreed ones). false (and shm_off from then on)
  // when not every rank could map the host's shared memory.
  template <class Ptr>
  bool ensure_shared(Ptr& buf, std::size_t bytes) {
    if (buf && buf->size() >= bytes) return true;
    buf.reset();
    std::string why;
    buf = NodeBuffer::create(comm, bytes, &why);
    shm_off = buf == nullptr;
    if (shm_off) {  // messages from now on: nothing shared is used again
      stats.shared_memory_off = why.empty() ? "the shared buffer could not be made" : why;
      kv_pool.clear();
      dkv_shared.reset();
      pack_shared.reset();
    }
    return !shm_off;
  }
  // The K/V pool entry a forward takes: the first free on every rank (`free_everywhere`, the
  // agreement's minima, one per entry), else a new one; grown or made here (collective, on
  // agreed facts only). Null: the message path (shared memory off or unusable, or the pool full).
  std::shared_ptr<NodeBuffer> take_kv_shared(const RankPlan& plan, const std::vector<char>& free_everywhere) {
    if (!shm_enabled()) return nullptr;
    std::size_t i = 0;
    while (i < kv_pool.size() && !free_everywhere[i]) ++i;
    if (i == kv_pool.size()) {
      if (kv_pool.size() == kKvPool) return nullptr;
      kv_pool.emplace_back();
    }
    if (!ensure_shared(kv_pool[i], kv_shared_bytes(plan))) return nullptr;
    if (share_pack && !ensure_shared(pack_shared, pack_shared_bytes(plan))) return nullptr;
    return kv_pool[i];
  }
  // This rank's writes, then every peer's: a barrier between two fences, its time counted as
  // exposed communication and in `part`.
  void shared_barrier(double& part) {
    const auto t0 = Clock::now();
    std::atomic_thread_fence(std::memory_order_seq_cst);  // this rank's rows, before the barrier
    comm.barrier();
    std::atomic_thread_fence(std::memory_order_seq_cst);  // the peers' rows, after it
    stats.comm_s += seconds_since(t0);
    part += seconds_since(t0);
  }
  // A consumed context's K/V storage, or empty vectors: what a next forward fills.
  SpareKv take_spare_kv() {
    if (spare_kv.empty()) return {};
    SpareKv e = std::move(spare_kv.back());
    spare_kv.pop_back();
    return e;
  }
  // Keeps a consumed context's K/V storage for a next forward (counted as a buffer from here;
  // reserve first: a bad_alloc leaves the context whole).
  void recycle_kv(CpContext::State& c) {
    if (c.k.capacity() == 0 && c.v.capacity() == 0) return;
    spare_kv.reserve(spare_kv.size() + 1);
    spare_kv.push_back({std::move(c.k), std::move(c.v)});
  }
  int64_t bytes_sent() const { return comm.bytes_sent() + (a2a ? a2a->bytes_sent() : 0); }
  int64_t bytes_received() const { return comm.bytes_received() + (a2a ? a2a->bytes_received() : 0); }

  // The shapes of this rank's tensors for a plan of t local tokens.
  Expected q_like(int64_t t) const { return {t, cfg.num_heads_q, "num_heads_q", cfg.head_dim_qk, "head_dim_qk", cfg.dtype}; }
  Expected o_like(int64_t t) const { return {t, cfg.num_heads_q, "num_heads_q", cfg.head_dim_v, "head_dim_v", cfg.dtype}; }
  Expected k_like(int64_t t) const { return {t, cfg.num_heads_k, "num_heads_k", cfg.head_dim_qk, "head_dim_qk", cfg.dtype}; }
  Expected v_like(int64_t t) const { return {t, cfg.num_heads_k, "num_heads_k", cfg.head_dim_v, "head_dim_v", cfg.dtype}; }
  int64_t k_row() const { return int64_t{cfg.num_heads_k} * cfg.head_dim_qk; }
  int64_t v_row() const { return int64_t{cfg.num_heads_k} * cfg.head_dim_v; }
  bool indexed() const { return cfg.kv_mode == KvMode::index; }

  std::shared_ptr<const PreparedWork> prepare(const std::shared_ptr<const RankPlan>& plan) {
    const RankPlan* outer = a2a ? &a2a->prepare(plan) : nullptr;  // (its own key: kept across backwards)
    if (prepared && prepared->plan == plan) return prepared;
    if (!nested) check_memory_for(*plan, outer);
    auto w = std::make_shared<PreparedWork>();
    w->plan = plan;
    if (a2a) {  // the all-to-all level and its outer layer hold the work
      prepared = std::move(w);
      return prepared;
    }
    const WorkList keys = without_padding(*plan, keys_for_mask(*plan, cfg.options.mask));
    if (cfg.scheme == CpScheme::ring) {
      w->steps = ring_steps(*plan, keys, cfg.options);
      w->returns = ring_returns(*plan, cfg.options);
    } else if (cfg.scheme == CpScheme::pass_q)
      w->passq = pass_q_work(*plan, cfg.options);
    else if (indexed())
      copy_form(keys, w->copy_index, w->work);
    else {
      // Each task's keys as one run of the document-ordered K/V: read in place from the
      // rank-major buffer, they are up to 2 cp runs cut at chunk boundaries that fall inside
      // the kernel's key blocks, and the kernel runs the partial blocks at both ends of every
      // run (issue 15: a median 11% more kernel time per rank at cp = 2 in fp32, 2.5% in
      // bf16; docs/benchmarks.md).
      const std::vector<RowMove> moves = document_order_moves(*plan);
      w->work = moves.empty() ? keys : in_document_order(*plan, keys);
      const int64_t t_all = plan->layout.rank_begin.back();
      if (!moves.empty()) {
        w->key_rows.resize(static_cast<std::size_t>(t_all));
        for (const RowMove& m : moves)
          for (int64_t i = 0; i < m.len; ++i) w->key_rows[static_cast<std::size_t>(m.ordered + i)] = m.gathered + i;
      }
      if (cfg.overlap && comm.size() > 1) {
        w->fwd_cut = overlap_doc_cut(*plan, cfg.options, true);
        w->bwd_cut = overlap_doc_cut(*plan, cfg.options, false);
        w->fwd_parts = doc_parts(*plan, w->work, w->fwd_cut);
        w->bwd_parts = doc_parts(*plan, w->work, w->bwd_cut);
        for (const AttnTask& t : w->work.tasks) w->longest_task = std::max(w->longest_task, t.q_len);
        std::vector<char> named(static_cast<std::size_t>(t_all), 0);  // gathered rows
        for (const auto& [a, b] : named_key_rows(w->work))
          for (int64_t row = a; row < b; ++row)
            named[static_cast<std::size_t>(w->key_rows.empty() ? row : w->key_rows[static_cast<std::size_t>(row)])] = 1;
        for (int64_t r = 0; r < t_all;) {
          if (named[static_cast<std::size_t>(r)]) {
            ++r;
            continue;
          }
          const int64_t r0 = r;
          while (r < t_all && !named[static_cast<std::size_t>(r)]) ++r;
          w->unnamed.emplace_back(r0, r);
        }
      }
    }
    prepared = std::move(w);
    return prepared;
  }

  // The kernels' inputs for a context: local q over the keys the context holds.
  AttnInputs inputs(ConstTensorView q, const CpContext::State& c) const {
    AttnOptions o = cfg.options;
    o.seed = c.seed;
    return {.q = q,
            .k = contiguous(c.k_data(), c.total_k, cfg.num_heads_k, cfg.head_dim_qk, cfg.dtype),
            .v = contiguous(c.v_data(), c.total_k, cfg.num_heads_k, cfg.head_dim_v, cfg.dtype),
            .work = &c.work->work,
            .options = o,
            .key_rows = key_rows(c)};
  }
  // The row map of a context's K/V (PreparedWork::key_rows), null when they are in key order.
  static const int64_t* key_rows(const CpContext::State& c) {
    return c.work->key_rows.empty() ? nullptr : c.work->key_rows.data();
  }

  // The kernels' inputs for KV-head group g of `groups` of a grouped context (or of a context
  // of one group, whose K/V may be in the node's shared buffer: a backward that could not make
  // its shared dK/dV buffer runs by groups of documents over them): query heads
  // [g hq, (g+1) hq) of q (a strided view) over the group's kv heads, the ALiBi slopes and the
  // dropout heads of those query heads (so that each head computes what one call computes);
  // `work`: the tasks of a group of documents (default: all of the context's).
  AttnInputs group_inputs(ConstTensorView q, const CpContext::State& c, int g, const WorkList* work = nullptr) const {
    const int groups = c.groups, hq = cfg.num_heads_q / groups, hk = cfg.num_heads_k / groups;
    const std::size_t es = dtype_size(cfg.dtype);
    AttnOptions o = cfg.options;
    o.seed = c.seed;
    if (o.alibi_slopes) o.alibi_slopes += g * hq;
    o.dropout_head_offset += g * hq;
    const auto kg = static_cast<std::size_t>(c.total_k * hk * cfg.head_dim_qk) * es;
    const auto vg = static_cast<std::size_t>(c.total_k * hk * cfg.head_dim_v) * es;
    return {.q = head_slice(q, g * hq, hq),
            .k = contiguous(c.k_data() + g * kg, c.total_k, hk, cfg.head_dim_qk, cfg.dtype),
            .v = contiguous(c.v_data() + g * vg, c.total_k, hk, cfg.head_dim_v, cfg.dtype),
            .work = work ? work : &c.work->work,
            .options = o,
            .key_rows = key_rows(c)};
  }

  // One transfer and kernel call of the overlapped all-gather: KV-head group g over every
  // document (part null) or over a group of them (PreparedWork::DocPart).
  struct Unit {
    int g = 0;
    const PreparedWork::DocPart* part = nullptr;
    // Rank s's local rows [first, second) that the unit moves.
    std::pair<int64_t, int64_t> rows(const RankPlan& plan, int s) const {
      if (!part) return {0, plan.layout.rank_tokens(s)};
      return {part->lo[static_cast<std::size_t>(s)], part->hi[static_cast<std::size_t>(s)]};
    }
    const WorkList* work() const { return part ? &part->work : nullptr; }
    bool first_of_group(const std::vector<Unit>& all, std::size_t i) const { return i == 0 || all[i - 1].g != g; }
    bool last_of_group(const std::vector<Unit>& all, std::size_t i) const { return i + 1 == all.size() || all[i + 1].g != g; }
  };
  // The forward's units (its first group split by documents) or the backward's (its last).
  static std::vector<Unit> overlap_units(const PreparedWork& w, int groups, bool backward) {
    const std::vector<PreparedWork::DocPart>& parts = backward ? w.bwd_parts : w.fwd_parts;
    std::vector<Unit> units;
    for (const OverlapUnit& u : cpattn::overlap_units(groups, !parts.empty(), backward))
      units.push_back({u.group, u.part < 0 ? nullptr : &parts[static_cast<std::size_t>(u.part)]});
    return units;
  }
  // Whether the all-gather runs overlapped: by KV-head groups, or by groups of documents.
  static bool overlapped(int groups, const PreparedWork& w, bool backward) {
    return groups > 1 || !(backward ? w.bwd_parts : w.fwd_parts).empty();
  }

  // Runs call(in) with in.progress running step() (moving transfers along: InFlight::advance)
  // while the kernel computes; the time of those calls is counted as communication (as waited,
  // in comm_s and in `part`) and is left out of the compute time it returns.
  template <class Step, class Call>
  double compute_advancing(Step&& step, double& waited, double& part, AttnInputs in, Call&& call) {
    double polled = 0;
    const double total = run_with_progress(step, polled, [&](const std::function<void()>* progress) {
      in.progress = progress;
      call(in);
    });
    count_waited(polled, waited, part);
    return total - polled;
  }

  // `s` seconds in communication calls: as waited (the overlap's), as exposed (comm_s) and in
  // `part` (one of CpStats' parts of comm_s).
  void count_waited(double s, double& waited, double& part) {
    waited += s;
    stats.comm_s += s;
    part += s;
  }

  // Waits for f's requests [i0, i1) (calling `between` while they are in flight, if given), the
  // time counted as waited, as exposed (comm_s) and in `part` (one of CpStats' parts of comm_s).
  void wait_counted(InFlight& f, std::size_t i0, std::size_t i1, double& waited, double& part,
                    const std::function<void()>* between = nullptr) {
    const auto t0 = Clock::now();
    f.wait(i0, i1, between);
    count_waited(seconds_since(t0), waited, part);
  }

  // The overlapped all-gather forward (runs mode, cp > 1, `groups` KV-head groups, the first
  // split by documents where the plan has two groups of them; docs/cp.md "Overlap"): every
  // unit's K and V go to every peer, point to point, one unit after the other, into the
  // context's group-major K/V ([groups][gathered rows, group row], rank s's rows at
  // layout.rank_begin[s], as all_gather_rows puts them; this rank's own rows packed there and
  // sent from there); unit u is computed as soon as its blocks are in, reading them in
  // document order through the plan's key_rows (a unit of some documents reads their rows
  // alone: the kernels read no row its tasks do not name), the later units' transfers moved
  // along inside and between the kernel calls. Returns the seconds the payload was in flight
  // beyond the time this rank waited for it (CpStats::comm_total_s).
  double grouped_forward(const CpForwardArgs& a, CpContext::State& ctx, int groups) {
    const RankPlan& plan = *ctx.plan;
    const SplitLayout& layout = plan.layout;
    const int cp = comm.size(), me = comm.rank();
    const std::size_t es = dtype_size(cfg.dtype);
    const int64_t t_loc = plan.local_tokens, t_all = layout.rank_begin.back();
    const int hk = cfg.num_heads_k / groups, hq = cfg.num_heads_q / groups;
    const auto kg = static_cast<std::size_t>(hk * cfg.head_dim_qk) * es;  // bytes of one group's row
    const auto vg = static_cast<std::size_t>(hk * cfg.head_dim_v) * es;
    const auto k_bytes = static_cast<std::size_t>(k_row()) * es, v_bytes = static_cast<std::size_t>(v_row()) * es;
    const auto row_off = [&](int rank) { return static_cast<std::size_t>(layout.rank_begin[rank]); };
    const std::vector<Unit> units = overlap_units(*ctx.work, groups, false);
    const std::size_t nu = units.size();
    auto t0 = Clock::now();
    ctx.groups = groups;
    ctx.total_k = t_all;
    SpareKv e = take_spare_kv();  // a fresh context's are empty; resized to the same size, not zeroed
    ctx.k = std::move(e.k);
    ctx.v = std::move(e.v);
    ctx.k.resize(groups * t_all * kg);  // every row is received or packed
    ctx.v.resize(groups * t_all * vg);
    ctx.lse.assign(static_cast<std::size_t>(t_loc) * cfg.num_heads_q, -std::numeric_limits<float>::infinity());
    zero_padding_rows(a.out, plan);
    stats.compute_s += seconds_since(t0);

    const auto* k_in = static_cast<const std::byte*>(a.k.data);
    const auto* v_in = static_cast<const std::byte*>(a.v.data);
    std::byte* const all_k = ctx.k.data();
    std::byte* const all_v = ctx.v.data();
    InFlight f{.comm = comm, .reqs = {}};
    f.reqs.reserve(4 * static_cast<std::size_t>(cp - 1) * nu);  // K and V of every unit, to and from every peer
    // recv_end[u]: the requests before it are units 0..u's receives (every receive is posted
    // before any send: the peers' blocks have somewhere to land as soon as they are sent). A
    // rank with no rows in a unit makes empty sends and receives (every rank makes the same
    // calls; a call of no elements moves no message).
    std::vector<std::size_t> recv_end(nu);
    double waited = 0;
    try {
      t0 = Clock::now();
      for (std::size_t u = 0; u < nu; ++u) {
        const int g = units[u].g;
        for (int st = 1; st < cp; ++st) {
          const int q = (me - st + cp) % cp;
          const auto [lo, hi] = units[u].rows(plan, q);
          const auto at = row_off(q) + static_cast<std::size_t>(lo), n = static_cast<std::size_t>(hi - lo);
          f.reqs.push_back(comm.start_recv<std::byte>({all_k + g * t_all * kg + at * kg, n * kg}, q, kTagGather));
          f.reqs.push_back(comm.start_recv<std::byte>({all_v + g * t_all * vg + at * vg, n * vg}, q, kTagGather));
        }
        recv_end[u] = f.reqs.size();
      }
      count_waited(seconds_since(t0), waited, stats.first_kv_s);
      // Every group packed into its own rows first; then unit by unit sent to each peer (rank
      // + 1, rank + 2, ...; each peer gets K then V of unit 0, 1, ..., the order its receives
      // were posted in). Unit u's sends to a peer are posted once unit u - 1's to that peer
      // have completed, so that unit 0's blocks, which every rank waits for before it computes
      // anything, have the link to themselves (posted together, MPI interleaves the messages'
      // fragments and group 0 arrived with nearly all the others: 28-60 ms against 7-9 at
      // 4 Gbit/s over TCP, docs/benchmarks.md); per peer, so that a slow peer holds back its own
      // next unit alone (cp > 2).
      // The later sends are posted as the earlier ones complete, from the kernels' progress
      // callback and while this rank waits for a unit's blocks, and unit u's at the latest
      // before it waits for unit u's blocks (send_through): no rank waits for a unit it has
      // not sent, so none waits on another that waits on it.
      t0 = Clock::now();
      for (int g = 0; g < groups; ++g) {
        copy_columns(k_in, all_k + g * t_all * kg + row_off(me) * kg, t_loc, k_bytes, g * kg, kg, false);
        copy_columns(v_in, all_v + g * t_all * vg + row_off(me) * vg, t_loc, v_bytes, g * vg, vg, false);
      }
      stats.compute_s += seconds_since(t0);
      // Per step st (peer rank + st): the units whose sends to it are posted, and where the
      // requests of the last of them are (K, then V).
      std::vector<std::size_t> sent(static_cast<std::size_t>(cp), 0), last_sends(sent.size(), 0);
      const auto post_sends = [&](int st) {  // the next unit's to peer rank + st
        const Unit& un = units[sent[st]++];
        const int q = (me + st) % cp;
        const auto [lo, hi] = un.rows(plan, me);
        last_sends[st] = f.reqs.size();
        const auto at = row_off(me) + static_cast<std::size_t>(lo), n = static_cast<std::size_t>(hi - lo);
        f.reqs.push_back(comm.start_send<std::byte>({all_k + un.g * t_all * kg + at * kg, n * kg}, q, kTagGather));
        f.reqs.push_back(comm.start_send<std::byte>({all_v + un.g * t_all * vg + at * vg, n * vg}, q, kTagGather));
      };
      const auto last_done = [&](int st) {
        for (std::size_t i = last_sends[st]; i < last_sends[st] + 2; ++i)
          if (f.reqs[i].active() && !comm.test(f.reqs[i])) return false;
        return true;
      };
      // Posts each peer's next units while the last ones posted to it have completed; each
      // test moves every transfer along. Never waits. Also run while this rank waits for a
      // unit's blocks: a peer that has sent its part holds back none of its later units.
      const std::function<void()> send_more = [&] {
        for (int st = 1; st < cp; ++st)
          while (sent[st] < nu && last_done(st)) {
            f.last_done = Clock::now();
            post_sends(st);
          }
      };
      // Unit u's sends to every peer not yet posted (this rank's unit u leaves before it waits
      // for the peers').
      const auto send_through = [&](std::size_t u) {
        for (int st = 1; st < cp; ++st)
          while (sent[st] <= u) post_sends(st);
      };
      t0 = Clock::now();
      send_through(0);
      count_waited(seconds_since(t0), waited, stats.first_kv_s);
      std::vector<float>& lse_g = lse_group;
      for (std::size_t u = 0; u < nu; ++u) {
        const int g = units[u].g;
        double& part = u == 0 ? stats.first_kv_s : stats.later_kv_s;
        t0 = Clock::now();
        send_through(u);
        count_waited(seconds_since(t0), waited, part);
        // unit u's blocks (and the earlier units', done already)
        wait_counted(f, 0, recv_end[u], waited, part, &send_more);

        t0 = Clock::now();
        if (units[u].first_of_group(units, u))
          lse_g.assign(static_cast<std::size_t>(t_loc) * hq, -std::numeric_limits<float>::infinity());
        stats.compute_s += seconds_since(t0);
        // the later units' transfers move along (and their sends leave) inside the call too
        stats.compute_s += compute_advancing(
            [&] {
              f.advance();
              send_more();
            },
            waited, stats.later_kv_s, group_inputs(a.q, ctx, g, units[u].work()), [&](const AttnInputs& in) {
              attention_forward({.in = in, .out = head_slice(a.out, g * hq, hq), .lse = lse_g.data()});
            });
        t0 = Clock::now();
        if (units[u].last_of_group(units, u))
          for (int64_t i = 0; i < t_loc; ++i)
            std::copy_n(lse_g.data() + i * hq, hq, ctx.lse.data() + i * cfg.num_heads_q + g * hq);
        if (u == 0) note_peak(ctx.bytes());  // the forward's peak: the context being filled
        stats.compute_s += seconds_since(t0);

        t0 = Clock::now();
        f.poll();  // the later units move along before the next kernel call
        send_more();
        count_waited(seconds_since(t0), waited, stats.later_kv_s);
      }
      wait_counted(f, 0, f.reqs.size(), waited, stats.later_kv_s);  // this rank's sends
    } catch (...) {
      // A throw-mode timeout, or any other throw after the posts (a kernel's bad_alloc), leaves
      // requests that may still read or write the context's K/V: dropping them here hands them
      // to the communicator (which poisons itself), and the K/V's storage then stays alive
      // until they complete, moved out of the context (which the throw frees).
      f.reqs.clear();
      comm.keep_if_poisoned(ctx.k, ctx.v);
      throw;
    }
    return std::max(0.0, f.span() - waited);
  }

  // The forward over the host's shared memory (`buf`: a K/V pool entry free on every rank and
  // large enough): this rank writes its K/V rows at their gathered rows, a barrier, and the
  // kernel reads every rank's rows in place. The context holds the entry until its backward.
  void shared_forward(const CpForwardArgs& a, CpContext::State& ctx, std::shared_ptr<NodeBuffer> buf) {
    const RankPlan& plan = *ctx.plan;
    const std::size_t es = dtype_size(cfg.dtype);
    const int64_t t_all = plan.layout.rank_begin.back(), t_loc = plan.local_tokens;
    const auto kb = static_cast<std::size_t>(k_row()) * es, vb = static_cast<std::size_t>(v_row()) * es;
    const auto mine = static_cast<std::size_t>(plan.layout.rank_begin[comm.rank()]);
    auto t0 = Clock::now();
    ctx.shared = std::move(buf);
    ctx.shared_v_offset = static_cast<std::size_t>(t_all) * kb;
    ctx.total_k = t_all;
    std::byte* const base = ctx.shared->data();
    if (t_loc > 0) {  // a padding-free rank may hold no token
      std::memcpy(base + mine * kb, a.k.data, static_cast<std::size_t>(t_loc) * kb);
      std::memcpy(base + ctx.shared_v_offset + mine * vb, a.v.data, static_cast<std::size_t>(t_loc) * vb);
    }
    ctx.lse.assign(static_cast<std::size_t>(t_loc) * cfg.num_heads_q, -std::numeric_limits<float>::infinity());
    zero_padding_rows(a.out, plan);
    stats.compute_s += seconds_since(t0);

    shared_barrier(stats.first_kv_s);

    t0 = Clock::now();
    note_peak(ctx.bytes());
    PackShare ps;
    AttnInputs in = inputs(a.q, ctx);
    attach_pack_share(ps, in, stats.first_kv_s);
    attention_forward({.in = in, .out = a.out, .lse = ctx.lse.data()});
    stats.compute_s += seconds_since(t0) - ps.waited;
    ++stats.shared_forwards;
  }

  // The backward's dK/dV over the node's shared memory (dkv_shared large enough): the kernel
  // leaves this rank's fp32 partial sums (KvGradShare: per KV head and head set, in its own
  // layout) in its own slot, a barrier, and each rank finishes its own rows from every slot
  // (attention_grad_share_rows: what each kernel would have written as fp32 dK/dV) and sums
  // them in reduce_scatter_rows' order (bitwise its sums). The slots are written again only
  // after the next call's agreement, which every peer enters after its sums.
  void shared_backward(const CpBackwardArgs& a, const CpContext::State& cs) {
    const RankPlan& plan = *cs.plan;
    const auto slot = [&](int q) -> std::byte* { return dkv_shared->data() + static_cast<std::size_t>(q) * grad_slot_bytes; };
    auto t0 = Clock::now();
    PackShare ps;
    AttnInputs in = inputs(a.q, cs);
    attach_pack_share(ps, in, stats.dkv_s);
    const KvGradShare gs{.buffer = slot(comm.rank()), .bytes = grad_slot_bytes};
    attention_backward({.in = in,
                        .out = a.out,
                        .lse = cs.lse.data(),
                        .dout = a.dout,
                        .dq = a.dq,
                        .grad_mode = GradMode::write,
                        .grad_share = &gs});
    zero_padding_rows(a.dq, plan);
    stats.compute_s += seconds_since(t0) - ps.waited;

    shared_barrier(stats.dkv_s);

    t0 = Clock::now();
    store_shared_sums(plan, cs, slot, a.dk.data, a.dv.data);
    stats.compute_s += seconds_since(t0);
    ++stats.shared_backwards;
  }

  // store_sums' sums from the ranks' KvGradShare slots: this rank's rows (gathered rows
  // [mine, mine + local_tokens)) are the kernels' key rows share_src[i] (through the context's
  // key_rows, or the rows themselves), read in runs of consecutive key rows, a few at a time.
  template <class Slot>
  void store_shared_sums(const RankPlan& plan, const CpContext::State& cs, const Slot& slot, void* dk, void* dv) {
    const int cp = comm.size(), me = comm.rank();
    const int64_t t_loc = plan.local_tokens, mine = plan.layout.rank_begin[me], kr = k_row(), vr = v_row();
    share_src.resize(static_cast<std::size_t>(t_loc));
    if (const int64_t* map = key_rows(cs)) {
      // The map is the global layout's (PreparedWork: the same on every rank) and a permutation
      // of the gathered rows, so it names the same key row in every rank's slot, and each of
      // this rank's rows once.
      std::fill(share_src.begin(), share_src.end(), int64_t{-1});
      for (int64_t r = 0; r < cs.total_k; ++r)
        if (map[r] >= mine && map[r] < mine + t_loc) share_src[static_cast<std::size_t>(map[r] - mine)] = r;
      if (std::find(share_src.begin(), share_src.end(), int64_t{-1}) != share_src.end())
        throw std::logic_error("CpAttention: the context's key_rows do not reach every local row");
    } else {
      for (int64_t i = 0; i < t_loc; ++i) share_src[static_cast<std::size_t>(i)] = mine + i;
    }
    const int64_t rows = shared_sum_rows(kr, vr, t_loc);
    const int64_t per = rows * (kr + vr);  // one rank's rows: dK, then dV
    const AttnShape shape{.num_heads_k = cfg.num_heads_k, .head_dim_qk = cfg.head_dim_qk, .head_dim_v = cfg.head_dim_v};
    share_rows.resize(static_cast<std::size_t>(cp * per));
    sum_rows.resize(static_cast<std::size_t>(rows * std::max(kr, vr)));
    for (int64_t i0 = 0; i0 < t_loc;) {
      // local rows [i0, i0 + n): key rows [src, src + n), ending where a 16-row group does
      const int64_t src = share_src[static_cast<std::size_t>(i0)];
      int64_t n = 1;
      while (i0 + n < t_loc && n < rows - src % 16 && share_src[static_cast<std::size_t>(i0 + n)] == src + n) ++n;
      for (int q = 0; q < cp; ++q) {
        float* part = share_rows.data() + q * per;
        attention_grad_share_rows(slot(q), grad_slot_bytes, shape, src, n, part, part + rows * kr);
      }
      store_rank_sums(plan, i0, n, [&](int q, bool is_k) { return share_rows.data() + q * per + (is_k ? 0 : rows * kr); },
                      dk, dv);
      i0 += n;
    }
  }

  // Local rows [i0, i0 + n) of dK and dV (dk, dv: [local_tokens, k_row] and [.., v_row]) in the
  // storage dtype: the sums over ranks q of the n rows of q's fp32 partial at rows_of(q, is_k)
  // (dK when is_k, else dV), in reduce_scatter_rows' order (bitwise its sums). sum_rows, the
  // sums on their way to the store, holds n * max(k_row, v_row) floats: the caller sizes it.
  template <class RowsOf>
  void store_rank_sums(const RankPlan& plan, int64_t i0, int64_t n, const RowsOf& rows_of, void* dk, void* dv) {
    const std::size_t es = dtype_size(cfg.dtype);
    for (const bool is_k : {true, false}) {
      const int64_t w = is_k ? k_row() : v_row();
      sum_rank_parts(plan.split, comm.size(), comm.rank(), [&](int q) -> const float* { return rows_of(q, is_k); },
                     static_cast<std::size_t>(n * w), sum_rows.data());
      from_float(sum_rows.data(), static_cast<std::size_t>(n * w), cfg.dtype,
                 static_cast<std::byte*>(is_k ? dk : dv) + static_cast<std::size_t>(i0 * w) * es);
    }
  }

  // This rank's dK and dV in the storage dtype (dk, dv: [local_tokens, k_row] and [.., v_row]):
  // the sums over ranks q of rank q's fp32 partials, part(q, is_k) pointing at q's dK
  // (is_k) or dV of every gathered row, rank-major, in reduce_scatter_rows' order (bitwise its
  // sums). A few rows at a time, so that the sums stay in cache on their way to the store.
  template <class Part>
  void store_sums(const RankPlan& plan, const Part& part, void* dk, void* dv) {
    const int64_t t_loc = plan.local_tokens, mine = plan.layout.rank_begin[comm.rank()], kr = k_row(), vr = v_row();
    // At most the local rows: never more than the dk_loc/dv_loc the memory estimate counts.
    const int64_t rows = std::clamp<int64_t>(8192 / std::max(kr, vr), 1, std::max<int64_t>(t_loc, 1));
    sum_rows.resize(static_cast<std::size_t>(rows * std::max(kr, vr)));
    for (int64_t i0 = 0; i0 < t_loc; i0 += rows) {
      const int64_t n = std::min(rows, t_loc - i0);
      store_rank_sums(plan, i0, n, [&](int q, bool is_k) { return part(q, is_k) + (mine + i0) * (is_k ? kr : vr); }, dk,
                      dv);
    }
  }

  // The overlapped backward: unit u's dK/dV (fp32: a KV-head group's, the last group's per
  // group of documents where the plan has two) are written by the kernel at their rank-major
  // rows (key_rows) and sent to their owners at once, while unit u + 1 is computed; each owner
  // sums its blocks in the order the non-overlapped reduce-scatter does (the padded split: the
  // communicator's ring order ((x[r+1] + x[r+2]) + ...) + x[r]; the padding-free split: ranks
  // 0..cp-1 from 0), so the sums are bitwise those of reduce_scatter_rows. A unit of some
  // documents writes their rows alone (named_rows_only, the whole batch's longest task: the sums
  // of the one call over every document); the rows no task reads are zeroed first.
  // Returns what grouped_forward returns.
  double grouped_backward(const CpBackwardArgs& a, const CpContext::State& cs) {
    const RankPlan& plan = *cs.plan;
    const SplitLayout& layout = plan.layout;
    const int groups = cs.groups, cp = comm.size(), me = comm.rank();
    const int64_t t_loc = plan.local_tokens, t_all = layout.rank_begin.back();
    const int hk = cfg.num_heads_k / groups, hq = cfg.num_heads_q / groups;
    const int64_t kg = int64_t{hk} * cfg.head_dim_qk, vg = int64_t{hk} * cfg.head_dim_v;  // floats per group row
    const std::vector<Unit> units = overlap_units(*cs.work, groups, true);
    auto t0 = Clock::now();
    dk_all.resize(static_cast<std::size_t>(groups * t_all * kg));  // [groups][t_all, kg], rank-major
    dv_all.resize(static_cast<std::size_t>(groups * t_all * vg));
    rs_k.resize(static_cast<std::size_t>(groups * cp * t_loc * kg));  // [groups][cp][t_loc, kg]
    rs_v.resize(static_cast<std::size_t>(groups * cp * t_loc * vg));
    for (const Unit& un : units)
      if (un.part && un.part == &cs.work->bwd_parts.front())  // (its group's calls write the named rows alone)
        for (const auto& [r0, r1] : cs.work->unnamed) {
          std::fill(dk_all.begin() + (un.g * t_all + r0) * kg, dk_all.begin() + (un.g * t_all + r1) * kg, 0.0f);
          std::fill(dv_all.begin() + (un.g * t_all + r0) * vg, dv_all.begin() + (un.g * t_all + r1) * vg, 0.0f);
        }
    stats.compute_s += seconds_since(t0);
    InFlight f{.comm = comm, .reqs = {}};
    std::vector<std::pair<std::size_t, std::size_t>> recvs(units.size());  // each unit's receives' requests
    double waited = 0;
    for (std::size_t u = 0; u < units.size(); ++u) {
      const Unit& un = units[u];
      const int g = un.g;
      t0 = Clock::now();
      float* dk_g = dk_all.data() + g * t_all * kg;
      float* dv_g = dv_all.data() + g * t_all * vg;
      if (un.first_of_group(units, u)) {
        lse_group.resize(static_cast<std::size_t>(t_loc) * hq);
        for (int64_t i = 0; i < t_loc; ++i)
          std::copy_n(cs.lse.data() + i * cfg.num_heads_q + g * hq, hq, lse_group.data() + i * hq);
      }
      stats.compute_s += seconds_since(t0);
      // the earlier units' dK/dV move along inside the call
      stats.compute_s += compute_advancing([&] { f.advance(); }, waited, stats.dkv_s, group_inputs(a.q, cs, g, un.work()),
                                           [&](const AttnInputs& in) {
        attention_backward({.in = in,
                            .out = head_slice(a.out, g * hq, hq),
                            .lse = lse_group.data(),
                            .dout = head_slice(a.dout, g * hq, hq),
                            .dq = head_slice(a.dq, g * hq, hq),
                            .dk = contiguous(dk_g, t_all, hk, cfg.head_dim_qk),  // in fp32
                            .dv = contiguous(dv_g, t_all, hk, cfg.head_dim_v),
                            .grad_mode = GradMode::write,
                            .named_rows_only = un.part != nullptr,
                            .longest_task = un.part ? cs.work->longest_task : 0});
      });

      t0 = Clock::now();
      recvs[u].first = f.reqs.size();
      const auto [lo, hi] = un.rows(plan, me);
      for (int st = 1; st < cp; ++st) {  // receives first, then sends rank + 1, rank + 2, ... (empty ones too)
        const int q = (me - st + cp) % cp;
        const auto n = static_cast<std::size_t>(hi - lo);
        f.reqs.push_back(comm.start_recv<float>({rs_k.data() + ((g * cp + q) * t_loc + lo) * kg, n * kg}, q, kTagScatter));
        f.reqs.push_back(comm.start_recv<float>({rs_v.data() + ((g * cp + q) * t_loc + lo) * vg, n * vg}, q, kTagScatter));
      }
      recvs[u].second = f.reqs.size();
      for (int st = 1; st < cp; ++st) {
        const int q = (me + st) % cp;
        const auto [qlo, qhi] = un.rows(plan, q);
        const auto n = static_cast<std::size_t>(qhi - qlo);
        f.reqs.push_back(comm.start_send<float>({dk_g + (layout.rank_begin[q] + qlo) * kg, n * kg}, q, kTagScatter));
        f.reqs.push_back(comm.start_send<float>({dv_g + (layout.rank_begin[q] + qlo) * vg, n * vg}, q, kTagScatter));
      }
      if (u == 0) f.posted = f.last_done = t0;
      f.poll();
      count_waited(seconds_since(t0), waited, stats.dkv_s);
    }
    t0 = Clock::now();
    zero_padding_rows(a.dq, plan);
    stats.compute_s += seconds_since(t0);

    const std::size_t es = dtype_size(cfg.dtype);
    // Rows [r0, r1) of this rank's block of group g, summed over the ranks into loc's rows.
    const auto sum_block = [&](const std::vector<float>& all, const std::vector<float>& rs, int64_t w, int g,
                              int64_t r0, int64_t r1, std::vector<float>& loc) {
      loc.resize(static_cast<std::size_t>(t_loc * w));
      const float* own = all.data() + (g * t_all + layout.rank_begin[me] + r0) * w;
      const auto part = [&](int q) { return q == me ? own : rs.data() + ((g * cp + q) * t_loc + r0) * w; };
      sum_rank_parts(plan.split, cp, me, part, static_cast<std::size_t>((r1 - r0) * w), loc.data() + r0 * w);
    };
    // Unit by unit as its blocks come in: the earlier units' sums run while the last unit's
    // dK/dV are still in flight or a slower peer still computes them.
    for (std::size_t u = 0; u < units.size(); ++u) {
      wait_counted(f, recvs[u].first, recvs[u].second, waited, stats.dkv_s);
      t0 = Clock::now();
      const int g = units[u].g;
      const auto [lo, hi] = units[u].rows(plan, me);
      sum_block(dk_all, rs_k, kg, g, lo, hi, dk_loc);
      sum_block(dv_all, rs_v, vg, g, lo, hi, dv_loc);
      for (int64_t i = lo; i < hi; ++i) {
        from_float(dk_loc.data() + i * kg, static_cast<std::size_t>(kg), cfg.dtype,
                   static_cast<std::byte*>(a.dk.data) + static_cast<std::size_t>(i * k_row() + g * kg) * es);
        from_float(dv_loc.data() + i * vg, static_cast<std::size_t>(vg), cfg.dtype,
                   static_cast<std::byte*>(a.dv.data) + static_cast<std::size_t>(i * v_row() + g * vg) * es);
      }
      stats.compute_s += seconds_since(t0);
    }
    wait_counted(f, 0, f.reqs.size(), waited, stats.dkv_s);  // this rank's sends
    return std::max(0.0, f.span() - waited);
  }

  // Every rank learns every rank's local error, and all throw the same message; else the
  // ranks agree on the fingerprint. One all-gather, before any payload moves. A rank with an
  // error still takes part, so that the others fail with its message instead of waiting.
  // Returns, per K/V pool entry, whether it is free on every rank (1) or not (0).
  // grad_share_need: a shared backward's attention_grad_share_bytes on this rank (0 otherwise);
  // their maximum over the ranks sets grad_slot_bytes.
  std::vector<char> agree_or_throw(const std::string& local_error, const PreparedWork* work, int64_t local_tokens,
                      int64_t phase, int64_t context_forward_call, uint64_t seed, int64_t grad_share_need = 0) {
    const auto t0 = Clock::now();
    const int64_t calls_before = comm.calls();
    const AttnOptions& o = cfg.options;
    pack_layout = attention_kv_pack_layout(o.path, cfg.dtype);
    share_pack = shm_enabled() && !kv_pool.empty() && pack_layout != KvPackLayout::alone;
    const RankPlan* plan = work ? work->plan.get() : nullptr;
    // A rank with a local error may have no plan: it sends an empty fingerprint, and the
    // agreement reports the errors before it compares fingerprints.
    Fingerprint fp;
    if (local_error.empty())
      fp.add("phase (1 forward, 2 backward)", phase)
        .add("forward calls", stats.forward_calls)
        .add("backward calls", stats.backward_calls)
        // Which forward's context a backward consumes (0 in a forward): catches ranks that
        // run the layers' backwards in different orders.
        .add("context of forward call", context_forward_call)
        // Collectives this communicator ran before: catches ranks that run different layers
        // (each with its own CpAttention) over the same communicator.
        .add("communicator calls", calls_before)
        .add("cp", comm.size())
        .add("num_heads_q", cfg.num_heads_q)
        .add("num_heads_k", cfg.num_heads_k)
        .add("head_dim_qk", cfg.head_dim_qk)
        .add("head_dim_v", cfg.head_dim_v)
        .add("dtype", static_cast<int64_t>(cfg.dtype))
        .add("mask", static_cast<int64_t>(o.mask))
        .add("kv_mode", static_cast<int64_t>(cfg.kv_mode))
        .add("scheme (CpScheme: 0 allgather, 1 ring, 2 pass-q, 3 a2a, 4 hybrid)", static_cast<int64_t>(cfg.scheme))
        .add("cp_inner", cfg.cp_inner)
        .add("hybrid_outer", static_cast<int64_t>(cfg.hybrid_outer))
        .add("split (0 padded, 1 padding-free)", static_cast<int64_t>(cfg.split))
        .add("overlap", cfg.overlap)
        .add("shared_memory", cfg.shared_memory)
        .add("shared memory found unusable", shm_off)
        // Only once shared memory was made (one host, so one CPU): ranks on several hosts may
        // run different kernel paths; ranks of one host must agree to pack K/V together.
        .add("packs K/V with its peers in layout (KvPackLayout: 0 alone, 1 fp32, 2 bf16_tiles; shared memory in use)",
             share_pack ? static_cast<int64_t>(pack_layout) : 0)
        .add("softmax_scale set", o.softmax_scale.has_value())
        .add("softmax_scale (bits)", std::bit_cast<int32_t>(o.softmax_scale.value_or(0.0f)))
        .add("dropout_p (bits)", std::bit_cast<int32_t>(o.dropout_p))
        .add("dropout_head_offset", o.dropout_head_offset)
        .add("window_size_left", o.window_size_left)
        .add("window_size_right", o.window_size_right)
        .add("softcap (bits)", std::bit_cast<int32_t>(o.softcap))
        .add("alibi slopes hash", static_cast<int64_t>(hash_slopes(o.alibi_slopes, cfg.num_heads_q)))
        .add("seed", static_cast<int64_t>(seed))
        .add("deterministic", cfg.deterministic)
        // Padded: every rank has the same local count. Padding-free: the counts differ, and
        // the ranks agree on all of them (the gathered buffer's layout). One name for both, so
        // that ranks of two splits are told apart by the split's value, not by the names' hash.
        .add("split", static_cast<int64_t>(plan->split))
        .add("local tokens (padding-free: every rank's, hashed)",
             plan->split == CpSplit::padded ? local_tokens
                                            : static_cast<int64_t>(hash_boundaries(plan->layout.rank_begin)))
        .add("documents", static_cast<int64_t>(plan->docs.size()))
        .add("global tokens", plan->global_tokens)
        .add("cu_seqlens hash", static_cast<int64_t>(hash_boundaries(plan->cu_seqlens)))
        // (from the boundaries in floating point: ranks of different builds could differ, and
        // would then move different rows)
        .add("overlap document cuts (forward << 32 | backward)", work->fwd_cut << 32 | work->bwd_cut)
        .add("shared K/V buffers", static_cast<int64_t>(kv_pool.size()))
        // Made and remade only on agreed facts; a rank whose creation threw after its
        // collectives would differ here (an error, not a wait in a collective the others skip).
        .add("shared buffers' sizes (hash)", static_cast<int64_t>(shared_sizes_hash()));
    // May differ: a context another rank has dropped already (the AND decides). 63 entries'
    // flags per field: the pool's 256 take 5, within the agreement's one all-gather.
    if (local_error.empty())
      for (std::size_t i0 = 0; i0 < kv_pool.size(); i0 += kFlagsPerField) {
        int64_t flags = 0;
        for (std::size_t i = i0; i < std::min(kv_pool.size(), i0 + kFlagsPerField); ++i)
          if (!held(kv_pool[i])) flags |= int64_t{1} << (i - i0);
        fp.add_and("shared K/V buffers " + std::to_string(i0) + ".. free", flags);
      }
    // (negated: the minimum is minus the largest)
    const std::size_t grad_field = fp.reduced.size();
    if (local_error.empty()) fp.add_min("grad share bytes, negated", -grad_share_need);
    std::vector<int64_t> minima;
    try {
      minima = agree(comm, fp, kCpAgreement, local_error);  // one all-gather when all agree
    } catch (...) {
      stats.comm_s += seconds_since(t0);
      stats.agree_s += seconds_since(t0);
      throw;
    }
    stats.comm_s += seconds_since(t0);
    stats.agree_s += seconds_since(t0);
    std::vector<char> free_everywhere(kv_pool.size());
    for (std::size_t i = 0; i < kv_pool.size(); ++i)
      free_everywhere[i] = static_cast<char>((minima[i / kFlagsPerField] >> (i % kFlagsPerField)) & 1);
    if (phase == 2) grad_slot_bytes = (static_cast<std::size_t>(-minima[grad_field]) + 63) / 64 * 64;
    return free_everywhere;
  }

  // A new plan's forward + backward must fit in what the machine has, beside the buffers this
  // layer already holds (reused) and the contexts alive (already allocated).
  // `outer`: the a2a level's outer plan, whose work the estimate counts.
  void check_memory_for(const RankPlan& plan, const RankPlan* outer) const {
    const CpMemoryEstimate e = outer ? cp_detail::a2a_memory_estimate(cfg, plan, *outer) : cp_memory_estimate(cfg, plan);
    const uint64_t held = buffer_bytes(true);
    const uint64_t needed = e.total() > held ? e.total() - held : 0;
    check_memory(needed, "CpAttention: a forward and backward of " + std::to_string(plan.local_tokens) +
                 " local tokens", e.describe() + (held > 0 ? ", less the " + format_bytes(held) + " of buffers held" : ""));
  }

  // `reusable`: only what a next call can reuse (not the K/V buffers live contexts hold).
  std::size_t buffer_bytes(bool reusable = false) const {
    std::size_t bytes = 0;
    for (const std::vector<float>* f : {&dk_all, &dv_all, &dkx, &dvx, &dk_loc, &dv_loc, &rs_k, &rs_v, &lse_group,
                                        &acc_out, &acc_lse, &dq_acc, &dkv_home, &sum_rows, &share_rows})
      bytes += f->capacity() * sizeof(float);
    bytes += share_src.capacity() * sizeof(int64_t);
    bytes += ring.bytes() + passq.bytes();
    for (const SpareKv& e : spare_kv) bytes += e.k.capacity() + e.v.capacity();
    if (a2a) bytes += a2a->buffer_bytes();
    for (const auto& b : kv_pool)
      if (b && !(reusable && held(b))) bytes += b->size();  // every rank's K/V rows, read by this rank
    if (dkv_shared) bytes += dkv_shared->size() / static_cast<std::size_t>(comm.size());  // its own slot
    // Its own share (the kernels' packed K/V, which a kernel call without it allocates as
    // scratch, attention_backward_scratch_bytes, once per rank)
    if (pack_shared) bytes += pack_shared->size() / static_cast<std::size_t>(comm.size());
    return bytes;
  }

  // `transient`: what the call holds beyond the layer's buffers and the contexts already
  // counted (a forward's context being filled; the non-overlapped paths' gathered K/V).
  void note_peak(std::size_t transient = 0) {
    stats.peak_buffer_bytes = std::max(stats.peak_buffer_bytes, *live_bytes + buffer_bytes() + transient);
  }

  // The kernels' inputs for one ring step: the caller's q (storage dtype, as it is) over the
  // visiting block [K | V] (storage dtype, as it arrived: the kernel converts while it packs).
  // (e.progress: the step's progress callback, as pass-Q's step_inputs passes it.)
  AttnInputs ring_inputs(const SchemeEnv& e, ConstTensorView q, const std::byte* block, const WorkList& w,
                         uint64_t seed) const {
    AttnOptions o = cfg.options;
    o.seed = seed;
    const int64_t t = q.rows;
    return {.q = q,
            .k = contiguous(block, t, cfg.num_heads_k, cfg.head_dim_qk, cfg.dtype),
            .v = contiguous(block + static_cast<std::size_t>(t * k_row()) * dtype_size(cfg.dtype), t, cfg.num_heads_k,
                            cfg.head_dim_v, cfg.dtype),
            .work = &w,
            .options = o,
            .progress = e.progress};
  }

  void ring_wait(CommRequest& r) { env().wait(r); }
  SchemeEnv env() { return {.comm = comm, .cfg = cfg, .stats = stats}; }

  // The ring's and pass-Q's context keeps a copy of the local K/V for backward.
  void keep_local_kv(const CpForwardArgs& a, CpContext::State& ctx) const {
    const std::size_t es = dtype_size(cfg.dtype);
    const auto k_bytes = static_cast<std::size_t>(ctx.plan->local_tokens * k_row()) * es;
    const auto v_bytes = static_cast<std::size_t>(ctx.plan->local_tokens * v_row()) * es;
    ctx.k.assign(static_cast<const std::byte*>(a.k.data), static_cast<const std::byte*>(a.k.data) + k_bytes);
    ctx.v.assign(static_cast<const std::byte*>(a.v.data), static_cast<const std::byte*>(a.v.data) + v_bytes);
    ctx.total_k = ctx.plan->local_tokens;
  }

  void pass_q_forward(const CpForwardArgs& a, CpContext::State& ctx) {
    const auto t0 = Clock::now();
    keep_local_kv(a, ctx);
    ctx.lse.resize(static_cast<std::size_t>(ctx.plan->local_tokens) * cfg.num_heads_q);
    stats.compute_s += seconds_since(t0);
    SchemeEnv e = env();
    cp_detail::pass_q_forward(e, passq, ctx.work->passq, ctx.seed, a.q, a.k, a.v, a.out, ctx.lse);
  }

  void pass_q_backward(const CpBackwardArgs& a, const CpContext::State& ctx) {
    const int64_t t = ctx.plan->local_tokens;
    SchemeEnv e = env();
    cp_detail::pass_q_backward(e, passq, ctx.work->passq, ctx.seed, a,
                               contiguous(ctx.k.data(), t, cfg.num_heads_k, cfg.head_dim_qk, cfg.dtype),
                               contiguous(ctx.v.data(), t, cfg.num_heads_k, cfg.head_dim_v, cfg.dtype), ctx.lse);
  }

  // Ring forward: step s computes this rank's queries over rank (rank - s) mod cp's block
  // while the next block travels. The kernel's accumulate mode carries the online softmax
  // from step to step in fp32 out and lse (no partial result, no merge), steps in order 0, 1,
  // ..., cp-1 whatever the timing.
  void ring_forward(const CpForwardArgs& a, CpContext::State& ctx) {
    const RankPlan& plan = *ctx.plan;
    const int cp = comm.size(), r = comm.rank();
    const int right = (r + 1) % cp, left = (r + cp - 1) % cp;
    const int64_t t = plan.local_tokens;
    auto t0 = Clock::now();
    keep_local_kv(a, ctx);  // the ring sends from its own buffers
    fill_own_block(ctx);
    const std::size_t n_lse = static_cast<std::size_t>(t) * cfg.num_heads_q;
    acc_out.assign(n_lse * cfg.head_dim_v, 0.0f);
    acc_lse.assign(n_lse, -std::numeric_limits<float>::infinity());
    stats.compute_s += seconds_since(t0);
    for (int st = 0; st < cp; ++st) {
      const int cur = st % 2, nxt = 1 - cur;
      CommRequest rq;
      if (st + 1 < cp) {  // the next block in flight while this one is computed
        t0 = Clock::now();
        rq = start_block_shift(comm, cfg.dtype, ring.visit[cur], right, ring.visit[nxt], left);
        stats.comm_s += seconds_since(t0);
      }
      const WorkList& w = ctx.work->steps[static_cast<std::size_t>(st)];
      if (!w.tasks.empty()) {  // skipped when no pair of this block is visible
        SchemeEnv e = env();  // (the next block moves along inside the call)
        e.compute_moving({&rq}, [&] {
          attention_forward({.in = ring_inputs(e, a.q, ring.visit[cur].data(), w, ctx.seed),
                             .out = contiguous(acc_out.data(), t, cfg.num_heads_q, cfg.head_dim_v),
                             .lse = acc_lse.data(),
                             .out_mode = OutMode::accumulate});
        });
      }
      ring_wait(rq);
    }
    t0 = Clock::now();
    store_f32(acc_out.data(), a.out);  // padding rows: 0 (no task writes them)
    ctx.lse = acc_lse;
    stats.compute_s += seconds_since(t0);
  }

  // ring.visit[0] = this rank's [K | V] (the context's copy), visit[1] sized alike.
  void fill_own_block(const CpContext::State& ctx) {
    ring.visit[0].resize(ctx.k.size() + ctx.v.size());
    std::memcpy(ring.visit[0].data(), ctx.k.data(), ctx.k.size());
    std::memcpy(ring.visit[0].data() + ctx.k.size(), ctx.v.data(), ctx.v.size());
    ring.visit[1].resize(ring.visit[0].size());
  }

  // Ring backward: the blocks travel as in forward; step s computes the dK/dV of the visiting
  // block's keys from this rank's queries (fp32) and sends it home at once, under the next
  // step's compute; an owner adds its own part (step 0, in place) and the parts that come back
  // in step order 1, ..., cp-1, whatever the timing. dQ adds up in the kernel (accumulate_all)
  // over the steps in order. q, out and dout are read in their storage dtype.
  void ring_backward(const CpBackwardArgs& a, const CpContext::State& ctx) {
    const int64_t t = ctx.plan->local_tokens;
    const auto n_k = static_cast<std::size_t>(t * k_row()), n_kv = n_k + static_cast<std::size_t>(t * v_row());
    auto t0 = Clock::now();
    fill_own_block(ctx);
    dkv_home.assign(n_kv, 0.0f);  // [dK | dV] of this rank's keys
    dq_acc.assign(static_cast<std::size_t>(t) * cfg.num_heads_q * cfg.head_dim_qk, 0.0f);
    stats.compute_s += seconds_since(t0);
    SchemeEnv e = env();
    const auto compute = [&](int s, const std::byte* block, float* part) {
      float* dkv = part ? part : dkv_home.data();
      if (part) std::fill_n(part, n_kv, 0.0f);
      attention_backward({.in = ring_inputs(e, a.q, block, ctx.work->steps[static_cast<std::size_t>(s)], ctx.seed),
                          .out = a.out,
                          .lse = ctx.lse.data(),
                          .dout = a.dout,
                          .dq = contiguous(dq_acc.data(), t, cfg.num_heads_q, cfg.head_dim_qk),
                          .dk = contiguous(dkv, t, cfg.num_heads_k, cfg.head_dim_qk),
                          .dv = contiguous(dkv + n_k, t, cfg.num_heads_k, cfg.head_dim_v),
                          .grad_mode = GradMode::accumulate_all});
    };
    const auto take = [&](const float* part) {
      for (std::size_t i = 0; i < n_kv; ++i) dkv_home[i] += part[i];
    };
    run_home_ring(e, ring, ctx.work->steps, ctx.work->returns, n_kv, true, compute, take);
    t0 = Clock::now();
    store_f32(dq_acc.data(), a.dq);  // padding rows: 0 (no task has a padding query)
    from_float(dkv_home.data(), n_k, cfg.dtype, a.dk.data);
    from_float(dkv_home.data() + n_k, n_kv - n_k, cfg.dtype, a.dv.data);
    stats.compute_s += seconds_since(t0);
  }
};

int cp_overlap_groups(const CpAttnConfig& cfg, int cp) {
  if (!cfg.overlap || cfg.scheme != CpScheme::allgather || cfg.kv_mode != KvMode::runs || cp <= 1) return 1;
  return overlap_kv_groups(cfg.num_heads_k);
}

void check_cp_scheme(const CpAttnConfig& cfg, int cp) {
  CPATTN_CHECK(cp >= 1, "cp (the communicator's size) must be >= 1, got ", cp);
  // (0 failed in PlanCache's constructor under its own name; a huge one threw length_error)
  CPATTN_CHECK(cfg.plan_cache_capacity >= 1 && cfg.plan_cache_capacity <= kMaxPlanCacheCapacity,
               "CpAttnConfig::plan_cache_capacity must be in 1..", kMaxPlanCacheCapacity, ", got ",
               cfg.plan_cache_capacity);
  CPATTN_CHECK(cfg.scheme >= CpScheme::allgather && cfg.scheme <= CpScheme::hybrid,
               "scheme must be allgather, ring, pass-q, a2a or hybrid, got ", static_cast<int>(cfg.scheme));
  if (cfg.scheme == CpScheme::hybrid) {
    CPATTN_CHECK(cfg.cp_inner >= 1 && cfg.cp_inner <= cp && cp % cfg.cp_inner == 0,
                 "CpAttention (hybrid): cp_inner = ", cfg.cp_inner, " must divide cp = ", cp,
                 " (cp = cp_inner x cp_outer, all-to-all groups of cp_inner consecutive ranks)");
    CPATTN_CHECK(cfg.hybrid_outer == CpScheme::allgather || cfg.hybrid_outer == CpScheme::ring,
                 "CpAttention (hybrid): hybrid_outer must be allgather or ring, got ", to_string(cfg.hybrid_outer));
  } else {
    CPATTN_CHECK(cfg.cp_inner == 0, "CpAttention: cp_inner is the hybrid scheme's and must be 0 for scheme ",
                 to_string(cfg.scheme), ", got ", cfg.cp_inner);
  }
  const CpScheme kv = kv_scheme(cfg);
  CPATTN_CHECK(kv == CpScheme::allgather || cfg.kv_mode == KvMode::runs, "kv_mode index is the all-gather "
               "scheme's; the ", to_string(kv), " scheme reads its blocks in place (kv_mode runs)");
  CPATTN_CHECK(cfg.split == CpSplit::padded || cfg.split == CpSplit::padding_free, "split must be padded or "
               "padding_free, got ", static_cast<int>(cfg.split));
  CPATTN_CHECK(cfg.scheme == CpScheme::allgather || cfg.split == CpSplit::padded, "scheme ", to_string(cfg.scheme),
               " takes only the padded split; the padding-free split needs scheme allgather");
}

void check_cp_attn_config(const CpAttnConfig& cfg, int cp) {
  CPATTN_CHECK(is_valid(cfg.dtype), "CpAttention: dtype must be fp32, fp16 or bf16, got ", static_cast<int>(cfg.dtype));
  // The kernels' own checks of sizes and options, before any tensor exists.
  check_attention_config({.num_heads_q = cfg.num_heads_q, .num_heads_k = cfg.num_heads_k,
                          .head_dim_qk = cfg.head_dim_qk, .head_dim_v = cfg.head_dim_v},
                         cfg.options, "CpAttention");
  check_cp_scheme(cfg, cp);
  if (cfg.scheme == CpScheme::a2a || cfg.scheme == CpScheme::hybrid)
    head_split(cfg.num_heads_q, cfg.num_heads_k, detail::a2a_group_size(cfg, cp),
               "CpAttention (" + std::string(to_string(cfg.scheme)) + ")");
}

CpAttention::CpAttention(Communicator& comm, const CpAttnConfig& cfg) {
  check_cp_attn_config(cfg, comm.size());
  // Where dK/dV are reduce-scattered over more than one rank: the all-gather scheme's padded
  // split at cp > 1, and the hybrid's outer all-gather over more than one group. (It was asked
  // of every configuration whose K/V move by all-gather, cp = 1, a2a and the padding-free
  // split's all_to_all_v sums included, none of which reduce-scatters.)
  const bool reduce_scatters = cfg.scheme == CpScheme::hybrid
                                   ? cfg.hybrid_outer == CpScheme::allgather && comm.size() / cfg.cp_inner > 1
                                   : cfg.scheme == CpScheme::allgather && cfg.split == CpSplit::padded && comm.size() > 1;
  CPATTN_CHECK(!cfg.deterministic || !reduce_scatters || comm.options().reduce_scatter_algorithm == CommAlgorithm::ring,
               "deterministic CP attention needs the communicator's fixed-order ring reduce-scatter");
  s_ = std::make_unique<State>(comm, cfg);
}

CpScheme parse_cp_scheme(std::string_view name) {
  std::string names;
  for (const CpScheme s : kCpSchemes) {
    if (name == to_string(s)) return s;
    names += (names.empty() ? "" : ", ") + std::string(to_string(s));
  }
  CPATTN_CHECK(false, "scheme must be one of ", names, ", got '", name, "'");
  return CpScheme::allgather;  // not reached
}

CpAttention::~CpAttention() {
  // After a timeout in throw_error mode, the communicator's pending requests may still read
  // or write the dK/dV buffers: the state outlives this object until they end.
  // No exception may leave a destructor: where the communicator cannot be asked (moved from
  // since: poisoned() throws; its state, pending requests included, went with the move), the
  // state is leaked on purpose rather than freed under requests that may still use it (out of
  // memory while keeping it, keep_if_poisoned ends the job with the state alive).
  try {
    if (s_) s_->comm.keep_if_poisoned(s_);
  } catch (...) {
    (void)s_.release();
  }
}

std::shared_ptr<const RankPlan> CpAttention::plan(std::span<const int64_t> cu_seqlens) {
  return s_->cache.get(cu_seqlens, s_->comm.size(), s_->comm.rank(), s_->cfg.split);
}
std::shared_ptr<const RankPlan> CpAttention::plan(std::span<const int32_t> cu_seqlens) {
  return s_->cache.get(cu_seqlens, s_->comm.size(), s_->comm.rank(), s_->cfg.split);
}

CpContext CpAttention::forward(const CpForwardArgs& a) {
  State& s = *s_;
  const CpAttnConfig& c = s.cfg;
  const char* fn = "CpAttention::forward";
  ++s.stats.forward_calls;
  auto ctx = std::make_shared<CpContext::State>();
  std::string err = local_error(fn, a.caller_error, [&] {
    s.check_groups(fn);
    if (a.plan) {
      CPATTN_CHECK(a.plan->cp == s.comm.size() && a.plan->rank == s.comm.rank(), fn, ": plan is for rank ",
                   a.plan->rank, " of cp = ", a.plan->cp, ", this is rank ", s.comm.rank(), " of ", s.comm.size());
      CPATTN_CHECK(a.plan->split == c.split, fn, ": plan is of the ", to_string(a.plan->split),
                   " split, the layer's is ", to_string(c.split));
      CPATTN_CHECK(a.cu_seqlens.empty() || std::equal(a.cu_seqlens.begin(), a.cu_seqlens.end(),
                                                      a.plan->cu_seqlens.begin(), a.plan->cu_seqlens.end()),
                   fn, ": cu_seqlens and plan were both given and differ (pass one of them)");
      ctx->plan = a.plan;
    } else {
      ctx->plan = s.cache.get(a.cu_seqlens, s.comm.size(), s.comm.rank(), c.split);
    }
    const int64_t t = ctx->plan->local_tokens;
    check_view(fn, "q", a.q, s.q_like(t), false);
    check_view(fn, "k", a.k, s.k_like(t), true);
    check_view(fn, "v", a.v, s.v_like(t), true);
    check_view(fn, "out", a.out, s.o_like(t), false);
    if (c.check_finite) {
      check_finite(fn, "q", a.q, *ctx->plan);
      check_finite(fn, "k", a.k, *ctx->plan);
      check_finite(fn, "v", a.v, *ctx->plan);
    }
    ctx->work = s.prepare(ctx->plan);
  });
  ctx->seed = a.dropout_seed.value_or(c.options.seed);
  double hidden = 0;  // the overlapped transfers' time in flight beyond the waits
  const std::vector<char> kv_free = s.agree_or_throw(err, ctx->work.get(), a.q.rows, 1, 0, ctx->seed);
  if (s.uses_a2a())  // before the byte count: the split is no payload
    s.a2a->connect([](CpAttention& outer) { outer.s_->nested = true; });
  const int64_t sent0 = s.bytes_sent(), received0 = s.bytes_received();

  if (s.uses_a2a()) {
    ctx->a2a = std::make_unique<detail::A2aContext>();
    hidden = s.a2a->forward(a, ctx->plan, ctx->seed, ctx->lse, *ctx->a2a, s.stats);
  } else if (c.scheme == CpScheme::ring) {
    s.ring_forward(a, *ctx);
  } else if (c.scheme == CpScheme::pass_q) {
    s.pass_q_forward(a, *ctx);
  } else if (std::shared_ptr<NodeBuffer> buf = s.take_kv_shared(*ctx->plan, kv_free)) {
    s.shared_forward(a, *ctx, std::move(buf));
  } else if (const int groups = cp_overlap_groups(c, s.comm.size()); State::overlapped(groups, *ctx->work, false)) {
    hidden = s.grouped_forward(a, *ctx, groups);
  } else {
    const RankPlan& plan = *ctx->plan;
    const std::size_t es = dtype_size(c.dtype);
    const int64_t t_all = plan.layout.rank_begin.back();  // cp * local_tokens when padded
    auto t0 = Clock::now();
    std::vector<std::byte> k_all, v_all;
    if (!s.indexed()) {  // runs mode: a consumed context's, resized (every row is gathered)
      State::SpareKv e = s.take_spare_kv();
      k_all = std::move(e.k);
      v_all = std::move(e.v);
    }
    k_all.resize(static_cast<std::size_t>(t_all * s.k_row()) * es);
    v_all.resize(static_cast<std::size_t>(t_all * s.v_row()) * es);
    try {
      all_gather_rows(s.comm, c.dtype, plan, a.k.data, s.k_row(), k_all.data());
      all_gather_rows(s.comm, c.dtype, plan, a.v.data, s.v_row(), v_all.data());
    } catch (...) {
      // A throw-mode timeout leaves requests that may still write the receive buffers.
      s.comm.keep_if_poisoned(k_all, v_all);
      throw;
    }
    s.stats.comm_s += seconds_since(t0);
    s.stats.first_kv_s += seconds_since(t0);

    t0 = Clock::now();
    // The keys the kernel reads: the gathered buffer in place (runs: in document order
    // through the plan's key_rows) or its index_select copy.
    if (s.indexed()) {
      index_select(k_all.data(), ctx->work->copy_index, s.k_row() * es, ctx->k);
      index_select(v_all.data(), ctx->work->copy_index, s.v_row() * es, ctx->v);
      ctx->total_k = static_cast<int64_t>(ctx->work->copy_index.size());
    } else {
      ctx->k = std::move(k_all);
      ctx->v = std::move(v_all);
      ctx->total_k = t_all;
    }
    ctx->lse.assign(static_cast<std::size_t>(plan.local_tokens) * c.num_heads_q,
                    -std::numeric_limits<float>::infinity());
    zero_padding_rows(a.out, plan);
    s.note_peak(ctx->bytes() + k_all.capacity() + v_all.capacity());  // index mode: the gathered K/V beside its copy
    attention_forward({.in = s.inputs(a.q, *ctx), .out = a.out, .lse = ctx->lse.data()});
    s.stats.compute_s += seconds_since(t0);
  }
  if (a.lse && !ctx->lse.empty()) {  // every scheme leaves the local queries' lse in the context
    const auto t0 = Clock::now();
    std::memcpy(a.lse, ctx->lse.data(), ctx->lse.size() * sizeof(float));
    s.stats.compute_s += seconds_since(t0);
  }
  s.stats.bytes_sent += s.bytes_sent() - sent0;
  s.stats.bytes_received += s.bytes_received() - received0;
  s.hidden_s += hidden;
  s.stats.comm_total_s = s.stats.comm_s + s.hidden_s;  // exactly comm_s without overlap
  ctx->owner = s.id;
  ctx->forward_call = s.stats.forward_calls;
  ctx->live_bytes = s.live_bytes;
  ctx->counted = ctx->bytes();
  *s.live_bytes += ctx->counted;
  s.note_peak();
  CpContext out;
  out.s_ = std::move(ctx);
  return out;
}

void CpAttention::backward(CpContext& ctx, const CpBackwardArgs& a) {
  State& s = *s_;
  const CpAttnConfig& c = s.cfg;
  const char* fn = "CpAttention::backward";
  ++s.stats.backward_calls;
  int64_t grad_need = 0;  // a shared backward's attention_grad_share_bytes
  std::string err = local_error(fn, a.caller_error, [&] {
    s.check_groups(fn);
    CPATTN_CHECK(ctx.s_ != nullptr, fn, ": the context holds no forward (each forward's context is consumed by "
                 "one backward); forward calls ", s.stats.forward_calls, ", backward calls ", s.stats.backward_calls);
    CPATTN_CHECK(ctx.s_->owner == s.id, fn, ": the context was made by another CpAttention's forward");
    const int64_t t = ctx.s_->plan->local_tokens;
    check_view(fn, "q", a.q, s.q_like(t), false);
    check_view(fn, "out", a.out, s.o_like(t), false);
    check_view(fn, "dout", a.dout, s.o_like(t), false);
    check_view(fn, "dq", a.dq, s.q_like(t), false);
    check_view(fn, "dk", a.dk, s.k_like(t), true);
    check_view(fn, "dv", a.dv, s.v_like(t), true);
    if (c.check_finite) check_finite(fn, "dout", a.dout, *ctx.s_->plan);
    if (s.takes_shared_backward(*ctx.s_))
      grad_need = static_cast<int64_t>(attention_grad_share_bytes({.in = s.inputs(a.q, *ctx.s_)}));
  });
  const CpContext::State* cs = ctx.s_.get();
  double hidden = 0;  // the overlapped transfers' time in flight beyond the waits
  s.agree_or_throw(err, cs ? cs->work.get() : nullptr, a.q.rows, 2, cs ? cs->forward_call : 0, cs ? cs->seed : 0,
                   grad_need);
  const int64_t sent0 = s.bytes_sent(), received0 = s.bytes_received();
  // Counted however backward leaves (the all-gather path below returns at its end).
  const auto count_bytes = [&] {
    s.stats.bytes_sent += s.bytes_sent() - sent0;
    s.stats.bytes_received += s.bytes_received() - received0;
    s.hidden_s += hidden;
    s.stats.comm_total_s = s.stats.comm_s + s.hidden_s;
  };

  if (c.scheme != CpScheme::allgather || s.uses_a2a()) {
    if (s.uses_a2a())
      hidden = s.a2a->backward(*cs->a2a, cs->plan, a, s.stats);
    else if (c.scheme == CpScheme::ring)
      s.ring_backward(a, *cs);
    else
      s.pass_q_backward(a, *cs);
    count_bytes();
    s.note_peak();
    ctx.s_.reset();
    return;
  }
  if (s.takes_shared_backward(*cs) && s.ensure_shared(s.dkv_shared, s.dkv_shared_bytes()) &&
      (!s.share_pack || s.ensure_shared(s.pack_shared, s.pack_shared_bytes(*cs->plan)))) {
    s.shared_backward(a, *cs);
    count_bytes();
    s.note_peak();
    s.recycle_kv(*ctx.s_);  // a message-path context's K/V storage (a shared one's is its pool entry)
    ctx.s_.reset();  // consumed: its K/V pool entry is free again once every rank's is
    return;
  }
  if (!s.indexed() && State::overlapped(cs->groups, *cs->work, true)) {
    hidden = s.grouped_backward(a, *cs);
    count_bytes();
    s.note_peak();
    s.recycle_kv(*ctx.s_);  // for a next forward's context
    ctx.s_.reset();
    return;
  }
  const RankPlan& plan = *cs->plan;
  auto t0 = Clock::now();
  const int64_t k_row = s.k_row(), v_row = s.v_row();
  const int64_t t_all = plan.layout.rank_begin.back();
  // dK/dV of every gathered row, fp32, rank-major: what the reduce-scatter sums. In runs mode
  // the kernel writes every row there (at the gathered rows, through the plan's key_rows); in
  // index mode it adds into the copy's rows, and index_add_ moves them here.
  const std::vector<int64_t>& index = cs->work->copy_index;
  const auto n_idx = static_cast<int64_t>(index.size());
  float* dkp = nullptr;
  float* dvp = nullptr;
  if (s.indexed()) {
    s.dk_all.assign(static_cast<std::size_t>(t_all * k_row), 0.0f);
    s.dv_all.assign(static_cast<std::size_t>(t_all * v_row), 0.0f);
    s.dkx.assign(static_cast<std::size_t>(n_idx * k_row), 0.0f);
    s.dvx.assign(static_cast<std::size_t>(n_idx * v_row), 0.0f);
    dkp = s.dkx.data();
    dvp = s.dvx.data();
  } else {  // every row written: resized, not zeroed
    s.dk_all.resize(static_cast<std::size_t>(t_all * k_row));
    s.dv_all.resize(static_cast<std::size_t>(t_all * v_row));
    dkp = s.dk_all.data();
    dvp = s.dv_all.data();
  }
  attention_backward({.in = s.inputs(a.q, *cs),
                      .out = a.out,
                      .lse = cs->lse.data(),
                      .dout = a.dout,
                      .dq = a.dq,
                      .dk = contiguous(dkp, cs->total_k, c.num_heads_k, c.head_dim_qk),
                      .dv = contiguous(dvp, cs->total_k, c.num_heads_k, c.head_dim_v),
                      .grad_mode = s.indexed() ? GradMode::accumulate : GradMode::write});
  zero_padding_rows(a.dq, plan);
  if (s.indexed()) {
    // index_add_, in index order: deterministic.
    for (int64_t i = 0; i < n_idx; ++i) {
      const int64_t g = index[i];
      for (int64_t e = 0; e < k_row; ++e) s.dk_all[g * k_row + e] += s.dkx[i * k_row + e];
      for (int64_t e = 0; e < v_row; ++e) s.dv_all[g * v_row + e] += s.dvx[i * v_row + e];
    }
  }
  s.stats.compute_s += seconds_since(t0);

  if (s.comm.size() == 1) {  // the reduce-scatter of one rank: its own rows, summed as it would
    t0 = Clock::now();
    s.store_sums(plan, [&](int, bool is_k) { return is_k ? s.dk_all.data() : s.dv_all.data(); }, a.dk.data, a.dv.data);
    s.stats.compute_s += seconds_since(t0);
  } else {
    t0 = Clock::now();
    // (the padding-free split's receive blocks: in runs mode the overlapped backward's, the same
    // size, so that a layer whose batches run either way holds one set: cp_memory_estimate)
    reduce_scatter_rows(s.comm, plan, s.dk_all, k_row, s.dk_loc, s.indexed() ? s.dkx : s.rs_k);
    reduce_scatter_rows(s.comm, plan, s.dv_all, v_row, s.dv_loc, s.indexed() ? s.dvx : s.rs_v);
    s.stats.comm_s += seconds_since(t0);
    s.stats.dkv_s += seconds_since(t0);

    t0 = Clock::now();
    from_float(s.dk_loc.data(), s.dk_loc.size(), c.dtype, a.dk.data);
    from_float(s.dv_loc.data(), s.dv_loc.size(), c.dtype, a.dv.data);
    s.stats.compute_s += seconds_since(t0);
  }
  count_bytes();
  s.note_peak();
  if (!s.indexed()) s.recycle_kv(*ctx.s_);  // runs mode: the K/V storage for a next forward
  ctx.s_.reset();  // consumed
}

const CpAttnConfig& CpAttention::config() const { return s_->cfg; }
const CpStats& CpAttention::stats() const { return s_->stats; }
const PlanCache& CpAttention::plan_cache() const { return s_->cache; }
void CpAttention::reset_stats() {
  const int64_t f = s_->stats.forward_calls, b = s_->stats.backward_calls;
  std::string off = std::move(s_->stats.shared_memory_off);  // a fact of the layer, not a figure
  s_->stats = CpStats{};
  s_->stats.shared_memory_off = std::move(off);
  s_->hidden_s = 0;
  s_->stats.forward_calls = f;  // the counters are part of the agreement: never reset
  s_->stats.backward_calls = b;
}

std::vector<float> gather_global_rows(Communicator& comm, const RankPlan& p, ConstTensorView local) {
  std::string err;
  // (The plan must be this rank's, of one batch on every rank: another rank's plan, or another
  // batch's of the same token count, gave wrong rows without a word.)
  if (p.cp != comm.size() || p.rank != comm.rank())
    err = "gather_global_rows: the plan is rank " + std::to_string(p.rank) + "'s of cp = " + std::to_string(p.cp) +
          ", this is rank " + std::to_string(comm.rank()) + " of " + std::to_string(comm.size());
  else if (local.rows != p.local_tokens)
    err = "gather_global_rows: local must have the plan's local_tokens = " + std::to_string(p.local_tokens) +
          " rows, got " + std::to_string(local.rows);
  else if (!local.addressable())
    err = "gather_global_rows: local must not be null";
  Fingerprint fp;
  if (err.empty())
    fp.add("heads", local.heads).add("dim", local.dim).add("global tokens", p.global_tokens).add("cp", p.cp)
        .add("cu_seqlens hash", static_cast<int64_t>(hash_boundaries(p.cu_seqlens)))
        .add("split", static_cast<int64_t>(p.split));
  agree(comm, fp, "gather_global_rows", err);
  const int64_t row = int64_t{local.heads} * local.dim;
  const std::size_t es = dtype_size(local.dtype);
  // What the all-gathers send and receive, shared: after a throw-mode timeout the
  // communicator keeps it while their requests are pending (keep_if_poisoned).
  struct Buffers {
    std::vector<float> mine, all_val;
    std::vector<int64_t> idx, all_idx;
  };
  auto bufs = std::make_shared<Buffers>();
  auto& [mine, all_val, idx, all_idx] = *bufs;
  mine.reserve(static_cast<std::size_t>((p.local_tokens - p.padding_tokens) * row));
  std::vector<float> tmp(static_cast<std::size_t>(local.dim));
  for (int64_t i = 0; i < p.local_tokens; ++i) {
    if (p.real_token_index[i] < 0) continue;
    for (int h = 0; h < local.heads; ++h) {
      to_float(static_cast<const std::byte*>(local.data) + local.offset(i, h) * es, local.dtype, tmp.size(), tmp.data());
      mine.insert(mine.end(), tmp.begin(), tmp.end());
    }
    idx.push_back(p.real_token_index[i]);
  }
  const std::vector<int64_t> n_idx = comm.all_gather_counts(static_cast<int64_t>(idx.size()));
  std::vector<int64_t> n_val(n_idx.size());
  for (std::size_t r = 0; r < n_idx.size(); ++r) n_val[r] = n_idx[r] * row;
  all_idx.resize(static_cast<std::size_t>(p.global_tokens));
  all_val.resize(static_cast<std::size_t>(p.global_tokens * row));
  try {
    comm.all_gather_v<int64_t>(idx, n_idx, all_idx);
    comm.all_gather_v<float>(mine, n_val, all_val);
  } catch (...) {
    comm.keep_if_poisoned(bufs);
    throw;
  }
  std::vector<float> out(all_val.size());
  for (int64_t i = 0; i < p.global_tokens; ++i)
    std::copy_n(all_val.begin() + i * row, row, out.begin() + all_idx[i] * row);
  return out;
}

}  // namespace cpattn
