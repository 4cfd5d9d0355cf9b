"""The benchmarks' timer: median wall time of a jitted call with device synchronisation."""

import statistics
import time

import jax


def median_seconds(jitted, args, iters, warmup=1) -> float:
    """Median wall time of ``jitted(*args)`` with device synchronisation, after ``warmup`` calls."""
    for _ in range(warmup):
        jax.block_until_ready(jitted(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(jitted(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
