import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from reference import ref_cast, ref_round_e5m6

import fp8jax
from fp8jax import formats
from fp8jax.formats import (
    as_format,
    e5m6_scale_exponent,
    float32_from_parts,
    fmt_max,
    fmt_tiny,
    fp8_codes,
    ldexp_exact,
    round_to_e5m6,
    saturating_cast,
)


@pytest.mark.parametrize(
    "fmt,mx",
    [
        (fp8jax.E4M3, 448.0),
        (fp8jax.E5M2, 57344.0),
        (fp8jax.E4M3FNUZ, 240.0),
        (fp8jax.E5M2FNUZ, 57344.0),
    ],
)
def test_fmt_max(fmt, mx):
    assert fmt_max(fmt) == mx


def test_as_format_names():
    assert as_format("e4m3") == fp8jax.E4M3
    assert as_format("float8_e5m2") == fp8jax.E5M2
    assert as_format("e8m0") == fp8jax.E8M0
    with pytest.raises(ValueError):
        as_format("e3m4x")


def test_plain_cast_is_not_saturating_but_ours_is():
    x = jnp.array([500.0, -1e6, 448.0, 449.0], jnp.float32)
    plain = np.asarray(x.astype(fp8jax.E4M3)).astype(np.float32)
    assert np.isnan(plain[0])  # the trap the saturating cast avoids
    for fn in (saturating_cast, jax.jit(saturating_cast, static_argnums=1)):
        ours = np.asarray(fn(x, fp8jax.E4M3)).astype(np.float32)
        np.testing.assert_array_equal(ours, [448.0, -448.0, 448.0, 448.0])


@pytest.mark.parametrize("fmt", [fp8jax.E4M3, fp8jax.E5M2, fp8jax.E4M3FNUZ, fp8jax.E5M2FNUZ])
@pytest.mark.parametrize("jit", [False, True])
def test_saturating_cast_matches_reference(fmt, jit):
    rng = np.random.default_rng(0)
    m = fmt_max(fmt)
    x = np.concatenate(
        [
            rng.standard_normal(1000) * m / 4,
            rng.standard_normal(100) * m * 100,
            [0.0, -0.0, m, -m, 2 * m, 1e-12, -1e-12, np.inf, -np.inf, np.nan],
        ]
    ).astype(np.float32)
    ref = ref_cast(x, ml_dtypes.finfo(fmt).dtype)
    f = jax.jit(saturating_cast, static_argnums=1) if jit else saturating_cast
    ours = np.asarray(f(jnp.asarray(x), fmt))
    np.testing.assert_array_equal(ours.view(np.uint8), ref.view(np.uint8))
    # Finite values saturate; non-finite ones stay non-finite (used to become +-max).
    out = ours.astype(np.float32)
    assert np.all(np.abs(out[:-3]) <= m)
    assert not np.any(np.isfinite(out[-3:]))
    if fmt == fp8jax.E5M2:  # the only one of these with an Inf
        assert out[-3] == np.inf and out[-2] == -np.inf
    else:
        assert np.all(np.isnan(out[-3:]))


def _f32_specials(rng, n=3000):
    tiny = np.finfo(np.float32).tiny
    return np.concatenate(
        [
            rng.standard_normal(n).astype(np.float32) * np.float32(1e-40),  # subnormals
            (rng.standard_normal(n) * np.exp(rng.uniform(-100, 88, n))).astype(np.float32),
            np.float32([0.0, -0.0, 2.0**-149, -(2.0**-149), tiny, np.nextafter(tiny, 0)]),
            np.float32([np.finfo(np.float32).max, np.inf, -np.inf, np.nan]),
        ]
    ).astype(np.float32)


@pytest.mark.parametrize("k", [-200, -140, -64, -1, 0, 1, 64, 127, 300])
@pytest.mark.parametrize("jit", [False, True])
def test_ldexp_exact_matches_numpy(k, jit):
    # numpy's float32 ldexp is correctly rounded with subnormals; XLA on CPU
    # flushes them, which ldexp_exact must not.
    x = _f32_specials(np.random.default_rng(k + 1000))
    f = jax.jit(ldexp_exact) if jit else ldexp_exact
    got = np.asarray(f(jnp.asarray(x), k))
    with np.errstate(over="ignore", under="ignore"):
        ref = np.ldexp(x, k).astype(np.float32)
    np.testing.assert_array_equal(got.view(np.int32), ref.view(np.int32))


