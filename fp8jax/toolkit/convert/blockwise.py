"""128x128 block (de)quantization of 2-D weights (DeepSeek-V3 checkpoint layout).

Layout: an FP8 weight ``W`` (rows x cols, float8_e4m3fn) and a float32
``W_scale_inv`` of shape (ceil(rows/128), ceil(cols/128)); block (i, j)
covers rows 128i..128i+127 and cols 128j..128j+127, clipped at the bottom and
right edges.  ``dequant(W) = W * scale_inv[block]``.

Dequantization, two roundings to choose from (:data:`ROUNDINGS`):

* ``"deepseek"`` (the default): what DeepSeek-V3's ``fp8_cast_bf16.py`` does
  through ``weight_dequant``: the FP8 value and its scale as float32, their
  product rounded to nearest-even in float32, that product rounded to
  nearest-even in BF16.  Two roundings: for about one product in 10^5 the
  result differs by one BF16 ulp from the correctly rounded one, and a
  checkpoint converted here is bit for bit the one DeepSeek's script writes.
  (Products below float32's normal range keep IEEE gradual underflow; a GPU
  that flushes float32 subnormals would give zero there.)
* ``"exact"``: the product of an FP8 value (4 significant bits) and a
  float32 scale (24 bits) is exact in float64 (28 <= 53 bits) and is rounded
  once to BF16 with :func:`round_to`: the float64 reference rounded to BF16,
  bit for bit.

Quantization (:func:`quant_rows`) is ``fp8jax.quantize(x, E4M3, "block")``
itself, so a converted checkpoint holds exactly what the training code's
weight quantizer gives: scale = amax / 448 per block (a float32 division,
as DeepSeek's kernels), data = E4M3(float32(x / scale)) with saturation.

:func:`round_to` casts float64 correctly: float64 -> float32 with
round-to-odd, then float32 -> target with round-to-nearest-even; with at
least two more significand bits in the intermediate than in the target (24
vs 8 for BF16, 4 for E4M3) round-to-odd makes the second rounding give the
correctly rounded result (ml_dtypes' own float64 cast rounds twice).
"""

from __future__ import annotations

import functools

import jax
import ml_dtypes
import numpy as np

from fp8jax.formats import E4M3
from fp8jax.quant import quantize
from fp8jax.toolkit.convert.layouts import check_scale_values, grid_shape

BLOCK = 128
ROUNDINGS = ("deepseek", "exact")
# Scale dtypes whose values float32 holds exactly (DeepSeek's scales are F32).
SCALE_DTYPES = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16))


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


def count_nonfinite(a: np.ndarray) -> tuple[int, int]:
    """(number of NaN, number of +-Inf) elements of a float array of any checkpoint dtype."""
    # Every FP8/BF16/F16 value is exact in float32, NaN and Inf included.
    f = np.asarray(a).astype(np.float32) if np.asarray(a).dtype != np.float64 else np.asarray(a)
    return int(np.isnan(f).sum()), int(np.isinf(f).sum())


def describe_nonfinite(a: np.ndarray) -> str:
    """'3 NaN and 1 Inf value(s)'-style count of a chunk's non-finite elements."""
    nan, inf = count_nonfinite(a)
    parts = [f"{nan} NaN" if nan else "", f"{inf} Inf" if inf else ""]
    return " and ".join(p for p in parts if p) + " value(s)"


