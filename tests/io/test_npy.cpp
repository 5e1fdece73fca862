#include <cpattn/error.hpp>
#include <cpattn/npy.hpp>

#include "temp_dir.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace cpattn {
namespace {

using ::testing::HasSubstr;

std::vector<std::byte> bytes_of(const std::string& s) {
  std::vector<std::byte> b(s.size());
  std::memcpy(b.data(), s.data(), s.size());
  return b;
}

// A file as numpy.save writes it for np.array([[1, 2, 3], [4, 5, 6]], dtype='<i8'), built by
// hand from the format's specification: magic, version 1.0, little-endian header length,
// the dict padded with spaces to a multiple of 64 bytes, a newline, then the data.
std::string hand_made_i8() {
  std::string header = "{'descr': '<i8', 'fortran_order': False, 'shape': (2, 3), }";
  header.append((64 - (10 + header.size() + 1) % 64) % 64, ' ');
  header += '\n';
  std::string file = std::string("\x93NUMPY\x01\x00", 8);
  file += static_cast<char>(header.size());
  file += '\0';
  file += header;
  for (int64_t v = 1; v <= 6; ++v) file.append(reinterpret_cast<const char*>(&v), 8);
  return file;
}

TEST(Npy, ReadsWhatNumpyWrites) {
  const NpyArray a = parse_npy(bytes_of(hand_made_i8()));
  EXPECT_EQ(a.type, NpyType::i64);
  EXPECT_EQ(a.shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(a.as_int64(), (std::vector<int64_t>{1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(a.as_float(), (std::vector<float>{1, 2, 3, 4, 5, 6}));
  // And writes the same bytes.
  EXPECT_EQ(format_npy(a), bytes_of(hand_made_i8()));
}

TEST(Npy, RoundTripsEveryTypeAndShape) {
  const std::string dir = ::testing::TempDir();
  const std::vector<float> v{1.5f, -2.0f, 0.25f, 8.0f};
  write_npy(dir + "/f.npy", v, {2, 2});
  const NpyArray f = read_npy(dir + "/f.npy");
  EXPECT_EQ(f.type, NpyType::f32);
  EXPECT_EQ(f.shape, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(f.as_float(), v);
  NpyArray h{.type = NpyType::f16, .shape = {3}, .data = std::vector<std::byte>(6)};
  const uint16_t halves[3] = {0x3c00, 0xc000, 0x3800};  // 1, -2, 0.5
  std::memcpy(h.data.data(), halves, 6);
  EXPECT_EQ(parse_npy(format_npy(h)).as_float(), (std::vector<float>{1.0f, -2.0f, 0.5f}));
  NpyArray i{.type = NpyType::i32, .shape = {2}, .data = std::vector<std::byte>(8)};
  const int32_t ints[2] = {0, 40};
  std::memcpy(i.data.data(), ints, 8);
  EXPECT_EQ(parse_npy(format_npy(i)).as_int64(), (std::vector<int64_t>{0, 40}));
  NpyArray scalar{.type = NpyType::f32, .shape = {}, .data = std::vector<std::byte>(4)};
  EXPECT_EQ(parse_npy(format_npy(scalar)).elements(), 1);
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::FILE* out = std::fopen(path.c_str(), "wb");
  ASSERT_NE(out, nullptr) << path;
  EXPECT_EQ(std::fwrite(bytes.data(), 1, bytes.size(), out), bytes.size());
  std::fclose(out);
}

// A header read alone gives the file's type and shape, with its size checked as read_npy checks
// it; read_npy gives the same type, shape and data. A 16 GiB sparse file's header is read in
// a moment without its data (a budget before the read: cpattn run --npy-in).
TEST(Npy, AHeaderReadAloneIsTheFilesTypeAndShape) {
  const testing::TempDir t;
  const std::string path = t / "h.npy";
  const std::string f = hand_made_i8();
  write_bytes(path, f);
  const NpyArray head = read_npy_header(path), whole = read_npy(path);
  EXPECT_EQ(head.type, NpyType::i64);
  EXPECT_EQ(head.shape, (std::vector<int64_t>{2, 3}));
  EXPECT_TRUE(head.data.empty());
  EXPECT_EQ(whole.shape, head.shape);
  EXPECT_EQ(whole.as_int64(), (std::vector<int64_t>{1, 2, 3, 4, 5, 6}));
  ASSERT_EQ(::truncate(path.c_str(), static_cast<off_t>(f.size() - 8)), 0);  // one element short
  try {
    (void)read_npy_header(path);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_THAT(e.message(), HasSubstr(path + ": .npy data holds 40 bytes, the shape needs 6 elements of 8 bytes"));
  }
  // 2^31 rows of 8 bytes: the data is never read (the file is sparse: its blocks are holes)
  std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': (2147483648, 2), }";
  header.append((64 - (10 + header.size() + 1) % 64) % 64, ' ');
  header += '\n';
  std::string file = std::string("\x93NUMPY\x01\x00", 8);
  file += static_cast<char>(header.size() & 0xff);
  file += static_cast<char>(header.size() >> 8);
  file += header;
  const std::string big = t / "big.npy";
  write_bytes(big, file);
  ASSERT_EQ(::truncate(big.c_str(), static_cast<off_t>(file.size() + (uint64_t{1} << 34))), 0);
  const NpyArray big_head = read_npy_header(big);
  EXPECT_EQ(big_head.shape, (std::vector<int64_t>{int64_t{1} << 31, 2}));
  EXPECT_TRUE(big_head.data.empty());
}

std::string error_of(const std::string& file) {
  try {
    parse_npy(bytes_of(file), "x.npy");
  } catch (const Error& e) {
    return e.message();
  }
  return "no error";
}

TEST(Npy, MalformedFilesAreNamed) {
  EXPECT_THAT(error_of("hello"), HasSubstr("x.npy: not a .npy file"));
  std::string f = hand_made_i8();
  EXPECT_THAT(error_of(f.substr(0, f.size() - 1)), HasSubstr("the shape needs"));
  EXPECT_THAT(error_of(f + "x"), HasSubstr("the shape needs exactly"));
  std::string wrong_type = f;
  wrong_type.replace(wrong_type.find("<i8"), 3, ">f8");
  EXPECT_THAT(error_of(wrong_type), HasSubstr("unsupported .npy dtype '>f8'"));
  std::string fortran = f;
  fortran.replace(fortran.find("False"), 5, "True ");
  EXPECT_THAT(error_of(fortran), HasSubstr("Fortran-order"));
  std::string long_header = f;
  long_header[8] = '\xff';
  EXPECT_THAT(error_of(long_header), HasSubstr("runs past the end"));
  std::string version = f;
  version[6] = '\x07';
  EXPECT_THAT(error_of(version), HasSubstr("unsupported .npy format version 7.0"));
  std::string minor = f;
  minor[7] = '\x05';
  EXPECT_THAT(error_of(minor), HasSubstr("unsupported .npy format version 1.5"));
  EXPECT_THAT(error_of(std::string("\x93NUMPY\x01\x00\x04\x00{}  ", 14)), HasSubstr("no 'descr' key"));
  EXPECT_THROW(read_npy("/nonexistent/x.npy"), Error);
}

}  // namespace
}  // namespace cpattn