@pytest.mark.parametrize("jit", [False, True])
def test_float32_from_parts_rounds_like_float64(jit):
    rng = np.random.default_rng(7)
    m = rng.integers(0, 2**30, 5000, dtype=np.int64)
    m[:8] = [0, 1, 2**24 - 1, 2**24 + 1, 3 * 2**22, 2**29 + 2**5, 5, 2**30 - 1]
    e = rng.integers(-185, 110, 5000)
    neg = rng.random(5000) < 0.5
    f = jax.jit(float32_from_parts) if jit else float32_from_parts
    got = np.asarray(f(jnp.asarray(neg), jnp.asarray(m, jnp.int32), jnp.asarray(e, jnp.int32)))
    # m * 2^e is exact in float64 (m < 2^30, e within float64's range); the
    # float64 -> float32 cast rounds once, to nearest even, subnormals kept.
    with np.errstate(over="ignore", under="ignore"):
        ref = (np.where(neg, -1.0, 1.0) * np.ldexp(m.astype(np.float64), e)).astype(np.float32)
    np.testing.assert_array_equal(got.view(np.int32), ref.view(np.int32))


@pytest.mark.parametrize("jit", [False, True])
def test_round_to_e5m6_matches_float64_reference(jit):
    rng = np.random.default_rng(8)
    x = np.concatenate(
        [
            (rng.standard_normal(4000) * np.exp(rng.uniform(-18, 12, 4000))).astype(np.float32),
            # Exact ties between two E5M6 values (7 bits: the last one a half).
            (rng.integers(64, 128, 500) * 2 + 1).astype(np.float32) * np.float32(2.0**-7),
            np.float32([2.0**-20, 2.0**-21, 3 * 2.0**-21, 2.0**-14, 65024.0, 65280.0, 65279.0]),
            np.float32([65536.0, 1e30, -1e30, 0.0, -0.0, 1e-40, np.inf, -np.inf, np.nan]),
        ]
    ).astype(np.float32)
    f = jax.jit(round_to_e5m6) if jit else round_to_e5m6
    got = np.asarray(f(jnp.asarray(x)))
    assert got.dtype == np.float32
    ref = ref_round_e5m6(x)
    np.testing.assert_array_equal(got.astype(np.float64)[~np.isnan(ref)], ref[~np.isnan(ref)])
    assert np.all(np.isnan(got[np.isnan(ref)]))
    # Saturating: the largest magnitude is 65024; ties went to even mantissas.
    assert np.max(np.abs(got[np.isfinite(got)])) == 65024.0
    np.testing.assert_array_equal(got[-9:-6], [65024.0, 65024.0, -65024.0])


@pytest.mark.parametrize("jit", [False, True])
def test_e5m6_scale_exponent_is_the_smallest_power_of_two_that_fits(jit):
    rng = np.random.default_rng(10)
    edges = [65024.0 * 2.0**j for j in (-140, -20, -1, 0, 1, 40, 112)]
    amax = np.concatenate(
        [
            np.abs(rng.standard_normal(3000) * np.exp(rng.uniform(-100, 88, 3000))),
            edges,
            [np.nextafter(np.float32(v), np.float32(np.inf)) for v in edges],
            [np.nextafter(np.float32(v), np.float32(0)) for v in edges],
            [0.0, 1e-45, 1e-40, 2.0**-126, 1.0, 32512.0, 32768.0, 3.4028235e38],
        ]
    ).astype(np.float32)
    f = jax.jit(e5m6_scale_exponent) if jit else e5m6_scale_exponent
    got = np.asarray(f(jnp.asarray(amax)))
    # The rule in float64: the smallest k with amax <= 65024 * 2^k (0 for amax 0).
    a64 = amax.astype(np.float64)
    fits = a64 <= 65024.0 * np.ldexp(1.0, got)
    fits_below = a64 <= 65024.0 * np.ldexp(1.0, got - 1)
    assert np.all(fits[a64 > 0]) and not np.any(fits_below[a64 > 0])
    assert got[a64 == 0].tolist() == [0]


