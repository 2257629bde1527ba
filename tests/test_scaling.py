import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from reference import max_scale, ref_scale

import fp8jax
from fp8jax import scaling


def test_exact_div_matches_numpy_where_xla_rewrites():
    rng = np.random.default_rng(1)
    a = np.abs(rng.standard_normal(20000)).astype(np.float32) * 100
    got = np.asarray(jax.jit(lambda a: scaling.exact_div(a, jnp.float32(448.0)))(a))
    np.testing.assert_array_equal(got, a / np.float32(448.0))


def _jit(f, jit):
    return jax.jit(f) if jit else f


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("fmt", [fp8jax.E4M3, fp8jax.E5M2, fp8jax.E4M3FNUZ])
@pytest.mark.parametrize("jit", [False, True])
def test_scale_from_amax_bitwise_incl_subnormal_and_huge(jit, fmt, pow2):
    rng = np.random.default_rng(2)
    fm = float(ml_dtypes.finfo(fmt).max)
    # Normal amaxes, amaxes whose quotient is subnormal (around fm * 2^-126),
    # float32-subnormal amaxes down to the smallest one, and huge ones.
    amax = np.concatenate(
        [
            [0.0, 1.0, 448.0, 3.7, 1e30, 1e-37, 2.0**-149, 3 * 2.0**-149, 1e-45, 1e-43],
            [np.finfo(np.float32).max, np.nextafter(np.finfo(np.float32).max, 0)],
            np.exp(rng.uniform(np.log(1e-45), np.log(1e-30), 400)),
            fm * 2.0**-126 * rng.uniform(0.98, 1.02, 50),
            np.exp(rng.uniform(0, np.log(3e38), 50)),
        ]
    ).astype(np.float32)
    f = lambda a: scaling.scale_from_amax(a, fmt, pow2=pow2)
    got = np.asarray(_jit(f, jit)(jnp.asarray(amax)))
    ref = np.array([ref_scale(a, fmt, pow2) for a in amax], np.float32)
    np.testing.assert_array_equal(got.view(np.int32), ref.view(np.int32))
    assert np.all(np.isfinite(got)) and np.all(got > 0)
    # The largest code times the scale never overflows.
    assert np.all(np.isfinite(got.astype(np.float64) * fm)) and np.all(
        got * np.float32(fm) < np.inf
    )


@pytest.mark.parametrize("fmt", [fp8jax.E4M3, fp8jax.E5M2])
def test_subnormal_scales_are_the_correctly_rounded_quotient(fmt):
    # amax / fmt_max below float32's normal range: the quotient rounded half
    # to even onto the subnormal grid, from exact rationals.
    from fractions import Fraction

    fm = float(ml_dtypes.finfo(fmt).max)
    limit = int(np.float32(fm * 2.0**-126).view(np.int32))
    rng = np.random.default_rng(5)
    bits = np.concatenate([np.arange(1, 2000), rng.integers(1, limit, 3000), [limit - 1]])
    amax = bits.astype(np.int32).view(np.float32)
    got = np.asarray(scaling.scale_from_amax(jnp.asarray(amax), fmt)).view(np.int32)
    step = Fraction(2) ** -149
    want = [max(round(Fraction(float(a)) / Fraction(fm) / step), 1) for a in amax]
    np.testing.assert_array_equal(got, np.asarray(want, np.int32))


@pytest.mark.parametrize("jit", [False, True])
def test_subnormal_amax_is_not_flushed(jit):
    # Under XLA on CPU a float32 subnormal amax reads as 0 in float arithmetic;
    # the old guard turned such tiles into scale 1 (all-zero data).
    amax = jnp.asarray(np.float32([1e-40, 1e-39, 5e-44]))
    got = np.asarray(_jit(lambda a: scaling.scale_from_amax(a, fp8jax.E4M3), jit)(amax))
    with np.errstate(under="ignore"):
        ref = np.float32([1e-40, 1e-39, 5e-44]) / np.float32(448.0)
    ref[ref == 0] = np.float32(2.0**-149)
    np.testing.assert_array_equal(got, ref)
    x = np.float32([1e-40, -3e-41, 7e-42])
    amx = _jit(scaling.finite_amax, jit)(jnp.asarray(x))
    assert float(amx) == np.float32(1e-40)


