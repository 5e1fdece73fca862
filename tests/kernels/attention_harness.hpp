// Inputs, runs and error measures for attention tests and benchmarks: THD tensors in a
// storage dtype, contiguous, filled with reproducible random values.
#pragma once

#include "attention_cases.hpp"

#include <cpattn/attention.hpp>
#include <cpattn/reference.hpp>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

namespace cpattn::testing {

inline float round_to(DType t, float x) {
  switch (t) {
    case DType::f32: return x;
    case DType::f16: return static_cast<float>(static_cast<_Float16>(x));
    case DType::bf16: {
      uint32_t u = std::bit_cast<uint32_t>(x);
      u += 0x7fffu + ((u >> 16) & 1u);
      return std::bit_cast<float>(u & 0xffff0000u);
    }
  }
  return x;
}

// A tensor in a storage dtype; values are kept as fp32 too (exactly representable).
struct Tensor {
  DType dtype = DType::f32;
  std::vector<float> f;         // the values, fp32
  std::vector<uint16_t> half;   // the storage for f16/bf16

  Tensor() = default;
  Tensor(DType t, size_t n) : dtype(t), f(n, 0.0f), half(t == DType::f32 ? 0 : n, 0) {}
  size_t size() const { return f.size(); }
  void* data() { return dtype == DType::f32 ? static_cast<void*>(f.data()) : half.data(); }
  const void* data() const {
    return dtype == DType::f32 ? static_cast<const void*>(f.data()) : half.data();
  }
  void set(size_t i, float x) {
    x = round_to(dtype, x);
    f[i] = x;
    if (dtype == DType::f16) half[i] = std::bit_cast<uint16_t>(static_cast<_Float16>(x));
    if (dtype == DType::bf16) half[i] = static_cast<uint16_t>(std::bit_cast<uint32_t>(x) >> 16);
  }
  // Refresh f from the storage after a kernel wrote it.
  std::vector<float> values() const {
    if (dtype == DType::f32) return f;
    std::vector<float> r(half.size());
    for (size_t i = 0; i < half.size(); ++i)
      r[i] = dtype == DType::f16 ? static_cast<float>(std::bit_cast<_Float16>(half[i]))
                                 : std::bit_cast<float>(uint32_t{half[i]} << 16);
    return r;
  }
  static Tensor from(DType t, const std::vector<float>& v) {
    Tensor r(t, v.size());
    for (size_t i = 0; i < v.size(); ++i) r.set(i, v[i]);
    return r;
  }
};

struct Problem {
  AttnCase c;
  DType dtype;
  WorkList work;
  Tensor q, k, v, dout;

  Problem(const AttnCase& cs, DType t, uint64_t seed, float magnitude = 1.0f)
      : c(cs), dtype(t) {
    work = varlen_worklist(c.cu_seqlens_q(), c.cu_seqlens_k());
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    auto fill = [&](Tensor& x, size_t n, float mag) {
      x = Tensor(t, n);
      for (size_t i = 0; i < n; ++i) x.set(i, mag * u(rng));
    };
    fill(q, c.total_q() * c.num_heads_q * c.head_dim_qk, magnitude);
    fill(k, c.total_k() * c.num_heads_k * c.head_dim_qk, magnitude);
    fill(v, c.total_k() * c.num_heads_k * c.head_dim_v, 1.0f);
    fill(dout, c.total_q() * c.num_heads_q * c.head_dim_v, 1.0f);
  }

  size_t out_size() const { return c.total_q() * c.num_heads_q * c.head_dim_v; }
  size_t lse_size() const { return c.total_q() * c.num_heads_q; }
  size_t dk_size() const { return c.total_k() * c.num_heads_k * c.head_dim_qk; }
  size_t dv_size() const { return c.total_k() * c.num_heads_k * c.head_dim_v; }

