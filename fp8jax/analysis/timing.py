"""Wall-clock timing of jitted functions: warm-up, block_until_ready, median."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import jax


def time_fn(fn: Callable, *args, warmup: int = 2, iters: int = 5) -> float:
    """Median seconds per call of ``fn(*args)`` after ``warmup`` calls (compile included there)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def tree_nbytes(tree) -> int:
    """Total bytes of the array leaves of a pytree."""
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree) if hasattr(x, "dtype")))
