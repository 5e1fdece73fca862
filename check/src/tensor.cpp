#include <cpattn/check/tensor.hpp>

#include <cpattn/error.hpp>

namespace cpattn::check {

Tensor::Tensor(DType t, TensorShape s)
    : dtype(t),
      shape(s),
      f(static_cast<std::size_t>(s.elements()), 0.0f),
      half(t == DType::f32 ? 0 : static_cast<std::size_t>(s.elements()), 0) {}

Tensor Tensor::from(DType t, TensorShape s, std::span<const float> values) {
  CPATTN_CHECK(static_cast<int64_t>(values.size()) == s.elements(), "check::Tensor::from: ",
               values.size(), " values for a [", s.rows, ", ", s.heads, ", ", s.dim, "] tensor");
  Tensor r(t, s);
  for (std::size_t i = 0; i < values.size(); ++i) r.set(i, values[i]);
  return r;
}

void Tensor::set(std::size_t i, float x) {
  switch (dtype) {
    case DType::f32: f[i] = x; return;
    case DType::f16: half[i] = f32_to_f16(x); f[i] = f16_to_f32(half[i]); return;
    case DType::bf16: half[i] = f32_to_bf16(x); f[i] = bf16_to_f32(half[i]); return;
  }
}

std::vector<float> Tensor::values() const {
  if (dtype == DType::f32) return f;
  std::vector<float> r(half.size());
  to_float(half.data(), dtype, r.size(), r.data());
  return r;
}

}  // namespace cpattn::check
