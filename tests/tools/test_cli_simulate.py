"""`cpattn simulate` and `cpattn calibrate` end to end: the JSON's per-rank work against `cpattn
plan`'s, its bytes against the all-gather's hand formula, the built-in profile against the
documented example file, the SVG as XML, a calibrated profile read back, and exit code 2 with a
line naming the field or flag for bad profiles and meshes; calibrate's --timeout beats
CPATTN_COMM_TIMEOUT_S, and a bad value of either is refused naming it."""
import json
import os
import time
import sys
import tempfile
import xml.etree.ElementTree as ET

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/cli_lib.py
from cli_lib import check, finish, job

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "profiles", "gpu-8x-nvlink-400g.json")


def run(*args, mpi=0, env=None):
    return job(mpi, *args, timeout=120, env={**os.environ, **(env or {})})


def bad(args, *needles, env=None):
    r = run(*args, env=env)
    lines = r.stderr.strip().splitlines()
    check(r.returncode == 2 and len(lines) == 1 and all(n in r.stderr for n in needles),
          f"{args}: exit {r.returncode}, stderr {r.stderr!r}, want {needles}")


tmp = tempfile.mkdtemp()
lengths = [37, 100, 1, 64, 23, 9, 2]  # a 1-token document, some needing padding at cp 3
lf = os.path.join(tmp, "lengths.txt")
with open(lf, "w") as f:
    f.write("# test batch\n" + "\n".join(map(str, lengths)) + "\n")

# ---- per-rank work is the planner's; bytes follow the all-gather's formula -------------------
for cp in (2, 3):
    r = run("simulate", "--lengths-file", lf, "--cp", str(cp), "--heads", "6", "--kv-heads", "3",
            "--head-dim-qk", "7", "--head-dim-v", "5", "--dtype", "fp16", "--profile", EXAMPLE, "--json")
    check(r.returncode == 0, f"simulate cp {cp}: {r.stderr}")
    j = json.loads(r.stdout)
    plan = json.loads(run("plan", "--lengths-file", lf, "--cp", str(cp), "--json").stdout)
    check(j["visible_pairs"] == [x["visible_pairs"] for x in plan["ranks"]], f"cp {cp}: pairs vs plan")
    check([s["scheme"] for s in j["schemes"]] == ["allgather", "ring", "pass-q", "a2a", "hybrid"], "schemes")
    ag = j["schemes"][0]
    t_loc = plan["padded_tokens"] // cp
    # forward: (cp-1) blocks of K and of V, fp16; backward: the same in fp32.
    check(ag["forward"]["bytes_sent"] == [(cp - 1) * t_loc * 3 * (7 + 5) * 2] * cp, f"cp {cp}: allgather fwd bytes")
    check(ag["backward"]["bytes_received"] == [(cp - 1) * t_loc * 3 * (7 + 5) * 4] * cp, f"cp {cp}: bwd bytes")
    check(ag["forward"]["agreement_bytes_sent"] == [(cp - 1) * 408] * cp, "agreement bytes")
    for s in j["schemes"]:
        if s["valid"]:
            check(abs(s["step_s"] - (s["compute_s"] + s["exposed_comm_s"] + s["bubble_s"])) <= 1e-9 * s["step_s"],
                  f"{s['scheme']}: step = compute + exposed + bubble")
    check(j["best"] in [s["scheme"] for s in j["schemes"] if s["valid"]], "best is a valid scheme")

# ---- the built-in profile is the documented example's -----------------------------------------
common = ["simulate", "--lengths", "4096,100,7", "--cp", "4", "--json", "--no-breakeven"]
a, b = run(*common), run(*common, "--profile", EXAMPLE)
ja, jb = json.loads(a.stdout), json.loads(b.stdout)
check([s.get("step_s") for s in ja["schemes"]] == [s.get("step_s") for s in jb["schemes"]],
      "default profile differs from examples/profiles/gpu-8x-nvlink-400g.json")

# ---- the CP overhead: a fraction of each call's kernel time, added to its compute -------------
with open(EXAMPLE) as f:
    prof = json.load(f)
