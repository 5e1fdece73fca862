"""`cpattn train` end to end: a small run at cp = 1 and 2 with its JSON log, --compare,
checkpoints through the command line (bitwise resume at cp = 1, cp 2 -> cp 1), and bad input:
missing or empty data, a too short --seq-len, --cp different from the MPI world size (exit 2,
one clear line, no hang); every documented spelling of --dtype (docs/cli.md)."""
import json
import os
import subprocess
import sys
import tempfile

CPATTN, MPIEXEC = sys.argv[1], sys.argv[2]
failures = []
SMALL = ["--layers", "1", "--dim", "32", "--heads", "4", "--kv-heads", "2", "--seq-len", "128",
         "--warmup", "2"]


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what, flush=True)


def train(np_, *args, timeout=300):
    cmd = ([MPIEXEC, "-np", str(np_), "--oversubscribe"] if np_ else []) + [CPATTN, "train", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def log(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


with tempfile.TemporaryDirectory() as tmp:
    p = lambda name: os.path.join(tmp, name)

    # Plain `cpattn train` (CP=1, no mpirun) and mpirun -np 2 --cp 2: same curve.
    r1 = train(0, *SMALL, "--steps", "6", "--json-log", p("cp1.jsonl"))
    check(r1.returncode == 0, f"cp 1: exit {r1.returncode}\n{r1.stderr[-2000:]}")
    check("run summary" in r1.stdout and "tok/s" in r1.stdout, f"cp 1 output:\n{r1.stdout[-1500:]}")
    r2 = train(2, *SMALL, "--cp", "2", "--steps", "6", "--json-log", p("cp2.jsonl"))
    check(r2.returncode == 0, f"cp 2: exit {r2.returncode}\n{r2.stderr[-2000:]}")
    check(r2.stdout.count("run summary") == 1, "only rank 0 prints")
    if r1.returncode == 0 and r2.returncode == 0:
        a, b = log(p("cp1.jsonl")), log(p("cp2.jsonl"))
        check(len(a) == 6 and len(b) == 6, "one JSON object per step")
        for key in ("step", "loss", "grad_norm", "step_s", "peak_rss_mb", "tokens_per_s"):
            check(key in a[0], f"JSON log has {key}")
        check(len(b[0]["peak_rss_mb_per_rank"]) == 2, "peak memory of every rank")
        for x, y in zip(a, b):
            check(abs(x["loss"] - y["loss"]) <= 1e-5 * x["loss"], f"step {x['step']}: {x['loss']} vs {y['loss']}")
            check(abs(x["grad_norm"] - y["grad_norm"]) <= 1e-5 * x["grad_norm"], f"grad norm step {x['step']}")

    # --compare runs each CP size as its own job and prints the table.
    r = train(0, *SMALL, "--steps", "3", "--compare", "1,2")
    check(r.returncode == 0 and "max dloss" in r.stdout and "peak MB per rank" in r.stdout,
          f"--compare: exit {r.returncode}\n{r.stdout[-1500:]}\n{r.stderr[-1500:]}")

    # Resume: 3 + 3 steps equal 6 steps bitwise at cp 1; a cp 2 checkpoint resumes at cp 1.
    train(0, *SMALL, "--steps", "3", "--save", p("a.ckpt"))
    r = train(0, *SMALL, "--steps", "6", "--resume", p("a.ckpt"), "--json-log", p("resumed.jsonl"))
    check(r.returncode == 0, f"resume: exit {r.returncode}\n{r.stderr[-1500:]}")
    if r.returncode == 0 and r1.returncode == 0:
        straight, resumed = log(p("cp1.jsonl")), log(p("resumed.jsonl"))
        check([x["step"] for x in resumed] == [3, 4, 5], "resumed steps")
        check([x["loss"] for x in resumed] == [x["loss"] for x in straight[3:]], "bitwise resume at cp 1")
        check([x["grad_norm"] for x in resumed] == [x["grad_norm"] for x in straight[3:]], "bitwise grad norms")
    train(2, *SMALL, "--cp", "2", "--steps", "3", "--save", p("b.ckpt"))
    r = train(0, *SMALL, "--steps", "6", "--resume", p("b.ckpt"), "--json-log", p("down.jsonl"))
    check(r.returncode == 0, f"resume cp 2 -> 1: exit {r.returncode}\n{r.stderr[-1500:]}")
    if r.returncode == 0 and r1.returncode == 0:
        for x, y in zip(log(p("cp1.jsonl"))[3:], log(p("down.jsonl"))):
            check(abs(x["loss"] - y["loss"]) <= 1e-5 * x["loss"], f"cp 2 -> 1 step {x['step']}")

    # Every --dtype spelling train supports, printed under its canonical name.
    for spelling, canonical in (("fp32", "fp32"), ("bf16", "bf16"), ("float32", "fp32"), ("bfloat16", "bf16")):
        r = train(0, *SMALL, "--steps", "1", "--dtype", spelling)
        check(r.returncode == 0 and f"attention {canonical};" in r.stdout,
              f"--dtype {spelling}: exit {r.returncode}\n{r.stdout[-800:]}\n{r.stderr[-800:]}")

    # Bad input: exit 2 with one clear line (rank 0 only), on every rank, no hang.
    os.mkdir(p("empty"))
    open(p("empty/nothing.txt"), "w").close()
    bad = [
        (2, ["--cp", "2", "--data", p("missing")], "no such file or folder"),
        (2, ["--cp", "2", "--data", p("empty")], "no non-empty document"),
        (2, ["--cp", "2", "--seq-len", "3"], "--seq-len 3 cannot hold one padded chunk per rank"),
        (2, ["--cp", "4"], "does not match the MPI world size 2"),
        (0, ["--cp", "2"], "does not match the MPI world size 1"),
        (0, ["--dtype", "fp16"], "--dtype must be one of fp32, bf16 (or float32, bfloat16) "
                                 "(cpattn train supports only these today), got 'fp16'"),
        (0, ["--dtype", "float16"], "cpattn train supports only these today), got 'float16'"),
        (0, ["--dtype", "f32"], "--dtype must be one of fp32, bf16 (or float32, bfloat16)"),
        (2, ["--cp", "2", "--dtype", "fp64"], "--dtype must be one of fp32, bf16 (or float32, bfloat16)"),
        (0, ["--attn-dtype", "bf16"], "--attn-dtype"),  # the old name is gone
        (2, ["--cp", "2", "--resume", p("missing.ckpt")], "cannot read"),
    ]
    for np_, args, msg in bad:
        r = train(np_, *SMALL[:-4], *args, "--steps", "2", timeout=120)
        check(r.returncode == 2, f"{args}: exit {r.returncode}, want 2\n{r.stderr[-1500:]}")
        check(msg in r.stderr and r.stderr.count("cpattn: error:") == 1,
              f"{args}: stderr should say '{msg}' once:\n{r.stderr[-1500:]}")

if failures:
    print(f"{len(failures)} check(s) failed")
    sys.exit(1)
print("all checks passed")