@pytest.mark.parametrize("jit", [False, True])
def test_pow2_near_float32_max_stays_finite(jit):
    big = np.float32([3.4e38, np.finfo(np.float32).max, 2.0**127, 1e38])
    s = np.asarray(
        _jit(lambda a: scaling.scale_from_amax(a, fp8jax.E4M3, pow2=True), jit)(jnp.asarray(big))
    )
    assert np.all(s <= max_scale(fp8jax.E4M3, True))
    assert np.all(np.isfinite(s * np.float32(448.0)))
    # Powers of two, and they still cover amax wherever that is representable.
    assert np.all(np.log2(s) == np.round(np.log2(s)))
    cover = big.astype(np.float64) <= 448.0 * s
    np.testing.assert_array_equal(cover, big.astype(np.float64) <= 448.0 * 2.0**119)
    x = jnp.asarray(big[None, :])
    q = fp8jax.quantize(x, fp8jax.E4M3, "tensor", pow2=True)
    d = np.asarray(fp8jax.dequantize(q))
    assert np.all(np.isfinite(d))
    # Values above 448 * max scale saturate there; the rest round normally.
    np.testing.assert_array_equal(d[0, :2], np.float32(448.0 * 2.0**119))
    assert d[0, 2] == 2.0**127
    assert abs(d[0, 3] / 1e38 - 1) <= 2.0**-4


def test_pow2_scales_round_up():
    amax = jnp.array([448.0, 449.0, 1.0, 0.3, 0.0], jnp.float32)
    s = np.asarray(scaling.scale_from_amax(amax, fp8jax.E4M3, pow2=True))
    np.testing.assert_array_equal(s, [1.0, 2.0, 2.0**-8, 2.0**-10, 1.0])
    assert np.all(np.asarray(amax) / s <= 448.0)


def test_amax_floor():
    s = scaling.scale_from_amax(jnp.float32(1e-8), fp8jax.E4M3, amax_floor=1e-4)
    assert float(s) == pytest.approx(1e-4 / 448.0, rel=1e-7)


def test_finite_amax_ignores_nonfinite():
    x = jnp.array([1.0, -3.0, jnp.inf, jnp.nan, -jnp.inf])
    assert float(scaling.finite_amax(x)) == 3.0


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
@pytest.mark.parametrize(
    "shape, axis", [((6, 256), 1), ((6, 96), 1), ((64, 3), 0), ((4, 128, 2, 128), (1, 3))]
)
def test_bits_amax_in_runs_is_the_finite_amax(shape, axis, dtype, jit):
    # Reduced in runs of 32 then over the runs (the CPU's one kernel), or in
    # one reduction: the float64 max over the finite elements, subnormals exact.
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(shape) * np.float64(2.0) ** rng.integers(-140, 20, shape)).astype(
        np.float32
    )
    x.flat[::37] = np.nan
    x.flat[5::41] = -np.inf
    x = x.astype(dtype)
    x64 = np.asarray(x, np.float64)
    want = np.max(np.where(np.isfinite(x64), np.abs(x64), 0.0), axis=axis)
    for runs in (0, 32):
        got = _jit(lambda t, r=runs: scaling._bits_amax(t, axis, False, runs=r), jit)(
            jnp.asarray(x)
        )
        np.testing.assert_array_equal(np.asarray(got, np.float64), want)


