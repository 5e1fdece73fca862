// The tolerances of every check in cpattn (kernel tests, CP tests, `cpattn run`, the
// benchmark's check): one table, per storage dtype, against the float64 reference or a
// single-process run. Nothing else in the tree spells these numbers.
#pragma once

#include <cpattn/dtype.hpp>

#include <string_view>

namespace cpattn::check {

// f32: ||diff|| / ||ref|| <= rel_norm. f16/bf16: elementwise |diff| <= atol + rtol |ref| (the
// reference design's values) and ||diff|| / ||ref|| <= rtol (atol alone passed anything, zeros
// too, where every |ref| is below it: gradients of a loss averaged over tokens); against the
// float64 reference, the norm error at most `naive_factor` times a naive same-precision
// implementation's.
struct Tolerance {
  double rel_norm;
  double atol, rtol;
  double naive_factor;
  std::string_view rule;  // the pass rule in words, as reports print it
};

constexpr Tolerance tolerance(DType t) {
  switch (t) {
    case DType::f32: return {1e-5, 0.0, 0.0, 0.0, "fp32: relative L2 error <= 1e-5"};
    case DType::f16:
      return {0.0, 5e-3, 5e-3, 2.0, "fp16: |diff| <= 5e-3 + 5e-3*|ref| and relative L2 error <= 5e-3"};
    case DType::bf16:
      return {0.0, 2.5e-2, 2.5e-2, 2.0, "bf16: |diff| <= 2.5e-2 + 2.5e-2*|ref| and relative L2 error <= 2.5e-2"};
  }
  return {0.0, 0.0, 0.0, 0.0, ""};
}

// lse is fp32 in every storage dtype: the fp32 rule applies to it.
inline constexpr double kLseRelNorm = tolerance(DType::f32).rel_norm;

// lse of a CP run against a single-process run of the same inputs (compare_lse): elementwise
// |diff| <= lse_atol + lse_rtol |ref|, in every storage dtype (lse is fp32 and computed from the
// same rounded inputs; 1e-2 for fp16/bf16 let an lse rounded through fp16 pass, 4e-3 off at lse
// 9; measured differences are below 1e-6 at the tests' scales and one fp32 ulp, 1.5e-5, at lse
// past 128, which the relative term admits).
constexpr double lse_atol(DType) { return 1e-5; }
constexpr double lse_rtol(DType) { return 1e-5; }
constexpr std::string_view lse_rule(DType) { return "lse: |diff| <= 1e-5 + 1e-5*|ref|"; }

}  // namespace cpattn::check
