"""Convert DeepSeek checkpoints between FP8 / FP4 (block scales) and BF16.

The layouts read (DeepSeek-V3; V3.1 / V3.2 with power-of-two "ue8m0" scales;
V4 with E8M0 scales and packed FP4 routed experts; V4.1 with 32x32 blocks,
settings under ``text_config`` and Engram tables passed through) are
described, with their sources, in :mod:`fp8jax.toolkit.convert.layouts`; FP4
tensors dequantize the same way as FP8 ones below, their E2M1 values decoded
first.  Every FP8 scale grid must be the one config.json's block gives.

``fp8_to_bf16(src, dst)``: every FP8 tensor ``x`` with its float32
``x_scale_inv`` becomes BF16 ``x * scale_inv`` (``rounding="deepseek"``, the
default: the float32 product rounded to BF16, bit for bit what DeepSeek-V3's
``fp8_cast_bf16.py`` writes; ``"exact"``: the exact product rounded once; see
:mod:`fp8jax.toolkit.convert.blockwise`); the ``_scale_inv`` tensors are
dropped; other tensors are copied unchanged.

``bf16_to_fp8(src, dst)``: every 2-D BF16/F16/F32 tensor whose name ends in
``weight`` becomes FP8 E4M3 plus ``<name>_scale_inv`` (float32, one per
128x128 block) through ``fp8jax.quantize(x, E4M3, "block")``, except the
tensors that stay high precision: embeddings, the output head, norms, the MoE
router (``*.gate.weight``) and whatever the caller's ``keep`` patterns match.

Both work shard by shard (the output keeps the input's shard names), a
stripe of rows at a time (memory is bounded by a few times
``CHUNK_ELEMS`` elements, not by the size of a tensor), with a plain-text
progress bar on stderr.

Safety.  All headers (validated as the reference safetensors library does),
the index, config.json and every scale tensor (shape, finite, > 0) are
checked before anything is written.  Output goes to a hidden directory
``.<dst>.partial-*`` next to ``dst`` (created with the umask's permissions,
marked with the converting process's id); each written shard is re-read and
checked (names, shapes, dtypes, all values finite); config.json and the other
files are carried over; the index is written last; only then is the
directory renamed to ``dst``.  Any failure, Ctrl-C (SIGINT), SIGTERM or
SIGHUP removes the hidden directory, so a failed run leaves no ``dst`` at all;
a partial directory left by a process that no longer exists (kill -9, power
loss) is removed by the next conversion into the same parent directory.
FP8 NaN codes, non-positive scales, an output inside the input and a source with nothing to convert are refused.

What the source may hold.  Shards, the index and config.json must be regular
files (a FIFO would block, a device such as /dev/zero never ends; the JSON
files are read up to ``MAX_JSON_BYTES``); they may be symlinks to files
anywhere (a Hugging Face cache snapshot is links into its blob directory).
The other files are copied into the output as files; a symlink among them
must lead to a regular file, or to a directory inside the source that the
copy does not reach another way: a directory link that leaves the source, a
loop, a dangling link and special files are refused before anything is
written.  Shards are read, not memory-mapped, and each read checks that the
shard has not changed since its header was checked.

A ``.safetensors`` file in a directory with an index that the index does not
list is converted too (with a warning): it appears in the output under the
same name and, as in the input, not in the output index.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import signal
import stat
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import numpy as np

from fp8jax.atomic_output import (
    TerminationSignals,
    make_partial_dir,
    publish,
    remove_stale_partials,
)
from fp8jax.progress import Progress
from fp8jax.scaling import DEEPSEEK_AMAX_FLOOR
from fp8jax.toolkit.convert.blockwise import (
    BLOCK,
    ROUNDINGS,
    SCALE_DTYPES,
    all_finite,
    check_scale,
    dequant_rows,
    describe_nonfinite,
    quant_rows,
    scale_shape,
)
from fp8jax.toolkit.convert.layouts import (
    LAYOUT_NAMES,
    QuantConfig,
    check_scale_values,
    decode_e2m1,
    grid_shape,
    infer_block,
    is_engram,
    read_quant_config,
)
from fp8jax.toolkit.convert.safetensors_io import (
    DTYPES,
    FLOAT_DTYPES,
    FP8_DTYPES,
    MAX_HEADER_BYTES,
    SafetensorsError,
    SafetensorsFile,
    SafetensorsWriter,
    array_can_hold,
    file_kind,
    iter_row_chunks,
    loads_json,
    read_regular,
    save_file,
)

INDEX_NAME = "model.safetensors.index.json"
SCALE_SUFFIX = "_scale_inv"
# DeepSeek-V4 names the scale of ``P.weight`` ``P.scale``.
V4_SCALE_SUFFIX = ".scale"
WEIGHT_SUFFIX = ".weight"
# One-byte storage of packed FP4 (two E2M1 values per byte): DeepSeek-V4 writes I8.
PACKED_FP4_DTYPES = ("I8", "U8")
# A routed expert's weight in DeepSeek-V4's naming (config expert_dtype "fp4").
_ROUTED_EXPERT = re.compile(r"(^|\.)experts\.\d+\.")
SCALE_FMT_CHOICES = ("auto", "float32", "ue8m0")
CHUNK_ELEMS = 1 << 22
# Written into the hidden output directory while a conversion runs (and removed
# before the rename): which process owns it, so a later run can tell a stale one.
PARTIAL_MARKER = ".fp8jax-convert.json"
# The index and config.json are read whole: DeepSeek-V3's index is about 9 MB.
MAX_JSON_BYTES = MAX_HEADER_BYTES

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


class ConversionTerminated(BaseException):
    """SIGTERM or SIGHUP arrived during a conversion (its partial output is removed)."""

    def __init__(self, signum: int):
        super().__init__(f"terminated by signal {signal.Signals(signum).name}")
        self.signum = signum


def _stderr_warn(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr)


# -- reading the source ---------------------------------------------------------


@dataclass
class Source:
    """A checkpoint directory: its shards, weight map and index metadata.

    ``shards`` are the files the index lists (all ``*.safetensors`` files when
    there is no index); ``unlisted`` the ``*.safetensors`` files an index
    leaves out.
    """

    root: Path
    shards: list[str]
    weight_map: dict[str, str]
    index_meta: dict
    has_index: bool
    unlisted: list[str] = field(default_factory=list)
    _open: dict[str, SafetensorsFile] = field(default_factory=dict)

    @property
    def all_shards(self) -> list[str]:
        return self.shards + self.unlisted

    def file(self, shard: str) -> SafetensorsFile:
        if shard not in self._open:
            try:
                self._open[shard] = SafetensorsFile(self.root / shard)
            except SafetensorsError as e:
                raise ConversionError(str(e)) from None
        return self._open[shard]

    def locate(self, name: str, shard: str | None = None) -> SafetensorsFile | None:
        """The file holding ``name``: ``shard`` itself if it has it, else the index's choice."""
        if shard is not None and name in self.file(shard):
            return self.file(shard)
        owner = self.weight_map.get(name)
        return None if owner is None else self.file(owner)

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()


