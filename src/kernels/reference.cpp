// Reference attention, llm.c style: readable top to bottom. Acc is double (ground truth) or
// float (the naive same-precision baseline).
#include "common.hpp"

#include <cpattn/error.hpp>
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
  Acc s;     // the score (scale * q.k, soft-capped, ALiBi-biased), then P
  Acc keep;  // 1 / (1 - p) if kept, 0 if dropped (1 without dropout)
  Acc dcap;  // d(soft-capped score) / d(scale * q.k): 1 - tanh^2 (1 without softcap)
};

// A view's elements decoded once into a dense [rows, heads, dim] array of Acc: the loops below
// read each element O(T) times, and decoding fp16/bf16 on every read was most of the time.
template <class Acc>
class Dense {
 public:
  // Row r is stored row rows[r] of t when `rows` is given (AttnInputs::key_rows).
  explicit Dense(const ConstTensorView& t, const int64_t* rows = nullptr) : heads_(t.heads), dim_(t.dim) {
    if (t.empty()) return;
    v_.resize(static_cast<size_t>(t.rows) * heads_ * dim_);
    for (int64_t r = 0; r < t.rows; ++r)
      for (int h = 0; h < heads_; ++h)
        for (int d = 0; d < dim_; ++d)
          v_[(r * heads_ + h) * dim_ + d] =
              static_cast<Acc>(load_elem(t.data, t.dtype, t.offset(rows ? rows[r] : r, h) + d));
  }
  // Element (row, head, d).
  Acc operator()(int64_t row, int head, int d) const { return v_[(row * heads_ + head) * dim_ + d]; }

 private:
  int heads_, dim_;
  std::vector<Acc> v_;
};

// The inputs every query row reads, decoded.
template <class Acc>
struct DenseInputs {
  explicit DenseInputs(const AttnInputs& in) : q(in.q), k(in.k, in.key_rows), v(in.v, in.key_rows) {}
  Dense<Acc> q, k, v;
};

// For query row at position qp of task t, head h: the visible keys with scores, and lse.
// Returns lse (-inf if no key is visible).
template <class Acc>
Acc scores(const AttnInputs& in, const DenseInputs<Acc>& x, const AttnTask& t, int h,
           int64_t qrow, int64_t qp, std::vector<Visible<Acc>>& vis) {
  const AttnOptions& o = in.options;
  const int hk = h / (in.q.heads / in.k.heads);
  const Acc scale = static_cast<Acc>(in.softmax_scale());
  const uint32_t thr = kernels::dropout_threshold(o.dropout_p);
  const uint64_t rkey = kernels::dropout_row_key(o.seed, h + o.dropout_head_offset, t.doc, qp);
  const Acc inv_keep = Acc(1) / (Acc(1) - static_cast<Acc>(o.dropout_p));
  const kernels::Visibility sees = kernels::visibility(o);  // causal and window
  const Acc cap = static_cast<Acc>(o.softcap);
  const Acc slope = o.alibi_slopes ? static_cast<Acc>(o.alibi_slopes[h]) : Acc(0);
  vis.clear();
  for (int64_t r = t.run_begin; r < t.run_end; ++r) {
    const KeyRun& run = in.work->runs[r];
    for (int64_t j = 0; j < run.len; ++j) {
      const int64_t kp = run.pos + j, krow = run.row + j;
      if (!sees.sees(qp, kp)) continue;
      Acc dot = 0;  // q_i . k_j over head_dim_qk
      for (int d = 0; d < in.q.dim; ++d)
        dot += x.q(qrow, h, d) * x.k(krow, hk, d);
      Acc s = scale * dot, dcap = 1;
      if (cap > 0) {  // s = cap * tanh(s / cap)
        const Acc th = std::tanh(s / cap);
        s = cap * th;
        dcap = 1 - th * th;
      }
      s -= slope * static_cast<Acc>(std::abs(qp - kp));  // ALiBi
      Acc keep = 1;
      if (o.dropout_p > 0.0f) keep = kernels::dropout_keep_row(rkey, kp, thr) ? inv_keep : Acc(0);
      vis.push_back({krow, s, keep, dcap});
    }
  }
  if (vis.empty()) return -std::numeric_limits<Acc>::infinity();
  Acc mx = vis[0].s;
  for (const auto& e : vis) mx = std::max(mx, e.s);
  Acc sum = 0;
  for (const auto& e : vis) sum += std::exp(e.s - mx);
  return mx + std::log(sum);
}

