"""Operand telemetry: amax, saturated and flushed fractions against float64 references."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import fp8jax
from fp8jax import quant, telemetry


def _awkward(dtype) -> np.ndarray:
    """Normals over a wide range, subnormals, zeros, NaN and +-Inf."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((6, 256)) * np.exp(rng.uniform(-20, 20, (6, 1)))
    x[1, :40] = rng.integers(-9, 10, 40) * float(np.finfo(dtype).smallest_subnormal)
    x[2, 7], x[3, 9], x[4, [3, 4]] = np.nan, np.inf, [-np.inf, np.nan]
    x[5, :128] = 0
    return x.astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
@pytest.mark.parametrize("jit", [False, True])
def test_operand_stats_is_the_three_definitions_in_one_pass(jit, dtype):
    x = jnp.asarray(_awkward(dtype))
    # Scales from a tame copy, so that the awkward rows saturate and flush.
    q = quant.quantize(jnp.ones_like(x) * 1e-3, fp8jax.E4M3, "tile", -1, 128)
    stats = (jax.jit(telemetry.operand_stats) if jit else telemetry.operand_stats)(x, q)
    x64 = np.asarray(x).astype(np.float64)
    finite = np.isfinite(x64)
    assert float(stats["amax"]) == np.abs(x64[finite]).max()
    # The one-pass fractions are the separate definitions' values, bit for bit.
    sat = telemetry.saturated_fraction(x, q)
    flushed = telemetry.flushed_fraction(x, q.data)
    np.testing.assert_array_equal(np.asarray(stats["saturated"]), np.asarray(sat))
    np.testing.assert_array_equal(np.asarray(stats["flushed"]), np.asarray(flushed))
    # Against float64: |x / s| past the clip threshold; non-zero values whose code is 0.
    s = np.asarray(quant.dequantize(q) / q.data.astype(jnp.float32), np.float64)
    clip = telemetry.clip_threshold(fp8jax.E4M3)
    n = np.float32(x64.size)
    n_sat = np.sum(finite & (np.abs(np.where(finite, x64, 0) / s) > clip))
    codes = np.asarray(q.data).astype(np.float64)
    n_flushed = np.sum(finite & (x64 != 0) & (codes == 0))
    # The fractions: exact counts, one float32 division.
    assert float(stats["saturated"]) == np.float32(n_sat) / n
    assert float(stats["flushed"]) == np.float32(n_flushed) / n
    assert 0 < float(stats["saturated"]) < 1


@pytest.mark.parametrize("jit", [False, True])
def test_saturated_counts_by_the_quantizers_quotient_under_subnormal_scales(jit):
    # Tiles of tiny values have float32-subnormal scales; a CPU flushes them
    # to zero in a plain division.  Row 0: online scales, nothing clipped.
    # Rows 1-2: one given subnormal scale, values on both sides of the clip
    # threshold (|x / s| rounded to float32 above max + ulp(max) / 2).
    rng = np.random.default_rng(5)
    s = np.float32(3e-40)  # subnormal
    x = np.zeros((3, 128), np.float32)
    x[0] = rng.uniform(-1, 1, 128).astype(np.float32) * np.float32(1e-37)
    x[1:] = (rng.uniform(300, 600, (2, 128)) * np.float64(s)).astype(np.float32)
    online = quant.quantize(jnp.asarray(x[:1]), fp8jax.E4M3, "tile", -1, 128)
    given = quant.quantize_with_scale(jnp.asarray(x[1:]), jnp.full((2, 1), s), fp8jax.E4M3)
    stats = jax.jit(telemetry.operand_stats) if jit else telemetry.operand_stats
    assert np.asarray(online.scale).view(np.int32).max() < 0x00800000  # subnormal
    assert float(stats(jnp.asarray(x[:1]), online)["saturated"]) == 0.0
    # float64 reference: clipped iff |x| / s > max + ulp(max) / 2 + ulp32 / 2,
    # the midpoint above the threshold (464 is even, a tie rounds down to it);
    # both products below are exact in float64.
    edge = telemetry.clip_threshold(fp8jax.E4M3) + 2.0 ** (8 - 23) / 2
    n_sat = np.sum(np.abs(x[1:].astype(np.float64)) > edge * np.float64(s))
    assert 0 < n_sat < x[1:].size
    got = stats(jnp.asarray(x[1:]), given)["saturated"]
    assert float(got) == np.float32(n_sat) / np.float32(x[1:].size)
    # The quantizer agrees: those elements became +-max (with any that round to it).
    codes = np.abs(np.asarray(given.data).astype(np.float64))
    assert np.sum(codes == 448) >= n_sat


def test_operand_stats_of_plain_and_empty_operands():
    x = jnp.asarray(np.float32([[1.0, -5.0, np.inf]]))
    plain = telemetry.operand_stats(x, x)
    assert float(plain["amax"]) == 5.0
    assert float(plain["saturated"]) == 0.0 and float(plain["flushed"]) == 0.0
    empty = jnp.zeros((0, 4), jnp.float32)
    assert all(float(v) == 0.0 for v in telemetry.operand_stats(empty, empty).values())


