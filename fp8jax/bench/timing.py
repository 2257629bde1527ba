"""Timing and memory of a compiled JAX function.

Timing: :mod:`fp8jax.wall_time` (:func:`time_calls`, :func:`time_call`, re-exported
here).

Memory: ``compiled.memory_analysis()`` is XLA's static buffer assignment for
the executable.  Peak device memory of one call is estimated as
arguments + outputs + temporaries - aliased bytes (what XLA must have live at
once at most; the allocator cannot need more for this executable).
"""

from __future__ import annotations

from typing import Any

from fp8jax.wall_time import time_call, time_calls

__all__ = ["memory_stats", "time_call", "time_calls"]


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
