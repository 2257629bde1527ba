"""The Mosaic TPU block-scaled GEMM in Pallas' TPU interpret mode on CPU, and compiled for
TPU topologies through libtpu (where libtpu is installed).

Against the float64 oracle of ``test_kernels_block_gemm`` and the plain-jnp
references beside the Triton kernels (the same runs and promotion order; a
run's 128 products may be summed in another float32 order, so they agree to
float32 summation-order differences).
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_kernels_block_gemm import E4M3, E5M2, assert_close, fp8, make_case, scales
from test_kernels_grouped_block_gemm import (
    WGRAD_TILE_GROUPS,
    assert_grouped_close,
    make_grouped,
    make_token_tiles,
    wgrad_oracle,
)
from test_kernels_tpu_quantize import kernel_equations

from fp8jax.groups import group_layout
from fp8jax.kernels import block_gemm as bg
from fp8jax.kernels import grouped_block_gemm as gg
from fp8jax.kernels import tpu_block_gemm as tg


def assert_near_reference(got, want):
    """Equal up to float32 summation-order differences within a 128-long run."""
    want = np.asarray(want, np.float64)
    atol = 1e-5 * np.max(np.abs(want))
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-5, atol=atol)


# Small blocks so that tiny shapes still have several tiles in M and N.
SMALL = dict(block_m=128, block_n=128, interpret=True)

# (M, K, N): odd M and N (padding), one run, several runs in one K step,
# more runs than one step holds (9 runs: three K steps of 3, their scales
# padded to a tile of 8 rows).
SHAPES = [(37, 300, 200), (130, 128, 129), (20, 1100, 70)]


@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_fprop_matches_float64_and_the_reference(m, k, n, dtype):
    a, sa, b, sb = make_case(m + k + n, m, k, n, dtype)
    got = tg.block_scaled_matmul(a, sa, b, sb, out_dtype=jnp.float32, **SMALL)
    assert_close(got, a, sa, b, sb, jnp.float32)
    assert_near_reference(
        got, bg.block_scaled_matmul_reference(a, sa, b, sb, out_dtype=jnp.float32)
    )


@pytest.mark.parametrize("m,k,n", SHAPES[:2])
def test_dgrad_layout_matches_float64(m, k, n):
    a, sa, b, sb = make_case(3 + m, m, k, n)
    bt, sbt = np.ascontiguousarray(b.T), np.ascontiguousarray(sb.T)
    got = tg.block_scaled_matmul_nt(a, sa, bt, sbt, out_dtype=jnp.bfloat16, **SMALL)
    assert got.dtype == jnp.bfloat16
    assert_close(got, a, sa, b, sb, jnp.bfloat16)


@pytest.mark.parametrize("m,k,n", [(70, 300, 45), (200, 1100, 130)])
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_wgrad_layout_matches_float64(m, k, n, dtype):
    # K (the tokens) contracted, 128x1 tiles along it on both operands.
    rng = np.random.default_rng(k + n)
    kc = bg.cdiv(k, 128)
    at, b = fp8(rng, (k, m), dtype), fp8(rng, (k, n), dtype)
    sat, sb = scales(rng, (kc, m)), scales(rng, (kc, n))
    got = tg.block_scaled_matmul_tn(at, sat, b, sb, out_dtype=jnp.float32, **SMALL)
    # float64: the per-column scales of b are 128x1 tiles, not blocks.
    a64 = at.T.astype(np.float64) * np.repeat(sat.T.astype(np.float64), 128, axis=1)[:, :k]
    b64 = b.astype(np.float64) * np.repeat(sb.astype(np.float64), 128, axis=0)[:k]
    ref, mag = a64 @ b64, np.abs(a64) @ np.abs(b64)
    tol = (k + 3 * kc + 4) * 2.0**-24 * mag + 1e-30
    assert np.all(np.abs(np.asarray(got, np.float64) - ref) <= tol)
    assert_near_reference(
        got, bg.block_scaled_matmul_tn_reference(at, sat, b, sb, out_dtype=jnp.float32)
    )


def _assert_same_bits(got, want) -> None:
    """Each array of ``got`` holds ``want``'s bits (compared as unsigned integers)."""
    for g, w in zip(got, want, strict=True):
        g, w = np.asarray(g), np.asarray(w)
        assert g.dtype == w.dtype and g.shape == w.shape
        bits = np.dtype(f"uint{8 * g.dtype.itemsize}")
        np.testing.assert_array_equal(g.view(bits), w.view(bits))


@pytest.mark.parametrize(
    "m, k, n, dtype, block_n, opts",
    [
        (300, 260, 130, jnp.float32, 128, {}),
        (200, 1100, 300, jnp.bfloat16, 128, dict(pow2=True, ue8m0=True)),
        (37, 300, 200, jnp.float32, 256, dict(amax_floor=1e-4)),
    ],
)
def test_fprop_quantizing_its_x_gives_the_quantizers_bits(m, k, n, dtype, block_n, opts):
    # x quantized in the kernel: its codes and scales are the row quantizer's,
    # and the product the plain Fprop kernel's of them, bit for bit.  A tiny
    # row (subnormal scale, the offset division), padding in M, K and N, two
    # K steps (1100), and two or three column blocks, each quantizing x again
    # (only the first writes its codes).
    from fp8jax import quant
    from fp8jax.kernels import tpu_quantize as tq

    rng = np.random.default_rng(m + k)
    x = rng.standard_normal((m, k)) * np.exp(2 * rng.standard_normal((m, 1)))
    x[3] *= 1e-39
    x = jnp.asarray(x, dtype)
    w = quant.quantize(jnp.asarray(rng.standard_normal((k, n)), jnp.float32), E4M3, "block")
    kw = dict(block_m=128, block_n=block_n, interpret=True, out_dtype=jnp.float32)
    codes, row_scales = tq.quantize_2d(x, fmt=E4M3, orient="row", interpret=True, **opts)
    want = tg.block_scaled_matmul(codes, row_scales, w.data, w.scale, **kw)

    def fused(x, b, sb):
        return tg.block_scaled_matmul_quantizing(x, b, sb, fmt=E4M3, **opts, **kw)

    for f in (fused, jax.jit(fused)):
        _assert_same_bits(f(x, w.data, w.scale), (want, codes, row_scales))