def test_delayed_update_max_and_most_recent():
    spec = fp8jax.QuantSpec("e4m3", "tensor", scaling="delayed")
    st = scaling.init_delayed_state(4)
    cfg = fp8jax.DelayedConfig(4, "max", 0)
    for a in [10.0, 448.0 * 2, 5.0]:
        st = scaling.update_delayed_state(st, jnp.float32(a), spec, cfg)
    np.testing.assert_array_equal(np.asarray(st.amax_history), [5.0, 896.0, 10.0, 0.0])
    assert float(st.scale) == pytest.approx(2.0)
    cfg_r = fp8jax.DelayedConfig(4, "most_recent", 1)
    st2 = scaling.update_delayed_state(st, jnp.float32(44.8), spec, cfg_r)
    assert float(st2.scale) == pytest.approx(0.1 * 2.0, rel=1e-6)
    # history_len=1 keeps only the newest amax
    st1 = scaling.update_delayed_state(
        scaling.init_delayed_state(1), jnp.float32(7.0), spec, fp8jax.DelayedConfig(1)
    )
    assert st1.amax_history.shape == (1,)


def test_merge_is_max_not_sum():
    a = scaling.DelayedState(jnp.array([3.0, 1.0]), jnp.float32(3.0 / 448))
    b = scaling.DelayedState(jnp.array([5.0, 1.0]), jnp.float32(5.0 / 448))
    m = scaling.merge_delayed_states(a, b)
    np.testing.assert_array_equal(np.asarray(m.amax_history), [5.0, 1.0])
    assert float(m.scale) == pytest.approx(5.0 / 448)


def test_delayed_requires_tensor_granularity():
    with pytest.raises(ValueError):
        fp8jax.QuantSpec("e4m3", "tile", scaling="delayed")


_SPEC = fp8jax.QuantSpec("e4m3", "tensor", scaling="delayed")


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])  # -Inf is refused (a negative amax)
@pytest.mark.parametrize("jit", [False, True])
def test_delayed_history_ignores_nonfinite_entries(algo, bad, jit):
    # A NaN used to reset the scale to 1, an Inf to give scale Inf (zero or NaN output).
    cfg = fp8jax.DelayedConfig(4, algo, 0)
    st = scaling.DelayedState(jnp.asarray(np.float32([bad, 44.8, 10.0, bad])), jnp.float32(1.0))
    upd = _jit(lambda s, a: scaling.update_delayed_state(s, a, _SPEC, cfg), jit)
    new = upd(st, jnp.float32(4.48))
    want = 44.8 if algo == "max" else 4.48
    assert float(new.scale) == pytest.approx(want / 448.0, rel=1e-6)
    # This step's amax itself non-finite: the newest finite entry / max stands.
    new2 = upd(st, jnp.float32(bad))
    assert float(new2.scale) == pytest.approx(44.8 / 448.0, rel=1e-6)
    x = jnp.linspace(-4.0, 4.0, 64)
    q = fp8jax.quant.quantize_with_scale(x, new2.scale, fp8jax.E4M3, "tensor")
    d = np.asarray(fp8jax.dequantize(q))
    assert np.all(np.isfinite(d)) and np.max(np.abs(d - np.asarray(x))) <= 4.0 * 2.0**-4


def test_delayed_history_all_nonfinite_is_a_fresh_state():
    cfg = fp8jax.DelayedConfig(2, "max", 0)
    st = scaling.DelayedState(jnp.asarray(np.float32([np.nan, np.inf])), jnp.float32(1.0))
    new = scaling.update_delayed_state(st, jnp.float32(np.nan), _SPEC, cfg)
    assert float(new.scale) == 1.0


