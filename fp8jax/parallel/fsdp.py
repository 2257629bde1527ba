"""FSDP weight gathers in FP8: quantize the shard in 128x128 blocks, gather codes and scales.

A weight sharded over the "fsdp" axis is needed whole by the GEMM that uses
it.  For FP8 recipes the GEMM would quantize it in ``tile`` x ``tile`` blocks
anyway, so each device quantizes its own shard and the all-gather moves E4M3
codes (1 byte per element) plus one float32 scale per block (4 bytes per
128 x 128 elements) instead of 2 (BF16) or 4 (FP32) bytes per element.

Equality with quantize-then-gather: the blocks are over the last two axes of
the array as given (the GEMM's (K, N) weight layout).  Gathering along a
leading axis, or along one of the last two with shards whose length is a
multiple of the tile, never cuts a block, so every block's amax, scale and
codes are those of quantizing the whole array (bit for bit).  A shard that
would cut a block is refused with a clear error.

The gradient goes back by a reduce-scatter (``psum_scatter``) of the
per-device partial gradients in ``reduce_dtype`` (float32 by default;
bfloat16 halves the bytes at the cost of a BF16 sum).  The cotangent of the
QTensor that :func:`gather_weight` returns follows the straight-through
contract of :mod:`fp8jax.parallel.dispatch`: its ``data`` cotangent is the
cotangent of the represented values, its ``scale`` cotangent is ignored.

All functions run inside ``jax.shard_map`` over the axis they gather.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from fp8jax.formats import as_format
from fp8jax.quant import QTensor, quantize
from fp8jax.recipes import QuantSpec


def _check_aligned(shape: tuple[int, ...], axis: int, tile: int) -> None:
    nd = len(shape)
    if axis >= nd - 2 and shape[axis] % tile:
        raise ValueError(
            f"an FP8 gather along axis {axis} needs shards whose length is a multiple of "
            f"the {tile}-element block, got a shard of shape {shape}"
        )


def quantize_blocks(w: jax.Array, spec: QuantSpec) -> QTensor:
    """``w`` in ``spec.tile`` x ``spec.tile`` blocks over its last two axes, per ``spec``."""
    return quantize(
        w,
        as_format(spec.fmt),
        "block",
        axis=w.ndim - 1,
        tile=spec.tile,
        pow2=spec.pow2,
        amax_floor=spec.amax_floor,
    )


def all_gather_fp8(w_shard: jax.Array, spec: QuantSpec, axis_name: str, axis: int) -> QTensor:
    """Quantize this device's shard in blocks, then all-gather codes and scales along ``axis``.

    Equals ``quantize_blocks(all_gather(w))`` bit for bit (see the module docstring).
    """
    if w_shard.ndim < 2:
        raise ValueError(f"block quantization needs at least 2 axes, got shape {w_shard.shape}")
    axis = axis % w_shard.ndim
    _check_aligned(w_shard.shape, axis, spec.tile)
    q = quantize_blocks(w_shard, spec)
    data = lax.all_gather(q.data, axis_name, axis=axis, tiled=True)
    # The scale array has one entry per block: its axis lines up with the
    # data's axis, shard by shard.
    scale = lax.all_gather(q.scale, axis_name, axis=axis, tiled=True)
    return QTensor(data, scale, q.granularity, q.axis, q.tile)


@partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _gather_fp8(w_shard, spec, axis_name, axis, reduce_dtype):
    return all_gather_fp8(w_shard, spec, axis_name, axis)


def _gather_fp8_fwd(w_shard, spec, axis_name, axis, reduce_dtype):
    # An empty array carries the shard's dtype to the backward pass.
    return all_gather_fp8(w_shard, spec, axis_name, axis), jnp.zeros((0,), w_shard.dtype)


def _gather_fp8_bwd(spec, axis_name, axis, reduce_dtype, res, ct):
    return (_reduce_scatter(ct.data, axis_name, axis, reduce_dtype).astype(res.dtype),)


_gather_fp8.defvjp(_gather_fp8_fwd, _gather_fp8_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _gather_plain(w_shard, dtype, axis_name, axis, reduce_dtype):
    return lax.all_gather(w_shard.astype(dtype), axis_name, axis=axis, tiled=True)


def _gather_plain_fwd(w_shard, dtype, axis_name, axis, reduce_dtype):
    return _gather_plain(w_shard, dtype, axis_name, axis, reduce_dtype), jnp.zeros(
        (0,), w_shard.dtype
    )


def _gather_plain_bwd(dtype, axis_name, axis, reduce_dtype, res, ct):
    return (_reduce_scatter(ct, axis_name, axis, reduce_dtype).astype(res.dtype),)


_gather_plain.defvjp(_gather_plain_fwd, _gather_plain_bwd)


def _reduce_scatter(ct: jax.Array, axis_name: str, axis: int, reduce_dtype) -> jax.Array:
    # The partial gradients are summed in reduce_dtype (float32 unless told:
    # a BF16 sum over many devices loses the small contributions).
    return lax.psum_scatter(ct.astype(reduce_dtype), axis_name, scatter_dimension=axis, tiled=True)


def gather_weight(
    w_shard: jax.Array,
    axis_name: str,
    axis: int,
    spec: QuantSpec | None,
    *,
    compute_dtype=jnp.bfloat16,
    reduce_dtype=jnp.float32,
) -> QTensor | jax.Array:
    """The whole weight from this device's shard, differentiable (reduce-scatter backward).

    ``spec`` a quantized, current-scaling block spec: an FP8 gather
    (:func:`all_gather_fp8`) returning a QTensor.  Otherwise the shard is
    cast to ``compute_dtype`` and gathered (the BF16 baseline).
    """
    axis = axis % w_shard.ndim
    if (
        spec is not None
        and spec.quantized
        and spec.scaling == "current"
        and spec.granularity == "block"
    ):
        return _gather_fp8(w_shard, spec, axis_name, axis, jnp.dtype(reduce_dtype))
    return _gather_plain(
        w_shard, jnp.dtype(compute_dtype), axis_name, axis, jnp.dtype(reduce_dtype)
    )
