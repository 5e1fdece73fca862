"""cpattn across hosts (issue 17 item 6): three hosts made as network namespaces joined by a
bridge (hosts.sh), mpirun launching through them (rsh_agent.sh) over TCP only. The same runs
as on one host give bitwise the same files and training log; a lossy and a slow link still
complete exactly; a link cut during the run and a stalled host end every rank within the
deadline with a message naming the operation, leave no output that looks complete, and leave
no process behind. Skipped (exit 77) without root or network namespaces.

usage: test_multihost.py CPATTN MPIEXEC"""
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import time

CPATTN, MPIEXEC = sys.argv[1], sys.argv[2]
HERE = pathlib.Path(__file__).resolve().parent
SKIP = 77
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
# Letters only: Open MPI compresses node names with digits into ranges and misroutes names such
# as "cm123h1", so the pid is spelled in letters.
PREFIX = "cm" + "".join(chr(ord("a") + int(d)) for d in str(os.getpid() % 100000))
SUBNET = str(100 + os.getpid() % 100)
ENV["CPATTN_NETNS_SUBNET"] = SUBNET
HOSTS = [f"{PREFIX}h{c}" for c in "abc"]  # hosts.sh names them with letters
# Open MPI's daemons notice a lost peer only by TCP keepalive (default: after 300 s idle); the
# short settings end mpirun within seconds of a cut, after cpattn's own 2 s deadline has fired.
MCA = ["--mca", "plm_rsh_agent", str(HERE / "rsh_agent.sh"), "--mca", "routed", "direct", "--mca", "btl", "tcp,self",
       "--mca", "btl_tcp_if_include", f"10.{SUBNET}.0.0/24", "--mca", "oob_tcp_if_include",
       f"10.{SUBNET}.0.0/24", "--mca", "oob_tcp_keepalive_time", "3", "--mca",
       "oob_tcp_keepalive_intvl", "1", "--mca", "oob_tcp_keepalive_probes", "3",
       "-x", "OMPI_ALLOW_RUN_AS_ROOT", "-x", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"]
RUN = ["run", "--seq-len", "1024", "--heads", "4", "--kv-heads", "2", "--head-dim", "32",
       "--seed", "5"]
LONG = ["run", "--seq-len", "2048", "--heads", "4", "--kv-heads", "2", "--head-dim", "64",
        "--repeats", "400", "--timeout", "2"]
TRAIN = ["train", "--layers", "1", "--dim", "32", "--heads", "4", "--kv-heads", "2",
         "--seq-len", "128", "--warmup", "2", "--steps", "4"]
TIMEOUT_LINE = re.compile(r"timeout: [a-z_]+ \(call #\d+\) on rank \d of \d did not complete "
                          r"within the deadline of 2 s")
failures = []


T0 = time.time()


def say(what):
    print(f"[{time.time() - T0:6.1f} s] {what}", flush=True)


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what, flush=True)


def sh(*cmd):
    subprocess.run(cmd, check=True, env=ENV, stdout=subprocess.DEVNULL)


def on(host, *cmd):
    sh("ip", "netns", "exec", host, *cmd)


def across(n, args):
    """The command line of an mpirun on hosts 0..n-1, one rank each, started on host 0."""
    return (["ip", "netns", "exec", HOSTS[0], MPIEXEC, "--host", ",".join(HOSTS[:n]),
             "-np", str(n), *MCA, CPATTN, *args])


def one_host(n, args):
    return [MPIEXEC, "-np", str(n), "--oversubscribe", CPATTN, *args]


def run(cmd, timeout=60):
    for i, a in enumerate(cmd[:-1]):  # --npy-out names an existing folder
        if a == "--npy-out":
            os.makedirs(cmd[i + 1], exist_ok=True)
    # Open MPI 4.1 now and then fails to start a daemon in a namespace host ("unable to
    # reliably start one or more daemons", then "does not know how to route"), before any rank
    # runs: that launch is retried, up to 3 times; anything else counts.
    for attempt in range(3):
        try:
            r = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=timeout,
                               stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
            return subprocess.CompletedProcess(cmd, 124, out, out)
        if r.returncode == 0 or "unable to reliably start one or more daemons" not in r.stdout + r.stderr:
            return r
        say(f"launch failed in Open MPI (attempt {attempt + 1}), retried")
        time.sleep(1)
    return r


