"""Numerics lab: summation accuracy against float64/exact references, metrics, demos."""

import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from fp8jax import numerics
from fp8jax.numerics import metrics


def _exact(x: np.ndarray) -> float:
    # math.fsum is the correctly rounded float64 of the exact sum.
    return math.fsum(x.astype(np.float64).tolist())


def test_kahan_beats_naive_on_a_million_float32():
    rng = np.random.default_rng(0)
    x = rng.uniform(0.0, 1.0, 10**6).astype(np.float32)
    ref = _exact(x)
    naive = float(numerics.naive_sum(x))
    kahan = float(numerics.kahan_sum(x))
    err_naive, err_kahan = abs(naive - ref), abs(kahan - ref)
    # naive_sum is the sequential float32 recursion: numpy's cumsum does the same.
    assert naive == float(np.cumsum(x)[-1])
    ulp = float(np.spacing(np.float32(ref)))
    assert err_kahan <= ulp  # within one float32 ulp of the exact sum
    assert err_naive > 20 * max(err_kahan, ulp / 2)
    # The lane-parallel variant is just as accurate.
    assert abs(float(numerics.kahan_sum(x, lanes=256)) - ref) <= ulp


@pytest.mark.parametrize("fn", [numerics.neumaier_sum, numerics.pairwise_sum])
def test_other_sums_beat_naive(fn):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(200_000) * 10.0 ** rng.integers(-3, 4, 200_000)).astype(np.float32)
    ref = _exact(x)
    err = abs(float(fn(x)) - ref)
    err_naive = abs(float(numerics.naive_sum(x)) - ref)
    assert err < err_naive / 5


def test_neumaier_survives_large_addends_kahan_does_not():
    x = jnp.asarray([1.0, 1e30, 1.0, -1e30], jnp.float32)
    assert float(numerics.neumaier_sum(x)) == 2.0
    assert float(numerics.neumaier_sum(x, lanes=2)) == 2.0
    assert float(numerics.kahan_sum(x)) != 2.0  # the known weakness of plain Kahan


def test_sums_are_jittable_and_handle_odd_lengths():
    x = jnp.arange(1, 1001, dtype=jnp.float32)
    for f in (numerics.naive_sum, numerics.kahan_sum, numerics.neumaier_sum, numerics.pairwise_sum):
        assert float(jax.jit(f)(x)) == 500500.0
    assert float(numerics.kahan_sum(x, lanes=7)) == 500500.0
    assert float(numerics.pairwise_sum(jnp.zeros((0,), jnp.float32))) == 0.0
    with pytest.raises(TypeError):
        numerics.kahan_sum(jnp.arange(3))


def test_metrics_against_hand_values():
    ref = np.array([3.0, 4.0])
    assert numerics.relative_error(ref + [0.0, 0.5], ref) == pytest.approx(0.1)
    assert numerics.sqnr_db(ref + [0.0, 0.5], ref) == pytest.approx(10 * math.log10(25 / 0.25))
    assert numerics.sqnr_db(ref, ref) == math.inf
    assert numerics.max_relative_error([3.3, 4.0], ref) == pytest.approx(0.1)
    one = np.float32(1.0)
    assert numerics.ulp_distance(one, np.nextafter(one, np.float32(2)))[()] == 1
    assert numerics.ulp_distance(np.float32(-0.0), np.float32(0.0))[()] == 0
    tiny = np.float32(1.4e-45)  # smallest subnormal: one step on each side of zero
    assert numerics.ulp_distance(-tiny, tiny)[()] == 2
    assert numerics.ulp_distance(np.float64(1.0), 1.0 + 4 * 2.0**-52)[()] == 4
    assert numerics.ulp_distance(np.float64(-1.0), np.float64(1.0))[()] == 2 * 0x3FF0000000000000
    e4 = ml_dtypes.float8_e4m3fn
    assert numerics.ulp_distance(np.array([448.0], e4), np.array([416.0], e4))[0] == 1
    assert numerics.ulp_distance(np.array([1.0], ml_dtypes.bfloat16), np.array([1.0078125]))[0] == 1
    assert np.isnan(numerics.ulp_distance(np.float32(np.nan), np.float32(1.0))[()])


def test_saturation_and_flush_fractions():
    e4 = ml_dtypes.float8_e4m3fn
    x = np.array([1000.0, 460.0, 448.0, 1e-4, 0.0, 1.0])
    data = np.clip(x, -448, 448).astype(e4)
    deq = data.astype(np.float64)
    # 1000 was clipped; 460 rounds to 448 anyway (< 448 + 16); 1e-4 flushes to 0.
    assert metrics.half_ulp_above_max(e4) == 464.0
    assert numerics.saturated_fraction(x, deq, data, e4) == pytest.approx(1 / 6)
    # 1e-4 flushes; the denominator is every element (the 0 included).
    assert float(numerics.flushed_fraction(x, deq)) == pytest.approx(1 / 6)


def test_demos_show_loss_and_remedy():
    demos = {d.name: d for d in numerics.all_demos()}
    assert set(demos) >= {
        "absorption",
        "summation order",
        "float64 -> float32",
        "integers above 2^53",
        "NaN propagation",
        "subnormals",
    }
    a = demos["absorption"]
    assert (a.lossy, a.remedy, a.exact) == (0.0, 1.0, 1)
    i = demos["integers above 2^53"]
    assert i.exact == 2**53 + 1 and i.remedy == 2**53 + 1 and i.lossy == 2.0**53
    assert i.lossy_error == pytest.approx(1 / (2**53 + 1))
    n = demos["NaN propagation"]
    assert math.isnan(n.lossy) and n.remedy == 3.0
    f = demos["float64 -> float32"]
    assert f.lossy == 16777216.0 and f.remedy == 16777217.0
    s = demos["subnormals"]
    assert s.lossy == 2.0**-149
    assert s.remedy_error < 1e-7 < s.lossy_error
    o = demos["summation order"]
    assert o.lossy == 1.0 and o.remedy_error < 1e-5 < o.lossy_error
    assert float(Fraction(o.exact)) == pytest.approx(1.001)
    fp8 = demos["FP8 overflow"]
    assert math.isnan(fp8.lossy) and fp8.remedy == 500.0
    text = numerics.format_demos()
    assert "9007199254740993" in text and "absorption" in text


