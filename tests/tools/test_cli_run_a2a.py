"""`mpirun -np N cpattn run --scheme a2a|hybrid [--cp-inner N]` end to end: exact against the
single-process run (cpattn run's own check), byte counts in the JSON, and the flags' errors
(exit 2 naming the flag). Few small jobs: the CI budget."""
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/cli_lib.py
from cli_lib import check, finish, run, run_json

SMALL = ("--lengths", "37,1,100,3", "--head-dim-qk", "48", "--head-dim-v", "32")
# (ranks, flags): a2a with split KV heads, a2a with one replicated KV head and no mask,
# hybrid 2 x 2, and hybrid 1 x 2 with dropout in two CP groups of 2 (--cp 2).
for np_, flags in ((2, ("--scheme", "a2a", "--heads", "4", "--kv-heads", "2", "--dtype", "bf16")),
                   (3, ("--scheme", "a2a", "--heads", "6", "--kv-heads", "1", "--mask", "none")),
                   (4, ("--scheme", "hybrid", "--cp-inner", "2", "--heads", "4", "--kv-heads", "2", "--dtype", "fp16")),
                   (4, ("--scheme", "hybrid", "--cp-inner", "1", "--cp", "2", "--heads", "4", "--kv-heads", "4",
                        "--dropout", "0.1"))):
    j = run_json(np_, *flags, *SMALL)
    if j:
        scheme = flags[1]
        check(j["passed"] and j["scheme"] == scheme, f"{flags} np {np_}: {j}")
        check(j["cp_inner"] == (int(flags[3]) if scheme == "hybrid" else 0), f"cp_inner in the JSON: {j}")
        check(len(j["bytes_sent"]) == j["cp"] and all(b > 0 for b in j["bytes_sent"]), f"bytes: {j}")
        check(j["bytes_sent"] == j["bytes_received"], f"bytes balance: {j}")

# The table's comm_s by part: the all-gather's four parts, the other schemes' agreement and their
# own transfers (they printed the all-gather's parts, zero but the agreement, summing to more).
for scheme, part in (("ring", "ring"), ("a2a", "a2a"), ("allgather", "first K/V")):
    r = run(2, "--scheme", scheme, "--heads", "4", "--kv-heads", "2", *SMALL)
    rows = re.findall(r"^  [01] +agreement ([0-9.]+) \+ " + re.escape(part) + r" ([0-9.]+) .*= ([0-9.]+)$", r.stdout, re.M)
    check(r.returncode == 0 and len(rows) == 2, f"{scheme}: by-part rows {rows} in {r.stdout[-1500:]!r}")
    if scheme != "allgather":
        check(all(abs(float(a) + float(b) - float(c)) <= 2e-4 for a, b, c in rows), f"{scheme}: parts {rows} do not add up")

# Bad flags: exit 2, the flag named, the same line from every rank.
for np_, flags, flag in ((4, ("--scheme", "hybrid", "--cp-inner", "3"), "--cp-inner must divide the CP size 4"),
                         (2, ("--scheme", "a2a", "--cp-inner", "2"), "--cp-inner is for --scheme hybrid only"),
                         (4, ("--scheme", "a2a", "--heads", "12", "--kv-heads", "3"), "--kv-heads (3) must be divisible"),
                         # the all-gather's flags, given to a scheme without one (they were ignored)
                         (2, ("--scheme", "ring", "--overlap", "off"), "--overlap sets the all-gather's"),
                         (2, ("--scheme", "a2a", "--shared-memory", "on"), "--shared-memory sets the all-gather's"),
                         (2, ("--mode", "index", "--overlap", "off"), "--overlap sets the all-gather in runs mode: "
                                                                      "--mode index would ignore it"),
                         (2, ("--scheme", "all", "--mode", "index", "--shared-memory", "on"),
                          "--shared-memory sets the all-gather in runs mode: --mode index would ignore it")):
    r = run(np_, *flags, "--lengths", "10")
    # Every rank rejects it: the line names all of them ([ranks 0,1], [ranks 0-3]).
    every = "0,1" if np_ == 2 else f"0-{np_ - 1}"
    check(r.returncode == 2 and flag in r.stderr and f"[ranks {every}]" in r.stderr,
          f"{flags}: exit {r.returncode} {r.stderr[-800:]}")

finish()
print("all passed")
