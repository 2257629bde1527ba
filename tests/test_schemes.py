"""The scheme registry: one spec quantizer for every format, checked against numpy."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import fp8jax
from fp8jax import microscaling, schemes
from fp8jax.recipes import QuantSpec


def _x(shape=(4, 256), seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) * np.exp(rng.uniform(-4, 4, shape[-1]))).astype(np.float32)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize(
    "spec",
    [
        QuantSpec("e4m3", "tile", 128),
        QuantSpec("e4m3", "tile", 128, pow2=True),
        QuantSpec("e5m2", "row"),
        QuantSpec("e4m3", "block", 128, amax_floor=1e-3),
    ],
)
def test_fp8_spec_is_the_format_quantizer(spec, jit):
    x = jnp.asarray(_x())
    f = (
        (lambda t: schemes.quantize(t, spec, 1))
        if not jit
        else jax.jit(lambda t: schemes.quantize(t, spec, 1))
    )
    q = f(x)
    ref = fp8jax.quantize(
        x,
        spec.fmt,
        spec.granularity,
        axis=1,
        tile=spec.tile,
        pow2=spec.pow2,
        amax_floor=spec.amax_floor,
    )
    assert q.scheme == "fp8" and (q.granularity, q.axis, q.tile) == (ref.granularity, 1, spec.tile)
    np.testing.assert_array_equal(
        np.asarray(q.data).view(np.uint8), np.asarray(ref.data).view(np.uint8)
    )
    np.testing.assert_array_equal(np.asarray(q.scale), np.asarray(ref.scale))
    if spec.pow2:
        m, _ = np.frexp(np.asarray(q.scale, np.float64))
        assert np.all(m == 0.5)  # every scale a power of two


def test_given_scale_and_amax():
    x = _x()
    spec = QuantSpec("e4m3", "row")
    amax = np.full((4, 1), 2.0 * np.abs(x).max(), np.float32)
    q = schemes.quantize(jnp.asarray(x), spec, 1, amax=jnp.asarray(amax))
    # scale = amax / 448, correctly rounded; codes = e4m3(x / scale).
    s = (amax.astype(np.float64) / 448).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(q.scale), s)
    want = (x.astype(np.float64) / s).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(q.data).view(np.uint8), want.view(np.uint8))
    delayed = QuantSpec("e4m3", "tensor", scaling="delayed")
    with pytest.raises(ValueError, match="scale="):
        schemes.quantize(jnp.asarray(x), delayed, 1)
    qd = schemes.quantize(jnp.asarray(x), delayed, 1, scale=jnp.float32(0.5))
    np.testing.assert_array_equal(
        np.asarray(fp8jax.dequantize(qd)), np.asarray(qd.data, np.float32) * 0.5
    )


@pytest.mark.parametrize("fmt,scheme", [("mxfp8", "mx"), ("nvfp4", "nvfp4")])
def test_block_formats_and_element_scales(fmt, scheme):
    x = _x((4, 64))
    spec = QuantSpec(fmt, "tile", 32 if fmt == "mxfp8" else 16)
    q = schemes.quantize(jnp.asarray(x), spec, 1)
    ref = (
        microscaling.quantize_mxfp8(jnp.asarray(x), 1)
        if fmt == "mxfp8"
        else (microscaling.quantize_nvfp4(jnp.asarray(x), 1))
    )
    assert q.scheme == scheme and q.granularity == "tile" and q.tile == spec.tile
    np.testing.assert_array_equal(
        np.asarray(fp8jax.dequantize(q)), np.asarray(fp8jax.dequantize(ref))
    )
    # Every element's value is its code times its element scale (float64).
    s = np.broadcast_to(np.asarray(schemes.element_scale(q), np.float64), x.shape)
    codes = np.asarray(q.data.astype(jnp.float32), np.float64)
    np.testing.assert_allclose(np.asarray(fp8jax.dequantize(q), np.float64), codes * s, rtol=1e-6)
    with pytest.raises(ValueError, match="own scales"):
        schemes.quantize(jnp.asarray(x), spec, 1, scale=jnp.float32(1.0))
    assert schemes.requantizes_codes("e4m3") and not schemes.requantizes_codes(fmt)
    with pytest.raises(ValueError, match="fp8jax.dequantize"):
        fp8jax.quant.dequantize(q)


def test_fp8_element_scale_and_bad_spec():
    x = _x()
    q = schemes.quantize(jnp.asarray(x), QuantSpec("e4m3", "tile", 128), 1)
    s = np.asarray(schemes.element_scale(q), np.float64)
    assert s.shape == x.shape
    np.testing.assert_array_equal(np.repeat(np.asarray(q.scale, np.float64), 128, axis=1), s)
    with pytest.raises(ValueError, match="quantized spec"):
        schemes.quantize(jnp.asarray(x), QuantSpec(None, "tensor"), 1)


def test_fp8_ue8m0_spec_quantizes_with_e8m0_bytes_and_same_element_scales():
    x = jnp.asarray(np.random.default_rng(5).standard_normal((64, 256)) * 10, jnp.float32)
    f32 = QuantSpec("e4m3", "tile", 128, pow2=True)
    e8 = QuantSpec("e4m3", "tile", 128, pow2=True, scale_fmt="ue8m0")
    a, b = schemes.quantize(x, f32, 1), schemes.quantize(x, e8, 1)
    assert b.scale.dtype == jnp.dtype(ml_dtypes.float8_e8m0fnu)
    np.testing.assert_array_equal(
        np.asarray(schemes.element_scale(a)), np.asarray(schemes.element_scale(b))
    )
    # The caller's amax path (an expert's tokens) stores bytes as well.
    amax = jnp.full((64, 2), 3.0, jnp.float32)
    c = schemes.quantize(x, e8, 1, amax=amax)
    assert np.asarray(c.scale).view(np.uint8).tolist() == [[127 - 7] * 2] * 64  # 2^-7 >= 3/448
    with pytest.raises(ValueError, match="powers of two"):
        schemes.quantize(x, e8, 1, scale=jnp.float32(0.1))
