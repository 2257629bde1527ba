"""Gradient-to-quantization-noise ratio of a GEMM's output gradient, for block formats.

A GEMM with a block-format gradient (MXFP8 / NVFP4 ``dgrad.lhs``) quantizes
its output gradient dy in the backward pass, where nothing can be sown.
:func:`probe` is the identity on the GEMM's output; its backward pass
quantizes dy as the recipe's Dgrad does (:func:`fp8jax.schemes.quantize`,
along dy's last axis) and returns
(||dy||, ||Q(dy) - dy||) as the cotangent of a :class:`GradNoise` variable.
That variable belongs to the FP8 state, which a training step replaces by
its gradient (microbatches merged by elementwise max: the largest norms), so
the next forward pass finds the last step's pair there and the layer sows
its ratio (:func:`sow_ratio`) as ``<gemm>/dy`` -> {"noise_ratio"}: one step
behind, at no cost but one more quantization of dy.  Below
:data:`fp8jax.monitors.NOISE_RATIO_FLOOR` (sqrt(3)) quantized training
stalls ("FP4 All the Way").  Before the first step the pair is (0, 0) and the
ratio NaN.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from fp8jax import blockscaled, monitors, schemes
from fp8jax.nn.recording import record
from fp8jax.nn.variables import FP8State
from fp8jax.recipes import QuantSpec, Recipe


class GradNoise(FP8State):
    """float32 (2,): (||dy||, ||Q(dy) - dy||) of the last step; replaced by its gradient."""


def wants_probe(recipe: Recipe) -> bool:
    """True when the recipe quantizes the output gradient dy in a block format."""
    return blockscaled.is_block_format(recipe.dgrad.lhs.fmt)


def init_grad_noise(recipe: Recipe) -> GradNoise | None:
    """A zero (2,) GradNoise variable for a block-format recipe, else None."""
    return GradNoise(jnp.zeros((2,), jnp.float32)) if wants_probe(recipe) else None


def sow_ratio(module: nnx.Module, name: str, var: GradNoise | None) -> None:
    """Sow the ratio held by ``var`` (the last step's) under ``name/dy``."""
    if var is not None:
        pair = jax.lax.stop_gradient(var.get_value())
        record(module, name, {"dy": {"noise_ratio": monitors.ratio_of(pair)}})


def probe(y: jax.Array, pair: jax.Array | None, recipe: Recipe) -> jax.Array:
    """``y`` unchanged; its gradient's signal and noise go to the cotangent of ``pair``.

    ``pair``: the (2,) value of the layer's :class:`GradNoise` (None: ``y`` as it is).
    """
    if pair is None:
        return y
    return _probe(y, pair, recipe.dgrad.lhs, recipe.seed)


def per_shard(pair: jax.Array | None, n_shards: int) -> jax.Array | None:
    """``pair`` repeated (n_shards, 2), one row per shard of a ``shard_map``.

    Split over every mesh axis, each shard probes its own rows with its row
    (:func:`probe`), and its cotangent comes back unsummed; the backward
    pass merges the shards' (||dy_s||, ||Q(dy_s) - dy_s||) into the norms
    over all rows: sqrt(sum_s n_s^2) for each.  Quantization is row-local,
    so these are the norms one device would see for the same rows.
    """
    if pair is None:
        return None
    return _per_shard(pair, n_shards)


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def _per_shard(pair, n_shards):
    return jnp.broadcast_to(pair, (n_shards, *pair.shape))


def _per_shard_fwd(pair, n_shards):
    return _per_shard(pair, n_shards), None


def _per_shard_bwd(n_shards, _, ct_Sx2):
    # Squares of norms add over disjoint rows; scaled by the largest norm
    # first, as signal_and_noise does, so no square under- or overflows.
    ct = ct_Sx2.astype(jnp.float32)
    m = jnp.max(ct, axis=0)
    safe = jnp.where(m > 0, m, 1.0)
    return (jnp.sqrt(jnp.sum(jnp.square(ct / safe), axis=0)) * safe,)


_per_shard.defvjp(_per_shard_fwd, _per_shard_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _probe(y, pair, spec: QuantSpec, seed: int):
    del pair, spec, seed
    return y


def _probe_fwd(y, pair, spec, seed):
    del pair, spec, seed
    return y, None


def _probe_bwd(spec, seed, _, dy):
    # dy as the Dgrad GEMM quantizes it: rows of its last (contraction) axis.
    g = dy.reshape(-1, dy.shape[-1]) if dy.ndim != 2 else dy
    q = schemes.quantize(g.astype(jnp.float32), spec, -1, seed=seed)
    deq = schemes.dequantize(q)[..., : g.shape[-1]]
    return dy, monitors.signal_and_noise(g, deq)


_probe.defvjp(_probe_fwd, _probe_bwd)