@pytest.mark.parametrize("margin", [-64, -8, 0, 8, 64])
def test_delayed_margin_scales_by_power_of_two_and_stays_finite(margin):
    cfg = fp8jax.DelayedConfig(1, "max", margin)
    for amax in [1.0, 3e38, 1e-40]:
        new = scaling.update_delayed_state(
            scaling.init_delayed_state(1), jnp.float32(amax), _SPEC, cfg
        )
        s = np.float32(new.scale)
        want = float(ref_scale(amax, fp8jax.E4M3)) * 2.0**margin
        want = min(want, max_scale(fp8jax.E4M3))
        if want >= np.finfo(np.float32).tiny:
            assert float(s) == pytest.approx(want, rel=1e-6)
        assert np.isfinite(s) and s >= 0 and np.isfinite(s * np.float32(448.0))


@pytest.mark.parametrize(
    "kw",
    [
        {"margin": -200},
        {"margin": 65},
        {"margin": 0.5},
        {"margin": True},
        {"margin": "1"},
        {"history_len": 0},
        {"history_len": 2.0},
        {"algo": "mean"},
    ],
)
def test_delayed_config_rejects_bad_values(kw):
    with pytest.raises(ValueError):
        fp8jax.DelayedConfig(**kw)


def test_delayed_config_accepts_sane_values():
    assert fp8jax.DelayedConfig(4, "most_recent", np.int64(-64)).margin == -64
    assert fp8jax.DelayedConfig(margin=64).margin == 64


_DN = (((1,), (0,)), ((), ()))


@pytest.mark.parametrize("bad", [0.0, -1.0, np.nan, np.inf, 1e-45, 1e-40, 3e38])
def test_delayed_state_scale_is_validated_where_it_enters(bad):
    # Each of these used to be accepted and give NaN outputs.
    recipe = fp8jax.recipes.hybrid_delayed()
    st = scaling.init_delayed_gemm_state(recipe)
    bad_st = st._replace(w=st.w._replace(scale=jnp.float32(bad)))
    x, w = jnp.ones((4, 8)), jnp.ones((8, 3))
    with pytest.raises(ValueError, match=r"delayed-scaling state: scale .* is not a finite"):
        fp8jax.dot_general(x, w, _DN, recipe=recipe, state=bad_st)
    with pytest.raises(ValueError, match=r"delayed-scaling state: scale"):
        scaling.check_delayed_state(bad_st.w, fp8jax.E4M3)


@pytest.mark.parametrize("bad", [-5.0, -np.inf])
def test_delayed_state_negative_history_is_refused(bad):
    recipe = fp8jax.recipes.hybrid_delayed()
    st = scaling.init_delayed_gemm_state(recipe)
    hist = st.x.amax_history.at[1].set(bad)
    bad_st = st._replace(x=st.x._replace(amax_history=hist))
    x, w = jnp.ones((4, 8)), jnp.ones((8, 3))
    with pytest.raises(ValueError, match="amax is a magnitude"):
        fp8jax.dot_general(x, w, _DN, recipe=recipe, state=bad_st)
    # NaN / +Inf entries (what an update records from a tensor holding them) pass.
    ok = st._replace(x=st.x._replace(amax_history=st.x.amax_history.at[1].set(np.inf)))
    scaling.check_delayed_state(ok.x, fp8jax.E4M3)


def test_delayed_state_empty_history_is_one_line():
    recipe = fp8jax.recipes.hybrid_delayed()
    st = scaling.init_delayed_gemm_state(recipe)
    empty = scaling.DelayedState(jnp.zeros((0,), jnp.float32), jnp.float32(1.0))
    with pytest.raises(ValueError, match="amax_history must be a non-empty 1-D array"):
        fp8jax.dot_general(
            jnp.ones((4, 8)), jnp.ones((8, 3)), _DN, recipe=recipe, state=st._replace(x=empty)
        )
    with pytest.raises(ValueError, match="non-empty"):
        scaling.update_delayed_state(empty, jnp.float32(1.0), _SPEC, fp8jax.DelayedConfig(1))


