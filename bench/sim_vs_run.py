"""The simulator against measured runs on this machine (docs/benchmarks.md, "The simulator"):
calibrate, run every scheme (`cpattn run --scheme all`), calibrate again, and set the
predictions from each calibration against the measured forward + backward step of the slowest
rank. On a shared machine the two calibrations bracket the load the run met. `--runs N` repeats
the whole comparison N times and ends with the medians over the runs (a loaded machine moves
single runs by tens of percent).

Each calibration measures the kernel rates on the run's documents (--lengths) and the CP
overhead (profile.cp_overhead) on a batch of its own (calibrate's --overhead-tokens and
--overhead-seed), never on the run's batch.

    python3 bench/sim_vs_run.py build/ci/tools/cpattn 2 [--repeats 5] [--runs 3] [extra cpattn run flags...]
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile

cpattn, np_ = sys.argv[1], int(sys.argv[2])
extra = sys.argv[3:]


def take(flag, default):
    if flag not in extra:
        return default
    i = extra.index(flag)
    value = extra[i + 1]
    del extra[i:i + 2]
    return value


repeats = take("--repeats", "5")
runs = int(take("--runs", "1"))
mpi = ["mpirun", "-np", str(np_), "--oversubscribe"]


def sh(args):
    r = subprocess.run(args, capture_output=True, text=True, timeout=1200)
    if r.returncode != 0:
        sys.exit(f"{' '.join(args)} failed: {r.stderr}")
    return r.stdout


def calibrate(lengths, run):
    fd, out = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    sh(mpi + [cpattn, "calibrate", "--dtypes", run["dtype"], "--lengths", ",".join(map(str, lengths)),
              "--heads", str(run["heads"]), "--kv-heads", str(run["kv_heads"]), "--head-dim",
              str(run["head_dim_qk"]), "--out", out])
    return out


def predict(profile, run, inner):
    j = json.loads(sh([cpattn, "simulate", "--lengths", ",".join(map(str, run["lengths"])), "--cp", str(np_),
                       "--cp-inner", str(inner), "--heads", str(run["heads"]), "--kv-heads", str(run["kv_heads"]),
                       "--head-dim-qk", str(run["head_dim_qk"]), "--head-dim-v", str(run["head_dim_v"]),
                       "--dtype", run["dtype"], "--profile", profile, "--json", "--no-breakeven"]))
    with open(profile) as f:
        prof = json.load(f)
    os.unlink(profile)
    return {s["scheme"]: s["step_s"] for s in j["schemes"] if s["valid"]}, prof


def overheads(p, dt):
    o = p.get("cp_overhead", {})
    return ", ".join(f"{s} {o.get('fwd', {}).get(dt, {}).get(s, 0):.2f}/{o.get('bwd', {}).get(dt, {}).get(s, 0):.2f}"
                     for s in ("allgather", "ring", "pass-q", "a2a", "hybrid"))


inner = 2 if np_ % 2 == 0 else 1
# The run's batch first (its lengths come from --seed), so that calibrate times the same documents.
# The simulator models the message path: the runs keep to it (--shared-memory off).
NO_SHM = ["--shared-memory", "off"]
probe = json.loads(sh(mpi + [cpattn, "run", "--scheme", "allgather", "--repeats", "1", "--json", *NO_SHM, *extra]))
errors = {}  # scheme -> [error of the mean prediction, per run]
figures = {}  # scheme -> [(measured, predicted mean), per run]
for k in range(runs):
    before = calibrate(probe["lengths"], probe)
    run = json.loads(sh(mpi + [cpattn, "run", "--scheme", "all", "--cp-inner", str(inner), "--repeats", repeats,
                               "--json", *NO_SHM, *extra]))
    after = calibrate(run["lengths"], run)
    pa, prof_a = predict(before, run, inner)
    pb, prof_b = predict(after, run, inner)
    dt = run["dtype"]
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    print(f"run {k + 1} of {runs} (load average {load}): cp {np_}: {len(run['lengths'])} documents, "
          f"{sum(run['lengths'])} tokens, Hq {run['heads']}, Hkv {run['kv_heads']}, "
          f"D {run['head_dim_qk']}/{run['head_dim_v']}, {dt}")
    for name, p in (("before", prof_a), ("after", prof_b)):
        print(f"  calibration {name}: fwd {p['compute']['fwd'][dt]:.2f} GFLOP/s, bwd {p['compute']['bwd'][dt]:.2f}, "
              f"link {p['intra_node']['bandwidth_gbs']:.3f} GB/s, {p['intra_node']['latency_us']:.2f} us; "
              f"cp_overhead fwd/bwd: {overheads(p, dt)}")
    print("| scheme | measured fwd+bwd s | predicted (calibration before) | error | predicted (after) | error | "
          "predicted (mean) | error |")
    print("|---|---|---|---|---|---|---|---|")
    for s in run["schemes"]:
        name = s["scheme"]
        measured = max(f + b for f, b in zip(s["forward_s"], s["backward_s"]))
        a, b = pa[name], pb[name]
        m = (a + b) / 2
        errors.setdefault(name, []).append(100 * (m / measured - 1))
        figures.setdefault(name, []).append((measured, m))
        print(f"| {name} | {measured:.3f} | {a:.3f} | {100 * (a / measured - 1):+.0f}% | {b:.3f} | "
              f"{100 * (b / measured - 1):+.0f}% | {m:.3f} | {100 * (m / measured - 1):+.0f}% |")
    sys.stdout.flush()
if runs > 1:
    print(f"medians over {runs} runs (error: of the mean prediction, per run):")
    print("| scheme | measured fwd+bwd s | predicted (mean) | error | errors of the runs |")
    print("|---|---|---|---|---|")
    for name, e in errors.items():
        meas = statistics.median(x for x, _ in figures[name])
        pred = statistics.median(y for _, y in figures[name])
        print(f"| {name} | {meas:.3f} | {pred:.3f} | {statistics.median(e):+.0f}% | "
              f"{', '.join(f'{x:+.0f}%' for x in e)} |")
