"""The classic losses of floating point, each with its remedy.

Every demo returns a :class:`Demo`: the lossy result, the remedy's result and
the exact value (worked out with Python integers / fractions where the
floating result is in doubt), plus one line on how each was obtained.
``format_demos()`` prints them as a table (``fp8jax numerics`` does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from fp8jax.numerics.summation import naive_sum, neumaier_sum


@dataclass(frozen=True)
class Demo:
    """One loss and its remedy: ``lossy`` and ``remedy`` results against ``exact``."""

    name: str
    what: str
    lossy: float | int
    lossy_how: str
    remedy: float | int
    remedy_how: str
    exact: float | int

    def error(self, value: float | int) -> float:
        """|value - exact| / |exact|, computed exactly (absolute error when exact is 0).

        Integers (the 2^53 demo) stay Python ints, so the difference is exact.
        NaN or inf values give NaN / inf.
        """
        if isinstance(value, float) and not math.isfinite(value):
            return math.nan if math.isnan(value) else math.inf
        d = abs(Fraction(value) - Fraction(self.exact))
        return float(d / abs(Fraction(self.exact))) if self.exact != 0 else float(d)

    @property
    def lossy_error(self) -> float:
        return self.error(self.lossy)

    @property
    def remedy_error(self) -> float:
        return self.error(self.remedy)


def absorption() -> Demo:
    """1e20 + 1 - 1e20: the 1 is absorbed by the large addend."""
    terms = [1e20, 1.0, -1e20]
    lossy = (terms[0] + terms[1]) + terms[2]
    remedy = float(neumaier_sum(jnp.asarray(terms, jnp.float32)))
    return Demo(
        "absorption",
        "1e20 + 1 - 1e20: 1 is below half an ulp of 1e20 (8192 in float64)",
        lossy,
        "float64, left to right",
        remedy,
        "Neumaier compensated sum (float32)",
        float(sum(Fraction(t) for t in terms)),
    )


def summation_order(n: int = 100_000) -> Demo:
    """1 followed by n terms of 1e-8, in float32: order decides whether the small ones count."""
    small = np.full(n, 1e-8, np.float32)
    big_first = np.concatenate([np.ones(1, np.float32), small])
    small_first = np.concatenate([small, np.ones(1, np.float32)])
    exact = Fraction(1) + n * Fraction(float(np.float32(1e-8)))
    return Demo(
        "summation order",
        f"1 + {n} x 1e-8 in float32: each 1e-8 is below half an ulp of 1 (6e-8)",
        float(naive_sum(jnp.asarray(big_first))),
        "float32, largest term first",
        float(naive_sum(jnp.asarray(small_first))),
        "float32, smallest terms first (ascending magnitude)",
        float(exact),
    )


def float64_to_float32(x: float = 16777217.0) -> Demo:
    """2^24 + 1 does not fit float32's 24-bit significand; a (hi, lo) pair of float32 keeps it."""
    hi = np.float32(x)
    # The remainder x - hi is exact in float64 and small enough for a float32.
    lo = np.float32(x - float(hi))
    return Demo(
        "float64 -> float32",
        f"{x!r} has {len(bin(int(x))) - 2} significant bits; float32 keeps 24",
        float(hi),
        "float32(x)",
        float(hi) + float(lo),
        "two float32s, hi = float32(x), lo = float32(x - hi)",
        x,
    )


def large_integers() -> Demo:
    """Integers above 2^53 are not all representable in float64."""
    n = 2**53 + 1
    return Demo(
        "integers above 2^53",
        "2^53 + 1 as a float64: every other integer is missing above 2^53",
        float(np.float64(2**53) + np.float64(1)),
        "float64 arithmetic",
        int(np.int64(2**53) + np.int64(1)),
        "int64 arithmetic (exact to 2^63; Python int: unbounded)",
        n,
    )


def nan_propagation() -> Demo:
    """One NaN poisons every sum it enters; drop (and count) it explicitly instead."""
    x = jnp.asarray([1.0, jnp.nan, 2.0], jnp.float32)
    return Demo(
        "NaN propagation",
        "sum of [1, NaN, 2]: NaN + anything = NaN, and NaN != NaN",
        float(jnp.sum(x)),
        "jnp.sum",
        float(jnp.nansum(x)),
        "jnp.nansum (after counting the NaNs: jnp.isnan(x).sum() == 1)",
        3.0,
    )


def fp8_overflow(value: float = 500.0) -> Demo:
    """A plain cast to E4M3 turns 500 into NaN (no inf in E4M3FN); scaling keeps it."""
    fmt = ml_dtypes.float8_e4m3fn
    with np.errstate(all="ignore"):
        lossy = float(np.float32(value).astype(fmt).astype(np.float32))
    fmax = float(ml_dtypes.finfo(fmt).max)
    scale = value / fmax  # amax / max: the amax element maps exactly onto 448
    remedy = float(np.float64(np.float32(value / scale).astype(fmt)) * scale)
    return Demo(
        "FP8 overflow",
        f"{value} cast to float8_e4m3fn (max {fmax:g}, no inf)",
        lossy,
        "plain cast",
        remedy,
        "scale by amax / 448, cast, multiply back",
        value,
    )


def subnormals() -> Demo:
    """1e-20 * 1e-25 lands among float32 subnormals (one significant bit left)."""
    a, b = np.float32(1e-20), np.float32(1e-25)
    with np.errstate(under="ignore"):
        lossy = float(a * b)
    # Remedy: keep the significands in range and carry the exponent separately.
    # 2^64 * 2^64 = 2^128 is exact, so only the final product is rounded.
    sa, sb = np.float32(a * np.float32(2.0**64)), np.float32(b * np.float32(2.0**64))
    remedy = float(np.float64(sa * sb) * 2.0**-128)
    return Demo(
        "subnormals",
        "float32 1e-20 * 1e-25 = 1e-45, below the smallest normal 1.2e-38",
        lossy,
        "float32 product (gradual underflow to 1 x 2^-149)",
        remedy,
        "rescale both by 2^64, multiply, carry 2^-128 separately",
        float(Fraction(float(a)) * Fraction(float(b))),
    )


def all_demos() -> list[Demo]:
    """Every demo, in the order the CLI prints them."""
    return [
        absorption(),
        summation_order(),
        float64_to_float32(),
        large_integers(),
        nan_propagation(),
        fp8_overflow(),
        subnormals(),
    ]


def _v(x: float | int) -> str:
    if isinstance(x, int):
        return str(x)
    if math.isnan(x):
        return "nan"
    if math.isfinite(x) and x == int(x) and abs(x) < 1e18:
        return str(int(x))  # integral floats in full: 2^53 shows as 9007199254740992
    return f"{x:.10g}"


def _e(x: float) -> str:
    return "nan" if math.isnan(x) else f"{x:.2g}"


def format_demos(demos: list[Demo] | None = None) -> str:
    """A readable listing of the demos."""
    demos = all_demos() if demos is None else demos
    out = []
    for d in demos:
        out += [
            f"{d.name}: {d.what}",
            f"  exact   {_v(d.exact)}",
            f"  lossy   {_v(d.lossy):<22} rel.err {_e(d.lossy_error):<8} ({d.lossy_how})",
            f"  remedy  {_v(d.remedy):<22} rel.err {_e(d.remedy_error):<8} ({d.remedy_how})",
            "",
        ]
    return "\n".join(out).rstrip() + "\n"
