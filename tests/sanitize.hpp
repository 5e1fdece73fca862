#pragma once

// Whether this test binary is built under ASan or TSan (the CI's asan and tsan presets), where
// it runs 5-20x slower (the emulated tile paths' scalar products far more): such tests run
// fewer or smaller cases there, and the optimized build runs them whole. GCC defines the
// __SANITIZE_* macros; clang answers __has_feature. (UBSan alone, which no preset builds,
// names itself to neither, and runs the tests whole.)
#if defined(__has_feature)
#define CPATTN_TEST_HAS_FEATURE(x) __has_feature(x)
#else
#define CPATTN_TEST_HAS_FEATURE(x) 0
#endif

namespace cpattn::test {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__) || CPATTN_TEST_HAS_FEATURE(address_sanitizer) || \
    CPATTN_TEST_HAS_FEATURE(thread_sanitizer)
inline constexpr bool kSanitize = true;
#else
inline constexpr bool kSanitize = false;
#endif
}  // namespace cpattn::test

#undef CPATTN_TEST_HAS_FEATURE
