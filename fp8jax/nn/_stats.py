"""Telemetry plumbing shared by the fp8jax layers.

Layers take an optional ``stats`` dict; when it is given (and the layer's
recipe quantizes), the layer writes the forward operands' telemetry of each
of its GEMMs under ``f"{name}/x"`` and ``f"{name}/w"``, each a dict
``{"amax", "saturated", "flushed"}`` of float32 scalars (see
:func:`fp8jax.dot_general.operand_stats`).  Passing ``stats=None`` switches
telemetry off at no cost.  The dict is an explicit, functional channel:
nothing is stored on the module, so it works under ``jax.jit`` / ``nnx.jit``
and with ``nnx.split``/``merge`` alike.
"""

from __future__ import annotations

from typing import Any

StatsDict = dict[str, dict[str, Any]]


def record(stats: StatsDict | None, name: str, gemm_stats: dict[str, dict[str, Any]]) -> None:
    """Store one GEMM's {"x": ..., "w": ...} telemetry under ``name/x`` and ``name/w``."""
    if stats is None:
        return
    for operand, vals in gemm_stats.items():
        key = f"{name}/{operand}"
        if key in stats:
            raise ValueError(f"duplicate FP8 telemetry name {key!r}: give layers unique names")
        stats[key] = vals
