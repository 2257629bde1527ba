"""The classic losses of floating point, each with its remedy.

Every demo returns a :class:`Demo`: the lossy result, the remedy's result and
the exact value (worked out with Python integers / fractions where the
floating result is in doubt), one line on how each was obtained, and what a
user should do about it (``advice``).  :func:`subnormal_speed` is the one demo
about time rather than accuracy: it measures, on the machine it runs on, how
much slower numpy arithmetic on subnormal operands is, and returns a
:class:`SpeedDemo`.  ``format_demos()`` prints them all (``fp8jax numerics``
does).
"""

from __future__ import annotations

import math
import platform
import time
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from fp8jax import host_cpu
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
    advice: str = ""

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
        "sum terms of very different magnitude with a compensated sum (neumaier_sum) or "
        "math.fsum, or subtract the large terms first",
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
        "accumulate long sums in float32 with pairwise_sum / kahan_sum, or in float64; "
        "never add many small terms one by one to a large total",
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
        "keep counters, ids and timestamps above 2^24 out of float32 (int64 or float64), "
        "or carry a (hi, lo) pair",
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
        "do integer arithmetic in integer types; a float64 holds every integer only up to 2^53",
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
        "count NaNs where they enter (jnp.isnan(x).sum()), find their cause; drop them "
        "explicitly (nansum) only when missing values are expected",
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
        "never cast to FP8 unscaled: divide by amax / max first (fp8jax.quantize), or clip "
        "to +-448 before the cast (fp8jax.saturating_cast)",
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
        "keep values in the normal range: scale them (as loss scaling does for FP16 "
        "gradients) or work in logs; see also subnormal_speed()",
    )


def point_one(n: int = 10) -> Demo:
    """Adding 0.1 ten times does not give 1: 0.1 has no finite binary expansion."""
    total = 0.0
    for _ in range(n):
        total += 0.1
    # Decimal arithmetic keeps 0.1 exact (base 10), so n tenths sum to n/10 exactly.
    remedy = float(sum((Decimal("0.1") for _ in range(n)), Decimal(0)))
    return Demo(
        "0.1 in binary",
        f"0.1 added {n} times in float64: 0.1 = 0x1.999999999999ap-4 is rounded, "
        f"the {n} roundings add up",
        total,
        "float64, left to right",
        remedy,
        "decimal.Decimal('0.1'), summed exactly",
        n // 10 if n % 10 == 0 else float(Fraction(n, 10)),
        "compare floats with a tolerance (math.isclose), never ==; keep money and other "
        "decimal quantities as integers (cents) or decimal.Decimal",
    )


def float_to_int(x: float = 3.999) -> Demo:
    """int() truncates toward zero: int(3.999) is 3 where round() gives 4."""
    return Demo(
        "float -> int",
        f"int({x!r}) truncates toward zero; so does int(0.29 * 100) = {int(0.29 * 100)}, "
        f"because 0.29 * 100 = {0.29 * 100!r}",
        int(x),
        "int(x): truncation toward zero",
        round(x),
        "round(x): nearest integer",
        round(Fraction(x)),
        "round to the nearest integer (round, np.rint) before converting, unless truncation "
        "is what is meant (then say so: math.trunc / math.floor)",
    )


def _hilbert(n: int) -> list[list[Fraction]]:
    return [[Fraction(1, i + j + 1) for j in range(n)] for i in range(n)]


