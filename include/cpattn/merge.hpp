// Exact merge of partial softmax results (docs/design.md section 6): the public API the pass-Q
// scheme uses, in fp32 and float64 (the ring carries its running (out, lse) in the kernel's
// OutMode::accumulate instead).
//
// Attention over a key set split into parts a = 0..n-1 gives per part and per (row, head)
// an lse_a and an out_a. The full result is
//   lse = log sum_a exp(lse_a),   out = sum_a exp(lse_a - lse) * out_a.
// The -inf conventions: an empty part (no visible key) has lse_a = -inf and weight 0, and its
// out_a is never read (it may hold anything, even NaN); when every part is empty lse = -inf
// and out = 0 (the -inf - -inf case is guarded, never NaN). Merging is associative: a merged
// pair is a valid part of a further merge, so parts may be merged in any grouping (equal up
// to rounding), e.g. as they arrive in a fixed order.
//
//   const float* lses[] = {lse_a, lse_b};   // [rows, heads] each
//   const float* outs[] = {out_a, out_b};   // [rows, heads, head_dim] each
//   cpattn::merge_partial_softmax({.num_parts = 2, .rows = rows, .num_heads = heads,
//                                  .head_dim = dv, .lse_parts = lses, .out_parts = outs,
//                                  .lse = lse_a, .out = out_a});   // into part a, in place
#pragma once

#include <cstdint>
#include <span>

namespace cpattn {

// T is float (MergeParams) or double (MergeParams64).
template <class T>
struct MergeParamsT {
  int num_parts = 0;          // n >= 1
  int64_t rows = 0;           // rows x heads merged, each independently
  int num_heads = 0;          // heads per row
  int head_dim = 0;           // Dv, >= 1
  const T* const* lse_parts = nullptr;  // n pointers to [rows, num_heads], contiguous
  const T* const* out_parts = nullptr;  // n pointers to [rows, num_heads, head_dim], contiguous
  T* lse = nullptr;           // [rows, num_heads], may alias lse_parts[0]
  T* out = nullptr;           // [rows, num_heads, head_dim], may alias out_parts[0]
};
using MergeParams = MergeParamsT<float>;
using MergeParams64 = MergeParamsT<double>;

// Sums in double either way; the fp32 form rounds the weights and the result to float.
void merge_partial_softmax(const MergeParams& p);
void merge_partial_softmax(const MergeParams64& p);

// One (row, head): merged lse of `lse_parts`, writing the weights exp(lse_a - lse) (0 for an
// empty part, all 0 when every part is empty) into `weights` (same length).
float merge_weights(std::span<const float> lse_parts, std::span<float> weights);
double merge_weights(std::span<const double> lse_parts, std::span<double> weights);

}  // namespace cpattn
