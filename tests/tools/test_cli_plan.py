"""`cpattn plan` end to end: the table, the JSON against docs/design.md's worked example, every
input spelling, and exit code 2 with one line for bad flags and values."""
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/cli_lib.py
from cli_lib import check, finish, job


def run(*args):
    return job(0, *args, timeout=60)


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
# No padding here, so the real-only counts are the whole chunks' (per document c = 4, 6):
# rect (2cp+1)c^2 = 5*16 + 5*36 = 260, pairs (2cp-1)c^2 + c(c+1) = 68 + 150 = 218.
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

# The default: the built-in example (lengths 3000,120,900,1,2047,64,1500,361), as a table.
# Work counts real pairs only. Per rank, a document of chunk c without padding gives
# 4c^2 + c pairs at cp = 2 (3000, 120, 900, 64, 1500: 2250750 + 3630 + 202725 + 1040 +
# 562875 = 3021020 on both ranks); the padding (1 -> 4, 2047 -> 2048, 361 -> 364) sits at the
# tail, and each padding query at position p would have seen p + 1 keys:
#   1:    W = 5,       rank 0 loses 4 (pos 3)           -> 1, rank 1 loses 2+3 (pos 1,2) -> 0
#   2047: W = 1049088, rank 0 loses 2048                -> 1047040, rank 1 1049088
#   361:  W = 33215,   rank 0 loses 362+363+364 = 1089  -> 32126,   rank 1 33215
# rank 0: 4100187, rank 1: 4103323 pairs; imbalance 4103323 / 4101755 = 1.000382...
r = run("plan")
check(r.returncode == 0 and "imbalance" in r.stdout and "balanced 1.0004" in r.stdout,
      f"default table: {r.stdout} {r.stderr}")
j = json.loads(run("plan", "--json").stdout)
check([x["visible_pairs"] for x in j["ranks"]] == [4100187, 4103323], "default visible_pairs")
check(abs(j["imbalance"]["balanced"] - 4103323 / 4101755) < 1e-12, "default balanced imbalance")

# A padded batch: lengths 5 and 1 at cp = 2, padded to 8 and 4 (chunks 2 and 1). Real work:
#   rank 0: doc 0 chunk 0 (pos 0,1 over keys 0,1) rect 2*2, pairs 1+2; chunk 3 all padding;
#           doc 1 chunk 0 (pos 0) rect 1, pairs 1; chunk 3 padding    -> rect 5, pairs 4
#   rank 1: doc 0 chunk 1 (pos 2,3 over keys 0-3) rect 2*4, pairs 3+4; chunk 2 (pos 4 real)
#           rect 1*5, pairs 5; doc 1 chunks 1, 2 padding              -> rect 13, pairs 12
# imbalance 12 / 8 = 1.5 (rank 0 holds the padding).
r = run("plan", "--cu-seqlens", "0,5,6", "--cp", "2", "--json")
j = json.loads(r.stdout)
check(j["cu_seqlens_padded"] == [0, 8, 12], "padding in json")
check(j["padding_tokens"] == 6 and [x["padding_tokens"] for x in j["ranks"]] == [3, 3], "padding tokens")
check([x["rect_work"] for x in j["ranks"]] == [5, 13], f"padded rect_work: {j['ranks']}")
check([x["visible_pairs"] for x in j["ranks"]] == [4, 12], "padded visible_pairs")
check(j["imbalance"]["balanced"] == 1.5, "padded balanced imbalance")

# cp = 1: no padding, one task per document (the single-process varlen call), the gather
# index the identity; rect 16^2 + 24^2 = 832, pairs 16*17/2 + 24*25/2 = 136 + 300 = 436.
r = run("plan", "--cu-seqlens", "0,16,40", "--cp", "1", "--json")
check(r.returncode == 0, f"cp 1: {r.stderr}")
j = json.loads(r.stdout)
(only,) = j["ranks"]
check(j["cu_seqlens_padded"] == [0, 16, 40] and j["padding_tokens"] == 0, "cp 1 padding")
check(only["local_tokens"] == 40 and only["padding_tokens"] == 0 and only["tasks"] == 2, "cp 1 counts")
check(only["actual_seq_qlen"] == [16, 40] and only["actual_seq_kvlen"] == [16, 40], "cp 1 seqlens")
check(only["global_token_index"] == list(range(40)) and only["kv_gather_index"] == list(range(40)),
      "cp 1 identity")
check(only["kv_runs"] == [[{"row": 0, "len": 16, "pos": 0}], [{"row": 16, "len": 24, "pos": 0}]],
      "cp 1 runs")
