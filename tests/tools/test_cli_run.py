"""`mpirun -np N cpattn run` end to end: the built-in default, every dtype and mode at
cp = 2 and 3, --npy-in/--npy-out against an independent float64 NumPy attention, every
documented spelling of --dtype, --mask and --kernel-path (docs/cli.md), exit codes."""
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/cli_lib.py
from cli_lib import CPATTN, MPIEXEC, check, finish, job, run, run_json

# The default batch, the main job.
r = run(2)
check(r.returncode == 0 and "result: PASS" in r.stdout, f"default run: {r.stdout[-1500:]} {r.stderr[-1500:]}")

# --scheme ring: exact against the single process, the scheme and per-rank byte counts in
# the JSON; a bad value exits 2 naming the flag.
for np_ in (2, 3):
    for mask in ("causal", "none"):
        j = run_json(np_, "--scheme", "ring", "--lengths", "37,1,100,3", "--heads", "4", "--kv-heads", "2",
                     "--head-dim-qk", "48", "--head-dim-v", "32", "--dtype", "bf16", "--mask", mask)
        if j:
            check(j["passed"] and j["scheme"] == "ring", f"ring np {np_} {mask}: {j}")
            check(len(j["bytes_sent"]) == np_ and all(b > 0 for b in j["bytes_sent"]), f"ring bytes: {j}")
            check(j["bytes_sent"] == j["bytes_received"], f"ring bytes balance: {j}")
j = run_json(2, "--lengths", "37,1,100")
check(j is not None and j["scheme"] == "allgather", f"default scheme: {j}")
# --scheme pass-q, and --scheme all: every scheme on the same batch, each checked, with its
# per-rank times, bytes and peak buffers; each scheme's bytes equal its own run's.
PQ = ["--lengths", "37,1,100,3", "--heads", "4", "--kv-heads", "2", "--head-dim-qk", "48", "--head-dim-v", "32"]
alone = {name: run_json(3, "--scheme", name, *PQ) for name in ("ring", "pass-q")}
check(alone["pass-q"] is not None and alone["pass-q"]["passed"] and alone["pass-q"]["scheme"] == "pass-q",
      f"pass-q: {alone['pass-q']}")
# bf16 with dropout through pass-Q, on the path the CPU picks: pass-Q ran fp32 copies, rounded
# unlike the single process's bf16 products, and failed the check on AMX (dq 3.5e-2 off).
for scheme in ("pass-q", "ring"):
    j = run_json(2, "--scheme", scheme, "--lengths", "37,100,5,1,64", "--heads", "4", "--kv-heads", "2",
                 "--head-dim", "16", "--dtype", "bf16", "--dropout", "0.1")
    check(j is not None and j["passed"], f"bf16 with dropout, {scheme}: {j}")
j = run_json(3, "--scheme", "all", *PQ)
if j:
    check(j["scheme"] == "all" and j["passed"], f"all: {j}")
    check([x["scheme"] for x in j["schemes"]] == ["allgather", "ring", "pass-q"], f"all: schemes {j['schemes']}")
    for x in j["schemes"]:
        name = x["scheme"]
        check(x["passed"] and set(x["rel_l2_err"]) >= {"out", "dq", "dk", "dv"}, f"all {name}: {x}")
        for key in ("forward_s", "backward_s", "bytes_sent", "bytes_received", "peak_buffer_mb"):
            check(len(x[key]) == 3 and all(v > 0 for v in x[key]), f"all {name} {key}: {x[key]}")
        check(sum(x["bytes_sent"]) == sum(x["bytes_received"]), f"all {name}: bytes balance")
        if alone.get(name):
            check(x["bytes_sent"] == alone[name]["bytes_sent"], f"all {name}: bytes differ from its own run")
r = run(3, "--scheme", "all", *PQ)
check(r.returncode == 0 and "result: PASS" in r.stdout and all(n in r.stdout for n in ("allgather", "ring", "pass-q")),
      f"--scheme all table: {r.stdout[-1500:]} {r.stderr[-500:]}")
r = run(2, "--scheme", "zigzag")
check(r.returncode == 2 and "--scheme" in r.stderr and "pass-q" in r.stderr, f"bad --scheme: exit {r.returncode} {r.stderr[-500:]}")

