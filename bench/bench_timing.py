"""Timing shared by the Python benchmarks in bench/ (run as scripts, so bench/ is on sys.path)."""

import statistics
import time


def median_seconds(fn, repeats):
    """The median wall time of `repeats` calls of fn(), after one warm-up call."""
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
