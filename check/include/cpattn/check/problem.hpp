// The inputs of one attention case (reproducible random q, k, v, dout in a storage dtype) and
// its runs: the kernels, or the reference (float64 ground truth or the naive fp32 baseline),
// forward then backward. What the kernel tests and the benchmark's check are built on. No MPI.
#pragma once

#include <cpattn/check/cases.hpp>
#include <cpattn/check/tensor.hpp>

#include <cpattn/attention.hpp>
#include <cpattn/reference.hpp>
#include <cpattn/worklist.hpp>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace cpattn::check {

struct Problem {
  AttnCase c;
  DType dtype;
  WorkList work;  // varlen_worklist of the case
  Tensor q, k, v, dout;
  std::vector<float> slopes;  // ALiBi slopes when c.alibi (alibi_slopes(num_heads_q))

  // Uniform values in [-magnitude, magnitude] for q and k, [-1, 1] for v and dout, from one
  // mt19937_64 stream seeded with `seed`, rounded to `t`.
  Problem(const AttnCase& cs, DType t, uint64_t seed, float magnitude = 1.0f);

  TensorShape q_shape() const { return {c.total_q(), c.num_heads_q, c.head_dim_qk}; }
  TensorShape k_shape() const { return {c.total_k(), c.num_heads_k, c.head_dim_qk}; }
  TensorShape v_shape() const { return {c.total_k(), c.num_heads_k, c.head_dim_v}; }
  TensorShape out_shape() const { return {c.total_q(), c.num_heads_q, c.head_dim_v}; }
  std::size_t out_size() const { return static_cast<std::size_t>(out_shape().elements()); }
  std::size_t lse_size() const { return static_cast<std::size_t>(c.total_q() * c.num_heads_q); }
  std::size_t dk_size() const { return static_cast<std::size_t>(k_shape().elements()); }
  std::size_t dv_size() const { return static_cast<std::size_t>(v_shape().elements()); }

  AttnOptions options(KernelPath path, int threads) const {
    return {.mask = c.mask,
            .dropout_p = c.dropout_p,
            .seed = 77,
            .num_threads = threads,
            .path = path,
            .window_size_left = c.window_left,
            .window_size_right = c.window_right,
            .softcap = c.softcap,
            .alibi_slopes = c.alibi ? slopes.data() : nullptr};
  }
  // Parameters over the tensors given (which may be copies in another dtype), on `w` (default:
  // the case's work list), grad_mode write.
  AttnFwdParams fwd(const Tensor& Q, const Tensor& K, const Tensor& V, Tensor& out, float* lse,
                    KernelPath path, int threads, const WorkList* w = nullptr) const;
  AttnBwdParams bwd(const Tensor& Q, const Tensor& K, const Tensor& V, const Tensor& out,
                    const float* lse, const Tensor& dO, Tensor& dq, Tensor& dk, Tensor& dvt,
                    KernelPath path, int threads, const WorkList* w = nullptr) const;
};

// Forward then backward in `dt` (the problem's values rounded to it) with the kernels on
// `path`. Backward takes `out_in`/`lse_in` when given (so that every implementation
// differentiates the same forward result), else its own forward's.
Results run_kernels(const Problem& pb, DType dt, KernelPath path, int threads,
                    const Tensor* out_in = nullptr, const std::vector<float>* lse_in = nullptr);
// The same with the reference: RefAccum::f64 is the ground truth (run it with dt = f32 so that
// nothing but the fp32 result is rounded), RefAccum::f32 the naive same-precision baseline.
Results run_reference(const Problem& pb, DType dt, RefAccum accum,
                      const Tensor* out_in = nullptr, const std::vector<float>* lse_in = nullptr);

}  // namespace cpattn::check
