#!/usr/bin/env python3
"""Every CP scheme on the CP benchmark's batch (issue: every way to split attention), in one
script run: `cpattn run --scheme all` at cp = 2 per dtype, repeated, and the medians.

    bench/scheme_table.py build/ci/tools/cpattn [--seq-len 8192] [--repeats 5] [--runs 2]

Per scheme: forward and backward seconds (the slowest rank's median step), the ratio of
forward + backward to the all-gather scheme of the same run, the exposed communication (the
share of the step a rank spent inside communication calls: blocking collectives and waits
for transfers still in flight; a transfer that finished under compute costs nothing here),
and the bytes sent per rank (the communicator's counts). Prints a Markdown table."""
import argparse
import json
import os
import statistics
import subprocess

ap = argparse.ArgumentParser()
ap.add_argument("cpattn")
ap.add_argument("--seq-len", type=int, default=8192)
ap.add_argument("--repeats", type=int, default=5)
ap.add_argument("--runs", type=int, default=2, help="whole --scheme all runs per dtype (medians over them)")
ap.add_argument("--dtypes", default="fp32,bf16")
ap.add_argument("--cp", type=int, default=2)
args = ap.parse_args()
env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")


def run(dtype):
    cmd = ["mpirun", "-np", str(args.cp), "--oversubscribe", "--bind-to", "core", args.cpattn, "run",
           "--scheme", "all", "--seq-len", str(args.seq_len), "--heads", "16", "--kv-heads", "4",
           "--head-dim", "128", "--repeats", str(args.repeats), "--dtype", dtype, "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    j = json.loads(r.stdout.strip().splitlines()[-1])
    assert j["passed"], "a scheme does not match the single-process run"
    return j


print("| dtype | scheme | fwd s | bwd s | fwd+bwd vs allgather | exposed comm (share of step) | MiB sent per rank |")
print("|---|---|---|---|---|---|---|")
for dtype in args.dtypes.split(","):
    rows = {}
    for _ in range(args.runs):
        for s in run(dtype)["schemes"]:
            r = rows.setdefault(s["scheme"], {"fwd": [], "bwd": [], "share": [], "sent": s["bytes_sent"]})
            r["fwd"].append(max(s["forward_s"]))
            r["bwd"].append(max(s["backward_s"]))
            r["share"].append(max(c / t for c, t in zip(s["comm_s"], s["step_s"])))
    base = statistics.median(rows["allgather"]["fwd"]) + statistics.median(rows["allgather"]["bwd"])
    for name, r in rows.items():
        fwd, bwd = statistics.median(r["fwd"]), statistics.median(r["bwd"])
        print(f"| {dtype} | {name} | {fwd:.3f} | {bwd:.3f} | {(fwd + bwd) / base:.2f} | "
              f"{100 * statistics.median(r['share']):.1f}% | {max(r['sent']) / 2**20:.1f} |")
