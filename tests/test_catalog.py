"""Format catalog: figures checked against hand values and an enumeration of every bit pattern."""

import math
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest

from fp8jax.toolkit import catalog

# (name, max, smallest normal, smallest subnormal, eps): worked out from the
# formats' definitions (OCP FP8/MX specs, IEEE 754), not from ml_dtypes.
HAND = [
    ("fp32", (2 - 2**-23) * 2.0**127, 2.0**-126, 2.0**-149, 2.0**-23),
    ("bf16", (2 - 2**-7) * 2.0**127, 2.0**-126, 2.0**-133, 2.0**-7),
    ("fp16", 65504.0, 2.0**-14, 2.0**-24, 2.0**-10),
    ("tf32", (2 - 2**-10) * 2.0**127, 2.0**-126, 2.0**-136, 2.0**-10),
    ("fp8_e4m3", 448.0, 2.0**-6, 2.0**-9, 2.0**-3),
    ("fp8_e5m2", 57344.0, 2.0**-14, 2.0**-16, 2.0**-2),
    ("fp8_e4m3fnuz", 240.0, 2.0**-7, 2.0**-10, 2.0**-3),
    ("fp8_e5m2fnuz", 57344.0, 2.0**-15, 2.0**-17, 2.0**-2),
    ("fp6_e2m3", 7.5, 1.0, 0.125, 0.125),
    ("fp6_e3m2", 28.0, 0.25, 0.0625, 0.25),
    ("fp4_e2m1", 6.0, 1.0, 0.5, 0.5),
    ("e8m0", 2.0**127, 2.0**-127, 2.0**-127, 1.0),
]


@pytest.mark.parametrize("name,mx,mn,sub,eps", HAND)
def test_hand_values(name, mx, mn, sub, eps):
    r = catalog.lookup(name)
    assert r.max == mx
    assert r.smallest_normal == mn
    assert r.smallest_subnormal == sub
    assert r.eps == eps


SMALL = {
    "fp8_e4m3": ml_dtypes.float8_e4m3fn,
    "fp8_e5m2": ml_dtypes.float8_e5m2,
    "fp8_e4m3fnuz": ml_dtypes.float8_e4m3fnuz,
    "fp8_e5m2fnuz": ml_dtypes.float8_e5m2fnuz,
    "fp6_e2m3": ml_dtypes.float6_e2m3fn,
    "fp6_e3m2": ml_dtypes.float6_e3m2fn,
    "fp4_e2m1": ml_dtypes.float4_e2m1fn,
    "bf16": ml_dtypes.bfloat16,
    "fp16": np.float16,
}


@pytest.mark.parametrize("name", sorted(SMALL))
def test_enumerated_bit_patterns(name):
    """Decode every bit pattern; max, smallest values and inf/nan must agree with the catalog."""
    t = SMALL[name]
    r = catalog.lookup(name)
    nbits = r.bits
    codes = np.arange(2**nbits, dtype=np.uint16 if nbits > 8 else np.uint8)
    if nbits == 16:
        with np.errstate(invalid="ignore"):
            vals = codes.view(t).astype(np.float64)
    else:
        # Sub-byte types are stored one per byte, in the low bits.
        vals = codes.astype(np.uint8).view(t).astype(np.float64)
    finite = vals[np.isfinite(vals)]
    pos = finite[finite > 0]
    assert finite.max() == r.max
    assert pos.min() == r.smallest_subnormal
    assert r.inf == bool(np.isinf(vals).any())
    assert r.nan == bool(np.isnan(vals).any())
    # eps: gap between 1 and the next value.
    assert pos[pos > 1].min() - 1.0 == r.eps
    # The normal range starts where consecutive gaps stop being uniform.
    normals = pos[pos >= r.smallest_normal]
    subn = pos[pos < r.smallest_normal]
    if len(subn) > 1:
        gaps = np.diff(np.sort(subn))
        assert np.allclose(gaps, r.smallest_subnormal)
    assert normals.min() == r.smallest_normal


def test_integers_and_typed_in_rows():
    assert catalog.lookup("int8").max == 127
    assert catalog.lookup("int4").max == 7
    nf4 = catalog.lookup("nf4")
    assert nf4.source.startswith("typed in")
    assert catalog.lookup("tf32").source.startswith("typed in")
    assert len(catalog.NF4_CODEBOOK) == 16 and catalog.NF4_CODEBOOK[7] == 0.0
    assert list(catalog.NF4_CODEBOOK) == sorted(catalog.NF4_CODEBOOK)
    # Every row that has an array type says it was computed.
    for r in catalog.catalog():
        assert r.source.startswith("computed") == (r.dtype is not None)


def test_decimal_digits_and_table():
    assert math.isclose(catalog.lookup("fp32").decimal_digits, 24 * math.log10(2))
    table = catalog.format_table()
    for name in [
        "fp64",
        "fp32",
        "tf32",
        "hf32",
        "hif8",
        "bf16",
        "fp16",
        "fp8_e4m3",
        "fp8_e5m2",
        "nf4",
        "int4",
        "e8m0",
    ]:
        assert name in table
    with pytest.raises(ValueError, match="unknown format"):
        catalog.lookup("fp7")


