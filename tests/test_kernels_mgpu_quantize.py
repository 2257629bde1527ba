"""The Mosaic GPU quantizers (1x128 tiles, 128x1 tiles, 128x128 blocks, dy's two tile
layouts at once, the cached x requantized K-major) in Mosaic GPU's interpreter on
CPU (TMA copies, shared memory and barriers simulated; data races raised where
asked): the same codes and scales as ``fp8jax.quantize`` on CPU, bit for bit, on
the data of the TPU quantizer's tests (NaN, +-Inf, zero tiles, float32
subnormals, values past the format's range, shapes that are not multiples of 128).
Where XLA's compile-only CUDA client is installed they also compile for an H100.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu
from test_kernels_tpu_quantize import (
    E4M3,
    E5M2,
    SCALE_OPTIONS,
    _assert_scale_options_under_jit,
    _bits,
    _data,
    _reference,
)

from fp8jax import platforms, quant
from fp8jax.bench import compilers, mgpu_ir
from fp8jax.kernels import gpu_quantize as gq
from fp8jax.kernels import mgpu_quantize as mq
from fp8jax.kernels import tpu_quantize

RACES = plgpu.InterpretGPUParams(detect_races=True)


def _assert_same(codes, scales, want):
    assert codes.dtype == want.data.dtype and codes.shape == want.data.shape
    assert scales.shape == want.scale.shape
    assert gq.same_codes(np.asarray(codes), np.asarray(want.data))
    np.testing.assert_array_equal(_bits(scales), _bits(want.scale))


@pytest.mark.parametrize("orient", mq.ORIENTS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_kernel_gives_quantize_bits(orient, dtype, fmt):
    x = _data((300, 260), dtype, seed=8)
    codes, scales = mq.quantize_2d(x, fmt=fmt, orient=orient, interpret=True)
    _assert_same(codes, scales, _reference(x, fmt, orient))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_kernel_gives_both_layouts_bits(dtype, fmt):
    # float32 x reaches its transposed tiles as two 16-bit halves: both dtypes.
    x = _data((300, 260), dtype, seed=6)
    rc, rs, cc, cs = mq.quantize_rows_cols(x, fmt=fmt, interpret=True)
    _assert_same(rc, rs, quant.quantize(x, fmt, "tile", axis=1))
    _assert_same(cc, cs, quant.quantize(x, fmt, "tile", axis=0))


def _assert_block_both(x, fmt, interpret=True):
    codes, codes_t, scales = mq.quantize_block_both(x, fmt=fmt, interpret=interpret)
    _assert_same(codes, scales, quant.quantize(x, fmt, "block"))
    # The transposed codes are the same bytes moved.
    assert codes_t.dtype == codes.dtype and codes_t.shape == codes.shape[::-1]
    np.testing.assert_array_equal(_bits(codes_t), _bits(codes).T)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_block_kernel_writes_both_layouts_with_quantize_bits(dtype, fmt):
    # NaN, +-Inf, zero blocks and values past the range among the data; edge
    # blocks on both sides (300 x 260).
    _assert_block_both(_data((300, 260), dtype, seed=12), fmt)


@pytest.mark.parametrize("cache_fmt", [E4M3, E5M2])
def test_requantize_gives_dequantize_then_quantize_bits_transposed(cache_fmt):
    # A row of tiny values (subnormal scales), +-Inf and NaN of either sign in the cache.
    x = np.array(_data((300, 260), jnp.float32, seed=9))
    x[5, :] = np.where(np.isfinite(x[5, :]), x[5, :] * 1e-38, x[5, :])
    x[7, 3], x[8, 4], x[9, 5] = -np.inf, -np.nan, np.nan
    cached = quant.float32_scales(quant.quantize(jnp.asarray(x), cache_fmt, "tile", axis=-1))
    codes_t, scales_t = mq.requantize_col_t(cached.data, cached.scale, fmt=E4M3, interpret=True)
    want = quant.quantize(quant.dequantize(cached, jnp.float32), E4M3, "tile", axis=0)
    assert codes_t.shape == (260, 300) and scales_t.shape == (260, 3)
    _assert_same(codes_t.T, scales_t.T, want)


@pytest.mark.parametrize("shape", [(288, 160), (300, 288)])
def test_edges_read_in_place_give_quantize_bits(shape):
    # Dimensions that are multiples of 32 and at least 128 reach the kernels as
    # they are (TMA reads an edge square's missing elements as zeros and drops
    # the writes past the edge); the others are padded: (288, 160) neither,
    # (300, 288) its rows only.
    x = _data(shape, jnp.bfloat16, seed=11)
    padded = int(shape[0] % 32 != 0) + int(shape[1] % 32 != 0)
    for orient in mq.ORIENTS:
        run = functools.partial(mq.quantize_2d, fmt=E4M3, orient=orient, interpret=True)
        assert str(jax.make_jaxpr(run)(x)).count(" pad[") == min(padded, 1)
        _assert_same(*run(x), _reference(x, E4M3, orient))
    x32 = x.astype(jnp.float32)
    rc, rs, cc, cs = mq.quantize_rows_cols(x32, fmt=E5M2, interpret=True)
    _assert_same(rc, rs, quant.quantize(x32, E5M2, "tile", axis=1))
    _assert_same(cc, cs, quant.quantize(x32, E5M2, "tile", axis=0))
    cached = quant.float32_scales(quant.quantize(x, E4M3, "tile", axis=-1))
    codes_t, scales_t = mq.requantize_col_t(cached.data, cached.scale, fmt=E4M3, interpret=True)
    want = quant.quantize(quant.dequantize(cached, jnp.float32), E4M3, "tile", axis=0)
    _assert_same(codes_t.T, scales_t.T, want)


def test_stacked_matrices_by_vmap_give_quantize_bits():
    # The experts' weights: a stack of matrices, each its own 128x128 blocks
    # (fp8jax.quant maps the kernel over the leading axes).
    x = jnp.stack([_data((130, 260), jnp.bfloat16, seed=s) for s in (1, 2)])
    run = functools.partial(mq.quantize_2d, fmt=E4M3, orient="block", interpret=True)
    codes, scales = jax.vmap(run)(x)
    _assert_same(codes, scales, quant.quantize(x, E4M3, "block"))
    # Both layouts as the GPU quantizers' runner maps a kernel over a stack,
    # with the result shapes it declares for the lowering.
    both = functools.partial(mq.quantize_block_both, fmt=E4M3, interpret=True)

    def call(fn, arrays, out_shape):
        out = fn(*arrays)
        assert [(o.shape, o.dtype) for o in out] == [(o.shape, o.dtype) for o in out_shape]
        return out

    codes, codes_t, scales = tpu_quantize.over_matrices(both, (x,), call)
    _assert_same(codes, scales, quant.quantize(x, E4M3, "block"))
    np.testing.assert_array_equal(_bits(codes_t), _bits(codes).transpose(0, 2, 1))


def test_shared_memory_is_race_free():
    # The kernels whose threads read each other's stores (the transposed reads),
    # on squares that end past both edges of x (read and written in place).
    x = _data((288, 160), jnp.float32, seed=4)
    rc, rs, cc, cs = mq.quantize_rows_cols(x, fmt=E4M3, interpret=RACES)
    _assert_same(cc, cs, quant.quantize(x, E4M3, "tile", axis=0))
    cached = quant.float32_scales(quant.quantize(x, E4M3, "tile", axis=-1))
    codes_t, scales_t = mq.requantize_col_t(cached.data, cached.scale, fmt=E4M3, interpret=RACES)
    want = quant.quantize(quant.dequantize(cached, jnp.float32), E4M3, "tile", axis=0)
    _assert_same(codes_t.T, scales_t.T, want)
    # The block's scale, stored to global memory by every lane of the warpgroup.
    codes, scales = mq.quantize_2d(x, fmt=E4M3, orient="block", interpret=RACES)
    _assert_same(codes, scales, quant.quantize(x, E4M3, "block"))
    # The block's codes read back transposed by other threads.
    _assert_block_both(x, E4M3, interpret=RACES)


def test_scale_options_under_jit():
    x = _data((130, 257), jnp.float32, seed=7)
    _assert_scale_options_under_jit(mq.quantize_rows_cols, x, SCALE_OPTIONS)


def test_refuses_what_is_not_a_matrix_and_unknown_orientations():
    with pytest.raises(ValueError, match="2-D"):
        mq.quantize_rows_cols(jnp.zeros((2, 128, 128)), fmt=E4M3, interpret=True)
    with pytest.raises(ValueError, match="2-D"):
        mq.requantize_col_t(jnp.zeros((128,), E4M3), jnp.ones((1,)), fmt=E4M3, interpret=True)
    with pytest.raises(ValueError, match="orient"):
        mq.quantize_2d(jnp.zeros((128, 128)), fmt=E4M3, orient="diagonal", interpret=True)
    with pytest.raises(ValueError, match="quantize_block_both takes a 2-D array"):
        mq.quantize_block_both(jnp.zeros((2, 128, 128)), fmt=E4M3, interpret=True)


def test_check_against_the_cpu_passes_interpreted():
    assert gq.compare_with_cpu(interpret=True, kind="mosaic") is None


def test_taken_by_default_for_hopper_targets_and_refused_where_asked(monkeypatch):
    monkeypatch.delenv(gq.OPT_IN, raising=False)
    with platforms.cuda_target("9.0"):
        assert gq.kernels() is mq
    with platforms.cuda_target("8.0"):
        assert gq.kernels() is None
    monkeypatch.setenv(gq.OPT_IN, "xla")
    with platforms.cuda_target("9.0"):
        assert gq.kernels() is None
    monkeypatch.setenv(gq.OPT_IN, "cublas")
    with pytest.raises(ValueError, match="FP8JAX_GPU_QUANTIZER='cublas': expected one of"):
        gq.requested()


@pytest.mark.skipif(compilers.unavailable(compilers.target("h100")) is not None, reason="no client")
def test_compiles_for_an_h100_as_quantizer_kernels_not_gemms():
    # Deviceless: XLA's compile-only CUDA client builds the executable; the census
    # counts the kernels as non-GEMM work priced at bytes / HBM bandwidth.
    x = jax.ShapeDtypeStruct((512, 384), jnp.bfloat16)
    compiled = compilers.compile_for(
        lambda x: mq.quantize_rows_cols(x, fmt=E4M3), (x,), compilers.target("h100")
    )
    census = compilers.census(compiled)
    assert census.gemm_kernels == {} and census.other_kernels == 1
    assert census.fusions <= 2 and not census.loops
    assert "fp8_quantize_rows_cols" in compiled.text


@pytest.mark.parametrize("kernel", ["row", "block", "block_both", "rows_cols", "requantize"])
def test_h100_code_reads_by_tma_and_keeps_its_temporaries_in_registers(kernel):
    why = mgpu_ir.unavailable()
    if why:
        pytest.skip(why)
    x = jax.ShapeDtypeStruct((256, 384), jnp.bfloat16)
    args = (x,)
    fn = {
        "row": lambda x: mq.quantize_2d(x, fmt=E4M3, orient="row"),
        "block": lambda x: mq.quantize_2d(x, fmt=E4M3, orient="block"),
        "block_both": lambda x: mq.quantize_block_both(x, fmt=E4M3),
        "rows_cols": lambda x: mq.quantize_rows_cols(x, fmt=E4M3),
        "requantize": lambda c, s: mq.requantize_col_t(c, s, fmt=E4M3),
    }[kernel]
    if kernel == "requantize":
        args = (jax.ShapeDtypeStruct((256, 384), E4M3), jax.ShapeDtypeStruct((256, 3), jnp.float32))
    [code] = mgpu_ir.compile_h100(fn, *args)
    assert not code.fp8_wgmma and code.mma_sync == 0 and code.tma_loads > 0
    assert 0 < code.shared_bytes <= mgpu_ir.H100_SHARED_BYTES
    # A chunk of a half square at a time (ROWS x COLS): no spill to local memory.
    assert code.registers <= mgpu_ir.MAX_REGISTERS and code.spill_bytes == 0
    # x / scale (each thread's elements of a chunk) is the IEEE division
    # (inline div.rn.f32), not Mosaic GPU's div.full.f32.
    assert code.ptx.count("div.rn.f32") >= mq.ROWS * mq.COLS // 128