check(only["rect_work"] == 832 and only["visible_pairs"] == 436, "cp 1 work")
check(only["contiguous_rect_work"] == 832 and only["contiguous_visible_pairs"] == 436, "cp 1 contiguous")
check(j["imbalance"] == {"balanced": 1.0, "contiguous": 1.0, "bound": 1.0, "lower_bound": 1.0}, "cp 1 imbalance")
r = run("plan", "--lengths", "3", "--cp", "1", "--json")
check(json.loads(r.stdout)["cu_seqlens_padded"] == [0, 3], "cp 1 pads nothing")

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
    ("plan", "--lengths-file", "/nonexistent/file"): "--lengths-file: '/nonexistent/file': cannot read it",
    ("plan", "--lengths-file", "/"): "--lengths-file: '/' is a folder, not a regular file",
    ("plan", "--lengths-file", ""): "--lengths-file: a path must not be empty",  # (was: the default batch)
    ("plan", "--svg", ""): "--svg: a path must not be empty",  # (was: no drawing, no word)
    ("nosuchcommand",): "nosuchcommand",
    ("plan", "--lengths", "6,4444444448", "--cp", "1"): "--lengths: work count overflows int64",  # found by fuzz_cli
    ("plan", "--cu-seqlens", "0,1099511627776", "--cp", "2"): "--cu-seqlens: work count overflows int64",
    ("plan", "--ends", "4294967295", "--cp", "1"): "--ends: work count overflows int64",
    # past int64: named as given (the conversion's clamped value, -9223372036854775808, was quoted)
    ("plan", "--lengths", "-99999999999999999999"): "--lengths: must be an integer within int64 (|x| <= "
                                                    "9223372036854775807), got -99999999999999999999",
    ("plan", "--cu-seqlens", "0,99999999999999999999"): "--cu-seqlens: must be an integer within int64",
    ("run", "--lengths", "99999999999999999999"): "--lengths: must be an integer within int64",
    ("simulate", "--lengths", "99999999999999999999"): "--lengths: must be an integer within int64",
    # an empty field of a comma-separated value (CLI11 dropped it: 16,,24 planned 16,24)
    ("plan", "--lengths", "16,,24"): "--lengths: an empty field in '16,,24'",
    ("plan", "--lengths=16,24,"): "--lengths: an empty field in '16,24,'",
    ("plan", "--cu-seqlens", ",0,16"): "--cu-seqlens: an empty field in ',0,16'",
    ("run", "--lengths", "8", "8,,8"): "--lengths: an empty field in '8,,8'",
    ("bench", "attention", "--lengths", "5,,6"): "--lengths: an empty field in '5,,6'",
    ("train", "--compare", "1,,2"): "--compare: an empty field in '1,,2'",
}
for args, needle in bad.items():
    r = run(*args)
    lines = r.stderr.strip().splitlines()
    check(r.returncode == 2, f"{args}: exit {r.returncode}, want 2")
    check(len(lines) == 1 and needle in lines[0], f"{args}: stderr {r.stderr!r} lacks {needle!r}")

with tempfile.TemporaryDirectory() as d:
    # --svg in --lengths-file's file (by name, through a link): refused, the input left as it
    # was (the drawing replaced it).
    lengths = os.path.join(d, "lens.txt")
    with open(lengths, "w") as f:
        f.write("16\n24\n")
    os.symlink(lengths, os.path.join(d, "link.svg"))
    for svg in (lengths, os.path.join(d, "link.svg")):
        r = run("plan", "--lengths-file", lengths, "--svg", svg)
        check(r.returncode == 2 and f"--svg '{svg}' is the file of --lengths-file '{lengths}'" in r.stderr,
              f"--svg {svg} over its input: exit {r.returncode}\n{r.stderr}")
    with open(lengths) as f:
        check(f.read() == "16\n24\n", "--lengths-file left as it was")
    # A long valid --svg name (250 bytes; NAME_MAX 255) is written (its temporary name was too long).
    svg = os.path.join(d, "s" * 250)
    r = run("plan", "--lengths", "16,24", "--svg", svg)
    check(r.returncode == 0 and os.path.isfile(svg), f"250-byte --svg name: exit {r.returncode}\n{r.stderr}")

    # A plan past memory: refused with both sizes, naming --cp and the lengths' flag (a bare
    # std::bad_alloc before). 2000 documents at cp 1024: 2000 x 2048 chunks of 32 bytes =
    # 131072000 bytes of chunk table (125.0 MiB), against a limit of 10^7 bytes (9.5 MiB).
    with open(lengths, "w") as f:
        f.write("1\n" * 2000)
    env = {**os.environ, "CPATTN_MEMORY_LIMIT_BYTES": "10000000"}
    r = job(0, "plan", "--lengths-file", lengths, "--cp", "1024", timeout=60, env=env)
    check(r.returncode == 2 and f"cpattn plan of 2000 documents (--lengths-file {lengths}) at --cp 1024 needs" in r.stderr
          and "chunk table 125.0 MiB" in r.stderr and "more than the 9.5 MiB available (CPATTN_MEMORY_LIMIT_BYTES)"
          in r.stderr and len(r.stderr.strip().splitlines()) == 1, f"plan past memory: exit {r.returncode}\n{r.stderr}")
    r = job(0, "plan", "--lengths-file", lengths, "--cp", "8", timeout=60, env=env)  # 1 MiB of chunks: fits
    check(r.returncode == 0, f"plan within memory: exit {r.returncode}\n{r.stderr}")
    r = job(0, "plan", "--lengths", "1,2,3", "--cp", "65536", timeout=60, env=env)  # 12 MiB of chunks
    check(r.returncode == 2 and "(--lengths) at --cp 65536 needs" in r.stderr, f"--lengths past memory: {r.stderr}")

finish()
print("cli plan: all checks passed")
