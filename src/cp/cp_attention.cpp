// CpAttention: docs/design.md section 7, KV all-gather with the symmetric split.
#include <cpattn/cp.hpp>
#include <cpattn/dtype.hpp>
#include <cpattn/error.hpp>
#include <cpattn/layout.hpp>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

namespace cpattn {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

void all_gather_rows(Communicator& comm, DType t, const void* local, std::size_t elems, void* all) {
  if (t == DType::f32) {
    comm.all_gather<float>({static_cast<const float*>(local), elems},
                           {static_cast<float*>(all), elems * comm.size()});
  } else {
    comm.all_gather<uint16_t>({static_cast<const uint16_t*>(local), elems},
                              {static_cast<uint16_t*>(all), elems * comm.size()});
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

// The keys each task reads, as runs of the rank-major gathered buffer. Causal: chunks 0..j of
// the document, the plan's runs. No mask: every chunk of the document. A sliding window
// (AttnOptions) reads the same runs: the kernels skip the key blocks outside the window.
WorkList keys_for_mask(const RankPlan& plan, MaskType mask) {
  if (mask == MaskType::causal) return plan.work;
  WorkList w;
  w.tasks = plan.work.tasks;
  const int64_t cp = plan.cp;
  for (AttnTask& t : w.tasks) {
    const DocSplit& d = plan.docs[t.doc];
    t.run_begin = static_cast<int64_t>(w.runs.size());
    for (int64_t m = 0; m < chunks_per_document(plan.cp); ++m) {
      const int64_t row = chunk_owner(m, plan.cp) * plan.local_tokens + d.local_begin + (m < cp ? 0 : d.chunk);
      if (static_cast<int64_t>(w.runs.size()) > t.run_begin && w.runs.back().row + w.runs.back().len == row)
        w.runs.back().len += d.chunk;
      else
        w.runs.push_back(KeyRun{.row = row, .len = d.chunk, .pos = m * d.chunk});
    }
    t.run_end = static_cast<int64_t>(w.runs.size());
  }
  return w;
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

// rows[i] = all[index[i]], rows of `row_bytes`.
void index_select(const std::byte* all, const std::vector<int64_t>& index, std::size_t row_bytes,
                  std::vector<std::byte>& rows) {
  rows.resize(index.size() * row_bytes);
  for (std::size_t i = 0; i < index.size(); ++i)
    std::memcpy(rows.data() + i * row_bytes, all + index[i] * row_bytes, row_bytes);
}

// Whether every element of `t` is finite (one pass, converted in row pieces).
bool all_finite(ConstTensorView t) {
  std::vector<float> row(static_cast<std::size_t>(t.dim));
  const std::size_t es = dtype_size(t.dtype);
  for (int64_t i = 0; i < t.rows; ++i)
    for (int h = 0; h < t.heads; ++h) {
      to_float(static_cast<const std::byte*>(t.data) + t.offset(i, h) * es, t.dtype, row.size(), row.data());
      for (const float x : row)
        if (!std::isfinite(x)) return false;
    }
  return true;
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
  CPATTN_CHECK(t.data != nullptr, fn, ": ", name, " must not be null");
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
};

}  // namespace

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
  std::vector<float> lse;
  // The live-context byte count of the CpAttention that made it (for its peak figure).
  std::shared_ptr<std::size_t> live_bytes;

  std::size_t bytes() const { return k.capacity() + v.capacity() + lse.capacity() * sizeof(float); }
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
  std::shared_ptr<std::size_t> live_bytes = std::make_shared<std::size_t>(0);
  // Backward's buffers, kept across calls (one backward runs at a time): fp32 dK/dV of every
  // key row the kernel reads, the gathered rows' sums in index mode, this rank's share.
  std::vector<float> dk_all, dv_all, dkx, dvx, dk_loc, dv_loc;

  State(Communicator& c, const CpAttnConfig& config)
      : comm(c), cfg(config), cache(config.plan_cache_capacity) {}

  // The shapes of this rank's tensors for a plan of t local tokens.
  Expected q_like(int64_t t) const { return {t, cfg.num_heads_q, "num_heads_q", cfg.head_dim_qk, "head_dim_qk", cfg.dtype}; }
  Expected o_like(int64_t t) const { return {t, cfg.num_heads_q, "num_heads_q", cfg.head_dim_v, "head_dim_v", cfg.dtype}; }
  Expected k_like(int64_t t) const { return {t, cfg.num_heads_k, "num_heads_k", cfg.head_dim_qk, "head_dim_qk", cfg.dtype}; }
  Expected v_like(int64_t t) const { return {t, cfg.num_heads_k, "num_heads_k", cfg.head_dim_v, "head_dim_v", cfg.dtype}; }
  int64_t k_row() const { return int64_t{cfg.num_heads_k} * cfg.head_dim_qk; }
  int64_t v_row() const { return int64_t{cfg.num_heads_k} * cfg.head_dim_v; }
  bool indexed() const { return cfg.kv_mode == KvMode::index; }

  std::shared_ptr<const PreparedWork> prepare(const std::shared_ptr<const RankPlan>& plan) {
    if (prepared && prepared->plan == plan) return prepared;
    auto w = std::make_shared<PreparedWork>();
    w->plan = plan;
    const WorkList keys = without_padding(*plan, keys_for_mask(*plan, cfg.options.mask));
    if (indexed())
      copy_form(keys, w->copy_index, w->work);
    else
      w->work = keys;
    prepared = std::move(w);
    return prepared;
  }

  // The kernels' inputs for a context: local q over the keys the context holds.
  AttnInputs inputs(ConstTensorView q, const CpContext::State& c) const {
    AttnOptions o = cfg.options;
    o.seed = c.seed;
    return {.q = q,
            .k = contiguous(c.k.data(), c.total_k, cfg.num_heads_k, cfg.head_dim_qk, cfg.dtype),
            .v = contiguous(c.v.data(), c.total_k, cfg.num_heads_k, cfg.head_dim_v, cfg.dtype),
            .work = &c.work->work,
            .options = o};
  }

  // Every rank learns every rank's local error, and all throw the same message; else the
  // ranks agree on the fingerprint. One all-gather, before any payload moves. A rank with an
  // error still takes part, so that the others fail with its message instead of waiting.
  void agree_or_throw(const std::string& local_error, const RankPlan* plan, int64_t local_tokens,
                      int64_t phase, int64_t context_forward_call, uint64_t seed) {
    const auto t0 = Clock::now();
    const int64_t calls_before = comm.calls();
    const AttnOptions& o = cfg.options;
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
        .add("softmax_scale set", o.softmax_scale.has_value())
        .add("softmax_scale (bits)", std::bit_cast<int32_t>(o.softmax_scale.value_or(0.0f)))
        .add("dropout_p (bits)", std::bit_cast<int32_t>(o.dropout_p))
        .add("window_size_left", o.window_size_left)
        .add("window_size_right", o.window_size_right)
        .add("softcap (bits)", std::bit_cast<int32_t>(o.softcap))
        .add("alibi slopes hash", static_cast<int64_t>(hash_slopes(o.alibi_slopes, cfg.num_heads_q)))
        .add("seed", static_cast<int64_t>(seed))
        .add("deterministic", cfg.deterministic)
        .add("local_tokens", local_tokens)
        .add("documents", static_cast<int64_t>(plan->docs.size()))
        .add("global tokens", plan->global_tokens)
        .add("cu_seqlens hash", static_cast<int64_t>(hash_boundaries(plan->cu_seqlens)));
    try {
      agree(comm, fp, "CP attention", local_error);  // one all-gather when all agree
    } catch (...) {
      stats.comm_s += seconds_since(t0);
      throw;
    }
    stats.comm_s += seconds_since(t0);
  }

  void note_peak() {
    std::size_t bytes = *live_bytes;
    for (const std::vector<float>* f : {&dk_all, &dv_all, &dkx, &dvx, &dk_loc, &dv_loc})
      bytes += f->capacity() * sizeof(float);
    stats.peak_buffer_bytes = std::max(stats.peak_buffer_bytes, bytes);
  }
};

CpAttention::CpAttention(Communicator& comm, const CpAttnConfig& cfg) {
  const AttnOptions& o = cfg.options;
  CPATTN_CHECK(cfg.num_heads_q >= 1 && cfg.num_heads_k >= 1 && cfg.num_heads_q % cfg.num_heads_k == 0,
               "num_heads_q (", cfg.num_heads_q, ") must be a positive multiple of num_heads_k (",
               cfg.num_heads_k, ")");
  CPATTN_CHECK(cfg.head_dim_qk >= 1 && cfg.head_dim_qk <= 256, "head_dim_qk must be in [1, 256], got ",
               cfg.head_dim_qk);
  CPATTN_CHECK(cfg.head_dim_v >= 1 && cfg.head_dim_v <= 256, "head_dim_v must be in [1, 256], got ",
               cfg.head_dim_v);
  CPATTN_CHECK(o.dropout_p >= 0.0f && o.dropout_p < 1.0f, "dropout_p must be in [0, 1), got ", o.dropout_p);
  CPATTN_CHECK(!o.softmax_scale || std::isfinite(*o.softmax_scale),
               "softmax_scale must be finite when set (unset: 1/sqrt(head_dim_qk)), got ", o.softmax_scale.value_or(0));
  CPATTN_CHECK(o.num_threads >= 1, "num_threads must be >= 1, got ", o.num_threads);
  CPATTN_CHECK(kernel_path_supported(o.path), "kernel path ", to_string(o.path), " cannot run on this CPU");
  CPATTN_CHECK(!cfg.deterministic || comm.options().reduce_scatter_algorithm == CommAlgorithm::ring,
               "deterministic CP attention needs the communicator's fixed-order ring reduce-scatter");
  s_ = std::make_unique<State>(comm, cfg);
}

CpAttention::~CpAttention() {
  // After a timeout in throw_error mode, the communicator's pending requests may still read
  // or write the dK/dV buffers: the state outlives this object until they end.
  if (s_ && s_->comm.poisoned()) s_->comm.retain_while_pending(std::shared_ptr<State>(std::move(s_)));
}

std::shared_ptr<const RankPlan> CpAttention::plan(std::span<const int64_t> cu_seqlens) {
  return s_->cache.get(cu_seqlens, s_->comm.size(), s_->comm.rank());
}
std::shared_ptr<const RankPlan> CpAttention::plan(std::span<const int32_t> cu_seqlens) {
  return s_->cache.get(cu_seqlens, s_->comm.size(), s_->comm.rank());
}

CpContext CpAttention::forward(const CpForwardArgs& a) {
  State& s = *s_;
  const CpAttnConfig& c = s.cfg;
  const char* fn = "CpAttention::forward";
  ++s.stats.forward_calls;
  auto ctx = std::make_shared<CpContext::State>();
  std::string err;
  try {
    if (a.plan) {
      CPATTN_CHECK(a.plan->cp == s.comm.size() && a.plan->rank == s.comm.rank(), fn, ": plan is for rank ",
                   a.plan->rank, " of cp = ", a.plan->cp, ", this is rank ", s.comm.rank(), " of ", s.comm.size());
      CPATTN_CHECK(a.cu_seqlens.empty() || std::equal(a.cu_seqlens.begin(), a.cu_seqlens.end(),
                                                      a.plan->cu_seqlens.begin(), a.plan->cu_seqlens.end()),
                   fn, ": cu_seqlens and plan were both given and differ (pass one of them)");
      ctx->plan = a.plan;
    } else {
      ctx->plan = s.cache.get(a.cu_seqlens, s.comm.size(), s.comm.rank());
    }
    const int64_t t = ctx->plan->local_tokens;
    check_view(fn, "q", a.q, s.q_like(t), false);
    check_view(fn, "k", a.k, s.k_like(t), true);
    check_view(fn, "v", a.v, s.v_like(t), true);
    check_view(fn, "out", a.out, s.o_like(t), false);
    if (c.check_finite) {
      CPATTN_CHECK(all_finite(a.q), fn, ": q holds a non-finite value");
      CPATTN_CHECK(all_finite(a.k), fn, ": k holds a non-finite value");
      CPATTN_CHECK(all_finite(a.v), fn, ": v holds a non-finite value");
    }
    ctx->work = s.prepare(ctx->plan);
  } catch (const Error& e) {
    err = e.message();
  } catch (const std::exception& e) {  // bad_alloc and the like: still fail on every rank
    err = std::string(fn) + ": " + e.what();
  }
  ctx->seed = a.dropout_seed.value_or(c.options.seed);
  s.agree_or_throw(err, ctx->plan.get(), a.q.rows, 1, 0, ctx->seed);

  const RankPlan& plan = *ctx->plan;
  const int cp = s.comm.size();
  const std::size_t es = dtype_size(c.dtype);
  const auto k_elems = static_cast<std::size_t>(plan.local_tokens * s.k_row());
  const auto v_elems = static_cast<std::size_t>(plan.local_tokens * s.v_row());
  auto t0 = Clock::now();
  std::vector<std::byte> k_all(k_elems * cp * es), v_all(v_elems * cp * es);
  try {
    all_gather_rows(s.comm, c.dtype, a.k.data, k_elems, k_all.data());
    all_gather_rows(s.comm, c.dtype, a.v.data, v_elems, v_all.data());
  } catch (...) {
    // A throw-mode timeout leaves requests that may still write the receive buffers.
    if (s.comm.poisoned()) {
      auto keep = std::make_shared<std::pair<std::vector<std::byte>, std::vector<std::byte>>>(std::move(k_all),
                                                                                               std::move(v_all));
      s.comm.retain_while_pending(keep);
    }
    throw;
  }
  s.stats.comm_s += seconds_since(t0);

  t0 = Clock::now();
  // The keys the kernel reads: the gathered buffer in place (runs) or its index_select copy.
  if (s.indexed()) {
    index_select(k_all.data(), ctx->work->copy_index, s.k_row() * es, ctx->k);
    index_select(v_all.data(), ctx->work->copy_index, s.v_row() * es, ctx->v);
    ctx->total_k = static_cast<int64_t>(ctx->work->copy_index.size());
  } else {
    ctx->k = std::move(k_all);
    ctx->v = std::move(v_all);
    ctx->total_k = cp * plan.local_tokens;
  }
  ctx->lse.assign(static_cast<std::size_t>(plan.local_tokens) * c.num_heads_q,
                  -std::numeric_limits<float>::infinity());
  zero_padding_rows(a.out, plan);
  attention_forward({.in = s.inputs(a.q, *ctx), .out = a.out, .lse = ctx->lse.data()});
  if (a.lse) std::memcpy(a.lse, ctx->lse.data(), ctx->lse.size() * sizeof(float));
  s.stats.compute_s += seconds_since(t0);

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
  std::string err;
  try {
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
    if (c.check_finite) CPATTN_CHECK(all_finite(a.dout), fn, ": dout holds a non-finite value");
  } catch (const Error& e) {
    err = e.message();
  } catch (const std::exception& e) {
    err = std::string(fn) + ": " + e.what();
  }
  const CpContext::State* cs = ctx.s_.get();
  s.agree_or_throw(err, cs ? cs->plan.get() : nullptr, a.q.rows, 2, cs ? cs->forward_call : 0, cs ? cs->seed : 0);

  const RankPlan& plan = *cs->plan;
  const int cp = s.comm.size();
  auto t0 = Clock::now();
  const int64_t k_row = s.k_row(), v_row = s.v_row();
  const int64_t t_all = cp * plan.local_tokens;
  // dK/dV of every gathered row, fp32, rank-major: what the reduce-scatter sums. In index
  // mode the kernel adds into the copy's rows, and index_add_ moves them here.
  s.dk_all.assign(static_cast<std::size_t>(t_all * k_row), 0.0f);
  s.dv_all.assign(static_cast<std::size_t>(t_all * v_row), 0.0f);
  float* dkp = s.dk_all.data();
  float* dvp = s.dv_all.data();
  const std::vector<int64_t>& index = cs->work->copy_index;
  const auto n_idx = static_cast<int64_t>(index.size());
  if (s.indexed()) {
    s.dkx.assign(static_cast<std::size_t>(n_idx * k_row), 0.0f);
    s.dvx.assign(static_cast<std::size_t>(n_idx * v_row), 0.0f);
    dkp = s.dkx.data();
    dvp = s.dvx.data();
  }
  attention_backward({.in = s.inputs(a.q, *cs),
                      .out = a.out,
                      .lse = cs->lse.data(),
                      .dout = a.dout,
                      .dq = a.dq,
                      .dk = contiguous(dkp, cs->total_k, c.num_heads_k, c.head_dim_qk),
                      .dv = contiguous(dvp, cs->total_k, c.num_heads_k, c.head_dim_v),
                      .grad_mode = GradMode::accumulate});
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

  t0 = Clock::now();
  s.dk_loc.resize(static_cast<std::size_t>(plan.local_tokens * k_row));
  s.dv_loc.resize(static_cast<std::size_t>(plan.local_tokens * v_row));
  s.comm.reduce_scatter_sum(s.dk_all, s.dk_loc);
  s.comm.reduce_scatter_sum(s.dv_all, s.dv_loc);
  s.stats.comm_s += seconds_since(t0);

  t0 = Clock::now();
  from_float(s.dk_loc.data(), s.dk_loc.size(), c.dtype, a.dk.data);
  from_float(s.dv_loc.data(), s.dv_loc.size(), c.dtype, a.dv.data);
  s.stats.compute_s += seconds_since(t0);
  s.note_peak();
  ctx.s_.reset();  // consumed: its gathered K/V are released
}

const CpAttnConfig& CpAttention::config() const { return s_->cfg; }
const CpStats& CpAttention::stats() const { return s_->stats; }
const PlanCache& CpAttention::plan_cache() const { return s_->cache; }
void CpAttention::reset_stats() {
  const int64_t f = s_->stats.forward_calls, b = s_->stats.backward_calls;
  s_->stats = CpStats{};
  s_->stats.forward_calls = f;  // the counters are part of the agreement: never reset
  s_->stats.backward_calls = b;
}

std::vector<float> gather_global_rows(Communicator& comm, const RankPlan& p, ConstTensorView local) {
  std::string err;
  if (local.data == nullptr || local.rows != p.local_tokens)
    err = "gather_global_rows: local must have the plan's local_tokens = " + std::to_string(p.local_tokens) +
          " rows, got " + std::to_string(local.rows);
  Fingerprint fp;
  if (err.empty())
    fp.add("heads", local.heads).add("dim", local.dim).add("global tokens", p.global_tokens).add("cp", p.cp);
  agree(comm, fp, "gather_global_rows", err);
  const int64_t row = int64_t{local.heads} * local.dim;
  const std::size_t es = dtype_size(local.dtype);
  std::vector<float> mine;
  std::vector<int64_t> idx;
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
  std::vector<int64_t> n_val(n_idx.size()), all_idx(static_cast<std::size_t>(p.global_tokens));
  for (std::size_t r = 0; r < n_idx.size(); ++r) n_val[r] = n_idx[r] * row;
  std::vector<float> all_val(static_cast<std::size_t>(p.global_tokens * row)), out(all_val.size());
  comm.all_gather_v<int64_t>(idx, n_idx, all_idx);
  comm.all_gather_v<float>(mine, n_val, all_val);
  for (int64_t i = 0; i < p.global_tokens; ++i)
    std::copy_n(all_val.begin() + i * row, row, out.begin() + all_idx[i] * row);
  return out;
}

}  // namespace cpattn