prof["cp_overhead"] = {"fwd": {"bf16": {"allgather": 0.5}}, "bwd": {"bf16": {"allgather": 0.25, "ring": 1}}}
po = os.path.join(tmp, "overhead.json")
with open(po, "w") as f:
    json.dump(prof, f)
args = ["simulate", "--lengths-file", lf, "--cp", "3", "--heads", "6", "--kv-heads", "3", "--json", "--no-breakeven",
        "--overlap", "off"]
j0 = json.loads(run(*args, "--profile", EXAMPLE).stdout)
j1 = json.loads(run(*args, "--profile", po).stdout)
for s0, s1 in zip(j0["schemes"], j1["schemes"]):
    for d, x in (("forward", 0.5 if s0["scheme"] == "allgather" else 0),
                 ("backward", {"allgather": 0.25, "ring": 1}.get(s0["scheme"], 0))):
        if not s0["valid"]:
            continue
        k0, c1, o1 = s0[d]["compute_s"], s1[d]["compute_s"], s1[d]["overhead_s"]
        check(all(abs(o - x * k) <= 1e-12 * k and abs(c - (1 + x) * k) <= 1e-12 * k for k, c, o in zip(k0, c1, o1)),
              f"{s0['scheme']} {d}: overhead {x} of the kernel time: {k0} -> {c1}, {o1}")
ag0, ag1 = j0["schemes"][0], j1["schemes"][0]  # no overlap: the step grows by the overhead alone
slow = max(range(3), key=lambda r: ag0["forward"]["compute_s"][r] + ag0["backward"]["compute_s"][r])
added = 0.5 * ag0["forward"]["compute_s"][slow] + 0.25 * ag0["backward"]["compute_s"][slow]
check(abs(ag1["step_s"] - (ag0["step_s"] + added)) <= 1e-9 * ag1["step_s"], f"allgather step + overhead {added}")

# ---- --overlap on|off (default on): the all-gather's KV-head groups (3 here) move the same bytes;
# off hides nothing, on hides some of the later groups' transfers; a bad value exits 2.
jon = json.loads(run(*args[:-2], "--profile", EXAMPLE).stdout)
check(jon["overlap"] is True and j0["overlap"] is False, "--overlap in --json")
on, off = jon["schemes"][0], j0["schemes"][0]
check(on["step_bytes"] == off["step_bytes"], f"--overlap on/off bytes: {on['step_bytes']} {off['step_bytes']}")
check(off["hidden_comm_s"] == 0 and on["hidden_comm_s"] > 0, f"allgather hidden: on {on['hidden_comm_s']} off {off['hidden_comm_s']}")
check(on["compute_s"] == off["compute_s"], "--overlap changes no compute")
r = run(*args[:-2], "--overlap", "maybe")
check(r.returncode == 2 and "--overlap" in r.stderr, f"bad --overlap: exit {r.returncode} {r.stderr[-300:]}")

# ---- SVG: one line per scheme ------------------------------------------------------------------
svg = os.path.join(tmp, "sim.svg")
r = run("simulate", "--distribution", "lognormal", "--tokens", "65536", "--mean-length", "4096", "--cp", "16",
        "--heads", "16", "--kv-heads", "4", "--pp", "2", "--layers", "4", "--micro-batches", "4", "--svg", svg)
check(r.returncode == 0 and "best:" in r.stdout, f"simulate table: {r.stdout} {r.stderr}")
root = ET.parse(svg).getroot()
check(len([e for e in root.iter() if e.tag.endswith("polyline")]) == 5, "svg polylines")

# ---- bad profiles and meshes -----------------------------------------------------------------
with open(EXAMPLE) as f:
    good = json.load(f)


def write(name, obj):
    p = os.path.join(tmp, name)
    with open(p, "w") as f:
        json.dump(obj, f)
    return p