def test_hf32_and_hif8_rows():
    hf = catalog.lookup("hf32")
    # HF32: fp32's exponent (same range), 11 mantissa bits (CANN docs).
    assert (hf.bits, hf.exponent_bits, hf.mantissa_bits) == (20, 8, 11)
    assert hf.max == (2 - 2.0**-11) * 2.0**127
    assert hf.smallest_normal == 2.0**-126 and hf.eps == 2.0**-11
    assert math.isnan(hf.smallest_subnormal)  # not documented
    h8 = catalog.lookup("HiFloat8")
    assert h8.name == "hif8" and h8.bits == 8
    assert (h8.max, h8.smallest_normal, h8.smallest_subnormal) == (2.0**15, 2.0**-15, 2.0**-22)
    for r in (hf, h8):
        assert r.source.startswith("typed in") and "http" in r.source
    names = [r.name for r in catalog.catalog()]
    assert names.index("tf32") < names.index("hf32") < names.index("bf16")
    assert names.index("fp8_e5m2fnuz") < names.index("hif8") < names.index("fp6_e2m3")


def _hif8_reference() -> list[Fraction]:
    """HiF8's finite positive values from the white paper's description, by exponent range.

    Normal: E in -15..15 with 3 mantissa bits for |E| <= 3 (7 exponents), 2 bits
    for 4 <= |E| <= 7 (8), 1 bit for 8 <= |E| <= 15 (16); denormal: 2^-16 ..
    2^-22; the largest code (1.5 * 2^15) is Inf.
    """
    vals = set()
    for e in range(-15, 16):
        m = 3 if abs(e) <= 3 else 2 if abs(e) <= 7 else 1
        for k in range(2**m):
            vals.add((1 + Fraction(k, 2**m)) * Fraction(2) ** e)
    vals |= {Fraction(2) ** -k for k in range(16, 23)}
    vals.discard(Fraction(3, 2) * 2**15)
    return sorted(vals)


def test_hif8_value_set_and_round_trip():
    ref = _hif8_reference()
    assert [Fraction(v) for v in catalog.HIF8_VALUES] == ref
    # 119 normal + 7 denormal values per sign; with zero, NaN and +-Inf: 256 codes.
    assert 2 * len(ref) + 1 + 1 + 2 == 256
    rng = np.random.default_rng(0)
    mids = [(a + b) / 2 for a, b in zip(ref[:-1], ref[1:], strict=True)]
    xs = [float(m) for m in mids[::3]] + list(
        rng.standard_normal(300) * 10.0 ** rng.integers(-7, 5, 300)
    )
    xs += [0.0, -0.0, 2.0**-23, 2.0**-24, 1.0, -3.5, 2.0**15, 40959.0, 40960.0, 1e6]
    got = catalog.hif8_round(np.array(xs))
    grid = [Fraction(0)] + ref
    for x, g in zip(xs, got, strict=True):
        mag = abs(Fraction(x))
        if mag >= Fraction(2**15 + 2**13):
            want = math.inf
        else:
            # Nearest value; at a tie the larger magnitude (ties away from zero).
            best = min(grid, key=lambda v: (abs(v - mag), -v))
            want = float(best)
        want = math.copysign(want, x) if want != 0 else 0.0
        assert g == want, (x, g, want)
    assert np.isnan(catalog.hif8_round(np.nan))


def _hf32_reference(x: float) -> float:
    """float32 x rounded to 12 significant bits (11 stored), ties to even, exactly."""
    m, e = math.frexp(x)  # x = m * 2^e, 0.5 <= |m| < 1
    q = Fraction(x) * Fraction(2) ** (12 - e)  # 12 significant bits before the point
    return float(round(q) * Fraction(2) ** (e - 12))  # round(Fraction): half to even


def test_hf32_round_trip_against_exact_rounding():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(2000) * 10.0 ** rng.integers(-30, 30, 2000)).astype(np.float32)
    # Exact ties: 1 + k * 2^-12 with odd k sits halfway between HF32 neighbours.
    ties = np.float32(1.0) + np.arange(1, 64, 2, dtype=np.float32) * np.float32(2.0**-12)
    x = np.concatenate([x, ties, -ties])
    got = catalog.hf32_round(x)
    assert got.dtype == np.float32
    for xi, gi in zip(x.tolist(), got.tolist(), strict=True):
        assert gi == _hf32_reference(xi), xi
    # fp32's largest value rounds past HF32's largest: Inf, as float32 encodes it.
    assert np.isinf(catalog.hf32_round(np.float32(3.4028235e38)))
    assert catalog.hf32_round(np.float32(catalog.lookup("hf32").max)) == catalog.lookup("hf32").max
    assert np.isnan(catalog.hf32_round(np.float32("nan")))


def test_group_formats_bits_by_hand():
    # bits per element = element bits + (scale bits + zero-point bits) / group
    hand = {
        "fp8-b128": 8 + 32 / (128 * 128),  # DeepSeek-V3: float32 per 128x128 block
        "int8-b128": 8 + 32 / (128 * 128),
        "w4a16-g128": 4 + (16 + 4) / 128,  # FP16 scale + 4-bit zero per 128
        "mxfp8": 8 + 8 / 32,
        "mxfp4": 4 + 8 / 32,
        "nvfp4": 4 + 8 / 16,
    }
    got = {g.name: g.bits_per_element for g in catalog.group_formats()}
    assert got == hand
    for g in catalog.group_formats():
        assert catalog.lookup(g.element) and catalog.lookup(g.scale)
        assert g.source and set(g.native) <= {r.name for r in catalog.catalog()}
    assert catalog.group_format("w4a16-g128").native == ()  # weight-only
    with pytest.raises(ValueError, match="unknown group format"):
        catalog.group_format("w3a16")
    assert "w4a16-g128" in catalog.group_table()
