// Tensors of the checks: a THD tensor in a storage dtype that also keeps its values as fp32,
// so that a test can read what it put in, hand views to the kernels and read back what they
// wrote. Results holds the fp32 outputs of one forward + backward. No MPI here.
#pragma once

#include <cpattn/dtype.hpp>
#include <cpattn/tensor.hpp>

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace cpattn::check {

// [rows, heads, dim], contiguous.
struct TensorShape {
  int64_t rows = 0;
  int heads = 0;
  int dim = 0;
  constexpr int64_t row_elements() const { return int64_t{heads} * dim; }
  constexpr int64_t elements() const { return rows * row_elements(); }
};

// A contiguous tensor in storage type `dtype`. `f` holds the values as fp32 (exactly the
// stored ones, every value rounded through the dtype by set/from); for f32 `f` is the storage
// itself. After a kernel wrote a f16/bf16 tensor, values() reads the storage.
struct Tensor {
  DType dtype = DType::f32;
  TensorShape shape;
  std::vector<float> f;        // the values, fp32
  std::vector<uint16_t> half;  // the storage for f16/bf16 (empty for f32)

  Tensor() = default;
  Tensor(DType t, TensorShape s);  // zeros
  // `values` (shape.elements() of them) rounded to `t`.
  static Tensor from(DType t, TensorShape s, std::span<const float> values);

  std::size_t size() const { return f.size(); }
  void* data() { return dtype == DType::f32 ? static_cast<void*>(f.data()) : half.data(); }
  const void* data() const {
    return dtype == DType::f32 ? static_cast<const void*>(f.data()) : half.data();
  }
  TensorView view() { return contiguous(data(), shape.rows, shape.heads, shape.dim, dtype); }
  ConstTensorView view() const {
    return contiguous(data(), shape.rows, shape.heads, shape.dim, dtype);
  }
  void set(std::size_t i, float x);  // stores round_to_dtype(dtype, x)
  std::vector<float> values() const;  // the stored values, fp32
  Tensor as(DType t) const { return from(t, shape, values()); }  // the values in another dtype
};

// The fp32 results of one forward + backward (for a batch: real tokens in global order).
struct Results {
  std::vector<float> out, lse, dq, dk, dv;
};

}  // namespace cpattn::check
