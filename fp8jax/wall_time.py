"""Wall time of a compiled JAX function on its device, round-robin against others.

Timing protocol: ``warmup`` untimed calls (after compilation), then ``iters``
samples, each timed with ``time.perf_counter`` around the call(s) *and*
``jax.block_until_ready`` on the outputs (JAX dispatch is asynchronous: without
the block the clock would stop before the device finished).  A call shorter
than ``min_sample_s`` (sub-millisecond GPU GEMMs) is repeated ``inner`` times
back to back inside one sample, and the sample divided by ``inner``, so the
fixed cost of one dispatch + block (tens of microseconds) does not inflate the
time.  The median sample is the reported time (robust to the odd slow call on
a shared machine); min and max are kept to show the spread.  Functions
compared with each other are timed round-robin (:func:`time_calls`), so a
change in machine load hits them alike.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax


def time_calls(
    cases: Mapping[str, tuple[Callable[..., Any], Sequence[Any]]],
    *,
    warmup: int = 2,
    iters: int = 10,
    min_sample_s: float = 2e-3,
) -> dict[str, dict[str, float]]:
    """Median / min / max wall time in seconds of each case's ``fn(*args)``.

    The cases are timed round-robin: sample i of every case runs before sample
    i + 1 of any, so a change in machine load hits all cases alike and their
    ratios stay meaningful on a shared machine (see the module docstring for
    the protocol of one sample).  ``fn`` may keep state between calls (a train
    step that feeds its new state to the next call): only its outputs are
    blocked on.
    """
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    inner: dict[str, int] = {}
    for name, (fn, args) in cases.items():
        for _ in range(warmup):
            jax.block_until_ready(fn(*args))
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        first = time.perf_counter() - t0
        inner[name] = max(1, min(1000, math.ceil(min_sample_s / max(first, 1e-9))))
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(iters):
        for name, (fn, args) in cases.items():
            t0 = time.perf_counter()
            out = None
            for _ in range(inner[name]):
                out = fn(*args)
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - t0) / inner[name])
    return {
        name: {
            "median_s": statistics.median(ts),
            "min_s": min(ts),
            "max_s": max(ts),
            "iters": iters,
            "inner": inner[name],
            "warmup": warmup,
        }
        for name, ts in times.items()
    }


def time_call(
    fn: Callable[..., Any],
    args: Sequence[Any],
    *,
    warmup: int = 2,
    iters: int = 10,
    min_sample_s: float = 2e-3,
) -> dict[str, float]:
    """Median / min / max wall time in seconds of one ``fn(*args)`` (see :func:`time_calls`)."""
    return time_calls({"": (fn, args)}, warmup=warmup, iters=iters, min_sample_s=min_sample_s)[""]
