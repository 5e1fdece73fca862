#!/usr/bin/env python3
"""Soak: long runs with flat memory (docs/reliability.md, "Soak").

Runs `cpattn train` for 2000 steps and `cpattn run` for 10,000 CP forward/backward calls, each
under mpirun at 2 ranks, sampling every rank's resident set (VmRSS in /proc/PID/status) ten times a
second. Reports per rank the RSS at the end of the first tenth of the run (warm: buffers,
plans and caches at full size) and the largest after it; fails when any rank grew by more than
--max-growth-mib. The plan cache's bound under changing batches is cp_reliability_test's.

    bench/soak.py build/ci/tools/cpattn            # the full soak (minutes)
    bench/soak.py build/ci/tools/cpattn --short    # 200 steps, 1000 calls
"""
import argparse
import json
import os
import subprocess
import sys
import time


def children(pid):
    """Processes whose parent is `pid` (mpirun's ranks on this node)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                out.append(int(entry))
        except (OSError, IndexError, ValueError):
            pass
    return sorted(out)


def rss_kib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def soak(name, cmd, period=0.1):
    """Runs cmd, sampling its ranks' RSS; returns {rank pid: [(seconds, kib), ...]}."""
    start = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})
    samples = {}
    while p.poll() is None:
        for pid in children(p.pid):
            kib = rss_kib(pid)
            if kib is not None:
                samples.setdefault(pid, []).append((time.monotonic() - start, kib))
        time.sleep(period)
    err = p.stderr.read()
    if p.returncode != 0:
        sys.exit(f"{name}: exit {p.returncode}\n{err[-2000:]}")
    return samples, time.monotonic() - start


def summarize(name, samples, seconds, max_growth_mib):
    rows, ok = [], True
    for i, (pid, s) in enumerate(sorted(samples.items())):
        if len(s) < 10:
            continue  # a rank that lived too briefly to judge
        warm = s[len(s) // 10][1]
        peak = max(k for _, k in s[len(s) // 10:])
        growth = (peak - warm) / 1024
        ok &= growth <= max_growth_mib
        rows.append({"rank": i, "samples": len(s), "warm_mib": warm / 1024, "peak_after_warm_mib": peak / 1024,
                     "growth_mib": growth})
    print(f"{name}: {seconds:.1f} s")
    for r in rows:
        print(f"  rank {r['rank']}: {r['samples']} samples, RSS warm {r['warm_mib']:.1f} MiB, "
              f"largest after {r['peak_after_warm_mib']:.1f} MiB, growth {r['growth_mib']:+.2f} MiB")
    return {"name": name, "seconds": seconds, "ranks": rows, "flat": ok and bool(rows)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cpattn")
    ap.add_argument("--mpirun", default="mpirun")
    ap.add_argument("--short", action="store_true", help="200 training steps and 1000 CP calls")
    ap.add_argument("--max-growth-mib", type=float, default=4.0)
    ap.add_argument("--json", help="write the summary here")
    a = ap.parse_args()
    steps, calls = (200, 1000) if a.short else (2000, 10000)
    mpi = [a.mpirun, "-np", "2", "--oversubscribe", a.cpattn]
    results = [
        summarize("train", *soak("train", mpi + ["train", "--cp", "2", "--steps", str(steps), "--seq-len", "128",
                                                 "--layers", "1", "--dim", "32", "--heads", "2", "--kv-heads", "1",
                                                 "--print-every", str(steps)]), a.max_growth_mib),
        summarize("cp", *soak("cp", mpi + ["run", "--lengths", "37,1,100,3", "--heads", "4", "--kv-heads", "2",
                                           "--head-dim", "32", "--repeats", str(calls)]), a.max_growth_mib),
    ]
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    flat = all(r["flat"] for r in results)
    print("memory flat" if flat else f"memory grew past {a.max_growth_mib} MiB")
    sys.exit(0 if flat else 1)


if __name__ == "__main__":
    main()
