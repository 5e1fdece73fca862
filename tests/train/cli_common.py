"""What the `cpattn train` command-line tests share: the binaries (argv: cpattn, mpiexec),
check() collecting failures, train() running one job, log() reading a JSON log."""
import json
import subprocess
import sys

CPATTN, MPIEXEC = sys.argv[1], sys.argv[2]
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what, flush=True)


def train(np_, *args, timeout=300):
    """`cpattn train ARGS`, under mpiexec -np NP unless NP is 0."""
    cmd = ([MPIEXEC, "-np", str(np_), "--oversubscribe"] if np_ else []) + [CPATTN, "train", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def log(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
