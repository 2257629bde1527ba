"""Format catalog: figures checked against hand values and an enumeration of every bit pattern."""

import math

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
