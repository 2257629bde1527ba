"""Grouped (MoE contiguous layout) block-scaled FP8 GEMM vs a float64 numpy oracle."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_kernels_block_gemm import (
    U32,
    U_BF16,
    dequant_blocks,
    dequant_rows,
    fp8,
    scales,
    tensor_core_tolerance,
)

from fp8jax.kernels import availability
from fp8jax.kernels import grouped_block_gemm as gg


def cdiv(a, b):
    return -(-a // b)


def make_grouped(seed, m, k, n, group_sizes):
    rng = np.random.default_rng(seed)
    e = len(group_sizes)
    a, b = fp8(rng, (m, k)), fp8(rng, (e, k, n))
    sa = scales(rng, (m, cdiv(k, 128)))
    sb = scales(rng, (e, cdiv(k, 128), cdiv(n, 128)))
    return a, sa, b, sb, np.asarray(group_sizes, np.int32)


def grouped_oracle(a, sa, b, sb, group_sizes):
    """float64 result: row m uses expert e(m); rows past sum(group_sizes) are zero."""
    m, n = a.shape[0], b.shape[2]
    a64 = dequant_rows(a, sa)
    ref, mag = np.zeros((m, n)), np.zeros((m, n))
    start = 0
    for e, g in enumerate(group_sizes):
        if g:
            b64 = dequant_blocks(b[e], sb[e])
            ref[start : start + g] = a64[start : start + g] @ b64
            mag[start : start + g] = np.abs(a64[start : start + g]) @ np.abs(b64)
        start += g
    return ref, mag


def assert_grouped_close(got, a, sa, b, sb, gs, out_dtype, tensor_core=False):
    ref, mag = grouped_oracle(a, sa, b, sb, gs)
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    assert got.shape == ref.shape
    if tensor_core:
        tol = tensor_core_tolerance(mag, ref, out_dtype)
    else:
        k = a.shape[1]
        tol = (k + 3 * cdiv(k, 128) + 4) * U32 * mag
        if jnp.dtype(out_dtype) == jnp.bfloat16:
            tol = tol + U_BF16 * np.abs(ref)
    err = np.abs(got - ref)
    assert np.all(err <= tol), f"max err/tol {np.max(err / (tol + 1e-300)):.3g}"
    # Rows that belong to no expert are exactly zero.
    assert np.all(got[int(np.sum(gs)) :] == 0)


# group sizes: ragged, an empty expert, rows left over past sum(group_sizes)
CASES = [
    (50, 200, 136, [7, 0, 30, 5]),
    (40, 256, 128, [16, 24]),
    (33, 130, 40, [0, 0, 20]),
]


@pytest.mark.parametrize(
    "m,k,n,gs,out_dtype",
    [
        pytest.param(*CASES[0], jnp.bfloat16, marks=pytest.mark.slow),
        (*CASES[0], jnp.float32),
        (*CASES[2], jnp.float32),
    ],
)
def test_grouped_kernel_matches_float64(m, k, n, gs, out_dtype):
    a, sa, b, sb, gs = make_grouped(m + k, m, k, n, gs)
    got = gg.grouped_block_scaled_matmul(a, sa, b, sb, gs, out_dtype=out_dtype, interpret=True)
    assert got.dtype == jnp.dtype(out_dtype)
    assert_grouped_close(got, a, sa, b, sb, gs, out_dtype)


def test_grouped_kernel_nk_layout_under_jit():
    a, sa, b, sb, gs = make_grouped(4, 45, 260, 150, [9, 20, 0, 11])
    bt, sbt = (
        np.ascontiguousarray(b.transpose(0, 2, 1)),
        np.ascontiguousarray(sb.transpose(0, 2, 1)),
    )
    f = jax.jit(
        lambda *xs: gg.grouped_block_scaled_matmul(
            *xs, out_dtype=jnp.float32, b_layout="nk", interpret=True
        )
    )
    assert_grouped_close(f(a, sa, bt, sbt, gs), a, sa, b, sb, gs, jnp.float32)


def test_grouped_reference_matches_float64():
    m, k, n, gs = CASES[0]
    a, sa, b, sb, gs = make_grouped(8, m, k, n, gs)
    got = gg.grouped_block_scaled_matmul_reference(a, sa, b, sb, gs, out_dtype=jnp.float32)
    assert_grouped_close(got, a, sa, b, sb, gs, jnp.float32)


def test_aligned_entry_point_skips_padding_tiles():
    a, sa, b, sb, _ = make_grouped(2, 512, 128, 128, [0, 0])
    block_group = np.array([1, -1, 0, -1], np.int32)
    got = np.asarray(
        gg.grouped_block_scaled_matmul_aligned(
            a, sa, b, sb, block_group, out_dtype=jnp.float32, interpret=True
        )
    )
    # tiles 0 and 2 use experts 1 and 0; tiles 1 and 3 are zeros
    a64 = dequant_rows(a, sa)
    for t, e in enumerate(block_group):
        rows = slice(128 * t, 128 * (t + 1))
        if e < 0:
            assert np.all(got[rows] == 0)
        else:
            ref = a64[rows] @ dequant_blocks(b[e], sb[e])
            np.testing.assert_allclose(got[rows], ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max())


def test_grouped_bad_inputs_raise():
    a, sa, b, sb, gs = make_grouped(0, 32, 128, 128, [16, 16])
    with pytest.raises(ValueError, match="group_sizes"):
        gg.grouped_block_scaled_matmul(a, sa, b, sb, gs[:1], interpret=True)
    with pytest.raises(ValueError, match="b_scale"):
        gg.grouped_block_scaled_matmul(a, sa, b, sb[:1], gs, interpret=True)
    with pytest.raises(ValueError, match="multiple of 128"):
        gg.grouped_block_scaled_matmul_aligned(
            a[:30], sa[:30], b, sb, np.zeros(1, np.int32), interpret=True
        )


@pytest.mark.gpu
@pytest.mark.skipif(not availability.hopper_gpu(), reason="needs a Hopper+ NVIDIA GPU")
@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_gpu_grouped_kernel_matches_float64(layout):
    a, sa, b, sb, gs = make_grouped(7, 1000, 512, 384, [300, 0, 129, 500, 1])
    if layout == "nk":
        b_in, sb_in = b.transpose(0, 2, 1).copy(), sb.transpose(0, 2, 1).copy()
    else:
        b_in, sb_in = b, sb
    got = gg.grouped_block_scaled_matmul(
        a, sa, b_in, sb_in, gs, out_dtype=jnp.bfloat16, b_layout=layout, interpret=False
    )
    assert_grouped_close(got, a, sa, b, sb, gs, jnp.bfloat16, tensor_core=True)


# ----------------------------------------------------------------------------
# Wgrad over expert-aligned token tiles
# ----------------------------------------------------------------------------


def make_token_tiles(seed, tiles, m, n):
    """FP8 codes of x and dy in 128-token tiles, with one scale per tile and column."""
    rng = np.random.default_rng(seed)
    a, b = fp8(rng, (tiles, 128, m)), fp8(rng, (tiles, 128, n))
    return a, scales(rng, (tiles, 1, m)), b, scales(rng, (tiles, 1, n))


def wgrad_oracle(a, sa, b, sb, tile_group, num_groups):
    """float64 dw[e] = sum of x_t^T dy_t over expert e's tiles, and its magnitude bound."""
    a64 = np.asarray(a, np.float64) * np.asarray(sa, np.float64)
    b64 = np.asarray(b, np.float64) * np.asarray(sb, np.float64)
    shape = (num_groups, a.shape[2], b.shape[2])
    ref, mag = np.zeros(shape), np.zeros(shape)
    for t, g in enumerate(tile_group):
        if g >= 0:
            ref[g] += a64[t].T @ b64[t]
            mag[g] += np.abs(a64[t]).T @ np.abs(b64[t])
    return ref, mag