@pytest.mark.parametrize("fmt", [fp8jax.E4M3, fp8jax.E5M2])
@pytest.mark.parametrize("jit", [False, True])
def test_clipped_by_product_is_the_quotients_answer(jit, fmt):
    # The CPU's float64 product test against the quantizer's quotient, element
    # for element, on values a few ulps either side of t * s for normal,
    # subnormal, huge, zero, negative, Inf and NaN scales, and on NaN / Inf x.
    t = telemetry.clip_threshold(fmt)
    rng = np.random.default_rng(3)
    n = 60000
    s_bits = np.concatenate(
        [
            rng.integers(1, 0x00800000, n // 4),
            rng.integers(0x00800000, 0x7F000000, n - n // 4),
        ]
    ).astype(np.int32)
    s = s_bits.view(np.float32).copy()
    with np.errstate(over="ignore", under="ignore"):
        edge = (np.float64(t) * s.astype(np.float64)).astype(np.float32)
    x = (edge.view(np.int32) + rng.integers(-3, 4, n).astype(np.int32)).view(np.float32)
    x = np.where(rng.random(n) < 0.5, -x, x).astype(np.float32)
    x[:8] = [np.nan, np.inf, -np.inf, 0.0, 1e-45, 3e38, -3e38, 5.0]
    s[8:12] = [0.0, -1.0, np.inf, np.nan]
    f = lambda g: jax.jit(g) if jit else g
    by_quotient = f(lambda x, s: telemetry._clipped_by_quotient(x, s, t))(x, s)
    by_product = f(lambda x, s: telemetry._clipped_by_product(x, s, t))(x, s)
    np.testing.assert_array_equal(np.asarray(by_product), np.asarray(by_quotient))
    # Both sides occur, and a non-finite x or a scale without a value never clips.
    assert 0 < int(np.asarray(by_product).sum()) < n
    assert not np.asarray(by_product)[[0, 1, 2, 8, 9, 11]].any()


def _with_given_scales(x: np.ndarray, granularity: str, axis: int, fmt, scale_fmt) -> quant.QTensor:
    """x's quantization with scales from a tame copy of it, so that x saturates and flushes."""
    tame = jnp.full(x.shape, 1e-3, x.dtype)
    pow2 = scale_fmt == "ue8m0"
    q = quant.quantize(tame, fmt, granularity, axis, 128, pow2=pow2, scale_fmt=scale_fmt)
    scale = quant.scale_values(q)
    data = quant.quantize_with_scale(jnp.asarray(x), scale, fmt, granularity, axis, 128).data
    return quant.QTensor(data, q.scale, q.layout)


@pytest.mark.parametrize(
    ("shape", "granularity", "axis"),
    [((6, 300), "tile", -1), ((3, 200, 5), "tile", 1), ((2, 130, 270), "block", -1)],
)
@pytest.mark.parametrize(
    ("dtype", "fmt", "scale_fmt"),
    [
        (np.float32, fp8jax.E4M3, "float32"),
        (ml_dtypes.bfloat16, fp8jax.E5M2, "float32"),
        (np.float32, fp8jax.E4M3, "ue8m0"),
    ],
)
@pytest.mark.parametrize("jit", [False, True])
def test_flushed_counts_subnormal_elements(jit, shape, granularity, axis, dtype, fmt, scale_fmt):
    # Subnormal elements of x are non-zero: flushed wherever their code is 0,
    # op by op as under jit (XLA's CPU compares a subnormal with zero as zero
    # in some kernels).  Partial tiles and blocks, zeros, NaN and +-Inf in x.
    rng = np.random.default_rng(7)
    x = rng.standard_normal(shape) * np.exp(rng.uniform(-25, 25, shape))
    flat = x.reshape(-1)
    flat[:50] = rng.integers(-9, 10, 50) * float(np.finfo(dtype).smallest_subnormal)
    flat[[60, 61, 62, 63]] = [np.nan, np.inf, -np.inf, 0.0]
    x = x.astype(dtype)
    q = _with_given_scales(x, granularity, axis, fmt, scale_fmt)
    x64, codes = x.astype(np.float64), np.asarray(q.data).astype(np.float64)
    n_flushed = np.sum(np.isfinite(x64) & (x64 != 0) & (codes == 0))
    assert np.sum((x64 != 0) & (np.abs(x64) < np.finfo(np.float32).tiny) & (codes == 0)) > 0
    f = (lambda g: jax.jit(g)) if jit else (lambda g: g)
    stats = f(telemetry.operand_stats)(jnp.asarray(x), q)
    share = np.float32(n_flushed) / np.float32(x.size)
    assert float(stats["flushed"]) == share
    assert float(f(telemetry.flushed_fraction)(jnp.asarray(x), q.data)) == share
