"""Catalog of number formats used in training and inference.

Every figure of a format that exists as a numpy or ml_dtypes type is *computed*
from that type (``numpy.finfo`` / ``ml_dtypes.finfo`` / ``iinfo``), never typed
in.  Two formats have no array type: TF32 (a tensor-core input mode, stored in
32-bit registers) and NF4 (a 16-entry code book from QLoRA).  Their figures are
derived here from their definitions and every such row says so in ``source``.

Columns:

* ``bits``: storage bits of one element (TF32: the 19 significant bits; it
  occupies 32 bits in memory);
* ``exponent_bits`` / ``mantissa_bits``: explicit field widths (None for
  integer and code-book formats);
* ``max``: largest finite value; ``smallest_normal`` / ``smallest_subnormal``:
  smallest positive normal / subnormal value (integers: 1);
* ``eps``: machine epsilon, the gap between 1 and the next larger value
  (``2**-mantissa_bits``; integers: 1);
* ``decimal_digits``: significand precision in decimal digits,
  ``(mantissa_bits + 1) * log10(2)`` for floats (the implicit bit included),
  ``log10(max)`` for integers;
* ``inf`` / ``nan``: whether the format encodes infinities / NaN;
* ``source``: where the figures come from.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import ml_dtypes
import numpy as np


@dataclass(frozen=True)
class FormatInfo:
    """Figures of one number format (see the module docstring for the columns)."""

    name: str
    dtype: str | None
    bits: int
    exponent_bits: int | None
    mantissa_bits: int | None
    max: float
    smallest_normal: float
    smallest_subnormal: float
    eps: float
    decimal_digits: float
    inf: bool
    nan: bool
    source: str
    note: str = ""

    def asdict(self) -> dict:
        return asdict(self)


# NF4 code book of QLoRA (Dettmers et al. 2023, "QLoRA: Efficient Finetuning of
# Quantized LLMs", appendix E; bitsandbytes' NF4 table): quantiles of N(0, 1)
# normalised to [-1, 1], with an exact zero.  Values are relative to the
# per-block absmax scale.
NF4_CODEBOOK: tuple[float, ...] = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)

# name -> (array type, note).  Order is the order of the printed table.
_FLOAT_TYPES: dict[str, tuple[type, str]] = {
    "fp64": (np.float64, "IEEE 754 binary64"),
    "fp32": (np.float32, "IEEE 754 binary32"),
    "bf16": (ml_dtypes.bfloat16, "bfloat16: fp32's range, 8-bit significand"),
    "fp16": (np.float16, "IEEE 754 binary16"),
    "fp8_e4m3": (ml_dtypes.float8_e4m3fn, "OCP E4M3 (e4m3fn): no inf, NaN = S.1111.111"),
    "fp8_e5m2": (ml_dtypes.float8_e5m2, "OCP E5M2: IEEE-like, has inf"),
    "fp8_e4m3fnuz": (ml_dtypes.float8_e4m3fnuz, "AMD/Graphcore E4M3: no -0, NaN = 0x80, bias 8"),
    "fp8_e5m2fnuz": (ml_dtypes.float8_e5m2fnuz, "AMD/Graphcore E5M2: no inf, no -0, bias 16"),
    "fp6_e2m3": (ml_dtypes.float6_e2m3fn, "OCP MX FP6 E2M3: no inf, no NaN"),
    "fp6_e3m2": (ml_dtypes.float6_e3m2fn, "OCP MX FP6 E3M2: no inf, no NaN"),
    "fp4_e2m1": (ml_dtypes.float4_e2m1fn, "OCP MX FP4 E2M1 (also NVFP4's element type)"),
    "e8m0": (ml_dtypes.float8_e8m0fnu, "OCP MX scale: unsigned power of two, NaN = 0xFF"),
}

_INT_TYPES: dict[str, tuple[type, str]] = {
    "int8": (np.int8, "two's complement"),
    "int4": (ml_dtypes.int4, "two's complement, stored one per byte by numpy"),
}


def _has_inf(t: type) -> bool:
    # The cast of an infinite value tells whether the format can hold it: formats
    # without inf give NaN (or, for e8m0, NaN as well).
    with np.errstate(all="ignore"):
        return bool(np.isinf(np.array(np.inf, np.float32).astype(t).astype(np.float32)))


def _has_nan(t: type) -> bool:
    with np.errstate(all="ignore"):
        return bool(np.isnan(np.array(np.nan, np.float32).astype(t).astype(np.float32)))


def _float_info(name: str, t: type, note: str) -> FormatInfo:
    fi = ml_dtypes.finfo(t)
    module = "numpy" if t in (np.float64, np.float32, np.float16) else "ml_dtypes"
    nmant = int(fi.nmant)
    return FormatInfo(
        name=name,
        dtype=np.dtype(t).name,
        bits=int(fi.bits),
        exponent_bits=int(fi.nexp),
        mantissa_bits=nmant,
        max=float(fi.max),
        smallest_normal=float(fi.smallest_normal),
        smallest_subnormal=float(fi.smallest_subnormal),
        eps=float(fi.eps),
        decimal_digits=(nmant + 1) * math.log10(2.0),
        inf=_has_inf(t),
        nan=_has_nan(t),
        source=f"computed: {module}.finfo({np.dtype(t).name})",
        note=note,
    )


def _int_info(name: str, t: type, note: str) -> FormatInfo:
    ii = ml_dtypes.iinfo(t)
    return FormatInfo(
        name=name,
        dtype=np.dtype(t).name,
        bits=int(ii.bits),
        exponent_bits=None,
        mantissa_bits=None,
        max=float(ii.max),
        smallest_normal=1.0,
        smallest_subnormal=1.0,
        eps=1.0,
        decimal_digits=math.log10(float(ii.max)),
        inf=False,
        nan=False,
        source=f"computed: ml_dtypes.iinfo({np.dtype(t).name})",
        note=f"{note}; min {int(ii.min)}",
    )


def _tf32_info() -> FormatInfo:
    # TF32 = fp32's 8 exponent bits (bias 127) with fp16's 10 mantissa bits; no
    # array type exists, so the figures follow from the field widths.
    e, m, bias = 8, 10, 127
    return FormatInfo(
        name="tf32",
        dtype=None,
        bits=1 + e + m,
        exponent_bits=e,
        mantissa_bits=m,
        max=(2.0 - 2.0**-m) * 2.0**bias,
        smallest_normal=2.0 ** (1 - bias),
        smallest_subnormal=2.0 ** (1 - bias - m),
        eps=2.0**-m,
        decimal_digits=(m + 1) * math.log10(2.0),
        inf=True,
        nan=True,
        source="typed in: derived from the field widths (1+8+10); no numpy/ml_dtypes type",
        note="tensor-core input mode of fp32 data (Ampere+); held in 32-bit registers",
    )


def _nf4_info() -> FormatInfo:
    nonzero = [abs(v) for v in NF4_CODEBOOK if v != 0.0]
    return FormatInfo(
        name="nf4",
        dtype=None,
        bits=4,
        exponent_bits=None,
        mantissa_bits=None,
        max=max(NF4_CODEBOOK),
        smallest_normal=min(nonzero),
        smallest_subnormal=min(nonzero),
        eps=float("nan"),
        decimal_digits=float("nan"),
        inf=False,
        nan=False,
        source="typed in: QLoRA NF4 code book (Dettmers et al. 2023); no numpy/ml_dtypes type",
        note="16 normal-quantile levels in [-1, 1], times a per-block absmax scale",
    )


def catalog() -> list[FormatInfo]:
    """All formats, in table order (FP64 ... FP4, NF4, INT8, INT4, E8M0)."""
    rows = [_float_info(n, t, note) for n, (t, note) in _FLOAT_TYPES.items() if n != "e8m0"]
    # TF32 sits between FP32 and BF16 by precision.
    rows.insert(2, _tf32_info())
    rows.append(_nf4_info())
    rows += [_int_info(n, t, note) for n, (t, note) in _INT_TYPES.items()]
    t, note = _FLOAT_TYPES["e8m0"]
    rows.append(_float_info("e8m0", t, note))
    return rows


def lookup(name: str) -> FormatInfo:
    """One format by name; accepts e.g. "e4m3", "fp8_e4m3", "float8_e4m3fn", "bfloat16"."""
    key = name.lower().replace("-", "_")
    aliases = {
        "float64": "fp64",
        "double": "fp64",
        "float32": "fp32",
        "float": "fp32",
        "bfloat16": "bf16",
        "float16": "fp16",
        "half": "fp16",
        "e4m3": "fp8_e4m3",
        "e4m3fn": "fp8_e4m3",
        "float8_e4m3fn": "fp8_e4m3",
        "e5m2": "fp8_e5m2",
        "float8_e5m2": "fp8_e5m2",
        "e4m3fnuz": "fp8_e4m3fnuz",
        "float8_e4m3fnuz": "fp8_e4m3fnuz",
        "e5m2fnuz": "fp8_e5m2fnuz",
        "float8_e5m2fnuz": "fp8_e5m2fnuz",
        "fp4": "fp4_e2m1",
        "e2m1": "fp4_e2m1",
        "float4_e2m1fn": "fp4_e2m1",
        "float8_e8m0fnu": "e8m0",
        "ue8m0": "e8m0",
    }
    key = aliases.get(key, key)
    for row in catalog():
        if row.name == key or row.dtype == key:
            return row
    raise ValueError(f"unknown format {name!r}; known: {[r.name for r in catalog()]}")


def _fmt_num(v: float | None) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and math.isnan(v):
        return "n/a"
    if v == int(v) and abs(v) < 1e7:
        return str(int(v))
    return f"{v:.4g}"


def format_table(rows: list[FormatInfo] | None = None) -> str:
    """The catalog as a fixed-width text table (what ``fp8jax formats`` prints)."""
    rows = catalog() if rows is None else rows
    head = [
        "format",
        "bits",
        "E",
        "M",
        "max",
        "min normal",
        "min subnormal",
        "eps",
        "digits",
        "inf",
        "nan",
    ]
    body = []
    for r in rows:
        body.append(
            [
                r.name,
                str(r.bits),
                _fmt_num(r.exponent_bits),
                _fmt_num(r.mantissa_bits),
                _fmt_num(r.max),
                _fmt_num(r.smallest_normal),
                _fmt_num(r.smallest_subnormal),
                _fmt_num(r.eps),
                "n/a" if math.isnan(r.decimal_digits) else f"{r.decimal_digits:.2f}",
                "y" if r.inf else "n",
                "y" if r.nan else "n",
            ]
        )
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(b, widths)).rstrip() for b in body]
    typed = [r.name for r in rows if r.source.startswith("typed in")]
    lines.append("")
    lines.append(
        "Computed from numpy/ml_dtypes finfo/iinfo, except "
        + ", ".join(typed)
        + " (typed in from their definitions: no array type exists)."
    )
    return "\n".join(lines)
