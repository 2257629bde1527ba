"""DeepSeek-V3's block-scaled FP8 quantization in numpy: the reference the recipe is checked against.

Written from DeepSeek-V3's inference code (``act_quant``: one float32 scale
amax / 448 per 1 x 128 tile, codes ``float8_e4m3fn(x / scale)``; weights in
128 x 128 blocks with the same rule) and its training description (the
cached 1 x 128 activation converted to 128 x 1 tiles for Wgrad), and
independent of fp8jax's quantizer: numpy float32 arithmetic and ml_dtypes'
cast, float64 products.  Shapes must be multiples of 128 along the tiled
axes; tiles hold finite values.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

E4M3_MAX = 448.0
TILE = 128


def act_quant(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Quantize-dequantize x in 1 x 128 tiles along ``axis``: float64 values of codes x scales."""
    x32 = np.moveaxis(np.asarray(x, np.float32), axis, -1)
    shape = x32.shape
    if shape[-1] % TILE:
        raise ValueError(f"axis of length {shape[-1]} is not a multiple of {TILE}")
    tiles = x32.reshape(*shape[:-1], shape[-1] // TILE, TILE)
    # float32 scale, amax / 448, as act_quant computes it; an all-zero tile gets 1.
    amax = np.abs(tiles).max(axis=-1, keepdims=True)
    scale = np.where(amax > 0, amax / np.float32(E4M3_MAX), np.float32(1.0)).astype(np.float32)
    # x / scale in float32, then the cast to E4M3 (round to nearest even); the
    # largest element lands on 448 (or within one float32 rounding of it).
    codes = np.clip(tiles / scale, -E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn)
    out = codes.astype(np.float64) * scale.astype(np.float64)
    return np.moveaxis(out.reshape(shape), -1, axis)


def block_quant(w: np.ndarray) -> np.ndarray:
    """Quantize-dequantize a (K, N) weight in 128 x 128 blocks: float64 values."""
    w32 = np.asarray(w, np.float32)
    k, n = w32.shape
    if k % TILE or n % TILE:
        raise ValueError(f"weight shape {w32.shape} is not a multiple of {TILE} x {TILE}")
    blocks = w32.reshape(k // TILE, TILE, n // TILE, TILE)
    amax = np.abs(blocks).max(axis=(1, 3), keepdims=True)
    scale = np.where(amax > 0, amax / np.float32(E4M3_MAX), np.float32(1.0)).astype(np.float32)
    codes = np.clip(blocks / scale, -E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn)
    return (codes.astype(np.float64) * scale.astype(np.float64)).reshape(k, n)


def reference_linear(
    x: np.ndarray, w: np.ndarray, dy: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """y, dx, dw of y = x @ w (x (M, K), w (K, N), dy (M, N)) with DeepSeek's quantization.

    Fprop: x in 1 x 128 tiles along K, w in blocks.  Dgrad: dy in 1 x 128
    tiles along N, the same weight blocks.  Wgrad: the cached FP8 x
    re-quantized in 128 x 1 tiles along the tokens, dy in 128 x 1 tiles.
    Every product and sum in float64.
    """
    xq = act_quant(x, axis=1)
    wq = block_quant(w)
    y = xq @ wq
    dx = act_quant(dy, axis=1) @ wq.T
    dw = act_quant(xq, axis=0).T @ act_quant(dy, axis=0)
    return y, dx, dw
