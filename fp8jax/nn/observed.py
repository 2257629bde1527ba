"""One observed GEMM: what every layer that owns a GEMM does around it.

:class:`~fp8jax.nn.Dense`, :class:`~fp8jax.nn.Einsum` and the routed experts
of :mod:`fp8jax.models.moe` (on one device and under expert parallelism)
run their GEMMs through here, so what is measured does not depend on the
layer or the mesh.  Four steps:

1. **hook**: the call goes through :func:`fp8jax.nn.taps.gemm` (the hooks a
   study opened see it);
2. **probe**: the output goes through :func:`fp8jax.nn.grad_noise.probe`
   (block-format gradients: the signal and noise of dy);
3. **record**: the forward operands' telemetry is sown under ``name/x`` and
   ``name/w`` (:func:`fp8jax.nn.recording.record`);
4. **ratio**: the last step's gradient-to-noise ratio is sown under
   ``name/dy`` (:func:`fp8jax.nn.grad_noise.sow_ratio`).

Steps 1-2 are traced where the GEMM runs (:func:`run_gemm`, a pure
function: it may run inside ``jax.shard_map``), steps 3-4 where the layer
is (:func:`record_gemm`: a sow must not happen inside a ``shard_map`` body).
:func:`observed_gemm` does all four.  Under ``shard_map`` the body calls
:func:`run_gemm` and returns the statistics; the layer merges them over the
shards (:func:`fp8jax.telemetry.merge_operand_stats`) and calls
:func:`record_gemm` outside.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from fp8jax.nn import taps
from fp8jax.nn.grad_noise import GradNoise, probe, sow_ratio
from fp8jax.nn.recording import Stats, record
from fp8jax.nn.variables import FP8State
from fp8jax.recipes import Recipe


def run_gemm(
    scope: str,
    fn: Callable[..., tuple[jax.Array, Stats]],
    x: Any,
    w: Any,
    dims_or_groups: Any,
    *,
    recipe: Recipe,
    state: Any = None,
    noise: jax.Array | None = None,
    **kwargs: Any,
) -> tuple[jax.Array, Stats]:
    """(y, {"x": stats, "w": stats}): ``fn`` through the open hooks, y through the probe.

    ``scope`` "dense" (``dims_or_groups``: dot_general dimension numbers) or
    "expert" (rows per expert), as :func:`fp8jax.nn.taps.gemm` hands it to
    the hooks.  ``noise``: the (2,) value of the layer's
    :class:`~fp8jax.nn.grad_noise.GradNoise` (None: no probe).
    """
    y, stats = taps.gemm(scope, fn, x, w, dims_or_groups, recipe=recipe, state=state, **kwargs)
    return probe(y, noise, recipe), stats


def record_gemm(
    layer: nnx.Module, name: str, stats: Stats, noise_var: GradNoise | None = None
) -> None:
    """Sow one GEMM's operand telemetry and its last step's noise ratio under ``name``."""
    record(layer, name, stats)
    sow_ratio(layer, name, noise_var)


def value_of(var: nnx.Variable | None) -> Any:
    """A variable's value, None for None (a layer without that state)."""
    return var.get_value() if var is not None else None


def observed_gemm(
    layer: nnx.Module,
    name: str,
    scope: str,
    fn: Callable[..., tuple[jax.Array, Stats]],
    x: Any,
    w: Any,
    dims_or_groups: Any,
    *,
    recipe: Recipe,
    state_var: FP8State | None = None,
    noise_var: GradNoise | None = None,
    **kwargs: Any,
) -> jax.Array:
    """``fn(x, w, dims_or_groups, recipe=..., state=..., **kwargs)``'s output, observed.

    The four steps of the module docstring, for a GEMM traced where
    ``layer`` can sow.  ``state_var``: the layer's delayed-scaling state of
    this GEMM (its value goes to ``fn``); ``noise_var``: its GradNoise.
    """
    y, stats = run_gemm(
        scope,
        fn,
        x,
        w,
        dims_or_groups,
        recipe=recipe,
        state=value_of(state_var),
        noise=value_of(noise_var),
        **kwargs,
    )
    record_gemm(layer, name, stats, noise_var)
    return y
