"""`cpattn moe` under mpirun: the JSON report's counts add up against hand-derived totals, a
skewed router favours expert 0, and bad flags exit 2 with one line naming the flag."""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/cli_lib.py
from cli_lib import CPATTN, MPIEXEC, check, finish, job


def run(np_, *args):
    return job(np_, "moe", *args, timeout=120)


SMALL = ["--tokens", "16", "--hidden", "8", "--ffn", "8"]

# ep 2, E 4, top-2, capacity ceil(0.5 * 16 * 2 / 4) = 4 per expert per rank: drops.
r = run(2, "--experts", "4", "--top-k", "2", "--ep", "2", "--capacity-factor", "0.5", "--json", *SMALL)
check(r.returncode == 0, f"moe json failed: {r.returncode} {r.stderr}")
j = json.loads(r.stdout)
check(j["check"]["pass"] and j["check"]["y"] <= 1e-5, f"check {j['check']}")
check(sum(j["routed_per_expert"]) == 2 * 16 * 2, "routed total = ranks * tokens * K")
check(all(k <= 2 * 4 for k in j["kept_per_expert"]), "kept <= ranks * capacity")
check(sum(j["kept_per_expert"]) + j["dropped"] == 64 and j["dropped"] > 0, "kept + dropped")
check([x["tokens"] for x in j["ranks"]] == [sum(j["kept_per_expert"][0:2]), sum(j["kept_per_expert"][2:4])],
      "tokens per rank = its experts' kept rows")
check(all(x["bytes_sent"] > 0 for x in j["ranks"]), "bytes counted")

# ep 3, E 3, top-1, a strong skew: expert 0 takes the most tokens.
r = run(3, "--experts", "3", "--ep", "3", "--skew", "6", "--json", *SMALL)
check(r.returncode == 0, f"skewed run failed: {r.stderr}")
j = json.loads(r.stdout)
check(j["routed_per_expert"][0] == max(j["routed_per_expert"]) and j["imbalance"] > 1.5,
      f"skew: {j['routed_per_expert']}")

# The table.
r = run(2, "--experts", "2", "--ep", "2", "--router", "sigmoid-bias", *SMALL)
check(r.returncode == 0 and "PASS" in r.stdout and "imbalance (max/mean)" in r.stdout, f"table: {r.stdout}")

# Bad flags: exit 2, the flag named on one line (rank 0 prints).
for np, args, text in [
    (2, ["--experts", "4", "--top-k", "5", "--ep", "2"], "--top-k must be in 1..--experts = 4, got 5"),
    (2, ["--experts", "3", "--ep", "2"], "--ep 2 must divide --experts 3"),
    (2, ["--experts", "4", "--ep", "3"], "--ep 3 must equal the number of MPI ranks (2)"),
    (1, ["--experts", "4", "--capacity-factor", "0"], "--capacity-factor must be finite and > 0, got 0"),
    (1, ["--experts", "4", "--capacity-factor", "inf"], "--capacity-factor must be finite and > 0, got inf"),
    (1, ["--experts", "4", "--aux-loss-coeff", "-1"], "--aux-loss-coeff must be finite and >= 0, got -1"),
    (1, ["--experts", "4", "--aux-loss-coeff", "0.1", "--router", "sigmoid-bias"], "--aux-loss-coeff needs --router softmax"),
    (1, ["--experts", "4", "--router", "topk"], "--router"),
    # finite as a double, infinite as the router's float weight: NaN results passed the check
    (1, ["--experts", "4", "--skew", "1e39"], "--skew must be in [-10000, 10000]"),
]:
    r = run(np, *args, *SMALL)
    check(r.returncode == 2, f"{args}: exit {r.returncode}")
    check(r.stderr.count("cpattn: error") == 1 and text in r.stderr,
          f"{args}: stderr {r.stderr!r}")

# One rank failing a check of its own (its node's memory, here a limit only rank 0 is given; or
# flags that differ between ranks): every rank exits 2 at once with rank 0's message. The
# others waited in the layer's agreement until --timeout before.
import subprocess
import time
for env0, flags0, text in [(["-x", "CPATTN_MEMORY_LIMIT_BYTES=1000"], [], "more than the 1000 B available (CPATTN_MEMORY_LIMIT_BYTES)"),
                           ([], ["--top-k", "5"], "--top-k must be in 1..--experts = 4, got 5")]:
    flags = ["moe", "--experts", "4", "--ep", "2", "--timeout", "60", *SMALL]
    start = time.monotonic()
    r = subprocess.run([MPIEXEC, "--oversubscribe", "-np", "1", *env0, CPATTN, *flags, *flags0, ":",
                        "-np", "1", CPATTN, *flags], capture_output=True, text=True, timeout=120)
    took = time.monotonic() - start
    check(r.returncode == 2 and text in r.stderr and took < 30,
          f"one rank failing alone ({text}): exit {r.returncode} after {took:.0f} s, stderr {r.stderr[-800:]!r}")

finish()
