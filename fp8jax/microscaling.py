"""Block-scaled formats below per-tile FP8: MXFP8 (and MXFP4) and NVFP4.

Both split the contraction axis into short blocks, each with its own scale
stored in 8 bits, and are the formats Blackwell tensor cores multiply
natively.  Their quantizers return a :class:`~fp8jax.quant.QTensor` of
scheme "mx" or "nvfp4" holding ``data`` (element format, ``x``'s shape),
``scale`` (one per block, in the scale format) and ``tensor_scale``
(float32, NVFP4's second level; 1 for MX), with

    x ~= dequantize(q) = data * scale * tensor_scale.

MX (OCP Microscaling Formats v1.0, section 6.3, "Conversion from vectors of
Float32 to MX"): per block of 32 elements along ``axis``,

    shared_exp = floor(log2(max_i |V_i|)) - emax_elem
    X          = 2^shared_exp            (E8M0, shared_exp clamped to [-127, 127])
    P_i        = quantize_to_element_format(V_i / X)

where ``emax_elem`` is the exponent of the element format's largest normal
(E4M3: 8, E5M2: 15, E2M1: 2) and values of ``V_i / X`` past the element
format's largest normal clamp to it (``V_i / X`` can reach just under
``2^(emax_elem + 1)``, above E4M3's 448).  Rounding is round-to-nearest-even.
Because X is a power of two, ``V_i / X`` is an exact multiplication by
``2^-shared_exp``; for finite float32 input ``shared_exp`` never exceeds
127 - emax_elem, so the spec's NaN scale for ``shared_exp > 127`` is
unreachable, and an all-zero block gets the smallest scale, 2^-127.

The floor above is the OCP rule ("floor", the default).  It lets a block's
top values land above the element maximum (up to just under 2^(emax_elem+1),
which E4M3 clamps to 448).  ``scale_rounding="ceil"`` takes instead the
smallest power of two X with amax / X <= max_elem, i.e. ceil(log2(amax /
max_elem)) computed exactly from amax's bits (one more than the floor rule
when amax's significand exceeds max_elem's, 1.75 for E4M3): no element ever
clips, at the cost of one bit of range for the smallest values.  NVIDIA's
MXFP8 training recipe and Transformer Engine round the scale up this way
(they divide amax by max_elem in float32 first, which can differ from the
exact ceiling only where that division rounds across a power of two).

NVFP4 ("Pretraining Large Language Models with NVFP4", NVIDIA 2025, and
Transformer Engine's NVFP4 recipe): E2M1 elements (max 6), one E4M3 scale
per 16 elements along ``axis`` (or per 16x16 block over the last two axes,
used for weights so that W and W^T see the same quantized values), and a
per-tensor float32 scale that maps the tensor's amax to 6 * 448:

    s_enc   = 6 * 448 / amax(x)                    (float32; 1 when amax = 0)
    s_dec   = 1 / s_enc                            (float32, the tensor_scale)
    scale_b = e4m3(amax_b / 6 * s_enc)             (round-to-nearest-even, saturating)
    enc_b   = 1 / (float32(scale_b) * s_dec)       (0 for an all-zero block)
    data    = e2m1(clip(x * enc_b, -6, 6))         (nearest-even or stochastic)

every division correctly rounded in float32.  ``s_enc`` is capped at 2^126 so
that ``s_dec`` stays a normal float32 (only tensors with amax below ~3e-35
notice).  Dequantization computes ``(data * scale_b) * s_dec``: the first
product is exact, the second rounds once.

Special values (both families): float32 subnormal inputs count as signed
zeros (XLA on CPU flushes them; doing it explicitly keeps backends equal).
Amaxes ignore NaN and +-Inf, so +-Inf saturates to the largest element value
of its block (or to zero when its block has no other nonzero finite
element: the block's scale is then zero for NVFP4).  A NaN stays in its own element where the element format has a
NaN (E4M3, E5M2); E2M1 has none, so a NaN makes its whole block's scale NaN
(E8M0 and E4M3 both have one) and the block decodes to NaN.

Stochastic rounding (``key`` given) replaces the element rounding by
:func:`fp8jax.rounding.round_stochastic`; scales are always rounded to
nearest.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

from fp8jax.formats import BLOCK_FORMATS, E2M1, E4M3, E8M0, as_format, saturating_cast
from fp8jax.layout import Layout
from fp8jax.quant import QTensor, group_amax, layout_amax
from fp8jax.rounding import floor_log2, flush_subnormals, pow2_int, round_to_format
from fp8jax.scaling import exact_div

MX_BLOCK = BLOCK_FORMATS["mxfp8"]
NVFP4_BLOCK = BLOCK_FORMATS["nvfp4"]
# NVFP4's tensor scale maps the tensor amax onto e2m1 max * e4m3 max.
_NVFP4_RANGE = 6.0 * 448.0
_F32_MAX = float(jnp.finfo(jnp.float32).max)
_S_ENC_CAP = 2.0**126


def _check(x: jnp.ndarray, block: int, two_d: bool) -> None:
    if x.ndim == 0:
        raise ValueError("block quantization needs at least a 1-d tensor")
    if block <= 0:
        raise ValueError(f"block must be positive, got {block}")
    if two_d and x.ndim < 2:
        raise ValueError("2-d blocks need at least a 2-d tensor")


def _finite(xf: jnp.ndarray) -> jnp.ndarray:
    # +-Inf becomes +-float32 max so that a product with a zero block scale
    # is 0, not NaN; any other product saturates in the element cast.
    return jnp.clip(xf, -_F32_MAX, _F32_MAX)


def _layout(axis: int, block: int, two_d: bool) -> Layout:
    # The fp8jax.quant scale layout that holds these blocks (``axis``
    # normalized; 2-d blocks cover the last two axes whatever it is).
    return Layout("block" if two_d else "tile", axis, block)


def _nan_blocks(xf: jnp.ndarray, layout: Layout) -> jnp.ndarray:
    """True for the blocks that hold a NaN.

    Counted on an isnan mask, not read off a NaN-propagating max: XLA on CPU
    can drop a NaN from a max-reduction over a zero-padded block.
    """
    return layout_amax(jnp.isnan(xf).astype(jnp.float32), layout) > 0


def element_emax(fmt) -> int:
    """Exponent of the largest normal of an element format (E4M3: 8, E2M1: 2)."""
    return int(ml_dtypes.finfo(as_format(fmt)).maxexp) - 1


def _has_nan(fmt) -> bool:
    # E4M3 / E5M2 encode NaN; E2M1 has no NaN (ml_dtypes turns NaN into -0).
    nan = np.array(np.nan, np.float32).astype(as_format(fmt)).astype(np.float32)
    return bool(np.isnan(nan))


MX_SCALE_ROUNDINGS = ("floor", "ceil")


def mx_shared_exponent(
    amax: jnp.ndarray, elem_fmt=E4M3, scale_rounding: str = "floor"
) -> jnp.ndarray:
    """int32 shared exponent of a block with this ``amax`` (module docstring).

    "floor": clamp(floor(log2 amax) - emax_elem, -127, 127) (OCP MX v1.0).
    "ceil": the smallest e with amax <= max_elem * 2^e, clamped likewise.
    ``amax`` float32 and finite; zero and float32 subnormals count as 2^-127
    (and are never rounded up).
    """
    if scale_rounding not in MX_SCALE_ROUNDINGS:
        raise ValueError(
            f"scale_rounding must be one of {MX_SCALE_ROUNDINGS}, got {scale_rounding!r}"
        )
    elem_fmt = as_format(elem_fmt)
    emax = element_emax(elem_fmt)
    e = floor_log2(amax) - emax
    if scale_rounding == "ceil":
        # amax = m * 2^f and max_elem = m_max * 2^emax with m, m_max in [1, 2):
        # amax / 2^(f - emax) = m * 2^emax exceeds max_elem iff m > m_max, a
        # comparison of the 23 significand bits (exact, no division).
        m_max = float(ml_dtypes.finfo(elem_fmt).max) / 2.0**emax
        threshold = int(round((m_max - 1.0) * 2**23))
        bits = lax.bitcast_convert_type(amax.astype(jnp.float32), jnp.int32)
        normal = ((bits >> 23) & 0xFF) > 0
        e = e + ((bits & 0x7FFFFF) > threshold).astype(jnp.int32) * normal.astype(jnp.int32)
    return jnp.clip(e, -127, 127)


def _e8m0(shared_exp: jnp.ndarray) -> jnp.ndarray:
    # E8M0 is a bare biased exponent (bias 127); 255 is its NaN.
    return lax.bitcast_convert_type((shared_exp + 127).astype(jnp.uint8), E8M0)


def e8m0_exponent(scale: jnp.ndarray) -> jnp.ndarray:
    return lax.bitcast_convert_type(scale, jnp.uint8).astype(jnp.int32) - 127


# The quantizers are jitted as a whole: run op by op they compile dozens of
# small kernels on first use, which costs seconds on a CPU.
@partial(jax.jit, static_argnames=("elem_fmt", "axis", "block", "two_d", "scale_rounding"))
def quantize_mx(
    x: jnp.ndarray,
    elem_fmt=E4M3,
    axis: int = -1,
    block: int = MX_BLOCK,
    *,
    two_d: bool = False,
    key: jax.Array | None = None,
    scale_rounding: str = "floor",
) -> QTensor:
    """MX quantization (OCP MX v1.0): E8M0 power-of-two scale per block (module docstring).

    ``scale_rounding``: "floor" (the OCP rule) or "ceil" (the scale rounded up
    so that no element clips).
    """
    _check(x, block, two_d)
    elem_fmt = as_format(elem_fmt)
    axis = axis % x.ndim
    layout = _layout(axis, block, two_d)
    xf = flush_subnormals(x)
    amax = layout_amax(xf, layout)
    shared = mx_shared_exponent(amax, elem_fmt, scale_rounding)
    scale = _e8m0(shared)
    if not _has_nan(elem_fmt):
        scale = jnp.where(_nan_blocks(xf, layout), jnp.array(jnp.nan, E8M0), scale)
    # V / X = V * 2^-shared_exp, exact; 2^-shared_exp is a normal float32
    # because shared_exp <= 127 - emax_elem for finite float32 input.
    inv = layout.expand(pow2_int(-shared), x.shape)
    y = _finite(xf) * inv
    y = jnp.where(jnp.isnan(y), jnp.zeros_like(y), y) if not _has_nan(elem_fmt) else y
    data = round_to_format(y, elem_fmt, key)
    return QTensor(data, scale, layout, jnp.ones((), jnp.float32), "mx")


def nvfp4_tensor_scales(amax: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """(s_enc, s_dec) from the tensor's finite amax (float32; module docstring)."""
    amax = amax.astype(jnp.float32)
    s_enc = exact_div(jnp.float32(_NVFP4_RANGE), jnp.where(amax > 0, amax, 1.0))
    # amax = 0: any scale reproduces the zeros; 1 keeps everything exact.
    s_enc = jnp.where(amax > 0, jnp.minimum(s_enc, jnp.float32(_S_ENC_CAP)), 1.0)
    s_dec = exact_div(jnp.float32(1.0), s_enc)
    return s_enc, s_dec


