"""`cpattn plan` end to end: the table, the JSON against DESIGN.md's worked example, every
input spelling, and exit code 2 with one line for bad flags and values."""
import json
import os
import subprocess
import sys
import tempfile

CPATTN = sys.argv[1]
failures = []


def run(*args):
    return subprocess.run([CPATTN, *args], capture_output=True, text=True, timeout=60)


def check(cond, what):
    if not cond:
        failures.append(what)


# The worked example, value by value.
r = run("plan", "--cu-seqlens", "0,16,40", "--cp", "2", "--json")
check(r.returncode == 0, f"json run failed: {r.stderr}")
j = json.loads(r.stdout)
check(j["cp"] == 2, "cp")
check(j["cu_seqlens_padded"] == [0, 16, 40], "cu_seqlens_padded")
r0, r1 = j["ranks"]
check(r0["rank"] == 0 and r1["rank"] == 1, "rank order")
check(r0["global_token_index"] == [*range(0, 4), *range(12, 16), *range(16, 22), *range(34, 40)],
      "rank 0 global_token_index")
check(r1["global_token_index"] == [*range(4, 8), *range(8, 12), *range(22, 28), *range(28, 34)],
      "rank 1 global_token_index")
check(r0["actual_seq_qlen"] == [4, 8, 14, 20], "actual_seq_qlen")
check(r0["actual_seq_kvlen"] == [4, 20, 26, 50], "rank 0 actual_seq_kvlen")
check(r1["actual_seq_kvlen"] == [8, 20, 32, 50], "rank 1 actual_seq_kvlen")
check(r0["kv_gather_index"] == [*range(0, 4), *range(0, 4), *range(20, 28), *range(4, 8),
                                *range(8, 14), *range(8, 14), *range(28, 40), *range(14, 20)],
      "rank 0 kv_gather_index")
for rank in (r0, r1):
    check(rank["local_tokens"] == 20 and rank["padding_tokens"] == 0, "tokens")
    check(rank["rect_work"] == 5 * 16 + 5 * 36, "rect_work")
    check(rank["visible_pairs"] == 3 * 16 + 20 + 3 * 36 + 42, "visible_pairs")
check(j["imbalance"]["balanced"] == 1.0, "balanced imbalance")
check(abs(j["imbalance"]["contiguous"] - 290 / 218) < 1e-12, "contiguous imbalance")

# Every spelling of the same batch gives the same plan.
with tempfile.TemporaryDirectory() as d:
    path = os.path.join(d, "lengths.txt")
    with open(path, "w") as f:
        f.write("# document lengths\n16\n\n24  # the second\n")
    same = [run("plan", "--ends", "16,40", "--cp", "2", "--json"),
            run("plan", "--lengths", "16,24", "--cp", "2", "--json"),
            run("plan", "--lengths-file", path, "--cp", "2", "--json")]
    for s in same:
        check(s.returncode == 0 and json.loads(s.stdout) == j, f"spelling differs: {s.args}")
    with open(path, "w") as f:
        f.write("16\nabc\n")
    bad_file = run("plan", "--lengths-file", path)
    check(bad_file.returncode == 2 and ":2:" in bad_file.stderr, f"bad file: {bad_file.stderr}")

# The default: the built-in example, as a table.
r = run("plan")
check(r.returncode == 0 and "imbalance" in r.stdout and "balanced 1.0000" in r.stdout,
      f"default table: {r.stdout} {r.stderr}")
r = run("plan", "--cu-seqlens", "0,5,6", "--cp", "2", "--json")
check(json.loads(r.stdout)["cu_seqlens_padded"] == [0, 8, 12], "padding in json")

# Help explains every flag.
h = run("plan", "--help")
for flag in ("--cu-seqlens", "--ends", "--lengths-file", "--cp", "--json"):
    check(flag in h.stdout, f"help lacks {flag}")
check(run("--help").returncode == 0 and "plan" in run("--help").stdout, "top-level help")

# Bad flags and values: exit code 2, one line naming the problem, no stack trace.
bad = {
    ("plan", "--cu-seqlens", "0,16,16"): "--cu-seqlens",
    ("plan", "--cu-seqlens", "1,16"): "--cu-seqlens[0] must be 0",
    ("plan", "--ends", "16,8"): "--ends",
    ("plan", "--ends", "16,-4"): "negative",
    ("plan", "--cp", "0"): "--cp must be >= 1",
    ("plan", "--cp", "two"): "--cp",
    ("plan", "--bogus"): "--bogus",
    ("plan", "--ends", "16", "--cu-seqlens", "0,16"): "excludes",
    ("plan", "--lengths", "3,0"): "--lengths[1]",
    ("plan", "--lengths-file", "/nonexistent/file"): "cannot open",
    ("nosuchcommand",): "nosuchcommand",
    ("plan", "--lengths", "6,4444444448", "--cp", "1"): "overflows int64",  # found by fuzz_cli
}
for args, needle in bad.items():
    r = run(*args)
    lines = r.stderr.strip().splitlines()
    check(r.returncode == 2, f"{args}: exit {r.returncode}, want 2")
    check(len(lines) == 1 and needle in lines[0], f"{args}: stderr {r.stderr!r} lacks {needle!r}")

if failures:
    print("FAILED:\n  " + "\n  ".join(failures))
    sys.exit(1)
print("cli plan: all checks passed")