def ill_conditioned(n: int = 10, steps: int = 5) -> Demo:
    """A Hilbert system H x = b with x = 1: its condition number turns rounding into large errors.

    ``b = H @ 1`` is exact (Fractions); the float64 solve sees H and b rounded
    once, and the condition number (~1.6e13 for n = 10) amplifies those 1e-16
    relative errors.  The remedy is iterative refinement: the residual
    ``b - H x`` computed exactly (Fractions), the correction solved in float64,
    ``steps`` times.  The values reported are ``max_i |x_i - 1|``, so exact is 0.
    """
    h_exact = _hilbert(n)
    b_exact = [sum(row) for row in h_exact]  # H @ ones, exactly
    # float64 rounding of the exact matrix and right-hand side: the only error
    # the solver's input carries.
    h64 = np.array([[float(v) for v in row] for row in h_exact], dtype=np.float64)
    b64 = np.array([float(v) for v in b_exact], dtype=np.float64)
    x = np.linalg.solve(h64, b64)
    lossy = float(np.max(np.abs(x - 1.0)))
    cond = float(np.linalg.cond(h64))
    xr = x.copy()
    for _ in range(steps):
        # Residual in exact arithmetic: float64 values are exact rationals.
        xf = [Fraction(float(v)) for v in xr]
        r = [b_exact[i] - sum(h_exact[i][j] * xf[j] for j in range(n)) for i in range(n)]
        xr = xr + np.linalg.solve(h64, np.array([float(v) for v in r], dtype=np.float64))
    remedy = float(np.max(np.abs(xr - 1.0)))
    return Demo(
        "ill-conditioned system",
        f"solve the {n}x{n} Hilbert system H x = H @ 1 (cond(H) = {cond:.1e}): "
        f"about log10(cond) = {math.log10(cond):.0f} of float64's 16 digits are lost; "
        "values are max |x_i - 1|",
        lossy,
        "np.linalg.solve in float64",
        remedy,
        f"iterative refinement, {steps} steps: exact residual b - H x, correction in float64",
        0,
        "check np.linalg.cond(A) before trusting a solve (digits lost ~ log10 cond); rescale or "
        "regularize, prefer QR / lstsq to normal equations, refine with a higher-precision residual",
    )


@dataclass(frozen=True)
class SpeedDemo:
    """A timing demo: seconds per pass over normal and subnormal operands.

    ``rows``: (dtype name, operation, seconds with normal operands, seconds
    with subnormal operands), best of ``repeats`` passes each, measured on
    ``machine`` when the demo ran.
    """

    name: str
    what: str
    rows: tuple[tuple[str, str, float, float], ...]
    n: int
    repeats: int
    advice: str
    machine: str = ""

    def ratio(self, dtype: str, op: str) -> float:
        """Subnormal time / normal time for ``dtype`` and ``op``."""
        for name, o, normal, sub in self.rows:
            if (name, o) == (dtype, op):
                return sub / normal
        raise KeyError((dtype, op))


