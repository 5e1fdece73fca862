"""`cpattn train`'s files and flags (bad ones: exit 2 with one line naming the flags, no hang): an
output (--save, --json-log, --svg) in a --data file or folder is refused (by any name: a link, a
relative name, a bind mount), the data left as it was; a --data folder with link loops loads each file once, at once; a long valid --save name is
written; --compare with skipped (non-finite) steps; --compare entries' errors; the doubles
--compare hands its runs; a resume with --steps below its step; a mesh past any MPI world."""
import json
import os
import re
import stat
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/cli_lib.py
from cli_lib import CPATTN, check, finish, train

TINY = ["--layers", "1", "--dim", "16", "--heads", "2", "--kv-heads", "1", "--seq-len", "32", "--warmup", "1"]


def refused(r, msg, what):
    """Exit 2 before training, with one error line saying `msg`."""
    check(r.returncode == 2 and msg in r.stderr and r.stderr.count("cpattn: error:") == 1
          and "step " not in r.stdout, f"{what}: exit {r.returncode}, want 2 saying {msg!r}\n{r.stderr[-1200:]}")


def read(path):
    with open(path, "rb") as f:
        return f.read()


with tempfile.TemporaryDirectory() as tmp:
    p = lambda name: os.path.join(tmp, name)
    os.makedirs(p("e"))
    os.makedirs(p("d/sub"))
    os.makedirs(p("d2"))  # beside d, its name starting the same: not in d
    corpus = b"the corpus, a document the user keeps. " * 8
    for name in ("e/corpus.txt", "d/a.txt", "d/sub/b.txt"):
        with open(p(name), "wb") as f:
            f.write(corpus)
    os.symlink(p("e/corpus.txt"), p("corpus_link"))

    # Outputs in the training data: refused before any work (with a corpus replaced by a
    # checkpoint, exit 0, before; a checkpoint in the data folder a document of the next run).
    cases = [
        (0, ["--data", p("e/corpus.txt"), "--save", p("e/corpus.txt")],
         f"--save '{p('e/corpus.txt')}' is the file of --data '{p('e/corpus.txt')}'"),
        (0, ["--data", p("e/corpus.txt"), "--save", p("corpus_link")], "is the file of --data"),
        (0, ["--data", p("e/corpus.txt"), "--json-log", p("e/corpus.txt")], "--json-log '"),
        (0, ["--data", p("d"), "--save", p("d/ck")], f"--save '{p('d/ck')}' lies in the folder of --data '{p('d')}'"),
        (0, ["--data", p("d"), "--json-log", p("d/sub/log.jsonl")], "--json-log '" + p("d/sub/log.jsonl") + "' lies in"),
        (0, ["--data", p("e"), p("d"), "--save", p("d/sub/../ck")], "lies in the folder of --data '" + p("d") + "'"),
        (2, ["--cp", "2", "--data", p("d"), "--save", p("d/ck")], "lies in the folder of --data"),
        (0, ["--data", p("d"), "--compare", "1", "--svg", p("d/loss.svg")], "--svg '" + p("d/loss.svg") + "' lies in"),
    ]
    for np_, args, msg in cases:
        refused(train(np_, *TINY, "--steps", "2", *args, timeout=120), msg, args)
    check(read(p("e/corpus.txt")) == corpus and read(p("d/a.txt")) == corpus, "the data is left as it was")
    check(sorted(os.listdir(p("d"))) == ["a.txt", "sub"] and os.listdir(p("d/sub")) == ["b.txt"],
          f"nothing written into the data folder: {os.listdir(p('d'))} {os.listdir(p('d/sub'))}")
    # Beside the data folder is fine.
    r = train(0, *TINY, "--steps", "2", "--data", p("d"), "--save", p("d2/ck"), timeout=120)
    check(r.returncode == 0 and os.path.isfile(p("d2/ck")), f"--save beside --data: exit {r.returncode}\n{r.stderr[-800:]}")
    # ... but not in a folder the data's walk reaches through a link below it, nor onto a data
    # file under another name (a hard link): both were taken before.
    os.makedirs(p("f/g"))
    os.makedirs(p("far"))
    with open(p("f/a.txt"), "wb") as f:
        f.write(corpus)
    os.symlink(p("far"), p("f/g/to_far"))
    os.link(p("f/a.txt"), p("hard.txt"))
    far = os.path.realpath(p("far"))
    for args, msg in (
            (["--save", p("far/ck")], f"--save '{p('far/ck')}' lies in the folder '{far}', which --data reaches through a link"),
            (["--json-log", p("far/new/log.jsonl")], "which --data reaches through a link"),
            (["--json-log", p("hard.txt")], f"--json-log '{p('hard.txt')}' is the data file '{os.path.realpath(p('f/a.txt'))}' "
                                             "of --data under another name")):
        refused(train(0, *TINY, "--steps", "1", "--data", p("f"), *args, timeout=120), msg, args)
    check(read(p("hard.txt")) == corpus and os.listdir(p("far")) == [], "the linked data is left as it was")
    # A name relative to the data folder (cd d && --data . --save ck): compared as written, it
    # was let through and the checkpoint became a document.
    cwd = os.getcwd()
    os.chdir(p("d"))
    try:
        refused(train(0, *TINY, "--steps", "1", "--data", ".", "--save", "ck", timeout=120),
                "--save 'ck' lies in the folder of --data '.'", "a relative --save in the data folder")
    finally:
        os.chdir(cwd)
    check(sorted(os.listdir(p("d"))) == ["a.txt", "sub"], f"nothing written into the data folder: {os.listdir(p('d'))}")
    # The data folder under another name, a bind mount: taken before, its names not below the
    # data's. In a mount namespace of the job's own (unshare), so that no mount outlives it;
    # where unshare or mount is refused (no root, no CAP_SYS_ADMIN) the case is skipped.
    os.makedirs(p("alias"))
    bind = ["unshare", "--mount", "--propagation", "private", "sh", "-c", 'mount --bind "$1" "$2" && shift 2 && exec "$@"',
            "sh", p("f"), p("alias")]
    try:
        can_bind = subprocess.run([*bind, "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        can_bind = False
    if can_bind:
        r = subprocess.run([*bind, CPATTN, "train", *TINY, "--steps", "1", "--data", p("f"), "--save", p("alias/ck")],
                           capture_output=True, text=True, timeout=120)
        refused(r, f"--save '{p('alias/ck')}' lies in the folder '{os.path.realpath(p('f'))}', which --data reaches "
                   "through a link or under another name", "--save into a bind mount of the data")
        check(sorted(os.listdir(p("f"))) == ["a.txt", "g"], f"nothing written into the data: {os.listdir(p('f'))}")
    else:
        print("skipped: --save into a bind mount of the data (unshare --mount or mount --bind refused here)")

    # A --data folder with two links back to itself: each file once, at once (the walk never
    # ended before).
    os.makedirs(p("d3"))
    with open(p("d3/a.txt"), "wb") as f:
        f.write(corpus)
    os.symlink(".", p("d3/l1"))
    os.symlink(".", p("d3/l2"))
    try:
        r = train(0, *TINY, "--steps", "1", "--data", p("d3"), timeout=60)
        check(r.returncode == 0 and "data: 1 documents" in r.stdout, f"link loops: exit {r.returncode}\n{r.stdout[-600:]}")
    except subprocess.TimeoutExpired:
        check(False, "--data with two folder links back to itself: no answer in 60 s")

    # A --save name of 250 bytes (NAME_MAX 255) is written, not refused after the training
    # ("File name too long": the temporary name was 12 bytes longer).
    long_name = p("c" * 250)
    r = train(0, *TINY, "--steps", "1", "--save", long_name, timeout=120)
    check(r.returncode == 0 and os.path.isfile(long_name) and not any(".tmp." in n for n in os.listdir(tmp)),
          f"250-byte --save name: exit {r.returncode}\n{r.stderr[-800:]}")

    # --compare with skipped steps (no timing, a null loss in the log): left out of the
    # comparison (the log's rows crashed it: json type_error 302).
    r = train(0, *TINY[:-2], "--warmup", "0", "--lr", "1e30", "--skip-nonfinite", "--compare", "1,2", "--steps", "4",
              timeout=300)
    check(r.returncode == 0 and "max dloss" in r.stdout and "unexpected error" not in r.stderr,
          f"--compare with skipped steps: exit {r.returncode}\n{r.stdout[-1200:]}\n{r.stderr[-1200:]}")
    # ... and each run's skipped steps are told (steps one run skipped and another took would
    # be counted a difference: the curves at the common steps alone hid them).
    skips = re.findall(r"^(cp\d+) skipped (\d+) step\(s\) as non-finite(.*)$", r.stdout, re.M)
    check(len(skips) == 2 and all(int(n) >= 1 for _, n, _ in skips), f"skipped steps not reported: {r.stdout[-1500:]}")
    for label, n, rest in skips:
        if "counted as a difference" in rest:
            check(re.search(r"^" + label + r" +inf", r.stdout, re.M) is not None, f"{label}: {r.stdout[-1500:]}")

    # The rule itself, on prepared logs (a launcher in place of mpirun writes each run's log):
    # steps skipped by one run and taken by the other are a difference (inf), the same skips are
    # not, and the steps all runs took are compared.
    launcher = p("fake_mpirun.py")
    with open(launcher, "w") as f:
        f.write(f"""#!{sys.executable}
import json, os, sys
args = sys.argv[1:]
ranks, log = int(args[args.index("-np") + 1]), args[args.index("--json-log") + 1]
skipped = json.loads(os.environ["FAKE_SKIPS"])[str(ranks)]
with open(log, "w") as out:
    for step in range(1, 5):
        row = {{"step": step, "skipped": True}} if step in skipped else {{
            "step": step, "loss": 5.0 + step, "grad_norm": 1.0, "lr": 1e-3, "step_s": 0.1,
            "tokens_per_s": 1000.0, "peak_rss_mb_per_rank": [10.0] * ranks}}
        out.write(json.dumps(row) + "\\n")
""")
    os.chmod(launcher, 0o755)
    for skips, differ in (({"1": [2], "2": [3]}, True), ({"1": [2], "2": [2]}, False)):
        os.environ["FAKE_SKIPS"] = json.dumps(skips)
        try:
            r = train(0, *TINY, "--steps", "4", "--compare", "1,2", "--mpirun", launcher, timeout=60)
        finally:
            del os.environ["FAKE_SKIPS"]
        num = r"(inf|[0-9.]+e[-+][0-9]+)"
        row = re.search(r"^cp2 +" + r" +".join([num] * 4) + " ", r.stdout, re.M)  # the table's maxima
        said = "cp2 skipped 1 step(s) as non-finite, not the same as cp1's: counted as a difference (inf)" in r.stdout
        check(r.returncode == 0 and row is not None and said == differ
              and all((x == "inf") == differ for x in row.groups()) and (differ or float(row.group(1)) == 0.0),
              f"--compare, skips {skips}: exit {r.returncode}\n{r.stdout[-1500:]}\n{r.stderr[-800:]}")

    # --compare: an entry's errors name it.
    refused(train(0, *TINY, "--compare", "0", "--steps", "1", timeout=60), "--compare '0': --cp must be >= 1, got 0",
            "--compare 0")
    refused(train(0, *TINY, "--compare", "dp0xcp1", "--steps", "1", timeout=60),
            "--compare 'dp0xcp1': --dp must be >= 1, got 0", "--compare dp0xcp1")

    # --compare hands its runs every double flag as it was given (%.9g cut 0.1 + 2^-40 to 0.1):
    # a stand-in mpirun records the command line.
    fake = p("fake-mpirun")
    with open(fake, "w") as f:
        f.write(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {p('argv.txt')}\nexit 1\n")
    os.chmod(fake, os.stat(fake).st_mode | stat.S_IEXEC)
    coeff = 0.1 + 2.0 ** -40
    r = train(0, *TINY, "--experts", "2", "--aux-loss-coeff", repr(coeff), "--capacity-factor", repr(1 + 2.0 ** -40),
              "--compare", "1", "--mpirun", fake, "--steps", "1", timeout=60)
    check(r.returncode != 0 and os.path.exists(p("argv.txt")), f"fake mpirun not run: {r.stderr[-800:]}")
    if os.path.exists(p("argv.txt")):
        argv = read(p("argv.txt")).decode().split("\n")
        for flag, want in (("--aux-loss-coeff", coeff), ("--capacity-factor", 1 + 2.0 ** -40)):
            got = argv[argv.index(flag) + 1] if flag in argv else None
            check(got is not None and float(got) == want, f"{flag}: the run got {got}, want {want!r}")

    # A resume with --steps below the checkpoint's step: an error, the checkpoint left as it was
    # (it trained nothing, re-saved and exited 0).
    r = train(0, *TINY, "--steps", "4", "--save", p("ck4"), timeout=120)
    check(r.returncode == 0, f"4 steps: {r.stderr[-800:]}")
    before = read(p("ck4"))
    r = train(0, *TINY, "--steps", "2", "--resume", p("ck4"), "--save", p("ck4"), timeout=120)
    refused(r, "--steps 2 is below the checkpoint's step 4", "--steps 2 --resume a step-4 checkpoint")
    check("saved step" not in r.stdout and read(p("ck4")) == before, "the checkpoint is left as it was")
    # ... and one with another --micro (it trained on another global batch without a word).
    r = train(0, *TINY, "--steps", "6", "--micro", "2", "--resume", p("ck4"), timeout=120)
    refused(r, "has micro 1, this run 2", "--micro 2 resuming a --micro 1 checkpoint")
    r = train(0, *TINY, "--steps", "4", "--resume", p("ck4"), timeout=120)
    check(r.returncode == 0, f"--steps equal to the checkpoint's step: exit {r.returncode}\n{r.stderr[-800:]}")
    # --compare's chart onto the checkpoint it resumes: refused, the checkpoint as it was.
    r = train(0, *TINY, "--steps", "5", "--resume", p("ck4"), "--compare", "1", "--svg", p("ck4"), timeout=60)
    refused(r, "--svg '" + p("ck4") + "' is the file of --resume", "--svg onto the --resume file")
    check(read(p("ck4")) == before, "the checkpoint is left as it was (--svg)")

    # The mesh's rank count in int64: past any MPI world before MPI starts (in int it wrapped:
    # 954437177 * 9 = 2^33 + 1 = 1 rank).
    refused(train(0, *TINY, "--dp", "954437177", "--pp", "9", "--micro", "954437177", "--steps", "1", timeout=60),
            "--dp 954437177 * --cp 1 * --pp 9 ranks is past any MPI world size (at most 2147483647 ranks)",
            "--dp 954437177 --pp 9")

finish()
print("all checks passed")