def _read_json(path: Path, what: str, strict: bool = True):
    try:
        text = read_regular(path, what, MAX_JSON_BYTES).decode("utf-8")
    except UnicodeDecodeError:
        raise ConversionError(f"unreadable {what} {path}: not UTF-8 text") from None
    except SafetensorsError as e:
        raise ConversionError(str(e)) from None
    except OSError as e:
        raise ConversionError(f"cannot read {what} {path}: {e.strerror or e}") from None
    try:
        return loads_json(text, strict=strict)
    except ValueError as e:
        raise ConversionError(f"unreadable {what} {path}: {e}") from None


def open_source(src: str | os.PathLike, warn: Callable[[str], None] | None = None) -> Source:
    """Read the index (or list the shards) of ``src`` and check that they agree.

    ``warn`` receives one line per ``.safetensors`` file the index does not list.
    """
    warn = warn or _stderr_warn
    root = Path(src)
    if not root.is_dir():
        raise ConversionError(f"source {root} is not a directory")
    idx_path = root / INDEX_NAME
    if idx_path.exists() or idx_path.is_symlink():
        idx = _read_json(idx_path, "index")
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
            if not (root / s).exists() and not (root / s).is_symlink():
                raise ConversionError(f"index {idx_path} names a missing file: {s}")
            _require_regular(root / s, f"file {s} named by index {idx_path}")
        unlisted = sorted(p.name for p in root.glob("*.safetensors") if p.name not in set(shards))
        for u in unlisted:
            warn(
                f"{u} is not listed in {INDEX_NAME}: converting it too; it stays out of "
                "the output index, as in the input"
            )
        source = Source(
            root, shards, dict(wm), dict(meta) if isinstance(meta, dict) else {}, True, unlisted
        )
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
    # listed shard must be indexed to that shard.
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
    for s in source.unlisted:
        source.file(s)  # its header is checked now, before anything is written
    return source


def _require_regular(path: Path, what: str) -> None:
    """Refuse (ConversionError) a path that is not, or does not lead to, a regular file."""
    try:
        mode = path.stat().st_mode
    except RuntimeError:  # Python < 3.13 reports a symlink loop so
        raise ConversionError(f"{what} is a symlink loop") from None
    except OSError as e:
        raise ConversionError(f"cannot read {what}: {e.strerror or e}") from None
    if not stat.S_ISREG(mode):
        raise ConversionError(f"{what} is {file_kind(mode)}, not a regular file")


def carried_files(src: Path, skip: set[str]) -> list[tuple[Path, Path | None]]:
    """The files besides shards and index that go into the output, checked before writing.

    Returns (path relative to ``src``, the file to copy; None for a
    directory to create), parents before children.  ``skip`` names
    top-level entries left out (shards; ``*.safetensors`` and the index are
    always left out).  A symlink is followed when it leads to a regular file
    (anywhere) or to a directory inside ``src`` that the walk has not
    reached yet; a directory link that leaves ``src``, reaches a directory a
    second time (a loop, or two paths to the same data), dangles or loops on
    itself, and any FIFO, socket or device, raise ConversionError: one line
    naming the entry.
    """
    root = src.resolve()
    out: list[tuple[Path, Path | None]] = []
    seen = {root}
    stack: list[tuple[Path, Path]] = [(Path(), root)]
    while stack:
        rel_dir, real_dir = stack.pop()
        for entry in sorted(real_dir.iterdir(), key=lambda p: p.name, reverse=True):
            rel = rel_dir / entry.name
            if rel_dir == Path() and (
                entry.name in skip
                or entry.name == INDEX_NAME
                or entry.name.endswith(".safetensors")
            ):
                continue
            shown = src / rel
            try:
                target = entry.resolve(strict=True) if entry.is_symlink() else entry
                mode = target.stat().st_mode
            except (OSError, RuntimeError):
                raise ConversionError(
                    f"{shown} is a symlink that loops or leads nowhere; remove it or the link"
                ) from None
            if stat.S_ISDIR(mode):
                if not target.is_relative_to(root):
                    raise ConversionError(
                        f"{shown} is a symlink to the directory {target}, outside the source "
                        f"{root}; copy what it holds into the source or remove the link"
                    )
                if target in seen:
                    raise ConversionError(
                        f"{shown} is a symlink to {target}, which the copy reaches another way "
                        "(a symlink loop or a second path to the same directory); remove the link"
                    )
                seen.add(target)
                out.append((rel, None))
                stack.append((rel, target))
            elif stat.S_ISREG(mode):
                out.append((rel, target))
            else:
                raise ConversionError(
                    f"{shown} is {file_kind(mode)}, not a regular file; only files are converted "
                    "or copied"
                )
    return sorted(out, key=lambda e: e[0].parts)


