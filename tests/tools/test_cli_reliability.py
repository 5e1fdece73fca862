"""`cpattn run`, `cpattn plan` (and `train`, `moe` where they share the rule) against bad input, memory and deadlines (docs/reliability.md):
a NaN query and an fp32 value past fp16's range are refused naming the tensor and the element;
with --no-check-finite the mismatch report names the worst row; a request past the memory is
refused at once with both sizes (train's with experts counting this rank's share of them and
the whole model once, the hybrid's by its --cp-inner groups); --timeout beats CPATTN_COMM_TIMEOUT_S beats 300 s, and the
timeout line names both; rank 0's serial check longer than --timeout does not time the others
out; `cpattn plan --json` past its bound is refused, not killed."""
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/cli_lib.py
from cli_lib import CPATTN, MPIEXEC, check, finish, last_json


def mpirun(np_, *args, env=None, timeout=120):
    cmd = [MPIEXEC, "-np", str(np_), "--oversubscribe", CPATTN, "run", *args]
    start = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})
    return r, time.monotonic() - start


TINY = ["--lengths", "37,1,20", "--heads", "2", "--kv-heads", "1", "--head-dim", "8"]

# Inputs: a NaN query, an fp32 value past fp16's range (a 1-token document first).
rng = np.random.default_rng(7)
cu = np.array([0, 1, 12, 30], dtype=np.int64)
T, HQ, HKV, D = 30, 4, 2, 8
arrays = {"q": rng.standard_normal((T, HQ, D)), "k": rng.standard_normal((T, HKV, D)),
          "v": rng.standard_normal((T, HKV, D)), "dout": rng.standard_normal((T, HQ, D))}
with tempfile.TemporaryDirectory() as d:
    def save(**changed):
        for name, a in arrays.items():
            np.save(os.path.join(d, name + ".npy"), changed.get(name, a).astype(np.float32))
        np.save(os.path.join(d, "cu_seqlens.npy"), cu)

    q = arrays["q"].copy()
    q[13, 2, 5] = np.nan
    save(q=q)
    r, _ = mpirun(2, "--npy-in", d)
    check(r.returncode == 2 and r.stderr.count("input q holds nan at token 13, head 2, dim 5: inputs must be finite "
                                               "(--no-check-finite skips this check)") == 1,
          f"NaN query: exit {r.returncode} {r.stderr[-600:]!r}")
    # Skipped: the run goes on and the mismatch names the tensor and the row of its worst error.
    r, _ = mpirun(2, "--npy-in", d, "--no-check-finite", "--json")
    j = json.loads(r.stdout.strip().splitlines()[-1]) if r.stdout.strip() else None
    check(r.returncode == 1 and j is not None and not j["passed"], f"--no-check-finite: exit {r.returncode}")
    if j:
        # The kernels hide the NaN from out (as in the single process); it reaches dK of its
        # document's keys 12..13 in kv head 1 (q head 2's group): the first NaN row is named.
        check(j["worst"]["dk"] == {"token": 12, "head": 1}, f"worst rows: {j['worst']}")
    r, _ = mpirun(2, "--npy-in", d, "--no-check-finite")
    check("(12, 1)  FAIL (NaN/Inf)" in r.stdout, f"table names the worst row: {r.stdout[-900:]!r}")
    # Every scheme the heads allow at cp 2 names the same row in its own object.
    r, _ = mpirun(2, "--npy-in", d, "--no-check-finite", "--scheme", "all", "--json")
    j = json.loads(r.stdout.strip().splitlines()[-1]) if r.stdout.strip() else None
    names = [x["scheme"] for x in j["schemes"]] if j else []
    check(r.returncode == 1 and {"allgather", "ring", "pass-q", "a2a"} <= set(names),
          f"--scheme all: exit {r.returncode} {names}")
    for x in (j["schemes"] if j else []):
        check(not x["passed"] and x["worst"]["dk"] == {"token": 12, "head": 1}, f"{x['scheme']}: {x['worst']}")

    v = arrays["v"].copy()
    v[29, 1, 7] = 70000.0
    save(v=v)
    r, _ = mpirun(2, "--npy-in", d, "--dtype", "fp16")
    check(r.returncode == 2 and r.stderr.count("--npy-in: v.npy holds 70000 at token 29, head 1, dim 7, finite in "
                                               "float32 but past fp16's range") == 1,
          f"fp16 overflow: exit {r.returncode} {r.stderr[-600:]!r}")

# Memory: refused at once, with the size needed and the size available.
r, elapsed = mpirun(2, "--seq-len", "100000000000")
check(r.returncode == 2 and "cpattn run of 100000000000 tokens needs" in r.stderr and "PiB" in r.stderr
      and "available (" in r.stderr and elapsed < 20, f"huge --seq-len: exit {r.returncode} in {elapsed:.1f} s "
      f"{r.stderr[-600:]!r}")
r = subprocess.run([CPATTN, "bench", "attention", "--seq-len", "10000000000"], capture_output=True, text=True,
                   timeout=60)
check(r.returncode == 2 and "cpattn bench attention of 10000000000 tokens needs" in r.stderr
      and "available (" in r.stderr, f"bench attention past memory: exit {r.returncode} {r.stderr[-400:]!r}")
