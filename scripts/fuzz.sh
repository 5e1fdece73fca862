#!/usr/bin/env bash
# Builds the libFuzzer targets with clang and runs each for a bounded time (default 30 s)
# from its seed corpus, as many at once as there are cores (each target is one process). A
# crash leaves its input in build/fuzz/crashes/; add it to the target's corpus and a
# regression test. Usage: scripts/fuzz.sh [seconds]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-30}
cmake --preset fuzz >/dev/null
cmake --build --preset fuzz --target fuzzers
mkdir -p build/fuzz/crashes
targets=(fuzz_plan fuzz_npy fuzz_cli fuzz_profile fuzz_lengths fuzz_checkpoint)

run_target() {  # one target from its seeds; its log in build/fuzz/<target>.log
  local t=$1 work=build/fuzz/corpus/$1 seeds=tests/fuzz/corpus/${1#fuzz_} quiet=()
  mkdir -p "$work"
  [ "$t" = fuzz_cli ] && quiet=(-close_fd_mask=2)  # its error lines, one per input
  [ "$t" = fuzz_profile ] && seeds=examples/profiles  # the documented profiles
  # New inputs go to the scratch corpus; the seeds in the repository are read only.
  build/fuzz/tests/fuzz/$t -max_total_time="$seconds" -print_final_stats=1 \
    -artifact_prefix=build/fuzz/crashes/ -rss_limit_mb=4096 "${quiet[@]}" "$work" "$seeds" \
    > "build/fuzz/$t.log" 2>&1
}

slots=$(nproc)
declare -A pid_of=()
failed=()
finish() {  # waits for target $1 and reports it
  local t=$1
  if wait "${pid_of[$t]}"; then
    echo "fuzz: $t ran ${seconds}s"
    grep -E '^(stat::number_of_executed_units|stat::new_units_added)' "build/fuzz/$t.log" || true
  else
    tail -n 40 "build/fuzz/$t.log" || true
    echo "fuzz: $t FAILED; inputs in build/fuzz/crashes/"
    failed+=("$t")
  fi
}
trap 'kill $(jobs -p) 2>/dev/null || true' EXIT  # an interrupted run leaves no fuzzer behind
started=()
for t in "${targets[@]}"; do
  if ((${#started[@]} >= slots)); then  # a slot frees when the oldest running target ends
    finish "${started[0]}"
    started=("${started[@]:1}")
  fi
  run_target "$t" & pid_of[$t]=$!
  started+=("$t")
done
for t in "${started[@]}"; do finish "$t"; done
((${#failed[@]} == 0)) || { echo "fuzz: failed: ${failed[*]}"; exit 1; }