#: Each tile's expert (4 experts): empty experts, one padding tile; the last
#: expert only; no tokens at all (every expert's Wgrad is zero).
WGRAD_TILE_GROUPS = [[0, 0, 2, 2, 2, -1], [3, 3, 3], [-1, -1]]


@pytest.mark.parametrize("tile_group", WGRAD_TILE_GROUPS)
def test_grouped_wgrad_matches_float64(tile_group):
    # Odd M and N (padded blocks), empty experts, one run or several per expert.
    num_groups = 4
    a, sa, b, sb = make_token_tiles(len(tile_group), len(tile_group), 200, 300)
    tg = jnp.asarray(tile_group, jnp.int32)
    got = np.asarray(gg.grouped_wgrad(a, sa, b, sb, tg, num_groups, interpret=True))
    ref, mag = wgrad_oracle(a, sa, b, sb, tile_group, num_groups)
    assert got.shape == ref.shape and got.dtype == np.float32
    # Each run's float32 partial, its promotion and one float32 add per run.
    runs = max(1, max(tile_group.count(g) for g in range(num_groups)))
    np.testing.assert_array_less(np.abs(got - ref), (128 + 3 * runs + 4) * U32 * mag + 1e-30)
    assert not got[[g for g in range(num_groups) if g not in tile_group]].any()


