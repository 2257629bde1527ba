"""The comparisons' statistics: Student-t quantiles against published values, mean and
t-interval, prediction interval and verdict against float64 numpy references."""

import math

import numpy as np
import pytest

from fp8jax.lab import stats

# Published Student-t quantiles (e.g. NIST/SEMATECH e-Handbook table, more digits
# from any statistics package).
T_975 = {
    1: 12.706204736174694,
    2: 4.302652729749462,
    3: 3.1824463052837078,
    4: 2.7764451051977934,
    5: 2.5705818356363146,
    10: 2.228138851986274,
    30: 2.0422724563012378,
    100: 1.9839715185235518,
}


@pytest.mark.parametrize("df", sorted(T_975))
def test_t_quantile_matches_published_values(df):
    assert stats.t_quantile(0.975, df) == pytest.approx(T_975[df], rel=1e-10)


def test_t_quantile_other_levels_and_bad_input():
    assert stats.t_quantile(0.95, 1) == pytest.approx(6.313751514675037, rel=1e-10)
    assert stats.t_quantile(0.995, 4) == pytest.approx(4.604094871349992, rel=1e-10)
    # Large df tends to the normal quantile 1.959964.
    assert stats.t_quantile(0.975, 5000) == pytest.approx(1.9604386, abs=1e-6)
    with pytest.raises(ValueError):
        stats.t_quantile(0.975, 0)
    with pytest.raises(ValueError):
        stats.t_quantile(0.3, 3)


def test_mean_interval_against_a_float64_reference():
    gaps = [0.005, 0.01, 0.002]
    st = stats.mean_interval(gaps)
    x = np.asarray(gaps, np.float64)
    half = T_975[2] * x.std(ddof=1) / math.sqrt(3)
    assert st["mean"] == pytest.approx(x.mean(), rel=1e-14)
    assert st["half_width"] == pytest.approx(half, rel=1e-10)
    assert (st["lo"], st["hi"]) == pytest.approx((x.mean() - half, x.mean() + half), rel=1e-10)
    assert st["per_seed"] == gaps and st["n"] == 3
    one = stats.mean_interval([0.001])
    assert one["half_width"] == math.inf and stats.verdict(one) == "cannot resolve"
    assert stats.verdict(stats.mean_interval([0.001, math.nan])) == "diverged"


@pytest.mark.parametrize(
    "gaps, expected",
    [
        ([0.0010, 0.0012, 0.0008, 0.0011], "within"),  # interval inside +-0.25%
        ([0.0030, 0.0032, 0.0028, 0.0031], "outside"),  # narrow, above 0.25%
        ([0.0022, 0.0026, 0.0024, 0.0025], "crosses"),  # narrow, crosses +0.25%
        ([-0.005, 0.004, 0.0], "cannot resolve"),  # wider than 0.5%
        ([0.20, 0.30, 0.25], "outside"),  # wide, but wholly above +0.25%
        ([0.0, 0.02, 0.01], "cannot resolve"),  # wide, reaching into +-0.25%
        ([0.0, 0.0], "within"),  # identical runs
    ],
)
def test_verdict_needs_the_whole_interval_inside(gaps, expected):
    assert stats.verdict(stats.mean_interval(gaps)) == expected


def test_prediction_interval_against_a_float64_reference():
    gaps = [0.001, -0.002, 0.004, 0.0]
    g = np.asarray(gaps, np.float64)
    half = T_975[3] * g.std(ddof=1) * math.sqrt(1 + 1 / 4)
    lo, hi = stats.prediction_interval(gaps)
    assert (lo, hi) == pytest.approx((g.mean() - half, g.mean() + half), rel=1e-10)
    with pytest.raises(ValueError, match="2\\+ values"):
        stats.prediction_interval([0.001])


def test_interval_text_and_values_read_back_from_json():
    st = stats.mean_interval([0.001, 0.002])
    lo, hi = st["lo"], st["hi"]
    assert stats.interval_text(st) == f"+0.15% [{100 * lo:+.2f}%, {100 * hi:+.2f}%]"
    assert stats.interval_text(stats.mean_interval([0.001])) == "+0.10% [unbounded: one seed]"
    back = stats.stats_from_json({**st, "hi": "Infinity", "per_seed": [None, 0.5]})
    assert back["hi"] == math.inf and math.isnan(back["per_seed"][0])
