// Comparing a result with its reference: relative L2, max abs, max rel, allclose excess and
// the pass rule of tolerance.hpp, in one report per tensor that names the tensor and its worst
// row. Where the reference is infinite (lse = -inf of a query that sees no key) an equal
// result is an exact match and is skipped. No MPI here.
#pragma once

#include <cpattn/dtype.hpp>

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

namespace cpattn::check {

// ||a - ref|| / ||ref|| (||a - ref|| when ref is all zero).
double rel_norm_error(std::span<const float> a, std::span<const float> ref);
// max over elements of |a - ref| - (atol + rtol |ref|): <= 0 means allclose.
double allclose_excess(std::span<const float> a, std::span<const float> ref, double atol,
                       double rtol);
bool all_finite(std::span<const float> a);

struct TensorReport {
  std::string name;           // which tensor ("out", "dq", ...)
  DType dtype = DType::f32;   // whose rule applied
  double rel_l2 = 0;          // ||diff|| / ||ref||
  double max_abs = 0;         // max |diff|
  double max_rel = 0;         // max |diff| / max |ref|
  double allclose_excess = 0; // max |diff| - (atol + rtol |ref|) under dtype's tolerance
  int64_t worst_row = -1;     // the row (of row_elements) holding that worst element
  bool finite = true;         // no NaN/Inf in the result (but for exact infinite matches)
  bool pass = true;           // finite, and f32: rel_l2 <= rel_norm; else allclose_excess <= 0
  std::string rule;           // the pass rule in words (tolerance(dtype).rule, or lse_rule)
  std::string describe() const;  // one line, for messages
};

// Sizes must agree (cpattn::Error otherwise). `row_elements` locates the worst row.
TensorReport compare(std::string_view name, std::span<const float> got,
                     std::span<const float> ref, DType dtype, int64_t row_elements = 1);

// lse (fp32 in every storage dtype) against a run of the same inputs, e.g. CP against a single
// process: pass = finite and every |diff| <= lse_atol(storage) (allclose_excess is under that
// bound, rtol 0). Equal infinities are exact matches, as above. `heads` (Hq) locates the
// worst row (token).
TensorReport compare_lse(std::span<const float> got, std::span<const float> ref, DType storage,
                         int heads);

}  // namespace cpattn::check