# --overlap on|off (default on): both exact, bitwise the same results (--npy-out), reported with
# the exposed (comm_s, waited) and total (comm_total_s, in flight) communication per rank: equal
# without overlap, total >= exposed with it; a bad value exits 2.
with tempfile.TemporaryDirectory() as d:
    res = {}
    for ov in ("on", "off"):
        os.makedirs(f"{d}/{ov}")
        j = run_json(3, *PQ, "--dtype", "bf16", "--overlap", ov, "--npy-out", f"{d}/{ov}")
        check(j is not None and j["passed"] and j["overlap"] == (ov == "on"), f"--overlap {ov}: {j}")
        if j:
            pairs = list(zip(j["comm_total_s"], j["comm_s"]))
            check(len(pairs) == 3 and all(t > 0 and (t >= e if ov == "on" else t == e) for t, e in pairs),
                  f"comm_total_s: {j}")
        res[ov] = {n: np.load(f"{d}/{ov}/{n}.npy") for n in ("out", "lse", "dq", "dk", "dv")}
    for n in res["on"]:
        check(res["on"][n].tobytes() == res["off"][n].tobytes(), f"--overlap on/off differ in {n}")
check(run_json(2, *PQ)["overlap"] is True, "--overlap default")

# --shared-memory on|off (default on): on one host both calls of the last step go through shared
# memory (shared_calls of calls), none with off; no reason to give it up (shared_memory_off).
for sm, want in (("on", 2), ("off", 0)):
    j = run_json(2, *PQ, "--shared-memory", sm)
    check(j is not None and j["passed"] and j["shared_calls"] == [want, want] and j["calls"] == [2, 2]
          and j["shared_memory_off"] == "", f"--shared-memory {sm}: {j}")
r = run(2, *PQ, "--overlap", "maybe")
check(r.returncode == 2 and "--overlap" in r.stderr, f"bad --overlap: exit {r.returncode} {r.stderr[-500:]}")

# Every dtype and both key modes, MHA, GQA and MLA shapes, documents needing padding.
for np_ in (2, 3):
    for dtype in ("fp32", "fp16", "bf16"):
        for mode in ("runs", "index"):
            j = run_json(np_, "--lengths", "37,100,1,64,23", "--heads", "4", "--kv-heads", "2",
                         "--head-dim-qk", "48", "--head-dim-v", "32", "--dtype", dtype, "--mode", mode)
            if j:
                check(j["passed"] and j["cp"] == np_, f"np {np_} {dtype} {mode}: {j}")
                for key in ("max_abs_err", "max_rel_err"):
                    check(set(j[key]) >= {"out", "dq", "dk", "dv"}, f"{key} keys")
                check(len(j["compute_s"]) == np_ and len(j["comm_s"]) == np_, "per-rank times")
                # Real pairs only; the padding (37 -> 40|42, 1 -> 4|6, 23 -> 24, and at np 3
                # 100 -> 102, 64 -> 66) sits in the last chunk, rank 0's. np 2: rank 0 3985,
                # rank 1 4125 pairs; np 3: 2332, 2889, 2889 (see docs/planner.md, Balance).
                want = {2: 4125 / 4055, 3: 2889 * 3 / 8110}[np_]
                check(abs(j["imbalance"]["balanced"] - want) < 1e-12, "balanced")

# Every documented spelling (docs/cli.md), reported under its canonical name.
TINY = ["--lengths", "37,1,20", "--heads", "2", "--kv-heads", "1", "--head-dim", "8"]
for spelling, canonical in (("float32", "fp32"), ("float16", "fp16"), ("bfloat16", "bf16")):
    j = run_json(2, *TINY, "--dtype", spelling)
    check(j is not None and j["passed"] and j["dtype"] == canonical, f"--dtype {spelling}: {j}")
for mask in ("causal", "none"):
    j = run_json(2, *TINY, "--mask", mask)
    check(j is not None and j["passed"] and j["mask"] == mask, f"--mask {mask}: {j}")
for path in ("automatic", "portable"):
    j = run_json(2, *TINY, "--kernel-path", path)
    want = {"portable", "avx2", "avx512"} if path == "automatic" else {"portable"}
    check(j is not None and j["passed"] and j["kernel_path"] in want, f"--kernel-path {path}: {j}")
