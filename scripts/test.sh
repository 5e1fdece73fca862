#!/usr/bin/env bash
# Runs every test: an optimized build with warnings as errors, then the same tests again
# under AddressSanitizer + UndefinedBehaviorSanitizer (internal asserts on); between the two,
# each libFuzzer target runs for a bounded time from its seed corpus and the kernel tests run
# under ThreadSanitizer; last, a Debug build (-O0) runs a few kernel cases on every path.
# Usage: scripts/test.sh [--fast] (--fast skips the sanitizer, fuzzing and Debug passes).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
jobs=$(nproc)
cmake --preset ci >/dev/null
cmake --build --preset ci -j "$jobs"
ctest --preset ci -j "$jobs"
scripts/test_python.sh                    # the Python package, against the ci build's CLI
if [ "${1:-}" != "--fast" ]; then
  scripts/fuzz.sh "${CPATTN_FUZZ_SECONDS:-20}"
  cmake --preset tsan >/dev/null          # the threaded kernels under ThreadSanitizer
  cmake --build --preset tsan -j "$jobs"
  ctest --preset tsan -j "$jobs"
  cmake --preset asan >/dev/null
  cmake --build --preset asan -j "$jobs"
  ctest --preset asan -j "$jobs"
  cmake --preset debug >/dev/null         # unoptimized code of every kernel path (a few cases)
  cmake --build --preset debug -j "$jobs"
  ctest --preset debug -j "$jobs"
fi
