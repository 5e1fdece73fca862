"""The kernels run with the GIL released: another Python thread makes progress meanwhile."""

import threading
import time

import torch

import cpattn
from conftest import cu_from_lengths


def test_other_threads_run_during_a_kernel():
    torch.set_num_threads(1)
    # ~34 GFLOP: long enough to tell on a fast core (2048 tokens of 4 heads took 0.044 s on an
    # AVX-512 Xeon), short on a slow one
    q, k, v = (torch.randn(4096, 8, 64) for _ in range(3))
    cu = cu_from_lengths([4096])
    started, done = threading.Event(), threading.Event()
    span = {}

    def kernel():
        started.set()
        t0 = time.perf_counter()
        cpattn.flash_attn_varlen_func(q, k, v, cu, cu, 4096, 4096, causal=False)
        span["t"] = (t0, time.perf_counter())
        done.set()

    worker = threading.Thread(target=kernel)
    worker.start()
    started.wait()
    ticks = []
    while not done.is_set():  # the main thread's heartbeat
        ticks.append(time.perf_counter())
        time.sleep(0.001)
    worker.join()
    t0, t1 = span["t"]
    inside = [t for t in ticks if t0 <= t <= t1]
    gaps = [b - a for a, b in zip([t0] + inside, inside + [t1])]
    # Holding the GIL, the kernel would stop the heartbeat for its whole duration.
    assert t1 - t0 > 0.05, "the kernel must run long enough to tell"
    assert max(gaps) < 0.5 * (t1 - t0), f"heartbeat stalled {max(gaps):.3f} s of a {t1 - t0:.3f} s kernel"
