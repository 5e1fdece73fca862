#pragma once

// Whether this test binary is built under ASan or TSan (the CI's asan and tsan presets), where
// it runs 5-20x slower (the emulated tile paths' scalar products far more): such tests run
// fewer or smaller cases there, and the optimized build runs them whole. GCC defines the
// __SANITIZE_* macros; clang answers __has_feature.
namespace cpattn::test {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
inline constexpr bool kSanitize = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
inline constexpr bool kSanitize = true;
#else
inline constexpr bool kSanitize = false;
#endif
#else
inline constexpr bool kSanitize = false;
#endif
}  // namespace cpattn::test