missing = dict(good)
del missing["intra_node"]
neg = json.loads(json.dumps(good))
neg["inter_node"]["latency_us"] = -1
fp8 = json.loads(json.dumps(good))
fp8["compute"]["fwd"]["fp8"] = 1000
nobf16 = json.loads(json.dumps(good))
del nobf16["compute"]["bwd"]["bf16"]
base = ["simulate", "--lengths", "100,50", "--cp", "2"]
bad(base + ["--heads", "-8", "--kv-heads", "-2"], "--heads: must be >= 1, got -8")  # (was: "-8 must be a multiple of -2")
bad(base + ["--svg", ""], "--svg: a path must not be empty")
bad(base + ["--profile", write("missing.json", missing)], "missing field profile.intra_node")
bad(base + ["--profile", write("neg.json", neg)], "profile.inter_node.latency_us", ">= 0")
bad(base + ["--profile", write("fp8.json", fp8)], "unknown dtype 'fp8'")
bad(base + ["--profile", write("nobf16.json", nobf16)], "profile.compute.bwd.bf16")
bad(base + ["--profile", os.path.join(tmp, "none.json")], "--profile: '" + os.path.join(tmp, "none.json") + "': cannot read it")
bad(base + ["--profile", "/dev/zero"], "--profile: '/dev/zero' is a character device, not a regular file")
# a huge regular file (a sparse 2 GiB one, no disk used): refused by its size, 1 MiB of it read at most
huge = os.path.join(tmp, "huge.json")
with open(huge, "wb") as f:
    f.truncate(2 << 30)
bad(base + ["--profile", huge], f"--profile: '{huge}' is {2 << 30} bytes, more than a machine profile's limit of 1048576 bytes")
os.unlink(huge)
# a key twice in one object (the parser kept the last, silently): refused, naming the key
twice = os.path.join(tmp, "twice.json")
with open(twice, "w") as f:
    f.write(json.dumps(good).replace('"inter_node": {', '"inter_node": {"latency_us": 1, ', 1))
bad(base + ["--profile", twice], "profile.inter_node.latency_us appears twice in its object: give each key once")
# --svg: checked before any work, never over an input (it replaced --lengths-file's file and the
# profile with a drawing), written whole (--svg /dev/full said nothing and exited 0).
with open(lf) as f:
    lengths_text = f.read()
bad(["simulate", "--lengths-file", lf, "--cp", "2", "--svg", lf],
    f"--svg '{lf}' is the file of --lengths-file '{lf}': the output would replace its input")
with open(lf) as f:
    check(f.read() == lengths_text, "--lengths-file left as it was")
prof = write("prof.json", good)
bad(base + ["--profile", prof, "--svg", prof], f"--svg '{prof}' is the file of --profile '{prof}'")
bad(base + ["--svg", "/dev/full"], "--svg: '/dev/full' is a character device, not a regular file")
# each head dim by its own flag (a bad --head-dim-qk was ignored; a bad --head-dim was named as
# --head-dim-qk and --head-dim-v)
bad(base + ["--head-dim-qk", "-5"], "--head-dim-qk: Value -5 not in range 1 to 256")
bad(base + ["--head-dim-v", "0"], "--head-dim-v: Value 0 not in range 1 to 256")
bad(base + ["--head-dim", "300"], "--head-dim: Value 300 not in range 1 to 256")
bad(["simulate", "--lengths", "100,50", "--cp", "4", "--cp-inner", "3"], "--cp-inner = 3 must divide --cp = 4")
bad(base + ["--experts", "4", "--ep", "3"], "--ep = 3 must divide --experts = 4")
bad(base + ["--pp", "2", "--layers", "3"], "--layers = 3", "multiple of --pp = 2")
bad(base + ["--schedule", "zigzag"], "--schedule must be one of")
bad(["simulate", "--lengths", "100", "--lengths-file", lf, "--cp", "2"], "give the batch once")
bad(base + ["--kv-heads", "3"], "--heads = 8 must be a multiple of --kv-heads = 3")
bad(["simulate", "--distribution", "lognormal", "--mean-length", "0", "--cp", "2"], "--mean-length must be >= 1")
# (from a helper's hunt) fill-drain predicted a forward's time beside a training step's bytes
bad(base + ["--pp", "2", "--layers", "2", "--schedule", "fill-drain"], "--schedule fill-drain runs forwards only")
# the schedule's own rules, named by the flags (they named make_schedule's fields)
bad(base + ["--pp", "2", "--layers", "4", "--micro-batches", "3", "--schedule", "interleaved", "--no-breakeven"],
    "--schedule with --pp stages, --micro-batches micro-batches and --virtual chunks:")