r = subprocess.run([MPIEXEC, "-np", "1", CPATTN, "train", "--seq-len", "1000000000", "--steps", "1"],
                   capture_output=True, text=True, timeout=60)
check(r.returncode == 2 and "cpattn train at --seq-len 1000000000 and --cp 1 needs" in r.stderr
      and "available (" in r.stderr, f"train past memory: exit {r.returncode} {r.stderr[-400:]!r}")


def format_bytes(n):  # memory.hpp's format_bytes
    units, v, u = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"], float(n), 0
    while v >= 1024.0 and u < 6:
        v, u = v / 1024.0, u + 1
    return f"{v:.0f} {units[u]}" if u == 0 else f"{v:.1f} {units[u]}"


def train_np2(*args, env=None):
    return subprocess.run([MPIEXEC, "-np", "2", "--oversubscribe", CPATTN, "train", "--steps", "1", "--seq-len", "32",
                           "--layers", "1", "--dim", "16", "--heads", "2", "--kv-heads", "1", *args],
                          capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})


# With experts under EP the parameters counted are this rank's: the model's header says how many
# it holds (experts / ep of every block's), and the whole model (every expert) is counted once
# more, gathered at initialisation and save: both figures from the model's own count.
LIMIT = {"CPATTN_MEMORY_LIMIT_BYTES": "10000"}
MOE_EP = ["--dp", "2", "--micro", "2", "--experts", "4", "--top-k", "2", "--ep", "2"]
r = train_np2(*MOE_EP)
head = [l for l in r.stdout.splitlines() if l.startswith("cpattn train:")]
words = head[0].replace("(", " ").split() if head else []
check(r.returncode == 0 and "on each rank: experts / ep)" in (head or [""])[0],
      f"train with experts: exit {r.returncode} {r.stdout[:400]!r} {r.stderr[-400:]!r}")
if r.returncode == 0 and head:
    total, mine = int(words[words.index("parameters") - 1]), int(words[words.index("on") - 1])
    r = train_np2(*MOE_EP, env=LIMIT)
    check(r.returncode == 2 and f"parameters, gradients and moments {format_bytes(16 * mine)}, every expert "
          f"gathered {format_bytes(4 * total)}, per rank" in r.stderr,
          f"train with experts past memory ({mine} of {total} parameters): exit {r.returncode} {r.stderr[-500:]!r}")
# The hybrid's estimate is of its --cp-inner groups: with one group of every rank it is the
# all-to-all's, figure for figure.
cp_attention = {}
for scheme in (["--cp-scheme", "hybrid", "--cp-inner", "2"], ["--cp-scheme", "a2a"]):
    r = train_np2("--cp", "2", *scheme, env=LIMIT)
    text = r.stderr.split("CP attention ", 1)[1].split(",", 1)[0] if "CP attention " in r.stderr else None
    check(r.returncode == 2 and text is not None, f"train {scheme} past memory: {r.stderr[-400:]!r}")
    cp_attention[scheme[1]] = text
check(cp_attention["hybrid"] == cp_attention["a2a"], f"hybrid at --cp-inner = --cp against a2a: {cp_attention}")
r, elapsed = mpirun(2, "--seq-len", "100000000000", "--scheme", "all")
check(r.returncode == 2 and "cpattn run of 100000000000 tokens needs" in r.stderr and elapsed < 20,
      f"huge --seq-len, every scheme: exit {r.returncode} {r.stderr[-600:]!r}")
r = subprocess.run([MPIEXEC, "-np", "1", CPATTN, "moe", "--experts", "2", "--tokens", "100000000000"],
                   capture_output=True, text=True, timeout=60)
check(r.returncode == 2 and "cpattn moe of 100000000000 tokens per rank needs" in r.stderr
      and "available (" in r.stderr, f"moe past memory: exit {r.returncode} {r.stderr[-400:]!r}")
r, _ = mpirun(2, *TINY, env={"CPATTN_MEMORY_LIMIT_BYTES": "10000"})
check(r.returncode == 2 and "more than the 9.8 KiB available (CPATTN_MEMORY_LIMIT_BYTES)" in r.stderr,
      f"memory limit: {r.stderr[-600:]!r}")
# Rank 0's single-process check counts the backward's per-task buffers of the longest document
# (its queries' rows): one document of 4096 tokens needs more than 64 documents of 64 tokens.
UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "PiB": 2**50, "EiB": 2**60}
reference = {}
for name, lengths in (("one", "4096"), ("many", ",".join(["64"] * 64))):
    r, _ = mpirun(2, "--lengths", lengths, "--heads", "8", "--kv-heads", "2", "--head-dim", "64", env=LIMIT)
    text = r.stderr.split("rank 0's single-process check ", 1)[-1].split(")", 1)[0].split()
    said = r.returncode == 2 and len(text) == 2 and text[1] in UNITS and text[0].replace(".", "", 1).isdigit()
    check(said, f"--lengths {lengths[:20]} past CPATTN_MEMORY_LIMIT_BYTES: exit {r.returncode} {r.stderr[-600:]!r}")
    if said:
        reference[name] = float(text[0]) * UNITS[text[1]]
