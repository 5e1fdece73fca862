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
  WorkList work;  // plan's tasks for cfg.kv_mode, without padding
  bool have_forward = false;
  // Saved by forward for backward (DESIGN.md 7): local q, out, lse and the gathered K/V.
  Bytes q, out, k_all, v_all;
  std::vector<float> lse;

  State(Communicator& c, const CpAttnConfig& config)
      : comm(c), cfg(config), cache(config.plan_cache_capacity) {}

  int64_t t_loc() const { return plan->local_tokens; }
  std::size_t esize() const { return dtype_size(cfg.dtype); }
  std::size_t q_elems() const { return static_cast<std::size_t>(t_loc()) * cfg.num_heads_q * cfg.head_dim_qk; }
  std::size_t o_elems() const { return static_cast<std::size_t>(t_loc()) * cfg.num_heads_q * cfg.head_dim_v; }
  std::size_t k_elems() const { return static_cast<std::size_t>(t_loc()) * cfg.num_heads_k * cfg.head_dim_qk; }
  std::size_t v_elems() const { return static_cast<std::size_t>(t_loc()) * cfg.num_heads_k * cfg.head_dim_v; }

  // Every rank learns every rank's local error, and all throw the same message; then the
  // ranks agree on the fingerprint. Both before any payload moves. A rank with an error
  // still takes part, so that the others fail with its message instead of waiting; the
  // fingerprint (which reads the plan) is reached only when no rank has an error.
  void agree_or_throw(const std::string& local_error, const char* what, uint64_t boundaries_hash,
                      int64_t local_tokens, int64_t phase) {
    const auto t0 = Clock::now();
    const std::vector<int64_t> lens = comm.all_gather_counts(static_cast<int64_t>(local_error.size()));
    int64_t total = 0;
    for (const int64_t n : lens) total += n;
    if (total > 0) {
      std::vector<std::byte> all(static_cast<std::size_t>(total));
      comm.all_gather_v<std::byte>(std::as_bytes(std::span(local_error)), lens, all);
      std::string msg = std::string(what) + " rejected its arguments:";
      int64_t at = 0;
      for (std::size_t r = 0; r < lens.size(); ++r) {
        if (lens[r] > 0)
          msg += " [rank " + std::to_string(r) + "] " +
                 std::string(reinterpret_cast<const char*>(all.data()) + at, static_cast<std::size_t>(lens[r]));
        at += lens[r];
      }
      stats.comm_s += seconds_since(t0);
      throw Error(msg);
    }
    Fingerprint fp;
    fp.add("phase (1 forward, 2 backward)", phase)
        .add("forward calls", stats.forward_calls)
        .add("backward calls", stats.backward_calls)
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
    agree(comm, fp, what);
    stats.comm_s += seconds_since(t0);
  }

  void note_peak() {
    const std::size_t bytes = q.data.capacity() + out.data.capacity() + k_all.data.capacity() +
                              v_all.data.capacity() + lse.capacity() * sizeof(float);
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

CpAttention::~CpAttention() = default;

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
  } catch (const Error& e) {
    err = e.message();
  }
  s.agree_or_throw(err, "CP attention", hash, a.local_tokens, 1);

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
  const int64_t k_row = int64_t{c.num_heads_k} * c.head_dim_qk, v_row = int64_t{c.num_heads_k} * c.head_dim_v;
  const int64_t q_row = int64_t{c.num_heads_q} * c.head_dim_qk, o_row = int64_t{c.num_heads_q} * c.head_dim_v;
  // The keys the kernel reads: the gathered buffer in place (runs) or its index_select copy.
  Bytes kx, vx;
  const void* kp = s.k_all.ptr();
  const void* vp = s.v_all.ptr();
  int64_t total_k = cp * plan.local_tokens;
  if (c.kv_mode == KvMode::index) {
    const auto n = static_cast<int64_t>(plan.kv_gather_index.size());
    kx.resize(static_cast<std::size_t>(n * k_row) * es);
    vx.resize(static_cast<std::size_t>(n * v_row) * es);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t g = plan.kv_gather_index[i];
      std::memcpy(kx.ptr() + i * k_row * es, s.k_all.ptr() + g * k_row * es, k_row * es);
      std::memcpy(vx.ptr() + i * v_row * es, s.v_all.ptr() + g * v_row * es, v_row * es);
    }
    kp = kx.ptr();
    vp = vx.ptr();
    total_k = n;
  }
  s.work = without_padding(plan, c.kv_mode == KvMode::index ? plan.work_indexed : plan.work);

  s.lse.assign(static_cast<std::size_t>(plan.local_tokens) * c.num_heads_q,
               -std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < plan.local_tokens; ++i)  // padding rows: the kernel leaves them
    if (plan.real_token_index[i] < 0) std::memset(static_cast<std::byte*>(a.out) + i * o_row * es, 0, o_row * es);
  attention_forward({.q = a.q, .q_row_stride = q_row, .q_head_stride = c.head_dim_qk,
                     .k = kp, .k_row_stride = k_row, .k_head_stride = c.head_dim_qk,
                     .v = vp, .v_row_stride = v_row, .v_head_stride = c.head_dim_v,
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
  }
  s.agree_or_throw(err, "CP attention", s.plan ? hash_boundaries(s.plan->cu_seqlens) : 0,
                   s.plan ? s.plan->local_tokens : 0, 2);
  s.have_forward = false;

  const RankPlan& plan = *s.plan;
  const int cp = s.comm.size();
  const std::size_t es = s.esize();
  auto t0 = Clock::now();
  const int64_t k_row = int64_t{c.num_heads_k} * c.head_dim_qk, v_row = int64_t{c.num_heads_k} * c.head_dim_v;
  const int64_t q_row = int64_t{c.num_heads_q} * c.head_dim_qk, o_row = int64_t{c.num_heads_q} * c.head_dim_v;
  const int64_t t_all = cp * plan.local_tokens;
  // dK/dV of every gathered row, fp32, rank-major: what the reduce-scatter sums.
  std::vector<float> dk_all(static_cast<std::size_t>(t_all * k_row), 0.0f);
  std::vector<float> dv_all(static_cast<std::size_t>(t_all * v_row), 0.0f);
  Bytes kx, vx;
  std::vector<float> dkx, dvx;
  const void* kp = s.k_all.ptr();
  const void* vp = s.v_all.ptr();
  float* dkp = dk_all.data();
  float* dvp = dv_all.data();
  int64_t total_k = t_all;
  const auto n_idx = static_cast<int64_t>(plan.kv_gather_index.size());
  if (c.kv_mode == KvMode::index) {
    kx.resize(static_cast<std::size_t>(n_idx * k_row) * es);
    vx.resize(static_cast<std::size_t>(n_idx * v_row) * es);
    for (int64_t i = 0; i < n_idx; ++i) {
      const int64_t g = plan.kv_gather_index[i];
      std::memcpy(kx.ptr() + i * k_row * es, s.k_all.ptr() + g * k_row * es, k_row * es);
      std::memcpy(vx.ptr() + i * v_row * es, s.v_all.ptr() + g * v_row * es, v_row * es);
    }
    dkx.assign(static_cast<std::size_t>(n_idx * k_row), 0.0f);
    dvx.assign(static_cast<std::size_t>(n_idx * v_row), 0.0f);
    kp = kx.ptr();
    vp = vx.ptr();
    dkp = dkx.data();
    dvp = dvx.data();
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
  if (c.kv_mode == KvMode::index) {
    // index_add_, in index order: deterministic.
    for (int64_t i = 0; i < n_idx; ++i) {
      const int64_t g = plan.kv_gather_index[i];
      for (int64_t e = 0; e < k_row; ++e) dk_all[g * k_row + e] += dkx[i * k_row + e];
      for (int64_t e = 0; e < v_row; ++e) dv_all[g * v_row + e] += dvx[i * v_row + e];
    }
  }
  s.stats.compute_s += seconds_since(t0);

  t0 = Clock::now();
  std::vector<float> dk_loc(s.k_elems()), dv_loc(s.v_elems());
  s.comm.reduce_scatter_sum(dk_all, dk_loc);
  s.comm.reduce_scatter_sum(dv_all, dv_loc);
  s.stats.comm_s += seconds_since(t0);

  t0 = Clock::now();
  from_float(dk_loc.data(), dk_loc.size(), c.dtype, a.dk);
  from_float(dv_loc.data(), dv_loc.size(), c.dtype, a.dv);
  s.stats.compute_s += seconds_since(t0);
  const std::size_t scratch = (dk_all.capacity() + dv_all.capacity() + dkx.capacity() + dvx.capacity() +
                               dk_loc.capacity() + dv_loc.capacity()) * sizeof(float) +
                              kx.data.capacity() + vx.data.capacity();
  s.note_peak();
  s.stats.peak_buffer_bytes = std::max(s.stats.peak_buffer_bytes,
                                       scratch + s.q.data.capacity() + s.out.data.capacity() +
                                           s.k_all.data.capacity() + s.v_all.data.capacity());
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
