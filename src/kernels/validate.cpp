// Argument checks of attention_forward/backward and their references: everything is checked
// here, before any work, and the kernels trust it.
#include "common.hpp"

#include <cpattn/error.hpp>
#include <cpattn/layout.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace cpattn::kernels {
namespace {

void check_shape(std::string_view fn, const AttnShape& s, const AttnOptions& o) {
  CPATTN_CHECK(s.total_q >= 0 && s.total_k >= 0, fn,
               ": total_q (q.rows) and total_k (k.rows) must be >= 0, got ", s.total_q, " and ",
               s.total_k);
  CPATTN_CHECK(s.num_heads_q >= 1 && s.num_heads_k >= 1, fn,
               ": num_heads_q (q.heads) and num_heads_k (k.heads) must be >= 1, got ",
               s.num_heads_q, " and ", s.num_heads_k);
  CPATTN_CHECK(s.num_heads_q % s.num_heads_k == 0, fn,
               ": num_heads_q must be a multiple of num_heads_k, got ", s.num_heads_q, " and ",
               s.num_heads_k);
  CPATTN_CHECK(s.head_dim_qk >= 1 && s.head_dim_qk <= 256, fn,
               ": head_dim_qk (q.dim) must be in [1, 256], got ", s.head_dim_qk);
  CPATTN_CHECK(s.head_dim_v >= 1 && s.head_dim_v <= 256, fn,
               ": head_dim_v (v.dim) must be in [1, 256], got ", s.head_dim_v);
  CPATTN_CHECK(o.mask == MaskType::none || o.mask == MaskType::causal, fn, ": mask must be none or causal, got ",
               static_cast<int>(o.mask));
  CPATTN_CHECK(o.dropout_p >= 0.0f && o.dropout_p < 1.0f, fn,
               ": dropout_p must be in [0, 1), got ", o.dropout_p);
  CPATTN_CHECK(!o.softmax_scale || std::isfinite(*o.softmax_scale), fn,
               ": softmax_scale must be finite, got ", o.softmax_scale.value_or(0.0f));
  CPATTN_CHECK(o.window_size_left >= -1 && o.window_size_right >= -1, fn,
               ": window_size_left and window_size_right must be >= -1 (-1 = unbounded), got ",
               o.window_size_left, " and ", o.window_size_right);
  CPATTN_CHECK(o.window_size_left <= kMaxTokens && o.window_size_right <= kMaxTokens, fn,
               ": window_size_left and window_size_right must be <= 2^48 (kMaxTokens; use -1 for unbounded), got ",
               o.window_size_left, " and ", o.window_size_right);
  CPATTN_CHECK(std::isfinite(o.softcap) && o.softcap >= 0.0f, fn,
               ": softcap must be finite and >= 0 (0 = off), got ", o.softcap);
  if (o.alibi_slopes)
    for (int h = 0; h < s.num_heads_q; ++h)
      CPATTN_CHECK(std::isfinite(o.alibi_slopes[h]), fn, ": alibi_slopes[", h,
                   "] must be finite, got ", o.alibi_slopes[h]);
  CPATTN_CHECK(o.dropout_head_offset >= 0 && o.dropout_head_offset <= std::numeric_limits<int>::max() - s.num_heads_q,
               fn, ": dropout_head_offset must be in [0, INT_MAX - num_heads_q] (head + offset is an int), got ",
               o.dropout_head_offset);
  CPATTN_CHECK(o.num_threads >= 1, fn, ": num_threads must be >= 1, got ", o.num_threads);
  CPATTN_CHECK(kernel_path_supported(o.path), fn, ": kernel path ", to_string(o.path),
               " is not supported by this CPU (best is ", to_string(best_kernel_path()), ")");
  if (o.path == KernelPath::automatic) {  // CPATTN_KERNEL_PATH, which automatic follows
    try {
      (void)resolve_kernel_path(o.path, DType::f32);
    } catch (const Error& e) {
      throw Error(std::string(fn) + ": " + e.message());
    }
  }
}

// The size a view must have in one of its extents, and the user-facing name of that size.
struct Want {
  int64_t value;
  const char* name;  // e.g. "total_q = q.rows"
};

// A THD view [rows, heads, dim] with head_dim contiguous: not null, the shape the call's
// sizes give it, and strides (row_step(), head_step(); 0 = contiguous) that keep heads and rows
// apart (no two (row, head) pairs share an element).
void check_view(const char* fn, const char* name, const ConstTensorView& t, Want rows,
                Want heads, Want dim) {
  CPATTN_CHECK(t.addressable(), fn, ": ", name, " must not be null");
  CPATTN_CHECK(t.rows == rows.value, fn, ": ", name, ".rows must equal ", rows.name, " = ",
               rows.value, ", got ", t.rows);
  CPATTN_CHECK(t.heads == heads.value, fn, ": ", name, ".heads must equal ", heads.name, " = ",
               heads.value, ", got ", t.heads);
  CPATTN_CHECK(t.dim == dim.value, fn, ": ", name, ".dim must equal ", dim.name, " = ",
               dim.value, ", got ", t.dim);
  const int64_t hs = t.head_step();
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  CPATTN_CHECK(hs >= t.dim, fn, ": ", name, ".head_stride must be >= head dim ", t.dim,
               " (or 0: contiguous), got ", hs);
  // Every element's offset fits int64 (a huge stride wrapped the row check's sum and passed it),
  // and so does the default row step, heads x head_stride, read next.
  CPATTN_CHECK(hs <= kMax / t.heads, fn, ": ", name, ".head_stride ", hs, " puts the last of ", t.heads,
               " heads past int64's offsets");
  const int64_t rs = t.row_step();
  const int64_t row_span = hs * (t.heads - 1) + t.dim;  // <= heads x hs
  CPATTN_CHECK(t.rows <= 1 || rs >= row_span, fn, ": ", name, ".row_stride must be >= ", row_span, " (", t.heads,
               " heads of stride ", hs, ", dim ", t.dim, ") or 0 (contiguous), got ", rs);
  CPATTN_CHECK(t.rows <= 1 || rs <= (kMax - row_span) / (t.rows - 1), fn, ": ", name, ".row_stride ", rs,
               " puts the last of ", t.rows, " rows past int64's offsets");
}

void check_dtype(const char* fn, const char* name, const ConstTensorView& t, DType want) {
  CPATTN_CHECK(t.dtype == want, fn, ": ", name, " has dtype ", to_string(t.dtype),
               " but q has ", to_string(want), " (every tensor has q's storage dtype)");
}

void check_work(const char* fn, const WorkList* w, int64_t total_q, int64_t total_k) {
  CPATTN_CHECK(w != nullptr, fn, ": work must not be null");
  const int64_t nruns = static_cast<int64_t>(w->runs.size());
  for (int64_t r = 0; r < nruns; ++r) {
    const KeyRun& run = w->runs[r];
    CPATTN_CHECK(run.len >= 1, fn, ": run ", r, " has len ", run.len, ", must be >= 1");
    CPATTN_CHECK(run.row >= 0 && run.row <= total_k - run.len, fn, ": run ", r, " rows [",
                 run.row, ", ", run.row + run.len, ") are outside k's rows [0, ", total_k, ")");
    // (Positions up to 2^48, kMaxTokens, as windows: pos + len and the masks' differences of
    // positions stay far inside int64.)
    CPATTN_CHECK(run.pos >= 0 && run.pos <= kMaxTokens - run.len, fn, ": run ", r, " positions [", run.pos, ", +",
                 run.len, ") must be in [0, 2^48]");
  }
  std::vector<std::pair<int64_t, int64_t>> qranges;
  qranges.reserve(w->tasks.size());
  for (size_t t = 0; t < w->tasks.size(); ++t) {
    const AttnTask& a = w->tasks[t];
    CPATTN_CHECK(a.q_len >= 1, fn, ": task ", t, " has q_len ", a.q_len, ", must be >= 1");
    CPATTN_CHECK(a.q_row >= 0 && a.q_row <= total_q - a.q_len, fn, ": task ", t,
                 " query rows [", a.q_row, ", ", a.q_row + a.q_len,
                 ") are outside q's rows [0, ", total_q, ")");
    CPATTN_CHECK(a.q_pos >= 0 && a.q_pos <= kMaxTokens - a.q_len, fn, ": task ", t, " positions [", a.q_pos, ", +",
                 a.q_len, ") must be in [0, 2^48]");
    CPATTN_CHECK(a.doc >= 0, fn, ": task ", t, " has doc ", a.doc, ", must be >= 0");
    CPATTN_CHECK(a.run_begin >= 0 && a.run_begin <= a.run_end && a.run_end <= nruns, fn,
                 ": task ", t, " runs [", a.run_begin, ", ", a.run_end,
                 ") must satisfy 0 <= run_begin <= run_end <= runs.size() = ", nruns);
    for (int64_t r = a.run_begin + 1; r < a.run_end; ++r)
      CPATTN_CHECK(w->runs[r - 1].pos + w->runs[r - 1].len <= w->runs[r].pos, fn, ": task ", t,
                   " runs ", r - 1, " and ", r, " must be in increasing position order "
                   "without overlap, got positions [", w->runs[r - 1].pos, ", ",
                   w->runs[r - 1].pos + w->runs[r - 1].len, ") then [", w->runs[r].pos, ", ",
                   w->runs[r].pos + w->runs[r].len, ")");
    qranges.emplace_back(a.q_row, a.q_row + a.q_len);
  }
  std::sort(qranges.begin(), qranges.end());
  for (size_t i = 1; i < qranges.size(); ++i)
    CPATTN_CHECK(qranges[i - 1].second <= qranges[i].first, fn,
                 ": tasks' query rows must not overlap, got [", qranges[i - 1].first, ", ",
                 qranges[i - 1].second, ") and [", qranges[i].first, ", ", qranges[i].second, ")");
}

// What forward and backward share: the shape (of q, k, v, checked against each other), the
// options, the dtype and the views q, k, v.
void check_inputs(const char* fn, const AttnInputs& in) {
  CPATTN_CHECK(in.q.addressable(), fn, ": q must not be null");
  CPATTN_CHECK(in.k.addressable(), fn, ": k must not be null");
  CPATTN_CHECK(in.v.addressable(), fn, ": v must not be null");
  const AttnShape s = in.shape();
  check_shape(fn, s, in.options);
  const DType dt = in.dtype();
  CPATTN_CHECK(is_valid(dt), fn, ": q's dtype must be fp32, fp16 or bf16, got ", static_cast<int>(dt));
  check_dtype(fn, "k", in.k, dt);
  check_dtype(fn, "v", in.v, dt);
  check_view(fn, "q", in.q, {s.total_q, "total_q = q.rows"},
             {s.num_heads_q, "num_heads_q = q.heads"}, {s.head_dim_qk, "head_dim_qk = q.dim"});
  check_view(fn, "k", in.k, {s.total_k, "total_k = k.rows"},
             {s.num_heads_k, "num_heads_k = k.heads"}, {s.head_dim_qk, "head_dim_qk = q.dim"});
  check_view(fn, "v", in.v, {s.total_k, "total_k = k.rows"},
             {s.num_heads_k, "num_heads_k = k.heads"}, {s.head_dim_v, "head_dim_v = v.dim"});
  if (in.key_rows) {  // a permutation: every row of k, v (dk, dv) read (written) once
    std::vector<char> seen(static_cast<size_t>(s.total_k), 0);
    for (int64_t r = 0; r < s.total_k; ++r) {
      const int64_t to = in.key_rows[r];
      CPATTN_CHECK(to >= 0 && to < s.total_k, fn, ": key_rows[", r, "] = ", to, " is outside k's rows [0, ",
                   s.total_k, ")");
      CPATTN_CHECK(!seen[static_cast<size_t>(to)], fn, ": key_rows must be a permutation of [0, total_k = ",
                   s.total_k, "), row ", to, " appears twice (again at key_rows[", r, "])");
      seen[static_cast<size_t>(to)] = 1;
    }
  }
  if (const KvPackShare* sh = in.kv_pack_share) {
    const std::size_t need = attention_kv_pack_bytes(s.total_k, s.num_heads_k, s.head_dim_qk, s.head_dim_v,
                                                     attention_kv_pack_layout(in.options.path, in.dtype()));
    CPATTN_CHECK(sh->buffer != nullptr && reinterpret_cast<std::uintptr_t>(sh->buffer) % 64 == 0, fn,
                 ": kv_pack_share.buffer must be 64-byte aligned and not null");
    CPATTN_CHECK(sh->bytes >= need, fn, ": kv_pack_share.bytes = ", sh->bytes,
                 " is less than attention_kv_pack_bytes = ", need);
    CPATTN_CHECK(sh->parts >= 1 && sh->part >= 0 && sh->part < sh->parts, fn, ": kv_pack_share.part = ", sh->part,
                 " must be in [0, parts = ", sh->parts, ")");
    CPATTN_CHECK(static_cast<bool>(sh->sync), fn, ": kv_pack_share.sync must be set");
  }
}

// A view of q's rows and heads (out, dout, dq) of head dim `dim`.
void check_q_like(const char* fn, const char* name, const AttnShape& s, const ConstTensorView& t,
                  Want dim) {
  check_view(fn, name, t, {s.total_q, "total_q = q.rows"},
             {s.num_heads_q, "num_heads_q = q.heads"}, dim);
}

}  // namespace

