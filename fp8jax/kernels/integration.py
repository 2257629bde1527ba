"""Glue between ``fp8jax.dot_general``'s canonical GEMMs and the Pallas kernels.

``fp8jax.dot_general`` calls ``block_gemm_or_none(a, b,
recipe, canon)`` with the operands of one canonical batched GEMM (QTensors or
arrays) and uses the result unless it is None (then XLA runs the GEMM):

======  ==========================  ==========================  ============
canon   a                           b                           kernel call
======  ==========================  ==========================  ============
fprop   x  (B, M, K), 1x128 tiles   w (B, K, N), 128x128 blocks  A @ B  ("kn")
dgrad   dy (B, M, N), 1x128 tiles   w (B, K, N), 128x128 blocks  dy @ w^T ("nk", no copy)
wgrad   x  (B, M, K), 128x1 tiles   dy (B, M, N), 128x1 tiles    x^T @ dy ("tn", 1D1D)
======  ==========================  ==========================  ============

Wgrad has 128x1 tiles on *both* operands (DeepGEMM's "1D1D" scaling): it uses
``block_scaled_matmul_tn`` (per-column B scales, A read transposed; no copies).
Batch dims (B > 1) are mapped with ``jax.vmap`` (Pallas adds a grid axis).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from fp8jax.kernels.block_gemm import (
    _FP8_DTYPES,
    CHUNK,
    block_scaled_matmul,
    block_scaled_matmul_nt,
    block_scaled_matmul_tn,
)
from fp8jax.kernels.dispatch import kernel_available, resolve_impl


def _is_q(op, granularity: str, axis: int | None) -> bool:
    """A QTensor (duck-typed: data/scale/granularity/axis/tile) with this 128-wide layout."""
    if not all(hasattr(op, f) for f in ("data", "scale", "granularity", "axis", "tile")):
        return False
    if op.granularity != granularity or op.tile != CHUNK:
        return False
    if axis is not None and op.axis != axis:
        return False
    return jnp.dtype(op.data.dtype) in _FP8_DTYPES and op.data.ndim == 3


def block_gemm_or_none(
    a: Any, b: Any, recipe: Any, canon: str, *, out_dtype: Any = jnp.float32
) -> jax.Array | None:
    """The canonical GEMM through the Pallas kernel, or None where it does not apply.

    Applies when ``resolve_impl(recipe.impl) == "pallas"`` (Hopper GPU for
    "auto"; interpret mode off-GPU for "pallas"), both operands are QTensors of
    the same FP8 dtype with the DeepSeek-V3 layouts of the table above (128-wide
    tiles along the contraction axis; 128x128 blocks for the weight).  The result is (B, M, N) in
    ``out_dtype`` (default float32, what the XLA path returns; pass the final
    dtype to save a pass over the output).
    """
    if resolve_impl(getattr(recipe, "impl", "auto")) != "pallas":
        return None
    if canon in ("fprop", "dgrad"):
        fits = _is_q(a, "tile", 2) and _is_q(b, "block", None)
    elif canon == "wgrad":
        fits = _is_q(a, "tile", 1) and _is_q(b, "tile", 1)
    else:
        return None
    if not fits or a.data.dtype != b.data.dtype:
        return None
    interpret = not kernel_available()
    kw = dict(out_dtype=jnp.dtype(out_dtype), interpret=interpret)
    if canon == "wgrad":
        # x (B, M, K) with (B, Mc, K) scales, dy (B, M, N) with (B, Mc, N):
        # contraction over the token axis M, both scaled per 128x1 tile.
        def one(ad, asc, bd, bsc):
            return block_scaled_matmul_tn(ad, asc, bd, bsc, **kw)
    elif canon == "fprop":
        # (B, M, K) x (B, K, N): A's tiles run along K, B's blocks are (Kc, Nc).
        def one(ad, asc, bd, bsc):
            return block_scaled_matmul(ad, asc, bd, bsc, **kw)
    else:
        # dy (B, M, N) x w (B, K, N) contracted over N: w is B^T, i.e. the
        # kernel's (N_out=K, K_contract=N) "nk" layout with scales (Kc, Nc).
        def one(ad, asc, bd, bsc):
            return block_scaled_matmul_nt(ad, asc, bd, bsc, **kw)

    if a.data.shape[0] == 1 and b.data.shape[0] == 1:
        return one(a.data[0], a.scale[0], b.data[0], b.scale[0])[None]
    return jax.vmap(one)(a.data, a.scale, b.data, b.scale)
