"""AdamW with FP32 master weights and optional BF16 moments; warm-up + cosine.

DeepSeek-V3 (section 3.3.3) keeps master weights and gradients in FP32 and
stores both AdamW moments in BF16.  optax's ``scale_by_adam(mu_dtype=...)``
lowers only the first moment, so :func:`scale_by_adam_lowp` stores *both*
moments in ``moment_dtype`` while doing every update in float32:

    mu_t = round(b1 * f32(mu_{t-1}) + (1 - b1) * g)
    nu_t = round(b2 * f32(nu_{t-1}) + (1 - b2) * g^2)
    u    = (mu_t / (1 - b1^t)) / (sqrt(nu_t / (1 - b2^t)) + eps)   (float32)

with ``round`` the cast to ``moment_dtype`` (round-to-nearest-even).  BF16
has 8 significant bits: an increment (1 - b2) * g^2 below ~2^-9 of nu is
lost, so with b2 = 0.999 the second moment would stall; the default
b2 = 0.95 (DeepSeek-V3's) keeps each increment representable.

The optimizer only ever sees ``nnx.Param`` gradients: FP8 scaling state and
router biases are separate pytrees (see :mod:`fp8jax.train.step`), so
global-norm clipping never touches them.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

# DeepSeek-V3's moment storage: the default of training configs and of
# make_optimizer alike, so benchmarks time the optimizer training runs.
MOMENT_DTYPE = "bfloat16"


class ScaleByAdamLowpState(NamedTuple):
    count: jax.Array
    mu: optax.Updates
    nu: optax.Updates


def scale_by_adam_lowp(
    b1: float = 0.9,
    b2: float = 0.95,
    eps: float = 1e-8,
    moment_dtype: str | jnp.dtype = "float32",
) -> optax.GradientTransformation:
    """Adam's scaling with both moments stored in ``moment_dtype`` (math in float32)."""
    mdt = jnp.dtype(moment_dtype)

    def init_fn(params):
        # Moments stored in the (possibly low-precision) moment dtype.
        zeros = lambda p: jnp.zeros(p.shape, mdt)
        return ScaleByAdamLowpState(
            jnp.zeros((), jnp.int32), jax.tree.map(zeros, params), jax.tree.map(zeros, params)
        )

    def update_fn(updates, state, params=None):
        del params
        count = state.count + 1
        # Moment arithmetic in float32; only the stored value is rounded.
        g32 = jax.tree.map(lambda g: g.astype(jnp.float32), updates)
        mu32 = jax.tree.map(lambda m, g: b1 * m.astype(jnp.float32) + (1 - b1) * g, state.mu, g32)
        nu32 = jax.tree.map(
            lambda v, g: b2 * v.astype(jnp.float32) + (1 - b2) * g * g, state.nu, g32
        )
        # Store the rounded moments and update from the *stored* values so the
        # optimizer state fully determines the next step (exact resume).
        mu = jax.tree.map(lambda m: m.astype(mdt), mu32)
        nu = jax.tree.map(lambda v: v.astype(mdt), nu32)
        c = count.astype(jnp.float32)
        bc1 = 1 - jnp.float32(b1) ** c
        bc2 = 1 - jnp.float32(b2) ** c
        out = jax.tree.map(
            lambda m, v, g: (
                (m.astype(jnp.float32) / bc1) / (jnp.sqrt(v.astype(jnp.float32) / bc2) + eps)
            ).astype(g.dtype),
            mu,
            nu,
            updates,
        )
        return out, ScaleByAdamLowpState(count, mu, nu)

    return optax.GradientTransformation(init_fn, update_fn)


def lr_schedule(
    peak_lr: float,
    total_steps: int | jax.Array,
    warmup_steps: int,
    min_lr_ratio: float = 0.1,
) -> optax.Schedule:
    """Linear warm-up from 0 to ``peak_lr``, then cosine decay to ``min_lr_ratio * peak_lr``.

    ``total_steps`` may be a traced integer: a jitted step that takes the
    run's length as an input is then one program for every length.  The
    values are those of ``optax.warmup_cosine_decay_schedule`` bit for bit
    (the same float32 operations, with the decay length as a float32 value).
    """
    if isinstance(total_steps, int) and total_steps <= 0:
        raise ValueError("total_steps must be positive")
    warmup_asked = max(int(warmup_steps), 0)
    end_lr = peak_lr * min_lr_ratio
    alpha = 0.0 if peak_lr == 0.0 else end_lr / peak_lr

    def schedule(count):
        # Lengths as float32 values (integers below 2**24 are exact): a warm-up
        # longer than the run is cut to the run, the decay spans the rest.
        warm_i = jnp.minimum(total_steps, warmup_asked)
        warm = jnp.asarray(warm_i, jnp.float32)
        decay = jnp.asarray(jnp.maximum(total_steps, warm_i + 1) - warm_i, jnp.float32)
        # XLA turns a division by a constant length into a product with its
        # float32 reciprocal; the same products keep a traced length bit-identical.
        ramp = jnp.clip(count, 0, warm_i).astype(jnp.float32)
        ramp = -peak_lr * (1 - ramp * (1.0 / warm)) + peak_lr
        t = jnp.minimum((count - warm_i).astype(jnp.float32), decay)
        cosine_decay = 0.5 * (1 + jnp.cos(jnp.pi * t * (1.0 / decay)))
        cosine = peak_lr * ((1 - alpha) * cosine_decay**1.0 + alpha)
        if warmup_asked == 0:
            # No warm-up at all: the cosine from the first step (0 / 0 never computed).
            return cosine
        return jnp.where((count < warm_i) & (warm_i > 0), ramp, cosine)

    return schedule


def decay_mask(params):
    """Weight decay on matrices only (ndim >= 2): not on norms' scales or biases."""
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(
    *,
    peak_lr: float,
    total_steps: int | jax.Array,
    warmup_steps: int,
    min_lr_ratio: float = 0.1,
    b1: float = 0.9,
    b2: float = 0.95,
    eps: float = 1e-8,
    weight_decay: float = 0.1,
    clip_norm: float | None = 1.0,
    moment_dtype: str = MOMENT_DTYPE,
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """Global-norm clipping -> Adam (moments in ``moment_dtype``) -> decoupled decay -> -lr.

    Params (the master weights) stay float32; updates are computed in float32.
    ``total_steps`` may be traced (see :func:`lr_schedule`); the optimizer
    state's structure does not depend on it.
    """
    schedule = lr_schedule(peak_lr, total_steps, warmup_steps, min_lr_ratio)
    parts = []
    if clip_norm is not None and clip_norm > 0:
        parts.append(optax.clip_by_global_norm(clip_norm))
    parts += [
        scale_by_adam_lowp(b1, b2, eps, moment_dtype),
        optax.add_decayed_weights(weight_decay, mask=decay_mask),
        optax.scale_by_learning_rate(schedule),
    ]
    return optax.chain(*parts), schedule