def subnormal_operands(dtype, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(normal, subnormal) arrays of ``n`` values of ``dtype`` from the same uniform draws.

    Both hold uniform [1, 2) values times 2^-4; the subnormal array is further
    scaled by the smallest normal, so it lies 4 binades below it (subnormal,
    with about ``nmant - 4`` significant bits left), and so do the results of
    the timed operations except ``sqrt`` (whose result is normal: only its
    operand is subnormal).  The normal array stays near 0.1.
    """
    fi = np.finfo(dtype)
    rng = np.random.default_rng(0)
    # The draws in ``dtype`` first, so both arrays start from the same values;
    # scaling by powers of two is exact until the subnormal range drops bits.
    base = rng.uniform(1.0, 2.0, n).astype(dtype)
    sub = (base * dtype(fi.smallest_normal) * dtype(2.0**-4)).astype(dtype)
    normal = (base * dtype(2.0**-4)).astype(dtype)
    return normal, sub


def _best_time(fn, repeats: int) -> float:
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


# Timed operations on subnormal operands; all but sqrt give subnormal results.
_SPEED_OPS = {
    "x * 0.9": lambda x, out: np.multiply(x, x.dtype.type(0.9), out=out),
    "x + x": lambda x, out: np.add(x, x, out=out),
    "x / 3": lambda x, out: np.divide(x, x.dtype.type(3), out=out),
    "sqrt(x)": lambda x, out: np.sqrt(x, out=out),
}


def subnormal_speed(n: int = 1 << 18, repeats: int = 7) -> SpeedDemo:
    """Time numpy elementwise operations on normal vs subnormal operands (float32, float64).

    Subnormal inputs or results send many x86 cores down a slow microcode
    path (tens of times slower per operation) unless flush-to-zero is on;
    other cores pay little, or only for division and square root.  The demo
    measures the machine it runs on (wall clock, best of ``repeats``); there is
    no fixed answer.  Checking the operands: ``subnormal_operands``.
    """
    rows = []
    for dt in (np.float32, np.float64):
        normal, sub = subnormal_operands(dt, n)
        out = np.empty_like(normal)
        for op, fn in _SPEED_OPS.items():
            fn(normal, out)  # warm-up: page in the buffers
            t_norm = _best_time(lambda f=fn, x=normal, o=out: f(x, o), repeats)
            t_sub = _best_time(lambda f=fn, x=sub, o=out: f(x, o), repeats)
            rows.append((np.dtype(dt).name, op, t_norm, t_sub))
    return SpeedDemo(
        "subnormal speed",
        f"numpy over {n} values, normal vs subnormal operands (results subnormal too, "
        f"except sqrt), best of {repeats}",
        tuple(rows),
        n,
        repeats,
        "keep data in the normal range (scale it, as loss scaling does), or enable "
        "flush-to-zero where the lost tiny values do not matter (XLA on CPU and GPUs flush "
        "by default); measure on your own hardware, the penalty differs per core",
        _cpu_name(),
    )


def _cpu_name() -> str:
    """The machine's architecture and CPU model (``fp8jax.host_cpu``)."""
    return f"{platform.machine()}, {host_cpu.cpu_model()}"


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
        point_one(),
        float_to_int(),
        ill_conditioned(),
    ]


def _v(x: float | int) -> str:
    if isinstance(x, int):
        return str(x)
    if math.isnan(x):
        return "nan"
    if math.isfinite(x) and x == int(x) and abs(x) < 1e18:
        return str(int(x))  # integral floats in full: 2^53 shows as 9007199254740992
    # The shortest string that reads back as the same float: 0.9999999999999999
    # must not print as 1.
    return repr(float(x))


def _e(x: float) -> str:
    return "nan" if math.isnan(x) else f"{x:.2g}"


def format_speed(d: SpeedDemo) -> str:
    """The timing demo as text: what was measured, on what, and the ratios."""
    out = [f"{d.name}: {d.what}"]
    for name, op, normal, sub in d.rows:
        out.append(
            f"  {name:<8} {op:<8} normal {normal * 1e3:7.3f} ms  subnormal {sub * 1e3:7.3f} ms  "
            f"ratio {sub / normal:5.1f}x"
        )
    out.append(f"  (measured now on this machine, {d.machine}; wall-clock times vary with load)")
    out.append(f"  do: {d.advice}")
    return "\n".join(out)


def format_demos(demos: list[Demo] | None = None, speed: SpeedDemo | None = None) -> str:
    """A readable listing of the demos; with ``demos=None`` also the timing demo, measured now."""
    if demos is None:
        demos = all_demos()
        speed = subnormal_speed() if speed is None else speed
    out = []
    for d in demos:
        # 'exact 0' demos report an error value: show absolute, not relative, errors.
        kind = "abs.err" if d.exact == 0 else "rel.err"
        out += [
            f"{d.name}: {d.what}",
            f"  exact   {_v(d.exact)}",
            f"  lossy   {_v(d.lossy):<22} {kind} {_e(d.lossy_error):<8} ({d.lossy_how})",
            f"  remedy  {_v(d.remedy):<22} {kind} {_e(d.remedy_error):<8} ({d.remedy_how})",
        ]
        if d.advice:
            out.append(f"  do: {d.advice}")
        out.append("")
    if speed is not None:
        out += [format_speed(speed), ""]
    return "\n".join(out).rstrip() + "\n"
