# Compiler settings shared by every cpattn target, through the interface target
# cpattn_build_options (never exported: it does not reach the library's users).
add_library(cpattn_build_options INTERFACE)
target_compile_features(cpattn_build_options INTERFACE cxx_std_20)
target_compile_options(cpattn_build_options INTERFACE
  -Wall -Wextra -Wpedantic -Wshadow -Wconversion -Wno-sign-conversion -Wnon-virtual-dtor
  $<$<BOOL:${CPATTN_WARNINGS_AS_ERRORS}>:-Werror>)
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