def same_files(a, b, names):
    return all((pathlib.Path(a) / n).read_bytes() == (pathlib.Path(b) / n).read_bytes() for n in names)


def losses(path):
    return [(r["step"], r["loss"], r["grad_norm"]) for r in map(json.loads, open(path)) if "loss" in r]


def processes(host):
    """cpattn and orted processes still alive in `host`'s namespace."""
    out = subprocess.run(["ip", "netns", "pids", host], capture_output=True, text=True).stdout.split()
    alive = []
    for pid in out:
        try:
            comm = pathlib.Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if comm in ("cpattn", "orted", "mpiexec", "mpirun"):
            alive.append((int(pid), comm))
    return alive


def no_survivors(what):
    deadline = time.time() + 10
    while time.time() < deadline and any(processes(h) for h in HOSTS):
        time.sleep(0.2)
    left = {h: processes(h) for h in HOSTS if processes(h)}
    check(not left, f"{what}: processes left behind: {left}")
    for procs in left.values():
        for pid, _ in procs:
            os.kill(pid, signal.SIGKILL)


def exact_cases(tmp, ref):
    for scheme in ("allgather", "ring"):
        r = run(across(3, [*RUN, "--scheme", scheme, "--npy-out", f"{tmp}/mh_{scheme}"]))
        check(r.returncode == 0, f"{scheme} across 3 hosts: exit {r.returncode}\n{r.stderr[-1500:]}")
        check(same_files(ref[scheme], f"{tmp}/mh_{scheme}", NPY),
              f"{scheme}: the files of 3 hosts differ from one host's")
    r = run(across(2, [*TRAIN, "--cp", "2", "--json-log", f"{tmp}/mh_train.jsonl"]))
    check(r.returncode == 0, f"train across 2 hosts: exit {r.returncode}\n{r.stderr[-1500:]}")
    check(r.returncode == 0 and losses(f"{tmp}/mh_train.jsonl") == losses(f"{tmp}/train.jsonl"),
          "train: the loss log of 2 hosts differs from one host's")


def degraded_link_cases(tmp, ref):
    # 3% of the packets into and out of host 1 dropped: TCP resends them, the result is exact.
    for chain in ("INPUT", "OUTPUT"):
        on(HOSTS[1], "iptables", "-A", chain, "-m", "statistic", "--mode", "random",
           "--probability", "0.03", "-j", "DROP")
    r = run(across(3, [*RUN, "--npy-out", f"{tmp}/lossy"]))
    check(r.returncode == 0 and same_files(ref["allgather"], f"{tmp}/lossy", NPY),
          f"lossy link: exit {r.returncode}, or files differ\n{r.stderr[-1500:]}")
    on(HOSTS[1], "iptables", "-F")
    # Host 2's link at 20 Mbit/s (a token bucket: rate and queueing delay).
    on(HOSTS[2], "tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", "20mbit",
       "burst", "32kbit", "latency", "100ms")
    r = run(across(3, [*RUN, "--npy-out", f"{tmp}/slow"]))
    check(r.returncode == 0 and same_files(ref["allgather"], f"{tmp}/slow", NPY),
          f"slow link: exit {r.returncode}, or files differ\n{r.stderr[-1500:]}")
    on(HOSTS[2], "tc", "qdisc", "del", "dev", "eth0", "root")


def ranks_alive():
    return [pid for h in HOSTS for pid, comm in processes(h) if comm == "cpattn"]


