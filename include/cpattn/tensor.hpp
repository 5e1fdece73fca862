// A view of a THD tensor: [rows, heads, dim] in one storage dtype, head_dim contiguous, the
// other strides in elements. It owns nothing; it is what every cpattn call takes for a tensor,
// so that a call checks one object per tensor (pointer, shape and dtype together).
//
//   std::vector<float> q(5 * 2 * 64);                                   // q [5, 2, 64]
//   cpattn::ConstTensorView qv = cpattn::contiguous(q.data(), 5, 2, 64);
//   // the same rows read as heads 1.. of a [5, 4, 64] buffer: a strided view
//   cpattn::TensorView o{.data = buf + 64, .rows = 5, .heads = 3, .dim = 64,
//                        .dtype = cpattn::DType::f32, .row_stride = 4 * 64};
//
// Strides left at 0 are the contiguous ones: head_stride = dim, row_stride = heads *
// head_stride (PyTorch's strides of a contiguous [rows, heads, dim] tensor).
#pragma once

#include <cpattn/dtype.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>

namespace cpattn {

template <class Ptr>  // void* (writable) or const void* (read-only)
struct BasicTensorView {
  Ptr data = nullptr;
  int64_t rows = 0;  // tokens
  int heads = 0;
  int dim = 0;       // head_dim, contiguous
  DType dtype = DType::f32;
  int64_t row_stride = 0;   // elements from one row to the next; 0: heads * head_step()
  int64_t head_stride = 0;  // elements from one head to the next; 0: dim

  constexpr int64_t head_step() const { return head_stride != 0 ? head_stride : dim; }
  constexpr int64_t row_step() const {
    return row_stride != 0 ? row_stride : int64_t{heads} * head_step();
  }
  // Element offset of (row, head, 0).
  constexpr int64_t offset(int64_t row, int64_t head) const {
    return row * row_step() + head * head_step();
  }
  constexpr int64_t elements() const { return rows * heads * dim; }  // logical elements
  constexpr bool is_contiguous() const {
    return head_step() == dim && row_step() == int64_t{heads} * dim;
  }
  constexpr bool empty() const { return data == nullptr; }
  // Whether the view can be read as its shape says: data is null only where there is no row (a
  // rank of the padding-free split that holds no token passes such views).
  constexpr bool addressable() const { return data != nullptr || rows == 0; }

  // Every writable view is also a read-only one.
  constexpr operator BasicTensorView<const void*>() const
    requires std::is_same_v<Ptr, void*>
  {
    return {data, rows, heads, dim, dtype, row_stride, head_stride};
  }
};

using TensorView = BasicTensorView<void*>;
using ConstTensorView = BasicTensorView<const void*>;

// Contiguous [rows, heads, dim] views of storage of `dtype` (fp32 for float pointers).
constexpr TensorView contiguous(void* data, int64_t rows, int heads, int dim, DType dtype) {
  return {data, rows, heads, dim, dtype, 0, 0};
}
constexpr ConstTensorView contiguous(const void* data, int64_t rows, int heads, int dim,
                                     DType dtype) {
  return {data, rows, heads, dim, dtype, 0, 0};
}
constexpr TensorView contiguous(float* data, int64_t rows, int heads, int dim) {
  return {data, rows, heads, dim, DType::f32, 0, 0};
}
constexpr ConstTensorView contiguous(const float* data, int64_t rows, int heads, int dim) {
  return {data, rows, heads, dim, DType::f32, 0, 0};
}

// One element of a view: (row, head, dim index).
struct ElementIndex {
  int64_t row = 0;  // token
  int head = 0;
  int dim = 0;
};

// The first NaN or infinite element of `t` in row, head, dim order (one pass, converted to
// fp32 a row of a head at a time), or nullopt when every element is finite.
std::optional<ElementIndex> first_nonfinite(ConstTensorView t);

// "`name` holds <value> at token T, head H, dim D" for messages: `value` is what the element
// holds (nan, inf, ...), `token` the row as the caller numbers it (e.g. the global token).
std::string describe_element(const char* name, float value, int64_t token, const ElementIndex& at);

}  // namespace cpattn