template <class Acc>
void forward_impl(const AttnFwdParams& p) {
  const AttnInputs& in = p.in;
  const int hq = in.q.heads, group = hq / in.k.heads, dv = in.v.dim;
  const DenseInputs<Acc> x(in);
  std::vector<Visible<Acc>> vis;
  std::vector<Acc> o(dv);
  for (const AttnTask& t : in.work->tasks)
    for (int h = 0; h < hq; ++h)
      for (int64_t i = 0; i < t.q_len; ++i) {
        const int64_t qrow = t.q_row + i;
        const Acc lse = scores<Acc>(in, x, t, h, qrow, t.q_pos + i, vis);
        // out_i = sum_j keep_j * exp(S_ij - lse_i) v_j          [head_dim_v]
        for (auto& e : o) e = 0;
        for (const auto& e : vis) {
          const Acc pij = std::exp(e.s - lse) * e.keep;
          for (int d = 0; d < dv; ++d) o[d] += pij * x.v(e.row, h / group, d);
        }
        if (p.out_mode == OutMode::accumulate) {
          // merge with the earlier result: weights exp(lse_prev - tot), exp(lse - tot)
          float* prev_out = static_cast<float*>(p.out.data) + p.out.offset(qrow, h);
          float& prev_lse = p.lse[qrow * hq + h];
          if (vis.empty()) continue;  // nothing new: the earlier result stays
          const Acc lp = static_cast<Acc>(prev_lse);
          const Acc tot = lp == -std::numeric_limits<Acc>::infinity()
                              ? lse : std::max(lp, lse) + std::log1p(std::exp(-std::abs(lp - lse)));
          const Acc wp = std::exp(lp - tot), wn = std::exp(lse - tot);
          for (int d = 0; d < dv; ++d)
            prev_out[d] = static_cast<float>(wp * static_cast<Acc>(prev_out[d]) + wn * o[d]);
          prev_lse = static_cast<float>(tot);
          continue;
        }
        for (int d = 0; d < dv; ++d)
          store_elem(p.out.data, p.out.dtype, p.out.offset(qrow, h) + d, static_cast<float>(o[d]));
        if (p.lse) p.lse[qrow * hq + h] = static_cast<float>(lse);
      }
}

