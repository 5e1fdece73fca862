#include <cpattn/dtype.hpp>
#include <cpattn/error.hpp>
#include <cpattn/npy.hpp>
#include <cpattn/file.hpp>

#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>

namespace cpattn {

namespace {

constexpr char kMagic[] = "\x93NUMPY";

std::size_t type_size(NpyType t) { return t == NpyType::f16 ? 2 : t == NpyType::i64 ? 8 : 4; }
const char* descr_of(NpyType t) {
  switch (t) {
    case NpyType::f32: return "<f4";
    case NpyType::f16: return "<f2";
    case NpyType::i32: return "<i4";
    case NpyType::i64: return "<i8";
  }
  return "?";
}

// The value of `key` in the header's Python dict literal, as raw text.
std::string_view dict_value(std::string_view header, std::string_view key, std::string_view name) {
  std::string quoted(key.size() + 2, '\'');  // 'key' (GCC 12 misreads "'" + std::string + "'")
  key.copy(quoted.data() + 1, key.size());
  const auto at = header.find(quoted);
  CPATTN_CHECK(at != std::string_view::npos, name, ": .npy header has no ", quoted, " key");
  auto rest = header.substr(at + quoted.size());
  const auto colon = rest.find(':');
  CPATTN_CHECK(colon != std::string_view::npos, name, ": .npy header: no ':' after ", quoted);
  rest = rest.substr(colon + 1);
  while (!rest.empty() && rest.front() == ' ') rest.remove_prefix(1);
  CPATTN_CHECK(!rest.empty(), name, ": .npy header ends after ", quoted);
  const char open = rest.front();
  const char close = open == '(' ? ')' : open == '\'' ? '\'' : '\0';
  if (close != '\0') {
    const auto end = rest.find(close, 1);
    CPATTN_CHECK(end != std::string_view::npos, name, ": .npy header: unterminated value of ", quoted);
    return rest.substr(1, end - 1);
  }
  const auto end = rest.find_first_of(",}");
  return rest.substr(0, end);
}

}  // namespace

int64_t NpyArray::elements() const {
  int64_t n = 1;
  for (const int64_t d : shape) n *= d;
  return n;
}
std::size_t NpyArray::element_size() const { return type_size(type); }

std::vector<float> NpyArray::as_float() const {
  const auto n = static_cast<std::size_t>(elements());
  std::vector<float> out(n);
  for (std::size_t i = 0; i < n; ++i) {
    const std::byte* p = data.data() + i * element_size();
    switch (type) {
      case NpyType::f32: std::memcpy(&out[i], p, 4); break;
      case NpyType::f16: { uint16_t h; std::memcpy(&h, p, 2); out[i] = f16_to_f32(h); break; }
      case NpyType::i32: { int32_t v; std::memcpy(&v, p, 4); out[i] = static_cast<float>(v); break; }
      case NpyType::i64: { int64_t v; std::memcpy(&v, p, 8); out[i] = static_cast<float>(v); break; }
    }
  }
  return out;
}

std::vector<int64_t> NpyArray::as_int64() const {
  const auto n = static_cast<std::size_t>(elements());
  std::vector<int64_t> out(n);
  for (std::size_t i = 0; i < n; ++i) {
    const std::byte* p = data.data() + i * element_size();
    switch (type) {
      case NpyType::i32: { int32_t v; std::memcpy(&v, p, 4); out[i] = v; break; }
      case NpyType::i64: std::memcpy(&out[i], p, 8); break;
      default: CPATTN_CHECK(false, "as_int64: the array holds floating-point values (", descr_of(type), ")");
    }
  }
  return out;
}

namespace {

// A header's fields and where its data begins.
struct Header {
  NpyArray a;  // type and shape; data empty
  std::size_t data_at = 0;
};

// The header at the start of `file` (the whole file, or its first bytes: at least the header's)
// of a file of `file_size` bytes, whose data must be exactly the shape's.
Header parse_header(std::span<const std::byte> file, std::uint64_t file_size, std::string_view name) {
  CPATTN_CHECK(file.size() >= 10 && std::memcmp(file.data(), kMagic, 6) == 0, name,
               ": not a .npy file (no \\x93NUMPY magic)");
  const auto major = static_cast<uint8_t>(file[6]), minor = static_cast<uint8_t>(file[7]);
  CPATTN_CHECK(major >= 1 && major <= 3 && minor == 0, name, ": unsupported .npy format version ", int{major}, ".",
               int{minor}, " (NumPy writes 1.0, 2.0 and 3.0)");
  std::size_t header_len = 0, header_at = 0;
  if (major == 1) {
    header_len = static_cast<std::size_t>(file[8]) | static_cast<std::size_t>(file[9]) << 8;
    header_at = 10;
  } else {
    CPATTN_CHECK(file.size() >= 12, name, ": truncated .npy header");
    for (int i = 0; i < 4; ++i) header_len |= static_cast<std::size_t>(file[8 + i]) << (8 * i);
    header_at = 12;
  }
  CPATTN_CHECK(header_len <= file_size - header_at, name, ": .npy header length ", header_len,
               " runs past the end of the file (", file_size, " bytes)");
  CPATTN_CHECK(header_len <= file.size() - header_at, name, ": .npy header of ", header_len, " bytes not read whole");
  const std::string_view header(reinterpret_cast<const char*>(file.data() + header_at), header_len);

  NpyArray a;
  const std::string_view descr = dict_value(header, "descr", name);
  if (descr == "<f4") a.type = NpyType::f32;
  else if (descr == "<f2") a.type = NpyType::f16;
  else if (descr == "<i4") a.type = NpyType::i32;
  else if (descr == "<i8") a.type = NpyType::i64;
  else CPATTN_CHECK(false, name, ": unsupported .npy dtype '", descr, "' (want <f4, <f2, <i4 or <i8)");
  const std::string_view order = dict_value(header, "fortran_order", name);
  CPATTN_CHECK(order.starts_with("False"), name, ": Fortran-order .npy arrays are not supported");
  std::string_view shape = dict_value(header, "shape", name);
  int64_t n = 1;
  while (!shape.empty()) {
    while (!shape.empty() && (shape.front() == ' ' || shape.front() == ',')) shape.remove_prefix(1);
    if (shape.empty()) break;
    int64_t d = 0;
    std::size_t digits = 0;
    while (digits < shape.size() && shape[digits] >= '0' && shape[digits] <= '9') {
      CPATTN_CHECK(d <= (std::numeric_limits<int64_t>::max() - 9) / 10, name, ": .npy shape entry too large");
      d = d * 10 + (shape[digits] - '0');
      ++digits;
    }
    CPATTN_CHECK(digits > 0, name, ": .npy shape holds a non-integer entry");
    CPATTN_CHECK(d == 0 || n <= std::numeric_limits<int64_t>::max() / d, name, ": .npy shape too large");
    n *= d;
    a.shape.push_back(d);
    shape.remove_prefix(digits);
  }
  const std::size_t data_at = header_at + header_len;
  const std::uint64_t have = file_size - data_at;
  CPATTN_CHECK(static_cast<uint64_t>(n) <= have / type_size(a.type), name, ": .npy data holds ", have,
               " bytes, the shape needs ", n, " elements of ", type_size(a.type), " bytes");
  CPATTN_CHECK(static_cast<std::uint64_t>(n) * type_size(a.type) == have, name, ": .npy data holds ", have,
               " bytes, the shape needs exactly ", static_cast<std::size_t>(n) * type_size(a.type));
  return {std::move(a), data_at};
}

}  // namespace

NpyArray parse_npy(std::span<const std::byte> file, std::string_view name) {
  Header h = parse_header(file, file.size(), name);
  h.a.data.assign(file.begin() + static_cast<std::ptrdiff_t>(h.data_at), file.end());
  return std::move(h.a);
}

NpyArray read_npy(const std::string& path) {
  // A FIFO blocked here for ever (ifstream's open waits for a writer), a folder gave
  // "basic_filebuf::underflow": both refused by their kind, naming the path.
  std::vector<std::byte> bytes = read_regular_file(path);
  Header h = parse_header(bytes, bytes.size(), path);
  // The data moved to the front of the file's own buffer: no second copy of a large tensor.
  bytes.erase(bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(h.data_at));
  h.a.data = std::move(bytes);
  return std::move(h.a);
}

NpyArray read_npy_header(const std::string& path) {
  // NumPy's headers are small (version 1.0: at most 65535 bytes); a longer 2.0/3.0 header is
  // read again whole.
  std::uint64_t size = 0;
  std::vector<std::byte> head = read_file_prefix(path, (std::size_t{1} << 16) + 16, size);  // (10 + 65535)
  if (head.size() >= 12 && std::memcmp(head.data(), kMagic, 6) == 0 && static_cast<uint8_t>(head[6]) >= 2) {
    std::uint64_t len = 0;
    for (int i = 0; i < 4; ++i) len |= static_cast<std::uint64_t>(head[8 + static_cast<std::size_t>(i)]) << (8 * i);
    if (12 + len > head.size() && 12 + len <= size) head = read_file_prefix(path, static_cast<std::size_t>(12 + len), size);
  }
  return parse_header(head, size, path).a;
}

namespace {

// A .npy file of `type` and `shape` whose data are `bytes` (one copy, into the file's bytes).
std::vector<std::byte> format_file(NpyType type, const std::vector<int64_t>& shape, std::span<const std::byte> bytes) {
  int64_t elements = 1;
  for (const int64_t d : shape) elements *= d;
  CPATTN_CHECK(static_cast<std::size_t>(elements) * type_size(type) == bytes.size(),
               "format_npy: data holds ", bytes.size(), " bytes for a shape of ", elements, " elements");
  // As numpy writes it: (), (3,), (2, 3).
  std::string dims = "(";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) dims += ", ";
    dims += std::to_string(shape[i]);
  }
  if (shape.size() == 1) dims += ",";
  dims += ")";
  std::string header = std::string("{'descr': '") + descr_of(type) + "', 'fortran_order': False, 'shape': " +
                       dims + ", }";
  // Pad with spaces so that the data starts at a multiple of 64 bytes; end with a newline.
  const std::size_t unpadded = 10 + header.size() + 1;
  header.append((64 - unpadded % 64) % 64, ' ');
  header += '\n';
  CPATTN_CHECK(header.size() <= 65535, "format_npy: header too long");
  std::vector<std::byte> out(10 + header.size() + bytes.size());
  std::memcpy(out.data(), kMagic, 6);
  out[6] = std::byte{1};
  out[7] = std::byte{0};
  out[8] = static_cast<std::byte>(header.size() & 0xff);
  out[9] = static_cast<std::byte>(header.size() >> 8);
  std::memcpy(out.data() + 10, header.data(), header.size());
  if (!bytes.empty()) std::memcpy(out.data() + 10 + header.size(), bytes.data(), bytes.size());
  return out;
}

}  // namespace

std::vector<std::byte> format_npy(const NpyArray& a) { return format_file(a.type, a.shape, a.data); }

void write_npy(const std::string& path, const NpyArray& a) {
  const std::vector<std::byte> bytes = format_npy(a);
  write_file_atomically(path, bytes);  // checked, fsynced, renamed: never half a file
}

std::vector<std::byte> format_npy(std::span<const float> values, std::vector<int64_t> shape) {
  return format_file(NpyType::f32, shape, std::as_bytes(values));
}

void write_npy(const std::string& path, std::span<const float> values, std::vector<int64_t> shape) {
  write_file_atomically(path, format_npy(values, std::move(shape)));
}

}  // namespace cpattn
