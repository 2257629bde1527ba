"""Per-token quantization error: what a scale group shared across tokens costs each token.

A 1x128 tile holds one token's 128 features, so its scale follows that
token's own range.  A 128x128 block holds 128 tokens: its scale follows the
largest of them, and a token whose values are 2^k below the block's amax
is coded with k bits fewer of the format's range, into E4M3's subnormals
(k > ~15: 448 = 2^8.8 down to the minimum normal 2^-6) and to zero (below
the smallest subnormal 2^-9, i.e. k > ~18).  Gradients span many binades
from token to token, which is the mechanism DeepSeek-V3 (appendix B.2)
points at when block-quantized activation gradients make training diverge.

Everything here is numpy float64 on the host (a measuring instrument); the
quantization itself is :func:`fp8jax.quantize`.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from fp8jax.formats import E4M3
from fp8jax.layout import Layout
from fp8jax.quant import dequantize, quantize

__all__ = ["group_amax_ratio", "token_quant_errors"]


def group_amax_ratio(t: np.ndarray, granularity: str, tile: int = 128) -> np.ndarray:
    """Per token (row of ``t``, (tokens, features)): how far below its scale groups it lies.

    For each group the token has values in, the token's amax there over the
    group's amax; the largest of these (the token's best-served part).  1 for
    "tile" and "row" (a token shares its groups with no other token), <= 1
    for "block" (tile x tile groups of tokens x features) and "tensor".  A
    token of zeros gives 0.  A token whose ratio is below 2^-19 is flushed to
    zero entirely by E4M3 (its values fall under half the smallest subnormal).
    """
    a = np.abs(np.asarray(t, np.float64))
    m, n = a.shape
    # Layout refuses a granularity it does not know.
    layout = Layout(granularity, axis=1, tile=tile)
    if layout.along_axis:
        return (a.max(axis=1) > 0).astype(np.float64)
    if layout.per_tensor:
        amax = a.max()
        return a.max(axis=1) / amax if amax > 0 else np.zeros(m)
    pad = np.pad(a, ((0, -m % tile), (0, -n % tile)))
    parts = pad.reshape(pad.shape[0], pad.shape[1] // tile, tile).max(
        axis=2
    )  # (tokens, col blocks)
    blocks = parts.reshape(-1, tile, parts.shape[1]).max(axis=1)  # (row blocks, col blocks)
    group = np.repeat(blocks, tile, axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = np.where(group > 0, parts / np.where(group > 0, group, 1.0), 0.0)
    return ratio.max(axis=1)[:m]


def token_quant_errors(t, granularity: str, fmt=E4M3, tile: int = 128) -> dict[str, np.ndarray]:
    """Per token of ``t`` (tokens, features) quantized along features at ``granularity``.

    Returns float64 arrays over tokens: ``rel_err`` (||q(t) - t|| / ||t||,
    0 for a token of zeros), ``flushed`` (the share of its non-zero values
    that became 0) and ``amax_ratio`` (:func:`group_amax_ratio`).
    """
    t64 = np.asarray(t, np.float64)
    # Scales from the float32 tensor the GEMM would see.
    q = quantize(jnp.asarray(t64, jnp.float32), fmt, granularity, axis=-1, tile=tile)
    deq = np.asarray(dequantize(q), np.float64)
    t32 = np.asarray(np.float32(t64), np.float64)
    norm = np.linalg.norm(t32, axis=1)
    err = np.linalg.norm(deq - t32, axis=1)
    nz = t32 != 0
    with np.errstate(invalid="ignore", divide="ignore"):
        rel = np.where(norm > 0, err / np.where(norm > 0, norm, 1.0), 0.0)
        flushed = np.where(
            nz.any(axis=1), (nz & (deq == 0)).sum(axis=1) / np.maximum(nz.sum(axis=1), 1), 0.0
        )
    return {
        "rel_err": rel,
        "flushed": flushed,
        "amax_ratio": group_amax_ratio(t32, granularity, tile),
    }