def test_grouped_wgrad_equals_the_per_tile_path_under_jit():
    # Against the path it replaces: the batched kernel per tile (each run
    # promoted alone), the tiles of an expert added in tile order.  The kernel
    # promotes each run into the running sum, an FMA where the compiler forms
    # one: the same values up to one rounding per run.
    from fp8jax.groups import sum_tiles
    from fp8jax.kernels.block_gemm import batched_matmul_nt

    tg = jnp.asarray([0, 1, 1, 3, -1], jnp.int32)
    a, sa, b, sb = make_token_tiles(7, 5, 256, 384)
    run = jax.jit(lambda *xs: gg.grouped_wgrad(*xs, 4, out_dtype=jnp.bfloat16, interpret=True))
    got = run(a, sa, b, sb, tg)
    per_tile = batched_matmul_nt(
        jnp.swapaxes(a, 1, 2),
        jnp.swapaxes(sa, 1, 2),
        jnp.swapaxes(b, 1, 2),
        sb,
        b_cols=True,
        out_dtype=jnp.float32,
        interpret=True,
    )
    want = sum_tiles(per_tile, type("Layout", (), {"tile_group": tg})(), 4).astype(jnp.bfloat16)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        np.asarray(got, np.float64), np.asarray(want, np.float64), rtol=2 * U_BF16, atol=0
    )


def test_expert_runs_are_each_experts_consecutive_tiles():
    start, count = gg.expert_runs(jnp.asarray([0, 0, 2, 2, 2, 4, -1, -1]), 5)
    np.testing.assert_array_equal(start, [0, 2, 2, 5, 5])
    np.testing.assert_array_equal(count, [2, 0, 3, 0, 1])


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(a=jnp.zeros((2, 64, 128), jnp.float8_e4m3fn)), "tiles"),
        (dict(tg=jnp.zeros((3,), jnp.int32)), "tile_group"),
        (dict(sa=jnp.ones((2, 128), jnp.float32)), "a_scale"),
        (dict(b=jnp.zeros((2, 128, 128), jnp.bfloat16)), "b_data"),
        (dict(out_dtype=jnp.float16), "out_dtype"),
    ],
)
def test_grouped_wgrad_bad_inputs_raise(change, match):
    args = dict(
        a=jnp.zeros((2, 128, 128), jnp.float8_e4m3fn),
        sa=jnp.ones((2, 1, 128), jnp.float32),
        b=jnp.zeros((2, 128, 128), jnp.float8_e4m3fn),
        sb=jnp.ones((2, 1, 128), jnp.float32),
        tg=jnp.zeros((2,), jnp.int32),
        out_dtype=jnp.float32,
    )
    args.update(change)
    with pytest.raises((ValueError, TypeError), match=match):
        gg.grouped_wgrad(
            args["a"],
            args["sa"],
            args["b"],
            args["sb"],
            args["tg"],
            1,
            out_dtype=args["out_dtype"],
            interpret=True,
        )
