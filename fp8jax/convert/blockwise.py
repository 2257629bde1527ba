"""128x128 block (de)quantization of 2-D weights, in numpy, correctly rounded.

DeepSeek-V3 layout: an FP8 weight ``W`` (rows x cols, float8_e4m3fn) and a
float32 ``W_scale_inv`` of shape (ceil(rows/128), ceil(cols/128)); block
(i, j) covers rows 128i..128i+127 and cols 128j..128j+127, clipped at the
bottom and right edges.  ``dequant(W) = W * scale_inv[block]``.

Rounding.  ml_dtypes casts float64 to bfloat16 / float8 through float32,
rounding twice (1 + 2^-8 + 2^-40 becomes 1.0 instead of 1 + 2^-7).
:func:`round_to` casts correctly: float64 -> float32 with round-to-odd,
then float32 -> target with round-to-nearest-even; with at least two more
significand bits in the intermediate than in the target (24 vs 8 for BF16,
4 for E4M3) round-to-odd makes the second rounding give the correctly
rounded result.

Dequantization computes the product of an FP8 value (4 significant bits) and
a float32 scale (24 bits) exactly in float64 (28 bits <= 53), then rounds
once to BF16: the result is the float64 reference rounded to BF16, bit for bit.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

BLOCK = 128
E4M3_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)


def round_to(x64: np.ndarray, dtype) -> np.ndarray:
    """Correctly rounded (nearest-even) cast of float64 values to ``dtype``.

    ``dtype`` must have at most 22 significand bits (bfloat16, float16,
    float8_*): the float32 intermediate needs two more.  No saturation:
    values past the target's range follow the cast's own rules (inf or NaN).
    """
    x64 = np.asarray(x64, dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        f = x64.astype(np.float32)
        back = f.astype(np.float64)
    inexact = (back != x64) & ~np.isnan(x64)
    # Round-to-odd: truncate toward zero, then set the last bit if inexact.
    # For sign-magnitude floats, one step toward zero is bits - 1.
    bits = f.view(np.uint32).copy()
    toward_zero = inexact & (np.abs(back) > np.abs(x64))
    bits[toward_zero] -= np.uint32(1)
    bits[inexact] |= np.uint32(1)
    return bits.view(np.float32).astype(dtype)


def scale_shape(shape: tuple[int, int], block: int = BLOCK) -> tuple[int, int]:
    """(ceil(rows/block), ceil(cols/block))."""
    r, c = shape
    return (-(-r // block), -(-c // block))


def expand_blocks(s: np.ndarray, rows: int, cols: int, block: int = BLOCK) -> np.ndarray:
    """Repeat each block's value over its block, cropped to (rows, cols)."""
    return np.repeat(np.repeat(s, block, axis=0)[:rows], block, axis=1)[:, :cols]


def dequant_rows(w: np.ndarray, scale_rows: np.ndarray, out_dtype=ml_dtypes.bfloat16) -> np.ndarray:
    """Dequantize a stripe of rows of an FP8 weight.

    ``w``: (r, cols) FP8 rows starting at a multiple of ``BLOCK``;
    ``scale_rows``: the (ceil(r/BLOCK), ceil(cols/BLOCK)) scales of those rows.
    Returns ``round_to(float64(w) * float64(scale), out_dtype)``.
    """
    r, c = w.shape
    # float64 holds every FP8 x float32 product exactly (4 + 24 significant bits).
    prod = w.astype(np.float64) * expand_blocks(scale_rows.astype(np.float64), r, c)
    return round_to(prod, out_dtype)


def quant_rows(
    x: np.ndarray, fmt=ml_dtypes.float8_e4m3fn, block: int = BLOCK
) -> tuple[np.ndarray, np.ndarray]:
    """Quantize a stripe of rows blockwise: returns (fp8 data, float32 scale_inv).

    Per block: ``scale = amax / fmt_max`` as a float32 division of float32
    operands (what DeepSeek's kernels compute), 1.0 for an all-zero block (its
    data are zeros either way, and a scale of 0 would divide by zero);
    ``data = round_to(clip(x / scale, -max, max))``.  ``x`` must be finite.
    """
    r, c = x.shape
    fmax = float(ml_dtypes.finfo(fmt).max)
    x64 = x.astype(np.float64)
    sr, sc = scale_shape((r, c), block)
    pad = np.zeros((sr * block, sc * block), np.float64)
    pad[:r, :c] = np.abs(x64)
    amax = pad.reshape(sr, block, sc, block).max(axis=(1, 3))
    # Every input element is a float32 value (BF16/F16/F32), so amax is exact in
    # float32 and the float32 division rounds once.
    scale = amax.astype(np.float32) / np.float32(fmax)
    scale = np.where(amax > 0, scale, np.float32(1.0)).astype(np.float32)
    q = x64 / expand_blocks(scale.astype(np.float64), r, c, block)
    # Clip before the cast: E4M3FN has no inf, and 448 * (1 + tiny) from the
    # division must saturate, not become NaN.
    data = round_to(np.clip(q, -fmax, fmax), fmt)
    return data, scale
