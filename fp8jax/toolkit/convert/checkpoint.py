"""Convert DeepSeek-V3-layout checkpoints between FP8 (128x128 block scales) and BF16.

``fp8_to_bf16(src, dst)``: every FP8 tensor ``x`` with its float32
``x_scale_inv`` becomes BF16 ``round(x * scale_inv)`` (see
:mod:`fp8jax.toolkit.convert.blockwise`); the ``_scale_inv`` tensors are dropped;
other tensors are copied unchanged.

``bf16_to_fp8(src, dst)``: every 2-D BF16/F16/F32 tensor whose name ends in
``weight`` becomes FP8 E4M3 plus ``<name>_scale_inv`` (float32, one per
128x128 block), except the tensors that stay high precision: embeddings, the
output head, norms, the MoE router (``*.gate.weight``) and whatever the
caller's ``keep`` patterns match.

Both work shard by shard (the output keeps the input's shard names), a
stripe of rows at a time (memory is bounded by a few times
``CHUNK_ELEMS`` elements, not by the size of a tensor), with a plain-text
progress bar on stderr.

Safety.  All headers, the index and every scale tensor are checked before
anything is written.  Output goes to a hidden temporary directory next to
``dst``; each written shard is re-read and checked (names, shapes, dtypes,
all values finite); config.json and the other files are carried over; the
index is written last; only then is the directory renamed to ``dst``.  Any
failure removes the temporary directory, so a failed run leaves no ``dst``
at all, and :class:`ConversionError` says what was wrong.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import numpy as np

from fp8jax.toolkit.convert.blockwise import BLOCK, all_finite, dequant_rows, quant_rows, scale_shape
from fp8jax.toolkit.convert.safetensors_io import (
    DTYPES,
    FLOAT_DTYPES,
    FP8_DTYPES,
    SafetensorsError,
    SafetensorsFile,
    SafetensorsWriter,
    iter_row_chunks,
)

INDEX_NAME = "model.safetensors.index.json"
SCALE_SUFFIX = "_scale_inv"
CHUNK_ELEMS = 1 << 22

# Tensors bf16-to-fp8 leaves in high precision (regular expressions searched in
# the name).  DeepSeek-V3 keeps these in BF16: embeddings, the output head, all
# norms and the MoE router ("mlp.gate.weight"; "gate_proj" is quantized).
DEFAULT_KEEP = (r"embed", r"lm_head", r"norm", r"(^|\.)gate\.weight$", r"e_score_correction")

# DeepSeek-V3's config.json entry for its FP8 weights.
FP8_QUANT_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [BLOCK, BLOCK],
}


class ConversionError(RuntimeError):
    """The input checkpoint is corrupt or inconsistent, or the output could not be made."""


# -- progress -------------------------------------------------------------------


class Progress:
    """Plain-text progress bar on a stream (stderr by default)."""

    def __init__(
        self,
        total: int,
        label: str,
        stream: TextIO | None = None,
        width: int = 30,
        quiet: bool = False,
    ):
        self.quiet = quiet
        self.total = max(int(total), 1)
        self.label = label
        self.stream = sys.stderr if stream is None else stream
        self.width = width
        self.done = 0
        self.t0 = time.monotonic()
        self._last = -1.0
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._last_decile = -1

    def update(self, n: int, what: str = "") -> None:
        self.done += int(n)
        if self.quiet:
            return
        now = time.monotonic()
        frac = min(self.done / self.total, 1.0)
        decile = int(frac * 10)
        # On a terminal redraw at most 5x a second; in a log, one line per 10%.
        if self._tty:
            if now - self._last < 0.2 and frac < 1.0:
                return
        elif decile == self._last_decile and frac < 1.0:
            return
        self._last, self._last_decile = now, decile
        fill = int(frac * self.width)
        rate = self.done / max(now - self.t0, 1e-9) / 1e6
        line = (
            f"{self.label} [{'#' * fill}{'.' * (self.width - fill)}] {frac:6.1%} "
            f"{self.done / 1e6:,.1f}/{self.total / 1e6:,.1f} MB {rate:,.1f} MB/s {what}"
        )
        if self._tty:
            self.stream.write("\r" + line[:160].ljust(160))
            if frac >= 1.0:
                self.stream.write("\n")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


# -- reading the source ---------------------------------------------------------


@dataclass
class Source:
    """A checkpoint directory: its shards, weight map and index metadata."""

    root: Path
    shards: list[str]
    weight_map: dict[str, str]
    index_meta: dict
    has_index: bool
    _open: dict[str, SafetensorsFile] = field(default_factory=dict)

    def file(self, shard: str) -> SafetensorsFile:
        if shard not in self._open:
            try:
                self._open[shard] = SafetensorsFile(self.root / shard)
            except SafetensorsError as e:
                raise ConversionError(str(e)) from None
        return self._open[shard]

    def locate(self, name: str) -> SafetensorsFile | None:
        shard = self.weight_map.get(name)
        return None if shard is None else self.file(shard)

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()


def open_source(src: str | os.PathLike) -> Source:
    """Read the index (or list the shards) of ``src`` and check that they agree."""
    root = Path(src)
    if not root.is_dir():
        raise ConversionError(f"source {root} is not a directory")
    idx_path = root / INDEX_NAME
    if idx_path.exists():
        try:
            idx = json.loads(idx_path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConversionError(f"unreadable index {idx_path}: {e}") from None
        wm = idx.get("weight_map") if isinstance(idx, dict) else None
        if not isinstance(wm, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in wm.items()
        ):
            raise ConversionError(
                f"unreadable index {idx_path}: no weight_map of tensor name -> file"
            )
        meta = idx.get("metadata") or {}
        shards = sorted(set(wm.values()))
        for s in shards:
            if Path(s).name != s:
                raise ConversionError(f"index {idx_path} names a file outside the directory: {s!r}")
            if not (root / s).is_file():
                raise ConversionError(f"index {idx_path} names a missing file: {s}")
        source = Source(root, shards, dict(wm), dict(meta) if isinstance(meta, dict) else {}, True)
    else:
        shards = sorted(p.name for p in root.glob("*.safetensors"))
        if not shards:
            raise ConversionError(f"no {INDEX_NAME} and no .safetensors files in {root}")
        source = Source(root, shards, {}, {}, False)
        for s in shards:
            for name in source.file(s).names():
                if name in source.weight_map:
                    raise ConversionError(
                        f"tensor {name!r} is in both {source.weight_map[name]} and {s}"
                    )
                source.weight_map[name] = s
    # Every tensor the index names must be in its shard, and every tensor of a
    # shard must be indexed to that shard.
    for s in source.shards:
        f = source.file(s)
        for name in f.names():
            if source.weight_map.get(name) != s:
                raise ConversionError(
                    f"shard {s} holds {name!r}, which the index puts in {source.weight_map.get(name)!r}"
                )
    for name, s in source.weight_map.items():
        if name not in source.file(s):
            raise ConversionError(f"index puts {name!r} in {s}, but that shard has no such tensor")
    return source


# -- planning -------------------------------------------------------------------


@dataclass(frozen=True)
class Action:
    """What to do with one input tensor: copy, dequantize or quantize."""

    kind: str  # "copy" | "dequant" | "quant"
    name: str
    out: tuple[tuple[str, str, tuple[int, ...]], ...]  # (name, dtype, shape) written
    scale: str | None = None  # dequant: name of the scale tensor


def _plan_fp8_to_bf16(source: Source) -> dict[str, list[Action]]:
    plan: dict[str, list[Action]] = {}
    for s in source.shards:
        f = source.file(s)
        acts = []
        for name in f.names():
            t = f.info(name)
            if name.endswith(SCALE_SUFFIX):
                base = name[: -len(SCALE_SUFFIX)]
                bf = source.locate(base)
                if bf is None or bf.info(base).dtype not in FP8_DTYPES:
                    raise ConversionError(
                        f"scale tensor {name!r} ({s}) has no FP8 weight {base!r} to go with it"
                    )
                continue  # consumed by its weight
            if t.dtype in FP8_DTYPES:
                sname = name + SCALE_SUFFIX
                sf = source.locate(sname)
                if sf is None:
                    raise ConversionError(
                        f"missing scale tensor {sname!r} for FP8 tensor {name!r} ({s})"
                    )
                if len(t.shape) != 2:
                    raise ConversionError(
                        f"FP8 tensor {name!r} has shape {list(t.shape)}; expected 2-D"
                    )
                st = sf.info(sname)
                want = scale_shape(t.shape)
                if st.shape != want:
                    raise ConversionError(
                        f"wrong scale shape for {name!r}: {sname!r} is {list(st.shape)}, expected "
                        f"{list(want)} (one per {BLOCK}x{BLOCK} block of {list(t.shape)})"
                    )
                if st.dtype not in ("F32", "BF16", "F16", "F64"):
                    raise ConversionError(
                        f"scale tensor {sname!r} has dtype {st.dtype}; expected F32"
                    )
                sv = sf.get(sname).astype(np.float64)
                if not np.isfinite(sv).all():
                    bad = int((~np.isfinite(sv)).sum())
                    raise ConversionError(
                        f"non-finite scale: {sname!r} holds {bad} inf/NaN value(s)"
                    )
                acts.append(Action("dequant", name, ((name, "BF16", t.shape),), sname))
            else:
                acts.append(Action("copy", name, ((name, t.dtype, t.shape),)))
        plan[s] = acts
    return plan


def _plan_bf16_to_fp8(source: Source, keep: Sequence[str]) -> dict[str, list[Action]]:
    pats = [re.compile(p) for p in (*DEFAULT_KEEP, *keep)]
    plan: dict[str, list[Action]] = {}
    for s in source.shards:
        f = source.file(s)
        acts = []
        for name in f.names():
            t = f.info(name)
            if t.dtype in FP8_DTYPES or name.endswith(SCALE_SUFFIX):
                raise ConversionError(
                    f"{name!r} ({s}) is already FP8 / a scale: use fp8-to-bf16 first"
                )
            quantize = (
                len(t.shape) == 2
                and t.dtype in ("BF16", "F16", "F32")
                and name.endswith("weight")
                and not any(p.search(name) for p in pats)
            )
            if quantize:
                sname = name + SCALE_SUFFIX
                if sname in source.weight_map:
                    raise ConversionError(f"{sname!r} already exists in the source")
                acts.append(
                    Action(
                        "quant",
                        name,
                        ((name, "F8_E4M3", t.shape), (sname, "F32", scale_shape(t.shape))),
                    )
                )
            else:
                acts.append(Action("copy", name, ((name, t.dtype, t.shape),)))
        plan[s] = acts
    return plan


# -- writing --------------------------------------------------------------------


def _write_shard(
    source: Source, shard: str, acts: list[Action], out_path: Path, progress: Progress
) -> None:
    f = source.file(shard)
    specs = [o for a in acts for o in a.out]
    meta = dict(f.metadata) or {"format": "pt"}
    w = SafetensorsWriter(out_path, specs, meta)
    try:
        for a in acts:
            t = f.info(a.name)
            if a.kind == "copy":
                if len(t.shape) == 0 or t.numel == 0:
                    w.write(a.name, f.get(a.name))
                    progress.update(t.nbytes)
                    continue
                row = t.numel // t.shape[0]
                for r0, r1 in iter_row_chunks(t.shape[0], row, 1, CHUNK_ELEMS):
                    w.write(a.name, f.rows(a.name, r0, r1))
                    progress.update((r1 - r0) * row * t.np_dtype.itemsize, a.name)
            elif a.kind == "dequant":
                scale = source.locate(a.scale).get(a.scale)
                for r0, r1 in iter_row_chunks(t.shape[0], t.shape[1], BLOCK, CHUNK_ELEMS):
                    out = dequant_rows(f.rows(a.name, r0, r1), scale[r0 // BLOCK : -(-r1 // BLOCK)])
                    if not all_finite(out):
                        raise ConversionError(
                            f"dequantized {a.name!r} overflows BF16 (rows {r0}..{r1}): scale too large"
                        )
                    w.write(a.name, out)
                    progress.update((r1 - r0) * t.shape[1] * t.np_dtype.itemsize, a.name)
            elif a.kind == "quant":
                # The scale tensor follows the data in the file: collect the scales
                # (one float32 per block) while the data stream out.
                scales = []
                chunks = list(iter_row_chunks(t.shape[0], t.shape[1], BLOCK, CHUNK_ELEMS))
                for r0, r1 in chunks:
                    x = f.rows(a.name, r0, r1)
                    if not all_finite(x):
                        raise ConversionError(
                            f"non-finite values in {a.name!r} (rows {r0}..{r1}) of {shard}"
                        )
                    data, sc = quant_rows(x)
                    w.write(a.name, data)
                    scales.append(sc)
                    progress.update((r1 - r0) * t.shape[1] * t.np_dtype.itemsize, a.name)
                w.write(a.name + SCALE_SUFFIX, np.concatenate(scales, axis=0))
        w.close()
    except BaseException:
        w.abort()
        raise


def _verify_shard(path: Path, acts: list[Action]) -> int:
    """Re-read a written shard: same tensors, shapes and dtypes as planned, all finite."""
    want = [o for a in acts for o in a.out]
    try:
        f = SafetensorsFile(path)
    except SafetensorsError as e:
        raise ConversionError(f"verification failed: {e}") from None
    with f:
        got = [(n, f.info(n).dtype, f.info(n).shape) for n in f.names()]
        if got != want:
            raise ConversionError(
                f"verification failed for {path.name}: tensors differ from the plan"
            )
        total = 0
        for n, dt, shape in want:
            total += f.info(n).nbytes
            if dt not in FLOAT_DTYPES or not shape or math.prod(shape) == 0:
                continue
            row = math.prod(shape[1:])
            for r0, r1 in iter_row_chunks(shape[0], row, 1, CHUNK_ELEMS):
                if not all_finite(f.rows(n, r0, r1)):
                    raise ConversionError(
                        f"verification failed: {n!r} in {path.name} has non-finite values"
                    )
        return total


def _carry_other_files(src: Path, tmp: Path, direction: str, shards: set[str]) -> None:
    for p in sorted(src.iterdir()):
        if p.name in shards or p.name == INDEX_NAME or p.name.endswith(".safetensors"):
            continue
        if p.name == "config.json":
            try:
                cfg = json.loads(p.read_text(encoding="utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError):
                print(f"warning: {p} is not valid JSON; copied unchanged", file=sys.stderr)
                shutil.copy2(p, tmp / p.name)
                continue
            if isinstance(cfg, dict):
                if direction == "fp8-to-bf16":
                    cfg.pop("quantization_config", None)
                    cfg["torch_dtype"] = "bfloat16"
                else:
                    cfg["quantization_config"] = dict(FP8_QUANT_CONFIG)
            (tmp / p.name).write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
        elif p.is_dir():
            shutil.copytree(p, tmp / p.name)
        elif p.is_file():
            shutil.copy2(p, tmp / p.name)


@dataclass(frozen=True)
class Report:
    """What a conversion did."""

    dst: Path
    shards: int
    tensors_in: int
    tensors_out: int
    converted: int
    bytes_in: int
    bytes_out: int
    seconds: float


def convert_checkpoint(
    direction: str,
    src: str | os.PathLike,
    dst: str | os.PathLike,
    keep: Sequence[str] = (),
    progress_stream: TextIO | None = None,
    quiet: bool = False,
) -> Report:
    """Convert ``src`` into a new directory ``dst`` ("fp8-to-bf16" or "bf16-to-fp8").

    Raises ConversionError (and leaves no ``dst``) on any problem.
    """
    if direction not in ("fp8-to-bf16", "bf16-to-fp8"):
        raise ValueError(f"direction must be fp8-to-bf16 or bf16-to-fp8, got {direction!r}")
    t0 = time.monotonic()
    src_p, dst_p = Path(src).resolve(), Path(dst).resolve()
    if dst_p == src_p:
        raise ConversionError("destination is the source directory")
    if dst_p.exists() and (not dst_p.is_dir() or any(dst_p.iterdir())):
        raise ConversionError(f"destination {dst_p} exists and is not an empty directory")
    if not dst_p.parent.is_dir():
        raise ConversionError(f"parent of the destination, {dst_p.parent}, does not exist")

    source = open_source(src_p)
    tmp: Path | None = None
    try:
        if direction == "fp8-to-bf16":
            plan = _plan_fp8_to_bf16(source)
        else:
            plan = _plan_bf16_to_fp8(source, keep)
        n_in = sum(len(source.file(s).names()) for s in source.shards)
        bytes_in = sum(
            source.file(s).info(n).nbytes for s in source.shards for n in source.file(s).names()
        )
        converted = sum(a.kind != "copy" for acts in plan.values() for a in acts)

        tmp = Path(tempfile.mkdtemp(prefix=f".{dst_p.name}.partial-", dir=dst_p.parent))
        progress = Progress(
            sum(source.file(s).info(a.name).nbytes for s in source.shards for a in plan[s]),
            direction,
            progress_stream,
            quiet=quiet,
        )
        weight_map: dict[str, str] = {}
        bytes_out = 0
        for s in source.shards:
            _write_shard(source, s, plan[s], tmp / s, progress)
            bytes_out += _verify_shard(tmp / s, plan[s])
            for a in plan[s]:
                for name, _, _ in a.out:
                    weight_map[name] = s
        _carry_other_files(src_p, tmp, direction, set(source.shards))
        if source.has_index or len(source.shards) > 1:
            meta = dict(source.index_meta)
            meta["total_size"] = bytes_out
            index = {"metadata": meta, "weight_map": dict(sorted(weight_map.items()))}
            (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        source.close()
        if dst_p.exists():
            dst_p.rmdir()  # empty, checked above
        os.replace(tmp, dst_p)
        tmp = None
        return Report(
            dst=dst_p,
            shards=len(source.shards),
            tensors_in=n_in,
            tensors_out=len(weight_map),
            converted=converted,
            bytes_in=bytes_in,
            bytes_out=bytes_out,
            seconds=time.monotonic() - t0,
        )
    except SafetensorsError as e:
        raise ConversionError(str(e)) from None
    except OSError as e:
        raise ConversionError(f"I/O error: {e}") from None
    finally:
        source.close()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def fp8_to_bf16(src, dst, **kw) -> Report:
    """Dequantize an FP8 (DeepSeek-V3 layout) checkpoint into BF16."""
    return convert_checkpoint("fp8-to-bf16", src, dst, **kw)


def bf16_to_fp8(src, dst, keep: Sequence[str] = (), **kw) -> Report:
    """Quantize a BF16 checkpoint's 2-D weights into FP8 E4M3 with 128x128 block scales."""
    return convert_checkpoint("bf16-to-fp8", src, dst, keep=keep, **kw)


__all__ = [
    "ConversionError",
    "DEFAULT_KEEP",
    "DTYPES",
    "Progress",
    "Report",
    "bf16_to_fp8",
    "convert_checkpoint",
    "fp8_to_bf16",
    "open_source",
]
