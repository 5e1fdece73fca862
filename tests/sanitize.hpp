#pragma once

// Whether this test binary is built under a sanitizer (the CI's asan and tsan presets), where
// it runs 5-20x slower (the emulated tile paths' scalar products far more): such tests run
// fewer or smaller cases there, and the optimized build runs them whole. GCC defines these
// macros for -fsanitize=address and -fsanitize=thread.
namespace cpattn::test {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
inline constexpr bool kSanitize = true;
#else
inline constexpr bool kSanitize = false;
#endif
}  // namespace cpattn::test
