#!/usr/bin/env bash
# Builds the libFuzzer targets with clang and runs each for a bounded time (default 30 s)
# from its seed corpus. A crash leaves its input in build/fuzz/crashes/; add it to the
# target's corpus and a regression test. Usage: scripts/fuzz.sh [seconds]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-30}
cmake --preset fuzz >/dev/null
cmake --build --preset fuzz --target fuzzers
mkdir -p build/fuzz/crashes
for t in fuzz_plan fuzz_npy fuzz_cli fuzz_profile fuzz_lengths fuzz_checkpoint; do
  work=build/fuzz/corpus/$t
  mkdir -p "$work"
  echo "fuzz: $t for ${seconds}s"
  # New inputs go to the scratch corpus; the seeds in the repository are read only.
  quiet=()
  [ "$t" = fuzz_cli ] && quiet=(-close_fd_mask=2)  # its error lines, one per input
  seeds=tests/fuzz/corpus/${t#fuzz_}
  [ "$t" = fuzz_profile ] && seeds=examples/profiles  # the documented profiles
  build/fuzz/tests/fuzz/$t -max_total_time="$seconds" -print_final_stats=1 -artifact_prefix=build/fuzz/crashes/ \
    -rss_limit_mb=4096 "${quiet[@]}" "$work" "$seeds" > "build/fuzz/$t.log" 2>&1 ||
    { tail -n 40 "build/fuzz/$t.log"; echo "fuzz: $t FAILED; inputs in build/fuzz/crashes/"; exit 1; }
  grep -E '^(stat::number_of_executed_units|stat::new_units_added)' "build/fuzz/$t.log" || true
done
