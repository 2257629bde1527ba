"""The Pallas Triton quantizers (1x128 tiles, 128x1 tiles, 128x128 blocks, and dy's
two tile layouts at once) in Pallas' interpreter on CPU (compiled on a Hopper
GPU where one is attached): the same codes and scales as ``fp8jax.quantize``
on CPU, bit for bit, on the data of the TPU quantizer's tests (NaN, +-Inf,
zero tiles, float32 subnormals, values past the format's range, shapes that
are not multiples of 128).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
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
from fp8jax.kernels import availability
from fp8jax.kernels import gpu_quantize as gq


@pytest.mark.parametrize("orient", gq.ORIENTS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_kernel_gives_quantize_bits(orient, dtype, fmt):
    x = _data((300, 260), dtype, seed=8)
    codes, scales = gq.quantize_2d(x, fmt=fmt, orient=orient, interpret=True)
    want = _reference(x, fmt, orient)
    assert codes.dtype == fmt and codes.shape == x.shape and scales.shape == want.scale.shape
    assert gq.same_codes(codes, want.data)
    np.testing.assert_array_equal(_bits(scales), _bits(want.scale))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_kernel_gives_both_layouts_bits(dtype, fmt):
    x = _data((300, 260), dtype, seed=6)
    rc, rs, cc, cs = gq.quantize_rows_cols(x, fmt=fmt, interpret=True)
    for (codes, scales), axis in (((rc, rs), 1), ((cc, cs), 0)):
        want = quant.quantize(x, fmt, "tile", axis=axis)
        assert gq.same_codes(codes, want.data), axis
        np.testing.assert_array_equal(_bits(scales), _bits(want.scale))


@pytest.mark.parametrize("cache_fmt, fmt", [(E4M3, E4M3), (E5M2, E4M3)])
def test_requantize_gives_dequantize_then_quantize_bits_transposed(cache_fmt, fmt):
    # DeepSeek-V3's cached x for Wgrad: its 1x128 FP8 tiles quantized again in
    # 128-token tiles, written K-major; one row of tiny values (subnormal scales),
    # +-Inf and NaN (whose codes keep their sign through the requantization).
    x = np.array(_data((300, 260), jnp.float32, seed=9))
    x[5, :] = np.where(np.isfinite(x[5, :]), x[5, :] * 1e-38, x[5, :])
    x[7, 3], x[8, 4], x[9, 5] = -np.inf, -np.nan, np.nan
    cached = quant.float32_scales(quant.quantize(jnp.asarray(x), cache_fmt, "tile", axis=-1))
    codes_t, scales_t = gq.requantize_col_t(cached.data, cached.scale, fmt=fmt, interpret=True)
    want = quant.quantize(quant.dequantize(cached, jnp.float32), fmt, "tile", axis=0)
    assert codes_t.shape == (260, 300) and scales_t.shape == (260, 3)
    assert gq.same_codes(codes_t.T, want.data)
    np.testing.assert_array_equal(_bits(scales_t.T), _bits(want.scale))


def test_differences_are_counted_with_the_first_position():
    codes = np.array([[0x3C, 0x7F], [0x10, 0x20]], np.uint8).view(E4M3)
    scales = np.ones((2, 1), np.float32)
    assert gq._difference(codes, scales, codes, scales) == ""
    moved = codes.view(np.uint8).copy()
    moved[1, 0] = 0x11
    scales_off = np.array([[1.0], [2.0]], np.float32)
    text = gq._difference(moved.view(E4M3), scales_off, codes, scales)
    assert text == "1 codes, 1 scales (first (1, 0): 0x11, CPU 0x10)"


def test_nan_codes_count_as_nan_of_their_sign_only():
    e5m2 = np.array([0x7E, 0x7F, 0xFE, 0x3C], np.uint8).view(E5M2)
    assert gq.same_codes(e5m2, np.array([0x7F, 0x7D, 0xFF, 0x3C], np.uint8).view(E5M2))
    assert not gq.same_codes(e5m2, np.array([0xFF, 0x7F, 0xFE, 0x3C], np.uint8).view(E5M2))
    assert not gq.same_codes(e5m2, np.array([0x7E, 0x7F, 0xFE, 0x3D], np.uint8).view(E5M2))


def test_scale_options_under_jit():
    x = _data((130, 257), jnp.float32, seed=7)
    _assert_scale_options_under_jit(gq.quantize_rows_cols, x, SCALE_OPTIONS)


def test_refuses_what_is_not_a_matrix_and_unknown_orientations():
    with pytest.raises(ValueError, match="2-D"):
        gq.quantize_rows_cols(jnp.zeros((2, 128, 128)), fmt=E4M3, interpret=True)
    with pytest.raises(ValueError, match="orient"):
        gq.quantize_2d(jnp.zeros((128, 128)), fmt=E4M3, orient="diagonal", interpret=True)


def test_check_against_the_cpu_passes_interpreted_and_from_a_trace():
    answers = []

    @jax.jit
    def traced(x):
        answers.append(gq.compare_with_cpu(interpret=True))
        return x + 1

    traced(jnp.ones(2))
    assert answers == [None]


def test_taken_where_asked_for_and_for_hopper_targets_only(monkeypatch):
    # Not asked for: the Mosaic GPU kernels, not these.
    monkeypatch.delenv(gq.OPT_IN, raising=False)
    with platforms.cuda_target("9.0"):
        assert gq.kernels() is not gq
    # Asked for, no GPU here: a CUDA target of 9.0 takes it on trust, 8.0 (no FP8) never.
    monkeypatch.setenv(gq.OPT_IN, "triton")
    with platforms.cuda_target("9.0"):
        assert gq.kernels() is gq
    with platforms.cuda_target("8.0"):
        assert gq.kernels() is None


@pytest.mark.gpu
@pytest.mark.skipif(not availability.hopper_gpu(), reason="needs a Hopper+ NVIDIA GPU")
@pytest.mark.parametrize("kind", ["mosaic", "triton"])
def test_compiled_kernels_give_the_cpus_bits_on_a_hopper_gpu(monkeypatch, kind):
    assert gq.check_error(kind) is None
    monkeypatch.setenv(gq.OPT_IN, kind)
    assert gq.kernels() is gq.module(kind)
