"""A small safetensors reader and writer with float8 support (ml_dtypes).

File layout (https://github.com/huggingface/safetensors, "Format"):

    8 bytes   N, unsigned little-endian: length of the header
    N bytes   JSON: {name: {"dtype": "BF16", "shape": [r, c], "data_offsets": [b, e]},
                     "__metadata__": {str: str}}   (optional)
    rest      raw little-endian tensor bytes; offsets are relative to the start
              of this data block

The ``safetensors`` package's numpy loader has no float8 dtypes, hence this
module.  The reader memory-maps the file and hands out one tensor (or a range
of rows of one) at a time, so converting a shard never holds more than a
chunk of it in memory.  The writer takes the list of tensors up front (the
header comes first), then streams each tensor's bytes in order.

Every structural problem raises :class:`SafetensorsError` with the file name
and what is wrong; a file that ends before its last tensor's bytes is called
*truncated*, one whose header cannot be parsed *unreadable*.
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")
FP8_DTYPES = ("F8_E4M3", "F8_E5M2")

# A header larger than this is not a real checkpoint header (real ones are a
# few hundred KB even for thousands of tensors).
MAX_HEADER_BYTES = 100 * 1024 * 1024

if sys.byteorder != "little":  # pragma: no cover - no big-endian CI
    raise ImportError(
        "fp8jax.toolkit.convert assumes a little-endian host (safetensors data is little-endian)"
    )


class SafetensorsError(ValueError):
    """A safetensors file is unreadable, truncated or inconsistent."""


def dtype_name(dtype) -> str:
    """safetensors dtype string of a numpy/ml_dtypes dtype."""
    dt = np.dtype(dtype)
    for k, v in DTYPES.items():
        if v == dt:
            return k
    raise ValueError(f"no safetensors dtype for {dt}")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def np_dtype(self) -> np.dtype:
        return DTYPES[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class SafetensorsFile:
    """Read-only, memory-mapped safetensors file.  Use as a context manager or call close()."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        p = self.path
        try:
            size = p.stat().st_size
        except OSError as e:
            raise SafetensorsError(f"cannot open shard {p}: {e.strerror}") from None
        if size < 8:
            raise SafetensorsError(
                f"truncated shard {p}: {size} bytes, shorter than the 8-byte header length"
            )
        with open(p, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8 or n > MAX_HEADER_BYTES:
                raise SafetensorsError(
                    f"unreadable shard {p}: header length {n} does not fit the file ({size} bytes); "
                    "not a safetensors file, or truncated"
                )
            raw = f.read(n)
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SafetensorsError(
                f"unreadable shard {p}: header is not valid JSON ({e})"
            ) from None
        if not isinstance(header, dict):
            raise SafetensorsError(f"unreadable shard {p}: header is not a JSON object")
        meta = header.pop("__metadata__", None) or {}
        if not isinstance(meta, dict):
            raise SafetensorsError(f"unreadable shard {p}: __metadata__ is not an object")
        self.metadata: dict[str, str] = {str(k): str(v) for k, v in meta.items()}
        self.data_start = 8 + n
        data_size = size - self.data_start
        self._infos: dict[str, TensorInfo] = {}
        for name, rec in header.items():
            self._infos[name] = self._parse_entry(name, rec, data_size)
        self._mm = np.memmap(p, dtype=np.uint8, mode="r") if size > self.data_start else None
        self._closed = False

    def _parse_entry(self, name: str, rec, data_size: int) -> TensorInfo:
        p = self.path
        if not isinstance(rec, dict) or not {"dtype", "shape", "data_offsets"} <= rec.keys():
            raise SafetensorsError(
                f"unreadable shard {p}: entry {name!r} lacks dtype/shape/data_offsets"
            )
        dt, shape, offs = rec["dtype"], rec["shape"], rec["data_offsets"]
        if dt not in DTYPES:
            raise SafetensorsError(
                f"unreadable shard {p}: tensor {name!r} has unsupported dtype {dt!r}"
            )
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise SafetensorsError(
                f"unreadable shard {p}: tensor {name!r} has a bad shape {shape!r}"
            )
        if (
            not isinstance(offs, list)
            or len(offs) != 2
            or not all(isinstance(o, int) for o in offs)
            or not 0 <= offs[0] <= offs[1]
        ):
            raise SafetensorsError(
                f"unreadable shard {p}: tensor {name!r} has bad data_offsets {offs!r}"
            )
        need = math.prod(shape) * DTYPES[dt].itemsize
        if offs[1] - offs[0] != need:
            raise SafetensorsError(
                f"unreadable shard {p}: tensor {name!r} ({dt}, shape {shape}) needs {need} bytes, "
                f"data_offsets give {offs[1] - offs[0]}"
            )
        if offs[1] > data_size:
            raise SafetensorsError(
                f"truncated shard {p}: tensor {name!r} ends at data byte {offs[1]} "
                f"but the file holds only {data_size} data bytes"
            )
        return TensorInfo(name, dt, tuple(shape), offs[0], offs[1])

    # -- access ---------------------------------------------------------------

    def names(self) -> list[str]:
        """Tensor names in header order."""
        return list(self._infos)

    def __contains__(self, name: str) -> bool:
        return name in self._infos

    def info(self, name: str) -> TensorInfo:
        try:
            return self._infos[name]
        except KeyError:
            raise SafetensorsError(f"shard {self.path} has no tensor {name!r}") from None

    def _require_open(self) -> None:
        if self._mm is None and self._closed:
            raise SafetensorsError(f"shard {self.path} is closed")

    def get(self, name: str) -> np.ndarray:
        """The whole tensor as a read-only view of the memory map (no copy)."""
        self._require_open()
        t = self.info(name)
        if t.nbytes == 0 or self._mm is None:
            return np.zeros(t.shape, t.np_dtype)
        raw = self._mm[self.data_start + t.begin : self.data_start + t.end]
        return raw.view(t.np_dtype).reshape(t.shape)

    def rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of a tensor (along its first axis) as a view."""
        self._require_open()
        t = self.info(name)
        if not t.shape:
            raise SafetensorsError(f"{name!r} is a scalar; it has no rows")
        row = math.prod(t.shape[1:]) * t.np_dtype.itemsize
        stop = min(stop, t.shape[0])
        if stop <= start or row == 0 or self._mm is None:
            return np.zeros((max(stop - start, 0), *t.shape[1:]), t.np_dtype)
        b = self.data_start + t.begin + start * row
        raw = self._mm[b : b + (stop - start) * row]
        return raw.view(t.np_dtype).reshape((stop - start, *t.shape[1:]))

    def close(self) -> None:
        # Drop our reference only: arrays handed out by get()/rows() are views of
        # the mapping, and unmapping under them would crash on their next read.
        # The mapping goes away when the last view does.
        self._mm = None
        self._closed = True

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class SafetensorsWriter:
    """Streaming writer: declare all tensors, then write each one's bytes in order.

    >>> w = SafetensorsWriter(path, [("a", "F32", (2, 3))])
    >>> w.write("a", np.ones((2, 3), np.float32)); w.close()

    Chunks of a tensor may be written in several calls (rows in order).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        specs: Iterable[tuple[str, str, tuple[int, ...]]],
        metadata: dict[str, str] | None = None,
    ):
        self.path = Path(path)
        self._specs: list[TensorInfo] = []
        header: dict = {}
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        off = 0
        for name, dt, shape in specs:
            if dt not in DTYPES:
                raise ValueError(f"unsupported dtype {dt!r} for {name!r}")
            if name in header or name == "__metadata__":
                raise ValueError(f"duplicate tensor name {name!r}")
            shape = tuple(int(d) for d in shape)
            nbytes = math.prod(shape) * DTYPES[dt].itemsize
            info = TensorInfo(name, dt, shape, off, off + nbytes)
            self._specs.append(info)
            header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + nbytes]}
            off += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        # Pad the header with spaces to a multiple of 8 so that the data block
        # starts 8-byte aligned (what the reference implementation does).
        raw += b" " * ((-len(raw)) % 8)
        self.total_bytes = off
        self._f = open(self.path, "wb")  # noqa: SIM115 - closed in close()
        self._f.write(struct.pack("<Q", len(raw)))
        self._f.write(raw)
        self._i = 0
        self._written = 0

    def write(self, name: str, chunk: np.ndarray) -> None:
        """Append bytes of tensor ``name`` (must be the next unfinished tensor)."""
        while (
            self._i < len(self._specs)
            and self._written == self._specs[self._i].nbytes
            and self._specs[self._i].name != name
        ):
            self._i += 1
            self._written = 0
        if self._i >= len(self._specs):
            raise ValueError(f"write of {name!r} after all declared tensors were written")
        t = self._specs[self._i]
        if name != t.name:
            raise ValueError(
                f"expected bytes of {t.name!r}, got {name!r} (tensors must be written in order)"
            )
        chunk = np.asarray(chunk)
        if chunk.dtype != t.np_dtype:
            raise ValueError(f"{name!r}: chunk dtype {chunk.dtype} != declared {t.dtype}")
        data = np.ascontiguousarray(chunk).tobytes()
        if self._written + len(data) > t.nbytes:
            raise ValueError(f"{name!r}: more bytes than its shape {t.shape} holds")
        self._f.write(data)
        self._written += len(data)

    def close(self) -> None:
        """Check that every declared tensor was written in full, then flush to disk."""
        while self._i < len(self._specs) and self._written == self._specs[self._i].nbytes:
            self._i += 1
            self._written = 0
        try:
            if self._i != len(self._specs):
                raise ValueError(f"tensor {self._specs[self._i].name!r} was not written in full")
            self._f.flush()
            os.fsync(self._f.fileno())
        finally:
            self._f.close()

    def abort(self) -> None:
        self._f.close()


def save_file(
    path: str | os.PathLike, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None
) -> None:
    """Write a dict of arrays (small files, tests)."""
    specs = [(k, dtype_name(v.dtype), v.shape) for k, v in tensors.items()]
    w = SafetensorsWriter(path, specs, metadata)
    for k, v in tensors.items():
        w.write(k, v)
    w.close()


def load_file(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Read a whole file into memory (copies; small files, tests)."""
    with SafetensorsFile(path) as f:
        return {k: np.array(f.get(k)) for k in f.names()}


def iter_row_chunks(
    n_rows: int, row_elems: int, align: int = 128, max_elems: int = 1 << 22
) -> Iterator[tuple[int, int]]:
    """Row ranges of at most ~max_elems elements, each a multiple of ``align`` rows (but the last)."""
    per = max(align, (max_elems // max(row_elems, 1)) // align * align)
    for r0 in range(0, n_rows, per):
        yield r0, min(r0 + per, n_rows)
