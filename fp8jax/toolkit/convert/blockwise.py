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
    # Round-to-odd: truncate toward zero, then set the last bit if inexact.
    # For sign-magnitude floats one step toward zero is bits - 1.  (NaN compares
    # unequal to itself: its last bit gets set, and it stays NaN.)
    toward_zero = np.abs(back) > np.abs(x64)
    bits = f.view(np.uint32)
    bits -= toward_zero
    bits |= back != x64
    return f.astype(dtype)


# Exponent-field masks: a value is inf/NaN when all its exponent bits are set
# (E4M3FN: NaN is S.1111.111 and it has no inf).
_NONFINITE_MASKS = {
    np.dtype(np.float64): (np.uint64, 0x7FF0000000000000),
    np.dtype(np.float32): (np.uint32, 0x7F800000),
    np.dtype(np.float16): (np.uint16, 0x7C00),
    np.dtype(ml_dtypes.bfloat16): (np.uint16, 0x7F80),
    np.dtype(ml_dtypes.float8_e5m2): (np.uint8, 0x7C),
    np.dtype(ml_dtypes.float8_e4m3fn): (np.uint8, 0x7F),
}


def all_finite(a: np.ndarray) -> bool:
    """True if no element is inf or NaN; a bit test for the checkpoint dtypes (no float cast)."""
    a = np.asarray(a)
    m = _NONFINITE_MASKS.get(a.dtype)
    if m is None:
        if not (
            np.issubdtype(a.dtype, np.floating) or a.dtype.kind == "V" or "float" in a.dtype.name
        ):
            return True
        return bool(np.isfinite(a.astype(np.float32)).all())
    ut, mask = m
    u = np.ascontiguousarray(a).view(ut)
    return not bool(np.any((u & ut(mask)) == ut(mask)))


def scale_shape(shape: tuple[int, int], block: int = BLOCK) -> tuple[int, int]:
    """(ceil(rows/block), ceil(cols/block))."""
    r, c = shape
    return (-(-r // block), -(-c // block))


def expand_blocks(s: np.ndarray, rows: int, cols: int, block: int = BLOCK) -> np.ndarray:
    """Repeat each block's value over its block, cropped to (rows, cols)."""
    return np.repeat(np.repeat(s, block, axis=0)[:rows], block, axis=1)[:, :cols]


def _times_blocks(x64: np.ndarray, s64: np.ndarray, op) -> np.ndarray:
    """op(x, scale of x's block) for a stripe of rows starting at a block edge.

    Broadcasts the (rows, ceil(cols/BLOCK)) row-expanded scales over 128-column
    groups instead of materialising a full-size scale array.
    """
    r, c = x64.shape
    srow = np.repeat(s64, BLOCK, axis=0)[:r]
    out = np.empty((r, c), np.float64)
    main = (c // BLOCK) * BLOCK
    if main:
        nb = main // BLOCK
        op(
            x64[:, :main].reshape(r, nb, BLOCK),
            srow[:, :nb, None],
            out=out[:, :main].reshape(r, nb, BLOCK),
        )
    if main < c:
        op(x64[:, main:], srow[:, -1:], out=out[:, main:])
    return out


def dequant_rows(w: np.ndarray, scale_rows: np.ndarray, out_dtype=ml_dtypes.bfloat16) -> np.ndarray:
    """Dequantize a stripe of rows of an FP8 weight.

    ``w``: (r, cols) FP8 rows starting at a multiple of ``BLOCK``;
    ``scale_rows``: the (ceil(r/BLOCK), ceil(cols/BLOCK)) scales of those rows.
    Returns ``round_to(float64(w) * float64(scale), out_dtype)``.
    """
    # float64 holds every FP8 x float32 product exactly (4 + 24 significant bits).
    prod = _times_blocks(w.astype(np.float64), scale_rows.astype(np.float64), np.multiply)
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
    if block != BLOCK:
        raise ValueError(f"only {BLOCK}x{BLOCK} blocks are supported")
    r, c = x.shape
    fmax = float(ml_dtypes.finfo(fmt).max)
    # Every input element is a float32 value (BF16/F16/F32): float32 holds it,
    # its absolute value and the block max exactly.
    ax = np.abs(x.astype(np.float32))
    sr, sc = scale_shape((r, c), block)
    pad = np.zeros((sr * block, sc * block), np.float32)
    pad[:r, :c] = ax
    amax = pad.reshape(sr, block, sc, block).max(axis=(1, 3))
    # The float32 division rounds once, as in DeepSeek's kernels.
    scale = amax / np.float32(fmax)
    scale = np.where(amax > 0, scale, np.float32(1.0)).astype(np.float32)
    q = _times_blocks(x.astype(np.float64), scale.astype(np.float64), np.divide)
    # Clip before the cast: E4M3FN has no inf, and 448 * (1 + tiny) from the
    # division must saturate, not become NaN.
    np.clip(q, -fmax, fmax, out=q)
    return round_to(q, fmt), scale