@pytest.mark.parametrize(
    "m, k, n, dtype, block_n, opts",
    [
        (300, 260, 130, jnp.bfloat16, 128, {}),
        (200, 1100, 300, jnp.float32, 128, dict(pow2=True, ue8m0=True)),
        (37, 300, 200, jnp.bfloat16, 256, dict(amax_floor=1e-4)),
    ],
)
def test_dgrad_quantizing_its_dy_gives_the_quantizers_bits(m, k, n, dtype, block_n, opts):
    # dy (m, k), k the contraction, quantized in the kernel: the product is the
    # plain Dgrad kernel's of the row quantizer's codes and scales, bit for
    # bit.  A tiny row (subnormal scale), padding in M, K and N, two K steps
    # (1100), and one to three column blocks, each quantizing dy again.
    from fp8jax import quant
    from fp8jax.kernels import tpu_quantize as tq

    rng = np.random.default_rng(m + k + 1)
    dy = rng.standard_normal((m, k)) * np.exp(2 * rng.standard_normal((m, 1)))
    dy[3] *= 1e-39
    dy = jnp.asarray(dy, dtype)
    # W (n, k) as the Dgrad reads it: 128x128 blocks over (n, k).
    w = quant.quantize(jnp.asarray(rng.standard_normal((n, k)), jnp.float32), E4M3, "block")
    kw = dict(block_m=128, block_n=block_n, interpret=True, out_dtype=jnp.float32)
    codes, row_scales = tq.quantize_2d(dy, fmt=E4M3, orient="row", interpret=True, **opts)
    want = tg.block_scaled_matmul_nt(codes, row_scales, w.data, w.scale, **kw)
    # The float64 oracle on the codes and scales as numpy arrays.
    ours = [np.asarray(t) for t in (codes, row_scales, w.data, w.scale)]
    assert_close(want, ours[0], ours[1], ours[2].T, ours[3].T, jnp.float32)

    def fused(dy, bt, sbt):
        return tg.block_scaled_matmul_nt_quantizing(dy, bt, sbt, fmt=E4M3, **opts, **kw)

    for f in (fused, jax.jit(fused)):
        _assert_same_bits((f(dy, w.data, w.scale),), (want,))


