// A whole packed batch as every rank of a CP check holds it (cu_seqlens, shapes, dtype, and
// q, k, v, dout over all real tokens in global order), its sources (random from a seed, a
// directory of .npy files), the single-process run of the whole batch (what CP must equal),
// and a rank's local rows of it. For tests/cp, `cpattn run` and the training checks. No MPI
// here: the gathering across ranks is gather.hpp.
#pragma once

#include <cpattn/check/tensor.hpp>

#include <cpattn/attention.hpp>
#include <cpattn/plan.hpp>

#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace cpattn::check {

struct BatchShape {
  int heads_q = 0;      // Hq
  int heads_k = 0;      // Hkv
  int head_dim_qk = 0;  // Dqk
  int head_dim_v = 0;   // Dv
};

struct Batch {
  std::vector<int64_t> cu_seqlens;  // real boundaries, leading 0
  BatchShape shape;
  DType dtype = DType::f32;
  Tensor q, k, v, dout;  // [T, Hq, Dqk], [T, Hkv, Dqk], [T, Hkv, Dv], [T, Hq, Dv]

  int64_t tokens() const { return cu_seqlens.empty() ? 0 : cu_seqlens.back(); }
  int64_t documents() const { return static_cast<int64_t>(cu_seqlens.size()) - 1; }
  TensorShape q_shape() const { return {tokens(), shape.heads_q, shape.head_dim_qk}; }
  TensorShape k_shape() const { return {tokens(), shape.heads_k, shape.head_dim_qk}; }
  TensorShape v_shape() const { return {tokens(), shape.heads_k, shape.head_dim_v}; }
  TensorShape out_shape() const { return {tokens(), shape.heads_q, shape.head_dim_v}; }
};

// A realistic mix: log-uniform lengths between 16 and kDocumentMixLongest tokens, the last one
// cut so that the batch holds exactly `tokens`.
inline constexpr int64_t kDocumentMixLongest = 2048;
std::vector<int64_t> document_mix(int64_t tokens, uint64_t seed);

// Normal(0, stddev) values rounded to `t`; a fresh distribution on `rng` (so that tensors drawn
// one after another from one stream do not share a cached deviate), or on mt19937_64(seed).
Tensor random_tensor(DType t, TensorShape s, std::mt19937_64& rng, float stddev = 1.0f);
Tensor random_tensor(DType t, TensorShape s, uint64_t seed, float stddev = 1.0f);

// q, k, v, dout drawn in that order from one mt19937_64(seed) stream, Normal(0, 1).
Batch random_batch(std::vector<int64_t> cu_seqlens, BatchShape shape, DType t, uint64_t seed);

// q.npy, k.npy, v.npy, dout.npy (float32 or float16, [T, H, D]) and cu_seqlens.npy (int32 or
// int64, leading 0) from `dir`, stored as `t`. Errors (cpattn::Error) begin with `what`.
Batch npy_batch(const std::string& dir, DType t, std::string_view what = "npy batch");
// What npy_batch would read, from the tensors' headers and cu_seqlens.npy alone (no tensor data
// read): the boundaries and the shape, with npy_batch's errors for them (a budget first).
struct NpyBatchInfo {
  std::vector<int64_t> cu_seqlens;
  BatchShape shape;
};
NpyBatchInfo npy_batch_info(const std::string& dir, std::string_view what = "npy batch");

// The kernels over the whole batch in one process: varlen_worklist(cu, cu), forward then
// backward with `options`. fp32 results of every real token in global order.
Results single_process(const Batch& b, const AttnOptions& options);

// A rank's local rows of a global tensor under `plan` (take_local_rows): padding rows zero.
Tensor local_rows(const Tensor& global, const RankPlan& plan);
// How many padding rows of a local tensor are not exactly zero (CP must leave them zero).
int64_t nonzero_padding_rows(ConstTensorView local, const RankPlan& plan);
// How many padding rows hold any value other than `value`: CP's lse is -inf at padding rows
// (view it as contiguous(lse, local_tokens, Hq, 1)).
int64_t padding_rows_not_equal(ConstTensorView local, const RankPlan& plan, float value);

}  // namespace cpattn::check
