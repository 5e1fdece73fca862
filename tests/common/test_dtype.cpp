// to_float / from_float's loops on every instruction set this CPU runs against the scalar
// conversions of dtype.hpp, bit for bit: every 16-bit pattern one way; the other way every float
// exponent with the mantissas where rounding turns (ties to even and either side of them at
// every mantissa bit, so fp16's subnormals and both formats' overflow to inf too), NaNs of
// every kind, with MXCSR's DAZ and FTZ off and on, and lengths that leave every tail.
#include <cpattn/dtype.hpp>

#include "../src/common/convert.hpp"

#include <gtest/gtest.h>

#if defined(__x86_64__)
#include <xmmintrin.h>  // _mm_getcsr, _mm_setcsr
#endif

#include <bit>
#include <cstdint>
#include <ostream>
#include <random>
#include <string>
#include <vector>

namespace cpattn {
namespace detail {
void PrintTo(ConvertIsa isa, std::ostream* os) { *os << to_string(isa); }  // (GoogleTest's name for a parameter)
}  // namespace detail
namespace {

using detail::ConvertIsa;

std::string name_of(ConvertIsa isa) { return std::string(detail::to_string(isa)); }

// The float bit patterns: both signs, every exponent, mantissas at and beside a rounding point
// at every bit from fp16's (bit 13; higher for its subnormals) and bf16's (bit 16) up, their
// ties with an even and an odd kept part and with all kept bits set (which overflow to inf at
// the largest exponents), the extremes, and random ones; with exponent 255 these are the
// infinities and NaNs (quiet and signaling, with payloads high and low).
std::vector<float> float_cases() {
  std::vector<uint32_t> mant = {0, 1, 2, 0x7fffff, 0x400000, 0x3fffff, 0x200000};
  for (uint32_t bit = 13; bit <= 23; ++bit)
    for (const uint32_t kept : {0u, 1u, 2u, 3u, 0x3fu, 0x7fu, 0x3ffu})
      for (const int32_t d : {-1, 0, 1}) {
        const uint32_t half = 1u << (bit - 1);
        mant.push_back(((kept << bit) | half) + static_cast<uint32_t>(d));
      }
  std::mt19937 rng(7);
  for (int i = 0; i < 24; ++i) mant.push_back(rng() & 0x7fffffu);
  std::vector<float> out;
  for (uint32_t sign = 0; sign < 2; ++sign)
    for (uint32_t e = 0; e < 256; ++e)
      for (const uint32_t m : mant) out.push_back(std::bit_cast<float>(sign << 31 | e << 23 | (m & 0x7fffffu)));
  return out;
}

// Runs fn with MXCSR's DAZ and FTZ off, then on (x86; elsewhere once), restoring MXCSR.
template <class Fn>
void with_and_without_daz_ftz(Fn&& fn) {
#if defined(__x86_64__)
  const unsigned saved = _mm_getcsr();
  for (const unsigned flags : {0u, 0x8040u}) {  // DAZ (bit 6), FTZ (bit 15)
    _mm_setcsr((saved & ~0x8040u) | flags);
    SCOPED_TRACE(flags ? "DAZ and FTZ on" : "DAZ and FTZ off");
    fn();
    _mm_setcsr(saved);
    if (::testing::Test::HasFatalFailure()) return;
  }
#else
  fn();
#endif
}

class Convert : public ::testing::TestWithParam<ConvertIsa> {
 protected:
  void SetUp() override {
    if (!detail::convert_isa_runs(GetParam()))
      GTEST_SKIP() << "this CPU does not run the " << name_of(GetParam()) << " conversions";
  }
};

TEST_P(Convert, FromFloatGivesTheScalarBits) {
  const std::vector<float> x = float_cases();
  with_and_without_daz_ftz([&] {
    for (const DType t : {DType::bf16, DType::f16}) {
      std::vector<uint16_t> got(x.size() + 1, 0xabcd);
      detail::from_float_with(GetParam(), x.data(), x.size(), t, got.data());
      for (std::size_t i = 0; i < x.size(); ++i) {
        const uint16_t want = t == DType::f16 ? f32_to_f16(x[i]) : f32_to_bf16(x[i]);
        ASSERT_EQ(got[i], want) << to_string(t) << " of float bits 0x" << std::hex << std::bit_cast<uint32_t>(x[i]);
      }
      EXPECT_EQ(got[x.size()], 0xabcd) << "wrote past n";
    }
  });
}

TEST_P(Convert, ToFloatGivesTheScalarBits) {
  std::vector<uint16_t> h(65536);
  for (uint32_t i = 0; i < h.size(); ++i) h[i] = static_cast<uint16_t>(i);
  with_and_without_daz_ftz([&] {
    for (const DType t : {DType::bf16, DType::f16}) {
      std::vector<float> got(h.size() + 1, 42.0f);
      detail::to_float_with(GetParam(), h.data(), t, h.size(), got.data());
      for (std::size_t i = 0; i < h.size(); ++i) {
        const float want = t == DType::f16 ? f16_to_f32(h[i]) : bf16_to_f32(h[i]);
        ASSERT_EQ(std::bit_cast<uint32_t>(got[i]), std::bit_cast<uint32_t>(want))
            << to_string(t) << " of bits 0x" << std::hex << h[i];
      }
      EXPECT_EQ(got[h.size()], 42.0f) << "wrote past n";
    }
  });
}

// Every length up to 40 from every start up to 16 (the vector bodies, their scalar tails and
// unaligned starts), each element where it belongs and nothing written around the range.
TEST_P(Convert, EveryLengthAndStart) {
  std::vector<float> x(64);
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (float& v : x) v = normal(rng);
  std::vector<uint16_t> h(64);
  for (std::size_t i = 0; i < h.size(); ++i) h[i] = f32_to_bf16(x[i]);
  for (const DType t : {DType::bf16, DType::f16})
    for (std::size_t start = 0; start <= 16; ++start)
      for (std::size_t n = 0; n <= 40; ++n) {
        std::vector<uint16_t> got(64, 0x5555);
        detail::from_float_with(GetParam(), x.data() + start, n, t, got.data() + start);
        std::vector<float> f(64, -7.0f);
        detail::to_float_with(GetParam(), h.data() + start, t, n, f.data() + start);
        for (std::size_t i = 0; i < 64; ++i) {
          const bool in = i >= start && i < start + n;
          const uint16_t want = !in ? 0x5555 : t == DType::f16 ? f32_to_f16(x[i]) : f32_to_bf16(x[i]);
          ASSERT_EQ(got[i], want) << to_string(t) << " from_float start " << start << " n " << n << " at " << i;
          const float fw = !in ? -7.0f : t == DType::f16 ? f16_to_f32(h[i]) : bf16_to_f32(h[i]);
          ASSERT_EQ(std::bit_cast<uint32_t>(f[i]), std::bit_cast<uint32_t>(fw))
              << to_string(t) << " to_float start " << start << " n " << n << " at " << i;
        }
      }
}

INSTANTIATE_TEST_SUITE_P(Isa, Convert, ::testing::Values(ConvertIsa::scalar, ConvertIsa::avx2, ConvertIsa::avx512),
                         [](const auto& param_info) { return name_of(param_info.param); });

// The public entry points take the widest loops and keep fp32 a copy.
TEST(ConvertEntryPoints, MatchTheScalarConversions) {
  const std::vector<float> x = float_cases();
  for (const DType t : {DType::f32, DType::bf16, DType::f16}) {
    std::vector<std::byte> stored(x.size() * dtype_size(t));
    from_float(x.data(), x.size(), t, stored.data());
    std::vector<float> back(x.size());
    to_float(stored.data(), t, x.size(), back.data());
    for (std::size_t i = 0; i < x.size(); ++i) {
      const float want = round_to_dtype(t, x[i]);
      ASSERT_EQ(std::bit_cast<uint32_t>(back[i]), std::bit_cast<uint32_t>(want))
          << to_string(t) << " of float bits 0x" << std::hex << std::bit_cast<uint32_t>(x[i]);
    }
  }
}

}  // namespace
}  // namespace cpattn
