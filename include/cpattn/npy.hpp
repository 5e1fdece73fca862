// NumPy .npy files (format versions 1.0, 2.0 and 3.0), little-endian, C order: what users
// exchange tensors with. Supported element types: float32 (<f4), float16 (<f2), int32 (<i4),
// int64 (<i8). Malformed files raise cpattn::Error naming the file and what is wrong.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace cpattn {

enum class NpyType { f32, f16, i32, i64 };

struct NpyArray {
  NpyType type = NpyType::f32;
  std::vector<int64_t> shape;
  std::vector<std::byte> data;  // elements, little-endian, C order

  int64_t elements() const;
  std::size_t element_size() const;
  // The elements converted to float or int64 (from any supported type).
  std::vector<float> as_float() const;
  std::vector<int64_t> as_int64() const;
};

// Parses the bytes of a whole .npy file; `name` is used in error messages.
NpyArray parse_npy(std::span<const std::byte> file, std::string_view name = "npy");
NpyArray read_npy(const std::string& path);
// The type and shape of the file at `path` from its header alone (data left empty), its size
// checked against them as read_npy does: for a budget before the data is read.
NpyArray read_npy_header(const std::string& path);

std::vector<std::byte> format_npy(const NpyArray& a);
void write_npy(const std::string& path, const NpyArray& a);
// A float32 array of the given shape.
std::vector<std::byte> format_npy(std::span<const float> values, std::vector<int64_t> shape);
void write_npy(const std::string& path, std::span<const float> values, std::vector<int64_t> shape);

}  // namespace cpattn
