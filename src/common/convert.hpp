// The loops behind to_float and from_float (dtype.cpp), one per instruction set, chosen at run
// time by what the CPU has (not by CPATTN_KERNEL_PATH: every one gives the scalar
// conversions' bits under the default rounding mode, DAZ and FTZ or not). A test runs each one
// this CPU has against the scalar f32_to_bf16 & co.
#pragma once

#include <cpattn/dtype.hpp>

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace cpattn::detail {

enum class ConvertIsa {
  scalar,  // the inline conversions of dtype.hpp, one element at a time
  avx2,    // 8 lanes (AVX2 and F16C)
  avx512,  // 16 lanes (AVX-512F)
};

std::string_view to_string(ConvertIsa isa);  // scalar, avx2, avx512

// Whether this CPU runs `isa`'s loops, and the widest one it runs.
bool convert_isa_runs(ConvertIsa isa);
ConvertIsa best_convert_isa();

// to_float / from_float of 16-bit storage (t is f16 or bf16) with `isa`'s loops, which this CPU
// must run.
void to_float_with(ConvertIsa isa, const uint16_t* src, DType t, std::size_t n, float* dst);
void from_float_with(ConvertIsa isa, const float* src, std::size_t n, DType t, uint16_t* dst);

}  // namespace cpattn::detail
