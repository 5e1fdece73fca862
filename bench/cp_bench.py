#!/usr/bin/env python3
"""CP=2 over MPI against one process with one and with two threads, in one script run
(issue: load-balanced KV all-gather CP). Every configuration is timed by `cpattn run`
(medians of --repeats forward+backward steps, after a check against a single-process run).

    bench/cp_bench.py build/release/tools/cpattn [--seq-len 8192] [--repeats 5]

Prints a Markdown table for docs/benchmarks.md."""
import argparse
import json
import os
import subprocess

ap = argparse.ArgumentParser()
ap.add_argument("cpattn")
ap.add_argument("--seq-len", type=int, default=8192)
ap.add_argument("--repeats", type=int, default=5)
ap.add_argument("--dtypes", default="fp32,bf16")
args = ap.parse_args()
env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
shape = ["--seq-len", str(args.seq_len), "--heads", "16", "--kv-heads", "4", "--head-dim", "128",
         "--repeats", str(args.repeats), "--json"]


def run(ranks, threads, dtype, mode="runs"):
    cmd = ["mpirun", "-np", str(ranks), "--oversubscribe", "--bind-to", "core" if ranks > 1 else "none",
           args.cpattn, "run", *shape, "--dtype", dtype, "--threads", str(threads), "--mode", mode]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    j = json.loads(r.stdout.strip().splitlines()[-1])
    assert j["passed"], j
    return j


print("| dtype | run | step s (max over ranks) | speed-up vs 1 thread | vs 2 threads | "
      "compute s per rank | comm share | peak RSS MB per rank |")
print("|---|---|---|---|---|---|---|---|")
for dtype in args.dtypes.split(","):
    one, two = run(1, 1, dtype), run(1, 2, dtype)
    cp2, cp2i = run(2, 1, dtype), run(2, 1, dtype, "index")
    t1, t2 = max(one["step_s"]), max(two["step_s"])
    for name, j in (("1 process, 1 thread", one), ("1 process, 2 threads", two),
                    ("CP=2, 2 ranks x 1 thread, runs", cp2), ("CP=2, 2 ranks x 1 thread, index", cp2i)):
        t = max(j["step_s"])
        share = max(c / s for c, s in zip(j["comm_s"], j["step_s"]))
        print(f"| {dtype} | {name} | {t:.3f} | {t1 / t:.2f} | {t2 / t:.2f} | "
              f"{', '.join(f'{c:.3f}' for c in j['compute_s'])} | {share:.1%} | "
              f"{', '.join(f'{m:.0f}' for m in j['peak_rss_mb'])} |")
    spread = max(cp2["compute_s"]) / min(cp2["compute_s"]) - 1
    print(f"| {dtype} | CP=2 compute spread (max/min - 1) | {spread:.2%} | | | | | |")
    print(f"| {dtype} | visible-pair imbalance: balanced / contiguous split | "
          f"{cp2['imbalance']['balanced']:.3f} / {cp2['imbalance']['contiguous']:.3f} | | | | | |")
    print(f"| {dtype} | peak buffers MB, runs / index | "
          f"{max(cp2['peak_buffer_mb']):.1f} / {max(cp2i['peak_buffer_mb']):.1f} | | | | | |")
