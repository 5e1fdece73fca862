"""What the command-line tests (tests/tools, tests/train) share: the binaries from the command
line (argv: cpattn, then mpiexec for the tests that run jobs), check() collecting failures, a
cpattn job on its own or under mpiexec, `cpattn run` and `cpattn train` jobs and their JSON, and
finish(), the exit status. A script finds this module through the sys.path line above its
import of it (tests/, its folder's parent). What the script's jobs leave in $TMPDIR (--compare's
logs, mpirun's session folders) lands in a folder of its own, removed when the script ends."""
import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile

CPATTN = sys.argv[1]
MPIEXEC = sys.argv[2] if len(sys.argv) > 2 else None
failures = []
os.environ["TMPDIR"] = tempfile.mkdtemp(prefix="cpattn-test-")
tempfile.tempdir = None  # (this script's own temporary files go there too)
atexit.register(shutil.rmtree, os.environ["TMPDIR"], ignore_errors=True)


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what, flush=True)


def job(np_, *args, timeout=300, env=None):
    """`cpattn ARGS`, under mpiexec -np NP unless NP is 0; env, when given, is the whole
    environment (subprocess.run's)."""
    cmd = ([MPIEXEC, "-np", str(np_), "--oversubscribe"] if np_ else []) + [CPATTN, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def run(np_, *args, timeout=300):
    """`cpattn run ARGS` under mpiexec -np NP."""
    return job(np_, "run", *args, timeout=timeout)


def last_json(r):
    """The JSON line a successful job printed last; None when it failed."""
    return json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else None


def run_json(np_, *args):
    """`cpattn run ARGS --json`, checked to succeed: its report, or None."""
    r = run(np_, *args, "--json")
    check(r.returncode == 0, f"{args} at np {np_}: exit {r.returncode}\n{r.stderr[-2000:]}")
    return last_json(r)


def train(np_, *args, timeout=300):
    """`cpattn train ARGS`, under mpiexec -np NP unless NP is 0."""
    return job(np_, "train", *args, timeout=timeout)


def log(path):
    """The records of a --json-log file."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def finish():
    """Exit 1 if any check failed (each was printed as it failed), else 0."""
    print(f"{len(failures)} check(s) failed")
    sys.exit(1 if failures else 0)