# -- planning -------------------------------------------------------------------


@dataclass(frozen=True)
class Action:
    """What to do with one input tensor: copy, dequantize or quantize."""

    op: str  # "copy" | "dequant" | "quant"
    name: str
    out: tuple[tuple[str, str, tuple[int, ...]], ...]  # (name, dtype, shape) written
    scale: str | None = None  # dequant: name of the scale tensor
    fmt: str = "fp8"  # dequant: "fp8" (E4M3/E5M2 codes) or "fp4" (packed E2M1)
    block: tuple[int, int] = (BLOCK, BLOCK)  # dequant: rows x cols per scale
    scale_dtype: str = "F32"  # dequant: the scale tensor's dtype


def compile_keep(patterns: Sequence[str]) -> list[re.Pattern]:
    """The keep patterns (DEFAULT_KEEP and the caller's) compiled; ValueError names a bad one."""
    out = []
    for p in (*DEFAULT_KEEP, *patterns):
        try:
            out.append(re.compile(p))
        except re.error as e:
            raise ValueError(f"keep pattern {p!r} is not a regular expression: {e}") from None
    return out


def _dtype_summary(source: Source) -> str:
    n = Counter(
        source.file(s).info(name).dtype
        for s in source.all_shards
        for name in source.file(s).names()
    )
    return ", ".join(f"{k} x {v}" for k, v in sorted(n.items()))


def _require_holdable(name: str, shard: str, dtype: str, shape: tuple[int, ...]) -> None:
    """Refuse an output tensor numpy cannot make (an absurd shape such as [2^62, 0] in BF16)."""
    if not array_can_hold(shape, DTYPES[dtype].itemsize):
        raise ConversionError(
            f"tensor {name!r} ({shard}) has shape {list(shape)}: as {dtype} it is beyond what an "
            "array can hold; the header is not a real checkpoint's"
        )


def _scale_names(name: str) -> list[str]:
    """Where the scale of quantized tensor ``name`` may be: V3's ``_scale_inv``, V4's ``.scale``."""
    out = [name + SCALE_SUFFIX]
    if name.endswith(WEIGHT_SUFFIX):
        out.append(name[: -len(WEIGHT_SUFFIX)] + V4_SCALE_SUFFIX)
    return out


def _weight_of_scale(name: str) -> str | None:
    """The weight a scale-like name belongs to (None: not a scale name)."""
    if name.endswith(SCALE_SUFFIX):
        return name[: -len(SCALE_SUFFIX)]
    if name.endswith(V4_SCALE_SUFFIX):
        return name[: -len(V4_SCALE_SUFFIX)] + WEIGHT_SUFFIX
    return None


def _find_scale(source: Source, name: str, shard: str) -> tuple[str, SafetensorsFile] | None:
    """(scale name, its file) for ``name``; refuses a weight with both namings."""
    found = [(n, f) for n in _scale_names(name) if (f := source.locate(n, shard)) is not None]
    if len(found) > 1:
        raise ConversionError(
            f"{name!r} ({shard}) has two scale tensors, {found[0][0]!r} and {found[1][0]!r}; "
            "which one applies is ambiguous"
        )
    return found[0] if found else None


def _is_quantized(source: Source, name: str, shard: str, dtype: str) -> bool:
    """FP8 codes, or one-byte storage with a scale (packed FP4)."""
    if dtype in FP8_DTYPES:
        return True
    return dtype in PACKED_FP4_DTYPES and _find_scale(source, name, shard) is not None


