"""`cpattn train --experts E --top-k K --ep N` (docs/training.md "Mixture of experts"): every
block's MLP replaced by the expert-parallel MoE layer trains to the curve of one process.
Checked per step, 1e-5 relative (fp32), against the one-process run with the same --micro:
  - with a capacity factor that drops assignments (by position, and by probability) and the
    Switch auxiliary loss (a routing group is one sequence, as on one process, whatever the
    mesh; at cp > 1 its statistics and drops are decided over the CP group): DP=2 x EP=2,
    CP=2 x EP=2 (both policies), and with 6 experts on documents of 1 to 300 bytes CP=3 x EP=3 (by position) and CP=3
    alone (EP=1, by probability); the dropped count is the same integer;
  - without a capacity factor (routing per token, so the CP split does not matter): CP=2 x
    EP=2, DP=2 x CP=2 x EP=4, DP=2 x CP=2 x EP=2 (each expert's gradient summed over two
    ranks), CP=3 x EP=3 (6 experts, top-3), CP=2 x PP=2 x EP=2 (zb-h1),
    on documents of 1, 2, 7 and 300 bytes (1-token documents; the planner pads at cp > 1,
    and padding rows are not routed);
  - the sigmoid-bias router (bias moved once per step from the whole step's load) at DP=2 x
    EP=2, and a larger bias step changes the curve;
  - a checkpoint saved at DP=2 x CP=2 x EP=2 (experts sharded, gathered on the writer
    alone) resumes at one process and continues the curve; a resume with another --top-k is refused naming top_k.
Bad arguments exit 2 naming the flag and the rule, before MPI starts (so one process shows it,
whatever the mesh the flags name); ranks launched
with another --experts or --top-k fail together naming it."""
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/cli_lib.py
from cli_lib import CPATTN, MPIEXEC, check, finish, log, train

TINY = ["--layers", "2", "--dim", "24", "--heads", "2", "--kv-heads", "1", "--seq-len", "48",
        "--warmup", "1", "--micro", "2"]
MOE = ["--experts", "4", "--top-k", "2"]
STEPS = 3


def close(x, y):
    return abs(x - y) <= 1e-5 * abs(x)


def same_curve(ref, got, what, aux=False):
    check(len(got) == len(ref), f"{what}: {len(got)} steps logged, expected {len(ref)}")
    for x, y in zip(ref, got):
        check(x["step"] == y["step"], f"{what}: step {y['step']} against {x['step']}")
        for key in ["loss", "grad_norm"] + (["aux_loss"] if aux else []):
            check(close(x[key], y[key]), f"{what} step {x['step']}: {key} {y[key]} vs {x[key]}")
        check(x["dropped"] == y["dropped"], f"{what} step {x['step']}: dropped {y['dropped']} vs {x['dropped']}")


def run(np_, flags, path, what):
    r = train(np_, *TINY, "--steps", str(STEPS), *flags, "--json-log", path)
    check(r.returncode == 0, f"{what}: exit {r.returncode}\n{r.stdout[-800:]}\n{r.stderr[-2000:]}")
    return log(path) if r.returncode == 0 else []


