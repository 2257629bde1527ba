"""Outlier injection: the stresses an experiment puts on a run, outside the model and the train step.

A training config may carry an ``inject`` block (its fields and defaults:
:func:`inject_block`; every one off by default).  The model and the train step
know nothing of it: :func:`with_injection` wraps the run's loss function so
that the model is traced with a hook on one activation site
(:mod:`fp8jax.nn.taps`), and :func:`fp8_state_stress` is the train step's
``fp8_update``.  Configs without the block train exactly as before (no hook
is opened, no update is applied).

* Massive activations (``massive_activation_*``): ``count`` values of
  ``scale`` x the median |activation| added at the first token of every
  sequence (channels 0..count-1) at the named site: the residual stream after
  the embedding (``"residual"``) or the input of every FFN down projection,
  dense, shared and routed experts alike (``"ffn_hidden"``, where real LLMs
  show them and where they reach an FP8 GEMM operand unnormalised).
* Delayed-scaling state (``fp8_reset_every``, ``fp8_amax_growth``): every
  ``fp8_reset_every`` steps the state goes back to fresh (scale 1, empty
  history), the fresh-state failure repeated; ``fp8_amax_growth`` = g > 1
  divides the stored amax histories and scales by g after each step, so the
  next step's scale is g times too small -- the clipping a tensor whose amax
  grew g-fold since the last step would see -- without changing the model's
  activations.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections

from fp8jax.nn import taps

__all__ = [
    "fp8_state_stress",
    "inject_block",
    "inject_massive",
    "massive_activations",
    "validate_block",
    "with_injection",
]


def inject_block(**overrides: Any) -> ml_collections.ConfigDict:
    """The ``inject`` block of a config: every field with its default (off), then ``overrides``."""
    b = ml_collections.ConfigDict()
    # Massive activations: this many x the median |activation| (0 = off) ...
    b.massive_activation_scale = 0.0
    # ... added to channels 0..count-1 of each sequence's first token ...
    b.massive_activation_count = 0
    # ... at this activation site of fp8jax.nn.taps.ACTIVATION_SITES.
    b.massive_activation_site = "residual"
    # Reset the delayed-scaling state to fresh every this many steps (0 = off).
    b.fp8_reset_every = 0
    # The stored amax lags the tensor's by this factor after each step (1 = off).
    b.fp8_amax_growth = 1.0
    unknown = sorted(set(overrides) - set(b.keys()))
    if unknown:
        raise ValueError(f"inject.{unknown[0]} is not a field; known: {', '.join(b.keys())}")
    b.update(overrides)
    return b


def _whole(block: ml_collections.ConfigDict | dict) -> ml_collections.ConfigDict:
    """``block`` with every field (defaults where it is silent); ValueError for an unknown one."""
    fields = block.to_dict() if isinstance(block, ml_collections.ConfigDict) else dict(block)
    return inject_block(**fields)


def validate_block(block: ml_collections.ConfigDict | dict) -> None:
    """ValueError (one line, naming the field) for a bad ``inject`` block."""
    b = _whole(block)
    scale, count = b.massive_activation_scale, b.massive_activation_count
    if not (isinstance(scale, int | float) and math.isfinite(scale) and scale >= 0):
        raise ValueError(f"inject.massive_activation_scale must be finite and >= 0, got {scale}")
    if not (isinstance(count, int) and count >= 0):
        raise ValueError(f"inject.massive_activation_count must be an integer >= 0, got {count}")
    if b.massive_activation_site not in taps.ACTIVATION_SITES:
        raise ValueError(
            f"inject.massive_activation_site must be one of {taps.ACTIVATION_SITES}, "
            f"got {b.massive_activation_site!r}"
        )
    if not (isinstance(b.fp8_reset_every, int) and b.fp8_reset_every >= 0):
        raise ValueError(f"inject.fp8_reset_every must be >= 0 (0 = off), got {b.fp8_reset_every}")
    g = b.fp8_amax_growth
    if not (isinstance(g, int | float) and math.isfinite(g) and g >= 1.0):
        raise ValueError(f"inject.fp8_amax_growth must be a finite number >= 1 (1 = off), got {g}")


def inject_massive(h: jax.Array, first: jax.Array, scale: float, count: int) -> jax.Array:
    """Add ``scale`` x median|h| to channels 0..count-1 of the rows where ``first`` is True.

    h: (R, C) rows of one activation; first: bool (R,), the rows of each
    sequence's first token (where real LLMs carry their massive activations).
    The magnitude is a stop-gradient constant of this call: an injected
    stress, not a learned value.
    """
    if scale <= 0 or count <= 0:
        return h
    if count > h.shape[-1]:
        raise ValueError(
            f"inject.massive_activation_count {count} exceeds the site's {h.shape[-1]} channels"
        )
    mag = jax.lax.stop_gradient(jnp.median(jnp.abs(h.astype(jnp.float32)))) * scale
    # Added in float32 then rounded once to the activation dtype.
    bump = jnp.where(first[:, None] & (jnp.arange(h.shape[-1]) < count)[None, :], mag, 0.0)
    return (h.astype(jnp.float32) + bump).astype(h.dtype)


def massive_activations(scale: float, count: int) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """A site hook (:func:`fp8jax.nn.taps.injecting`) adding massive activations."""
    return lambda h, first: inject_massive(h, first, float(scale), int(count))


def with_injection(loss_fn: Callable, block: ml_collections.ConfigDict | None) -> Callable:
    """``loss_fn(model, tokens)`` traced with the block's massive activations (itself if off)."""
    if block is None:
        return loss_fn
    b = _whole(block)
    if b.massive_activation_scale <= 0 or b.massive_activation_count <= 0:
        return loss_fn
    hook = massive_activations(b.massive_activation_scale, b.massive_activation_count)
    site = str(b.massive_activation_site)

    def injected(model, tokens):
        # Hooks act while the model is traced: open for this call only.
        with taps.injecting(site, hook):
            return loss_fn(model, tokens)

    return injected


def fp8_state_stress(
    fresh: Any, block: ml_collections.ConfigDict | None
) -> Callable[[Any, jax.Array], Any] | None:
    """The train step's ``fp8_update`` for the block's delayed-scaling stress (None if off).

    ``fresh``: the run's initial FP8 state (scale 1, empty history), restored
    every ``fp8_reset_every`` steps.
    """
    if block is None:
        return None
    b = _whole(block)
    every, growth = int(b.fp8_reset_every), float(b.fp8_amax_growth)
    if every == 0 and growth == 1.0:
        return None

    def update(fp8, step):
        if growth != 1.0:
            # Stale history: the recorded amax lags the "true" one by a factor g.
            fp8 = jax.tree.map(lambda v: v / jnp.float32(growth), fp8)
        if every > 0:
            reset = (step + 1) % every == 0
            fp8 = jax.tree.map(lambda new, old: jnp.where(reset, old, new), fp8, fresh)
        return fp8

    return update
