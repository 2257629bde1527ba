"""The format families behind the one quantized operand, and the one spec quantizer.

Every quantized operand is a :class:`~fp8jax.quant.QTensor` (codes, scales,
layout).  What differs between format families sits here, in one table
(:data:`SCHEMES`), keyed by ``QTensor.scheme``:

* ``"fp8"``: E4M3 / E5M2 codes with float32 scales per tensor, row, 1 x tile
  run or tile x tile block (:mod:`fp8jax.quant`), online or delayed; with
  ``QuantSpec.scale_fmt="ue8m0"`` the (power-of-two) scales are stored as
  E8M0 bytes, the same values;
* ``"mx"``: MXFP8, E4M3 codes with one E8M0 (power-of-two) scale per 32
  elements (:mod:`fp8jax.microscaling`);
* ``"nvfp4"``: E2M1 codes, one E4M3 scale per 16 elements (or 16 x 16
  block) and a float32 tensor scale.

A scheme says how a :class:`~fp8jax.recipes.QuantSpec` becomes codes and
scales, how they become values again, and the scale each element was
divided by.  Everything else (transposing, gathering or tiling an operand,
caching it for the backward pass, telemetry, choosing the GEMM) reads only
the operand's fields.

:func:`quantize` is the one place where a QuantSpec becomes codes and
scales: the GEMMs' operands, the FSDP weight gathers, the FP8 expert
dispatch, the SwiGLU cache and the grouped GEMM's token tiles all call it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from fp8jax import hadamard, quant, scaling
from fp8jax.blockscaled import operand_key, quantize_block_operand
from fp8jax.formats import floor_e8m0
from fp8jax.microscaling import dequantize_blocks, e8m0_exponent
from fp8jax.quant import QTensor
from fp8jax.rounding import pow2_int

if TYPE_CHECKING:
    from fp8jax.recipes import QuantSpec


@dataclass(frozen=True)
class Scheme:
    """What one format family does differently.

    Attributes:
      quantize: (t, spec, axis, scale, amax, seed) -> QTensor, see :func:`quantize`.
      dequantize: (q, dtype) -> the represented values in ``dtype``.
      element_scale: q -> float32, broadcastable to q's shape: the scale each
        element was divided by before rounding to its code (0 where the
        scale is not a positive float32).
      requantizes_codes: whether a backward GEMM may re-quantize an operand
        from its cached codes (FP8: DeepSeek-V3 re-tiles its cached 1x128
        activation); False: from the high-precision tensor, as Transformer
        Engine makes its columnwise NVFP4 / MXFP8 copy (re-quantizing 4-bit
        codes would round twice).
    """

    quantize: Callable[..., QTensor]
    dequantize: Callable[[QTensor, Any], jax.Array]
    element_scale: Callable[[QTensor], jax.Array]
    requantizes_codes: bool


def _quantize_fp8(t, spec, axis, scale, amax, seed) -> QTensor:
    del seed
    if amax is not None:
        # The caller's amax per scale group (e.g. over an expert's tokens).
        scale = scaling.scale_from_amax(amax, spec.fmt, pow2=spec.pow2, amax_floor=spec.amax_floor)
        if spec.scale_fmt == "ue8m0":
            # As quant.quantize does: E8M0 holds no power of two below 2^-127.
            scale = floor_e8m0(scale)
    if scale is not None:
        # A given scale (a delayed state's) that is not a power of two is refused
        # by a UE8M0 spec (quant.quantize_with_scale), never rounded.
        return quant.quantize_with_scale(
            t, scale, spec.fmt, spec.granularity, axis, spec.tile, scale_fmt=spec.scale_fmt
        )
    if spec.scaling == "delayed":
        raise ValueError("a delayed spec quantizes with the scale of its state: pass scale=")
    return quant.quantize(
        t,
        spec.fmt,
        spec.granularity,
        axis=axis,
        tile=spec.tile,
        pow2=spec.pow2,
        amax_floor=spec.amax_floor,
        scale_fmt=spec.scale_fmt,
    )


def _quantize_block(t, spec, axis, scale, amax, seed) -> QTensor:
    """MXFP8 / NVFP4 with the format's own online scales: the RHT, then quantization.

    ``spec.hadamard``: the random Hadamard transform along ``axis`` first
    (the axis is zero-padded to a multiple of 16, kept padded).
    ``spec.stochastic``: stochastic rounding keyed by
    :func:`~fp8jax.blockscaled.operand_key` (salt: the operand's rank and
    contraction axis, which differ between the Dgrad and Wgrad copies of the
    gradient, so their draws are independent).
    """
    if scale is not None or amax is not None:
        raise ValueError(f"{spec.fmt} computes its own scales: no scale= or amax=")
    axis = axis % t.ndim
    if spec.hadamard:
        t = hadamard.rht(t, hadamard.random_signs(seed), axis)
    key = operand_key(seed, 10 * t.ndim + axis, t) if spec.stochastic else None
    return quantize_block_operand(
        t, spec.fmt, spec.granularity, axis, key=key, scale_rounding=spec.scale_rounding
    )


def _fp8_element_scale(q: QTensor) -> jax.Array:
    # float32 or E8M0 bytes (decoded exactly): the values divided by.
    return q.layout.expand(quant.scale_values(q), q.shape)


def _mx_element_scale(q: QTensor) -> jax.Array:
    # 2^e from the E8M0 exponent (a NaN scale stays NaN); exponents below
    # float32's normal range give 0 (no positive float32 scale).
    e = e8m0_exponent(q.scale)
    s = jnp.where(e == 128, jnp.nan, jnp.where(e < -126, 0.0, pow2_int(jnp.maximum(e, -126))))
    return q.layout.expand(s.astype(jnp.float32), q.shape)


def _nvfp4_element_scale(q: QTensor) -> jax.Array:
    s = q.scale.astype(jnp.float32) * q.tensor_scale
    return q.layout.expand(s, q.shape)


SCHEMES: dict[str, Scheme] = {
    "fp8": Scheme(_quantize_fp8, quant.dequantize, _fp8_element_scale, True),
    "mx": Scheme(_quantize_block, dequantize_blocks, _mx_element_scale, False),
    "nvfp4": Scheme(_quantize_block, dequantize_blocks, _nvfp4_element_scale, False),
}
# The schemes of the QuantSpec formats that are not plain FP8 element formats.
_FORMAT_SCHEMES = {"mxfp8": "mx", "nvfp4": "nvfp4"}


def scheme_of(fmt: str | None) -> str:
    """The scheme a QuantSpec format quantizes with ("e4m3" -> "fp8", "mxfp8" -> "mx", ...)."""
    return _FORMAT_SCHEMES.get(fmt, "fp8")


def requantizes_codes(fmt: str | None) -> bool:
    """Whether operands of QuantSpec format ``fmt`` are re-quantized from cached codes (Scheme)."""
    return SCHEMES[scheme_of(fmt)].requantizes_codes


def quantize(
    t: jax.Array,
    spec: QuantSpec,
    axis: int,
    *,
    scale: jax.Array | None = None,
    amax: jax.Array | None = None,
    seed: int = 0,
) -> QTensor:
    """``t`` quantized as ``spec`` says, along ``axis`` (the GEMM's contraction axis).

    ``spec.granularity`` is relative to ``axis`` (fp8jax.recipes).  FP8
    formats: the online scale from each group's amax (``spec.pow2``,
    ``spec.amax_floor``), or the given ``scale`` layout (a delayed state's
    scale), or the scale from the given per-group ``amax`` (the amax taken
    over a wider group than the layout, such as an expert's tokens).  Block
    formats (MXFP8, NVFP4): the format's own online scales, after the
    Hadamard transform and with stochastic rounding where ``spec`` asks;
    ``seed`` is the recipe's seed for both.
    """
    if not spec.quantized:
        raise ValueError("quantize needs a quantized spec (fmt is None)")
    return SCHEMES[scheme_of(spec.fmt)].quantize(t, spec, axis, scale, amax, seed)


def dequantize(q: QTensor, dtype: Any = jnp.float32) -> jax.Array:
    """The values ``q`` represents, in ``dtype`` (its scheme's dequantizer)."""
    return SCHEMES[q.scheme].dequantize(q, dtype)


def element_scale(q: QTensor) -> jax.Array:
    """float32 scale of each element of ``q`` (broadcastable to its shape; 0: none)."""
    return SCHEMES[q.scheme].element_scale(q)