def test_point_one_has_no_finite_binary_form():
    d = numerics.point_one()
    # The float64 nearest 0.1 is not 1/10: its exact value has a power-of-two denominator.
    assert Fraction(0.1) != Fraction(1, 10) and Fraction(0.1).denominator == 2**55
    assert d.lossy == 0.9999999999999999 and d.lossy != 1.0
    assert d.remedy == 1.0 and d.exact == 1
    assert d.lossy_error == pytest.approx(2**-53, rel=1e-9)
    assert "isclose" in d.advice
    # 3 tenths: 0.1 + 0.1 + 0.1 != 0.3, exactly 0.3 with Decimal.
    d3 = numerics.point_one(3)
    assert d3.lossy == 0.30000000000000004 and d3.remedy == 0.3


def test_float_to_int_truncates():
    d = numerics.float_to_int()
    assert (d.lossy, d.remedy, d.exact) == (3, 4, 4)
    assert d.lossy_error == 0.25 and d.remedy_error == 0
    assert "int(0.29 * 100) = 28" in d.what
    neg = numerics.float_to_int(-2.7)
    assert (neg.lossy, neg.remedy) == (-2, -3)  # toward zero, not down


def test_ill_conditioned_system_amplifies_rounding():
    n = 8
    d = numerics.ill_conditioned(n=n, steps=4)
    # Hilbert matrix condition number grows like e^(3.5 n): ~1.5e10 for n = 8.
    h = np.array([[1.0 / (i + j + 1) for j in range(n)] for i in range(n)])
    cond = np.linalg.cond(h)
    assert 1e10 < cond < 1e11 and f"{cond:.1e}" in d.what
    # float64 solve: errors of order cond * eps, far above eps.
    assert 1e-9 < d.lossy < cond * 1e-15
    # Refinement with exact residuals converges to float64's own rounding of x = 1.
    assert d.remedy <= 2**-52 and d.exact == 0
    assert d.lossy_error == d.lossy  # absolute error against exact 0


def test_subnormal_speed_measures_what_it_says():
    for dt in (np.float32, np.float64):
        normal, sub = numerics.subnormal_operands(dt, 1000)
        fi = np.finfo(dt)
        assert np.all((sub > 0) & (sub < fi.smallest_normal))
        assert np.all(normal >= fi.smallest_normal)
        # The timed operations keep subnormal operands subnormal, except sqrt.
        for y in (sub * dt(0.9), sub + sub, sub / dt(3)):
            assert np.all((y > 0) & (y < fi.smallest_normal))
        assert np.all(np.sqrt(sub) >= fi.smallest_normal)
        # Same draws: the subnormal copy keeps all but the 4 bits it lost below 2^emin.
        ratio = sub.astype(np.float64) / float(fi.smallest_normal) / normal.astype(np.float64)
        assert np.allclose(ratio, 1.0, rtol=2.0 ** -(fi.nmant - 5), atol=0)
    d = numerics.subnormal_speed(n=4096, repeats=2)
    assert {(r[0], r[1]) for r in d.rows} == {
        (t, op) for t in ("float32", "float64") for op in ("x * 0.9", "x + x", "x / 3", "sqrt(x)")
    }
    for name, op, t_norm, t_sub in d.rows:
        assert t_norm > 0 and t_sub > 0
        assert d.ratio(name, op) == t_sub / t_norm
    text = numerics.format_speed(d)
    assert "ratio" in text and "measured now" in text and "flush-to-zero" in text


def test_every_demo_says_what_to_do():
    for d in numerics.all_demos():
        assert d.advice, d.name
    text = numerics.format_demos(numerics.all_demos(), numerics.subnormal_speed(n=1024, repeats=1))
    assert text.count("  do: ") == len(numerics.all_demos()) + 1
    assert "0.9999999999999999" in text and "ill-conditioned" in text


def test_site_errors_ratio_cells_give_the_draws_their_geomean_and_interval():
    from scipy import stats

    from fp8jax.numerics.studies.site_errors import REF_NAME, ratio_cell, table

    assert ratio_cell(np.array([1.5])) == "1.50"  # one draw: no interval
    assert ratio_cell(np.array([2.0, 2.0, 2.0])) == "2.00, 2.00, 2.00; geomean 2.00 [2.00, 2.00]"
    r = np.array([1.83, 1.11, 1.25])
    logs = np.log(r)
    half = stats.t.ppf(0.975, 2) * logs.std(ddof=1) / math.sqrt(3)
    lo, mid, hi = np.exp([logs.mean() - half, logs.mean(), logs.mean() + half])
    assert ratio_cell(r) == f"1.83, 1.11, 1.25; geomean {mid:.2f} [{lo:.2f}, {hi:.2f}]"
    assert lo < 1 < mid  # every draw above 1, yet three draws this spread do not exclude 1
    draws = [{REF_NAME: (1.0, 1.0, 1.0), "pow2": (a, 1.0, 2 * a)} for a in (1.2, 1.4)]
    (row,) = [line for line in table({"kind": draws}).splitlines() if "| pow2 |" in line]
    assert "1.20, 1.40; geomean 1.30 [" in row and "2.40, 2.80; geomean 2.59 [" in row
