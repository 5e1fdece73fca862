"""`cpattn train` on a DP x CP x PP mesh (docs/training.md): at 4 ranks, DP=2 x CP=2 (1f1b),
CP=2 x PP=2 (interleaved, 3 blocks over 4 virtual stages) and DP=2 x PP=2 (zb-h1) give the
loss and gradient norm of one process with the same --micro and --seq-len at every step
(1e-5 relative, the reference and DP=2 x PP=2 through --compare); a checkpoint saved on DP=2 x PP=2 resumes on CP=2 x PP=2 and continues the
one-process curve; `--compare 1,dp2xpp2 --svg` runs both and draws both curves; bad mesh
flags exit 2 with one line naming the flag, on every rank."""
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/cli_lib.py
from cli_lib import check, finish, log, train

BASE = ["--layers", "3", "--dim", "32", "--heads", "2", "--kv-heads", "1", "--seq-len", "64",
        "--warmup", "1"]
TINY = BASE + ["--micro", "4"]
STEPS = 3


def close(x, y):
    return abs(x - y) <= 1e-5 * abs(x)


def same_curve(ref, got, what):
    check(len(got) == len(ref), f"{what}: {len(got)} steps logged, expected {len(ref)}")
    for x, y in zip(ref, got):
        check(x["step"] == y["step"], f"{what}: step {y['step']} against {x['step']}")
        check(close(x["loss"], y["loss"]), f"{what} step {x['step']}: loss {y['loss']} vs {x['loss']}")
        check(close(x["grad_norm"], y["grad_norm"]),
              f"{what} step {x['step']}: grad norm {y['grad_norm']} vs {x['grad_norm']}")


with tempfile.TemporaryDirectory() as tmp:
    p = lambda name: os.path.join(tmp, name)
    # --compare with a mesh shape gives the one-process reference and DP=2 x PP=2 (zb-h1),
    # and draws both loss curves.
    r = train(0, *TINY, "--steps", str(STEPS), "--schedule", "zb-h1", "--compare", "1,dp2xpp2",
              "--svg", p("curves.svg"))
    check(r.returncode == 0 and "dp2xpp2" in r.stdout, f"--compare 1,dp2xpp2: exit {r.returncode}\n{r.stdout[-1500:]}\n{r.stderr[-1500:]}")
    logs = r.stdout.split("logs in ")[-1].split(")")[0] if r.returncode == 0 else ""
    one = log(os.path.join(logs, "cp1.jsonl")) if logs else []
    if logs:
        same_curve(one, log(os.path.join(logs, "dp2xpp2.jsonl")), "dp2xpp2 (zb-h1)")
        with open(p("curves.svg")) as f:
            svg = f.read()
        check(svg.count("<polyline") == 2 and "cp1 (1 rank)" in svg and "dp2xpp2 (4 ranks)" in svg,
              f"--svg draws one curve per run:\n{svg[:400]}")

    for name, flags in [("dp2xcp2", ["--dp", "2", "--cp", "2"]),
                        ("cp2xpp2", ["--cp", "2", "--pp", "2", "--schedule", "interleaved"])]:
        r = train(4, *TINY, *flags, "--steps", str(STEPS), "--json-log", p(name + ".jsonl"))
        check(r.returncode == 0, f"{name}: exit {r.returncode}\n{r.stderr[-2000:]}")
        check("mesh: dp" in r.stdout, f"{name}: the mesh is printed:\n{r.stdout[-800:]}")
        if r.returncode == 0:
            got = log(p(name + ".jsonl"))
            same_curve(one, got, name)
            check(all(j["dp"] * j["cp"] * j["pp"] == 4 for j in got), f"{name}: the log names the mesh")

    # Saved on DP=2 x PP=2 after 2 steps, resumed on CP=2 x PP=2 for the last one.
    r = train(4, *TINY, "--dp", "2", "--pp", "2", "--steps", "2", "--save", p("ck"))
    check(r.returncode == 0, f"save on dp2xpp2: exit {r.returncode}\n{r.stderr[-2000:]}")
    r = train(4, *TINY, "--cp", "2", "--pp", "2", "--steps", str(STEPS), "--resume", p("ck"),
              "--json-log", p("resumed.jsonl"))
    check(r.returncode == 0, f"resume on cp2xpp2: exit {r.returncode}\n{r.stderr[-2000:]}")
    if r.returncode == 0:
        same_curve(one[2:], log(p("resumed.jsonl")), "dp2xpp2 -> cp2xpp2 resume")

    # Bad mesh flags: exit 2, one line naming the flag, no hang.
    for np_, flags, text in [(4, ["--dp", "3"], "--micro 4 must be a multiple of --dp 3"),
                             (4, ["--dp", "2"], "--dp 2 * --cp 1 * --pp 1 = 2 does not match the MPI world size 4"),
                             (2, ["--pp", "0"], "--pp must be >= 1, got 0"),
                             (2, ["--pp", "2", "--schedule", "fill-drain"], "--schedule fill-drain runs forwards only"),
                             (2, ["--pp", "2", "--schedule", "interleaved", "--micro", "3"],
                              "--schedule: interleaved needs micro-batches to be a multiple of stages"),
                             (0, ["--compare", "1,tp2"], "--compare: 'tp2' is neither a CP size nor a mesh shape")]:
        r = train(np_, *BASE, *(flags if "--micro" in flags else flags + ["--micro", "4"]), "--steps", "1")
        check(r.returncode == 2 and text in r.stderr, f"{flags}: exit {r.returncode}, stderr {r.stderr[-600:]!r}")

finish()
print("all mesh training checks passed")