template <class Acc>
void backward_impl(const AttnBwdParams& p) {
  const AttnInputs& in = p.in;
  const int hq = in.q.heads, hk_n = in.k.heads, group = hq / hk_n;
  const int dqk = in.q.dim, dv = in.v.dim;
  const int64_t total_k = in.k.rows;
  const Acc scale = static_cast<Acc>(in.softmax_scale());
  // dK, dV accumulate over every task and every query head of a group.
  std::vector<Acc> dk(static_cast<size_t>(total_k) * hk_n * dqk, Acc(0));  // [total_k, Hkv, Dqk]
  std::vector<Acc> dvv(static_cast<size_t>(total_k) * hk_n * dv, Acc(0));  // [total_k, Hkv, Dv]
  const DenseInputs<Acc> x(in);
  const Dense<Acc> fwd_out(p.out), dout_all(p.dout);
  std::vector<Visible<Acc>> vis;
  std::vector<Acc> dq(dqk), dout(dv);
  for (const AttnTask& t : in.work->tasks)
    for (int h = 0; h < hq; ++h) {
      const int hk = h / group;
      for (int64_t i = 0; i < t.q_len; ++i) {
        const int64_t qrow = t.q_row + i;
        scores<Acc>(in, x, t, h, qrow, t.q_pos + i, vis);
        const Acc lse = static_cast<Acc>(p.lse[qrow * hq + h]);
        // delta_i = dout_i . out_i
        Acc delta = 0;
        for (int d = 0; d < dv; ++d) {
          dout[d] = dout_all(qrow, h, d);
          delta += dout[d] * fwd_out(qrow, h, d);
        }
        for (auto& e : dq) e = 0;
        for (const auto& e : vis) {
          const Acc pij = std::exp(e.s - lse);
          // dv_j += keep * P_ij dout_i;  dP_ij = keep * dout_i . v_j
          Acc dp = 0;
          for (int d = 0; d < dv; ++d) {
            dvv[(e.row * hk_n + hk) * dv + d] += e.keep * pij * dout[d];
            dp += dout[d] * x.v(e.row, hk, d);
          }
          const Acc ds = pij * (e.keep * dp - delta) * e.dcap;
          // dq_i += s dS_ij k_j;  dk_j += s dS_ij q_i
          for (int d = 0; d < dqk; ++d) {
            dq[d] += scale * ds * x.k(e.row, hk, d);
            dk[(e.row * hk_n + hk) * dqk + d] += scale * ds * x.q(qrow, h, d);
          }
        }
        for (int d = 0; d < dqk; ++d) {
          const int64_t at = p.dq.offset(qrow, h) + d;
          if (p.grad_mode == GradMode::accumulate_all) static_cast<float*>(p.dq.data)[at] += static_cast<float>(dq[d]);
          else store_elem(p.dq.data, p.dq.dtype, at, static_cast<float>(dq[d]));
        }
      }
    }
  // write: store in the views' dtype; accumulate, accumulate_all: dk/dv are fp32 views, +=.
  // Key row r is stored row in.key_rows[r] when given.
  auto deliver = [&](const TensorView& out, int64_t r, int hk, int d, float g) {
    const int64_t i = out.offset(in.stored_key_row(r), hk) + d;
    if (p.grad_mode == GradMode::write) store_elem(out.data, out.dtype, i, g);
    else static_cast<float*>(out.data)[i] += g;
  };
  for (int64_t r = 0; r < total_k; ++r)
    for (int hk = 0; hk < hk_n; ++hk) {
      for (int d = 0; d < dqk; ++d)
        deliver(p.dk, r, hk, d, static_cast<float>(dk[(r * hk_n + hk) * dqk + d]));
      for (int d = 0; d < dv; ++d)
        deliver(p.dv, r, hk, d, static_cast<float>(dvv[(r * hk_n + hk) * dv + d]));
    }
}

}  // namespace

void attention_forward_reference(const AttnFwdParams& p, RefAccum accum) {
  CPATTN_CHECK(p.in.kv_pack_share == nullptr, "attention_forward_reference: kv_pack_share is the kernels' (the "
               "reference packs nothing, and its peers would wait for it at the share's barrier)");
  kernels::validate(p);
  if (accum == RefAccum::f64) forward_impl<double>(p);
  else forward_impl<float>(p);
}

void attention_backward_reference(const AttnBwdParams& p, RefAccum accum) {
  CPATTN_CHECK(p.in.kv_pack_share == nullptr, "attention_backward_reference: kv_pack_share is the kernels' (the "
               "reference packs nothing, and its peers would wait for it at the share's barrier)");
  CPATTN_CHECK(p.grad_share == nullptr, "attention_backward_reference: grad_share is the kernels' (the reference "
               "writes dk and dv, which grad_share leaves empty)");
  kernels::validate(p);
  if (accum == RefAccum::f64) backward_impl<double>(p);
  else backward_impl<float>(p);
}

}  // namespace cpattn
