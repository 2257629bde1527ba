"""Blocks past an array's edge in the Pallas TPU kernels, in TPU interpret mode on CPU.

Interpret mode fills what a block reads past the edge with NaN, which every
amax ignores; a TPU leaves there whatever the VMEM buffer held, finite
values as often as not.  So the zeroing is checked here on blocks whose
part past ``valid`` holds large finite values: the kernels see zeros there,
and a quantizer's tiles across that point get the scales of the values
before it alone.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from test_kernels_tpu_quantize import _bits

from fp8jax import quant
from fp8jax.kernels import tpu_edges
from fp8jax.kernels import tpu_quantize as tq

E4M3 = jnp.float8_e4m3fn
INTERPRET = pltpu.InterpretParams()


def _with_far_values_past(valid: int, shape, dtype, axis: int = 1, seed: int = 0) -> np.ndarray:
    """Normal values before ``valid`` along ``axis``, 2^14 times larger after it."""
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    idx = np.arange(shape[axis]).reshape((1, -1) if axis == 1 else (-1, 1))
    return np.where(idx >= valid, 16384.0 * x, x).astype(dtype)


def _zeroed(x: np.ndarray, valid: int, axis: int) -> np.ndarray:
    y = x.copy()
    if axis == 1:
        y[:, valid:] = 0
    else:
        y[valid:, :] = 0
    return y


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, E4M3])
@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("valid", [1, 100, 128, 200, 256])
def test_zero_past_zeroes_the_block_from_valid_on(dtype, axis, valid):
    x = _with_far_values_past(valid, (256, 256), dtype, axis)

    def kernel(x_ref, o_ref):
        tpu_edges.zero_past(x_ref, axis, valid)
        o_ref[...] = x_ref[...]

    got = pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=INTERPRET
    )(x)
    want = _zeroed(x, valid, axis)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8), want.view(np.uint8))


def test_zeroing_acts_at_the_last_grid_step_only():
    # Two column blocks of 128: the first is left as it is, the second zeroed
    # from its 72nd column on.
    x = _with_far_values_past(200, (32, 256), np.float32)

    def copy(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    kernel = tpu_edges.zeroing(copy, (1, 1, tpu_edges.valid_in_last(200, 128)))
    spec = pl.BlockSpec((32, 128), lambda i, j: (i, j))
    got = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(1, 2),
        in_specs=[spec],
        out_specs=spec,
        interpret=INTERPRET,
    )(x)
    np.testing.assert_array_equal(np.asarray(got), _zeroed(x, 200, 1))


@pytest.mark.parametrize(
    "size, block, want", [(2112, 1024, 64), (2048, 1024, None), (576, 640, 576)]
)
def test_valid_in_last(size, block, want):
    assert tpu_edges.valid_in_last(size, block) == want


@pytest.mark.parametrize("orient, axis", [("row", 1), ("block", 1), ("col", 0), ("block", 0)])
def test_a_quantizers_tiles_across_the_edge_take_the_values_inside_alone(orient, axis):
    # The quantizer's kernel body as quantize_2d wraps it, on one block of 256 x
    # 256 whose columns (rows) from 200 on stand for what a TPU's VMEM may hold
    # past an array of 200: the tiles (or blocks) across column (row) 200 get the
    # scales of quant.quantize on the 200 columns (rows).
    valid = 200
    x = _with_far_values_past(valid, (256, 256), jnp.bfloat16, axis)
    kw = dict(fmt=jnp.dtype(E4M3), pow2=False, amax_floor=0.0, ue8m0=False)
    if orient == "row":
        body = functools.partial(tq.row_kernel, groups=2, **kw)
        s_shape = (256, 2)
    elif orient == "col":
        body = functools.partial(tq.col_kernel, groups=2, **kw)
        s_shape = (2, 256)
    else:
        body = functools.partial(tq.block_kernel, groups=2, col_groups=2, **kw)
        s_shape = (2, 256)
    kernel = tpu_edges.zeroing(body, (0, axis, valid))
    codes, scales = pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct(x.shape, E4M3),
            jax.ShapeDtypeStruct(s_shape, jnp.float32),
        ),
        grid=(1,),
        in_specs=[pl.BlockSpec(x.shape, lambda i: (0, 0))],
        out_specs=(
            pl.BlockSpec(x.shape, lambda i: (0, 0)),
            pl.BlockSpec(s_shape, lambda i: (0, 0)),
        ),
        interpret=INTERPRET,
    )(x)
    inside = x[:, :valid] if axis == 1 else x[:valid]
    granularity = "block" if orient == "block" else "tile"
    want = quant.quantize(jnp.asarray(inside), E4M3, granularity, axis=-1 if orient == "row" else 0)
    if orient == "block":
        scales = scales[:, ::128]
    codes = codes[:, :valid] if axis == 1 else codes[:valid]
    if orient != "row" and axis == 1:
        scales = scales[:, : want.scale.shape[1]]
    np.testing.assert_array_equal(_bits(codes), _bits(want.data))
    np.testing.assert_array_equal(_bits(scales[: want.scale.shape[0]]), _bits(want.scale))


@pytest.mark.parametrize("orient", tq.ORIENTS)
def test_the_quantizers_edges_reach_every_block_across_them(orient):
    # x of 200 x 200 in 128 x 256 blocks (row: whole rows), two row blocks, as
    # quantize_2d zeroes them (tq.edges): an array of 256 x 256 whose rows and
    # columns from 200 on hold large values stands for the VMEM past x's edges.
    # Every row block's 1x128 tiles cross column 200, the last row block's 128x1
    # tiles row 200, and the 128x128 blocks both.
    valid, bm, bn = 200, 128, 256
    x = _with_far_values_past(valid, (256, 256), jnp.bfloat16, 1)
    x = np.where(np.arange(256)[:, None] >= valid, x * 16384, x).astype(x.dtype)
    kw = dict(fmt=jnp.dtype(E4M3), pow2=False, amax_floor=0.0, ue8m0=False)
    body = {
        "row": functools.partial(tq.row_kernel, groups=2, **kw),
        "col": functools.partial(tq.col_kernel, groups=1, **kw),
        "block": functools.partial(tq.block_kernel, groups=1, col_groups=2, **kw),
    }[orient]
    kernel = tpu_edges.zeroing(body, *tq.edges(orient, valid, valid, bm, bn))
    s_block = (bm, 2) if orient == "row" else (1, bn)
    codes, scales = pl.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct(x.shape, E4M3),
            jax.ShapeDtypeStruct(
                (256, 2) if orient == "row" else (2, 256),
                jnp.float32,
            ),
        ),
        grid=(2, 1),
        in_specs=[pl.BlockSpec((bm, bn), lambda i, j: (i, j))],
        out_specs=(
            pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
            pl.BlockSpec(s_block, lambda i, j: (i, j)),
        ),
        interpret=INTERPRET,
    )(x)
    granularity, axis = {"row": ("tile", -1), "col": ("tile", 0), "block": ("block", -1)}[orient]
    want = quant.quantize(jnp.asarray(x[:valid, :valid]), E4M3, granularity, axis=axis)
    if orient == "block":
        scales = scales[:, ::128]
    np.testing.assert_array_equal(_bits(codes[:valid, :valid]), _bits(want.data))
    got_s = scales[: want.scale.shape[0], : want.scale.shape[1]]
    np.testing.assert_array_equal(_bits(got_s), _bits(want.scale))
