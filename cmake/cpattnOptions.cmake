# Compiler settings shared by every cpattn target, through the interface target
# cpattn_build_options (never exported: it does not reach the library's users).
add_library(cpattn_build_options INTERFACE)
target_compile_features(cpattn_build_options INTERFACE cxx_std_20)
target_compile_options(cpattn_build_options INTERFACE
  -Wall -Wextra -Wpedantic -Wshadow -Wconversion -Wno-sign-conversion -Wnon-virtual-dtor
  $<$<BOOL:${CPATTN_WARNINGS_AS_ERRORS}>:-Werror>
  # __FILE__ (CPATTN_CHECK's location in every error's what()) relative to the source tree: the
  # build machine's paths stay out of users' messages and the installed libraries
  -fmacro-prefix-map=${PROJECT_SOURCE_DIR}/=)
if(CPATTN_SANITIZE)
  target_compile_options(cpattn_build_options INTERFACE
    -fsanitize=${CPATTN_SANITIZE} -fno-omit-frame-pointer -fno-sanitize-recover=all)
  target_link_options(cpattn_build_options INTERFACE -fsanitize=${CPATTN_SANITIZE})
endif()
if(CPATTN_BUILD_FUZZERS)
  # The layers the fuzzers link carry libFuzzer's coverage instrumentation and its sanitizers,
  # or the fuzzers would be blind inside the code they exercise (tests/fuzz).
  if(NOT CMAKE_CXX_COMPILER_ID MATCHES "Clang")
    message(FATAL_ERROR "CPATTN_BUILD_FUZZERS needs clang (the fuzz preset uses clang++-14)")
  endif()
  target_compile_options(cpattn_build_options INTERFACE
    -fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=all -g)
  target_link_options(cpattn_build_options INTERFACE -fsanitize=address,undefined)
endif()

# Code that only drives the libraries (the command line's parsing, JSON and reports; the
# tests' setup and assertions) builds at -O1 whatever the build type: the work it starts runs
# in the libraries, which keep the build type's optimization. At -O3 these header-heavy files
# (CLI11, nlohmann-json, GoogleTest) were most of an optimized build's compile time, and CI's
# budget (docs/design.md, "Build time"). Under a sanitizer they build at -O0: instrumented
# template code is where a sanitizer build's time goes (cmd_simulate.cpp under ASan: 63 s at -O1,
# 23 s at -O0), and the libraries the tests exercise keep their optimization.
add_library(cpattn_driver_options INTERFACE)
if(CPATTN_SANITIZE)
  target_compile_options(cpattn_driver_options INTERFACE -O0)
else()
  target_compile_options(cpattn_driver_options INTERFACE $<$<NOT:$<CONFIG:Debug>>:-O1>)
endif()