# interleaved's chunks (--virtual, default 2): equal chunks, and V > 1 for interleaved only
bad(base + ["--pp", "2", "--layers", "2", "--micro-batches", "2", "--schedule", "interleaved", "--no-breakeven"],
    "--layers = 2 must be >= 1 and a multiple of --pp = 2 x --virtual = 2 (its default with interleaved)")
bad(base + ["--pp", "2", "--layers", "2", "--virtual", "2", "--no-breakeven"],
    "--virtual = 2 needs the interleaved schedule (--schedule), not 1f1b")
# interleaved runs --virtual chunks (default 2): in the JSON, and the same work in a smaller bubble
pipe = base + ["--pp", "2", "--layers", "8", "--micro-batches", "4", "--no-breakeven", "--json"]
one = json.loads(run(*pipe).stdout)
for extra, v in (([], 2), (["--virtual", "4"], 4)):
    il = json.loads(run(*pipe, "--schedule", "interleaved", *extra).stdout)
    check(il["mesh"]["virtual_stages"] == v and one["mesh"]["virtual_stages"] == 1, f"virtual_stages: {il['mesh']}")
    for a, b in zip(one["schemes"], il["schemes"]):
        if a["valid"]:
            check(b["bubble_fraction"] < a["bubble_fraction"] and abs(b["compute_s"] - a["compute_s"]) <= 1e-9 * a["compute_s"],
                  f"interleaved V {v} against 1f1b, {a['scheme']}: {b['bubble_fraction']} {a['bubble_fraction']}")
sub = json.loads(json.dumps(good))
sub["intra_node"]["bandwidth_gbs"] = 1e-320  # subnormal: passed "> 0", then inf costs named no field
bad(base + ["--profile", write("subnormal.json", sub)], "profile.intra_node.bandwidth_gbs must be a finite number >= 0.001")
sub = json.loads(json.dumps(good))
sub["compute"]["fwd"]["bf16"] = 1e-320
bad(base + ["--profile", write("subnormal2.json", sub)], "profile.compute.fwd.bf16", ">= 0.001 (GFLOP/s)")
# A mean length past int64: one document of all the tokens (llround of it gave 1-token documents).
r = run("simulate", "--distribution", "fixed", "--mean-length", "1e19", "--tokens", "100", "--cp", "2", "--json",
        "--no-breakeven")
check(r.returncode == 0 and json.loads(r.stdout)["documents"] == 1, f"--mean-length 1e19: {r.stdout[:300]} {r.stderr}")
# A NaN length from a huge --sigma (inf - inf): refused, naming the flag (it gave a negative
# document and an int64 overflow).
bad(["simulate", "--distribution", "lognormal", "--sigma", "1e308", "--tokens", "100", "--cp", "2"],
    "--sigma must be in [0, 100]")
# A billion layers: the step's bytes in O(1) (they were added layer by layer: minutes).
start = time.monotonic()
r = run("simulate", "--lengths", "4096", "--cp", "2", "--no-breakeven", "--layers", "1000000000", "--json")
check(r.returncode == 0 and time.monotonic() - start < 20, f"--layers 1e9: exit {r.returncode} {r.stderr[-300:]}")
over = json.loads(json.dumps(good))
over["cp_overhead"] = {"fwd": {"bf16": {"zigzag": 0.1}}}
bad(base + ["--profile", write("zigzag.json", over)], "profile.cp_overhead.fwd.bf16.zigzag: unknown scheme 'zigzag'")
over["cp_overhead"] = {"bwd": {"bf16": {"ring": -0.5}}}
bad(base + ["--profile", write("negover.json", over)], "profile.cp_overhead.bwd.bf16.ring must be a finite number >= 0")
over["cp_overhead"] = {"bwd": {"fp8": {"ring": 0.5}}}
bad(base + ["--profile", write("fp8over.json", over)], "profile.cp_overhead.bwd.fp8: unknown dtype 'fp8'")
# A --tokens far past memory: refused with both sizes, naming the flag, before the lengths exist
# (1e15 tokens would take 2 TiB of lengths alone; the check costs nothing).
bad(["simulate", "--distribution", "lognormal", "--tokens", "1000000000000000", "--cp", "1024"],
    "--tokens 1000000000000000 (about", "at --cp 1024 needs", "PiB", "available")