j = run_json(2, *TINY, "--threads", "2", "--repeats", "2")
if j:
    check(j["seq_len"] == 58 and j["documents"] == 3 and j["lengths"] == [37, 1, 20], f"seq_len, lengths: {j}")
    check(j["threads"] == 2 and j["repeats"] == 2 and j["heads"] == 2 and j["kv_heads"] == 1, f"shape: {j}")
    check(j["head_dim_qk"] == 8 and j["head_dim_v"] == 8, f"head dims: {j}")
j = run_json(2, "--seq-len", "100", "--heads", "2", "--kv-heads", "1", "--head-dim", "8")
check(j is not None and j["passed"] and j["seq_len"] == 100, f"--seq-len 100: {j}")

# No mask and dropout: still equal to the single-process run.
for extra in (("--mask", "none"), ("--dropout", "0.1"), ("--mask", "none", "--dropout", "0.3", "--mode", "index")):
    j = run_json(3, "--lengths", "37,100,1,64", "--heads", "4", "--kv-heads", "1", "--head-dim", "16", *extra)
    check(j is not None and j["passed"], f"{extra}: {j}")

# --npy-in / --npy-out against NumPy's float64 attention of the same batch.
rng = np.random.default_rng(5)
cu = np.array([0, 13, 14, 50, 77], dtype=np.int64)
T, HQ, HKV, D, DV = int(cu[-1]), 4, 2, 16, 8
q = rng.standard_normal((T, HQ, D)).astype(np.float32)
k = rng.standard_normal((T, HKV, D)).astype(np.float32)
v = rng.standard_normal((T, HKV, DV)).astype(np.float32)
dout = rng.standard_normal((T, HQ, DV)).astype(np.float32)


def reference(q, k, v, dout):
    q, k, v, dout = (x.astype(np.float64) for x in (q, k, v, dout))
    out = np.zeros((T, HQ, DV)); lse = np.zeros((T, HQ))
    dq = np.zeros_like(q); dk = np.zeros_like(k); dv = np.zeros_like(v)
    scale = 1 / np.sqrt(D)
    for a, b in zip(cu[:-1], cu[1:]):
        n = b - a
        mask = np.tril(np.ones((n, n), dtype=bool))
        for h in range(HQ):
            g = h // (HQ // HKV)
            s = scale * q[a:b, h] @ k[a:b, g].T
            s = np.where(mask, s, -np.inf)
            m = s.max(axis=1, keepdims=True)
            l = np.log(np.exp(s - m).sum(axis=1, keepdims=True)) + m
            p = np.exp(s - l)
            out[a:b, h] = p @ v[a:b, g]
            lse[a:b, h] = l[:, 0]
            dp = dout[a:b, h] @ v[a:b, g].T
            delta = (dout[a:b, h] * out[a:b, h]).sum(axis=1, keepdims=True)
            ds = p * (dp - delta)
            dq[a:b, h] = scale * ds @ k[a:b, g]
            dk[a:b, g] += scale * ds.T @ q[a:b, h]
            dv[a:b, g] += p.T @ dout[a:b, h]
    return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)


