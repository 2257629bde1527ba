"""FP8 telemetry of the layers, through Flax NNX intermediates (``sow``).

Each fp8jax layer sows, for each of its GEMMs, the forward operands'
telemetry under ``f"{name}/x"`` and ``f"{name}/w"``: a dict ``{"amax",
"saturated", "flushed"}`` of float32 scalars (definitions in
:mod:`fp8jax.telemetry`).  :func:`capture` runs a model function inside
``nnx.capture`` and returns those as one flat dict, so nothing is threaded
through the layers' ``__call__`` and their return types stay plain arrays.
Under ``jax.jit`` unused telemetry is dead code and costs nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flax import nnx

TELEMETRY = "fp8_telemetry"

Stats = dict[str, dict[str, Any]]


def record(module: nnx.Module, name: str, gemm_stats: dict[str, dict[str, Any]]) -> None:
    """Sow one GEMM's {"x": ..., "w": ...} telemetry under ``name/x`` and ``name/w``.

    Only inside :func:`capture` (``nnx.capture``).  Outside it a sow would
    attach a growing ``nnx.Intermediate`` to the module on every call: a
    jitted train step would then see a new module structure each step and
    compile again, and the model would carry telemetry nobody reads.
    """
    if not hasattr(module, "__captures__"):
        return
    module.sow(nnx.Intermediate, TELEMETRY, {f"{name}/{k}": v for k, v in gemm_stats.items()})


def capture(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, Stats]:
    """Run ``fn(*args, **kwargs)`` (a bound method of a module) and collect its layers' telemetry.

    Returns (fn's result, {"<gemm name>/x": stats, "<gemm name>/w": stats, ...}).
    """
    out, sown = nnx.capture(fn, nnx.Intermediate)(*args, **kwargs)
    stats: Stats = {}
    for path, var in nnx.to_flat_state(sown):
        if path[-1] != TELEMETRY:
            continue
        for entry in var.get_value():
            for key, val in entry.items():
                if key in stats:
                    raise ValueError(
                        f"duplicate FP8 telemetry name {key!r}: give layers unique names"
                    )
                stats[key] = val
    return out, stats