@partial(jax.jit, static_argnames=("axis", "block", "two_d"))
def quantize_nvfp4(
    x: jnp.ndarray,
    axis: int = -1,
    block: int = NVFP4_BLOCK,
    *,
    two_d: bool = False,
    key: jax.Array | None = None,
) -> QTensor:
    """NVFP4 quantization: E2M1 data, E4M3 block scales, float32 tensor scale."""
    _check(x, block, two_d)
    axis = axis % x.ndim
    layout = _layout(axis, block, two_d)
    xf = flush_subnormals(x)
    s_enc, s_dec = nvfp4_tensor_scales(group_amax(xf, "tensor"))
    bamax = layout_amax(xf, layout)
    # Block decode scale amax_b / 6, mapped by s_enc into E4M3's range and
    # rounded to nearest (saturating: rounding may push it past 448).
    scale = saturating_cast(exact_div(bamax, jnp.float32(6.0)) * s_enc, E4M3)
    # Flushed like every float32 subnormal here (XLA on CPU does it anyway).
    dec = flush_subnormals(scale.astype(jnp.float32) * s_dec)
    # enc_b = 1 / (scale_b * s_dec); a zero (or flushed) decode scale means an
    # all-zero or negligible block, whose elements quantize to zero.
    enc = jnp.where(dec > 0, exact_div(jnp.float32(1.0), jnp.where(dec > 0, dec, 1.0)), 0.0)
    scale = jnp.where(_nan_blocks(xf, layout), jnp.array(jnp.nan, E4M3), scale)
    y = _finite(xf) * layout.expand(enc, x.shape)
    # E2M1 has no NaN: the element becomes 0 and its block scale carries the NaN.
    y = jnp.where(jnp.isnan(y), jnp.zeros_like(y), y)
    data = round_to_format(y, E2M1, key)
    return QTensor(data, scale, layout, s_dec, "nvfp4")