@pytest.mark.parametrize(
    "m, k, n, block_m, opts",
    [
        (300, 260, 130, 128, {}),
        (1100, 1100, 300, 1024, dict(pow2=True, ue8m0=True)),
        (37, 300, 200, None, dict(amax_floor=1e-4)),
    ],
)
def test_dgrad_quantizing_writes_dys_column_tiles_bits(m, k, n, block_m, opts):
    # From the same read of dy the kernel also writes its 128-token tiles (the
    # Wgrad's operand): the column quantizer's codes and scales, bit for bit,
    # and the product unchanged.  A tiny row (subnormal scale), a column of
    # zeros, NaN, +-Inf and a value past every FP8 range, padding in M and K,
    # two K steps (1100), two row blocks of 640 (five rows of scales each,
    # stored padded to eight).
    from fp8jax import quant
    from fp8jax.kernels import tpu_quantize as tq

    rng = np.random.default_rng(m + k + 7)
    dy = rng.standard_normal((m, k)) * np.exp(2 * rng.standard_normal((1, k)))
    dy[3] *= 1e-39
    dy[:, 5] = 0.0
    dy[0, 1], dy[1, 0], dy[2, 2], dy[6, 7] = np.nan, np.inf, -np.inf, 3e38
    dy = jnp.asarray(dy, jnp.bfloat16)
    w = quant.quantize(jnp.asarray(rng.standard_normal((n, k)), jnp.float32), E4M3, "block")
    kw = dict(block_m=block_m, block_n=384, interpret=True, out_dtype=jnp.bfloat16)
    want = tg.block_scaled_matmul_nt_quantizing(dy, w.data, w.scale, fmt=E4M3, **opts, **kw)
    # The column quantizer (tested against quant.quantize in its own tests).
    col_codes, col_scales = tq.quantize_2d(dy, fmt=E4M3, orient="col", interpret=True, **opts)

    def fused(dy, bt, sbt):
        return tg.block_scaled_matmul_nt_quantizing(
            dy, bt, sbt, fmt=E4M3, col_codes=True, **opts, **kw
        )

    for f in (fused, jax.jit(fused)):
        got = f(dy, w.data, w.scale)
        assert got[1].shape == (m, k) and got[2].shape == (-(-m // 128), k)
        _assert_same_bits(got, (want, col_codes, col_scales))


def test_dgrad_column_tiles_need_one_column_block():
    from fp8jax import quant

    w = quant.quantize(jnp.ones((512, 256)), E4M3, "block")
    dy = jnp.ones((128, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match="one column block"):
        tg.block_scaled_matmul_nt_quantizing(
            dy, w.data, w.scale, fmt=E4M3, col_codes=True, block_n=256, interpret=True
        )


@pytest.mark.parametrize("n, itemsize, want", [(1536, 2, True), (4096, 2, False), (1536, 4, False)])
def test_dgrad_quantizes_in_kernel_where_that_reads_no_more(n, itemsize, want):
    # dy's column quantizer reads it anyway: one column block of bfloat16 dy
    # costs its two bytes, as its codes' write and read did.
    assert tg.quantizing_reads_less(n, itemsize, codes_only_here=True) == want


def test_fprop_quantizing_refuses_other_operands():
    from fp8jax import quant

    w = quant.quantize(jnp.ones((256, 128)), E4M3, "block")
    fn = functools.partial(tg.block_scaled_matmul_quantizing, fmt=E4M3, interpret=True)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        fn(jnp.ones((4, 256), jnp.float16), w.data, w.scale)
    with pytest.raises(ValueError, match="2-D"):
        fn(jnp.ones((2, 4, 256)), w.data, w.scale)
    with pytest.raises(ValueError):
        fn(jnp.ones((4, 128)), w.data, w.scale)


def _wgrad_of_cache(t, m, n, seed, cache_fmt=E4M3, tiny_row=None):
    """x's FP8 cache (1x128 tiles along its m features, t tokens), its subnormal flag
    and dy's 128-token tiles (n columns)."""
    from fp8jax import quant
    from fp8jax.kernels import tpu_quantize as tq

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((t, m)) * np.exp(2 * rng.standard_normal((t, 1)))
    if tiny_row is not None:
        # A tile of tiny values: a float32-subnormal scale, so every element of
        # the cache is dequantized on the bit patterns.
        x[tiny_row] *= 1e-38
    cached = quant.quantize(jnp.asarray(x, jnp.float32), cache_fmt, "tile", axis=1)
    qdy = quant.quantize(jnp.asarray(rng.standard_normal((t, n)), jnp.float32), E4M3, "tile", 0)
    return cached, tq.subnormal_scales(cached.scale), qdy


@pytest.mark.parametrize(
    "t, m, n, cache_fmt, tiny_row, opts",
    [
        (300, 260, 130, E4M3, None, {}),
        (300, 260, 130, E5M2, 9, {}),
        (1100, 256, 130, E4M3, None, dict(pow2=True, ue8m0=True)),
        (200, 1100, 70, E4M3, 150, dict(amax_floor=1e-4)),
        # 2048 tokens (16 runs) in one K step: the cache requantized once per row
        # block, in a loop over its 16 groups, for three column blocks.
        (2048, 256, 300, E4M3, 900, {}),
    ],
)
def test_wgrad_requantizing_its_cache_gives_the_requantized_operands_bits(
    t, m, n, cache_fmt, tiny_row, opts
):
    # The kernel's requantization in VMEM against the requantizing kernel's
    # codes in HBM fed to the plain Wgrad kernel: the same bits.  Blocks of
    # 128 and 256 columns of the cache (1 and 2 tiles: their scales padded to
    # 8 sublanes), and two of 640 for 1100 (5 tiles each, M padded); tokens
    # padded to whole K steps, two steps for 1100 tokens.
    from fp8jax.kernels import tpu_quantize as tq

    cached, flag, qdy = _wgrad_of_cache(t, m, n, t + m, cache_fmt, tiny_row)
    assert bool(flag) == (tiny_row is not None)
    block_m = {260: 128, 256: 256, 1100: 1024}[m]
    kw = dict(block_m=block_m, block_n=128, interpret=True, out_dtype=jnp.float32)
    codes, col_scales = tq.requantize_col(
        cached.data, cached.scale, flag, fmt=E4M3, interpret=True, **opts
    )
    want = tg.block_scaled_matmul_tn(codes, col_scales, qdy.data, qdy.scale, **kw)

    def fused(*args):
        return tg.block_scaled_matmul_tn_requant(*args, fmt=E4M3, **opts, **kw)

    args = (cached.data, cached.scale, flag, qdy.data, qdy.scale)
    kc = -(-t // 128)
    bm, bn = tg._blocks(m, n, block_m, 128, "tn")
    resident = tg._resident_a_blocks(m, n, kc, bm, bn, "tn", jnp.float32, 128, requant=True)
    assert (resident is not None) == (t == 2048)
    for f in (fused, jax.jit(fused)):
        np.testing.assert_array_equal(
            np.asarray(f(*args)).view(np.uint32), np.asarray(want).view(np.uint32)
        )


def test_kernels_hold_the_code_of_one_slice_and_one_row_of_groups():
    # The K step's runs go through a 2048-row block in a loop over slices of
    # ROWS_PER_DOT rows, and the Wgrad's requantization through its rows of
    # 128 x 128 groups in a loop: the kernels hold about the code of a block
    # of one slice and of one row of groups (unrolled, libtpu compiled the
    # quantizing Fprop of 4096^3 16 s and the requantizing Wgrad 14 s).
    k, n = 1024, 256

    def fprop(m):
        x, b = jnp.zeros((m, k), jnp.bfloat16), jnp.zeros((k, n), E4M3)
        sb = jnp.ones((k // 128, n // 128))
        return kernel_equations(
            lambda x, b, sb: tg.block_scaled_matmul_quantizing(x, b, sb, fmt=E4M3), x, b, sb
        )

    def wgrad(tokens):
        m = 2048
        d, s = jnp.zeros((tokens, m), E4M3), jnp.ones((tokens, m // 128))
        b, sb = jnp.zeros((tokens, n), E4M3), jnp.ones((tokens // 128, n))
        run = functools.partial(tg.block_scaled_matmul_tn_requant, fmt=E4M3)
        return kernel_equations(lambda *a: run(a[0], a[1], jnp.bool_(False), *a[2:]), d, s, b, sb)

    assert fprop(2048) < 1.05 * fprop(tg.ROWS_PER_DOT), (fprop(2048), fprop(tg.ROWS_PER_DOT))
    assert wgrad(1024) < 1.5 * wgrad(128), (wgrad(1024), wgrad(128))


def test_wgrad_of_a_cache_refuses_other_operands():
    cached, flag, qdy = _wgrad_of_cache(256, 256, 128, 0)
    fn = functools.partial(tg.block_scaled_matmul_tn_requant, fmt=E4M3, interpret=True)
    with pytest.raises(ValueError, match="FP8 codes"):
        fn(cached.data.astype(jnp.float32), cached.scale, flag, qdy.data, qdy.scale)
    with pytest.raises(ValueError, match=r"ceil\(M/128\)"):
        fn(cached.data, cached.scale.T, flag, qdy.data, qdy.scale)
    with pytest.raises(ValueError, match="contraction"):
        fn(cached.data, cached.scale, flag, qdy.data[:128], qdy.scale[:1])


def test_default_blocks_clip_to_a_small_operand():
    a, sa, b, sb = make_case(5, 17, 140, 33)
    f = jax.jit(lambda *xs: tg.block_scaled_matmul(*xs, out_dtype=jnp.float32, interpret=True))
    assert_close(f(a, sa, b, sb), a, sa, b, sb, jnp.float32)


@pytest.mark.parametrize(
    "size,block,tile,want",
    [
        (100, 1024, 32, 128),
        (1024, 1024, 32, 1024),
        (1536, 1024, 32, 768),
        (4096, 1024, 128, 1024),
        (7168, 1024, 128, 1024),
        (1100, 1024, 128, 640),
        (2112, 2048, 128, 2176),
        (2200, 2048, 128, 1152),
        (300, 256, 128, 256),
    ],
)
def test_blocks_split_an_axis_into_equal_lane_multiples(size, block, tile, want):
    got = tg._fit(size, block, tile)
    assert got == want
    # At most a sixteenth past the block, and the padding under one 128-lane tile
    # per block.
    blocks = -(-size // got)
    assert got <= block + block // 16
    assert blocks * got - size < 128 * blocks


@pytest.mark.parametrize(
    "kc, runs, want",
    [(5, 8, 5), (8, 8, 8), (9, 8, 3), (12, 8, 6), (13, 8, 7), (16, 8, 8), (56, 8, 8), (20, 8, 5)],
)
def test_k_steps_take_runs_that_divide_k(kc, runs, want):
    # K 1536 (12 runs) in two steps of 6, not padded to 16 runs; 56 runs (K
    # 7168) in steps of 8 as before; 13 runs padded by one.
    assert tg._step_runs(kc, runs) == want
    # The scale block of a step: j rows where legal, else a whole tile of 8.
    assert tg._step_rows(want, bg.round_up(kc, want)) in (want, 8)


@pytest.mark.parametrize("orient", ["nn", "nt", "tn"])
@pytest.mark.parametrize("k", [1536, 1300])
def test_k_steps_of_six_runs_keep_the_values(monkeypatch, orient, k):
    # K 1536: two K steps of 6 runs, each step's scales padded to 8 rows.
    # K 1300: 11 runs in two steps of 6, taken in place: the last step's
    # blocks run past K (its 5th run 20 long, its 6th wholly outside), where
    # interpret mode reads NaN unless the kernel zeroes them.  (Steps kept:
    # no VMEM for all of K in one step, _one_step.)
    monkeypatch.setattr(tg, "ONE_STEP_CODES", 0)
    m, n = 40, 130
    a, sa, b, sb = make_case(k + len(orient), m, k, n)
    kw = dict(block_m=128, block_n=128, interpret=True, out_dtype=jnp.float32)
    if orient == "nn":
        got = tg.block_scaled_matmul(a, sa, b, sb, **kw)
    elif orient == "nt":
        bt, sbt = np.ascontiguousarray(b.T), np.ascontiguousarray(sb.T)
        got = jax.jit(lambda *xs: tg.block_scaled_matmul_nt(*xs, **kw))(a, sa, bt, sbt)
    else:
        # a^T (K, M) with 128x1 tiles along K: the same per-run scales as a's 1x128
        # tiles; b's 128x128 block scales repeated over their 128 columns.
        sbc = np.repeat(sb, 128, axis=1)[:, :n]
        got = tg.block_scaled_matmul_tn(np.ascontiguousarray(a.T), sa.T, b, sbc, **kw)
    assert_close(got, a, sa, b, sb, jnp.float32)


@pytest.mark.parametrize(
    "m, n, k, orient",
    [(4096, 4096, 4096, "nn"), (8192, 8192, 8192, "nt"), (4096, 7168, 2048, "tn")],
)
def test_one_k_step_reads_a_once_where_that_moves_fewer_bytes(m, n, k, orient):
    kc = k // 128
    bm, bn = tg._blocks(m, n, tg.DENSE_BLOCK_M, tg.DENSE_BLOCK_N, orient)
    got = tg._resident_a_blocks(m, n, kc, bm, bn, orient, jnp.bfloat16, 128)
    assert got is not None
    rbm, rbn = got
    assert rbm % 128 == 0 and rbn % 128 == 0

    def moved(bm_, bn_, kp, resident):
        mp, np_ = bg.round_up(m, bm_), bg.round_up(n, bn_)
        est = tg.cost_estimate(mp, np_, kp, bm_, bn_, jnp.bfloat16, resident_a=resident)
        return est.bytes_accessed

    # A once and B once per row block, against A once per column block too.
    assert moved(rbm, rbn, k, True) < moved(bm, bn, k, False)
    # A's block (all of K) once and B's double-buffered fit the planned VMEM.
    assert (rbm + 2 * rbn) * k < tg.RESIDENT_A_VMEM


@pytest.mark.parametrize(
    "m, n, kc, orient",
    # One K step already; 12 runs (not groups of 8); K 65536, whose A block of even
    # 1024 rows (64 MiB) does not fit.
    [(4096, 4096, 8, "nn"), (4096, 24576, 12, "nn"), (4096, 7168, 512, "nt")],
)
def test_k_steps_stay_where_one_step_cannot_hold_k(m, n, kc, orient):
    bm, bn = tg._blocks(m, n, tg.DENSE_BLOCK_M, tg.DENSE_BLOCK_N, orient)
    assert tg._resident_a_blocks(m, n, kc, bm, bn, orient, jnp.bfloat16, 128) is None


@pytest.mark.parametrize("orient", ["nn", "nt", "tn"])
@pytest.mark.parametrize("m, block_m", [(200, 128), (2200, 1024)])
def test_one_k_step_gives_the_k_steps_bits(monkeypatch, orient, m, block_m):
    # K 2048 (16 runs) with 128-wide column blocks: one K step of 16 runs, A
    # copied once per row block and kept across two column blocks, the runs
    # looped in groups of 8, against two K steps of 8: the same products in the
    # same order, so the same bits.  2200 rows: two row blocks (the second's
    # copy starts past the first), each of more than 512 rows, looped in
    # slices of 512 with a shorter last one.
    k, n = 2048, 250
    a, sa, b, sb = make_case(k + len(orient) + m, m, k, n)
    kw = dict(block_m=block_m, block_n=128, interpret=True, out_dtype=jnp.float32)
    kc = k // 128
    bm, bn = tg._blocks(m, n, block_m, 128, orient)
    resident = tg._resident_a_blocks(m, n, kc, bm, bn, orient, jnp.float32, 128)
    assert resident is not None
    assert m < 512 or (resident[0] % tg.ROWS_PER_DOT and bg.cdiv(m, resident[0]) == 2)
    if orient == "nn":
        args, f = (a, sa, b, sb), tg.block_scaled_matmul
    elif orient == "nt":
        args, f = (
            (a, sa, np.ascontiguousarray(b.T), np.ascontiguousarray(sb.T)),
            (tg.block_scaled_matmul_nt),
        )
    else:
        sbc = np.repeat(sb, 128, axis=1)[:, :n]
        args, f = (np.ascontiguousarray(a.T), sa.T, b, sbc), tg.block_scaled_matmul_tn
    call = functools.partial(f, **kw)
    one_step = jax.jit(call)(*args)
    assert_close(one_step, a, sa, b, sb, jnp.float32)
    monkeypatch.setattr(tg, "_resident_a_blocks", lambda *_: None)
    np.testing.assert_array_equal(np.asarray(call(*args)), np.asarray(one_step))


@pytest.mark.parametrize(
    "kc, bm, bn, want",
    [
        (17, 2048, 1792, True),
        (16, 2048, 1792, False),
        (8, 128, 128, False),
        (17, 4096, 4096, False),
    ],
)
def test_an_unaligned_k_is_one_step_where_its_codes_fit(kc, bm, bn, want):
    # K 2112 (17 runs) by 2048 x 1792 blocks: 15.9 MiB of codes double-buffered;
    # 16 runs are steps of 8 (or the kernel's own copy of A); 4096 x 4096 blocks
    # hold too much.
    assert tg._one_step(kc, 8, bm, bn, 128) == want


@pytest.mark.parametrize("orient", ["nn", "nt", "tn"])
def test_one_step_of_an_unaligned_k_keeps_the_values(orient):
    # K 1300: all 11 runs in one step (A read once per row block), its blocks
    # past K zeroed; jitted around the kernel.
    m, k, n = 72, 1300, 130
    assert tg._one_step(11, 8, *tg._blocks(m, n, 128, 128, orient), 128)
    a, sa, b, sb = make_case(k + m + len(orient), m, k, n)
    kw = dict(block_m=128, block_n=128, interpret=True, out_dtype=jnp.float32)
    if orient == "nn":
        got = jax.jit(lambda *xs: tg.block_scaled_matmul(*xs, **kw))(a, sa, b, sb)
    elif orient == "nt":
        bt, sbt = np.ascontiguousarray(b.T), np.ascontiguousarray(sb.T)
        got = jax.jit(lambda *xs: tg.block_scaled_matmul_nt(*xs, **kw))(a, sa, bt, sbt)
    else:
        sbc = np.repeat(sb, 128, axis=1)[:, :n]
        at = np.ascontiguousarray(a.T)
        got = jax.jit(lambda *xs: tg.block_scaled_matmul_tn(*xs, **kw))(at, sa.T, b, sbc)
    assert_close(got, a, sa, b, sb, jnp.float32)


@pytest.mark.parametrize(
    "n, itemsize, want", [(256, 4, True), (2304, 4, False), (4096, 2, True), (7168, 2, False)]
)
def test_fprop_quantizes_in_kernel_while_it_reads_fewer_bytes(n, itemsize, want):
    # bfloat16 x: up to two column blocks (4096), not four (7168 in blocks of 1792).
    assert tg.quantizing_reads_less(n, itemsize) == want


def test_split_blocks_keep_the_values():
    # 600 rows in blocks of at most 512: two blocks of 384 (not two of 512);
    # 520 rows, a sixteenth past 512 at most: one block of 544; 300 columns in
    # blocks of at most 256: two of 256.
    assert tg._blocks(600, 300, 512, 256, "nn") == (384, 256)
    assert tg._blocks(520, 300, 512, 256, "nn") == (544, 256)
    a, sa, b, sb = make_case(520, 256, 300, 41)
    kw = dict(block_m=512, block_n=256, out_dtype=jnp.float32, interpret=True)
    call = functools.partial(tg.block_scaled_matmul, **kw)
    for f in (call, jax.jit(call)):
        assert_close(f(a, sa, b, sb), a, sa, b, sb, jnp.float32)


@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_rows_in_slices_keep_the_values(monkeypatch, out_dtype):
    # 300 rows in one block of 320, dotted 128 rows at a time (slices of 128,
    # 128 and 64),
    # in all three orientations; a float32 output block is its own accumulator.
    monkeypatch.setattr(tg, "ROWS_PER_DOT", 128)
    m, k, n = 300, 300, 140
    a, sa, b, sb = make_case(7, m, k, n)
    kw = dict(block_m=384, block_n=256, out_dtype=out_dtype, interpret=True)
    assert tg._blocks(m, n, 384, 256, "nn")[0] == 320
    bt, sbt = np.ascontiguousarray(b.T), np.ascontiguousarray(sb.T)
    nn = functools.partial(tg.block_scaled_matmul, **kw)
    nt = functools.partial(tg.block_scaled_matmul_nt, **kw)
    for f in (nn, jax.jit(nn)):
        assert_close(f(a, sa, b, sb), a, sa, b, sb, out_dtype)
    assert_close(nt(a, sa, bt, sbt), a, sa, b, sb, out_dtype)
    # "tn": the same product with A stored (K, M) and 128x1 tiles along K on both sides.
    rng = np.random.default_rng(11)
    at, bk = fp8(rng, (k, m), E4M3), fp8(rng, (k, n), E4M3)
    sat, sbk = scales(rng, (3, m)), scales(rng, (3, n))
    got = tg.block_scaled_matmul_tn(at, sat, bk, sbk, **kw)
    want = bg.block_scaled_matmul_tn_reference(at, sat, bk, sbk, out_dtype=jnp.float32)
    assert got.dtype == out_dtype
    if out_dtype == jnp.float32:
        assert_near_reference(got, want)
    else:
        # One rounding of the float32 sum to bfloat16.
        np.testing.assert_allclose(
            np.asarray(got, np.float64), np.asarray(want, np.float64), rtol=2**-8, atol=1e-30
        )


def _aligned_rows(a, sa, lay):
    """Rows ``a`` and their scales ``sa`` moved to the expert-aligned tiles of ``lay``:
    padding rows zero codes with unit scales."""
    valid = np.asarray(lay.row_valid)[:, None]
    src = np.asarray(lay.src_row)
    a_al = np.where(valid, a[src], np.zeros((), a.dtype))
    return a_al, np.where(valid, sa[src], 1.0).astype(np.float32)


@pytest.mark.parametrize(
    "gs,layout",
    [([70, 0, 100, 20], "kn"), ([0, 130, 0, 0], "nk"), ([5, 0, 0, 1], "kn")],
)
def test_grouped_aligned_matches_float64(gs, layout):
    # Ragged groups, empty experts, rows past sum(gs), tiles of padding only.
    m, k, n = 200, 300, 136
    a, sa, b, sb, gs = make_grouped(sum(gs) + len(gs), m, k, n, gs)
    lay = group_layout(jnp.asarray(gs), m, 128)
    a_al, sa_al = _aligned_rows(a, sa, lay)
    b_in = b if layout == "kn" else np.ascontiguousarray(np.swapaxes(b, 1, 2))
    sb_in = sb if layout == "kn" else np.ascontiguousarray(np.swapaxes(sb, 1, 2))
    y = tg.grouped_block_scaled_matmul_aligned(
        a_al,
        sa_al,
        b_in,
        sb_in,
        lay.tile_group,
        out_dtype=jnp.float32,
        b_layout=layout,
        block_n=128,
        interpret=True,
    )
    padding_tiles = np.asarray(lay.tile_group) < 0
    assert padding_tiles.any()
    assert np.all(np.asarray(y).reshape(lay.num_tiles, 128, n)[padding_tiles] == 0)
    got = jnp.where(lay.in_group[:, None], y[lay.dst_row], 0.0)
    assert_grouped_close(got, a, sa, b, sb, gs, jnp.float32)
    assert_near_reference(
        got, gg.grouped_block_scaled_matmul_reference(a, sa, b, sb, gs, out_dtype=jnp.float32)
    )


@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_grouped_one_k_step_equals_steps_of_runs(layout):
    # All of K's 16 runs in one step (an expert's consecutive tiles sharing its
    # weight block) against steps of 8: the same runs in the same order, so the
    # same bits; an empty expert and a tile of padding between them.
    gs = [150, 0, 100]
    m, k, n = 300, 2048, 256
    a, sa, b, sb, gs = make_grouped(3, m, k, n, gs)
    lay = group_layout(jnp.asarray(gs), m, 128)
    a_al, sa_al = _aligned_rows(a, sa, lay)
    if layout == "nk":
        b, sb = np.swapaxes(b, 1, 2).copy(), np.swapaxes(sb, 1, 2).copy()
    assert (np.asarray(lay.tile_group) < 0).any()
    assert tg._grouped_blocks(n, k // 128, tg.BLOCK_N, None) == (256, 16)
    run = functools.partial(
        tg.grouped_block_scaled_matmul_aligned,
        a_al,
        sa_al,
        b,
        sb,
        lay.tile_group,
        out_dtype=jnp.float32,
        b_layout=layout,
        interpret=True,
    )
    one_step = np.asarray(run())
    np.testing.assert_array_equal(
        one_step.view(np.uint32), np.asarray(run(runs_per_step=8)).view(np.uint32)
    )
    np.testing.assert_array_equal(
        one_step.view(np.uint32), np.asarray(jax.jit(lambda: run(block_n=128))()).view(np.uint32)
    )


@pytest.mark.parametrize(
    "n,kc,runs,want",
    [
        (2048, 56, None, (1024, 56)),  # K 7168: 2 x 7 MiB of an expert's weight
        (7168, 16, None, (1024, 16)),  # the Dgrad's K 2048
        (2048, 128, None, (768, 128)),  # K 16384: narrower blocks for one step
        (2048, 12, None, (1024, 8)),  # 12 runs would be unrolled whole: steps of 8
        (2048, 6, None, (1024, 6)),
        (384, 56, 8, (384, 8)),  # steps asked for
        (384, 4, 8, (384, 4)),
    ],
)
def test_grouped_blocks(n, kc, runs, want):
    assert tg._grouped_blocks(n, kc, tg.BLOCK_N, runs) == want


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(block_m=96), "block_m"),
        (dict(block_n=200), "block_n"),
        (dict(runs_per_step=4), "runs_per_step"),
        (dict(out_dtype=jnp.float16), "out_dtype"),
    ],
)
def test_bad_arguments_raise(kw, match):
    a, sa, b, sb = make_case(0, 8, 256, 128)
    with pytest.raises((ValueError, TypeError), match=match):
        tg.block_scaled_matmul(a, sa, b, sb, interpret=True, **kw)


@pytest.mark.parametrize("tile_group", WGRAD_TILE_GROUPS)
def test_grouped_wgrad_matches_float64(tile_group):
    # dw[e] = sum over e's 128-token tiles of x_t^T dy_t, with each tile's
    # scales per column; odd M and N (padded blocks), empty experts.
    e = 4
    a, sa, b, sb = make_token_tiles(len(tile_group), len(tile_group), 200, 300)
    tg_ = jnp.asarray(tile_group, jnp.int32)
    got = np.asarray(
        tg.grouped_wgrad(a, sa, b, sb, tg_, e, block_m=128, block_n=128, interpret=True)
    )
    want, mag = wgrad_oracle(a, sa, b, sb, tile_group, e)
    assert got.shape == want.shape and got.dtype == np.float32
    # float32 sums of at most a few 128-long runs.
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * (mag.max() + 1e-30))
    assert not got[[i for i in range(e) if i not in tile_group]].any()


def test_grouped_wgrad_equals_the_per_tile_path():
    # The kernel against the dense "tn" kernel per tile summed per expert (the
    # path it replaces), in the same interpret mode.
    from fp8jax.groups import sum_tiles

    rng = np.random.default_rng(7)
    tile_group = jnp.asarray([0, 1, 1, 3, -1], jnp.int32)
    a, b = fp8(rng, (5, 128, 256)), fp8(rng, (5, 128, 384))
    sa, sb = scales(rng, (5, 1, 256)), scales(rng, (5, 1, 384))
    got = tg.grouped_wgrad(a, sa, b, sb, tile_group, 4, block_m=128, block_n=128, interpret=True)
    per_tile = jnp.stack(
        [
            tg.block_scaled_matmul_tn(a[i], sa[i], b[i], sb[i], out_dtype=jnp.float32, **SMALL)
            for i in range(5)
        ]
    )
    layout = type("L", (), {"tile_group": tile_group})()
    want = sum_tiles(per_tile, layout, 4)
    assert_near_reference(got, want)


def test_grouped_wgrad_refuses_other_tiles():
    a = jnp.zeros((2, 64, 128), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="tiles"):
        tg.grouped_wgrad(a, jnp.ones((2, 1, 128)), a, jnp.ones((2, 1, 128)), jnp.zeros(2), 1)


def test_grouped_bad_tile_group_raises():
    a, sa, b, sb, _ = make_grouped(0, 256, 128, 128, [100, 100])
    with pytest.raises(ValueError, match="tile_group"):
        tg.grouped_block_scaled_matmul_aligned(a, sa, b, sb, jnp.zeros((3,), jnp.int32))


# ----------------------------------------------------------------------------
# compiled for TPU topologies (libtpu, no TPU attached)
# ----------------------------------------------------------------------------

_DIMS = (((1,), (0,)), ((), ()))


@functools.cache
def _sharding(topology: str):
    from jax.experimental import topologies

    device = topologies.get_topology_desc(topology, "tpu").devices[0]
    return jax.sharding.NamedSharding(
        jax.sharding.Mesh(np.array([device]), ("x",)), jax.sharding.PartitionSpec()
    )


def _gemm_kernels(text: str) -> int:
    """The GEMM kernels among a TPU program's Mosaic kernels; every other one must be
    the quantizer's (fp8jax.kernels.tpu_quantize) or the expert tiles' (tpu_tiles)."""
    calls = [line for line in text.splitlines() if 'custom_call_target="tpu_custom_call"' in line]
    others = ("block_scaled_matmul", "fp8_quantize_", "fp8_window_tiles", "fp8_window_rows")
    assert all(any(o in c for o in others) for c in calls), [c[:120] for c in calls]
    return sum("block_scaled_matmul" in c for c in calls)


@pytest.mark.parametrize("n", [256, 2304])
def test_auto_compiles_one_mosaic_kernel_per_gemm_for_ironwood(n):
    pytest.importorskip("libtpu")
    import fp8jax
    from fp8jax import path_record, recipes

    sh = _sharding("tpu7x:2x2x1")
    x = jax.ShapeDtypeStruct((256, 384), jnp.float32, sharding=sh)
    w = jax.ShapeDtypeStruct((384, n), jnp.float32, sharding=sh)
    r = recipes.deepseek_v3()

    def loss(x, w):
        return jnp.sum(fp8jax.dot_general(x, w, _DIMS, recipe=r).astype(jnp.float32) ** 2)

    with path_record.recording("tpu") as paths:
        traced = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).trace(x, w)
    assert set(path_record.as_table(paths).values()) == {"pallas tpu"}
    text = traced.lower(lowering_platforms=("tpu",)).compile().as_text()
    assert _gemm_kernels(text) == 3
    # No loop over K runs outside the kernels.
    assert not re.search(r"\bwhile\(", text)
    # Fprop quantizes x itself (x read once for its codes and the product)
    # while N is one column block of float32 x; across two, x is quantized
    # first and its codes read twice (quantizing_reads_less).  Wgrad
    # requantizes x's FP8 cache itself (no requantized copy in HBM).
    fused = n == 256
    assert ("fp8_block_scaled_matmul_nn_quantizing" in text) == fused
    assert bool(re.search(r"fp8_quantize_row(?!s_cols)", text)) != fused
    assert "fp8_block_scaled_matmul_tn_requant" in text
    assert "fp8_quantize_requantize_col" not in text


def test_grouped_kernel_reads_each_experts_weight_once_per_column_block_on_ironwood():
    # DeepSeek-V3's expert Fprop (K 7168, N 2048): all of K in one step fits
    # the grouped kernels' VMEM, and the bytes libtpu is given for the kernel
    # are each expert's weight once, not once per tile (10 tiles, 2 experts).
    pytest.importorskip("libtpu")
    sh = _sharding("tpu7x:2x2x1")
    e, k, n, tiles = 2, 7168, 2048, 10
    f8 = jnp.float8_e4m3fn
    args = [
        jax.ShapeDtypeStruct(shape, dt, sharding=sh)
        for shape, dt in (
            ((tiles * 128, k), f8),
            ((tiles * 128, k // 128), jnp.float32),
            ((e, k, n), f8),
            ((e, k // 128, n // 128), jnp.float32),
            ((tiles,), jnp.int32),
        )
    ]
    f = jax.jit(functools.partial(tg.grouped_block_scaled_matmul_aligned, interpret=False))
    text = f.trace(*args).lower(lowering_platforms=("tpu",)).compile().as_text()
    (kernel,) = [line for line in text.splitlines() if "fp8_grouped_block_scaled_matmul_nn" in line]
    weight = k * n * (1 + 4 / 128)  # codes and their per-column scales per run
    a_codes = tiles * 128 * k * (1 + 4 / 128) * (n // tg.BLOCK_N)
    out = tiles * 128 * n * 2
    got = int(re.search(r"bytes_accessed\W+(\d+)", kernel).group(1))
    assert got == e * weight + a_codes + out


@pytest.mark.slow
def test_ragged_dot_compiles_grouped_mosaic_kernels_for_ironwood():
    pytest.importorskip("libtpu")
    import fp8jax
    from fp8jax import path_record, recipes

    sh = _sharding("tpu7x:2x2x1")
    x = jax.ShapeDtypeStruct((512, 256), jnp.float32, sharding=sh)
    w = jax.ShapeDtypeStruct((4, 256, 384), jnp.float32, sharding=sh)
    gs = jax.ShapeDtypeStruct((4,), jnp.int32, sharding=sh)
    r = recipes.deepseek_v3()

    def loss(x, w, gs):
        return jnp.sum(fp8jax.ragged_dot(x, w, gs, recipe=r).astype(jnp.float32) ** 2)

    with path_record.recording("tpu") as paths:
        traced = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(x, w, gs)
    # Fprop and Dgrad: the grouped kernel on the expert-aligned tiles; Wgrad:
    # the grouped Wgrad kernel, each expert's tiles summed in VMEM.
    assert path_record.as_table(paths) == {
        "expert/fprop": "pallas grouped tpu",
        "expert/dgrad": "pallas grouped tpu",
        "expert/wgrad": "pallas grouped tpu",
    }
    text = traced.lower(lowering_platforms=("tpu",)).compile().as_text()
    assert _gemm_kernels(text) == 3
    # Wgrad's x: the cached FP8 codes requantized in token tiles by the kernel.
    assert "fp8_quantize_requantize_col" in text


_MXU_CHECK = """
import jax, jax.numpy as jnp, numpy as np
from jax.experimental import topologies
from fp8jax.kernels import tpu_block_gemm as tg
dev = topologies.get_topology_desc({topology!r}, "tpu").devices[0]
sh = jax.sharding.NamedSharding(jax.sharding.Mesh(np.array([dev]), ("x",)), jax.sharding.PartitionSpec())
s = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sh)
f8 = jnp.float8_e4m3fn
f = jax.jit(lambda *xs: tg.block_scaled_matmul(*xs, interpret=False))
args = s((256, 256), f8), s((256, 2), jnp.float32), s((256, 256), f8), s((2, 2), jnp.float32)
f.trace(*args).lower(lowering_platforms=("tpu",)).compile()
"""


def _matmul_formats(topology: str, tmp_path) -> set[str]:
    """The matrix-unit operand formats of the compiled kernel, from Mosaic's LLO dump."""
    pytest.importorskip("libtpu")
    env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    # libtpu reads its flags when it loads: a child process.
    env["LIBTPU_INIT_ARGS"] = f"--xla_mosaic_dump_to={tmp_path}"
    code = _MXU_CHECK.format(topology=topology)
    subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True)
    formats = set()
    for path in tmp_path.glob("*fp8_block_scaled_matmul_nn*finalize-llo.txt"):
        text = path.read_text()
        assert "llo.vmatmul" in text
        formats |= set(re.findall(r"matmul_data_format<(\w+)>", text))
    return formats


def test_fp8_operands_reach_ironwoods_matrix_unit(tmp_path):
    # E4M3 codes are the matrix unit's operands on tpu7x, not widened first.
    assert _matmul_formats("tpu7x:2x2x1", tmp_path) == {"e4m3b"}


@pytest.mark.slow
def test_v6e_widens_fp8_to_bfloat16_in_the_matrix_unit(tmp_path):
    # No FP8 matrix unit: the same kernel compiles, codes widened on the way in.
    assert _matmul_formats("v6e:2x2", tmp_path) == {"e4m3b_to_bf16"}


def test_prediction_command_refuses_a_bad_shape(capsys):
    from fp8jax.bench import tpu_kernel

    assert tpu_kernel.main(["--shape", "4096,4096"]) == 2
    assert "--shape" in capsys.readouterr().err


@pytest.mark.slow
def test_predictions_at_a_small_shape():
    pytest.importorskip("libtpu")
    from fp8jax.bench import tpu_kernel

    out = tpu_kernel.kernels("tpu7x", 256, 512, 256)
    assert [out[k]["mosaic_kernels"] for k in ("fprop", "dgrad", "wgrad")] == [1, 1, 1]
    assert out["bytes_accessed"] > 0
    # The promotion per run is part of the kernel body: fewer runs, fewer bundles per K.
    per_k = [tpu_kernel.bundles("tpu7x", r)["bundles_per_k128"] for r in (128, 2048)]
    assert per_k[0] > per_k[1] > 0
