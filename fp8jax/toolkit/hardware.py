"""The accelerator table: memory, bandwidth, dense TFLOP/s per format, native FP8.

The data lives in one file, ``fp8jax/toolkit/data/accelerators.csv``, one row per
card, every row with the vendor document it comes from (``source``) and a
``note``.  TFLOP/s are dense peak figures (vendors often print the 2:4
sparsity figure, twice the dense one; the table never uses it).  A figure
that no source gave is an empty cell, read here as ``None``: it is never
filled in with a guess.
"""

from __future__ import annotations

import csv
import functools
import io
from dataclasses import dataclass, field
from importlib import resources

FORMAT_COLUMNS = ("fp64", "fp32", "tf32", "bf16", "fp16", "fp8", "fp4", "int8")


@dataclass(frozen=True)
class Accelerator:
    """One row of the accelerator table.

    ``tflops`` maps a format name (FORMAT_COLUMNS) to the dense peak TFLOP/s
    (TOP/s for int8), or None where no source gave a figure.
    """

    key: str
    name: str
    vendor: str
    memory_gb: float | None
    bandwidth_gbs: float | None
    fp8_native: bool
    source: str
    note: str
    tflops: dict[str, float | None] = field(default_factory=dict)

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
    if v < 0:
        raise ValueError(f"accelerators.csv row {key!r}: {column}={cell!r} is negative")
    return v


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
        if not rec.get("source", "").strip():
            raise ValueError(f"accelerators.csv row {key!r} has no source")
        native = rec["fp8_native"].strip().lower()
        if native not in ("yes", "no"):
            raise ValueError(f"accelerators.csv row {key!r}: fp8_native must be yes/no")
        tflops = {}
        for f in FORMAT_COLUMNS:
            col = "int8_tops" if f == "int8" else f"{f}_tflops"
            tflops[f] = _num(rec[col], col, key)
        rows.append(
            Accelerator(
                key=key,
                name=rec["name"].strip(),
                vendor=rec["vendor"].strip(),
                memory_gb=_num(rec["memory_gb"], "memory_gb", key),
                bandwidth_gbs=_num(rec["bandwidth_gbs"], "bandwidth_gbs", key),
                fp8_native=native == "yes",
                source=rec["source"].strip(),
                note=rec["note"].strip(),
                tflops=tflops,
            )
        )
    return rows


@functools.cache
def accelerators() -> tuple[Accelerator, ...]:
    """All rows of the packaged table, in file order."""
    text = resources.files("fp8jax.toolkit").joinpath("data/accelerators.csv").read_text(encoding="utf-8")
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
    ]
    body = [
        [
            a.key,
            a.name,
            _cell(a.memory_gb),
            _cell(a.bandwidth_gbs),
            "yes" if a.fp8_native else "no",
            *(_cell(a.tflops[f]) for f in ("fp8", "bf16", "fp16", "tf32", "fp32", "fp4", "int8")),
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
    if sources:
        for a in rows:
            out.append(f"\n{a.key}: {a.source}\n  note: {a.note}")
    else:
        out.append("Sources and notes: fp8jax gpus --sources")
    return "\n".join(out)
