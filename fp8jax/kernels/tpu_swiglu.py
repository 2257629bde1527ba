"""SwiGLU's backward from its FP8-cached input as one Pallas TPU (Mosaic) kernel: the codes,
their scales and the output's cotangent read once each, the input's cotangent written once.

DeepSeek-V3 caches the SwiGLU input ``h`` = (gate, up) in FP8 (1x128 tiles
along F) and recomputes SwiGLU from it in the backward pass
(:func:`fp8jax.models.moe.swiglu`).  The backward is the gradient of
silu(gate) * up at the dequantized ``h``: on a TPU, XLA's compiler forms the
per-element scales of :func:`fp8jax.quant.dequantize` as a broadcast
reshaped from (rows, groups, 128) to h's shape, a reshape between two
tilings, and writes them (and the float32 ``h``) to HBM before the gradient
reads them back.  Here each grid step holds a block of rows in VMEM,
broadcasts each row's scale over its 128-column group there, and writes the
gradient in h's dtype.

The arithmetic is the XLA path's on a TPU, operation for operation:
each code times its scale in float32 (the plain product, or the product on
the bit patterns, :func:`fp8jax.scaling.exact_product`, for every element
when any scale of the cache is subnormal, which flush-to-zero would zero),
then ``jax.vjp`` of silu(gate) * up in float32 at those values, cast to h's
dtype.  In Pallas' interpret mode (``interpret=True``, the tests, on CPU)
the results are the XLA path's bits; compiled by Mosaic, the logistic
function is Mosaic's, so the last bits of the gate's gradient may differ
from XLA's TPU lowering of the same expression.

Shapes: ``codes`` (R, 2, F) with F a multiple of 128 (the caller pads), its
float32 ``scales`` (R, 2, F/128), the cotangent ``g`` (R, F) in any float
dtype; the result (R, 2, F).  Padding rows are zero codes with unit scales:
their gradient is zero, and cropped.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from fp8jax.kernels.block_gemm import _pad_to, round_up
from fp8jax.kernels.tpu_params import compiler_params
from fp8jax.kernels.tpu_quantize import GROUP, _blocks, dequantize_group, subnormal_flag


def silu_times(gate: jax.Array, up: jax.Array) -> jax.Array:
    """silu(gate) * up: the SwiGLU whose gradient the kernel takes (float32 operands)."""
    return jax.nn.silu(gate) * up


def _kernel(q_ref, s_ref, g_ref, flag_ref, dh_ref, *, groups: int, fmt):
    """One block of rows: the gate's and up's gradients, one 128-column group at a time."""
    subnormal = flag_ref[0:1, 0:1] != 0
    f = groups * GROUP
    for t in range(groups):
        gate = slice(t * GROUP, (t + 1) * GROUP)
        up = slice(f + t * GROUP, f + (t + 1) * GROUP)
        a = dequantize_group(q_ref[:, gate], s_ref[:, t : t + 1], subnormal, fmt)
        b = dequantize_group(q_ref[:, up], s_ref[:, groups + t : groups + t + 1], subnormal, fmt)
        _, vjp = jax.vjp(silu_times, a, b)
        # The cotangent in float32 (exact from any narrower float).
        da, db = vjp(g_ref[:, gate].astype(jnp.float32))
        # h's dtype, the gradient the XLA path returns.  Its gradient of h sums
        # the halves' cotangents, each zero-padded to h's shape, so its zeros
        # are +0 (-0 + +0): the same here, by a select (a compiler may fold
        # an addition of zero away).
        dh_ref[:, gate] = _positive_zero(da).astype(dh_ref.dtype)
        dh_ref[:, up] = _positive_zero(db).astype(dh_ref.dtype)


def _positive_zero(x: jax.Array) -> jax.Array:
    return jnp.where(x == 0, jnp.float32(0.0), x)


@functools.partial(jax.jit, static_argnames=("dtype", "interpret"))
def swiglu_grad(
    codes: jax.Array,
    scales: jax.Array,
    g: jax.Array,
    subnormal: jax.Array,
    *,
    dtype,
    interpret: bool = False,
) -> jax.Array:
    """The cotangent of ``h`` (R, 2, F), in ``dtype``, of silu(gate) * up at the dequantized
    FP8 ``codes`` of ``h`` (module docstring) for the output cotangent ``g`` (R, F).

    ``subnormal``: bool scalar, whether any scale of the cache is subnormal
    (quant.dequantize's choice for the whole tensor).
    """
    if codes.ndim != 3 or codes.shape[1] != 2 or codes.shape[2] % GROUP:
        raise ValueError(f"codes must be (R, 2, F), F a multiple of {GROUP}, got {codes.shape}")
    r, _, f = codes.shape
    groups = f // GROUP
    if scales.shape != (r, 2, groups) or g.shape != (r, f):
        raise ValueError(
            f"scales must be {(r, 2, groups)} and g {(r, f)}, got {scales.shape}, {g.shape}"
        )
    # Rows per step as for the 1x128 quantizer of the cotangent's width in
    # float32, the widest of the block's arrays.
    bm, _ = _blocks(r, 2 * f, "row", 4)
    rp = round_up(r, bm)
    # Zero codes pad the rows (their gradient is zero); unit scales theirs.
    qp = _pad_to(codes.reshape(r, 2 * f), (rp, 2 * f), 0)
    sp = _pad_to(scales.astype(jnp.float32).reshape(r, 2 * groups), (rp, 2 * groups), 1.0)
    gp = _pad_to(g, (rp, f), 0)
    flag = subnormal_flag(subnormal)
    rows = pl.BlockSpec((bm, 2 * f), lambda i: (i, 0))
    out_dtype = jnp.dtype(dtype)
    dh = pl.pallas_call(
        functools.partial(_kernel, groups=groups, fmt=jnp.dtype(codes.dtype)),
        out_shape=jax.ShapeDtypeStruct((rp, 2 * f), out_dtype),
        grid=(rp // bm,),
        in_specs=[
            rows,
            pl.BlockSpec((bm, 2 * groups), lambda i: (i, 0)),
            pl.BlockSpec((bm, f), lambda i: (i, 0)),
            pl.BlockSpec((8, GROUP), lambda i: (0, 0)),
        ],
        out_specs=rows,
        compiler_params=None if interpret else compiler_params(("parallel",)),
        cost_estimate=pl.CostEstimate(
            flops=20 * rp * f,
            transcendentals=rp * f,
            bytes_accessed=rp * 2 * f * (1 + out_dtype.itemsize)
            + sp.size * 4
            + gp.size * jnp.dtype(g.dtype).itemsize,
        ),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="fp8_swiglu_grad",
    )(qp, sp, gp, flag)
    return dh[:r].reshape(r, 2, f)
