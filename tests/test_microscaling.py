import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import reference_microscaling as ref

from fp8jax import microscaling as mx
from fp8jax.formats import E4M3, E5M2

E4M3_NP = ml_dtypes.float8_e4m3fn


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view({1: np.uint8, 4: np.uint32}[a.dtype.itemsize])


def _edge_tensor(shape, seed=0) -> np.ndarray:
    """Random values over many binades plus the edge cases both quantizers must handle."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * np.exp2(rng.integers(-12, 12, shape))
    x = x.astype(np.float32).reshape(-1, shape[-1])
    c = shape[-1]
    x[0, : min(c, 40)] = 0.0  # all-zero blocks
    x[1, :] = rng.standard_normal(c).astype(np.float32) * 1e-3
    x[1, 0] = 448.0  # block with E4M3 subnormals next to the max
    x[2, :] = 1e-39  # float32 subnormals (flushed to zero)
    x[3, :] = -(2.0**-130)
    x[4, 1] = np.nan
    x[5, 2] = np.inf
    x[5, 3] = -np.inf
    x[6, : min(c, 32)] = 511.0  # scaled past 448: clamps
    # Ties: with block amax 448 (MX shared exponent 0) 1.0625 is halfway
    # between E4M3 1.0 and 1.125; 0.25 / 2.5 / 5 are E2M1 ties when the
    # NVFP4 block scale maps them exactly (block amax 6 * 2^k).
    x[7, : min(c, 32)] = 1.0625
    x[7, 0] = 448.0
    x[8, :16] = np.array([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] * 2, np.float32)[: min(c, 16)]
    x[9, :] = -(2.0**120)  # huge: shared exponent near the top of E8M0
    return x.reshape(shape)


SHAPES_AXES = [((10, 77), -1), ((10, 77), 0), ((3, 10, 45), 1), ((10, 33), -1)]
# Every layout eagerly; under jit one layout per format (compiles are slow).
CASES = [(s, a, False) for s, a in SHAPES_AXES] + [((3, 10, 45), 1, True)]


@pytest.mark.parametrize("shape,axis,jit", CASES)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e2m1"])
def test_mx_bit_exact_vs_reference(shape, axis, fmt, jit):
    jfmt, nfmt = {
        "e4m3": (E4M3, E4M3_NP),
        "e5m2": (E5M2, ml_dtypes.float8_e5m2),
        "e2m1": (mx.E2M1, ml_dtypes.float4_e2m1fn),
    }[fmt]
    x = _edge_tensor(shape)
    f = lambda v: mx.quantize_mx(v, jfmt, axis)  # noqa: E731
    q = (jax.jit(f) if jit else f)(jnp.asarray(x))
    data, scale, deq = ref.mx_quantize(x, nfmt, axis)
    assert q.scale.dtype == jnp.dtype(ml_dtypes.float8_e8m0fnu)
    assert q.scale.shape == scale.shape
    np.testing.assert_array_equal(_bits(q.data), _bits(data))
    np.testing.assert_array_equal(_bits(q.scale), _bits(scale))
    np.testing.assert_array_equal(_bits(mx.dequantize_blocks(q)), _bits(deq))


@pytest.mark.parametrize("shape,axis,jit", CASES)
@pytest.mark.parametrize("two_d", [False, True])
def test_nvfp4_bit_exact_vs_reference(shape, axis, two_d, jit):
    x = _edge_tensor(shape, seed=1)
    f = lambda v: mx.quantize_nvfp4(v, axis, two_d=two_d)  # noqa: E731
    q = (jax.jit(f) if jit else f)(jnp.asarray(x))
    data, scale, s_dec, deq = ref.nvfp4_quantize(x, axis, two_d=two_d)
    assert q.data.dtype == mx.E2M1 and q.scale.dtype == E4M3
    assert q.scale.shape == scale.shape
    np.testing.assert_array_equal(_bits(q.data), _bits(data))
    np.testing.assert_array_equal(_bits(q.scale), _bits(scale))
    assert np.float32(q.tensor_scale) == s_dec
    np.testing.assert_array_equal(_bits(mx.dequantize_blocks(q)), _bits(deq))


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("two_d", [False, True])
def test_nvfp4_stochastic_bit_exact_vs_reference(two_d, jit):
    x = _edge_tensor((10, 45), seed=2)
    key = jax.random.key(7)
    f = lambda v: mx.quantize_nvfp4(v, -1, two_d=two_d, key=key)  # noqa: E731
    q = (jax.jit(f) if jit else f)(jnp.asarray(x))
    bits = np.asarray(jax.random.bits(key, x.shape, jnp.uint32))
    data, scale, _, deq = ref.nvfp4_quantize(x, -1, two_d=two_d, bits=bits)
    np.testing.assert_array_equal(_bits(q.data), _bits(data))
    np.testing.assert_array_equal(_bits(q.scale), _bits(scale))
    np.testing.assert_array_equal(_bits(mx.dequantize_blocks(q)), _bits(deq))


def test_mx_shared_exponent_follows_the_spec():
    # floor(log2 amax) - 8 for E4M3, clamped to E8M0's [-127, 127].
    amax = jnp.array([448.0, 512.0, 511.9, 1.0, 0.0, 1e-39, 2.0**-119, 3.0e38], jnp.float32)
    want = [0, 1, 0, -8, -127, -127, -127, 127 - 8]
    np.testing.assert_array_equal(np.asarray(mx.mx_shared_exponent(amax, E4M3)), want)
    assert mx.element_emax(mx.E2M1) == 2 and mx.element_emax(E5M2) == 15


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
def test_mx_ceil_scale_rounding_bit_exact_vs_reference(fmt, jit):
    jfmt, nfmt = {"e4m3": (E4M3, E4M3_NP), "e2m1": (mx.E2M1, ml_dtypes.float4_e2m1fn)}[fmt]
    x = _edge_tensor((10, 77))
    f = lambda v: mx.quantize_mx(v, jfmt, -1, scale_rounding="ceil")  # noqa: E731
    q = (jax.jit(f) if jit else f)(jnp.asarray(x))
    data, scale, deq = ref.mx_quantize(x, nfmt, -1, scale_rounding="ceil")
    np.testing.assert_array_equal(_bits(q.data), _bits(data))
    np.testing.assert_array_equal(_bits(q.scale), _bits(scale))
    np.testing.assert_array_equal(_bits(mx.dequantize_blocks(q)), _bits(deq))


def test_mx_shared_exponent_ceil_keeps_amax_at_or_below_max():
    # ceil: the smallest e with amax <= 448 * 2^e; one above floor only past 1.75 * 2^k.
    amax = jnp.array([448.0, 449.0, 511.9, 512.0, 1.75, 1.8, 0.0, 1e-39, 3.0e38], jnp.float32)
    want = [0, 1, 1, 1, -8, -7, -127, -127, 120]  # 3e38 = 1.76 * 2^127
    got = np.asarray(mx.mx_shared_exponent(amax, E4M3, "ceil"))
    np.testing.assert_array_equal(got, want)
    a = np.asarray(amax, np.float64)[:6]
    assert np.all(a <= 448.0 * np.exp2(got[:6].astype(np.float64)))
    with pytest.raises(ValueError, match="scale_rounding"):
        mx.mx_shared_exponent(amax, E4M3, "even")


def test_mx_ceil_never_clips_where_floor_does():
    # A block whose amax is 1.9 * 2^k: floor puts it at 486 (clipped to 448); ceil at 243.
    x = np.full((1, 32), 0.01, np.float32)
    x[0, 0] = 1.9 * 2.0**3
    for rule, clipped in (("floor", 448.0 * 2.0**-5), ("ceil", 240.0 * 2.0**-4)):
        q = mx.quantize_mxfp8(jnp.asarray(x), scale_rounding=rule)
        # floor: 15.2 / 2^-5 = 486.4 clips to 448; ceil: 15.2 / 2^-4 = 243.2 rounds to 240.
        assert float(np.asarray(mx.dequantize_blocks(q))[0, 0]) == clipped, rule


def test_mx_values_on_the_grid_are_exact_and_clamp_at_max():
    # One block: amax 448 -> X = 1; every E4M3 value round-trips, 511 clamps.
    grid = np.arange(0, 127, dtype=np.uint8).view(E4M3_NP).astype(np.float32)[:32]
    x = np.concatenate([[448.0], grid[1:]]).astype(np.float32)
    q = mx.quantize_mxfp8(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(mx.dequantize_blocks(q)), x)
    y = np.full(32, 1.0, np.float32)
    y[0] = 511.0  # floor(log2 511) = 8 -> X = 1, 511 > 448 clamps
    assert float(mx.dequantize_blocks(mx.quantize_mxfp8(jnp.asarray(y)))[0]) == 448.0


def test_nvfp4_block_max_maps_to_six_and_scales_are_two_level():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 64)).astype(np.float32)
    q = mx.quantize_nvfp4(jnp.asarray(x))
    # The tensor amax sits at 6 * 448 after the tensor scale: its block
    # scale is exactly 448 and its element exactly +-6.
    i = np.unravel_index(np.argmax(np.abs(x)), x.shape)
    assert float(q.scale[i[0], i[1] // 16].astype(jnp.float32)) == 448.0
    assert abs(float(q.data[i].astype(jnp.float32))) == 6.0
    np.testing.assert_allclose(float(q.tensor_scale), np.abs(x).max() / 2688.0, rtol=1e-7)
    # Per element: at most half the widest E2M1 gap (1, between 4 and 6)
    # times the decode scale, which is amax_b / 6 within E4M3's rounding
    # (2^-4): |err| <= amax_b / 6 * (1 + 2^-4).
    amax_b = np.repeat(np.abs(x).reshape(4, 4, 16).max(-1), 16, axis=1)
    err = np.abs(np.asarray(mx.dequantize_blocks(q)) - x)
    assert (err <= amax_b / 6 * (1 + 2**-4)).all()


def test_nan_and_inf_handling():
    x = np.ones((2, 32), np.float32)
    x[0, 3] = np.nan
    x[1, 4] = np.inf
    d = np.asarray(mx.dequantize_blocks(mx.quantize_mxfp8(jnp.asarray(x))))
    # E4M3 keeps the NaN in its element; Inf saturates to 448 * X.
    assert np.isnan(d[0, 3]) and np.isfinite(np.delete(d[0], 3)).all()
    assert d[1, 4] == 448.0 * 2.0**-8 and d[1, 0] == 1.0
    dn = np.asarray(mx.dequantize_blocks(mx.quantize_nvfp4(jnp.asarray(x))))
    # E2M1 has no NaN: the whole 16-block decodes to NaN, the next block not.
    assert np.isnan(dn[0, :16]).all() and np.isfinite(dn[0, 16:]).all()
    assert np.isfinite(dn[1]).all() and dn[1, 4] == dn[1, :16].max()


def test_layouts_and_errors():
    x = jnp.ones((5, 70, 33))
    assert mx.quantize_mxfp8(x, axis=1).scale.shape == (5, 3, 33)
    assert mx.quantize_nvfp4(x, axis=1).scale.shape == (5, 5, 33)
    assert mx.quantize_nvfp4(x, two_d=True).scale.shape == (5, 5, 3)
    q = mx.quantize_nvfp4(x)
    assert q.nbytes == 5 * 70 * 33 // 2 + q.scale.size + 4  # E2M1 packed two per byte
    with pytest.raises(ValueError, match="1-d"):
        mx.quantize_mxfp8(jnp.float32(1.0))
    with pytest.raises(ValueError, match="2-d"):
        mx.quantize_nvfp4(jnp.ones(16), two_d=True)
    with pytest.raises(ValueError, match="block must be positive"):
        mx.quantize_mx(x, E4M3, block=0)
    with pytest.raises(ValueError, match="unknown block format"):
        mx.fake_quantize(x, "mxfp6")


def test_fake_quantize_error_ordering():
    # Finer / wider formats lose less: MXFP8 << NVFP4 on Gaussian data.
    x = jax.random.normal(jax.random.key(0), (64, 256))
    e8 = jnp.linalg.norm(mx.fake_quantize(x, "mxfp8") - x) / jnp.linalg.norm(x)
    e4 = jnp.linalg.norm(mx.fake_quantize(x, "nvfp4") - x) / jnp.linalg.norm(x)
    assert float(e8) < 0.04 < float(e4) < 0.15
