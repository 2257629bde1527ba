"""Timing and memory of a compiled JAX function.

Timing protocol: ``warmup`` untimed calls (after compilation), then ``iters``
samples, each timed with ``time.perf_counter`` around the call(s) *and*
``jax.block_until_ready`` on the outputs (JAX dispatch is asynchronous: without
the block the clock would stop before the device finished).  A call shorter
than ``min_sample_s`` (sub-millisecond GPU GEMMs) is repeated ``inner`` times
back to back inside one sample, and the sample divided by ``inner``, so the
fixed cost of one dispatch + block (tens of microseconds) does not inflate the
time.  The median sample is the reported time (robust to the odd slow call on
a shared machine); min and max are kept to show the spread.

Memory: ``compiled.memory_analysis()`` is XLA's static buffer assignment for
the executable.  Peak device memory of one call is estimated as
arguments + outputs + temporaries - aliased bytes (what XLA must have live at
once at most; the allocator cannot need more for this executable).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax


def time_call(
    fn: Callable[..., Any],
    args: Sequence[Any],
    *,
    warmup: int = 2,
    iters: int = 10,
    min_sample_s: float = 2e-3,
) -> dict[str, float]:
    """Median / min / max wall time in seconds of one ``fn(*args)`` (see module docstring)."""
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t0
    inner = max(1, min(1000, math.ceil(min_sample_s / max(first, 1e-9))))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        out = None
        for _ in range(inner):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / inner)
    return {
        "median_s": statistics.median(times),
        "min_s": min(times),
        "max_s": max(times),
        "iters": iters,
        "inner": inner,
        "warmup": warmup,
    }


def memory_stats(compiled: Any) -> dict[str, int | None]:
    """Static memory of a compiled executable (bytes); None where XLA gives none."""
    try:
        ma = compiled.memory_analysis()
    except Exception:  # some backends do not implement it
        ma = None
    if ma is None:
        return {
            "argument_bytes": None,
            "output_bytes": None,
            "temp_bytes": None,
            "alias_bytes": None,
            "peak_bytes": None,
        }
    arg = int(ma.argument_size_in_bytes)
    out = int(ma.output_size_in_bytes)
    tmp = int(ma.temp_size_in_bytes)
    alias = int(ma.alias_size_in_bytes)
    return {
        "argument_bytes": arg,
        "output_bytes": out,
        "temp_bytes": tmp,
        "alias_bytes": alias,
        "peak_bytes": arg + out + tmp - alias,
    }
