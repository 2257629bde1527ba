"""The statistics every comparison uses: Student-t intervals over seeds and their verdict.

A comparison pairs runs by seed (same initialization, same batches), so each
seed gives one relative gap; :func:`mean_interval` is their mean and two-sided
t-interval (``mean +- t(0.5 + level/2, n - 1) * sd / sqrt(n)``, sample
standard deviation), :func:`prediction_interval` the interval one more seed
falls in (``sd * sqrt(1 + 1/n)``), and :func:`verdict` what an interval says
about DeepSeek-V3's criterion, a relative gap within +-0.25%.  The quantiles
come from the exact finite series of the t distribution (no scipy).  Values
are float64; NaN / Inf read back from JSON through
:func:`fp8jax.train.run_log.as_float`.
"""

from __future__ import annotations

import math

import numpy as np

from fp8jax.train.run_log import as_float

DEEPSEEK_TOLERANCE = 0.0025


def _t_abs_cdf(t: float, df: int) -> float:
    """P(|T| <= t) for Student's t with integer ``df`` (Abramowitz & Stegun 26.7.3-4).

    With theta = atan(t / sqrt(df)): df = 1 gives 2 theta / pi; odd df adds
    sin(theta) (cos + 2/3 cos^3 + ... + (2.4...(df-3))/(1.3...(df-2)) cos^(df-2));
    even df is sin(theta) (1 + 1/2 cos^2 + ... + (1.3...(df-3))/(2.4...(df-2)) cos^(df-2)).
    """
    theta = math.atan(t / math.sqrt(df))
    s, c2 = math.sin(theta), math.cos(theta) ** 2
    if df % 2:
        total, term = 0.0, math.cos(theta)
        if df > 1:
            total = term
            for k in range(1, (df - 3) // 2 + 1):
                term *= (2 * k) / (2 * k + 1) * c2
                total += term
        return 2.0 / math.pi * (theta + s * total)
    total, term = 1.0, 1.0
    for k in range(1, (df - 2) // 2 + 1):
        term *= (2 * k - 1) / (2 * k) * c2
        total += term
    return s * total


def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile (0.5 < p < 1) of Student's t with ``df >= 1`` degrees of freedom.

    Bisection on the exact finite series of :func:`_t_abs_cdf` (float64, to
    ~1e-12): t(0.975, 1) = 12.7062, t(0.975, 2) = 4.3027, t(0.975, 30) = 2.0423.
    """
    if not 0.5 < p < 1.0:
        raise ValueError(f"p must be in (0.5, 1), got {p}")
    if int(df) != df or df < 1:
        raise ValueError(f"df must be a positive integer, got {df}")
    df = int(df)
    target = 2.0 * p - 1.0
    lo, hi = 0.0, 1.0
    while _t_abs_cdf(hi, df) < target:
        lo, hi = hi, 2.0 * hi
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if _t_abs_cdf(mid, df) < target:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-13 * hi:
            break
    return 0.5 * (lo + hi)


def mean_interval(values, level: float = 0.95) -> dict:
    """Mean and two-sided ``level`` t-interval of ``values`` (one per seed).

    Returns mean, lo, hi, half_width, n, t and the per-seed values; with one
    value (or a non-finite one) the interval is unbounded / NaN.
    """
    v = np.asarray([as_float(x) for x in values], dtype=np.float64)
    n = int(v.size)
    mean = float(np.mean(v)) if n else math.nan
    if n >= 2 and np.all(np.isfinite(v)):
        t = t_quantile(0.5 + level / 2.0, n - 1)
        half = t * float(np.std(v, ddof=1)) / math.sqrt(n)
    else:
        t, half = math.nan, (math.inf if n == 1 and math.isfinite(mean) else math.nan)
    return {
        "mean": mean,
        "lo": mean - half,
        "hi": mean + half,
        "half_width": half,
        "n": n,
        "t": t,
        "per_seed": v.tolist(),
    }


def prediction_interval(values, level: float = 0.95) -> tuple[float, float]:
    """(lo, hi): where one new value falls with probability ``level``, given ``values``.

    ``mean +- t(0.5 + level/2, n - 1) * sd * sqrt(1 + 1/n)`` (sample standard
    deviation); needs two values or more.
    """
    v = np.asarray([as_float(x) for x in values], np.float64)
    n = int(v.size)
    if n < 2:
        raise ValueError(f"a prediction interval needs 2+ values, got {n}")
    t = t_quantile(0.5 + level / 2.0, n - 1)
    half = t * float(np.std(v, ddof=1)) * math.sqrt(1.0 + 1.0 / n)
    mean = float(np.mean(v))
    return mean - half, mean + half


def verdict(stats: dict, tol: float = DEEPSEEK_TOLERANCE) -> str:
    """What a :func:`mean_interval` says about +-tol.

    "within": the whole interval lies inside +-tol; "outside": the whole
    interval lies beyond it (however wide: a gap of [+5%, +20%] is resolved);
    "crosses": a narrow interval (width <= 2 tol) that contains the bound;
    "cannot resolve": any other interval wider than 2 tol.
    """
    lo, hi = stats["lo"], stats["hi"]
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return "cannot resolve" if math.isfinite(stats["mean"]) else "diverged"
    if lo > tol or hi < -tol:
        return "outside"
    if hi - lo > 2 * tol:
        return "cannot resolve"
    if -tol <= lo and hi <= tol:
        return "within"
    return "outside" if lo > tol or hi < -tol else "crosses"


# How a table writes each verdict (and the baseline's own row).
VERDICT_TEXT = {
    "baseline": "--",
    "within": "yes",
    "outside": "no",
    "crosses": "crosses the bound",
    "cannot resolve": "cannot resolve 0.25%",
    "diverged": "diverged",
}


def pct(x: float) -> str:
    """A relative gap as a signed percentage with two decimals: '+0.12%'."""
    return f"{100 * x:+.2f}%" if math.isfinite(x) else "n/a"


def interval_text(st: dict) -> str:
    """'+0.12% [-0.05%, +0.29%]' (mean and 95% interval)."""
    if not math.isfinite(st["mean"]):
        return "n/a"
    if not (math.isfinite(st["lo"]) and math.isfinite(st["hi"])):
        return f"{pct(st['mean'])} [unbounded: one seed]"
    return f"{pct(st['mean'])} [{pct(st['lo'])}, {pct(st['hi'])}]"


def stats_from_json(st: dict) -> dict:
    """A :func:`mean_interval` dict read back from results.json (NaN / inf restored)."""
    out = {k: as_float(v) for k, v in st.items() if k != "per_seed"}
    out["per_seed"] = [as_float(x) for x in st["per_seed"]]
    return out