@pytest.mark.parametrize("jit", [False, True])
def test_delayed_update_never_gives_a_subnormal_scale(jit):
    # A tiny amax, or a negative margin, used to give a subnormal scale: NaN
    # outputs at the next step.
    upd = lambda a, m: scaling.update_delayed_state(  # noqa: E731
        scaling.init_delayed_state(2), a, _SPEC, fp8jax.DelayedConfig(2, "max", m)
    )
    tiny = np.float32(np.finfo(np.float32).tiny)
    for amax, margin in [(1e-40, 0), (1e-37, 0), (1.0, -64), (1e-30, -64)]:
        new = _jit(lambda a, m=margin: upd(a, m), jit)(jnp.float32(amax))
        want = max(float(ref_scale(amax, fp8jax.E4M3)) * 2.0**margin, float(tiny))
        assert np.float32(new.scale) == np.float32(want)
        scaling.check_delayed_state(new, fp8jax.E4M3)
    # Normal scales are unchanged: amax 44.8 gives 0.1 as before.
    new = _jit(lambda a: upd(a, 0), jit)(jnp.float32(44.8))
    assert np.float32(new.scale) == np.float32(44.8) / np.float32(448.0)


@pytest.mark.parametrize("fmt", [fp8jax.E4M3, fp8jax.E5M2, fp8jax.E4M3FNUZ])
@pytest.mark.parametrize("jit", [False, True])
def test_float64_scales_equal_the_integer_ones_on_every_boundary(jit, fmt):
    # The CPU's float64 quotient against the integer one, bit for bit: every
    # float32 subnormal amax up to 2^14, both sides of float32's normal range
    # and of the subnormal-quotient limit, the largest amaxes, random ones.
    fm = float(ml_dtypes.finfo(fmt).max)
    limit = int(np.float32(fm * 2.0**-126).view(np.int32))
    rng = np.random.default_rng(7)
    bits = np.concatenate(
        [
            np.arange(0, 1 << 14),
            np.arange(0x00800000 - 3000, 0x00800000 + 3000),
            np.arange(limit - 3000, limit + 3000),
            np.arange(0x7F7FFFFF - 3000, 0x7F7FFFFF + 1),
            rng.integers(0, 0x7F800000, 50000),
        ]
    ).astype(np.int32)
    amax = jnp.asarray(bits.view(np.float32))
    for pow2 in (False, True):
        for floor in (0.0, 1e-4):
            kw = dict(pow2=pow2, amax_floor=floor)
            f = _jit(
                lambda a, kw=kw: scaling.scale_from_amax(a, fmt, arithmetic="float64", **kw), jit
            )
            want = scaling.scale_from_amax(amax, fmt, arithmetic="bits", **kw)
            np.testing.assert_array_equal(
                np.asarray(f(amax)).view(np.int32), np.asarray(want).view(np.int32)
            )


def test_float64_scales_refuse_a_format_max_they_cannot_round_exactly():
    # 127 (an integer format's max) is odd and above 32: the float64 path
    # might double-round; the platform choice keeps the integer one.
    assert not scaling._float64_exact(127.0) and not scaling._float64_exact(7.5)
    assert scaling._float64_exact(448.0) and scaling._float64_exact(57344.0)
    with pytest.raises(ValueError, match="arithmetic must be"):
        scaling.scale_from_amax(jnp.float32(1.0), fp8jax.E4M3, arithmetic="float32")


@pytest.mark.parametrize("fmt", [fp8jax.E4M3, fp8jax.E5M2])
@pytest.mark.parametrize("jit", [False, True])
def test_float64_product_equals_the_integer_one(jit, fmt):
    # Every code of the format (NaN and Inf included) times subnormal scales,
    # scales around float32's smallest normal, random and the largest ones:
    # the float64 product rounded once, bit for bit the integer version's.
    rng = np.random.default_rng(8)
    codes = np.arange(256, dtype=np.uint8).view(fmt).astype(np.float32)
    s_bits = np.concatenate(
        [
            np.arange(1, 600),
            np.arange(0x00800000 - 300, 0x00800000 + 300),
            rng.integers(1, 0x7F000000, 600),
            [0x7F000000, 0x7F7FFFFF],
        ]
    ).astype(np.int32)
    d = np.repeat(codes, s_bits.size)
    s = np.tile(s_bits.view(np.float32), codes.size)
    got = _jit(scaling.exact_product_float64, jit)(d, s)
    want = _jit(lambda d, s: scaling.exact_product(d, s, fmt), jit)(d, s)
    np.testing.assert_array_equal(np.asarray(got).view(np.int32), np.asarray(want).view(np.int32))