def scale_shape(shape: tuple[int, int], block: int = BLOCK) -> tuple[int, int]:
    """(ceil(rows/block), ceil(cols/block))."""
    r, c = shape
    return (-(-r // block), -(-c // block))


def check_scale(
    weight: str,
    w_shape: tuple[int, ...],
    scale_name: str,
    scale: np.ndarray,
    block: tuple[int, int] = (BLOCK, BLOCK),
    scale_fmt: str = "float32",
) -> None:
    """Refuse a scale tensor that cannot dequantize ``weight``: ValueError with one line.

    The scale must have exactly one value per ``block`` (128x128 unless told)
    of the (2-D) weight (a larger one would be cropped silently, a smaller one
    broadcast), a dtype float32 holds exactly or E8M0, and every value must
    pass :func:`fp8jax.toolkit.convert.layouts.check_scale_values` (finite,
    > 0, not E8M0's NaN byte; a power of two under ``scale_fmt="ue8m0"``).
    """
    if len(w_shape) != 2:
        raise ValueError(f"FP8 tensor {weight!r} has shape {list(w_shape)}; expected 2-D")
    want = grid_shape(tuple(w_shape), block)
    if tuple(scale.shape) != want:
        raise ValueError(
            f"wrong scale shape for {weight!r}: {scale_name!r} is {list(scale.shape)}, expected "
            f"{list(want)} (one per {block[0]}x{block[1]} block of {list(w_shape)})"
        )
    check_scale_values(scale_name, scale, scale_fmt, SCALE_DTYPES)


def _times_blocks(x: np.ndarray, s: np.ndarray, op, block: tuple[int, int]) -> np.ndarray:
    """op(x, scale of x's block) in x's dtype, for a stripe of rows starting at a block edge.

    Broadcasts the (rows, ceil(cols/bc)) row-expanded scales over groups of
    ``bc`` columns instead of materialising a full-size scale array.
    """
    br, bc = block
    r, c = x.shape
    srow = np.repeat(s, br, axis=0)[:r]
    out = np.empty((r, c), x.dtype)
    main = (c // bc) * bc
    if main:
        nb = main // bc
        op(
            x[:, :main].reshape(r, nb, bc),
            srow[:, :nb, None],
            out=out[:, :main].reshape(r, nb, bc),
        )
    if main < c:
        op(x[:, main:], srow[:, -1:], out=out[:, main:])
    return out


def dequant_rows(
    w: np.ndarray,
    scale_rows: np.ndarray,
    out_dtype=ml_dtypes.bfloat16,
    rounding: str = "deepseek",
    block: tuple[int, int] = (BLOCK, BLOCK),
) -> np.ndarray:
    """Dequantize a stripe of rows of a block-scaled weight to ``out_dtype``.

    ``w``: (r, cols) rows starting at a multiple of the block's rows, FP8
    codes or values already decoded to float32 (FP4, exact there);
    ``scale_rows``: the (ceil(r/br), ceil(cols/bc)) scales of those rows (any
    dtype float32 holds exactly: F32, BF16, F16, E8M0).
    ``rounding="deepseek"``: ``out_dtype(float32(w) * float32(scale))``;
    ``"exact"``: ``round_to(float64(w) * float64(scale), out_dtype)``.  The two
    agree wherever the float32 product is exact, which it is for every
    power-of-two scale (see :mod:`fp8jax.toolkit.convert.layouts`).
    """
    if rounding == "deepseek":
        # DeepSeek's weight_dequant: both operands to float32 (exact for FP8 and
        # F32/BF16/F16 scales), one float32 product, then a store to BF16.  A
        # product past float32's range becomes inf, which callers report.
        with np.errstate(over="ignore"):
            prod = _times_blocks(
                w.astype(np.float32), scale_rows.astype(np.float32), np.multiply, block
            )
        return prod.astype(out_dtype)
    if rounding == "exact":
        # float64 holds every FP8 x float32 product exactly (4 + 24 significant bits).
        prod = _times_blocks(
            w.astype(np.float64), scale_rows.astype(np.float64), np.multiply, block
        )
        return round_to(prod, out_dtype)
    raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")


# Blocks per call of the compiled quantizer: 64 x 128 x 128 = 1M elements.
_GROUP = 64


@functools.cache
def _block_quantizer(pow2: bool, amax_floor: float):
    # fp8jax.quantize's "block" granularity on a stack of 128x128 blocks gives
    # each block its own scale, the same arithmetic as on the 2-D weight; one
    # fixed stack shape means one compilation for every tensor of a checkpoint.
    return jax.jit(
        lambda x: quantize(x, E4M3, "block", tile=BLOCK, pow2=pow2, amax_floor=amax_floor)
    )


def quant_rows(
    x: np.ndarray, pow2: bool = False, amax_floor: float = 0.0
) -> tuple[np.ndarray, np.ndarray]:
    """Quantize a stripe of rows to E4M3 with 128x128 block scales: (data, float32 scale_inv).

    Exactly ``fp8jax.quantize(x, E4M3, "block", pow2=pow2, amax_floor=amax_floor)``
    (see the module docstring).  ``pow2=True`` gives DeepSeek-V3.1's UE8M0 scales:
    max(amax, amax_floor) / 448 rounded up to a power of two,
    ``2^ceil(log2(amax / 448))``, so that no element saturates (still stored as
    float32);
    ``x`` (rows starting at a multiple of 128) must be finite.  The stripe is
    zero-padded to whole blocks (zeros never raise a block's amax, and
    fp8jax.quantize pads partial blocks with zeros itself) and quantized as a
    stack of 128x128 blocks.
    """
    r, c = x.shape
    sr, sc = scale_shape((r, c))
    if r == 0 or c == 0:
        return np.zeros((r, c), E4M3), np.ones((sr, sc), np.float32)
    xp = np.zeros((sr * BLOCK, sc * BLOCK), x.dtype)
    xp[:r, :c] = x
    blocks = xp.reshape(sr, BLOCK, sc, BLOCK).transpose(0, 2, 1, 3).reshape(sr * sc, BLOCK, BLOCK)
    n = blocks.shape[0]
    total = -(-n // _GROUP) * _GROUP
    if total > n:
        blocks = np.concatenate([blocks, np.zeros((total - n, BLOCK, BLOCK), x.dtype)])
    quant = _block_quantizer(pow2, amax_floor)
    data, scale = [], []
    for g in range(0, total, _GROUP):
        q = quant(blocks[g : g + _GROUP])
        data.append(np.asarray(q.data))
        scale.append(np.asarray(q.scale, np.float32).reshape(-1))
    data_b = np.concatenate(data)[:n].reshape(sr, sc, BLOCK, BLOCK).transpose(0, 2, 1, 3)
    data_2d = data_b.reshape(sr * BLOCK, sc * BLOCK)[:r, :c]
    return np.ascontiguousarray(data_2d), np.concatenate(scale)[:n].reshape(sr, sc)