with tempfile.TemporaryDirectory() as tmp:
    p = lambda name: os.path.join(tmp, name)
    data = p("docs")
    os.mkdir(data)
    for name, text in [("a", b"x"), ("b", b"hi"), ("c", b"seven b"), ("d", bytes(range(32, 122)) * 3 + b"!" * 30)]:
        with open(os.path.join(data, name), "wb") as f:
            f.write(text)
    DATA = ["--data", data]

    # Capacity factor 1 (an expert keeps ceil(T * 2 / 4) assignments of a group) with the
    # auxiliary loss: one process against DP=2 x EP=2.
    CAP = MOE + ["--capacity-factor", "1.0", "--aux-loss-coeff", "0.01"]
    one = run(0, CAP, p("cap1.jsonl"), "capacity, one process")
    check(any(j["dropped"] > 0 for j in one), f"the capacity factor drops assignments: {[j['dropped'] for j in one]}")
    check(all(j["aux_loss"] > 0 for j in one), f"the auxiliary loss is logged: {[j['aux_loss'] for j in one]}")
    check(all(j["experts"] == 4 and j["ep"] == 1 for j in one), "the log names experts and ep")
    same_curve(one, run(2, CAP + ["--dp", "2", "--ep", "2"], p("cap2.jsonl"), "capacity, dp2 x ep2"),
               "capacity, dp2 x ep2", aux=True)
    PROB = CAP + ["--drop-policy", "probability"]
    prob = run(0, PROB, p("prob1.jsonl"), "drop by probability, one process")
    same_curve(prob, run(2, PROB + ["--dp", "2", "--ep", "2"], p("prob2.jsonl"), "drop by probability, dp2 x ep2"),
               "drop by probability, dp2 x ep2", aux=True)
    check(prob and one and prob[0]["dropped"] == one[0]["dropped"] and prob[0]["loss"] != one[0]["loss"],
          "dropping by probability drops as many assignments as by position, other ones")
    # At cp > 1 a sequence's routing group spans its CP ranks: the same drops and aux loss.
    for np_, flags, ref_run, policy in [(2, ["--cp", "2", "--ep", "2"], one, "position"),
                                        (2, ["--cp", "2", "--ep", "2"], prob, "probability")]:
        name = f"capacity by {policy}, {' '.join(flags)}"
        same_curve(ref_run, run(np_, CAP + ["--drop-policy", policy] + flags, p(f"cap_{policy}_{np_}.jsonl"), name),
                   name, aux=True)
    SIXCAP = ["--experts", "6", "--top-k", "2", "--capacity-factor", "1.0", "--aux-loss-coeff", "0.01"] + DATA
    for policy, flags, what in [("position", ["--cp", "3", "--ep", "3"], "cp3 x ep3"), ("probability", ["--cp", "3"], "cp3")]:
        name = f"6 experts, capacity {policy}, {what}"
        six_ref = run(0, SIXCAP + ["--drop-policy", policy], p(f"sixcap_{policy}.jsonl"), name + ", one process")
        check(any(j["dropped"] > 0 for j in six_ref), f"{name}: the capacity drops: {[j['dropped'] for j in six_ref]}")
        same_curve(six_ref, run(3, SIXCAP + ["--drop-policy", policy] + flags, p(f"sixcap_{policy}3.jsonl"), name),
                   name, aux=True)
    nocap = run(0, MOE + ["--aux-loss-coeff", "0.01"], p("nocap.jsonl"), "no capacity, one process")
    check(nocap and one and nocap[0]["loss"] != one[0]["loss"] and nocap[0]["dropped"] == 0,
          "dropping assignments changes the loss")

    # No capacity factor: CP splits (odd ones too), DP, PP, on short documents.
    ref = run(0, MOE + DATA, p("ref.jsonl"), "one process")
    for np_, flags, what in [(2, ["--cp", "2", "--ep", "2"], "cp2 x ep2"),
                             (4, ["--dp", "2", "--cp", "2", "--ep", "4"], "dp2 x cp2 x ep4"),
                             (4, ["--dp", "2", "--cp", "2", "--ep", "2"], "dp2 x cp2 x ep2"),
                             (4, ["--cp", "2", "--pp", "2", "--ep", "2", "--schedule", "zb-h1"], "cp2 x pp2 x ep2")]:
        same_curve(ref, run(np_, MOE + DATA + flags, p(what + ".jsonl"), what), what)
    SIX = ["--experts", "6", "--top-k", "3"] + DATA
    same_curve(run(0, SIX, p("six1.jsonl"), "6 experts, one process"),
               run(3, SIX + ["--cp", "3", "--ep", "3"], p("six3.jsonl"), "cp3 x ep3"), "6 experts top-3, cp3 x ep3")

    # The sigmoid-bias router: its bias moves from each step's load, the same on every mesh.
    SIG = MOE + ["--router", "sigmoid-bias", "--bias-update-rate", "0.05"]
    sig = run(0, SIG, p("sig1.jsonl"), "sigmoid-bias, one process")
    same_curve(sig, run(2, SIG + ["--dp", "2", "--ep", "2"], p("sig2.jsonl"), "sigmoid-bias, dp2 x ep2"),
               "sigmoid-bias, dp2 x ep2")
    slow = run(0, MOE + ["--router", "sigmoid-bias", "--bias-update-rate", "1e-6"], p("slow.jsonl"), "slow bias")
    check(sig and slow and sig[0]["loss"] == slow[0]["loss"] and sig[-1]["loss"] != slow[-1]["loss"],
          "the bias step changes the curve after the first step only")

    # A checkpoint of sharded experts (DP=2 x CP=2 x EP=2: two EP groups, the writer's gathers
    # its experts, the other sends nothing) resumes at one process.
    r = train(4, *TINY, *CAP, "--dp", "2", "--cp", "2", "--ep", "2", "--steps", "2", "--save", p("ck"))
    check(r.returncode == 0, f"save at dp2 x cp2 x ep2: exit {r.returncode}\n{r.stderr[-2000:]}")
    r = train(0, *TINY, *CAP, "--steps", str(STEPS), "--resume", p("ck"), "--json-log", p("resumed.jsonl"))
    check(r.returncode == 0, f"resume at one process: exit {r.returncode}\n{r.stderr[-2000:]}")
    if r.returncode == 0:
        same_curve(one[2:], log(p("resumed.jsonl")), "dp2 x cp2 x ep2 -> one process resume", aux=True)
    r = train(0, *TINY, "--experts", "4", "--top-k", "1", "--capacity-factor", "1.0", "--aux-loss-coeff", "0.01",
              "--steps", str(STEPS), "--resume", p("ck"))
    check(r.returncode == 2 and "holds a model with top_k = 2, this run has 1" in r.stderr,
          f"resume with another --top-k: exit {r.returncode}, {r.stderr[-600:]!r}")

    # Bad arguments: exit 2, the flag and the rule named, no hang. The flags are checked before
    # MPI starts, the same on every rank, so one process (no mpiexec) shows the error even for
    # a --cp 2 run (the world size would be checked after them).
    for flags, text in [
            (["--experts", "4", "--top-k", "5"], "--top-k must be in 1..--experts = 4, got 5"),
            (["--experts", "6", "--cp", "2", "--ep", "4"], "--ep 4 must divide --experts 6"),
            (["--experts", "4", "--cp", "2", "--ep", "4"], "--ep 4 must divide --dp * --cp = 1 * 2 = 2"),
            (["--experts", "4", "--cp", "2", "--ep", "2", "--capacity-factor", "0"],
             "--capacity-factor must be finite and > 0, got 0"),
            (["--cp", "2", "--ep", "2"], "need --experts E"),
            (["--experts", "4", "--router", "sigmoid-bias", "--aux-loss-coeff", "0.1"],
             "--aux-loss-coeff needs --router softmax"),
            (["--experts", "4", "--router", "topk"], "--router must be softmax or sigmoid-bias, got 'topk'")]:
        r = train(0, *TINY, *flags, "--steps", "1")
        check(r.returncode == 2 and text in r.stderr and "MPI world size" not in r.stderr,
              f"{flags}: exit {r.returncode}, stderr {r.stderr[-600:]!r}")

    # Ranks launched with other MoE settings (mpirun's MPMD form) fail together, naming the flag.
    for args1, msg in [(["--experts", "4", "--top-k", "1"], "ranks disagree on cpattn train: --top-k: rank 0 has 2, rank 1 has 1"),
                       (["--experts", "2", "--top-k", "2"], "ranks disagree on cpattn train: --experts: rank 0 has 4, rank 1 has 2")]:
        side = lambda extra: [CPATTN, "train", "--timeout", "60", *TINY, "--cp", "2", "--ep", "2", "--steps", "1", *extra]
        r = subprocess.run([MPIEXEC, "--oversubscribe", "-np", "1", *side(MOE), ":", "-np", "1", *side(args1)],
                           capture_output=True, text=True, timeout=120)
        check(r.returncode == 2 and msg in r.stderr, f"{args1} on rank 1 only: exit {r.returncode}\n{r.stderr[-800:]}")

finish()
print("all mixture-of-experts training checks passed")
