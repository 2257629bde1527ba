"""The accelerator table: memory, bandwidth, dense TFLOP/s per format, native formats.

The data lives in one file, ``fp8jax/toolkit/data/accelerators.csv``, one row per
card, every row with the documents it comes from (``source``, vendor datasheets
and whitepapers first; a row resting on secondary sources says so in its
``note``).  TFLOP/s are dense peak figures (vendors often print the 2:4
sparsity figure, twice the dense one; the table never uses it).  A figure
that no source gave is an empty cell, read here as ``None``: it is never
filled in with a guess.

``native`` lists the catalog formats (:mod:`fp8jax.toolkit.catalog`) the
card's matrix units (or, for FP64/FP32, its vector units) execute; ``?`` means
no source said.  The parser checks that every name is a catalog format and
that every format with a TFLOP/s figure is listed, so the format matrix
(:func:`format_matrix`, ``fp8jax gpus --formats``) and the figures cannot
disagree.  ``fp8_native`` (E4M3 weights run as they are) is derived from it.
"""

from __future__ import annotations

import csv
import functools
import io
import math
from dataclasses import dataclass, field
from importlib import resources

from fp8jax.toolkit import catalog

FORMAT_COLUMNS = ("fp64", "fp32", "tf32", "bf16", "fp16", "fp8", "fp4", "int8", "int4")

# Catalog formats that a TFLOP/s column stands for: a figure in the column
# requires one of them in the row's native list.
COLUMN_FORMATS: dict[str, tuple[str, ...]] = {
    "fp64": ("fp64",),
    "fp32": ("fp32",),
    "tf32": ("tf32",),
    "bf16": ("bf16",),
    "fp16": ("fp16",),
    "fp8": ("fp8_e4m3", "fp8_e5m2", "fp8_e4m3fnuz", "fp8_e5m2fnuz", "hif8"),
    "fp4": ("fp4_e2m1",),
    "int8": ("int8",),
    "int4": ("int4",),
}

# Columns of the format matrix, in precision order, with their short labels.
MATRIX_FORMATS: tuple[tuple[str, str], ...] = (
    ("fp64", "fp64"),
    ("fp32", "fp32"),
    ("tf32", "tf32"),
    ("hf32", "hf32"),
    ("bf16", "bf16"),
    ("fp16", "fp16"),
    ("fp8_e4m3", "e4m3"),
    ("fp8_e5m2", "e5m2"),
    ("fp8_e4m3fnuz", "e4m3z"),
    ("fp8_e5m2fnuz", "e5m2z"),
    ("hif8", "hif8"),
    ("fp6_e2m3", "e2m3"),
    ("fp6_e3m2", "e3m2"),
    ("fp4_e2m1", "fp4"),
    ("int8", "int8"),
    ("int4", "int4"),
)

# E4M3 in either encoding: DeepSeek's FP8 weights run as they are (FNUZ cards
# after a re-encode of the codes, no change of precision).
FP8_E4M3_FORMATS = ("fp8_e4m3", "fp8_e4m3fnuz")


@dataclass(frozen=True)
class Accelerator:
    """One row of the accelerator table.

    ``tflops`` maps a format name (FORMAT_COLUMNS) to the dense peak TFLOP/s
    (TOP/s for int8/int4), or None where no source gave a figure.  ``native``
    is the tuple of catalog formats the card executes, or None if unknown.
    """

    key: str
    name: str
    vendor: str
    memory_gb: float | None
    bandwidth_gbs: float | None
    native: tuple[str, ...] | None
    source: str
    note: str
    tflops: dict[str, float | None] = field(default_factory=dict)

    @property
    def fp8_native(self) -> bool:
        """True when the card multiplies E4M3 FP8 natively (unknown counts as no)."""
        return self.supports(*FP8_E4M3_FORMATS)

    def supports(self, *formats: str) -> bool:
        """True when the card executes any of ``formats`` natively (unknown: False)."""
        return self.native is not None and any(f in self.native for f in formats)

    @property
    def memory_bytes(self) -> float | None:
        # Vendor "GB" taken as 1e9 bytes: for HBM cards the physical capacity is
        # usually GiB, so this errs on the side of less memory.
        return None if self.memory_gb is None else self.memory_gb * 1e9

    @property
    def bandwidth_bytes_per_s(self) -> float | None:
        return None if self.bandwidth_gbs is None else self.bandwidth_gbs * 1e9