# A given batch past memory at its CP size (the chunk table, documents x 2cp): the same.
bad(["simulate", "--lengths", "5,6,7", "--cp", "65536"], "3 documents (--lengths) at --cp 65536 needs", "MiB",
    "more than the 976.6 KiB available (CPATTN_MEMORY_LIMIT_BYTES)", env={"CPATTN_MEMORY_LIMIT_BYTES": "1000000"})
# The library names SimModel's fields in a scheme's reason; the command line names its flags.
r = run("simulate", "--lengths", "100,50", "--cp", "3", "--json", "--no-breakeven")
a2a = json.loads(r.stdout)["schemes"][3] if r.returncode == 0 else {}
check(not a2a.get("valid", True) and "--heads / --tp" in a2a.get("reason", "") and "SimModel" not in a2a["reason"],
      f"a2a reason at cp 3: {a2a}")
# One 16M-token document: the length sweep stops where its pairs would overflow int64.
r = run("simulate", "--lengths", "16000000", "--cp", "8", "--heads", "64", "--kv-heads", "8", "--json")
check(r.returncode == 0 and all(s["valid"] for s in json.loads(r.stdout)["schemes"]), f"16M tokens: {r.stderr}")

# ---- calibrate: one process (links not measured), then two ranks (ring shifts) -----------------
tiny = ["calibrate", "--seq-len", "128", "--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--repeats", "1",
        "--iters", "3", "--sizes", "8,1048576", "--overhead-tokens", "96"]
out = os.path.join(tmp, "calibrated.json")
r = run(*tiny, "--json", "--out", out)
check(r.returncode == 0, f"calibrate: {r.stderr}")
p = json.loads(r.stdout)
check(all(p["compute"][d][t] > 0 for d in ("fwd", "bwd") for t in ("fp32", "fp16", "bf16")), "rates")
check("NOT measured" in p["source"] and p["ranks_per_node"] == 1, "one-rank source")
r = run("simulate", "--lengths", "300,20", "--cp", "2", "--profile", out, "--json", "--no-breakeven")
check(r.returncode == 0 and json.loads(r.stdout)["profile"] == "this-machine", f"read back: {r.stderr}")
# --timeout beats CPATTN_COMM_TIMEOUT_S (whose bad value is then never read), and a bad --timeout
# is refused naming the flag before any collective.
r = run(*tiny, "--dtypes", "fp32", "--json", "--timeout", "60", mpi=2, env={"CPATTN_COMM_TIMEOUT_S": "-1"})
check(r.returncode == 0, f"calibrate np 2: {r.stderr}")
p2 = json.loads(r.stdout)
check(p2["ranks_per_node"] == 2 and len(p2["measured"]["shifts"]) == 2, "np 2: shifts measured")
check(p2["intra_node"]["latency_us"] > 0 and p2["intra_node"]["bandwidth_gbs"] > 0, "np 2: link figures")
check(list(p2["compute"]["fwd"]) == ["fp32"], "only the asked dtype")
# The CP overhead: every scheme at cp 2 on its own batch; the fraction written is the measured
# one, and the model with it (at the bare kernel's rates on that batch) meets the measured call.
ov = p2["measured"]["cp_overhead"]
check([o["scheme"] for o in ov] == ["allgather", "ring", "pass-q", "a2a", "hybrid"], f"overheads measured: {ov}")
check(sum(p2["measured"]["cp_overhead_lengths"]) == 2 * 96, "the overhead's batch: 96 tokens per rank")
for o in ov:
    for d, name in (("fwd", "forward"), ("bwd", "backward")):
        written = p2.get("cp_overhead", {}).get(d, {}).get("fp32", {}).get(o["scheme"], 0)
        check(written == o[d] and o[d] >= 0, f"{o['scheme']} {d}: written {written}, measured {o[d]}")
        check((o[d] == 0) == (o[f"model_{d}_s"] >= o[f"measured_{d}_s"]), f"{o['scheme']} {d}: 0 iff the model is not below")
        if o[d] == 0:
            continue
        at = json.loads(json.dumps(p2))
        at["compute"] = {"fwd": {"fp32": o["kernel_fwd_gflops"]}, "bwd": {"fp32": o["kernel_bwd_gflops"]}}
        pf = os.path.join(tmp, "fit.json")
        with open(pf, "w") as f:
            json.dump(at, f)
        r = run("simulate", "--lengths", ",".join(map(str, p2["measured"]["cp_overhead_lengths"])), "--cp", "2",
                "--cp-inner", str(o["cp_inner"] or 2), "--heads", "2", "--kv-heads", "1", "--head-dim", "16",
                "--dtype", "fp32", "--profile", pf, "--json", "--no-breakeven")
        s = [x for x in json.loads(r.stdout)["schemes"] if x["scheme"] == o["scheme"]][0]
        t = max(c + e for c, e in zip(s[name]["compute_s"], s[name]["exposed_s"]))
        check(abs(t - o[f"measured_{d}_s"]) <= 1e-3 * o[f"measured_{d}_s"],
              f"{o['scheme']} {d}: the fitted model's call {t} vs measured {o[f'measured_{d}_s']}")
