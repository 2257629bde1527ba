"""Scales: online (current) scaling, power-of-two rounding, delayed scaling state.

Convention: ``x ~= data * scale`` with ``data = cast(x / scale)``; the scale
maps the tensor's amax onto the format's largest finite value:

    scale = max(amax, amax_floor) / fmt_max            (float32)

Guards: ``amax == 0`` (an all-zero tile) gives scale 1, and a scale is never
below float32's smallest normal, so no scale is zero, Inf or NaN for finite
input.  Non-finite elements are excluded from amax: an Inf saturates to
+-fmt_max in the cast instead of turning its whole tile into NaN (Inf / Inf),
and a NaN stays NaN in its own element only.

Power-of-two scales (``pow2=True``, DeepSeek's UE8M0) round the scale *up* to
``2^ceil(log2 scale)``, so ``x / scale`` never exceeds ``fmt_max``.

Delayed scaling (Transformer Engine / Flax fp8_ops): the scale used at step t
comes from an amax history of steps < t.  See :class:`DelayedState`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from fp8jax.formats import fmt_max
from fp8jax.recipes import DelayedConfig, QuantSpec, Recipe

_F32_TINY = float(jnp.finfo(jnp.float32).tiny)


def exact_div(num: jnp.ndarray, den: jnp.ndarray) -> jnp.ndarray:
    """Correctly rounded ``num / den`` under XLA.

    XLA rewrites ``a / broadcast(b)`` and ``a / constant`` into a multiply by
    the reciprocal, which is off by one ulp in about half the cases.  Adding
    ``num * 0`` makes the divisor an elementwise operand the simplifier cannot
    hoist, so the division is the IEEE one.  (``num`` must be finite where the
    result matters: ``inf * 0`` is NaN.)
    """
    return num / (den + num * 0)


def finite_amax(x: jnp.ndarray, axis=None, keepdims: bool = False) -> jnp.ndarray:
    """max |x| over ``axis`` in float32, ignoring NaN and +-Inf elements."""
    ax = jnp.abs(x.astype(jnp.float32))
    # Non-finite values would make the scale Inf/NaN for the whole group.
    ax = jnp.where(jnp.isfinite(ax), ax, 0.0)
    return jnp.max(ax, axis=axis, keepdims=keepdims)


def pow2_ceil(scale: jnp.ndarray) -> jnp.ndarray:
    """Round a positive float32 scale up to the next power of two (exact).

    Uses the bit pattern: a float32 with zero mantissa bits is already a power
    of two; otherwise the exponent is bumped by one and the mantissa cleared.
    """
    bits = lax.bitcast_convert_type(scale.astype(jnp.float32), jnp.int32)
    mant = bits & 0x007FFFFF
    exp_bits = bits & 0x7F800000
    up = jnp.where(mant != 0, exp_bits + 0x00800000, exp_bits)
    out = lax.bitcast_convert_type(up, jnp.float32)
    # Subnormal scales (exp bits 0) never occur: scales are clamped to >= tiny.
    return out


def scale_from_amax(
    amax: jnp.ndarray, fmt, *, pow2: bool = False, amax_floor: float = 0.0
) -> jnp.ndarray:
    """float32 scale = amax / fmt_max with the guards described in the module docstring."""
    amax = amax.astype(jnp.float32)
    if amax_floor > 0:
        amax = jnp.maximum(amax, jnp.float32(amax_floor))
    # Correctly rounded amax / max (DeepSeek's act_quant computes amax / 448 in fp32).
    scale = exact_div(amax, jnp.float32(fmt_max(fmt)))
    # amax == 0: any scale reproduces the zeros; 1 keeps the data exact.
    scale = jnp.where(amax > 0, scale, jnp.float32(1.0))
    # A scale that underflowed (amax below ~1e-36) would divide by zero.
    scale = jnp.maximum(scale, jnp.float32(_F32_TINY))
    if pow2:
        scale = pow2_ceil(scale)
    return scale


# --------------------------------------------------------------------------
# Delayed scaling state
# --------------------------------------------------------------------------


class DelayedState(NamedTuple):
    """Delayed-scaling state of one operand (per-tensor).

    amax_history: float32 (history_len,), newest first.
    scale: float32 (), the scale to use at the *next* quantization.

    A fresh state has scale 1 and an all-zero history: at the first step
    every value above fmt_max clips (the known failure of delayed scaling on a
    fresh state), which experiments reproduce on purpose.
    """

    amax_history: jnp.ndarray
    scale: jnp.ndarray


class DelayedGemmState(NamedTuple):
    """Delayed-scaling state of the operands of one linear layer's GEMMs.

    ``x`` serves fprop and wgrad, ``w`` fprop and dgrad, ``dy`` dgrad and
    wgrad: one history per tensor, as in Transformer Engine.

    Update rule ("overwrite with gradient"): ``fp8jax.dot_general`` returns,
    as the cotangent of this state, the *updated* state (history rolled with
    this step's amax in front, scale recomputed).  A training step takes
    ``jax.grad`` with respect to the state and replaces the state by that
    gradient instead of applying the optimizer to it.  Because ``dy`` is only
    seen in the backward pass, an explicit forward return value could not
    carry its amax; the gradient can.
    """

    x: DelayedState
    w: DelayedState
    dy: DelayedState


def init_delayed_state(history_len: int) -> DelayedState:
    return DelayedState(jnp.zeros((history_len,), jnp.float32), jnp.ones((), jnp.float32))


def init_delayed_gemm_state(recipe: Recipe) -> DelayedGemmState:
    """A fresh state (scale 1, empty history) for every operand of a GEMM."""
    n = recipe.delayed.history_len
    return DelayedGemmState(init_delayed_state(n), init_delayed_state(n), init_delayed_state(n))


def update_delayed_state(
    state: DelayedState, amax: jnp.ndarray, spec: QuantSpec, cfg: DelayedConfig
) -> DelayedState:
    """Roll the history, insert this step's amax, recompute the scale.

    scale = 2^-margin * amax_ref / fmt_max with amax_ref = max(history) for
    algo "max" or the newest amax for "most_recent".  An empty history
    (all zeros) keeps scale 1 via the amax == 0 guard.
    """
    hist = jnp.roll(state.amax_history, 1).at[0].set(amax.astype(jnp.float32))
    ref = jnp.max(hist) if cfg.algo == "max" else hist[0]
    scale = scale_from_amax(ref, spec.fmt, pow2=spec.pow2, amax_floor=spec.amax_floor)
    # The margin leaves 2^margin of headroom above the recorded amax.
    scale = scale * jnp.float32(2.0**cfg.margin)
    return DelayedState(hist, scale)


def updated_gemm_state(state: DelayedGemmState | None, new_x, new_w, new_dy):
    """The overwrite-with-gradient cotangent of a GEMM's state.

    Each operand's entry is its updated state where the GEMM quantized it
    with delayed scaling (``new_*`` not None), else the state unchanged.
    """
    if state is None:
        return None
    return DelayedGemmState(
        new_x if new_x is not None else state.x,
        new_w if new_w is not None else state.w,
        new_dy if new_dy is not None else state.dy,
    )


def merge_delayed_states(a, b):
    """Merge the updated states of two microbatches: elementwise max.

    Each microbatch's update rolls the *same* previous history and writes its
    own amax in front; the merged history must hold the max amax (summing the
    "gradients" as for parameters would double it), and the larger scale is
    the one computed from that max.
    """
    return jax.tree.map(jnp.maximum, a, b)
