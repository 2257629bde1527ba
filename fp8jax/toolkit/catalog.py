"""Catalog of number formats used in training and inference.

Every figure of a format that exists as a numpy or ml_dtypes type is *computed*
from that type (``numpy.finfo`` / ``ml_dtypes.finfo`` / ``iinfo``), never typed
in.  Four formats have no array type: TF32 (a tensor-core input mode, stored in
32-bit registers), Huawei's HF32 (the same idea on Ascend cube units), Huawei's
HiFloat8 (a tapered 8-bit format) and NF4 (a 16-entry code book from QLoRA).
Their figures are derived here from their published definitions and every such
row says so in ``source``.  HF32 and HiFloat8 have an emulated round trip
(:func:`hf32_round`, :func:`hif8_round`) built from the same definitions.

Deployment formats that pair an element format with per-group scales (INT8 /
INT4 weights, W4A16, W8A8, MXFP4, NVFP4, DeepSeek's FP8 blocks) are listed
separately as :class:`GroupFormat` rows (:func:`group_formats`): their cost is
the element's bits plus the scale (and zero-point) bits shared by a group.

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

# HF32 (Huawei CANN documentation, ``--allow_hf32`` / ``ENABLE_HF32_EXECUTION``):
# "HF32 shares the same value range with FP32, but its mantissa precision
# (11 bits) is close to FP16 (10 bits)"; Ascend cube units convert float32
# operands of Conv / Matmul to it (round to nearest even by default,
# ``SetHF32(transMode=0)``).  No subnormal rule is documented.
HF32_SOURCE = (
    "typed in: Huawei CANN docs, --allow_hf32 "
    "(https://www.hiascend.com/document/detail/en/canncommercial/850/devaids/atctool/"
    "atlasatcparam_16_0077.html): fp32's range, 11 mantissa bits; no array type"
)
HF32_MANTISSA_BITS = 11

# HiFloat8 (Luo et al. 2024, "Ascend HiFloat8 Format for Deep Learning",
# arXiv 2409.16626): sign, a prefix-coded "dot" field D = 0..4 giving the
# width of a sign-magnitude exponent whose leading magnitude bit is implicit,
# then the mantissa filling the 8 bits.  D = 0: E = 0, 3 mantissa bits;
# D = 1: E = +-1, 3 bits; D = 2: |E| in 2..3, 3 bits; D = 3: |E| in 4..7,
# 2 bits; D = 4: |E| in 8..15, 1 bit -- the paper's "7 exponents with a 3-bit
# mantissa, 8 with 2 bits, 16 with 1 bit".  A denormal mode adds 2^-16 ..
# 2^-22 (38 binades in all, 2^-22 .. 2^15).  The paper's abstract gives the
# field widths and the binade counts, and says every special value is
# encoded with a single zero.  Which codes hold them is taken here as: NaN =
# the spare negative-zero pattern, +-Inf = the (E = +15, mantissa 1) codes, so
# the largest finite value is 2^15.  That assignment is a reading that
# fits 256 codes; it is not checked against Ascend hardware.
HIF8_SOURCE = (
    "typed in: Ascend HiFloat8 white paper (Luo et al. 2024, arXiv 2409.16626, "
    "https://arxiv.org/abs/2409.16626): tapered, 1-3 mantissa bits; no array type"
)
HIF8_MAX = 2.0**15
HIF8_MIN_NORMAL = 2.0**-15
HIF8_MIN_DENORMAL = 2.0**-22


def _hif8_positive_values() -> np.ndarray:
    """Every finite positive HiFloat8 value, ascending (float64; see HIF8_SOURCE)."""
    vals: list[float] = []
    # (exponent magnitudes, mantissa bits) per dot value D = 0..4.
    rows = [([0], 3), ([1], 3), ([2, 3], 3), (list(range(4, 8)), 2), (list(range(8, 16)), 1)]
    for mags, mbits in rows:
        for mag in mags:
            for e in {mag, -mag}:
                for m in range(2**mbits):
                    vals.append((1.0 + m / 2**mbits) * 2.0**e)
    # Denormal mode: the 3 remaining bits select one more power of two below 2^-15.
    vals += [2.0 ** (k - 23) for k in range(1, 8)]
    # The (E = +15, mantissa 1) code is +Inf, not 1.5 * 2^15.
    vals.remove(1.5 * 2.0**15)
    return np.array(sorted(vals), dtype=np.float64)


HIF8_VALUES: np.ndarray = _hif8_positive_values()


def hif8_round(x) -> np.ndarray:
    """Round to the nearest HiFloat8 value (emulated; float64 in, float64 out).

    Ties go away from zero, the paper's "TA" rounding.  Magnitudes at or above
    2^15 + 2^13 (half a step past the largest value, whose step is 2^14) become
    +-Inf as in IEEE formats; values below half the smallest denormal become
    (unsigned) zero; NaN stays NaN.
    """
    # float64 holds every HiF8 value, every float32/float16 input and every
    # midpoint between HiF8 neighbours exactly, so the comparisons are exact.
    x64 = np.asarray(x, dtype=np.float64)
    mag = np.abs(x64)
    grid = np.concatenate([[0.0], HIF8_VALUES])
    # Index of the first grid value >= mag; the nearest is it or the one below.
    hi = np.clip(np.searchsorted(grid, mag, side="left"), 1, len(grid) - 1)
    lo_v, hi_v = grid[hi - 1], grid[hi]
    # Ties away from zero: at the exact midpoint take the larger magnitude.
    pick = np.where(mag - lo_v >= hi_v - mag, hi_v, lo_v)
    pick = np.where(mag >= HIF8_MAX + 2.0**13, np.inf, pick)
    out = np.where(np.signbit(x64) & (pick != 0), -pick, pick)
    return np.where(np.isnan(x64), np.nan, out)


def hf32_round(x) -> np.ndarray:
    """Round float32 values to HF32 (emulated): 11 explicit mantissa bits, fp32's exponent.

    Round to nearest, ties to even, on the float32 bit pattern (the CANN default,
    ``transMode=0``); a carry out of the mantissa moves to the next binade and,
    from fp32's largest binade, to Inf, as the float32 encoding does.  Inf and
    NaN pass through.  Input is cast to float32 first: HF32 replaces float32
    operands.
    """
    # HF32 replaces float32 operands: round the float32 value, not a wider one.
    x32 = np.asarray(x, dtype=np.float32)
    # Work on the bit pattern in uint64 so adding the rounding increment cannot wrap.
    u = x32.view(np.uint32).astype(np.uint64)
    drop = 23 - HF32_MANTISSA_BITS
    lsb = (u >> drop) & 1
    # Round half to even: add half an HF32 ulp minus one, plus the kept lsb.
    r = (u + (1 << (drop - 1)) - 1 + lsb) & ~np.uint64((1 << drop) - 1)
    special = (u & 0x7F800000) == 0x7F800000
    # Back to the 32-bit pattern (the rounded value fits: at most a carry into the exponent).
    r = np.where(special, u, r).astype(np.uint32)
    return r.view(np.float32)


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


def _hf32_info() -> FormatInfo:
    # fp32's 8 exponent bits (same range) with 11 mantissa bits; the figures
    # follow from the field widths.  Subnormal handling is not documented.
    e, m, bias = 8, HF32_MANTISSA_BITS, 127
    return FormatInfo(
        name="hf32",
        dtype=None,
        bits=1 + e + m,
        exponent_bits=e,
        mantissa_bits=m,
        max=(2.0 - 2.0**-m) * 2.0**bias,
        smallest_normal=2.0 ** (1 - bias),
        smallest_subnormal=float("nan"),
        eps=2.0**-m,
        decimal_digits=(m + 1) * math.log10(2.0),
        inf=True,
        nan=True,
        source=HF32_SOURCE,
        note="Ascend cube-unit mode for fp32 Conv/Matmul operands (Atlas A2/A3); held in "
        "32-bit registers; subnormals not documented; emulated by hf32_round",
    )


def _hif8_info() -> FormatInfo:
    # Tapered: the precision figures are those of the best-resolved binades
    # (|E| <= 3, 3 mantissa bits), which include 1.0.
    return FormatInfo(
        name="hif8",
        dtype=None,
        bits=8,
        exponent_bits=None,
        mantissa_bits=None,
        max=HIF8_MAX,
        smallest_normal=HIF8_MIN_NORMAL,
        smallest_subnormal=HIF8_MIN_DENORMAL,
        eps=2.0**-3,
        decimal_digits=4 * math.log10(2.0),
        inf=True,
        nan=True,
        source=HIF8_SOURCE,
        note="Huawei HiFloat8: 0-4 exponent bits, 3/2/1 mantissa bits for |E| <= 3 / 4..7 / "
        "8..15, denormals to 2^-22; emulated by hif8_round",
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
    # TF32 and HF32 sit between FP32 and BF16 by precision; HiFloat8 after the
    # other 8-bit floats.
    rows.insert(2, _tf32_info())
    rows.insert(3, _hf32_info())
    rows.insert([r.name for r in rows].index("fp8_e5m2fnuz") + 1, _hif8_info())
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
        "hifloat8": "hif8",
        "hi_f8": "hif8",
    }
    key = aliases.get(key, key)
    for row in catalog():
        if row.name == key or row.dtype == key:
            return row
    raise ValueError(f"unknown format {name!r}; known: {[r.name for r in catalog()]}")


@dataclass(frozen=True)
class GroupFormat:
    """A deployment format: elements of one catalog format sharing a scale per group.

    ``group`` elements share one ``scale`` (a catalog format) and, for
    asymmetric schemes, a ``zero_bits``-bit zero point.  ``activations`` is the
    GEMM's other operand; ``native`` lists the catalog formats of which any one,
    executed by the card's matrix units, runs the GEMM on the stored elements
    (empty for weight-only schemes such as W4A16: the weights are dequantized
    to BF16/FP16 before the multiply, saving memory and bandwidth only).
    """

    name: str
    element: str
    group: int
    scale: str
    zero_bits: int
    activations: str
    native: tuple[str, ...]
    source: str
    note: str = ""

    @property
    def element_bits(self) -> int:
        return lookup(self.element).bits

    @property
    def scale_bits(self) -> int:
        return lookup(self.scale).bits

    @property
    def overhead_bits(self) -> float:
        """Scale (and zero-point) bits per element: (scale bits + zero bits) / group."""
        return (self.scale_bits + self.zero_bits) / self.group

    @property
    def bits_per_element(self) -> float:
        """Storage bits per element, scales included."""
        return self.element_bits + self.overhead_bits

    def asdict(self) -> dict:
        d = asdict(self)
        d.update(
            element_bits=self.element_bits,
            scale_bits=self.scale_bits,
            overhead_bits=self.overhead_bits,
            bits_per_element=self.bits_per_element,
        )
        return d


_BLOCK = 128 * 128  # DeepSeek-V3's weight block: 128x128 elements, one scale.

GROUP_FORMATS: tuple[GroupFormat, ...] = (
    GroupFormat(
        "fp8-b128",
        "fp8_e4m3",
        _BLOCK,
        "fp32",
        0,
        "FP8 E4M3, one scale per 1x128 tile",
        ("fp8_e4m3", "fp8_e4m3fnuz"),
        "DeepSeek-V3 technical report (arXiv 2412.19437, section 3.3) and its published "
        "checkpoint (weight_scale_inv: one float32 per 128x128 block)",
        "W8A8 in FP8; FNUZ cards (MI300 series) run it after a re-encode to e4m3fnuz",
    ),
    GroupFormat(
        "int8-b128",
        "int8",
        _BLOCK,
        "fp32",
        0,
        "INT8, one scale per 1x128 token group (dynamic)",
        ("int8",),
        "block-wise INT8 DeepSeek-R1 (https://huggingface.co/meituan/DeepSeek-R1-Block-INT8): "
        "the FP8 checkpoint's 128x128 blocks requantized to INT8",
        "W8A8 in INT8: runs on INT8 matrix units (Ampere, Ascend, TPU, ...)",
    ),
    GroupFormat(
        "w4a16-g128",
        "int4",
        128,
        "fp16",
        4,
        "BF16/FP16 (weight-only)",
        (),
        "AWQ (Lin et al. 2023, arXiv 2306.00978) and GPTQ (Frantar et al. 2022, "
        "arXiv 2210.17323): INT4 weights, groups of 128 along K, FP16 scale and 4-bit zero",
        "weight-only: dequantized to BF16/FP16 in the GEMM kernel; saves memory and "
        "bandwidth, not FLOPs",
    ),
    GroupFormat(
        "mxfp8",
        "fp8_e4m3",
        32,
        "e8m0",
        0,
        "MXFP8",
        ("fp8_e4m3",),
        "OCP Microscaling Formats (MX) v1.0 specification "
        "(https://www.opencompute.org/documents/ocp-microscaling-formats-mx-v1-0-spec-final-pdf)",
        "power-of-two scale per 32 elements",
    ),
    GroupFormat(
        "mxfp4",
        "fp4_e2m1",
        32,
        "e8m0",
        0,
        "MXFP4 (W4A4) or BF16 (weight-only)",
        ("fp4_e2m1",),
        "OCP Microscaling Formats (MX) v1.0 specification "
        "(https://www.opencompute.org/documents/ocp-microscaling-formats-mx-v1-0-spec-final-pdf)",
        "power-of-two scale per 32 elements",
    ),
    GroupFormat(
        "nvfp4",
        "fp4_e2m1",
        16,
        "fp8_e4m3",
        0,
        "NVFP4 (W4A4) or BF16 (weight-only)",
        ("fp4_e2m1",),
        "NVIDIA, Introducing NVFP4 (https://developer.nvidia.com/blog/"
        "introducing-nvfp4-for-efficient-and-accurate-low-precision-inference/): E2M1 "
        "elements, an E4M3 scale per 16, one float32 per tensor",
        "the per-tensor float32 is not counted (4 bytes per tensor)",
    ),
)


def group_formats() -> tuple[GroupFormat, ...]:
    """The deployment group formats (see :class:`GroupFormat`)."""
    return GROUP_FORMATS


def group_format(name: str) -> GroupFormat:
    """One group format by name ("w4a16-g128", "nvfp4", ...)."""
    for g in GROUP_FORMATS:
        if g.name == name.lower():
            return g
    raise ValueError(f"unknown group format {name!r}; known: {[g.name for g in GROUP_FORMATS]}")


def group_table(rows: tuple[GroupFormat, ...] | None = None) -> str:
    """The group formats as a fixed-width table (printed by ``fp8jax formats``)."""
    rows = GROUP_FORMATS if rows is None else rows
    head = ["group format", "element", "group", "scale", "zero", "bits/elem", "activations"]
    body = [
        [
            g.name,
            g.element,
            "128x128" if g.group == _BLOCK else str(g.group),
            g.scale,
            str(g.zero_bits) if g.zero_bits else "-",
            f"{g.bits_per_element:.5g}",
            g.activations,
        ]
        for g in rows
    ]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(b, widths)).rstrip() for b in body]
    lines.append("")
    lines.append(
        "bits/elem = element bits + (scale bits + zero-point bits) / group; "
        "sources: fp8jax formats --json"
    )
    return "\n".join(lines)


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
