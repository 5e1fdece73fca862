"""Issue 14's per-CPU kernel table in one command: every kernel path this CPU runs, fp32, fp16
and bf16 storage, one and two threads, forward and backward GFLOP/s against the FMA peak (and
the AMX peak where the CPU has tiles) measured in the same `cpattn bench attention` run.

Each row is the median of --runs runs of `cpattn bench attention --json` (itself the median
of --repeats timed calls per direction, after its check against float64); the fraction of the
peak is taken per run, then its median. The CPU is named from /proc/cpuinfo (model name,
family, model, the kernel-relevant flags) at the top, so that the table can go into
docs/benchmarks.md as it is. The speed targets (issue 14) are printed beside the rows they
apply to; this script checks nothing (speed is measured, never asserted).

    python3 bench/kernel_table.py build/ci/tools/cpattn                    # T = 4096 and 8192
    python3 bench/kernel_table.py build/ci/tools/cpattn --seq-lens 4096 --runs 5
"""

import argparse
import json
import statistics
import subprocess
import sys

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("cpattn", help="the cpattn binary")
ap.add_argument("--seq-lens", default="4096,8192", help="one-document lengths, comma-separated")
ap.add_argument("--runs", type=int, default=3, help="runs per row (median)")
ap.add_argument("--repeats", type=int, default=3, help="timed calls per direction in each run")
ap.add_argument("--heads", type=int, default=16)
ap.add_argument("--kv-heads", type=int, default=4)
ap.add_argument("--head-dim", type=int, default=128)
args = ap.parse_args()

KERNEL_FLAGS = ["avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_fp16",
                "amx_tile", "amx_bf16", "amx_fp16"]


def cpu_name():
    info = {}
    with open("/proc/cpuinfo") as f:
        for line in f:
            if ":" in line:
                k, v = (x.strip() for x in line.split(":", 1))
                info.setdefault(k, v)
    flags = set(info.get("flags", "").split())
    has = [x for x in KERNEL_FLAGS if x in flags]
    return (f"{info.get('model name', '?')} (family {info.get('cpu family', '?')} model {info.get('model', '?')}): "
            f"{' '.join(has)}")


def paths():
    """The kernel paths this CPU runs, as `cpattn bench attention --kernel-path` names them."""
    r = subprocess.run([args.cpattn, "bench", "attention", "--help"], capture_output=True, text=True, check=True)
    line = next(x for x in r.stdout.splitlines() if "--kernel-path" in x)
    names = line[line.index("{") + 1:line.index("}")].split("|")
    runnable = []
    for p in names:
        if p in ("automatic", "portable") or p.endswith("_emulated"):
            continue  # the baseline and the test emulators are not speed paths
        r = subprocess.run([args.cpattn, "bench", "attention", "--kernel-path", p, "--seq-len", "64", "--heads", "1",
                            "--kv-heads", "1", "--repeats", "1", "--json"], capture_output=True, text=True)
        if r.returncode == 0:
            runnable.append(p)
    return runnable


def bench(dtype, path, threads, seq_len):
    runs = []
    for _ in range(args.runs):
        r = subprocess.run([args.cpattn, "bench", "attention", "--dtype", dtype, "--kernel-path", path,
                            "--threads", str(threads), "--seq-len", str(seq_len), "--heads", str(args.heads),
                            "--kv-heads", str(args.kv_heads), "--head-dim", str(args.head_dim),
                            "--repeats", str(args.repeats), "--json"], capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"kernel_table.py: {dtype} {path} {threads} thread(s): {r.stderr.strip()}")
        runs.append(json.loads(r.stdout))
    out = {k: statistics.median(x[k] for x in runs)
           for k in ("fwd_gflops", "bwd_gflops", "fma_peak_gflops", "fwd_fraction_of_fma_peak",
                     "bwd_fraction_of_fma_peak")}
    out["path"] = runs[0]["kernel_path"]  # the path that ran (automatic's choice named)
    return out


TARGETS = {("fp32", None): "fwd >= 90%, bwd >= 85% of the peak",
           ("bf16", "avx512_bf16"): "fwd >= 1.7x, bwd >= 1.4x the peak",
           ("bf16", "amx"): "fwd >= 1000, bwd >= 600 GFLOP/s"}


def main():
    have = paths()
    print(f"CPU: {cpu_name()}")
    print(f"paths: {' '.join(have)}; Hq = {args.heads}, Hkv = {args.kv_heads}, D = {args.head_dim}, one causal "
          f"document; medians of {args.runs} runs of `cpattn bench attention --repeats {args.repeats} --json`")
    rows = []
    for dtype in ("fp32", "fp16", "bf16"):
        for path in have:
            if dtype == "fp32" and path in ("avx512_bf16", "amx"):
                continue  # fp32 storage runs the avx512 code on these paths
            rows.append((dtype, path, 1))
    rows += [("fp32", "automatic", 2), ("bf16", "automatic", 2)]
    print()
    print("| T | dtype | path | threads | fwd GFLOP/s | bwd GFLOP/s | FMA peak | fwd / peak | bwd / peak | target |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for seq_len in (int(x) for x in args.seq_lens.split(",")):
        done = {}
        for dtype, path, threads in rows:
            b = bench(dtype, path, threads, seq_len)
            done[(dtype, b["path"], threads)] = b
            note = TARGETS.get((dtype, None if dtype == "fp32" else path), "")
            one = done.get((dtype, b["path"], 1))
            if threads == 2 and one:  # two threads against one on the same path (target >= 1.9x)
                note = (f"{b['fwd_gflops'] / one['fwd_gflops']:.2f}x / {b['bwd_gflops'] / one['bwd_gflops']:.2f}x "
                        f"one thread (target >= 1.9x)")
            shown = path if path != "automatic" else f"{b['path']} (automatic)"
            print(f"| {seq_len} | {dtype} | {shown} | {threads} | {b['fwd_gflops']:.0f} | {b['bwd_gflops']:.0f} | "
                  f"{b['fma_peak_gflops']:.0f} | {100 * b['fwd_fraction_of_fma_peak']:.0f}% | "
                  f"{100 * b['bwd_fraction_of_fma_peak']:.0f}% | {note} |", flush=True)


main()
