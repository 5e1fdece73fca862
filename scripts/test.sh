#!/usr/bin/env bash
# Runs every test: an optimized build with warnings as errors, then the same tests again
# under AddressSanitizer + UndefinedBehaviorSanitizer (internal asserts on); between the two,
# each libFuzzer target runs for a bounded time from its seed corpus and the kernel tests run
# under ThreadSanitizer; last, a Debug build (-O0) runs a few kernel cases on every path.
# Usage: scripts/test.sh [--fast] (--fast skips the sanitizer, fuzzing and Debug passes).
set -euo pipefail
cd "$(dirname "$0")/.."
mark() { echo "== test.sh: $1 at ${SECONDS} s"; }  # where CI's time goes (its budget: 45 min on 2 cores)
scripts/setup.sh
mark "setup done"
jobs=$(nproc)
cmake --preset ci >/dev/null
cmake --build --preset ci -j "$jobs"
mark "ci built"
ctest --preset ci -j "$jobs"
mark "ci tested"
scripts/test_python.sh                    # the Python package, against the ci build's CLI
mark "python tested"
if [ "${1:-}" != "--fast" ]; then
  scripts/fuzz.sh "${CPATTN_FUZZ_SECONDS:-20}"
  mark "fuzzed"
  cmake --preset tsan >/dev/null          # the threaded kernels under ThreadSanitizer
  cmake --build --preset tsan -j "$jobs"
  mark "tsan built"
  ctest --preset tsan -j "$jobs"
  mark "tsan tested"
  cmake --preset asan >/dev/null
  cmake --build --preset asan -j "$jobs"
  mark "asan built"
  ctest --preset asan -j "$jobs"
  mark "asan tested"
  cmake --preset debug >/dev/null         # unoptimized code of every kernel path (a few cases)
  cmake --build --preset debug -j "$jobs"
  ctest --preset debug -j "$jobs"
  mark "debug tested"
fi