bad(["calibrate", "--dtypes", "fp8"], "--dtypes: --dtype must be one of")
# --out checked before the calibration (it failed at the end), written whole (/dev/full: exit 0)
bad(["calibrate", "--out", os.path.join(tmp, "no-such-folder", "p.json")], "--out: the folder")
bad(["calibrate", "--out", "/dev/full"], "--out: '/dev/full' is a character device")
# One message size gives no bandwidth (65536 GB/s was written from a 1e-12 s difference).
r = run("calibrate", "--seq-len", "128", "--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--repeats", "1",
        "--iters", "3", "--dtypes", "fp32", "--sizes", "65536", "--overhead-tokens", "0", mpi=2)
check(r.returncode == 2 and "--sizes: give at least two different message sizes" in r.stderr,
      f"calibrate --sizes 65536 at np 2: exit {r.returncode} {r.stderr[-400:]!r}")
# A kernel case past memory: refused before anything is allocated, with both sizes.
bad(["calibrate", "--seq-len", "10000000000"], "cpattn calibrate's fp32 kernel case of 10000000000 tokens needs",
    "available")
# The CP overhead's case needs the world size: refused after MPI starts, on every rank alike.
r = run("calibrate", "--seq-len", "16", "--dtypes", "fp32", "--overhead-tokens", "65536", "--sizes", "8,1048576", mpi=2,
        env={"CPATTN_MEMORY_LIMIT_BYTES": "100000000"})
check(r.returncode == 2 and "fp32 CP overhead case (--overhead-tokens x 2 ranks) of 131072 tokens needs" in r.stderr,
      f"calibrate's overhead case past memory: exit {r.returncode} {r.stderr[-400:]!r}")
r = run(*tiny, "--timeout", "-1", mpi=2)
check(r.returncode == 2 and "--timeout must be in (0, 1e+07] seconds, got -1" in r.stderr,
      f"calibrate --timeout -1: exit {r.returncode} {r.stderr[-400:]!r}")
r = run(*tiny, mpi=2, env={"CPATTN_COMM_TIMEOUT_S": "-1"})
check(r.returncode == 2 and "CPATTN_COMM_TIMEOUT_S" in r.stderr, f"calibrate with a bad variable: {r.stderr[-400:]!r}")

finish()