def fault_case(tmp, name, inject):
    """A long run on 3 hosts, `inject()` 2 s in: every rank must end within the deadline (2 s)
    plus a margin, with a timeout line naming the operation, and write no output. Open MPI
    4.1's launcher may go on waiting for a daemon it can no longer reach (a cut host): that is
    reported, and the launcher and the daemon are then killed."""
    out = f"{tmp}/{name}"
    os.makedirs(out)
    for attempt in range(3):  # a launch that Open MPI fails before any rank runs is retried
        log = open(f"{tmp}/{name}.log", "w+")
        p = subprocess.Popen(across(3, [*LONG, "--npy-out", out]), env=ENV, stdout=log,
                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        time.sleep(2.0)
        log.seek(0)
        if p.poll() is None or "unable to reliably start one or more daemons" not in log.read():
            break
        say(f"{name}: launch failed in Open MPI (attempt {attempt + 1}), retried")
    check(p.poll() is None and len(ranks_alive()) == 3,
          f"{name}: the run ended before the fault (make LONG longer)")
    t0 = time.time()
    undo = inject()
    while ranks_alive() and time.time() - t0 < 20:
        time.sleep(0.1)
    took = time.time() - t0
    check(not ranks_alive(), f"{name}: ranks still alive 20 s after the fault: {ranks_alive()}")
    say(f"{name}: every rank ended {took:.1f} s after the fault")
    try:
        p.wait(timeout=10)
        check(p.returncode != 0, f"{name}: exit 0 after a fault")
    except subprocess.TimeoutExpired:
        say(f"{name}: mpirun still waits for an unreachable daemon 10 s after the ranks ended; killed")
        p.kill()
        p.wait()
    log.seek(0)
    text = log.read()
    check(TIMEOUT_LINE.search(text), f"{name}: no timeout line naming the operation\n{text[-2000:]}")
    written = sorted(f.name for f in pathlib.Path(out).iterdir())
    check(not written, f"{name}: output files left by a failed run: {written}")
    undo()
    no_survivors(name)


def cut_link():
    on(HOSTS[2], "ip", "link", "set", "eth0", "down")
    return lambda: on(HOSTS[2], "ip", "link", "set", "eth0", "up")


def stall_host():
    stopped = [pid for pid, comm in processes(HOSTS[1]) if comm == "cpattn"]
    for pid in stopped:
        os.kill(pid, signal.SIGSTOP)

    def undo():
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGKILL)
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    return undo


NPY = ["out.npy", "lse.npy", "dq.npy", "dk.npy", "dv.npy"]


def main():
    if os.geteuid() != 0:
        print("multihost: skipped: network namespaces need root")
        return SKIP
    probe = subprocess.run(["ip", "netns", "add", f"{PREFIX}probe"], capture_output=True)
    if probe.returncode != 0:
        print("multihost: skipped: cannot create a network namespace:", probe.stderr.decode().strip())
        return SKIP
    sh("ip", "netns", "del", f"{PREFIX}probe")
    hosts = [str(HERE / "hosts.sh"), PREFIX, "3"]
    with tempfile.TemporaryDirectory() as tmp:
        # References on one host (shared memory) first.
        ref = {}
        for scheme in ("allgather", "ring"):
            ref[scheme] = f"{tmp}/ref_{scheme}"
            r = run(one_host(3, [*RUN, "--scheme", scheme, "--npy-out", ref[scheme]]))
            check(r.returncode == 0, f"one host {scheme}: exit {r.returncode}\n{r.stderr[-1500:]}")
        r = run(one_host(2, [*TRAIN, "--cp", "2", "--json-log", f"{tmp}/train.jsonl"]))
        check(r.returncode == 0, f"one host train: exit {r.returncode}\n{r.stderr[-1500:]}")
        if failures:
            return 1
        subprocess.run([hosts[0], "up", *hosts[1:]], check=True, env=ENV)
        try:
            say("hosts up")
            exact_cases(tmp, ref)
            say("exact cases done")
            degraded_link_cases(tmp, ref)
            say("lossy and slow links done")
            fault_case(tmp, "cut-link", cut_link)
            fault_case(tmp, "stalled-host", stall_host)
        finally:
            subprocess.run([hosts[0], "down", *hosts[1:]], env=ENV)
    print("multihost:", "FAILED" if failures else "all cases passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