ref = reference(q, k, v, dout)
with tempfile.TemporaryDirectory() as din, tempfile.TemporaryDirectory() as dout_dir:
    for name, arr in (("q", q), ("k", k), ("v", v), ("dout", dout)):
        np.save(os.path.join(din, name + ".npy"), arr)
    np.save(os.path.join(din, "cu_seqlens.npy"), cu.astype(np.int32))
    for np_ in (2, 3):
        j = run_json(np_, "--npy-in", din, "--npy-out", dout_dir)
        if not j:
            continue
        check(j["seq_len"] == T and j["heads"] == HQ and j["kv_heads"] == HKV, "shapes from the files")
        check(j["lengths"] == np.diff(cu).tolist() and j["documents"] == len(cu) - 1, "lengths from the files")
        for name, want in ref.items():
            got = np.load(os.path.join(dout_dir, name + ".npy"))
            check(got.dtype == np.float32 and got.shape == want.shape, f"{name}.npy shape {got.shape}")
            err = np.linalg.norm(got - want) / np.linalg.norm(want)
            check(err < 2e-6, f"np {np_}: {name} relative error {err:.3g} against NumPy float64")
    # float16 inputs for a bf16 run are read and rounded; the check still passes.
    np.save(os.path.join(din, "q.npy"), q.astype(np.float16))
    j = run_json(2, "--npy-in", din, "--dtype", "bf16")
    check(j is not None and j["passed"], "fp16 files, bf16 run")
    # The files give the shape: shape flags beside them are refused (they were ignored); a
    # cu_seqlens.npy of two dimensions is refused (it was read flattened).
    r = run(2, "--npy-in", din, "--heads", "4")
    check(r.returncode == 2 and "--npy-in excludes --heads" in r.stderr, f"--npy-in with --heads: {r.stderr[-500:]}")
    np.save(os.path.join(din, "cu_seqlens.npy"), np.stack([cu[:2], cu[-2:]]).astype(np.int32))
    r = run(2, "--npy-in", din)
    check(r.returncode == 2 and r.stderr.count("cu_seqlens.npy must be 1-D, [documents + 1], got 2 dimensions") == 1,
          f"2-D cu_seqlens.npy: exit {r.returncode} {r.stderr[-500:]}")
    # A run whose check fails (a NaN in q, --no-check-finite) writes nothing: the earlier run's
    # --npy-out files stay as they were (they were replaced by the failed run's).
    np.save(os.path.join(din, "cu_seqlens.npy"), cu.astype(np.int32))
    before = {name: open(os.path.join(dout_dir, name + ".npy"), "rb").read() for name in ref}
    bad_q = q.copy()
    bad_q[20, 1, 3] = np.nan
    np.save(os.path.join(din, "q.npy"), bad_q)
    r = run(2, "--npy-in", din, "--npy-out", dout_dir, "--no-check-finite")
    check(r.returncode == 1 and "--npy-out: nothing written, the check failed" in r.stderr,
          f"failed run with --npy-out: exit {r.returncode} {r.stderr[-500:]}")
    for name, old in before.items():
        check(open(os.path.join(dout_dir, name + ".npy"), "rb").read() == old, f"{name}.npy left as it was")
    # A reader's error names the flag as well as the file.
    os.remove(os.path.join(din, "k.npy"))
    r = run(2, "--npy-in", din)
    check(r.returncode == 2 and r.stderr.count(f"--npy-in: '{din}/k.npy': cannot read it") == 1,
          f"missing k.npy: exit {r.returncode} {r.stderr[-500:]}")

# --npy-in past memory: refused from the files' headers, before their data is read (every rank
# read 9 GiB of these sparse files, twice over, before the same refusal).
with tempfile.TemporaryDirectory() as din:
    big_t = 1 << 22
    for name, heads, dim in (("q", 4, 64), ("k", 2, 64), ("v", 2, 32), ("dout", 4, 32)):
        m = np.lib.format.open_memmap(os.path.join(din, name + ".npy"), mode="w+", dtype=np.float32,
                                      shape=(big_t, heads, dim))
        del m  # a sparse file: its data blocks are holes
    np.save(os.path.join(din, "cu_seqlens.npy"), np.array([0, big_t], dtype=np.int64))
    start = time.monotonic()
    r = job(2, "run", "--npy-in", din, timeout=120, env={**os.environ, "CPATTN_MEMORY_LIMIT_BYTES": "100000000"})
    elapsed = time.monotonic() - start
    check(r.returncode == 2 and f"cpattn run of {big_t} tokens needs" in r.stderr
          and "more than the 95.4 MiB available (CPATTN_MEMORY_LIMIT_BYTES)" in r.stderr,
          f"--npy-in past memory: exit {r.returncode} {r.stderr[-600:]}")
    check(elapsed < 30, f"--npy-in past memory took {elapsed:.1f} s")

with open("/proc/cpuinfo") as f:
    HAS_AMX = " amx_tile" in f.read()
