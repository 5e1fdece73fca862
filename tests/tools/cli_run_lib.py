"""What the `cpattn run` end-to-end tests share: the binaries from the command line, a job
through mpiexec, its JSON line, and the list of failed checks."""
import json
import subprocess
import sys

CPATTN, MPIEXEC = sys.argv[1], sys.argv[2]
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what, flush=True)


def run(np_, *args, timeout=300):
    cmd = [MPIEXEC, "-np", str(np_), "--oversubscribe", CPATTN, "run", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def run_json(np_, *args):
    r = run(np_, *args, "--json")
    check(r.returncode == 0, f"{args} at np {np_}: exit {r.returncode}\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else None
