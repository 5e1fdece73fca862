#include <cpattn/dtype.hpp>

#include <cmath>
#include <cstring>

#include "convert.hpp"

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#include <immintrin.h>
#define CPATTN_CONVERT_X86 1
#endif

namespace cpattn {
namespace detail {
namespace {

void to_float_scalar(const uint16_t* h, DType t, std::size_t n, float* dst) {
  if (t == DType::f16)
    for (std::size_t i = 0; i < n; ++i) dst[i] = f16_to_f32(h[i]);
  else
    for (std::size_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(h[i]);
}

void from_float_scalar(const float* src, std::size_t n, DType t, uint16_t* h) {
  if (t == DType::f16)
    for (std::size_t i = 0; i < n; ++i) h[i] = f32_to_f16(src[i]);
  else
    for (std::size_t i = 0; i < n; ++i) h[i] = f32_to_bf16(src[i]);
}

#ifdef CPATTN_CONVERT_X86
// fp16: the F16C instructions, which round to nearest even (the immediate; the scalar
// conversions follow MXCSR's rounding mode, nearest even unless a program changes it) and keep
// a NaN's sign and top payload bits with the quiet bit set, as the scalar conversions do; a
// float too small for fp16's subnormals gives a zero of its sign whether or not MXCSR.DAZ is
// set, and VCVTPH2PS ignores DAZ. bf16: f32_to_bf16's integer steps on every lane.
constexpr int kRound = _MM_FROUND_TO_NEAREST_INT;

__attribute__((target("avx2,f16c"))) void to_float_avx2(const uint16_t* h, DType t, std::size_t n, float* dst) {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i));
    const __m256 f = t == DType::f16 ? _mm256_cvtph_ps(x)
                                     : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(x), 16));
    _mm256_storeu_ps(dst + i, f);
  }
  to_float_scalar(h + i, t, n - i, dst + i);
}

// f32_to_bf16 of 8 floats, each result in the low half of its 32-bit lane.
__attribute__((target("avx2"))) inline __m256i bf16_lanes_avx2(const float* p) {
  const __m256i u = _mm256_castps_si256(_mm256_loadu_ps(p));
  const __m256i nan =
      _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rne = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd), 16);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  return _mm256_blendv_epi8(rne, quiet, nan);
}

__attribute__((target("avx2,f16c"))) void from_float_avx2(const float* src, std::size_t n, DType t, uint16_t* h) {
  std::size_t i = 0;
  if (t == DType::f16) {
    for (; i + 8 <= n; i += 8)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(h + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), kRound));
  } else {
    for (; i + 16 <= n; i += 16) {
      // packus takes 128-bit lanes in turn: [a0-3 b0-3 | a4-7 b4-7], put back in order
      const __m256i packed = _mm256_packus_epi32(bf16_lanes_avx2(src + i), bf16_lanes_avx2(src + i + 8));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(h + i), _mm256_permute4x64_epi64(packed, 0xd8));
    }
  }
  from_float_scalar(src + i, n - i, t, h + i);
}

// GCC 12's AVX-512 intrinsics pass _mm512_undefined_* operands that -Wmaybe-uninitialized
// reports once they are inlined here (clang has no such warning).
#if !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
__attribute__((target("avx512f"))) void to_float_avx512(const uint16_t* h, DType t, std::size_t n, float* dst) {
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + i));
    const __m512 f = t == DType::f16 ? _mm512_cvtph_ps(x)
                                     : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
    _mm512_storeu_ps(dst + i, f);
  }
  to_float_scalar(h + i, t, n - i, dst + i);
}

// f32_to_bf16 of 16 floats, each result in the low half of its 32-bit lane.
__attribute__((target("avx512f"))) inline __m512i bf16_lanes_avx512(const float* p) {
  const __m512i u = _mm512_castps_si512(_mm512_loadu_ps(p));
  const __mmask16 nan =
      _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rne = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  return _mm512_mask_blend_epi32(nan, rne, quiet);
}

__attribute__((target("avx512f"))) void from_float_avx512(const float* src, std::size_t n, DType t, uint16_t* h) {
  std::size_t i = 0;
  if (t == DType::f16) {
    for (; i + 16 <= n; i += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(h + i), _mm512_cvtps_ph(_mm512_loadu_ps(src + i), kRound));
  } else {
    for (; i + 16 <= n; i += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(h + i), _mm512_cvtepi32_epi16(bf16_lanes_avx512(src + i)));
  }
  from_float_scalar(src + i, n - i, t, h + i);
}
#if !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif

}  // namespace

std::string_view to_string(ConvertIsa isa) {
  return isa == ConvertIsa::avx512 ? "avx512" : isa == ConvertIsa::avx2 ? "avx2" : "scalar";
}

bool convert_isa_runs(ConvertIsa isa) {
#ifdef CPATTN_CONVERT_X86
  switch (isa) {
    case ConvertIsa::scalar: return true;
    case ConvertIsa::avx2: {  // (F16C by CPUID: clang before 18 has no "f16c" for __builtin_cpu_supports)
      unsigned a = 0, b = 0, c = 0, d = 0;
      return __builtin_cpu_supports("avx2") && __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C) != 0;
    }
    case ConvertIsa::avx512: return __builtin_cpu_supports("avx512f");
  }
  return false;
#else
  return isa == ConvertIsa::scalar;
#endif
}

ConvertIsa best_convert_isa() {
  static const ConvertIsa best = convert_isa_runs(ConvertIsa::avx512) ? ConvertIsa::avx512
                                 : convert_isa_runs(ConvertIsa::avx2) ? ConvertIsa::avx2
                                                                      : ConvertIsa::scalar;
  return best;
}

void to_float_with([[maybe_unused]] ConvertIsa isa, const uint16_t* src, DType t, std::size_t n, float* dst) {
#ifdef CPATTN_CONVERT_X86
  if (isa == ConvertIsa::avx512) return to_float_avx512(src, t, n, dst);
  if (isa == ConvertIsa::avx2) return to_float_avx2(src, t, n, dst);
#endif
  to_float_scalar(src, t, n, dst);
}

void from_float_with([[maybe_unused]] ConvertIsa isa, const float* src, std::size_t n, DType t, uint16_t* dst) {
#ifdef CPATTN_CONVERT_X86
  if (isa == ConvertIsa::avx512) return from_float_avx512(src, n, t, dst);
  if (isa == ConvertIsa::avx2) return from_float_avx2(src, n, t, dst);
#endif
  from_float_scalar(src, n, t, dst);
}

}  // namespace detail

// (n = 0: nothing read or written, and either pointer may be null, as an empty buffer's is)
void to_float(const void* src, DType t, std::size_t n, float* dst) {
  if (n == 0) return;
  if (t == DType::f32) {
    std::memcpy(dst, src, n * sizeof(float));
    return;
  }
  detail::to_float_with(detail::best_convert_isa(), static_cast<const uint16_t*>(src), t, n, dst);
}

void from_float(const float* src, std::size_t n, DType t, void* dst) {
  if (n == 0) return;
  if (t == DType::f32) {
    std::memcpy(dst, src, n * sizeof(float));
    return;
  }
  detail::from_float_with(detail::best_convert_isa(), src, n, t, static_cast<uint16_t*>(dst));
}

std::optional<std::size_t> first_overflow(const float* src, std::size_t n, DType t) {
  if (t == DType::f32) return std::nullopt;
  for (std::size_t i = 0; i < n; ++i)
    if (std::isfinite(src[i]) && std::isinf(round_to_dtype(t, src[i]))) return i;
  return std::nullopt;
}

}  // namespace cpattn
