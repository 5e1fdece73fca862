// Argument checks of attention_forward/backward and their references: everything is checked
// here, before any work, and the kernels trust it.
#include "common.hpp"

#include <cpattn/error.hpp>

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

namespace cpattn::kernels {
namespace {

struct Shape {
  int64_t total_q, total_k;
  int hq, hk, dqk, dv;
  float dropout_p;
  int num_threads;
  KernelPath path;
};

void check_shape(const char* fn, const Shape& s) {
  CPATTN_CHECK(s.total_q >= 0 && s.total_k >= 0, fn, ": total_q and total_k must be >= 0, got ",
               s.total_q, " and ", s.total_k);
  CPATTN_CHECK(s.hq >= 1 && s.hk >= 1, fn, ": num_heads_q and num_heads_k must be >= 1, got ",
               s.hq, " and ", s.hk);
  CPATTN_CHECK(s.hq % s.hk == 0, fn, ": num_heads_q must be a multiple of num_heads_k, got ",
               s.hq, " and ", s.hk);
  CPATTN_CHECK(s.dqk >= 1 && s.dqk <= 256, fn, ": head_dim_qk must be in [1, 256], got ", s.dqk);
  CPATTN_CHECK(s.dv >= 1 && s.dv <= 256, fn, ": head_dim_v must be in [1, 256], got ", s.dv);
  CPATTN_CHECK(s.dropout_p >= 0.0f && s.dropout_p < 1.0f, fn,
               ": dropout_p must be in [0, 1), got ", s.dropout_p);
  CPATTN_CHECK(s.num_threads >= 1, fn, ": num_threads must be >= 1, got ", s.num_threads);
  CPATTN_CHECK(s.path != KernelPath::amx, fn,
               ": kernel path amx is not implemented (no AMX path is built; use automatic, "
               "portable, avx2 or avx512)");
  CPATTN_CHECK(kernel_path_supported(s.path), fn, ": kernel path ", to_string(s.path),
               " is not supported by this CPU (best is ", to_string(best_kernel_path()), ")");
}

// A THD tensor [rows, heads, dim] with head_dim contiguous: strides must keep heads and rows
// apart (no two (row, head) pairs share an element).
void check_tensor(const char* fn, const char* name, const void* ptr, int64_t row_stride,
                  int64_t head_stride, int heads, int dim, int64_t rows) {
  CPATTN_CHECK(ptr != nullptr, fn, ": ", name, " must not be null");
  CPATTN_CHECK(head_stride >= dim, fn, ": ", name, "_head_stride must be >= head dim ", dim,
               ", got ", head_stride);
  CPATTN_CHECK(rows <= 1 || row_stride >= head_stride * (heads - 1) + dim, fn, ": ", name,
               "_row_stride must be >= ", head_stride * (heads - 1) + dim, " (", heads,
               " heads of stride ", head_stride, ", dim ", dim, "), got ", row_stride);
}

void check_work(const char* fn, const WorkList* w, int64_t total_q, int64_t total_k) {
  CPATTN_CHECK(w != nullptr, fn, ": work must not be null");
  const int64_t nruns = static_cast<int64_t>(w->runs.size());
  for (int64_t r = 0; r < nruns; ++r) {
    const KeyRun& run = w->runs[r];
    CPATTN_CHECK(run.len >= 1, fn, ": run ", r, " has len ", run.len, ", must be >= 1");
    CPATTN_CHECK(run.row >= 0 && run.row <= total_k - run.len, fn, ": run ", r, " rows [",
                 run.row, ", ", run.row + run.len, ") are outside k's rows [0, ", total_k, ")");
    CPATTN_CHECK(run.pos >= 0, fn, ": run ", r, " has pos ", run.pos, ", must be >= 0");
  }
  std::vector<std::pair<int64_t, int64_t>> qranges;
  qranges.reserve(w->tasks.size());
  for (size_t t = 0; t < w->tasks.size(); ++t) {
    const AttnTask& a = w->tasks[t];
    CPATTN_CHECK(a.q_len >= 1, fn, ": task ", t, " has q_len ", a.q_len, ", must be >= 1");
    CPATTN_CHECK(a.q_row >= 0 && a.q_row <= total_q - a.q_len, fn, ": task ", t,
                 " query rows [", a.q_row, ", ", a.q_row + a.q_len,
                 ") are outside q's rows [0, ", total_q, ")");
    CPATTN_CHECK(a.q_pos >= 0, fn, ": task ", t, " has q_pos ", a.q_pos, ", must be >= 0");
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

// What forward and backward share: shapes, scale, q, k, v and out (the fields have the same
// names in both parameter structs).
template <class P>
void check_inputs(const char* fn, const P& p) {
  check_shape(fn, {p.total_q, p.total_k, p.num_heads_q, p.num_heads_k, p.head_dim_qk,
                   p.head_dim_v, p.dropout_p, p.num_threads, p.path});
  CPATTN_CHECK(std::isfinite(p.softmax_scale), fn, ": softmax_scale must be finite, got ",
               p.softmax_scale);
  check_tensor(fn, "q", p.q, p.q_row_stride, p.q_head_stride, p.num_heads_q, p.head_dim_qk, p.total_q);
  check_tensor(fn, "k", p.k, p.k_row_stride, p.k_head_stride, p.num_heads_k, p.head_dim_qk, p.total_k);
  check_tensor(fn, "v", p.v, p.v_row_stride, p.v_head_stride, p.num_heads_k, p.head_dim_v, p.total_k);
  check_tensor(fn, "out", p.out, p.out_row_stride, p.out_head_stride, p.num_heads_q, p.head_dim_v,
               p.total_q);
}

}  // namespace

void validate(const AttnFwdParams& p) {
  const char* fn = "attention_forward";
  check_inputs(fn, p);
  CPATTN_CHECK(p.lse != nullptr, fn, ": lse must not be null");
  check_work(fn, p.work, p.total_q, p.total_k);
}

void validate(const AttnBwdParams& p) {
  const char* fn = "attention_backward";
  check_inputs(fn, p);
  check_tensor(fn, "dout", p.dout, p.dout_row_stride, p.dout_head_stride, p.num_heads_q,
               p.head_dim_v, p.total_q);
  check_tensor(fn, "dq", p.dq, p.dq_row_stride, p.dq_head_stride, p.num_heads_q, p.head_dim_qk,
               p.total_q);
  CPATTN_CHECK(p.lse != nullptr, fn, ": lse must not be null");
  if (p.grad_mode == GradMode::write) {
    check_tensor(fn, "dk", p.dk, p.dk_row_stride, p.dk_head_stride, p.num_heads_k, p.head_dim_qk,
                 p.total_k);
    check_tensor(fn, "dv", p.dv, p.dv_row_stride, p.dv_head_stride, p.num_heads_k, p.head_dim_v,
                 p.total_k);
  } else {
    CPATTN_CHECK(p.dk_accum != nullptr && p.dv_accum != nullptr, fn,
                 ": grad_mode accumulate needs dk_accum and dv_accum, got dk_accum ",
                 static_cast<const void*>(p.dk_accum), ", dv_accum ",
                 static_cast<const void*>(p.dv_accum));
  }
  check_work(fn, p.work, p.total_q, p.total_k);
}

}  // namespace cpattn::kernels
