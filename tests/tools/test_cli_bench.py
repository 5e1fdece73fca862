"""`cpattn bench attention` end to end on tiny shapes: every documented spelling of --dtype,
--mask and --kernel-path (docs/cli.md) and the JSON fields of the shared vocabulary; bad values
and the old flag names exit 2 with one line listing the valid values; a failed check exits 1;
`cpattn --version`."""
import json
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/cli_lib.py
from cli_lib import CPATTN, check, finish, job

TINY = ["--seq-len", "48", "--heads", "2", "--kv-heads", "1", "--head-dim", "8", "--repeats", "1"]


def bench(*args, env=None):
    return job(0, "bench", "attention", *args, timeout=120, env=env)


def bench_json(*args, env=None):
    r = bench(*TINY, *args, "--json", env=env)
    check(r.returncode == 0, f"{args}: exit {r.returncode}\n{r.stderr[-1500:]}")
    return json.loads(r.stdout) if r.returncode == 0 else None


# --version: the project's version.
r = subprocess.run([CPATTN, "--version"], capture_output=True, text=True, timeout=30)
check(r.returncode == 0 and re.fullmatch(r"cpattn \d+\.\d+\.\d+\n", r.stdout), f"--version: {r.stdout!r} {r.stderr!r}")

# Every dtype spelling, reported as fp32/fp16/bf16.
for spelling, canonical in (("fp32", "fp32"), ("fp16", "fp16"), ("bf16", "bf16"),
                            ("float32", "fp32"), ("float16", "fp16"), ("bfloat16", "bf16")):
    j = bench_json("--dtype", spelling)
    check(j is not None and j["dtype"] == canonical, f"--dtype {spelling}: {j}")

# Both masks, and the shared JSON fields.
for mask in ("causal", "none"):
    j = bench_json("--mask", mask)
    check(j is not None and j["mask"] == mask, f"--mask {mask}: {j}")
j = bench_json("--kernel-path", "automatic", "--threads", "2")
if j:
    check(j["kernel_path"] in ("portable", "avx2", "avx512"), f"kernel_path is the path that ran: {j}")
    check(j["seq_len"] == 48 and j["documents"] == 1 and j["lengths"] == [48], f"seq_len: {j}")
    check(j["heads"] == 2 and j["kv_heads"] == 1 and j["head_dim_qk"] == 8 and j["head_dim_v"] == 8, f"shape: {j}")
    check(j["threads"] == 2 and j["repeats"] == 1 and j["dtype"] == "fp32" and j["mask"] == "causal", f"{j}")
    for old in ("path", "causal", "head_dim"):
        check(old not in j, f"old JSON field {old!r} still there")
j = bench_json("--kernel-path", "portable", "--head-dim-qk", "12", "--head-dim-v", "4")
check(j is not None and j["kernel_path"] == "portable" and j["head_dim_qk"] == 12 and j["head_dim_v"] == 4,
      f"--kernel-path portable, MLA head dims: {j}")
j = bench_json("--lengths", "20,7,21")
check(j is not None and j["seq_len"] == 48 and j["documents"] == 3 and j["lengths"] == [20, 7, 21], f"--lengths: {j}")

# Which path ran and why: the automatic choice (the measured order), the flag, the environment.
NO_ENV = {k: v for k, v in os.environ.items() if k != "CPATTN_KERNEL_PATH"}
with open("/proc/cpuinfo") as f:
    INTEL = any(line.startswith("vendor_id") and "GenuineIntel" in line for line in f)
for dtype in ("fp32", "bf16"):
    j = bench_json("--dtype", dtype, env=NO_ENV)
    order = ("avx512 > avx2 > portable" if dtype != "bf16"
             else "amx > avx512 > avx512_bf16 > avx2 > portable" if INTEL  # vdpbf16ps at half the FMA rate there
             else "amx > avx512_bf16 > avx512 > avx2 > portable")
    check(j is not None and j["kernel_path_reason"].startswith(f"chosen automatically: {j['kernel_path']} is the first")
          and order in j["kernel_path_reason"], f"automatic reason ({dtype}): {j}")
j = bench_json("--kernel-path", "portable", env=NO_ENV)
check(j is not None and j["kernel_path_reason"] == "forced by --kernel-path portable", f"flag reason: {j}")
j = bench_json("--dtype", "bf16", env={**NO_ENV, "CPATTN_KERNEL_PATH": "portable"})
check(j is not None and j["kernel_path"] == "portable"
      and j["kernel_path_reason"] == "forced by the environment (CPATTN_KERNEL_PATH=portable)", f"env reason: {j}")
j = bench_json("--kernel-path", "avx2", env={**NO_ENV, "CPATTN_KERNEL_PATH": "portable"})
check(j is None or j["kernel_path"] == "avx2", f"the flag beats the environment: {j}")
r = bench(*TINY, env={**NO_ENV, "CPATTN_KERNEL_PATH": "portable"})
check(r.returncode == 0 and "kernel path portable: forced by the environment (CPATTN_KERNEL_PATH=portable)" in r.stdout,
      f"text report names the reason: {r.stdout}")
