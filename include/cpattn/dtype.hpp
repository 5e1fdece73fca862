// Storage types of cpattn's tensors and conversions to and from fp32. fp16 and bf16 are
// storage only (docs/design.md 5): arithmetic is fp32 and results are rounded once, to nearest even.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace cpattn {

// Storage type of q, k, v, out, dout, dq, dk, dv.
enum class DType { f32, f16, bf16 };

constexpr std::size_t dtype_size(DType t) { return t == DType::f32 ? 4 : 2; }
// Whether `t` is one of the enumerators (not a value cast from a bad integer).
constexpr bool is_valid(DType t) { return t == DType::f32 || t == DType::f16 || t == DType::bf16; }

// The one spelling of a dtype in messages, reports and on the command line: fp32, fp16, bf16.
constexpr std::string_view to_string(DType t) {
  return t == DType::f32 ? "fp32" : t == DType::f16 ? "fp16" : "bf16";
}

inline float bf16_to_f32(uint16_t h) { return std::bit_cast<float>(uint32_t{h} << 16); }
inline uint16_t f32_to_bf16(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // NaN stays NaN
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);  // round to nearest even
}
#if defined(__FLT16_MANT_DIG__)  // the compiler has _Float16 (GCC 12 on x86-64): F16C where enabled
inline float f16_to_f32(uint16_t h) { return static_cast<float>(std::bit_cast<_Float16>(h)); }
inline uint16_t f32_to_f16(float f) { return std::bit_cast<uint16_t>(static_cast<_Float16>(f)); }
#else  // the same conversions in integer arithmetic (for compilers without _Float16)
inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t{h & 0x8000u} << 16;
  uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0x1f)  // inf; a NaN keeps its payload and is quiet (as F16C and libgcc give it)
    return std::bit_cast<float>(sign | 0x7f800000u | (man != 0 ? 0x400000u : 0u) | (man << 13));
  if (exp == 0) {
    if (man == 0) return std::bit_cast<float>(sign);
    exp = 1;
    while ((man & 0x400u) == 0) man <<= 1, --exp;  // normalize a subnormal
    man &= 0x3ffu;
    exp = exp + 112u;  // ... and rebias (exp may be "negative" before: unsigned wrap cancels)
    return std::bit_cast<float>(sign | (exp << 23) | (man << 13));
  }
  return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (man << 13));
}
inline uint16_t f32_to_f16(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const auto sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu));  // NaN: quiet, top payload
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);      // rounds to inf
  if (a < 0x38800000u) {                                                   // subnormal or 0
    const float scaled = std::bit_cast<float>(a) * 16777216.0f;            // * 2^24, exact
    const auto q = static_cast<uint32_t>(scaled);
    const float rest = scaled - static_cast<float>(q);
    const uint32_t r = q + (rest > 0.5f || (rest == 0.5f && (q & 1u)) ? 1u : 0u);
    return static_cast<uint16_t>(sign | r);
  }
  const uint32_t t = a - 0x38000000u;  // rebias the exponent by 127 - 15
  const uint32_t r = (t + 0xfffu + ((t >> 13) & 1u)) >> 13;  // round to nearest even
  return static_cast<uint16_t>(sign | r);
}
#endif

// The value x takes after a round trip through storage of type `t` (x itself for f32): what
// a kernel's result or a test's input becomes once stored.
inline float round_to_dtype(DType t, float x) {
  switch (t) {
    case DType::f32: return x;
    case DType::f16: return f16_to_f32(f32_to_f16(x));
    case DType::bf16: return bf16_to_f32(f32_to_bf16(x));
  }
  return x;
}

// n elements of storage type `t` at `src` -> fp32, and back (rounding once).
void to_float(const void* src, DType t, std::size_t n, float* dst);
void from_float(const float* src, std::size_t n, DType t, void* dst);

// The first of n fp32 values that is finite but becomes infinite once stored as `t` (|x| past
// fp16's 65504 (rounding to inf), or past bf16's ~3.39e38), or nullopt: from_float turns such a
// value into inf silently, so inputs converted from fp32 are checked with this first.
std::optional<std::size_t> first_overflow(const float* src, std::size_t n, DType t);

}  // namespace cpattn
