"""One FP8 operand's telemetry counts as a Pallas TPU (Mosaic) kernel: x, its codes and its
scales read once each, no per-element scale array in HBM.

:func:`fp8jax.telemetry.operand_stats` reduces, over every element of an
operand, the finite magnitude's bit pattern (max), whether the saturating
cast clipped it and whether its code flushed it to zero (sums).  Each
element's scale is its 1x128 tile's or 128x128 block's.  XLA's TPU compiler
forms those per-element scales as a broadcast reshaped from (rows, groups,
128) to x's shape, a reshape between two tilings, so it writes them to HBM
as float32 and reads them back (the small MoE train step on tpu7x: 1.08 GB
of its 9.77 GB went to deepseek_v3's telemetry, 0.39 GB of 7.48 GB to
bf16's amax).  Here each grid step holds a block of rows in VMEM and
broadcasts each row's scale over its 128-column group there.

The arithmetic is the XLA path's on a TPU, operation for operation, so the
counts are the same integers: the magnitudes' bit patterns of the float32
values (a 16-bit x widened exactly), the quotient of
:func:`fp8jax.scaling.divide_offset` (what :func:`fp8jax.quant.divide_by_scale`
is on a TPU) of the finite elements, clipped where above the threshold and
the scale is positive, flushed where finite, non-zero and its code zero.

Shapes: ``x`` and ``codes`` (R, C), ``row_scales`` float32 (R, ceil(C/128)),
each row's scale for each 128-column group (a block layout's scales repeated
over its rows by the caller).  Padding rows and columns are zeros with unit
scales: a zero adds to no count and raises no max.  ``interpret=True`` runs
Pallas' TPU interpret mode (the tests, on CPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from fp8jax import scaling
from fp8jax.kernels.block_gemm import _pad_to, cdiv, round_up
from fp8jax.kernels.tpu_params import compiler_params
from fp8jax.kernels.tpu_quantize import GROUP, _blocks

#: The int32 tile each grid step writes its partial counts into (the smallest
#: block Mosaic stores): every lane holds the same value, the caller reads one.
_TILE = (8, 128)


def _kernel(x_ref, q_ref, s_ref, bits_ref, clip_ref, flush_ref, *, groups: int, threshold):
    """One block of rows: its max magnitude bits and counts, each 128-column group in turn."""
    bits = jnp.zeros((1, 1), jnp.int32)
    clipped = jnp.zeros((1, 1), jnp.int32)
    flushed = jnp.zeros((1, 1), jnp.int32)
    for t in range(groups):
        cols = slice(t * GROUP, (t + 1) * GROUP)
        # float32: 16-bit values are exact in it, and the order of the
        # magnitudes' bit patterns is the order of the values.
        xf = x_ref[:, cols].astype(jnp.float32)
        raw, inf_bits = scaling._magnitude_bits(xf)
        finite = raw < inf_bits
        # NaN and +-Inf count in no max (scaling.finite_magnitude_bits).
        mag = jnp.where(finite, raw, 0)
        s = jnp.broadcast_to(s_ref[:, t : t + 1], xf.shape)
        # The quantizer's own quotient, of the finite elements only.
        y = scaling.divide_offset(jnp.where(finite, xf, 0.0), s)
        positive = jax.lax.bitcast_convert_type(s, jnp.int32) > 0
        clip = (jnp.abs(y) > threshold) & positive
        # A code's float32 value is exact; it is zero where the code is +-0.
        flush = (mag > 0) & (q_ref[:, cols].astype(jnp.float32) == 0)
        bits = jnp.maximum(bits, jnp.max(mag, keepdims=True))
        clipped = clipped + jnp.sum(clip.astype(jnp.int32), keepdims=True)
        flushed = flushed + jnp.sum(flush.astype(jnp.int32), keepdims=True)
    for ref, value in ((bits_ref, bits), (clip_ref, clipped), (flush_ref, flushed)):
        ref[...] = jnp.broadcast_to(value, _TILE)


@functools.partial(jax.jit, static_argnames=("threshold", "interpret"))
def operand_counts(
    x: jax.Array,
    codes: jax.Array,
    row_scales: jax.Array,
    *,
    threshold: float,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(max finite magnitude bits of float32 x, clipped count, flushed count), int32
    scalars, of a 2-D operand (module docstring); ``threshold``: the format's clip bound
    (:func:`fp8jax.telemetry.clip_threshold`)."""
    if x.ndim != 2 or codes.shape != x.shape:
        raise ValueError(f"x and codes must be the same 2-D shape, got {x.shape}, {codes.shape}")
    r, c = x.shape
    if row_scales.shape != (r, cdiv(c, GROUP)):
        raise ValueError(f"row_scales must be {(r, cdiv(c, GROUP))}, got {row_scales.shape}")
    bm, cp = _blocks(r, c, "row", jnp.dtype(x.dtype).itemsize)
    rp = round_up(r, bm)
    xp = _pad_to(x, (rp, cp), 0)
    qp = _pad_to(codes, (rp, cp), 0)
    # Zeros pad x and the codes (they add to no count); unit scales pad the scales.
    sp = _pad_to(row_scales.astype(jnp.float32), (rp, cp // GROUP), 1.0)
    steps = rp // bm
    tile = jax.ShapeDtypeStruct((steps * _TILE[0], _TILE[1]), jnp.int32)
    out_spec = pl.BlockSpec(_TILE, lambda i: (i, 0))
    rows = pl.BlockSpec((bm, cp), lambda i: (i, 0))
    bits, clipped, flushed = pl.pallas_call(
        functools.partial(_kernel, groups=cp // GROUP, threshold=threshold),
        out_shape=(tile, tile, tile),
        grid=(steps,),
        in_specs=[rows, rows, pl.BlockSpec((bm, cp // GROUP), lambda i: (i, 0))],
        out_specs=(out_spec, out_spec, out_spec),
        compiler_params=None if interpret else compiler_params(("parallel",)),
        cost_estimate=pl.CostEstimate(
            flops=20 * rp * cp,
            transcendentals=0,
            bytes_accessed=rp * cp * (jnp.dtype(x.dtype).itemsize + 1) + sp.size * 4,
        ),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="fp8_operand_telemetry",
    )(xp, qp, sp)
    # One lane of each step's tile: its partial max and counts.
    first = (slice(None, None, _TILE[0]), 0)
    return jnp.max(bits[first]), jnp.sum(clipped[first]), jnp.sum(flushed[first])