# Bad input: exit code 2 and one line, on the job as a whole; bad values name the flag and
# list the valid ones; the old flag names (--tokens) are gone.
for args, needle in ((("--dtype", "fp64"),
                      "--dtype must be one of fp32, fp16, bf16 (or float32, float16, bfloat16), got 'fp64'"),
                     (("--dtype", "f32"), "--dtype must be one of fp32, fp16, bf16 (or float32, float16, bfloat16)"),
                     (("--mask", "full"), "--mask must be one of causal, none, got 'full'"),
                     (("--kernel-path", "fast"), "--kernel-path must be one of automatic, portable, avx2, avx512, "
                                                 "avx512_bf16, bf16_emulated, amx, amx_emulated, got 'fast'"),
                     # a path this CPU cannot run (amx, where the CPU lacks it: no amx_tile flag)
                     (("--kernel-path", "amx"), "--kernel-path amx cannot run on this CPU") if not HAS_AMX
                     else (("--kernel-path", "fast"), "--kernel-path must be one of"),
                     (("--tokens", "100"), "--tokens"),
                     (("--lengths", "5,0"), "--lengths[1]"),
                     # a total past int64: the lengths' own rule (was a memory refusal of 2^63 - 1 tokens)
                     (("--lengths", "9223372036854775807,1"), "--lengths add up to more than the largest supported"),
                     (("--heads", "3", "--kv-heads", "2"), "--heads (3) must be a positive multiple of --kv-heads (2)"),
                     (("--dropout", "1"), "--dropout must be in [0, 1)"),
                     (("--head-dim", "300"), "--head-dim"),
                     (("--mode", "gather"), "--mode must be one of runs, index"),
                     (("--npy-in", "/nonexistent"),
                      "--npy-in: '/nonexistent/q.npy': cannot read it: No such file or directory"),
                     # an empty path was read as the flag not given
                     (("--npy-in", ""), "--npy-in: a path must not be empty"),
                     (("--npy-out", ""), "--npy-out: a path must not be empty"),
                     (("--cp", "0"), "--cp")):
    r = run(2, *args)
    check(r.returncode == 2, f"{args}: exit {r.returncode}, want 2; {r.stderr[-500:]}")
    check(r.stderr.count(needle) == 1, f"{args}: want one line with {needle!r}, got {r.stderr[-800:]!r}")

# --cp smaller than the world: world/cp CP groups each run and check the batch.
j = run_json(4, "--cp", "2", "--lengths", "37,100,1,64", "--heads", "4", "--kv-heads", "2", "--head-dim", "16")
check(j is not None and j["passed"] and j["cp"] == 2 and j["cp_groups"] == 2, f"--cp 2 at np 4: {j}")
r = run(3, "--cp", "2", "--seq-len", "100")
check(r.returncode == 2 and r.stderr.count("--cp must divide the MPI world size 3") == 1,
      f"--cp 2 at np 3: exit {r.returncode}, {r.stderr[-800:]!r}")


def mpmd(args0, args1):
    """Rank 0 and rank 1 with their own flags; returns (result, seconds)."""
    start = time.monotonic()
    r = subprocess.run([MPIEXEC, "--oversubscribe", "-np", "1", CPATTN, "run", "--timeout", "60", *args0, ":",
                        "-np", "1", CPATTN, "run", "--timeout", "60", *args1],
                       capture_output=True, text=True, timeout=120)
    return r, time.monotonic() - start


# An error on one nonzero rank only (here its own flags, through mpirun's MPMD form): every
# rank ends at once, and rank 0 prints that rank's message, well before the deadline.
r, elapsed = mpmd(["--seq-len", "100"], ["--npy-in", "/nonexistent"])
check(r.returncode == 2 and r.stderr.count("[rank 1] --npy-in: '/nonexistent/q.npy': cannot read it") == 1,
      f"error on rank 1 only: exit {r.returncode}, {r.stderr[-800:]!r}")
check(elapsed < 30, f"error on rank 1 only took {elapsed:.1f} s (deadline 60 s)")

# Other --cp on one rank: agreed before the world is split, so no rank waits in the split.
r, elapsed = mpmd(["--seq-len", "100", "--cp", "2"], ["--seq-len", "100", "--cp", "1"])
check(r.returncode == 2 and r.stderr.count("ranks disagree on cpattn run: --cp: rank 0 has 2, rank 1 has 1") == 1
      and elapsed < 30, f"--cp differing between ranks: exit {r.returncode} in {elapsed:.1f} s, {r.stderr[-800:]!r}")