def _plan_fp8_to_bf16(source: Source, qc: QuantConfig) -> dict[str, list[Action]]:
    """The dequantization of every FP8 / packed FP4 tensor, with all scales checked.

    ``qc`` is config.json's quantization (the FP8 block and the scale format,
    ``"ue8m0"`` requiring power-of-two float scales); see
    :mod:`fp8jax.toolkit.convert.layouts` for the layouts recognised.
    """
    plan: dict[str, list[Action]] = {}
    for s in source.all_shards:
        f = source.file(s)
        acts = []
        for name in f.names():
            t = f.info(name)
            if is_engram(name):
                # DeepSeek-V4.1's Engram lookup tables (and their scales) stay as they are.
                acts.append(Action("copy", name, ((name, t.dtype, t.shape),)))
                continue
            base = _weight_of_scale(name)
            if base is not None:
                bf = source.locate(base, s)
                if bf is not None and _is_quantized(source, base, s, bf.info(base).dtype):
                    continue  # consumed by its weight
                if name.endswith(SCALE_SUFFIX) or bf is not None:
                    raise ConversionError(
                        f"scale tensor {name!r} ({s}) has no FP8 weight {base!r} to go with it"
                    )
                # A ".scale" with no "<P>.weight" beside it is an ordinary tensor.
            found = None
            if t.dtype in FP8_DTYPES or t.dtype in PACKED_FP4_DTYPES:
                found = _find_scale(source, name, s)
            if t.dtype in FP8_DTYPES:
                if found is None:
                    raise ConversionError(
                        f"missing scale tensor {_scale_names(name)[0]!r} for FP8 tensor "
                        f"{name!r} ({s})"
                        + (
                            f" (nor {_scale_names(name)[1]!r})"
                            if name.endswith(WEIGHT_SUFFIX)
                            else ""
                        )
                    )
                sname, sf = found
                scale = sf.get(sname)
                block = _fp8_block(name, s, t.shape, sname, tuple(scale.shape), qc)
                try:
                    check_scale(name, t.shape, sname, scale, block, qc.scale_fmt)
                except ValueError as e:
                    raise ConversionError(str(e)) from None
                _require_holdable(name, s, "BF16", t.shape)
                acts.append(
                    Action(
                        "dequant",
                        name,
                        ((name, "BF16", t.shape),),
                        sname,
                        "fp8",
                        block,
                        sf.info(sname).dtype,
                    )
                )
            elif found is not None:
                acts.append(_plan_fp4(name, s, t.shape, *found, qc))
            elif (
                t.dtype in PACKED_FP4_DTYPES
                and qc.expert_dtype == "fp4"
                and _ROUTED_EXPERT.search(name)
                and name.endswith(WEIGHT_SUFFIX)
            ):
                raise ConversionError(
                    f"missing scale tensor {_scale_names(name)[1]!r} for the routed expert weight "
                    f"{name!r} ({s}, {t.dtype}), which config.json (expert_dtype 'fp4') says is "
                    "packed FP4"
                )
            else:
                acts.append(Action("copy", name, ((name, t.dtype, t.shape),)))
        plan[s] = acts
    if not any(a.op == "dequant" for acts in plan.values() for a in acts):
        raise ConversionError(
            f"no FP8 tensor in {source.root} ({_dtype_summary(source)}): it already is a "
            "high-precision checkpoint; nothing to convert"
        )
    return plan


def _fp8_block(
    name: str,
    shard: str,
    shape: tuple[int, ...],
    sname: str,
    grid: tuple[int, ...],
    qc: QuantConfig,
) -> tuple[int, int]:
    """The block of an FP8 tensor: config.json's, once its scale grid agrees.

    The grid a power-of-two block would give (:func:`infer_block`) must be the
    one config.json's ``weight_block_size`` gives (DeepSeek's 128x128 when it
    has none); otherwise the tensor is refused in one line naming it, the
    block its grid implies and the config's.
    """
    if len(shape) != 2 or grid_shape(tuple(shape), qc.block) == grid:
        return qc.block  # (check_scale refuses a tensor that is not 2-D)
    inferred = infer_block(tuple(shape), grid)
    seen = f"blocks of {inferred[0]}x{inferred[1]}" if inferred else "no power-of-two block"
    said = (
        f"config.json's weight_block_size is {list(qc.block)}"
        if qc.block_from_config
        else f"config.json gives no weight_block_size (DeepSeek's default {list(qc.block)})"
    )
    raise ConversionError(
        f"{name!r} ({shard}): its scale {sname!r} is a {list(grid)} grid over {list(shape)} "
        f"({seen}), but {said}: the checkpoint contradicts its config; refusing rather than "
        "rescaling the weight by the wrong blocks"
    )


def _plan_fp4(
    name: str,
    shard: str,
    shape: tuple[int, ...],
    sname: str,
    sf: SafetensorsFile,
    qc: QuantConfig,
) -> Action:
    """A packed FP4 tensor (two E2M1 values per byte, low nibble first) and its scale grid."""
    if len(shape) != 2:
        raise ConversionError(
            f"packed FP4 tensor {name!r} ({shard}) has shape {list(shape)}; expected 2-D"
        )
    logical = (shape[0], 2 * shape[1])
    scale = sf.get(sname)
    block = infer_block(logical, tuple(scale.shape))
    if block is None:
        raise ConversionError(
            f"packed FP4 tensor {name!r} ({shard}) stores {list(shape)} bytes = {list(logical)} "
            f"values, but its scale {sname!r} is {list(scale.shape)}: no power-of-two block "
            "gives that grid (DeepSeek-V4: one scale per 1x32 values); the shapes disagree"
        )
    try:
        check_scale_values(sname, scale, qc.scale_fmt, SCALE_DTYPES)
    except ValueError as e:
        raise ConversionError(str(e)) from None
    _require_holdable(name, shard, "BF16", logical)
    return Action(
        "dequant", name, ((name, "BF16", logical),), sname, "fp4", block, sf.info(sname).dtype
    )


def layout_of(plan: dict[str, list[Action]], qc: QuantConfig) -> str:
    """The layout a dequantization plan read (a key of layouts.LAYOUT_NAMES).

    ``qc`` is what config.json says, not what the caller asked the scales to
    be read as: the name follows the files.
    """
    deq = [a for acts in plan.values() for a in acts if a.op == "dequant"]
    if any(a.fmt == "fp4" or a.scale_dtype == "F8_E8M0" for a in deq):
        small = any(a.fmt == "fp8" and max(a.block) < BLOCK for a in deq)
        return "deepseek-v4.1" if small or max(qc.block) < BLOCK else "deepseek-v4"
    return "deepseek-v3.1" if qc.scale_fmt == "ue8m0" else "deepseek-v3"


