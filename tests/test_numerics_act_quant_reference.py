"""The numpy reference of DeepSeek's quantization, and deepseek_v3 measured against it."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import fp8jax
from fp8jax.numerics.act_quant_reference import act_quant, block_quant, reference_linear
from fp8jax.numerics.gemm_error import linear_outputs
from fp8jax.numerics.metrics import relative_error


def test_act_quant_tile_scale_is_amax_over_448_and_top_lands_on_448():
    x = np.zeros((2, 256), np.float32)
    x[0, :128] = np.linspace(-3.0, 7.0, 128)
    x[0, 128:] = 1e-3
    got = act_quant(x)
    # The first tile's largest element is exactly representable and lands on 448 x scale.
    assert got[0, 127] == pytest.approx(7.0, rel=2**-20)
    assert np.all(got[1] == 0.0)  # an all-zero tile stays zero (scale 1)
    scale = np.float32(7.0) / np.float32(448.0)
    codes = (np.clip(x[0, :128] / scale, -448, 448)).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(got[0, :128], codes.astype(np.float64) * np.float64(scale))


def test_reference_equals_fp8jax_tile_quantization():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((4, 384)) * np.exp(rng.standard_normal((4, 384)))).astype(np.float32)
    q = fp8jax.quantize(jnp.asarray(x), fp8jax.E4M3, granularity="tile", axis=-1)
    # codes x scale is exact in float64; fp8jax's dequantize rounds it once to float32.
    np.testing.assert_array_equal(act_quant(x).astype(np.float32), np.asarray(fp8jax.dequantize(q)))
    w = rng.standard_normal((256, 384)).astype(np.float32)
    qw = fp8jax.quantize(jnp.asarray(w), fp8jax.E4M3, granularity="block")
    np.testing.assert_array_equal(
        block_quant(w).astype(np.float32), np.asarray(fp8jax.dequantize(qw))
    )


def test_reference_refuses_partial_tiles():
    with pytest.raises(ValueError, match="multiple of 128"):
        act_quant(np.ones((2, 100), np.float32))
    with pytest.raises(ValueError, match="multiple of 128"):
        block_quant(np.ones((128, 100), np.float32))


def _inputs(kind, rng, m=256, k=256, n=256):
    if kind == "massive":
        x = rng.standard_normal((m, k))
        x.flat[rng.choice(x.size, 3, replace=False)] = [1e4, -3e4, 1e5]
    else:
        x = rng.choice([-1.0, 1.0], (m, k)) * np.exp(2.0 * rng.standard_normal((m, k)))
    w = rng.standard_normal((k, n)) / np.sqrt(k)
    dy = rng.standard_normal((m, n))
    return x.astype(np.float32), w.astype(np.float32), dy.astype(np.float32)


@pytest.mark.parametrize("kind", ["massive", "lognormal"])
def test_deepseek_v3_loses_no_more_than_deepseeks_quantization(kind):
    # Fprop and Wgrad error of the preset at a general linear within 15% of
    # the reference's on heavy-tailed inputs; the power-of-two variant is not.
    x, w, dy = _inputs(kind, np.random.default_rng(1))
    x64, w64, dy64 = (a.astype(np.float64) for a in (x, w, dy))
    exact = (x64 @ w64, dy64 @ w64.T, x64.T @ dy64)
    ref = [relative_error(a, e) for a, e in zip(reference_linear(x, w, dy), exact)]
    got = [
        relative_error(a, e)
        for a, e in zip(linear_outputs(fp8jax.recipes.deepseek_v3(), x, w, dy), exact)
    ]
    pow2x = fp8jax.recipes.deepseek_v3_pow2x()
    var = [relative_error(a, e) for a, e in zip(linear_outputs(pow2x, x, w, dy), exact)]
    for i in (0, 2):
        assert got[i] <= 1.15 * ref[i], (i, got[i], ref[i])
    assert var[0] > 1.15 * ref[0]
