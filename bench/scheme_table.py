#!/usr/bin/env python3
"""Every CP scheme on the CP benchmark's batch (issue: every way to split attention), in one
script run: `cpattn run --scheme all` at cp = 2 per dtype, repeated, and the medians.

    bench/scheme_table.py build/ci/tools/cpattn [--seq-len 8192] [--repeats 5] [--runs 2]
                          [--schemes allgather,ring] [--vs OTHER_CPATTN]

Per scheme: forward and backward seconds (the slowest rank's median step), the ratio of
forward + backward to the all-gather scheme of the same run, the exposed communication (the
share of the step a rank spent inside communication calls: blocking collectives and waits
for transfers still in flight; a transfer that finished under compute costs nothing here),
and the bytes sent per rank (the communicator's counts). Prints a Markdown table.

--vs OTHER_CPATTN (another build, e.g. the one before a change) runs it alternately with the
first binary, run for run, so that both see the same load on a shared machine; its rows are
labelled with its path and their ratios are against its own all-gather."""
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
ap.add_argument("--schemes", default="", help="comma-separated schemes to keep in the table (default: all)")
ap.add_argument("--vs", default="", help="another cpattn binary, run alternately with the first")
args = ap.parse_args()
binaries = [args.cpattn] + ([args.vs] if args.vs else [])
env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")


def run(binary, dtype):
    cmd = ["mpirun", "-np", str(args.cp), "--oversubscribe", "--bind-to", "core", binary, "run",
           "--scheme", "all", "--seq-len", str(args.seq_len), "--heads", "16", "--kv-heads", "4",
           "--head-dim", "128", "--repeats", str(args.repeats), "--dtype", dtype, "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    j = json.loads(r.stdout.strip().splitlines()[-1])
    assert j["passed"], "a scheme does not match the single-process run"
    return j


keep = set(args.schemes.split(",")) if args.schemes else None
label = "| binary " if args.vs else ""
print(f"{label}| dtype | scheme | fwd s | bwd s | fwd+bwd vs allgather | exposed comm (share of step) | MiB sent per rank |")
print("|---" * (8 if args.vs else 7) + "|")
for dtype in args.dtypes.split(","):
    rows = {b: {} for b in binaries}
    for _ in range(args.runs):
        for b in binaries:  # alternately: both binaries see the same load
            for s in run(b, dtype)["schemes"]:
                r = rows[b].setdefault(s["scheme"], {"fwd": [], "bwd": [], "share": [], "sent": s["bytes_sent"]})
                r["fwd"].append(max(s["forward_s"]))
                r["bwd"].append(max(s["backward_s"]))
                r["share"].append(max(c / t for c, t in zip(s["comm_s"], s["step_s"])))
    for b in binaries:
        base = statistics.median(rows[b]["allgather"]["fwd"]) + statistics.median(rows[b]["allgather"]["bwd"])
        for name, r in rows[b].items():
            if keep and name not in keep:
                continue
            fwd, bwd = statistics.median(r["fwd"]), statistics.median(r["bwd"])
            cell = f"| {b} " if args.vs else ""
            print(f"{cell}| {dtype} | {name} | {fwd:.3f} | {bwd:.3f} | {(fwd + bwd) / base:.2f} | "
                  f"{100 * statistics.median(r['share']):.1f}% | {max(r['sent']) / 2**20:.1f} |")