def engram_note(plan: dict[str, list[Action]], source: Source) -> str | None:
    """The line saying which Engram tables fp8-to-bf16 passed through (None: none)."""
    names = [(s, a.name) for s, acts in plan.items() for a in acts if is_engram(a.name)]
    if not names:
        return None
    nbytes = sum(source.file(s).info(n).nbytes for s, n in names)
    return (
        f"{len(names)} Engram lookup tensor(s), {nbytes / 1e9:.3g} GB, passed through as they "
        "are (FP8 rows fetched by an n-gram hash, not GEMM weights; see docs/toolkit.md)"
    )


def _plan_bf16_to_fp8(source: Source, keep: Sequence[str]) -> dict[str, list[Action]]:
    try:
        pats = compile_keep(keep)
    except ValueError as e:
        raise ConversionError(str(e)) from None
    plan: dict[str, list[Action]] = {}
    for s in source.all_shards:
        f = source.file(s)
        acts = []
        for name in f.names():
            t = f.info(name)
            if (
                t.dtype in FP8_DTYPES
                or t.dtype == "F8_E8M0"
                or name.endswith(SCALE_SUFFIX)
                or _is_quantized(source, name, s, t.dtype)
            ):
                raise ConversionError(
                    f"{name!r} ({s}) is already FP8 / a scale: use fp8-to-bf16 first"
                )
            quantize = (
                len(t.shape) == 2
                and t.numel > 0
                and t.dtype in ("BF16", "F16", "F32")
                and name.endswith("weight")
                and not any(p.search(name) for p in pats)
            )
            if quantize:
                sname = name + SCALE_SUFFIX
                if source.locate(sname, s) is not None:
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
    if not any(a.op == "quant" for acts in plan.values() for a in acts):
        raise ConversionError(
            f"no tensor of {source.root} ({_dtype_summary(source)}) is a 2-D BF16/F16/F32 "
            "'*weight' outside the keep patterns; nothing to convert"
        )
    return plan


def _read_config(src: Path) -> dict | None:
    """config.json as a dict (None: the source has none)."""
    p = src / "config.json"
    if not p.exists() and not p.is_symlink():
        return None
    cfg = _read_json(p, "config", strict=False)
    if not isinstance(cfg, dict):
        raise ConversionError(f"unreadable config {p}: not a JSON object")
    return cfg


def _converted_config(cfg: dict | None, direction: str, scale_fmt: str) -> dict | None:
    """config.json as it will be written (None: the source has none).

    fp8-to-bf16 drops ``quantization_config`` and DeepSeek-V4's
    ``expert_dtype`` (nothing is quantized any more); bf16-to-fp8 writes
    DeepSeek-V3's ``quantization_config``, with ``scale_fmt: "ue8m0"`` for
    power-of-two scales (DeepSeek-V3.1's).
    """
    if cfg is None:
        return None
    cfg = dict(cfg)
    if direction == "fp8-to-bf16":
        cfg.pop("quantization_config", None)
        cfg.pop("expert_dtype", None)
        if isinstance(cfg.get("text_config"), dict):  # DeepSeek-V4.1's nested settings
            cfg["text_config"] = {
                k: v
                for k, v in cfg["text_config"].items()
                if k not in ("quantization_config", "expert_dtype")
            }
        cfg["torch_dtype"] = "bfloat16"
    else:
        cfg["quantization_config"] = dict(FP8_QUANT_CONFIG)
        if scale_fmt == "ue8m0":
            cfg["quantization_config"]["scale_fmt"] = "ue8m0"
    return cfg


# -- writing --------------------------------------------------------------------