void validate(const AttnFwdParams& p) {
  const char* fn = "attention_forward";
  check_inputs(fn, p.in);
  const AttnShape s = p.in.shape();
  check_q_like(fn, "out", s, p.out, {s.head_dim_v, "head_dim_v = v.dim"});
  CPATTN_CHECK(p.out_mode == OutMode::write || p.out_mode == OutMode::accumulate, fn,
               ": out_mode must be write or accumulate, got ", static_cast<int>(p.out_mode));
  if (p.out_mode == OutMode::write) {
    check_dtype(fn, "out", p.out, p.in.dtype());
  } else {
    CPATTN_CHECK(p.out.dtype == DType::f32 && p.lse != nullptr, fn,
                 ": out_mode accumulate needs an fp32 out and an lse (the running result), got out ",
                 to_string(p.out.dtype), (p.lse ? "" : " and no lse"));
  }
  // lse is optional in write mode: null skips it
  check_work(fn, p.in.work, s.total_q, s.total_k);
}

void validate(const AttnBwdParams& p) {
  const char* fn = "attention_backward";
  check_inputs(fn, p.in);
  const AttnShape s = p.in.shape();
  const DType dt = p.in.dtype();
  const Want dqk{s.head_dim_qk, "head_dim_qk = q.dim"}, dv{s.head_dim_v, "head_dim_v = v.dim"};
  check_q_like(fn, "out", s, p.out, dv);
  check_q_like(fn, "dout", s, p.dout, dv);
  check_q_like(fn, "dq", s, p.dq, dqk);
  if (!p.grad_share) {
    check_view(fn, "dk", p.dk, {s.total_k, "total_k = k.rows"},
               {s.num_heads_k, "num_heads_k = k.heads"}, dqk);
    check_view(fn, "dv", p.dv, {s.total_k, "total_k = k.rows"},
               {s.num_heads_k, "num_heads_k = k.heads"}, dv);
  }
  CPATTN_CHECK(p.lse != nullptr || s.total_q == 0, fn, ": lse must not be null");
  check_dtype(fn, "out", p.out, dt);
  check_dtype(fn, "dout", p.dout, dt);
  CPATTN_CHECK(p.grad_mode == GradMode::write || p.grad_mode == GradMode::accumulate ||
                   p.grad_mode == GradMode::accumulate_all,
               fn, ": grad_mode must be write, accumulate or accumulate_all, got ", static_cast<int>(p.grad_mode));
  if (p.grad_mode == GradMode::accumulate_all)
    CPATTN_CHECK(p.dq.dtype == DType::f32, fn, ": grad_mode accumulate_all needs an fp32 dq, got ",
                 to_string(p.dq.dtype));
  else
    check_dtype(fn, "dq", p.dq, dt);
  if (p.grad_share) {  // dk and dv are not written: the buffer holds the partial sums
    CPATTN_CHECK(p.grad_mode == GradMode::write, fn, ": grad_share needs grad_mode write, got ",
                 p.grad_mode == GradMode::accumulate ? "accumulate" : "accumulate_all");
    CPATTN_CHECK(p.grad_share->buffer != nullptr && reinterpret_cast<uintptr_t>(p.grad_share->buffer) % 64 == 0, fn,
                 ": grad_share.buffer must be a 64-byte aligned, non-null pointer");
  } else if (p.grad_mode == GradMode::write) {  // the storage dtype, or fp32 (a caller's sums)
    CPATTN_CHECK(p.dk.dtype == p.dv.dtype && (p.dk.dtype == dt || p.dk.dtype == DType::f32), fn,
                 ": grad_mode write needs dk and dv both of the inputs' dtype ", to_string(dt),
                 " or both fp32, got dk ", to_string(p.dk.dtype), ", dv ", to_string(p.dv.dtype));
  } else {
    CPATTN_CHECK(p.dk.dtype == DType::f32 && p.dv.dtype == DType::f32, fn,
                 ": grad_mode accumulate and accumulate_all need fp32 dk and dv, got dk ", to_string(p.dk.dtype),
                 ", dv ", to_string(p.dv.dtype));
  }
  check_work(fn, p.in.work, s.total_q, s.total_k);
  if (p.longest_task != 0) {  // (the work list's tasks are checked above: their rows are within q)
    int64_t own = 0;
    for (const AttnTask& t : p.in.work->tasks) own = std::max(own, t.q_len);
    CPATTN_CHECK(p.longest_task >= own && p.longest_task <= s.total_q, fn,
                 ": longest_task must be 0 or between the call's longest task (", own, ") and total_q (", s.total_q,
                 "), got ", p.longest_task);
  }
  if (p.grad_share) {  // (the layout reads the work list's tasks: checked above)
    const std::size_t need = attention_grad_share_bytes(p);
    CPATTN_CHECK(p.grad_share->bytes >= need, fn, ": grad_share.bytes is ", p.grad_share->bytes,
                 ", the call needs attention_grad_share_bytes = ", need);
  }
}

}  // namespace cpattn::kernels

namespace cpattn {
void check_attention_config(const AttnShape& shape, const AttnOptions& options, std::string_view fn) {
  kernels::check_shape(fn, shape, options);
}
}  // namespace cpattn