def _num(cell: str, column: str, key: str) -> float | None:
    cell = cell.strip()
    if not cell:
        return None
    try:
        v = float(cell)
    except ValueError:
        raise ValueError(
            f"accelerators.csv row {key!r}: {column}={cell!r} is not a number"
        ) from None
    if not math.isfinite(v) or v <= 0:
        raise ValueError(
            f"accelerators.csv row {key!r}: {column}={cell!r} is not a positive finite number"
        )
    return v


def _native(cell: str, key: str, tflops: dict[str, float | None]) -> tuple[str, ...] | None:
    cell = cell.strip()
    if cell == "?":
        given = [f for f, v in tflops.items() if v is not None]
        if given:
            raise ValueError(
                f"accelerators.csv row {key!r}: native formats unknown ('?') but figures "
                f"given for {given}"
            )
        return None
    known = {r.name for r in catalog.catalog()}
    names = tuple(n.strip() for n in cell.split(";") if n.strip())
    if not names:
        raise ValueError(f"accelerators.csv row {key!r}: native is empty (use '?' if unknown)")
    for n in names:
        if n not in known:
            raise ValueError(
                f"accelerators.csv row {key!r}: native format {n!r} not in the catalog"
            )
    for col, v in tflops.items():
        if v is not None and not any(f in names for f in COLUMN_FORMATS[col]):
            raise ValueError(
                f"accelerators.csv row {key!r}: {col} figure {v:g} but no "
                f"{'/'.join(COLUMN_FORMATS[col])} in native"
            )
    return names


def parse_table(text: str) -> list[Accelerator]:
    """Parse the CSV text (lines starting with '#' are comments)."""
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    reader = csv.DictReader(io.StringIO("\n".join(lines)))
    rows: list[Accelerator] = []
    seen: set[str] = set()
    for rec in reader:
        key = rec["key"].strip()
        if not key or key in seen:
            raise ValueError(f"accelerators.csv: empty or duplicate key {key!r}")
        seen.add(key)
        if not (rec.get("source") or "").strip():
            raise ValueError(f"accelerators.csv row {key!r} has no source")
        if not (rec.get("note") or "").strip():
            raise ValueError(f"accelerators.csv row {key!r} has no note")
        tflops = {}
        for f in FORMAT_COLUMNS:
            col = f"{f}_tops" if f.startswith("int") else f"{f}_tflops"
            tflops[f] = _num(rec[col] or "", col, key)
        rows.append(
            Accelerator(
                key=key,
                name=rec["name"].strip(),
                vendor=rec["vendor"].strip(),
                memory_gb=_num(rec["memory_gb"] or "", "memory_gb", key),
                bandwidth_gbs=_num(rec["bandwidth_gbs"] or "", "bandwidth_gbs", key),
                native=_native(rec["native"] or "", key, tflops),
                source=rec["source"].strip(),
                note=rec["note"].strip(),
                tflops=tflops,
            )
        )
    return rows


@functools.cache
def accelerators() -> tuple[Accelerator, ...]:
    """All rows of the packaged table, in file order."""
    text = (
        resources.files("fp8jax.toolkit")
        .joinpath("data/accelerators.csv")
        .read_text(encoding="utf-8")
    )
    return tuple(parse_table(text))


def _norm(s: str) -> str:
    return "".join(ch for ch in s.lower() if ch.isalnum())