# amx: a path this CPU cannot run, where it lacks AMX (the kernel lists amx_tile where it has it)
with open("/proc/cpuinfo") as f:
    HAS_AMX = " amx_tile" in f.read()
for value, needle in (("fast", "CPATTN_KERNEL_PATH must be one of automatic, portable, avx2, avx512, avx512_bf16, "
                               "bf16_emulated, amx, amx_emulated (or unset), got 'fast'"),
                      ) + ((("amx", "CPATTN_KERNEL_PATH=amx cannot run on this CPU (the amx path needs"),) if not HAS_AMX else ()):
    r = bench(*TINY, env={**NO_ENV, "CPATTN_KERNEL_PATH": value})
    lines = r.stderr.strip().splitlines()
    check(r.returncode == 2 and len(lines) == 1 and needle in lines[0],
          f"CPATTN_KERNEL_PATH={value}: exit {r.returncode}, stderr {r.stderr!r}")

# The text report passes its check and names the same values.
r = bench(*TINY, "--dtype", "bfloat16", "--mask", "none")
check(r.returncode == 0 and "attention bf16," in r.stdout and "mask none" in r.stdout
      and "check passed" in r.stderr, f"text report: {r.stdout} {r.stderr}")

# The masks: reported in the JSON, checked against the float64 reference like any run.
j = bench_json("--window", "40,0", "--softcap", "5", "--alibi")
check(j is not None and j["window"] == [40, 0] and j["softcap"] == 5.0 and j["alibi"] is True,
      f"masks JSON: {j}")

# A window that shows each query only itself: dq = dk = 0 exactly, and the check's floor lets
# the kernels' rounding noise pass (it failed the relative norm alone on every fp32 path).
r = subprocess.run([CPATTN, "bench", "attention", "--lengths", "1,1,67,300,2", "--heads", "3", "--kv-heads", "1",
                    "--dtype", "fp32", "--head-dim", "256", "--window", "0,0", "--mask", "none", "--repeats", "1"],
                   capture_output=True, text=True, timeout=300)
check(r.returncode == 0 and "check passed" in r.stderr, f"self-only window: exit {r.returncode} {r.stderr[-800:]}")

# Bad values and old flags: exit 2, one line naming the flag and listing the valid values.
DTYPES = "--dtype must be one of fp32, fp16, bf16 (or float32, float16, bfloat16)"
bad = [
    (["--dtype", "f64"], DTYPES + ", got 'f64'"),
    (["--dtype", "f32"], DTYPES + ", got 'f32'"),  # the old spelling
    (["--mask", "full"], "--mask must be one of causal, none, got 'full'"),
    (["--kernel-path", "fast"],
     "--kernel-path must be one of automatic, portable, avx2, avx512, avx512_bf16, bf16_emulated, amx, amx_emulated, "
     "got 'fast'"),
    (["--kernel-path", "amx"], "--kernel-path amx cannot run on this CPU (it needs AVX-512, AVX512_BF16, AMX-TILE, AMX-BF16")
    if not HAS_AMX else (["--kernel-path", "fast"], "--kernel-path must be one of"),
    (["--heads", "3", "--kv-heads", "2"], "--heads (3) must be a positive multiple of --kv-heads (2)"),
    (["--seqlen", "48"], "--seqlen"),
    (["--causal"], "--causal"),
    (["--no-causal"], "--no-causal"),
    (["--path", "portable"], "--path"),
    (["--head-dim", "300"], "--head-dim"),
    # head counts whose per-token bytes wrapped an int (std::bad_alloc, exit 1; or "0 B")
    (["--heads", "2147483647", "--kv-heads", "1", "--seq-len", "64"], "cpattn bench attention of 64 tokens needs"),
    (["--heads", "1073741824", "--kv-heads", "1073741824", "--seq-len", "64"], "tensors and their reference 512.0 TiB"),
    (["--window", "5"], "--window must be LEFT,RIGHT"),
    (["--window", "-2,3"], "--window must be LEFT,RIGHT"),
    (["--window", "1,2,3"], "--window must be LEFT,RIGHT"),
    (["--window", ",5"], "--window must be LEFT,RIGHT"),
    (["--softcap", "-1"], "--softcap must be finite and >= 0"),
]
for args, needle in bad:
    r = bench("--repeats", "1", *args)  # each fails before any kernel runs
    lines = r.stderr.strip().splitlines()
    check(r.returncode == 2, f"{args}: exit {r.returncode}, want 2; {r.stderr[-500:]!r}")
    check(len(lines) == 1 and needle in lines[0], f"{args}: stderr {r.stderr!r} lacks {needle!r}")

# A failed check (the hidden testing flag corrupts one lse value before it): exit 1, its message.
r = bench(*TINY, "--testing-fail-check")
check(r.returncode == 1 and "cpattn: check failed: bench attention: lse does not match the float64 reference"
      in r.stderr, f"failed check: exit {r.returncode}, {r.stderr[-800:]!r}")

finish()