def test_round_to_e5m6_agrees_with_float16_where_e5m6_is_coarser():
    # Independent check: E5M6 values are float16 values with the 4 lowest
    # mantissa bits zero, and rounding float16-exact inputs needs no float32.
    rng = np.random.default_rng(9)
    h = rng.standard_normal(2000).astype(np.float16)
    got = np.asarray(round_to_e5m6(jnp.asarray(h.astype(np.float32)))).astype(np.float16)
    assert np.all((got.view(np.uint16) & 0xF) == 0)
    assert np.all(np.abs(got.astype(np.float64) - h) <= np.abs(h.astype(np.float64)) * 2.0**-7)


def test_bf16_input():
    x = jnp.array([1000.0, 1.5], jnp.bfloat16)
    out = np.asarray(saturating_cast(x, fp8jax.E4M3)).astype(np.float32)
    np.testing.assert_array_equal(out, [448.0, 1.5])


def _boundary_values(fmt) -> np.ndarray:
    """Every code's value, the float32 neighbours of every midpoint between codes, NaN, Inf."""
    codes = np.arange(256, dtype=np.uint8).view(fmt).astype(np.float64)
    vals = np.unique(codes[np.isfinite(codes) & (codes >= 0)])
    mids = (vals[:-1] + vals[1:]) / 2  # exact in float64, and in float32
    mids32 = mids.astype(np.float32)
    near = [mids32, np.nextafter(mids32, 0), np.nextafter(mids32, np.inf)]
    nans = np.array([0x7FC00000, 0x7F800001, 0x7FFFFFFF, 0x7F800000], np.uint32).view(np.float32)
    pos = np.concatenate([vals.astype(np.float32), *near, [np.float32(2.0**-130)], nans])
    return np.concatenate([pos, -pos]).astype(np.float32)


@pytest.mark.parametrize("fmt", [fp8jax.E4M3, fp8jax.E5M2])
@pytest.mark.parametrize("jit", [False, True])
def test_fp8_codes_is_the_cast_at_every_rounding_boundary(fmt, jit):
    rng = np.random.default_rng(1)
    m = fmt_max(fmt)
    # float32 throughout: a signalling NaN widened to float64 raises numpy's
    # invalid-value warning.
    x = np.concatenate(
        [
            _boundary_values(fmt),
            np.clip(rng.standard_normal(20000) * m / 8, -m, m).astype(np.float32),
            rng.uniform(-4 * fmt_tiny(fmt), 4 * fmt_tiny(fmt), 2000).astype(np.float32),
        ]
    )
    ref = x.astype(fmt)  # ml_dtypes: round to nearest even
    f = jax.jit(fp8_codes, static_argnums=1) if jit else fp8_codes
    ours = np.asarray(f(jnp.asarray(x), fmt))
    assert ours.dtype == fmt
    np.testing.assert_array_equal(ours.view(np.uint8), ref.view(np.uint8))


def test_fp8_codes_refuses_other_formats():
    with pytest.raises(ValueError, match="E4M3FN or E5M2"):
        fp8_codes(jnp.zeros(4, jnp.float32), fp8jax.E4M3FNUZ)