def _division_keeping_subnormals(num, den):
    """float32 num / den correctly rounded, subnormals kept, on a CPU that flushes them:
    the float64 quotient of the exact magnitudes rounded once more (53 >= 2 * 24 + 2
    bits: the two roundings give the correctly rounded float32), the sign put back."""
    from fp8jax.formats import float32_bits_of_float64, float64_magnitude

    with jax.enable_x64(True):
        q = float64_magnitude(num) / float64_magnitude(den)
        bits = float32_bits_of_float64(q)
    sign = (
        jax.lax.bitcast_convert_type(num, jnp.int32) ^ jax.lax.bitcast_convert_type(den, jnp.int32)
    ) & jnp.int32(-(2**31))
    return jax.lax.bitcast_convert_type(bits | sign, jnp.float32)


@pytest.mark.parametrize("jit", [False, True])
def test_divide_offset_without_its_offset_under_a_division_keeping_subnormals(jit):
    # A kernel whose division keeps subnormals (PTX div.rn.f32) divides
    # directly: the same quotients as the offset division, for subnormal,
    # tiny, normal and huge scales and x with subnormals, zeros, NaN and +-Inf.
    rng = np.random.default_rng(9)
    n = 4096
    scale = np.concatenate(
        [
            rng.integers(1, 0x00800000, n // 4).astype(np.int32).view(np.float32),
            np.exp(rng.uniform(-100, 80, n - n // 4)).astype(np.float32),
        ]
    )
    x = (scale.astype(np.float64) * rng.uniform(-500, 500, n)).astype(np.float32)
    x[:6] = [np.nan, np.inf, -np.inf, 0.0, -1e-45, 3e-39]
    x[6:12] = rng.integers(-9, 10, 6) * np.float32(1e-45)

    def direct(x, s):
        with scaling.ieee_division(_division_keeping_subnormals, keeps_subnormals=True):
            return scaling.divide_offset(x, s)

    # jax caches a trace per function, and the division is read at trace time
    # from ieee_division's stack, which is no part of the cache's key: each
    # trace below is of a function of its own, so none is one taken under
    # another division (whatever ran before in this process).
    def offset(x, s):
        return scaling.divide_offset(x, s)

    f = jax.jit if jit else (lambda g: g)
    want = np.asarray(f(offset)(x, scale))
    got = np.asarray(f(direct)(x, scale))
    np.testing.assert_array_equal(got.view(np.int32), want.view(np.int32))
    # Tiny scales occur, whose quotients the offset division shifts.
    assert (scale < scaling.OFFSET_SCALE).sum() > 0
    # And the direct division is what ran: fewer operations, no offset.
    direct_ops = _equations(jax.make_jaxpr(direct)(x, scale).jaxpr)
    with scaling.ieee_division(_division_keeping_subnormals):
        offset_ops = _equations(
            jax.make_jaxpr(lambda x, s: scaling.divide_offset(x, s))(x, scale).jaxpr
        )
    assert direct_ops < offset_ops


def _equations(jaxpr) -> int:
    """Equations of a jaxpr, those of the jaxprs inside its equations included."""
    n = 0
    for eqn in jaxpr.eqns:
        n += 1
        for v in eqn.params.values():
            inner = getattr(v, "jaxpr", v)
            if hasattr(inner, "eqns"):
                n += _equations(inner)
    return n
