"""The Mosaic GPU block-scaled kernels: interpreted with race detection, lowered and compiled for an H100.

On any machine: Mosaic GPU's interpreter (shared memory, barriers, TMA and the
three warpgroups simulated, data races raised) against the float64 oracle of
test_kernels_block_gemm and the jnp references; lowering for CUDA gives one
``mosaic_gpu`` custom call per GEMM.  Where XLA's compile-only CUDA client is
installed (``fp8jax.bench.compilers``; it compiles for a described GPU without
one): the kernels compile for an
H100 and their PTX holds FP8 ``wgmma`` and TMA copies, no ``mma.sync``, within
the H100's shared memory and registers.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_kernels_block_gemm import (
    E4M3,
    E5M2,
    U32,
    assert_close,
    make_case,
    make_tn_case,
    tn_oracle,
    tolerance,
)
from test_kernels_grouped_block_gemm import (
    assert_grouped_close,
    make_grouped,
    make_token_tiles,
    wgrad_oracle,
)

import fp8jax
from fp8jax import path_record, platforms, recipes
from fp8jax.bench import compilers, mgpu_ir, predicted
from fp8jax.kernels import block_gemm as bg
from fp8jax.kernels import grouped_block_gemm as gg
from fp8jax.kernels import mgpu_block_gemm as mgpu

RACES = mgpu.interpret_params(detect_races=True)


# ----------------------------------------------------------------------------
# interpreted, races detected
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("a_fmt,b_fmt", [(E4M3, E4M3), (E5M2, E4M3)])
def test_dense_kernel_is_race_free_and_exact_to_float32(a_fmt, b_fmt):
    # Odd M and N (padding), three K runs: more runs than fit one stage.
    m, k, n = 130, 300, 135
    a, sa, _, _ = make_case(1, m, k, n, dtype=a_fmt)
    _, _, b, sb = make_case(2, m, k, n, dtype=b_fmt)
    got = bg.block_scaled_matmul(a, sa, b, sb, out_dtype=jnp.float32, interpret=RACES)
    assert_close(got, a, sa, b, sb, jnp.float32)
    # The jnp reference sums in another float32 order: summation-order apart.
    want = np.asarray(bg.block_scaled_matmul_reference(a, sa, b, sb, out_dtype=jnp.float32))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_dense_kernel_takes_edge_tiles_in_place_with_the_padded_bits(out_dtype):
    # M and N multiples of 32 reach the kernel as they are (TMA reads the edge
    # tiles' missing rows as zeros and drops the writes past the edges; 160
    # bfloat16 columns are staged in tiles of 32); K is padded to whole runs of 128.
    m, k, n = 288, 416, 160
    a, sa, _, _ = make_case(6, m, k, n, dtype=E4M3)
    _, _, b, sb = make_case(7, m, k, n, dtype=E4M3)
    run = lambda a, sa, b, sb: bg.block_scaled_matmul(
        a, sa, b, sb, out_dtype=out_dtype, interpret=RACES
    )
    assert " pad[" not in str(jax.make_jaxpr(run)(a, sa, b, sb))
    got = run(a, sa, b, sb)
    assert_close(got, a, sa, b, sb, out_dtype)
    # Every dimension padded to 128 by hand: the same bits.
    pad = lambda x, shape, v: bg._pad_to(x, shape, v)[None]
    padded = mgpu.matmul_nt(
        pad(a, (384, 512), 0),
        pad(sa.T, (4, 384), 1.0),
        pad(b.T, (256, 512), 0),
        pad(sb, (4, 2), 1.0),
        b_cols=False,
        out_dtype=out_dtype,
        interpret=RACES,
    )[0, :m, :n]
    np.testing.assert_array_equal(_bits32(got), _bits32(padded))


def _bits32(x) -> np.ndarray:
    # bfloat16 widened to float32 is exact: equal bits either way.
    return np.asarray(x.astype(jnp.float32)).view(np.uint32)


@pytest.mark.parametrize(
    "d,want", [(288, 288), (4000, 4000), (4096, 4096), (272, 384), (1000, 1024), (96, 128)]
)
def test_edge_dim_keeps_what_tma_takes_in_place(d, want):
    assert mgpu.edge_dim(d) == want


def test_wgrad_kernel_with_column_scales_is_race_free():
    at, sat, b, sb = make_tn_case(3, 260, 70, 140)
    got = bg.block_scaled_matmul_tn(at, sat, b, sb, out_dtype=jnp.bfloat16, interpret=RACES)
    ref, mag = tn_oracle(at, sat, b, sb)
    err = np.abs(np.asarray(got.astype(jnp.float32), np.float64) - ref)
    assert np.all(err <= tolerance(mag, ref, 260, jnp.bfloat16))


def test_grouped_kernel_is_race_free_with_empty_and_ragged_groups():
    # Group boundaries off the 128-row tiles, an empty expert, rows in no group.
    a, sa, b, sb, gs = make_grouped(4, 300, 256, 130, [0, 140, 1, 0, 120])
    got = gg.grouped_block_scaled_matmul(a, sa, b, sb, gs, out_dtype=jnp.float32, interpret=RACES)
    assert_grouped_close(got, a, sa, b, sb, gs, jnp.float32)
    want = gg.grouped_block_scaled_matmul_reference(a, sa, b, sb, gs, out_dtype=jnp.float32)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-3)


def test_grouped_wgrad_kernel_is_race_free():
    # Expert 0 owns two K runs, expert 1 one, expert 2 none; odd M and N.
    tile_group = [0, 0, 1]
    a, sa, b, sb = make_token_tiles(5, 3, 130, 135)
    tg = jnp.asarray(tile_group, jnp.int32)
    got = np.asarray(gg.grouped_wgrad(a, sa, b, sb, tg, 3, interpret=RACES))
    ref, mag = wgrad_oracle(a, sa, b, sb, tile_group, 3)
    np.testing.assert_array_less(np.abs(got - ref), (128 + 10) * U32 * mag + 1e-30)
    assert not got[2].any()


def test_kernel_contract_is_checked():
    a = jnp.zeros((1, 100, 128), jnp.float8_e4m3fn)
    b = jnp.zeros((1, 128, 128), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="multiple of 128"):
        mgpu.matmul_nt(
            a, jnp.ones((1, 1, 100)), b, jnp.ones((1, 1, 1)), b_cols=False, out_dtype=jnp.float32
        )
    # B's scales in two layouts at once, or of the wrong shape for the one asked.
    square = lambda sb, **kw: mgpu.matmul_nt(b, jnp.ones((1, 1, 128)), b, sb, **kw)
    with pytest.raises(ValueError, match="pick one"):
        square(jnp.ones((1, 1, 128)), b_cols=True, b_scale_nk=True, out_dtype=jnp.float32)
    with pytest.raises(ValueError, match="b_scale must be"):
        square(jnp.ones((1, 2, 1)), b_cols=False, b_scale_nk=True, out_dtype=jnp.float32)
    with pytest.raises(ValueError, match="tile_group"):
        mgpu.grouped_matmul_nt(
            jnp.zeros((3,), jnp.int32),
            b[0],
            jnp.ones((1, 128)),
            b,
            jnp.ones((1, 1, 1)),
            out_dtype=jnp.float32,
        )


# ----------------------------------------------------------------------------
# lowered for CUDA (no GPU, no CUDA plugin needed)
# ----------------------------------------------------------------------------


def _cuda_text(fn, *args):
    with platforms.lowering_for_cuda("9.0"), path_record.recording("cuda") as paths:
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return text, path_record.as_table(paths)


def _mosaic_calls(text):
    """The Mosaic GPU GEMM kernels' calls (the quantizers' hold no wgmma)."""
    return [
        ln
        for ln in text.splitlines()
        if "stablehlo.custom_call @mosaic_gpu" in ln and "wgmma" in ln
    ]


def test_auto_lowers_every_deepseek_v3_gemm_to_a_mosaic_gpu_kernel():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((256, 384)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((384, 256)), jnp.float32)
    recipe = recipes.deepseek_v3()
    assert recipe.impl == "auto"

    def loss(x, w):
        y = fp8jax.dot_general(x, w, (((1,), (0,)), ((), ())), recipe=recipe)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    text, paths = _cuda_text(jax.value_and_grad(loss, argnums=(0, 1)), x, w)
    assert len(_mosaic_calls(text)) == 3  # Fprop, Dgrad, Wgrad
    # No Triton call: Mosaic GPU kernels quantize (the Triton ones only where asked for).
    assert "custom_call @__gpu$xla.gpu.triton" not in text
    assert set(paths.values()) == {"pallas"}


def test_ragged_dot_lowers_to_grouped_mosaic_gpu_kernels():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((200, 256)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((3, 256, 128)), jnp.float32)
    gs = jnp.asarray([90, 0, 70], jnp.int32)
    recipe = recipes.deepseek_v3()

    def loss(x, w):
        y = fp8jax.ragged_dot(x, w, gs, recipe=recipe, preferred_element_type=jnp.float32)
        return jnp.sum(y**2)

    text, paths = _cuda_text(jax.value_and_grad(loss, argnums=(0, 1)), x, w)
    # Grouped Fprop, Dgrad and Wgrad (each expert's token tiles summed in the
    # kernel's registers): no (tiles, K, N) float32 products, no loop adding them.
    assert len(_mosaic_calls(text)) == 3
    assert paths["expert/fprop"] == paths["expert/dgrad"] == paths["expert/wgrad"]
    assert paths["expert/wgrad"] == "pallas grouped"
    assert "stablehlo.while" not in text


def test_dgrad_reads_the_weights_block_scales_as_stored():
    # Dgrad's weight W (K, N) = bt with block scales (K/128, N/128) = (3, 2):
    # the kernel takes them as they are, not a transposed copy.
    s = jax.ShapeDtypeStruct
    args = (
        s((128, 256), E4M3),
        s((128, 2), jnp.float32),
        s((384, 256), E4M3),
        s((3, 2), jnp.float32),
    )
    fn = lambda a, sa, bt, sbt: bg.block_scaled_matmul_nt(a, sa, bt, sbt, out_dtype=jnp.float32)
    text, _ = _cuda_text(fn, *args)
    [call] = _mosaic_calls(text)
    assert "tensor<1x3x2xf32>) -> tensor<1x128x384xf32>" in call
    assert "-> tensor<1x2x3xf32>" not in text and "-> tensor<2x3xf32>" not in text


def test_one_shape_and_setting_is_one_kernel_in_a_program():
    # Two GEMMs of one shape share one kernel (lowered and compiled once);
    # another output type is another kernel.
    s = jax.ShapeDtypeStruct
    args = (
        s((1, 128, 256), E4M3),
        s((1, 2, 128), jnp.float32),
        s((1, 128, 256), E4M3),
        s((1, 2, 1), jnp.float32),
    )

    def two(a, sa, b, sb):
        nt = lambda dt: mgpu.matmul_nt(a, sa, b, sb, b_cols=False, out_dtype=dt)
        return nt(jnp.float32), nt(jnp.float32) * 2.0, nt(jnp.bfloat16)

    text, _ = _cuda_text(two, *args)
    assert len(_mosaic_calls(text)) == 2


# ----------------------------------------------------------------------------
# compiled for an H100 (needs XLA's compile-only CUDA client; no GPU)
# ----------------------------------------------------------------------------


def _h100_or_skip():
    why = mgpu_ir.unavailable()
    if why:
        pytest.skip(why)


@pytest.mark.parametrize(
    "layout,a_fmt,b_fmt,types",
    [
        ("nk", jnp.float8_e4m3fn, None, "e4m3.e4m3"),
        ("kn", jnp.float8_e5m2, jnp.float8_e4m3fn, "e5m2.e4m3"),
        ("tn", jnp.float8_e4m3fn, jnp.float8_e5m2, "e4m3.e5m2"),
        ("grouped_kn", jnp.float8_e4m3fn, None, "e4m3.e4m3"),
        ("grouped_wgrad", jnp.float8_e4m3fn, None, "e4m3.e4m3"),
    ],
)
def test_h100_code_is_fp8_wgmma_fed_by_tma(layout, a_fmt, b_fmt, types):
    _h100_or_skip()
    fn, args = mgpu_ir.kernel_case(layout, a_fmt, b_fmt, out_dtype=jnp.float32)
    [code] = mgpu_ir.compile_h100(fn, *args)
    # One K run of 128 per step: four m64n128k32 FP8 wgmma, one per 32 of K.
    assert code.fp8_wgmma == (f"wgmma.mma_async.sync.aligned.m64n128k32.f32.{types}",)
    assert code.fp8_wgmma_count == 4
    # The promotion: each thread's 64 accumulator elements, one FFMA each.
    assert code.ffma >= 64
    assert code.mma_sync == 0
    assert code.tma_loads > 0
    assert 0 < code.shared_bytes <= mgpu_ir.H100_SHARED_BYTES
    assert code.registers <= mgpu_ir.MAX_REGISTERS and code.spill_bytes == 0


def test_deepseek_v3_fwd_bwd_compiles_for_an_h100():
    _h100_or_skip()
    s = jax.ShapeDtypeStruct

    def fwd_bwd(x, w):
        recipe = dataclasses.replace(recipes.deepseek_v3(), impl="pallas")
        f = lambda x, w: jnp.sum(
            fp8jax.dot_general(x, w, (((1,), (0,)), ((), ())), recipe=recipe).astype(jnp.float32)
        )
        return jax.grad(f, argnums=(0, 1))(x, w)

    codes = mgpu_ir.compile_h100(fwd_bwd, s((256, 512), jnp.float32), s((512, 384), jnp.float32))
    # (Mosaic GPU names its dumps per distinct kernel; the lowering test above
    # counts the three calls.)  The quantizers' kernels hold no wgmma.
    gemms = [code for code in codes if code.fp8_wgmma]
    assert gemms and len(gemms) < len(codes)
    for code in gemms:
        assert code.mma_sync == 0 and code.tma_loads > 0


@pytest.mark.skipif(compilers.unavailable(compilers.target("h100")) is not None, reason="no client")
def test_unaligned_n_reaches_the_h100_kernels_unpadded():
    # N = 576 (DeepSeek-V3's 7168 -> 576) and M = 288: multiples of 32, so the
    # quantizers and the GEMMs take x, w, dy and their results with their edge
    # tiles in place, the Dgrad's contraction over N and the Wgrad's over M
    # included (a last K run of 64 and of 32): nothing is padded or cropped.
    fn = predicted.gemm_program(recipes.deepseek_v3())
    s = jax.ShapeDtypeStruct
    compiled = compilers.compile_for(
        fn, (s((288, 512), jnp.bfloat16), s((512, 576), jnp.bfloat16)), compilers.target("h100")
    )
    census = compilers.census(compiled)
    assert census.gemm_kernels == {"Mosaic GPU": 3} and not census.loops
    # (A one-element slice ties the cached x's scales to dy's: no operand's.)
    assert not re.search(r"= \w+\[\d+(,\d+)+\]\S* (pad|slice)\(", compiled.text)
