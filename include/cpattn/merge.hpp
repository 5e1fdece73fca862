// Exact merge of partial softmax results (docs/design.md section 6).
//
// Attention over a key set split into parts a = 0..n-1 gives per part and per (row, head)
// an lse_a and an out_a. The full result is
//   lse = log sum_a exp(lse_a),   out = sum_a exp(lse_a - lse) * out_a.
// An empty part has lse_a = -inf and weight 0; when every part is empty lse = -inf and out = 0
// (the -inf - -inf case is guarded, never NaN).
#pragma once

#include <cstdint>
#include <span>

namespace cpattn {

struct MergeParams {
  int num_parts = 0;          // n >= 1
  int64_t rows = 0;           // rows x heads merged, each independently
  int num_heads = 0;          // heads per row
  int head_dim = 0;           // Dv, >= 1
  const float* const* lse_parts = nullptr;  // n pointers to [rows, num_heads] fp32, contiguous
  const float* const* out_parts = nullptr;  // n pointers to [rows, num_heads, head_dim] fp32
  float* lse = nullptr;       // [rows, num_heads] fp32, may alias lse_parts[0]
  float* out = nullptr;       // [rows, num_heads, head_dim] fp32, may alias out_parts[0]
};

void merge_partial_softmax(const MergeParams& p);

// One (row, head): merged lse of `lse_parts`, writing the weights exp(lse_a - lse) (0 for an
// empty part, all 0 when every part is empty) into `weights` (same length).
float merge_weights(std::span<const float> lse_parts, std::span<float> weights);

}  // namespace cpattn