# --scheme all on one rank, one scheme on the other: rank 0 would time more layers (the layers'
# agreements see only the first scheme) and wait in a barrier rank 1 never reaches.
r, elapsed = mpmd(["--seq-len", "100", "--scheme", "all"], ["--seq-len", "100", "--scheme", "allgather"])
check(r.returncode == 2 and r.stderr.count("ranks disagree on cpattn run: --scheme (-1 all, 0 allgather, 1 ring, "
                                           "2 pass-q, 3 a2a, 4 hybrid): rank 0 has -1, rank 1 has 0") == 1 and elapsed < 30,
      f"--scheme all on rank 0 only: exit {r.returncode} in {elapsed:.1f} s, {r.stderr[-800:]!r}")
# The ranks of CP group 1 of 2 given other batches (world rank 3's --seed): that group's layers
# fail alone; every rank must still end at once with that group's message (group 1 waited out
# the deadline in a barrier group 0 never joined, and nobody printed its error).
group = ["run", "--timeout", "60", "--cp", "2", "--seq-len", "100", "--heads", "4", "--kv-heads", "2", "--head-dim", "16"]
start = time.monotonic()
r = subprocess.run([MPIEXEC, "--oversubscribe", "-np", "3", CPATTN, *group, ":", "-np", "1", CPATTN, *group,
                    "--seed", "7"], capture_output=True, text=True, timeout=120)
elapsed = time.monotonic() - start
check(r.returncode == 2 and r.stderr.count("cpattn run rejected its arguments: [ranks 2,3] CP group 1: ranks disagree "
                                           "on CP attention: seed: rank 0 has 1, rank 1 has 7") == 1 and elapsed < 30,
      f"CP group 1's error: exit {r.returncode} in {elapsed:.1f} s, {r.stderr[-800:]!r}")
# Flags no library agreement sees (--repeats: rank 1 would time more steps and wait in a
# collective rank 0 never reaches); another --split (told apart by the split, not by field names).
r, elapsed = mpmd(["--seq-len", "100", "--repeats", "1"], ["--seq-len", "100", "--repeats", "3"])
check(r.returncode == 2 and r.stderr.count("ranks disagree on cpattn run: --repeats: rank 0 has 1, rank 1 has 3") == 1
      and elapsed < 30, f"--repeats differing between ranks: exit {r.returncode} in {elapsed:.1f} s, {r.stderr[-800:]!r}")
r, elapsed = mpmd(["--seq-len", "100"], ["--seq-len", "100", "--split", "padding-free"])
check(r.returncode == 2 and "split: rank 0 has 0, rank 1 has 1" in r.stderr and elapsed < 30,
      f"--split differing between ranks: exit {r.returncode} in {elapsed:.1f} s, {r.stderr[-800:]!r}")
# Flags only one rank rejects (its own --heads): the CLI's check, named by the flag.
r, elapsed = mpmd(["--seq-len", "100"], ["--seq-len", "100", "--heads", "3", "--kv-heads", "2"])
check(r.returncode == 2 and r.stderr.count("[rank 1]") == 1 and elapsed < 30
      and "--heads (3) must be a positive multiple of --kv-heads (2)" in r.stderr,
      f"--heads on rank 1 only: exit {r.returncode} in {elapsed:.1f} s, {r.stderr[-800:]!r}")
# A configuration only one rank's CpAttention rejects (3 query heads over 2 kv heads, from
# that rank's files: the CLI leaves the files' shapes to CpAttention).
with tempfile.TemporaryDirectory() as din3:
    for name, shape in (("q", (T, 3, D)), ("k", (T, 2, D)), ("v", (T, 2, DV)), ("dout", (T, 3, DV))):
        np.save(os.path.join(din3, name + ".npy"), rng.standard_normal(shape).astype(np.float32))
    np.save(os.path.join(din3, "cu_seqlens.npy"), cu)
    r, elapsed = mpmd(["--seq-len", "100"], ["--npy-in", din3])
check(r.returncode == 2 and r.stderr.count("[rank 1]") == 1 and "num_heads_q must be a multiple of num_heads_k, got 3 and 2" in r.stderr and elapsed < 30,
      f"CpAttention's check on rank 1 only: exit {r.returncode} in {elapsed:.1f} s, {r.stderr[-800:]!r}")

finish()
print("cli run: all checks passed")
