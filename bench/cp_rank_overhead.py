#!/usr/bin/env python3
"""Issue 15's measures of CP = 2 on a two-core host, in rounds that alternate every run so that
the machine's drift falls on all of them alike:

  - the CP = 2 step (max over ranks) against one process with one thread and with two;
  - each rank's compute against one process running the same work (half the heads and KV
    heads) with a second such process side by side on the other core, as the ranks run
    (`taskset -c 0` and `-c 1`): the largest rank's over the largest process's; and the same of
    the forward and the backward alone (their `forward_s` and `backward_s`, which on a rank
    include its waits);
  - exposed communication: the waits (`comm_s`) of the rank with the most compute, the one
    that sets the step, over the step;
  - the faster rank's waits over the step: the ranks' skew.

    bench/cp_rank_overhead.py build/release/tools/cpattn [--rounds 6] [--dtypes bf16,fp32] [--lengths N ...]

Every `cpattn run` checks its result against a single process first. Prints one line a round
and the medians."""
import argparse
import json
import os
import statistics
import subprocess

ap = argparse.ArgumentParser()
ap.add_argument("cpattn")
ap.add_argument("--rounds", type=int, default=6)
ap.add_argument("--dtypes", default="bf16,fp32")
ap.add_argument("--seq-len", type=int, default=8192)
ap.add_argument("--repeats", type=int, default=10)
ap.add_argument("--lengths", type=int, nargs="*", help="document lengths (cpattn run --lengths) instead of --seq-len's mix")
args = ap.parse_args()
env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")


def shape(dtype, heads, kv_heads, threads):
    docs = ["--lengths", *map(str, args.lengths)] if args.lengths else ["--seq-len", str(args.seq_len)]
    return [args.cpattn, "run", *docs, "--heads", str(heads), "--kv-heads", str(kv_heads), "--head-dim", "128",
            "--dtype", dtype, "--repeats", str(args.repeats), "--threads", str(threads), "--json"]


def parse(out):
    j = json.loads(out.strip().splitlines()[-1])
    assert j["passed"], j
    return j


def run(cmd):
    return parse(subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout)


def side_by_side(dtype):
    procs = [subprocess.Popen(["taskset", "-c", str(c), *shape(dtype, 8, 2, 1)], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True, env=env) for c in (0, 1)]
    outs = [p.communicate()[0] for p in procs]
    for c, p in enumerate(procs):
        assert p.returncode == 0, f"the half-head run on core {c} failed ({p.returncode})"
    return [parse(out) for out in outs]


rows = {d: [] for d in args.dtypes.split(",")}
for i in range(args.rounds):
    for dtype in rows:
        cp = run(["mpirun", "-np", "2", "--bind-to", "core", *shape(dtype, 16, 4, 1)])
        one1 = run(["mpirun", "-np", "1", "--bind-to", "none", *shape(dtype, 16, 4, 1)])["step_s"][0]
        one2 = run(["mpirun", "-np", "1", "--bind-to", "none", *shape(dtype, 16, 4, 2)])["step_s"][0]
        halves = side_by_side(dtype)
        half = [h["compute_s"][0] for h in halves]
        step = max(cp["step_s"])
        slow = max(range(2), key=lambda r: cp["compute_s"][r])
        phase = {k: max(cp[k]) / max(h[k][0] for h in halves) - 1 for k in ("forward_s", "backward_s")}
        r = dict(x1=one1 / step, x2=one2 / step, overhead=max(cp["compute_s"]) / max(half) - 1,
                 fwd=phase["forward_s"], bwd=phase["backward_s"],
                 exposed=cp["comm_s"][slow] / step, skew=cp["comm_s"][1 - slow] / step)
        rows[dtype].append(r)
        print(f"{dtype} round {i + 1}: step {step:.4f} s, 1 process {one1:.4f} s (1 thread) {one2:.4f} s (2 threads): "
              f"{r['x1']:.2f}x, {r['x2']:.2f}x; compute {cp['compute_s'][0]:.4f}, {cp['compute_s'][1]:.4f} s against "
              f"{half[0]:.4f}, {half[1]:.4f} s: {r['overhead'] * 100:+.1f}% (forward {r['fwd'] * 100:+.1f}%, "
              f"backward {r['bwd'] * 100:+.1f}%); exposed {r['exposed'] * 100:.2f}%, "
              f"the faster rank's waits {r['skew'] * 100:.2f}%", flush=True)
for dtype, rs in rows.items():
    def med(k):
        return statistics.median(r[k] for r in rs)

    def span(k, scale=1.0, fmt="{:.2f}"):
        return fmt.format(min(r[k] for r in rs) * scale) + " to " + fmt.format(max(r[k] for r in rs) * scale)
    print(f"{dtype} medians of {len(rs)}: {med('x1'):.2f}x one thread ({span('x1')}), {med('x2'):.2f}x two threads "
          f"({span('x2')}), compute overhead {med('overhead') * 100:+.1f}% ({span('overhead', 100, '{:+.1f}')}%; "
          f"forward {med('fwd') * 100:+.1f}%, backward {med('bwd') * 100:+.1f}%), "
          f"exposed {med('exposed') * 100:.2f}% ({span('exposed', 100)}%), faster rank's waits "
          f"{med('skew') * 100:.2f}%")