def quantize_mxfp8(
    x: jnp.ndarray,
    axis: int = -1,
    *,
    two_d: bool = False,
    key: jax.Array | None = None,
    scale_rounding: str = "floor",
) -> QTensor:
    """MXFP8: E4M3 elements, E8M0 scale per 32 elements along ``axis`` (rounded per ``scale_rounding``)."""
    return quantize_mx(x, E4M3, axis, MX_BLOCK, two_d=two_d, key=key, scale_rounding=scale_rounding)


@partial(jax.jit, static_argnames=("dtype",))
def dequantize_blocks(q: QTensor, dtype: Any = jnp.float32) -> jnp.ndarray:
    """``data * scale * tensor_scale`` in float32, returned as ``dtype``.

    MX: ``data * 2^e`` is applied as two exact power-of-two products
    (``2^ceil(e/2)`` then ``2^floor(e/2)``) so that no float32 subnormal scale
    is ever formed (XLA on CPU would flush it); only a result below float32's
    normal range rounds, to a signed zero.  NVFP4: ``(data * scale) *
    tensor_scale``, the first product exact.
    """
    d = q.data.astype(jnp.float32)
    if q.scale.dtype == E8M0:
        e = e8m0_exponent(q.scale)
        nan = e == 128
        e = jnp.where(nan, 0, e)
        hi = q.layout.expand(pow2_int(e - e // 2), q.shape)
        lo = q.layout.expand(pow2_int(e // 2), q.shape)
        out = flush_subnormals(d * hi * lo)
        out = jnp.where(q.layout.expand(nan, q.shape), jnp.nan, out)
    else:
        s = q.layout.expand(q.scale.astype(jnp.float32), q.shape)
        out = flush_subnormals(d * s * q.tensor_scale)
    return out.astype(dtype)


def fake_quantize(
    x: jnp.ndarray,
    fmt: str,
    axis: int = -1,
    *,
    two_d: bool = False,
    key: jax.Array | None = None,
) -> jnp.ndarray:
    """Quantize then dequantize (float32): ``fmt`` is "mxfp8" or "nvfp4"."""
    if fmt == "mxfp8":
        q = quantize_mxfp8(x, axis, two_d=two_d, key=key)
    elif fmt == "nvfp4":
        q = quantize_nvfp4(x, axis, two_d=two_d, key=key)
    else:
        raise ValueError(f"unknown block format {fmt!r}; known: 'mxfp8', 'nvfp4'")
    return dequantize_blocks(q)
