#include <cpattn/check/compare.hpp>
#include <cpattn/check/tolerance.hpp>

#include <cpattn/attention.hpp>
#include <cpattn/error.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>

namespace cpattn::check {
namespace {
// An infinite reference met exactly (lse = -inf on both sides) takes no part.
bool exact_inf(float a, float ref) { return std::isinf(ref) && a == ref; }
}  // namespace

double rel_norm_error(std::span<const float> a, std::span<const float> ref) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (exact_inf(a[i], ref[i])) continue;
    const double d = static_cast<double>(a[i]) - ref[i];
    num += d * d;
    den += static_cast<double>(ref[i]) * ref[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

double allclose_excess(std::span<const float> a, std::span<const float> ref, double atol,
                       double rtol) {
  double worst = -1e300;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (exact_inf(a[i], ref[i])) continue;
    const double e = std::fabs(static_cast<double>(a[i]) - ref[i]) - (atol + rtol * std::fabs(ref[i]));
    if (std::isnan(e)) return std::numeric_limits<double>::infinity();  // a NaN is not close (max dropped it)
    worst = std::max(worst, e);
  }
  return worst;
}

bool all_finite(std::span<const float> a) {
  return std::all_of(a.begin(), a.end(), [](float x) { return std::isfinite(x); });
}

namespace {
// The statistics of a report, allclose_excess under atol + rtol |ref|; pass is the caller's.
// `infinite_ok`: an infinite reference met exactly takes no part (lse = -inf: a row that saw no
// key); elsewhere an infinite result is not finite, whatever the reference (the same overflow
// on both sides is still an overflow).
TensorReport measure(std::string_view name, std::span<const float> got, std::span<const float> ref,
                     DType dtype, int64_t row_elements, double atol, double rtol, bool infinite_ok) {
  CPATTN_CHECK(got.size() == ref.size(), "check::compare: ", name, " has ", got.size(),
               " elements, its reference ", ref.size());
  CPATTN_CHECK(row_elements >= 1, "check::compare: row_elements must be >= 1, got ", row_elements);
  TensorReport r;
  r.name = std::string(name);
  r.dtype = dtype;
  r.allclose_excess = -1e300;
  double d2 = 0, r2 = 0, ref_max = 0;
  int64_t nan_row = -1;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (infinite_ok && exact_inf(got[i], ref[i])) continue;
    if (!std::isfinite(got[i])) r.finite = false;
    const double d = std::abs(double{got[i]} - ref[i]);
    r.max_abs = std::max(r.max_abs, d);
    ref_max = std::max(ref_max, std::abs(double{ref[i]}));
    d2 += d * d;
    r2 += double{ref[i]} * ref[i];
    const double e = d - (atol + rtol * std::abs(double{ref[i]}));
    const int64_t row = static_cast<int64_t>(i) / row_elements;
    if (std::isnan(e)) {  // a NaN, or a finite value against an infinite reference: not close
      if (nan_row < 0) nan_row = row;
      r.allclose_excess = std::numeric_limits<double>::infinity();
    } else if (e > r.allclose_excess) {
      r.allclose_excess = e;
      r.worst_row = row;
    }
  }
  if (nan_row >= 0) r.worst_row = nan_row;  // a NaN is the worst there is
  if (r.allclose_excess == -1e300) r.allclose_excess = 0;  // nothing compared
  r.max_rel = ref_max > 0 ? r.max_abs / ref_max : r.max_abs;
  r.rel_l2 = r2 > 0 ? std::sqrt(d2 / r2) : std::sqrt(d2);
  return r;
}
}  // namespace

TensorReport compare(std::string_view name, std::span<const float> got,
                     std::span<const float> ref, DType dtype, int64_t row_elements) {
  const Tolerance tol = tolerance(dtype);
  TensorReport r = measure(name, got, ref, dtype, row_elements, tol.atol, tol.rtol, false);
  r.pass = r.finite && (dtype == DType::f32 ? r.rel_l2 <= tol.rel_norm : r.allclose_excess <= 0 && r.rel_l2 <= tol.rtol);
  r.rule = std::string(tol.rule);
  return r;
}

TensorReport compare_lse(std::span<const float> got, std::span<const float> ref, DType storage,
                         int heads) {
  TensorReport r = measure("lse", got, ref, storage, heads, lse_atol(storage), lse_rtol(storage), true);
  r.pass = r.finite && r.allclose_excess <= 0;
  r.rule = std::string(lse_rule(storage));
  return r;
}

std::string TensorReport::describe() const {
  std::ostringstream s;
  s << name << " (" << to_string(dtype) << "): " << (pass ? "pass" : "FAIL") << ", rel_l2 " << rel_l2
    << ", max_abs " << max_abs << ", max_rel " << max_rel << ", allclose excess " << allclose_excess
    << " (worst row " << worst_row << ")" << (finite ? "" : ", has NaN/Inf") << "; rule " << rule;
  return s.str();
}

}  // namespace cpattn::check