def _write_shard(
    source: Source,
    shard: str,
    acts: list[Action],
    out_path: Path,
    progress: Progress,
    rounding: str,
    pow2: bool = False,
    amax_floor: float = 0.0,
) -> None:
    f = source.file(shard)
    specs = [o for a in acts for o in a.out]
    meta = dict(f.metadata) or {"format": "pt"}
    w = SafetensorsWriter(out_path, specs, meta)
    try:
        for a in acts:
            t = f.info(a.name)
            if a.op == "copy":
                if len(t.shape) == 0 or t.numel == 0:
                    w.write(a.name, f.get(a.name))
                    progress.update(t.nbytes)
                    continue
                row = t.numel // t.shape[0]
                for r0, r1 in iter_row_chunks(t.shape[0], row, 1, CHUNK_ELEMS):
                    w.write(a.name, f.rows(a.name, r0, r1))
                    progress.update((r1 - r0) * row * t.np_dtype.itemsize, a.name)
            elif a.op == "dequant":
                scale = source.locate(a.scale, shard).get(a.scale)
                out_shape = a.out[0][2]
                if t.numel == 0:
                    # Written whole: the row count of an empty tensor must not
                    # drive the chunk loop.
                    w.write(a.name, np.zeros(out_shape, DTYPES["BF16"]))
                    continue
                br = a.block[0]
                # Stripes start at a block edge of the scale grid (blocks are powers of two).
                align = max(br, BLOCK)
                for r0, r1 in iter_row_chunks(t.shape[0], out_shape[1], align, CHUNK_ELEMS):
                    x = f.rows(a.name, r0, r1)
                    if a.fmt == "fp4":
                        # Every E2M1 code is a finite value, exact in float32.
                        x = decode_e2m1(x)
                    elif not all_finite(x):
                        raise ConversionError(
                            f"FP8 tensor {a.name!r} ({shard}, rows {r0}..{r1}) holds "
                            f"{describe_nonfinite(x)}: NaN/Inf codes are not weights"
                        )
                    out = dequant_rows(
                        x, scale[r0 // br : -(-r1 // br)], rounding=rounding, block=a.block
                    )
                    if not all_finite(out):
                        raise ConversionError(
                            f"dequantized {a.name!r} overflows BF16 (rows {r0}..{r1}): scale too large"
                        )
                    w.write(a.name, out)
                    progress.update((r1 - r0) * t.shape[1] * t.np_dtype.itemsize, a.name)
            elif a.op == "quant":
                # The scale tensor follows the data in the file: collect the scales
                # (one float32 per block) while the data stream out.
                scales = []
                chunks = list(iter_row_chunks(t.shape[0], t.shape[1], BLOCK, CHUNK_ELEMS))
                for r0, r1 in chunks:
                    x = f.rows(a.name, r0, r1)
                    if not all_finite(x):
                        raise ConversionError(
                            f"non-finite values in {a.name!r} (rows {r0}..{r1}) of {shard}: "
                            f"{describe_nonfinite(x)}"
                        )
                    data, sc = quant_rows(x, pow2=pow2, amax_floor=amax_floor)
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


def _carry_other_files(
    tmp: Path, config: dict | None, files: list[tuple[Path, Path | None]]
) -> None:
    """Write the converted config.json and copy ``files`` (from :func:`carried_files`)."""
    for rel, real in files:
        if rel == Path("config.json") and config is not None:
            (tmp / rel).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        elif real is None:
            (tmp / rel).mkdir()
        else:
            shutil.copy2(real, tmp / rel)


# -- the hidden output directory -------------------------------------------------


def _remove_stale_partials(parent: Path, warn: Callable[[str], None]) -> None:
    remove_stale_partials(parent, PARTIAL_MARKER, "conversion", warn)


def _make_partial_dir(dst: Path, src: Path) -> Path:
    try:
        return make_partial_dir(dst, PARTIAL_MARKER, {"src": str(src), "dst": str(dst)})
    except FileExistsError as e:
        raise ConversionError(str(e)) from None


# -- the conversion ---------------------------------------------------------------


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
    rounding: str | None = None
    warnings: tuple[str, ...] = ()
    layout: str | None = None  # fp8-to-bf16: the layout read (layouts.LAYOUT_NAMES)
    scale_fmt: str | None = None  # the scale format read or written: "float32" / "ue8m0"
    amax_floor: float = 0.0  # bf16-to-fp8: the floor each block's amax was clamped to

    @property
    def layout_name(self) -> str | None:
        return None if self.layout is None else LAYOUT_NAMES[self.layout]


def _resolve(path: str | os.PathLike, what: str) -> Path:
    """``path`` with its symlinks resolved; a loop of links is refused in one line."""
    try:
        return Path(path).resolve()
    except RuntimeError:  # Python < 3.13: "Symlink loop from ..."
        raise ConversionError(f"{what} {path} is a loop of symbolic links") from None
    except OSError as e:  # Python >= 3.13 reports the loop as ELOOP
        raise ConversionError(f"{what} {path} cannot be resolved: {e.strerror}") from None


def _check_paths(src_p: Path, dst_p: Path) -> None:
    if not src_p.is_dir():
        raise ConversionError(f"source {src_p} is not a directory")
    if dst_p == src_p or dst_p.is_relative_to(src_p):
        raise ConversionError(
            f"destination {dst_p} is inside the source {src_p}; choose a directory outside it"
        )
    if dst_p.exists() and (not dst_p.is_dir() or any(dst_p.iterdir())):
        raise ConversionError(f"destination {dst_p} exists and is not an empty directory")
    if not dst_p.parent.is_dir():
        raise ConversionError(f"parent of the destination, {dst_p.parent}, does not exist")


def convert_checkpoint(
    direction: str,
    src: str | os.PathLike,
    dst: str | os.PathLike,
    keep: Sequence[str] = (),
    progress_stream: TextIO | None = None,
    quiet: bool = False,
    rounding: str = "deepseek",
    warn: Callable[[str], None] | None = None,
    scale_fmt: str = "auto",
    amax_floor: float | None = None,
) -> Report:
    """Convert ``src`` into a new directory ``dst`` ("fp8-to-bf16" or "bf16-to-fp8").

    ``rounding`` ("deepseek" or "exact") chooses fp8-to-bf16's arithmetic.
    ``scale_fmt``: fp8-to-bf16 reads float scales as config.json's
    ``quantization_config.scale_fmt`` says ("auto": ``"ue8m0"`` requires
    powers of two, absent means any positive float32), or as told
    ("float32" / "ue8m0"); bf16-to-fp8 writes float32 amax / 448 scales
    ("auto" / "float32") or DeepSeek-V3.1's power-of-two ones ("ue8m0"), in
    float32 ``_scale_inv`` tensors either way.
    ``amax_floor`` (bf16-to-fp8): each block's amax is floored at it before
    the scale is taken; None (default): DeepSeek's inference floor
    ``fp8jax.scaling.DEEPSEEK_AMAX_FLOOR`` (1e-4) with ue8m0 scales, as
    DeepGEMM's ``per_block_cast_to_fp8``, and none (0) with float32 scales, as
    the training quantizer and DeepSeek-V3's 2024 code.
    ``warn`` receives one-line warnings (default: printed to stderr); they are
    also returned in the report.  Raises ConversionError (and leaves no
    ``dst``) on any problem, ConversionTerminated on SIGTERM / SIGHUP: while
    it runs in the main thread those two signals raise it (so that the
    partial output is removed), and the previous handlers are restored after.
    """
    if direction not in ("fp8-to-bf16", "bf16-to-fp8"):
        raise ValueError(f"direction must be fp8-to-bf16 or bf16-to-fp8, got {direction!r}")
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    if scale_fmt not in SCALE_FMT_CHOICES:
        raise ValueError(f"scale_fmt must be one of {SCALE_FMT_CHOICES}, got {scale_fmt!r}")
    if amax_floor is not None and not (math.isfinite(amax_floor) and amax_floor >= 0):
        raise ValueError(f"amax_floor must be a finite number >= 0, got {amax_floor!r}")
    if direction == "fp8-to-bf16" and amax_floor:
        raise ValueError("amax_floor applies to bf16-to-fp8 (fp8-to-bf16 quantizes nothing)")
    floor_used = 0.0
    if direction == "bf16-to-fp8":
        default = DEEPSEEK_AMAX_FLOOR if scale_fmt == "ue8m0" else 0.0
        floor_used = default if amax_floor is None else float(amax_floor)
    t0 = time.monotonic()
    warnings: list[str] = []
    sink = warn or _stderr_warn

    def note(msg: str) -> None:
        warnings.append(msg)
        sink(msg)

    src_p, dst_p = _resolve(src, "source"), _resolve(dst, "destination")
    _check_paths(src_p, dst_p)
    source = open_source(src_p, warn=note)
    tmp: Path | None = None
    try:
        with TerminationSignals(ConversionTerminated):
            src_config = _read_config(src_p)
            layout = None
            if direction == "fp8-to-bf16":
                try:
                    qc = read_quant_config(src_config, f"config {src_p / 'config.json'}")
                except ValueError as e:
                    raise ConversionError(str(e)) from None
                file_qc = qc
                if scale_fmt != "auto":
                    qc = dataclasses.replace(qc, scale_fmt=scale_fmt)
                plan = _plan_fp8_to_bf16(source, qc)
                layout, fmt_used = layout_of(plan, file_qc), qc.scale_fmt
                engram = engram_note(plan, source)
                if engram:
                    note(engram)
            else:
                plan = _plan_bf16_to_fp8(source, keep)
                fmt_used = "ue8m0" if scale_fmt == "ue8m0" else "float32"
            config = _converted_config(src_config, direction, fmt_used)
            shards = source.all_shards
            others = carried_files(src_p, set(shards))
            n_in = sum(len(source.file(s).names()) for s in shards)
            bytes_in = sum(
                source.file(s).info(n).nbytes for s in shards for n in source.file(s).names()
            )
            converted = sum(a.op != "copy" for acts in plan.values() for a in acts)

            _remove_stale_partials(dst_p.parent, note)
            tmp = _make_partial_dir(dst_p, src_p)
            progress = Progress(
                sum(source.file(s).info(a.name).nbytes for s in shards for a in plan[s]),
                direction,
                progress_stream,
                quiet=quiet,
            )
            weight_map: dict[str, str] = {}
            bytes_out = 0
            n_out = 0
            for s in shards:
                _write_shard(
                    source,
                    s,
                    plan[s],
                    tmp / s,
                    progress,
                    rounding,
                    pow2=fmt_used == "ue8m0",
                    amax_floor=floor_used,
                )
                nbytes = _verify_shard(tmp / s, plan[s])
                n_out += sum(len(a.out) for a in plan[s])
                if s in source.unlisted:
                    continue  # converted, and left out of the index as in the input
                bytes_out += nbytes
                for a in plan[s]:
                    for name, _, _ in a.out:
                        weight_map[name] = s
            _carry_other_files(tmp, config, others)
            if source.has_index or len(source.shards) > 1:
                meta = dict(source.index_meta)
                meta["total_size"] = bytes_out
                index = {"metadata": meta, "weight_map": dict(sorted(weight_map.items()))}
                (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
            source.close()
            publish(tmp, dst_p, PARTIAL_MARKER)  # dst_p is absent or empty, checked above
            tmp = None
        return Report(
            dst=dst_p,
            shards=len(shards),
            tensors_in=n_in,
            tensors_out=n_out,
            converted=converted,
            bytes_in=bytes_in,
            bytes_out=bytes_out,
            seconds=time.monotonic() - t0,
            rounding=rounding if direction == "fp8-to-bf16" else None,
            warnings=tuple(warnings),
            layout=layout,
            scale_fmt=fmt_used,
            amax_floor=floor_used,
        )
    except SafetensorsError as e:
        raise ConversionError(str(e)) from None
    except OSError as e:
        raise ConversionError(f"I/O error: {e}") from None
    finally:
        source.close()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def fp8_to_bf16(src, dst, rounding: str = "deepseek", **kw) -> Report:
    """Dequantize an FP8 / FP4 checkpoint (DeepSeek-V3, V3.1 / V3.2 or V4 layout) into BF16."""
    return convert_checkpoint("fp8-to-bf16", src, dst, rounding=rounding, **kw)


def bf16_to_fp8(src, dst, keep: Sequence[str] = (), **kw) -> Report:
    """Quantize a BF16 checkpoint's 2-D weights into FP8 E4M3 with 128x128 block scales.

    ``scale_fmt="ue8m0"`` writes DeepSeek-V3.1's power-of-two scales (as
    float32) and says so in config.json.  FP4 (DeepSeek-V4's routed experts)
    is not written: this direction produces the V3 / V3.1 layout only.
    """
    return convert_checkpoint("bf16-to-fp8", src, dst, keep=keep, **kw)


# -- a small example checkpoint ----------------------------------------------------

# (name, shape, stored as): a two-layer DeepSeek-V3-shaped model at toy size,
# no dimension a multiple of 128.  Layer 0 is dense, layer 1 a MoE layer with a
# BF16 router, a float32 router bias, two routed experts and a shared expert.
_EXAMPLE_HIDDEN, _EXAMPLE_FF, _EXAMPLE_VOCAB = 200, 264, 300
_EXAMPLE_TENSORS: tuple[tuple[str, tuple[int, ...], str], ...] = (
    ("model.embed_tokens.weight", (_EXAMPLE_VOCAB, _EXAMPLE_HIDDEN), "BF16"),
    *(
        t
        for layer in (0, 1)
        for t in (
            (f"model.layers.{layer}.input_layernorm.weight", (_EXAMPLE_HIDDEN,), "BF16"),
            (f"model.layers.{layer}.self_attn.q_proj.weight", (192, _EXAMPLE_HIDDEN), "FP8"),
            (f"model.layers.{layer}.self_attn.kv_proj.weight", (136, _EXAMPLE_HIDDEN), "FP8"),
            (f"model.layers.{layer}.self_attn.o_proj.weight", (_EXAMPLE_HIDDEN, 192), "FP8"),
            (f"model.layers.{layer}.post_attention_layernorm.weight", (_EXAMPLE_HIDDEN,), "BF16"),
        )
    ),
    ("model.layers.0.mlp.gate_proj.weight", (_EXAMPLE_FF, _EXAMPLE_HIDDEN), "FP8"),
    ("model.layers.0.mlp.up_proj.weight", (_EXAMPLE_FF, _EXAMPLE_HIDDEN), "FP8"),
    ("model.layers.0.mlp.down_proj.weight", (_EXAMPLE_HIDDEN, _EXAMPLE_FF), "FP8"),
    ("model.layers.1.mlp.gate.weight", (2, _EXAMPLE_HIDDEN), "BF16"),
    ("model.layers.1.mlp.gate.e_score_correction_bias", (2,), "F32"),
    *(
        (f"model.layers.1.mlp.{e}.{p}.weight", shape, "FP8")
        for e in ("experts.0", "experts.1", "shared_experts")
        for p, shape in (
            ("gate_proj", (72, _EXAMPLE_HIDDEN)),
            ("up_proj", (72, _EXAMPLE_HIDDEN)),
            ("down_proj", (_EXAMPLE_HIDDEN, 72)),
        )
    ),
    ("model.norm.weight", (_EXAMPLE_HIDDEN,), "BF16"),
    ("lm_head.weight", (_EXAMPLE_VOCAB, _EXAMPLE_HIDDEN), "BF16"),
)


def make_example_checkpoint(dst: str | os.PathLike, seed: int = 0, shards: int = 3) -> Path:
    """Write a small FP8 checkpoint in DeepSeek-V3's layout to the new directory ``dst``.

    Gaussian weights (std 0.02; norms 1) quantized with the converter's own
    bf16-to-fp8 arithmetic (E4M3, 128x128 block scales), spread over
    ``shards`` files with an index and a config.json; about 0.7 MB.  For
    trying ``fp8jax convert`` and ``fp8jax quant-error`` without a download.
    """
    root = Path(dst)
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise ConversionError(f"destination {root} exists and is not an empty directory")
    if shards < 1:
        raise ValueError("shards must be >= 1")
    rng = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray] = {}
    for name, shape, stored in _EXAMPLE_TENSORS:
        if "norm" in name:
            tensors[name] = np.ones(shape, DTYPES["BF16"])
        elif stored == "F32":
            tensors[name] = rng.standard_normal(shape).astype(np.float32)
        else:
            # Draw in float32, store as BF16 (what a trained checkpoint holds).
            w = (0.02 * rng.standard_normal(shape)).astype(np.float32).astype(DTYPES["BF16"])
            if stored == "FP8":
                tensors[name], tensors[name + SCALE_SUFFIX] = quant_rows(w)
            else:
                tensors[name] = w
    root.mkdir(parents=True, exist_ok=True)
    names = list(tensors)
    per = -(-len(names) // shards)
    weight_map: dict[str, str] = {}
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        members = names[i * per : (i + 1) * per]
        save_file(root / fname, {n: tensors[n] for n in members}, {"format": "pt"})
        weight_map.update({n: fname for n in members})
    total = sum(v.nbytes for v in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (root / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": _EXAMPLE_HIDDEN,
        "intermediate_size": _EXAMPLE_FF,
        "moe_intermediate_size": 72,
        "n_routed_experts": 2,
        "n_shared_experts": 1,
        "num_hidden_layers": 2,
        "first_k_dense_replace": 1,
        "vocab_size": _EXAMPLE_VOCAB,
        "torch_dtype": "bfloat16",
        "quantization_config": dict(FP8_QUANT_CONFIG),
    }
    (root / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return root


__all__ = [
    "ConversionError",
    "ConversionTerminated",
    "DEFAULT_KEEP",
    "DTYPES",
    "Progress",
    "Report",
    "bf16_to_fp8",
    "compile_keep",
    "convert_checkpoint",
    "fp8_to_bf16",
    "make_example_checkpoint",
    "open_source",
]
