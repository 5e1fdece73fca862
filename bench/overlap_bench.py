#!/usr/bin/env python3
"""Exposed against total communication of the all-gather scheme (docs/cp.md "Overlap"):
`cpattn run --scheme allgather` at cp = 2 on the CP benchmark's batch (T = 8192, Hq = 16,
Hkv = 4, D = 128), per dtype and --overlap setting, the settings (and --vs, an older build run
without the flag: "before") alternated run for run so that all see the same load on a shared
machine, and the medians.

    bench/overlap_bench.py build/ci/tools/cpattn [--overlap off,on] [--vs OLD_CPATTN]
                           [--runs 3] [--repeats 5]

Per (dtype, setting): the slowest rank's step (forward + backward, median of --repeats
steps), its compute, its exposed communication (CpStats::comm_s: time inside communication
calls, i.e. waited, the agreement included) and total communication (comm_total_s: exposed
plus the overlapped transfers' time in flight under compute, an upper bound; "-" for a build
that does not report it), each the median over --runs whole runs; exposed as a share of the
step, and by part (CpStats::agree_s, first_kv_s, later_kv_s, dkv_s: the agreement, the wait for
the first K/V, the later groups' waits and polls, the dK/dV reduce-scatter: means over the
steps, which add up to comm_s's mean, each the median over the runs; "-" for a build that does
not report them). Every run passes its check against a single process (asserted).
Prints Markdown."""
import argparse
import json
import os
import statistics
import subprocess

ap = argparse.ArgumentParser()
ap.add_argument("cpattn")
ap.add_argument("--vs", default="", help="an older cpattn build, run without --overlap (the 'before')")
ap.add_argument("--seq-len", type=int, default=8192)
ap.add_argument("--repeats", type=int, default=5)
ap.add_argument("--runs", type=int, default=3)
ap.add_argument("--dtypes", default="fp32,bf16")
ap.add_argument("--overlap", default="off,on", help="comma list of on, off")
ap.add_argument("--cp", type=int, default=2)
args = ap.parse_args()
env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")


def run(binary, dtype, overlap):
    cmd = ["mpirun", "-np", str(args.cp), "--oversubscribe", "--bind-to", "core", binary, "run",
           "--scheme", "allgather", "--seq-len", str(args.seq_len), "--heads", "16", "--kv-heads", "4",
           "--head-dim", "128", "--repeats", str(args.repeats), "--dtype", dtype, "--json"]
    if overlap:
        cmd += ["--overlap", overlap]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    j = json.loads(r.stdout.strip().splitlines()[-1])
    assert j["passed"], "the CP run does not match the single-process run"
    slowest = max(range(len(j["step_s"])), key=lambda i: j["step_s"][i])
    total = j.get("comm_total_s", [None] * len(j["step_s"]))[slowest]
    parts = tuple(j[k][slowest] for k in PARTS) if all(k in j for k in PARTS) else None
    return j["step_s"][slowest], j["compute_s"][slowest], j["comm_s"][slowest], total, parts


PARTS = ("agree_s", "first_kv_s", "later_kv_s", "dkv_s", "comm_mean_s")


settings = [(args.cpattn, ov, f"overlap {ov}") for ov in args.overlap.split(",")]
if args.vs:
    settings.insert(0, (args.vs, "", f"before ({args.vs})"))
print("| dtype | build | step s | compute s | exposed comm s (share of step) | total comm s | "
      "exposed, means over the steps: agreement + first K/V + later K/V + dK/dV = total s |")
print("|---|---|---|---|---|---|---|")
for dtype in args.dtypes.split(","):
    rows = {label: [] for _, _, label in settings}
    for _ in range(args.runs):
        for binary, ov, label in settings:
            rows[label].append(run(binary, dtype, ov))
    for _, _, label in settings:
        rs = rows[label]
        step, compute, exposed = (statistics.median(r[i] for r in rs) for i in range(3))
        totals = [r[3] for r in rs if r[3] is not None]
        total = f"{statistics.median(totals):.4f}" if totals else "-"
        parts = [r[4] for r in rs if r[4] is not None]
        med = [statistics.median(p[i] for p in parts) for i in range(len(PARTS))] if parts else []
        by_part = " + ".join(f"{x:.4f}" for x in med[:-1]) + f" = {med[-1]:.4f}" if parts else "-"
        print(f"| {dtype} | {label} | {step:.3f} | {compute:.3f} | {exposed:.4f} ({100 * exposed / step:.1f}%) "
              f"| {total} | {by_part} |", flush=True)