  // Parameters over the tensors given (which may be f32 copies for the ground truth).
  AttnFwdParams fwd(const Tensor& Q, const Tensor& K, const Tensor& V, Tensor& out, float* lse,
                    DType dt, KernelPath path, int threads, const WorkList* w = nullptr) const {
    const int hq = c.num_heads_q, hk = c.num_heads_k, dqk = c.head_dim_qk, dv = c.head_dim_v;
    return {.q = Q.data(), .q_row_stride = int64_t{hq} * dqk, .q_head_stride = dqk,
            .k = K.data(), .k_row_stride = int64_t{hk} * dqk, .k_head_stride = dqk,
            .v = V.data(), .v_row_stride = int64_t{hk} * dv, .v_head_stride = dv,
            .out = out.data(), .out_row_stride = int64_t{hq} * dv, .out_head_stride = dv,
            .lse = lse, .total_q = c.total_q(), .total_k = c.total_k(), .num_heads_q = hq,
            .num_heads_k = hk, .head_dim_qk = dqk, .head_dim_v = dv, .dtype = dt,
            .mask = c.mask, .work = w ? w : &work, .num_threads = threads, .path = path};
  }
  AttnBwdParams bwd(const Tensor& Q, const Tensor& K, const Tensor& V, const Tensor& out,
                    const float* lse, const Tensor& dO, Tensor& dq, Tensor& dk, Tensor& dvt,
                    DType dt, KernelPath path, int threads, const WorkList* w = nullptr) const {
    const int hq = c.num_heads_q, hk = c.num_heads_k, dqk = c.head_dim_qk, dv = c.head_dim_v;
    return {.q = Q.data(), .q_row_stride = int64_t{hq} * dqk, .q_head_stride = dqk,
            .k = K.data(), .k_row_stride = int64_t{hk} * dqk, .k_head_stride = dqk,
            .v = V.data(), .v_row_stride = int64_t{hk} * dv, .v_head_stride = dv,
            .out = out.data(), .out_row_stride = int64_t{hq} * dv, .out_head_stride = dv,
            .lse = lse, .dout = dO.data(), .dout_row_stride = int64_t{hq} * dv,
            .dout_head_stride = dv, .dq = dq.data(), .dq_row_stride = int64_t{hq} * dqk,
            .dq_head_stride = dqk, .grad_mode = GradMode::write, .dk = dk.data(),
            .dk_row_stride = int64_t{hk} * dqk, .dk_head_stride = dqk, .dv = dvt.data(),
            .dv_row_stride = int64_t{hk} * dv, .dv_head_stride = dv,
            .total_q = c.total_q(), .total_k = c.total_k(), .num_heads_q = hq,
            .num_heads_k = hk, .head_dim_qk = dqk, .head_dim_v = dv, .dtype = dt,
            .mask = c.mask, .work = w ? w : &work, .num_threads = threads, .path = path};
  }
};

// All results of one forward + backward.
struct Results {
  std::vector<float> out, lse, dq, dk, dv;
};

// Forward then backward in `dt` on `path` (or the reference with `accum` when ref is true).
// Backward takes `out_in`/`lse_in` when given (so every implementation differentiates the
// same forward result), else its own forward's.
inline Results run(const Problem& pb, DType dt, bool ref, RefAccum accum, KernelPath path,
                   int threads, const Tensor* out_in = nullptr,
                   const std::vector<float>* lse_in = nullptr) {
  const Tensor Q = Tensor::from(dt, pb.q.f), K = Tensor::from(dt, pb.k.f),
               V = Tensor::from(dt, pb.v.f), dO = Tensor::from(dt, pb.dout.f);
  Tensor out(dt, pb.out_size()), dq(dt, pb.q.size()), dk(dt, pb.dk_size()), dv(dt, pb.dv_size());
  std::vector<float> lse(pb.lse_size());
  const AttnFwdParams fp = pb.fwd(Q, K, V, out, lse.data(), dt, path, threads);
  if (ref) attention_forward_reference(fp, accum);
  else attention_forward(fp);
  Results r;
  r.out = out.values();
  r.lse = lse;
  const Tensor out_b = out_in ? Tensor::from(dt, out_in->f) : out;
  const float* lse_b = lse_in ? lse_in->data() : lse.data();
  const AttnBwdParams bp = pb.bwd(Q, K, V, out_b, lse_b, dO, dq, dk, dv, dt, path, threads);
  if (ref) attention_backward_reference(bp, accum);
  else attention_backward(bp);
  r.dq = dq.values();
  r.dk = dk.values();
  r.dv = dv.values();
  return r;
}

inline double rel_norm_error(const std::vector<float>& a, const std::vector<float>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isinf(ref[i]) && a[i] == ref[i]) continue;  // lse = -inf on both sides
    const double d = static_cast<double>(a[i]) - ref[i];
    num += d * d;
    den += static_cast<double>(ref[i]) * ref[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// max over elements of |a - ref| - (atol + rtol |ref|): <= 0 means allclose.
inline double allclose_excess(const std::vector<float>& a, const std::vector<float>& ref,
                              double atol, double rtol) {
  double worst = -1e300;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isinf(ref[i]) && a[i] == ref[i]) continue;
    const double e = std::fabs(static_cast<double>(a[i]) - ref[i]) - (atol + rtol * std::fabs(ref[i]));
    worst = std::max(worst, e);
  }
  return worst;
}

inline bool all_finite(const std::vector<float>& a) {
  for (float x : a)
    if (!std::isfinite(x)) return false;
  return true;
}

}  // namespace cpattn::testing
