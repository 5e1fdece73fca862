#include <cpattn/dtype.hpp>

#include <cmath>
#include <cstring>

namespace cpattn {

void to_float(const void* src, DType t, std::size_t n, float* dst) {
  const auto* h = static_cast<const uint16_t*>(src);
  switch (t) {
    case DType::f32: std::memcpy(dst, src, n * sizeof(float)); break;
    case DType::f16: for (std::size_t i = 0; i < n; ++i) dst[i] = f16_to_f32(h[i]); break;
    case DType::bf16: for (std::size_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(h[i]); break;
  }
}

void from_float(const float* src, std::size_t n, DType t, void* dst) {
  auto* h = static_cast<uint16_t*>(dst);
  switch (t) {
    case DType::f32: std::memcpy(dst, src, n * sizeof(float)); break;
    case DType::f16: for (std::size_t i = 0; i < n; ++i) h[i] = f32_to_f16(src[i]); break;
    case DType::bf16: for (std::size_t i = 0; i < n; ++i) h[i] = f32_to_bf16(src[i]); break;
  }
}

std::optional<std::size_t> first_overflow(const float* src, std::size_t n, DType t) {
  if (t == DType::f32) return std::nullopt;
  for (std::size_t i = 0; i < n; ++i)
    if (std::isfinite(src[i]) && std::isinf(round_to_dtype(t, src[i]))) return i;
  return std::nullopt;
}

}  // namespace cpattn
