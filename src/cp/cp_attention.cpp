// CpAttention: DESIGN.md section 7, KV all-gather with the symmetric split.
#include <cpattn/cp.hpp>
#include <cpattn/dtype.hpp>
#include <cpattn/error.hpp>
#include <cpattn/layout.hpp>

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

// Storage bytes as the elements the communicator moves: fp32 as float, fp16/bf16 bit for bit.
struct Bytes {
  std::vector<std::byte> data;
  void resize(std::size_t n) { data.resize(n); }
  std::byte* ptr() { return data.data(); }
  const std::byte* ptr() const { return data.data(); }
};

void all_gather_rows(Communicator& comm, DType t, const void* local, std::size_t elems, void* all) {
  if (t == DType::f32) {
    comm.all_gather<float>({static_cast<const float*>(local), elems},
                           {static_cast<float*>(all), elems * comm.size()});
  } else {
    comm.all_gather<uint16_t>({static_cast<const uint16_t*>(local), elems},
                              {static_cast<uint16_t*>(all), elems * comm.size()});
  }
}

// The keys each task reads, as runs of the rank-major gathered buffer. Causal: chunks 0..j of
// the document, the plan's runs. No mask: every chunk of the document.
WorkList keys_for_mask(const RankPlan& plan, MaskType mask) {
  if (mask == MaskType::causal) return plan.work;
  WorkList w;
  w.tasks = plan.work.tasks;
  const int64_t cp = plan.cp;
  for (AttnTask& t : w.tasks) {
    const DocSplit& d = plan.docs[t.doc];
    t.run_begin = static_cast<int64_t>(w.runs.size());
    for (int64_t m = 0; m < 2 * cp; ++m) {
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

bool all_finite(const void* p, DType t, std::size_t n) {
  std::vector<float> buf(std::min<std::size_t>(n, 1 << 16));
  for (std::size_t i = 0; i < n; i += buf.size()) {
    const std::size_t m = std::min(buf.size(), n - i);
    to_float(static_cast<const std::byte*>(p) + i * dtype_size(t), t, m, buf.data());
    for (std::size_t j = 0; j < m; ++j)
      if (!std::isfinite(buf[j])) return false;
  }
  return true;
}

}  // namespace

struct CpAttention::State {
  Communicator& comm;
  CpAttnConfig cfg;
  PlanCache cache;
  CpStats stats;

  std::shared_ptr<const RankPlan> plan;
  // What the kernel runs for `plan` (rebuilt only when the plan changes): the tasks without
  // padding, and in index mode their index_select form.
  std::shared_ptr<const RankPlan> work_of;  // held, so that its address is never reused
  WorkList work;
  std::vector<int64_t> copy_index;  // index mode: gathered row of each copied key row
  bool have_forward = false;
  // Saved by forward for backward (DESIGN.md 7): local q, out, lse and the gathered K/V (in
  // index mode their index_select copy, which is what the kernel reads).
  Bytes q, out, k_all, v_all;
  std::vector<std::byte> kx, vx;
  std::vector<float> lse;
  // Backward's buffers, kept across calls: fp32 dK/dV of every gathered (or copied) row, and
  // this rank's reduce-scattered share.
  std::vector<float> dk_all, dv_all, dkx, dvx, dk_loc, dv_loc;

  State(Communicator& c, const CpAttnConfig& config)
      : comm(c), cfg(config), cache(config.plan_cache_capacity) {}

  int64_t t_loc() const { return plan->local_tokens; }
  std::size_t esize() const { return dtype_size(cfg.dtype); }
  std::size_t q_elems() const { return static_cast<std::size_t>(t_loc()) * cfg.num_heads_q * cfg.head_dim_qk; }
  std::size_t o_elems() const { return static_cast<std::size_t>(t_loc()) * cfg.num_heads_q * cfg.head_dim_v; }
  std::size_t k_elems() const { return static_cast<std::size_t>(t_loc()) * cfg.num_heads_k * cfg.head_dim_qk; }
  std::size_t v_elems() const { return static_cast<std::size_t>(t_loc()) * cfg.num_heads_k * cfg.head_dim_v; }
  int64_t k_row() const { return int64_t{cfg.num_heads_k} * cfg.head_dim_qk; }
  int64_t v_row() const { return int64_t{cfg.num_heads_k} * cfg.head_dim_v; }
  int64_t q_row() const { return int64_t{cfg.num_heads_q} * cfg.head_dim_qk; }
  int64_t o_row() const { return int64_t{cfg.num_heads_q} * cfg.head_dim_v; }
  bool indexed() const { return cfg.kv_mode == KvMode::index; }

  void prepare_work() {
    if (work_of == plan) return;
    const WorkList keys = without_padding(*plan, keys_for_mask(*plan, cfg.mask));
    if (indexed())
      copy_form(keys, copy_index, work);
    else
      work = keys;
    work_of = plan;
  }

  // Every rank learns every rank's local error, and all throw the same message; else the
  // ranks agree on the fingerprint. One all-gather, before any payload moves. A rank with an
  // error still takes part, so that the others fail with its message instead of waiting.
  void agree_or_throw(const std::string& local_error, uint64_t boundaries_hash, int64_t local_tokens,
                      int64_t phase) {
    const char* what = "CP attention";
    const auto t0 = Clock::now();
    const int64_t calls_before = comm.calls();
    // A rank with a local error may have no plan: it sends an empty fingerprint, and the
    // agreement reports the errors before it compares fingerprints.
    Fingerprint fp;
    if (local_error.empty())
      fp.add("phase (1 forward, 2 backward)", phase)
        .add("forward calls", stats.forward_calls)
        .add("backward calls", stats.backward_calls)
        // Collectives this communicator ran before: catches ranks that run different layers
        // (each with its own CpAttention) over the same communicator.
        .add("communicator calls", calls_before)
        .add("cp", comm.size())
        .add("num_heads_q", cfg.num_heads_q)
        .add("num_heads_k", cfg.num_heads_k)
        .add("head_dim_qk", cfg.head_dim_qk)
        .add("head_dim_v", cfg.head_dim_v)
        .add("dtype", static_cast<int64_t>(cfg.dtype))
        .add("mask", static_cast<int64_t>(cfg.mask))
        .add("kv_mode", static_cast<int64_t>(cfg.kv_mode))
        .add("softmax_scale (bits)", std::bit_cast<int32_t>(cfg.softmax_scale))
        .add("dropout_p (bits)", std::bit_cast<int32_t>(cfg.dropout_p))
        .add("seed", static_cast<int64_t>(cfg.seed))
        .add("deterministic", cfg.deterministic)
        .add("local_tokens", local_tokens)
        .add("documents", static_cast<int64_t>(plan->docs.size()))
        .add("global tokens", plan->global_tokens)
        .add("cu_seqlens hash", static_cast<int64_t>(boundaries_hash));
    try {
      agree(comm, fp, what, local_error);  // one all-gather when all agree
    } catch (...) {
      stats.comm_s += seconds_since(t0);
      throw;
    }
    stats.comm_s += seconds_since(t0);
  }

  void note_peak() {
    std::size_t bytes = q.data.capacity() + out.data.capacity() + k_all.data.capacity() +
                        v_all.data.capacity() + kx.capacity() + vx.capacity();
    for (const std::vector<float>* f : {&lse, &dk_all, &dv_all, &dkx, &dvx, &dk_loc, &dv_loc})
      bytes += f->capacity() * sizeof(float);
    stats.peak_buffer_bytes = std::max(stats.peak_buffer_bytes, bytes);
  }
};

CpAttention::CpAttention(Communicator& comm, const CpAttnConfig& cfg) {
  CPATTN_CHECK(cfg.num_heads_q >= 1 && cfg.num_heads_k >= 1 && cfg.num_heads_q % cfg.num_heads_k == 0,
               "num_heads_q (", cfg.num_heads_q, ") must be a positive multiple of num_heads_k (",
               cfg.num_heads_k, ")");
  CPATTN_CHECK(cfg.head_dim_qk >= 1 && cfg.head_dim_qk <= 256, "head_dim_qk must be in [1, 256], got ",
               cfg.head_dim_qk);
  CPATTN_CHECK(cfg.head_dim_v >= 1 && cfg.head_dim_v <= 256, "head_dim_v must be in [1, 256], got ",
               cfg.head_dim_v);
  CPATTN_CHECK(cfg.dropout_p >= 0.0f && cfg.dropout_p < 1.0f, "dropout_p must be in [0, 1), got ",
               cfg.dropout_p);
  CPATTN_CHECK(cfg.softmax_scale >= 0.0f && std::isfinite(cfg.softmax_scale),
               "softmax_scale must be finite and >= 0 (0: 1/sqrt(head_dim_qk)), got ", cfg.softmax_scale);
  CPATTN_CHECK(cfg.num_threads >= 1, "num_threads must be >= 1, got ", cfg.num_threads);
  CPATTN_CHECK(kernel_path_supported(cfg.path), "kernel path ", to_string(cfg.path),
               " cannot run on this CPU");
  CPATTN_CHECK(!cfg.deterministic || comm.options().reduce_scatter_algorithm == CommAlgorithm::ring,
               "deterministic CP attention needs the communicator's fixed-order ring reduce-scatter");
  s_ = std::make_unique<State>(comm, cfg);
}

CpAttention::~CpAttention() {
  // After a timeout in throw_error mode, the communicator's pending requests may still read
  // the gathered K/V or write the dK/dV buffers: the state outlives this object until they end.
  if (s_ && s_->comm.poisoned()) s_->comm.retain_while_pending(std::shared_ptr<State>(std::move(s_)));
}

void CpAttention::forward(const CpForwardArgs& a) {
  State& s = *s_;
  const CpAttnConfig& c = s.cfg;
  s.have_forward = false;
  ++s.stats.forward_calls;
  std::string err;
  uint64_t hash = 0;
  try {
    CPATTN_CHECK(a.q && a.k && a.v && a.out, "forward: q, k, v and out must not be null");
    s.plan = s.cache.get(a.cu_seqlens, s.comm.size(), s.comm.rank());
    hash = hash_boundaries(a.cu_seqlens);
    CPATTN_CHECK(a.local_tokens == s.plan->local_tokens, "forward: local_tokens must be ",
                 s.plan->local_tokens, " (the padded batch's ", s.plan->global_tokens_padded,
                 " tokens over cp = ", s.comm.size(), "), got ", a.local_tokens);
    if (c.check_finite) {
      CPATTN_CHECK(all_finite(a.q, c.dtype, s.q_elems()), "forward: q holds a non-finite value");
      CPATTN_CHECK(all_finite(a.k, c.dtype, s.k_elems()), "forward: k holds a non-finite value");
      CPATTN_CHECK(all_finite(a.v, c.dtype, s.v_elems()), "forward: v holds a non-finite value");
    }
    s.prepare_work();
  } catch (const Error& e) {
    err = e.message();
  } catch (const std::exception& e) {  // bad_alloc and the like: still fail on every rank
    err = std::string("forward: ") + e.what();
  }
  s.agree_or_throw(err, hash, a.local_tokens, 1);

  const RankPlan& plan = *s.plan;
  const int cp = s.comm.size();
  const std::size_t es = s.esize();
  auto t0 = Clock::now();
  s.k_all.resize(s.k_elems() * cp * es);
  s.v_all.resize(s.v_elems() * cp * es);
  all_gather_rows(s.comm, c.dtype, a.k, s.k_elems(), s.k_all.ptr());
  all_gather_rows(s.comm, c.dtype, a.v, s.v_elems(), s.v_all.ptr());
  s.stats.comm_s += seconds_since(t0);

  t0 = Clock::now();
  // The keys the kernel reads: the gathered buffer in place (runs) or its index_select copy.
  const void* kp = s.k_all.ptr();
  const void* vp = s.v_all.ptr();
  int64_t total_k = cp * plan.local_tokens;
  if (s.indexed()) {
    index_select(s.k_all.ptr(), s.copy_index, s.k_row() * es, s.kx);
    index_select(s.v_all.ptr(), s.copy_index, s.v_row() * es, s.vx);
    kp = s.kx.data();
    vp = s.vx.data();
    total_k = static_cast<int64_t>(s.copy_index.size());
  }
  s.lse.assign(static_cast<std::size_t>(plan.local_tokens) * c.num_heads_q,
               -std::numeric_limits<float>::infinity());
  const int64_t o_row = s.o_row();
  for (int64_t i = 0; i < plan.local_tokens; ++i)  // padding rows: the kernel leaves them
    if (plan.real_token_index[i] < 0) std::memset(static_cast<std::byte*>(a.out) + i * o_row * es, 0, o_row * es);
  attention_forward({.q = a.q, .q_row_stride = s.q_row(), .q_head_stride = c.head_dim_qk,
                     .k = kp, .k_row_stride = s.k_row(), .k_head_stride = c.head_dim_qk,
                     .v = vp, .v_row_stride = s.v_row(), .v_head_stride = c.head_dim_v,
                     .out = a.out, .out_row_stride = o_row, .out_head_stride = c.head_dim_v,
                     .lse = s.lse.data(),
                     .total_q = plan.local_tokens, .total_k = total_k,
                     .num_heads_q = c.num_heads_q, .num_heads_k = c.num_heads_k,
                     .head_dim_qk = c.head_dim_qk, .head_dim_v = c.head_dim_v,
                     .dtype = c.dtype, .mask = c.mask, .softmax_scale = c.softmax_scale,
                     .dropout_p = c.dropout_p, .seed = c.seed, .work = &s.work,
                     .num_threads = c.num_threads, .path = c.path});
  if (a.lse) std::memcpy(a.lse, s.lse.data(), s.lse.size() * sizeof(float));
  // Keep what backward needs (the caller may reuse its buffers).
  s.q.resize(s.q_elems() * es);
  std::memcpy(s.q.ptr(), a.q, s.q.data.size());
  s.out.resize(s.o_elems() * es);
  std::memcpy(s.out.ptr(), a.out, s.out.data.size());
  s.have_forward = true;
  s.stats.compute_s += seconds_since(t0);
  s.note_peak();
}

void CpAttention::backward(const CpBackwardArgs& a) {
  State& s = *s_;
  const CpAttnConfig& c = s.cfg;
  ++s.stats.backward_calls;
  std::string err;
  try {
    CPATTN_CHECK(s.have_forward, "backward needs the forward just before it (one backward per "
                                 "forward); forward calls ", s.stats.forward_calls,
                 ", backward calls ", s.stats.backward_calls);
    CPATTN_CHECK(a.dout && a.dq && a.dk && a.dv, "backward: dout, dq, dk and dv must not be null");
    if (c.check_finite)
      CPATTN_CHECK(all_finite(a.dout, c.dtype, s.o_elems()), "backward: dout holds a non-finite value");
  } catch (const Error& e) {
    err = e.message();
  } catch (const std::exception& e) {
    err = std::string("backward: ") + e.what();
  }
  s.agree_or_throw(err, s.plan ? hash_boundaries(s.plan->cu_seqlens) : 0,
                   s.plan ? s.plan->local_tokens : 0, 2);
  s.have_forward = false;

  const RankPlan& plan = *s.plan;
  const int cp = s.comm.size();
  const std::size_t es = s.esize();
  auto t0 = Clock::now();
  const int64_t k_row = s.k_row(), v_row = s.v_row(), q_row = s.q_row(), o_row = s.o_row();
  const int64_t t_all = cp * plan.local_tokens;
  // dK/dV of every gathered row, fp32, rank-major: what the reduce-scatter sums. In index
  // mode the kernel adds into the copy's rows, and index_add_ moves them here.
  s.dk_all.assign(static_cast<std::size_t>(t_all * k_row), 0.0f);
  s.dv_all.assign(static_cast<std::size_t>(t_all * v_row), 0.0f);
  const void* kp = s.k_all.ptr();
  const void* vp = s.v_all.ptr();
  float* dkp = s.dk_all.data();
  float* dvp = s.dv_all.data();
  int64_t total_k = t_all;
  const auto n_idx = static_cast<int64_t>(s.copy_index.size());
  if (s.indexed()) {
    s.dkx.assign(static_cast<std::size_t>(n_idx * k_row), 0.0f);
    s.dvx.assign(static_cast<std::size_t>(n_idx * v_row), 0.0f);
    kp = s.kx.data();
    vp = s.vx.data();
    dkp = s.dkx.data();
    dvp = s.dvx.data();
    total_k = n_idx;
  }
  attention_backward({.q = s.q.ptr(), .q_row_stride = q_row, .q_head_stride = c.head_dim_qk,
                      .k = kp, .k_row_stride = k_row, .k_head_stride = c.head_dim_qk,
                      .v = vp, .v_row_stride = v_row, .v_head_stride = c.head_dim_v,
                      .out = s.out.ptr(), .out_row_stride = o_row, .out_head_stride = c.head_dim_v,
                      .lse = s.lse.data(),
                      .dout = a.dout, .dout_row_stride = o_row, .dout_head_stride = c.head_dim_v,
                      .dq = a.dq, .dq_row_stride = q_row, .dq_head_stride = c.head_dim_qk,
                      .grad_mode = GradMode::accumulate, .dk_accum = dkp, .dv_accum = dvp,
                      .total_q = plan.local_tokens, .total_k = total_k,
                      .num_heads_q = c.num_heads_q, .num_heads_k = c.num_heads_k,
                      .head_dim_qk = c.head_dim_qk, .head_dim_v = c.head_dim_v,
                      .dtype = c.dtype, .mask = c.mask, .softmax_scale = c.softmax_scale,
                      .dropout_p = c.dropout_p, .seed = c.seed, .work = &s.work,
                      .num_threads = c.num_threads, .path = c.path});
  for (int64_t i = 0; i < plan.local_tokens; ++i)  // padding rows: the kernel leaves them
    if (plan.real_token_index[i] < 0) std::memset(static_cast<std::byte*>(a.dq) + i * q_row * es, 0, q_row * es);
  if (s.indexed()) {
    // index_add_, in index order: deterministic.
    for (int64_t i = 0; i < n_idx; ++i) {
      const int64_t g = s.copy_index[i];
      for (int64_t e = 0; e < k_row; ++e) s.dk_all[g * k_row + e] += s.dkx[i * k_row + e];
      for (int64_t e = 0; e < v_row; ++e) s.dv_all[g * v_row + e] += s.dvx[i * v_row + e];
    }
  }
  s.stats.compute_s += seconds_since(t0);

  t0 = Clock::now();
  s.dk_loc.resize(s.k_elems());
  s.dv_loc.resize(s.v_elems());
  s.comm.reduce_scatter_sum(s.dk_all, s.dk_loc);
  s.comm.reduce_scatter_sum(s.dv_all, s.dv_loc);
  s.stats.comm_s += seconds_since(t0);

  t0 = Clock::now();
  from_float(s.dk_loc.data(), s.dk_loc.size(), c.dtype, a.dk);
  from_float(s.dv_loc.data(), s.dv_loc.size(), c.dtype, a.dv);
  s.stats.compute_s += seconds_since(t0);
  s.note_peak();
}

const CpAttnConfig& CpAttention::config() const { return s_->cfg; }
const RankPlan& CpAttention::plan() const {
  CPATTN_CHECK(s_->plan != nullptr, "plan(): no forward has run yet");
  return *s_->plan;
}
const CpStats& CpAttention::stats() const { return s_->stats; }
const PlanCache& CpAttention::plan_cache() const { return s_->cache; }
void CpAttention::reset_stats() {
  const int64_t f = s_->stats.forward_calls, b = s_->stats.backward_calls;
  s_->stats = CpStats{};
  s_->stats.forward_calls = f;  // the counters are part of the agreement: never reset
  s_->stats.backward_calls = b;
}

}  // namespace cpattn
