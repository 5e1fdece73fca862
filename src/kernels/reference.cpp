// Reference attention, llm.c style: readable top to bottom. Acc is double (ground truth) or
// float (the naive same-precision baseline).
#include "common.hpp"

#include <cpattn/reference.hpp>

#include <cmath>
#include <limits>
#include <vector>

namespace cpattn {
namespace {

using kernels::load_elem;
using kernels::store_elem;

// One visible key of a query row: its k/v row, its score and its dropout factor.
template <class Acc>
struct Visible {
  int64_t row;
  Acc s;     // scale * q.k, then P
  Acc keep;  // 1 / (1 - p) if kept, 0 if dropped (1 without dropout)
};

// For query row at position qp of task t, head h: the visible keys with scores, and lse.
// Returns lse (-inf if no key is visible).
template <class Acc, class P>
Acc scores(const P& p, const AttnTask& t, int h, int64_t qrow, int64_t qp,
           std::vector<Visible<Acc>>& vis) {
  const int hk = h / (p.num_heads_q / p.num_heads_k);
  const Acc scale = static_cast<Acc>(kernels::resolve_scale(p.softmax_scale, p.head_dim_qk));
  const uint32_t thr = kernels::dropout_threshold(p.dropout_p);
  const uint64_t rkey = kernels::dropout_row_key(p.seed, h, t.doc, qp);
  const Acc inv_keep = Acc(1) / (Acc(1) - static_cast<Acc>(p.dropout_p));
  vis.clear();
  for (int64_t r = t.run_begin; r < t.run_end; ++r) {
    const KeyRun& run = p.work->runs[r];
    for (int64_t j = 0; j < run.len; ++j) {
      const int64_t kp = run.pos + j, krow = run.row + j;
      if (p.mask == MaskType::causal && kp > qp) break;
      Acc dot = 0;  // q_i . k_j over head_dim_qk
      for (int d = 0; d < p.head_dim_qk; ++d)
        dot += static_cast<Acc>(load_elem(p.q, p.dtype, qrow * p.q_row_stride + h * p.q_head_stride + d)) *
               static_cast<Acc>(load_elem(p.k, p.dtype, krow * p.k_row_stride + hk * p.k_head_stride + d));
      Acc keep = 1;
      if (p.dropout_p > 0.0f) keep = kernels::dropout_keep_row(rkey, kp, thr) ? inv_keep : Acc(0);
      vis.push_back({krow, scale * dot, keep});
    }
  }
  if (vis.empty()) return -std::numeric_limits<Acc>::infinity();
  Acc mx = vis[0].s;
  for (const auto& x : vis) mx = std::max(mx, x.s);
  Acc sum = 0;
  for (const auto& x : vis) sum += std::exp(x.s - mx);
  return mx + std::log(sum);
}

template <class Acc>
void forward_impl(const AttnFwdParams& p) {
  const int group = p.num_heads_q / p.num_heads_k;
  std::vector<Visible<Acc>> vis;
  std::vector<Acc> o(p.head_dim_v);
  for (const AttnTask& t : p.work->tasks)
    for (int h = 0; h < p.num_heads_q; ++h)
      for (int64_t i = 0; i < t.q_len; ++i) {
        const int64_t qrow = t.q_row + i;
        const Acc lse = scores<Acc>(p, t, h, qrow, t.q_pos + i, vis);
        // out_i = sum_j keep_j * exp(S_ij - lse_i) v_j          [head_dim_v]
        for (auto& x : o) x = 0;
        for (const auto& x : vis) {
          const Acc pij = std::exp(x.s - lse) * x.keep;
          for (int d = 0; d < p.head_dim_v; ++d)
            o[d] += pij * static_cast<Acc>(load_elem(
                              p.v, p.dtype, x.row * p.v_row_stride + (h / group) * p.v_head_stride + d));
        }
        for (int d = 0; d < p.head_dim_v; ++d)
          store_elem(p.out, p.dtype, qrow * p.out_row_stride + h * p.out_head_stride + d,
                     static_cast<float>(o[d]));
        p.lse[qrow * p.num_heads_q + h] = static_cast<float>(lse);
      }
}

template <class Acc>
void backward_impl(const AttnBwdParams& p) {
  const int group = p.num_heads_q / p.num_heads_k;
  const int dqk = p.head_dim_qk, dv = p.head_dim_v, hk_n = p.num_heads_k;
  const Acc scale = static_cast<Acc>(kernels::resolve_scale(p.softmax_scale, p.head_dim_qk));
  // dK, dV accumulate over every task and every query head of a group.
  std::vector<Acc> dk(static_cast<size_t>(p.total_k) * hk_n * dqk, Acc(0));  // [total_k, Hkv, Dqk]
  std::vector<Acc> dvv(static_cast<size_t>(p.total_k) * hk_n * dv, Acc(0));  // [total_k, Hkv, Dv]
  std::vector<Visible<Acc>> vis;
  std::vector<Acc> dq(dqk), dout(dv);
  auto Q = [&](int64_t row, int h, int d) {
    return static_cast<Acc>(load_elem(p.q, p.dtype, row * p.q_row_stride + h * p.q_head_stride + d));
  };
  auto K = [&](int64_t row, int hk, int d) {
    return static_cast<Acc>(load_elem(p.k, p.dtype, row * p.k_row_stride + hk * p.k_head_stride + d));
  };
  auto V = [&](int64_t row, int hk, int d) {
    return static_cast<Acc>(load_elem(p.v, p.dtype, row * p.v_row_stride + hk * p.v_head_stride + d));
  };
  for (const AttnTask& t : p.work->tasks)
    for (int h = 0; h < p.num_heads_q; ++h) {
      const int hk = h / group;
      for (int64_t i = 0; i < t.q_len; ++i) {
        const int64_t qrow = t.q_row + i;
        scores<Acc>(p, t, h, qrow, t.q_pos + i, vis);
        const Acc lse = static_cast<Acc>(p.lse[qrow * p.num_heads_q + h]);
        // delta_i = dout_i . out_i
        Acc delta = 0;
        for (int d = 0; d < dv; ++d) {
          dout[d] = static_cast<Acc>(load_elem(p.dout, p.dtype, qrow * p.dout_row_stride + h * p.dout_head_stride + d));
          delta += dout[d] * static_cast<Acc>(load_elem(p.out, p.dtype, qrow * p.out_row_stride + h * p.out_head_stride + d));
        }
        for (auto& x : dq) x = 0;
        for (const auto& x : vis) {
          const Acc pij = std::exp(x.s - lse);
          // dv_j += keep * P_ij dout_i;  dP_ij = keep * dout_i . v_j
          Acc dp = 0;
          for (int d = 0; d < dv; ++d) {
            dvv[(x.row * hk_n + hk) * dv + d] += x.keep * pij * dout[d];
            dp += dout[d] * V(x.row, hk, d);
          }
          const Acc ds = pij * (x.keep * dp - delta);
          // dq_i += s dS_ij k_j;  dk_j += s dS_ij q_i
          for (int d = 0; d < dqk; ++d) {
            dq[d] += scale * ds * K(x.row, hk, d);
            dk[(x.row * hk_n + hk) * dqk + d] += scale * ds * Q(qrow, h, d);
          }
        }
        for (int d = 0; d < dqk; ++d)
          store_elem(p.dq, p.dtype, qrow * p.dq_row_stride + h * p.dq_head_stride + d,
                     static_cast<float>(dq[d]));
      }
    }
  for (int64_t r = 0; r < p.total_k; ++r)
    for (int hk = 0; hk < hk_n; ++hk) {
      for (int d = 0; d < dqk; ++d) {
        const float g = static_cast<float>(dk[(r * hk_n + hk) * dqk + d]);
        if (p.grad_mode == GradMode::write)
          store_elem(p.dk, p.dtype, r * p.dk_row_stride + hk * p.dk_head_stride + d, g);
        else
          p.dk_accum[(r * hk_n + hk) * dqk + d] += g;
      }
      for (int d = 0; d < dv; ++d) {
        const float g = static_cast<float>(dvv[(r * hk_n + hk) * dv + d]);
        if (p.grad_mode == GradMode::write)
          store_elem(p.dv, p.dtype, r * p.dv_row_stride + hk * p.dv_head_stride + d, g);
        else
          p.dv_accum[(r * hk_n + hk) * dv + d] += g;
      }
    }
}

}  // namespace

void attention_forward_reference(const AttnFwdParams& p, RefAccum accum) {
  kernels::validate(p);
  if (accum == RefAccum::f64) forward_impl<double>(p);
  else forward_impl<float>(p);
}

void attention_backward_reference(const AttnBwdParams& p, RefAccum accum) {
  kernels::validate(p);
  if (accum == RefAccum::f64) backward_impl<double>(p);
  else backward_impl<float>(p);
}

}  // namespace cpattn