def get(name: str) -> Accelerator:
    """Look a card up by key or name, ignoring case and punctuation ("H800", "ascend-910b").

    A unique prefix of a key also matches ("a100" is ambiguous; "a100-80g" is not).
    """
    want = _norm(name)
    rows = accelerators()
    for a in rows:
        if want in (_norm(a.key), _norm(a.name)):
            return a
    hits = [a for a in rows if _norm(a.key).startswith(want) or _norm(a.name).startswith(want)]
    if len(hits) == 1:
        return hits[0]
    keys = [a.key for a in rows]
    if hits:
        raise ValueError(f"accelerator {name!r} is ambiguous: {[a.key for a in hits]}")
    raise ValueError(f"unknown accelerator {name!r}; known: {keys}")


def _cell(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:g}"


def format_table(rows: tuple[Accelerator, ...] | None = None, sources: bool = False) -> str:
    """The table as fixed-width text (what ``fp8jax gpus`` prints)."""
    rows = accelerators() if rows is None else rows
    head = [
        "key",
        "name",
        "mem GB",
        "BW GB/s",
        "FP8",
        "fp8 TF",
        "bf16 TF",
        "fp16 TF",
        "tf32 TF",
        "fp32 TF",
        "fp4 TF",
        "int8 TOPS",
        "int4 TOPS",
    ]
    body = [
        [
            a.key,
            a.name,
            _cell(a.memory_gb),
            _cell(a.bandwidth_gbs),
            _fp8_cell(a),
            *(
                _cell(a.tflops[f])
                for f in ("fp8", "bf16", "fp16", "tf32", "fp32", "fp4", "int8", "int4")
            ),
        ]
        for a in rows
    ]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    out = [
        "  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip(),
        "  ".join("-" * w for w in widths),
    ]
    out += ["  ".join(c.ljust(w) for c, w in zip(b, widths)).rstrip() for b in body]
    out.append("")
    out.append("Dense peak TFLOP/s (never the sparsity figure); '-' = no figure found in a source.")
    out.append(
        "FP8: E4M3 weights run natively ('?' = formats unknown); all formats: fp8jax gpus --formats"
    )
    if sources:
        for a in rows:
            out.append(f"\n{a.key}: {a.source}\n  note: {a.note}")
    else:
        out.append("Sources and notes: fp8jax gpus --sources")
    return "\n".join(out)


def _fp8_cell(a: Accelerator) -> str:
    if a.native is None:
        return "?"
    return "yes" if a.fp8_native else "no"


def format_matrix(rows: tuple[Accelerator, ...] | None = None) -> str:
    """Native support per format, one row per card (what ``fp8jax gpus --formats`` prints).

    'x' = executed natively per the row's sources, '.' = not listed as native,
    '?' = no source said which formats the card executes.  Columns are catalog formats (``fp8jax formats``).
    """
    rows = accelerators() if rows is None else rows
    labels = [lab for _, lab in MATRIX_FORMATS]
    kw = max(len("key"), *(len(a.key) for a in rows))
    head = "key".ljust(kw) + "  " + " ".join(lab.rjust(max(4, len(lab))) for lab in labels)
    out = [head.rstrip(), "-" * len(head.rstrip())]
    for a in rows:
        cells = []
        for fmt, lab in MATRIX_FORMATS:
            mark = "?" if a.native is None else ("x" if fmt in a.native else ".")
            cells.append(mark.rjust(max(4, len(lab))))
        out.append((a.key.ljust(kw) + "  " + " ".join(cells)).rstrip())
    out.append("")
    out.append(
        "x = native per the row's sources (matrix units; vector units for fp64/fp32), "
        ". = not listed as native, ? = formats unknown."
    )
    out.append(
        "e4m3/e5m2 = OCP FP8; e4m3z/e5m2z = FNUZ FP8 (AMD CDNA 3); hif8 = Huawei HiFloat8; "
        "hf32 = Huawei HF32; e2m3/e3m2 = FP6; fp4 = E2M1 (MXFP4/NVFP4 elements)."
    )
    return "\n".join(out)