if len(reference) == 2:
    check(reference["one"] > reference["many"] + 2**20, f"the longest document's backward buffers: {reference}")

# Deadlines: the flag beats the variable beats the default (the deadline in effect is reported).
for env, flag, want in (({}, [], 300.0), ({"CPATTN_COMM_TIMEOUT_S": "7"}, [], 7.0),
                        ({"CPATTN_COMM_TIMEOUT_S": "7"}, ["--timeout", "5"], 5.0)):
    j = last_json(mpirun(1, *TINY, *flag, "--json", env={"CPATTN_COMM_TIMEOUT_S": "", **env})[0])
    check(j is not None and j["timeout_s"] == want, f"timeout {env} {flag}: {j and j['timeout_s']}, want {want}")


def stalled(env, flag):
    """Rank 1 stalls 60 s before its first step (mpirun's MPMD form); returns (result, seconds)."""
    start = time.monotonic()
    r = subprocess.run([MPIEXEC, "--oversubscribe", "-np", "1", CPATTN, "run", *TINY, *flag, ":", "-np", "1",
                        CPATTN, "run", *TINY, *flag, "--testing-stall-s", "60"],
                       capture_output=True, text=True, timeout=120, env={**os.environ, **env})
    return r, time.monotonic() - start


LINE = "did not complete within the deadline of 1 s (set by --timeout, else CPATTN_COMM_TIMEOUT_S, else 300 s)"
r, elapsed = stalled({"CPATTN_COMM_TIMEOUT_S": "1000"}, ["--timeout", "1"])
check(r.returncode != 0 and LINE in r.stderr and elapsed < 30, f"--timeout over the variable: {elapsed:.1f} s "
      f"{r.stderr[-600:]!r}")
r, elapsed = stalled({"CPATTN_COMM_TIMEOUT_S": "1"}, [])
check(r.returncode != 0 and LINE in r.stderr and elapsed < 30, f"the variable over the default: {elapsed:.1f} s "
      f"{r.stderr[-600:]!r}")
r, _ = mpirun(1, *TINY, "--timeout", "-1")
check(r.returncode == 2 and "--timeout must be in (0, " in r.stderr, f"--timeout -1: {r.stderr[-400:]!r}")
for cmd in (["train", "--steps", "1"], ["moe", "--experts", "2"]):
    r = subprocess.run([MPIEXEC, "-np", "1", CPATTN, *cmd, "--timeout", "-1"], capture_output=True, text=True,
                       timeout=60)
    check(r.returncode == 2 and "--timeout must be in (0, " in r.stderr, f"{cmd[0]} --timeout -1: {r.stderr[-400:]!r}")

# Rank 0's serial check, longer than --timeout: the others wait under a deadline sized for it.
# The check's length depends on the machine: a batch whose check ends within --timeout proves
# nothing, so a longer one follows (every run must pass; one of them must outlast --timeout).
outlasted = []
for tokens in ("2000", "4000", "8000", "16000"):
    r, _ = mpirun(2, "--lengths", tokens, "--heads", "8", "--kv-heads", "2", "--head-dim", "64", "--timeout", "0.5",
                  "--json")
    j = last_json(r)
    check(j is not None and j["passed"], f"long serial check of {tokens} tokens: exit {r.returncode} "
          f"{r.stderr[-600:]!r}")
    if j is None or j["single_process_s"] > 0.5:
        outlasted.append(tokens)
        break
check(outlasted, "no serial check outlasted --timeout 0.5 (up to 16000 tokens)")

# cpattn plan --json at cp = 4096 with many documents: refused with the bound, at once.
with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
    f.write("3\n" * 20000)
    f.flush()
    start = time.monotonic()
    r = subprocess.run([CPATTN, "plan", "--cp", "4096", "--lengths-file", f.name, "--json"], capture_output=True,
                       text=True, timeout=60)
    check(r.returncode == 2 and "past --json's bound of 134217728" in r.stderr and time.monotonic() - start < 20,
          f"plan --json at cp 4096: exit {r.returncode} {r.stderr[-400:]!r}")
# ... and where the key runs, not the index lists, are what is large: 1,000 one-token documents
# at cp = 256 (about 5 GB of text; the index lists alone, 131 million entries, passed the bound).
r = subprocess.run([CPATTN, "plan", "--cp", "256", "--lengths", ",".join(["1"] * 1000), "--json"], capture_output=True,
                   text=True, timeout=60)
check(r.returncode == 2 and "past --json's bound of 134217728" in r.stderr,
      f"plan --json of 1000 tiny documents at cp 256: exit {r.returncode} {r.stderr[-400:]!r}")
# ... while a plan under the bound is written whole.
r = subprocess.run([CPATTN, "plan", "--cp", "64", "--lengths", ",".join(["1"] * 50), "--json"], capture_output=True,
                   text=True, timeout=60)
check(r.returncode == 0 and r.stdout.count('"rank"') >= 64, f"plan --json of 50 tiny documents at cp 64: {r.stderr[-400:]!r}")

finish()