def test_saturating_cast_materializes_the_cpu_codes():
    """On a CPU the integer codes of a large operand are one pass behind an optimization
    barrier: a consumer of the codes (here their bfloat16 widening) reads them, the
    rounding is not traced into it again.  A small operand takes XLA's conversion."""
    if jax.default_backend() != "cpu":
        pytest.skip("the integer codes are the CPU's conversion")

    def f(x):
        return saturating_cast(x, fp8jax.E4M3).astype(jnp.bfloat16)

    big = jax.ShapeDtypeStruct((formats.CPU_CODES_MIN_SIZE // 8, 8), jnp.float32)
    text = str(jax.make_jaxpr(f)(big))
    assert text.count("optimization_barrier") == 1
    # The barrier holds the FP8 codes, and the widening reads its result.
    assert f"f8_e4m3fn[{big.shape[0]},8] = optimization_barrier" in text
    small = str(jax.make_jaxpr(f)(jnp.zeros((4, 8), jnp.float32)))
    assert "optimization_barrier" not in small and "f8_e4m3fn[4,8] = convert_element_type" in small


@pytest.mark.parametrize("jit", [False, True])
def test_float64_magnitude_is_exact_for_every_float32(jit):
    # Subnormals (which XLA's CPU arithmetic flushes), both signs, the largest
    # values, +-Inf and NaN: |x| in float64, as NumPy widens it.
    rng = np.random.default_rng(11)
    bits = np.concatenate(
        [np.arange(0, 5000), np.arange(0x007FF000, 0x00801000), rng.integers(0, 0x7F800000, 20000)]
    ).astype(np.int32)
    x = bits.view(np.float32)
    x = np.concatenate([x, -x, np.float32([np.inf, -np.inf, np.nan])])
    f = jax.jit(formats.float64_magnitude) if jit else formats.float64_magnitude
    got = np.asarray(f(jnp.asarray(x)))
    assert got.dtype == np.float64
    np.testing.assert_array_equal(got, np.abs(x.astype(np.float64)))


@pytest.mark.parametrize("fmt", [fp8jax.E4M3, fp8jax.E5M2])
@pytest.mark.parametrize("jit", [False, True])
def test_saturating_cast_gives_the_casts_codes_on_both_sides_of_the_cpu_size_switch(jit, fmt):
    # Below CPU_CODES_MIN_SIZE a CPU takes XLA's conversion, from it on the
    # integer codes: the same bytes as ml_dtypes' cast of the clipped values.
    m = float(ml_dtypes.finfo(fmt).max)
    rng = np.random.default_rng(12)
    for n in (formats.CPU_CODES_MIN_SIZE - 1, formats.CPU_CODES_MIN_SIZE):
        y = (rng.standard_normal(n) * np.exp(rng.uniform(-20, 12, n))).astype(np.float32)
        y[:6] = [np.nan, np.inf, -np.inf, 1e30, -0.0, 1e-45]
        f = lambda v: formats.saturating_cast(v, fmt)
        got = np.asarray((jax.jit(f) if jit else f)(jnp.asarray(y))).view(np.uint8)
        want = np.where(np.isinf(y), y, np.clip(y, -m, m)).astype(np.float32).astype(fmt)
        np.testing.assert_array_equal(got, want.view(np.uint8))


@pytest.mark.parametrize("jit", [False, True])
def test_float32_bits_of_float64_round_once_subnormals_included(jit):
    # float64 values across float32's subnormal range, its normal boundary,
    # exact float32 midpoints, the top of its range, +Inf and NaN of either
    # sign: NumPy's
    # conversion (which keeps subnormals) gives the bits.
    rng = np.random.default_rng(13)
    p = np.concatenate(
        [
            np.exp2(rng.uniform(-160, 127.9, 20000)),
            np.exp2(rng.uniform(-127, -125, 5000)),
            (np.arange(1, 2000) + 0.5) * 2.0**-149,
            [0.0, 2.0**-126, np.inf, np.nan, -np.nan],
            # Half the smallest subnormal (to even: 0) and just above it (1);
            # float64 subnormals; float32's top midpoint (to even: +Inf), just
            # below it (the largest finite) and far beyond.
            [2.0**-150, np.nextafter(2.0**-150, 1.0), 5e-324, 2.0**-1030],
            [2.0**128 - 2.0**103, np.nextafter(2.0**128 - 2.0**103, 0.0), 1e300],
        ]
    )
    f = jax.jit(formats.float32_bits_of_float64) if jit else formats.float32_bits_of_float64
    with jax.enable_x64(True):
        got = np.asarray(f(jnp.asarray(p, jnp.float64)))
    want = p.astype(np.float32).view(np.int32)
    np.testing.assert_array_equal(got, want)
