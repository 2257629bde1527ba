"""A small, strict safetensors reader and a streaming writer with float8 support (ml_dtypes).

File layout (https://github.com/huggingface/safetensors, "Format"):

    8 bytes   N, unsigned little-endian: length of the header
    N bytes   JSON: {name: {"dtype": "BF16", "shape": [r, c], "data_offsets": [b, e]},
                     "__metadata__": {str: str}}   (optional)
    rest      raw little-endian tensor bytes; offsets are relative to the start
              of this data block

The ``safetensors`` package's numpy loader has no float8 dtypes, hence this
module.  The reader hands out one tensor (or a range of rows of one) at a
time, read into a fresh array, so converting a shard never holds more than a
chunk of it in memory.  It reads with plain reads, not a memory map: a file
truncated while mapped kills the process (SIGBUS) on the next access, while
a read returns short; and before each read it checks that the file still has
the size and modification time it had when opened, so a shard changed under
a running conversion is one error line.  Only regular files are opened (a
FIFO would block, a device such as /dev/zero never ends).  The writer takes the list of tensors up front (the
header comes first), then streams each tensor's bytes in order.

Validation follows the reference implementation's rules (what
``safetensors.deserialize`` accepts, checked by a property test):

* the header is at most 100,000,000 bytes of UTF-8 JSON (standard JSON only:
  no NaN/Infinity literals, no lone surrogate escapes, numbers within float64
  range) nested at most 127 levels deep, whose top level is an object;
* ``__metadata__`` is absent, null, or an object of strings;
* every other entry is an object with a known ``dtype`` string, a ``shape``
  of non-negative integers and two integer ``data_offsets`` (integers are
  JSON integers below 2^64: not booleans, not ``2.0``); other fields are
  ignored;
* sorted by offsets, the tensors start at 0, follow each other without gap or
  overlap and end exactly at the end of the file; each one's byte length is
  its element count times its dtype's size (computed without overflowing 64
  bits).

Where fp8jax is stricter than the reference: a duplicate key anywhere in the
header is refused (the reference keeps the last one silently, so the file
means two things), a ``dtype`` must be a string (the reference also takes
``{"F32": null}``), the packed sub-byte dtypes (F4, F6_E2M3, F6_E3M2)
are refused as unsupported, and so is a shape numpy cannot make an array of
(non-zero dimensions spanning more than 2^63 - 1 bytes, as ``[2^62, 0]`` of
F32 does although it holds no element).

Every problem raises :class:`SafetensorsError` with the file name and what is
wrong; a file that ends before its last tensor's bytes is called *truncated*,
one whose header cannot be parsed or breaks a rule above *unreadable*.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import stat
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
    "F8_E4M3FNUZ": np.dtype(ml_dtypes.float8_e4m3fnuz),
    "F8_E5M2FNUZ": np.dtype(ml_dtypes.float8_e5m2fnuz),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "C64": np.dtype("<c8"),
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
# Dtypes the reference knows but a numpy array cannot hold one element per item of.
PACKED_DTYPES = ("F4", "F6_E2M3", "F6_E3M2")
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")
FP8_DTYPES = ("F8_E4M3", "F8_E5M2")

# The reference's bounds: a header of at most 10^8 bytes, JSON nested at most
# 127 levels (serde_json's recursion limit), sizes and offsets below 2^64.
MAX_HEADER_BYTES = 100_000_000
MAX_JSON_DEPTH = 127
_U64_MAX = 2**64 - 1
_INTP_MAX = int(np.iinfo(np.intp).max)

if sys.byteorder != "little":  # pragma: no cover - no big-endian CI
    raise ImportError(
        "fp8jax.toolkit.convert assumes a little-endian host (safetensors data is little-endian)"
    )


class SafetensorsError(ValueError):
    """A safetensors file is unreadable, truncated or inconsistent."""


_FILE_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def file_kind(mode: int) -> str:
    """'a FIFO', 'a directory', ... for an st_mode that is not a regular file."""
    return next((name for test, name in _FILE_KINDS if test(mode)), "not a regular file")


def open_regular(path: str | os.PathLike, what: str = "file") -> int:
    """A read-only descriptor of the regular file ``path``; OSError / ValueError otherwise.

    Opened non-blocking, so that a FIFO is refused instead of waiting for a
    writer; the type is checked on the open descriptor (no window between a
    check and the open).  Symlinks are followed.
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise SafetensorsError(f"{what} {path} is {file_kind(mode)}, not a regular file")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: str | os.PathLike, what: str, limit: int) -> bytes:
    """The bytes of the regular file ``path``, refused (ValueError) past ``limit`` bytes."""
    fd = open_regular(path, what)
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise SafetensorsError(f"{what} {path} is {size} bytes; at most {limit} accepted")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise SafetensorsError(f"{what} {path} grew past {limit} bytes while being read")
    return data


def array_can_hold(shape: Iterable[int], itemsize: int) -> bool:
    """Whether numpy can make an array of ``shape``: its non-zero dimensions times
    ``itemsize`` fit in a signed pointer-sized integer (numpy's rule, empty arrays included)."""
    span = itemsize
    for d in shape:
        if d < 0:
            return False
        if d:
            span *= d
            if span > _INTP_MAX:
                return False
    return True


def dtype_name(dtype) -> str:
    """safetensors dtype string of a numpy/ml_dtypes dtype."""
    dt = np.dtype(dtype)
    for k, v in DTYPES.items():
        if v == dt:
            return k
    raise ValueError(f"no safetensors dtype for {dt}")


# -- strict JSON ------------------------------------------------------------------

# A JSON string (escapes included), to skip strings when measuring nesting.
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_SURROGATE = re.compile("[\ud800-\udfff]")


def json_depth(text: str) -> int:
    """Deepest nesting of [ and { in a JSON text (strings skipped), without parsing it.

    Measured before parsing so that a hostile file never reaches Python's
    recursion limit.
    """
    bare = _JSON_STRING.sub("", text)
    if "[" not in bare and "{" not in bare:
        return 0
    b = np.frombuffer(bare.encode("utf-8", "surrogatepass"), np.uint8)
    step = (b == ord("[")).astype(np.int64) + (b == ord("{"))
    step -= (b == ord("]")).astype(np.int64) + (b == ord("}"))
    return int(np.cumsum(step).max())


class _JsonRuleError(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise _JsonRuleError(f"duplicate key {_brief(k)}")
        out[k] = v
    return out


def _reject_constant(name: str):
    raise _JsonRuleError(f"{name} is not JSON")


def _parse_float(s: str) -> float:
    v = float(s)
    if math.isinf(v):
        raise _JsonRuleError(f"number {s[:30]} is out of range")
    return v


def _parse_int(s: str) -> int | float:
    # JSON integers become Python ints only where they are integers in the
    # reference too (u64 / i64); "-0" and longer literals are floats there.
    if s == "-0":
        return -0.0
    digits = len(s) - s.startswith("-")
    if digits <= 20:
        v = int(s)
        if -(2**63) <= v <= _U64_MAX:
            return v
    return _parse_float(s)


def _check_strings(obj) -> None:
    # Lone surrogate escapes ("\ud800") decode in Python but are not Unicode.
    # (Recursion is bounded: the nesting was measured before parsing.)
    if isinstance(obj, str):
        if _SURROGATE.search(obj):
            raise _JsonRuleError("a string holds a lone surrogate escape")
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _check_strings(k)
            _check_strings(v)
    elif isinstance(obj, list):
        for v in obj:
            _check_strings(v)


def loads_json(text: str, max_depth: int = MAX_JSON_DEPTH, strict: bool = True):
    """Parse JSON with a nesting bound; ``strict``: standard JSON, no duplicate keys.

    Raises ValueError (one line) for anything it refuses; never RecursionError.
    """
    depth = json_depth(text)
    if depth > max_depth:
        raise ValueError(f"JSON nested {depth} levels deep (at most {max_depth} allowed)")
    try:
        if not strict:
            return json.loads(text)
        obj = json.loads(
            text,
            object_pairs_hook=_no_duplicates,
            parse_constant=_reject_constant,
            parse_float=_parse_float,
            parse_int=_parse_int,
        )
        _check_strings(obj)
        return obj
    except _JsonRuleError as e:
        raise ValueError(str(e)) from None
    except (json.JSONDecodeError, RecursionError, ValueError) as e:
        raise ValueError(f"not valid JSON ({e})") from None


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


def _brief(v, limit: int = 60) -> str:
    """repr(v), cut short: a hostile header must not make a megabyte error line."""
    r = repr(v)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def _is_u64(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= _U64_MAX


def _entry(name: str, rec) -> TensorInfo:
    n = _brief(name)
    if not isinstance(rec, dict) or not {"dtype", "shape", "data_offsets"} <= rec.keys():
        raise SafetensorsError(f"entry {n} lacks dtype/shape/data_offsets")
    dt, shape, offs = rec["dtype"], rec["shape"], rec["data_offsets"]
    if dt in PACKED_DTYPES:
        raise SafetensorsError(f"tensor {n} has the packed sub-byte dtype {dt}, not supported")
    if not isinstance(dt, str) or dt not in DTYPES:
        raise SafetensorsError(f"tensor {n} has unsupported dtype {_brief(dt)}")
    if not isinstance(shape, list) or not all(_is_u64(d) for d in shape):
        raise SafetensorsError(
            f"tensor {n} has a bad shape {_brief(shape)} (need a list of non-negative integers)"
        )
    if not isinstance(offs, list) or len(offs) != 2 or not all(_is_u64(o) for o in offs):
        raise SafetensorsError(
            f"tensor {n} has bad data_offsets {_brief(offs)} (need two non-negative integers)"
        )
    return TensorInfo(name, dt, tuple(shape), offs[0], offs[1])


def parse_header(raw: bytes, data_size: int) -> tuple[dict[str, str], dict[str, TensorInfo]]:
    """Validate a header (the N bytes after the length) against a data block of ``data_size``.

    Returns (metadata, {name: TensorInfo} in header order).  Raises
    SafetensorsError with a message that starts "unreadable" or "truncated".
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SafetensorsError(f"unreadable: header is not UTF-8 ({e.reason})") from None
    try:
        header = loads_json(text)
    except ValueError as e:
        raise SafetensorsError(f"unreadable: header: {e}") from None
    if not isinstance(header, dict):
        raise SafetensorsError("unreadable: header is not a JSON object")
    meta = header.pop("__metadata__", None)
    if meta is None:
        meta = {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise SafetensorsError("unreadable: __metadata__ is not an object of strings")
    try:
        infos = {name: _entry(name, rec) for name, rec in header.items()}
    except SafetensorsError as e:
        raise SafetensorsError(f"unreadable: {e}") from None
    # The data block is the tensors end to end: sorted by offsets, each starts
    # where the previous one ended, and the last ends where the file does.
    # Anything else overlaps (two tensors read the same bytes), leaves bytes
    # that no tensor owns, or points past the end.
    pos = 0
    for t in sorted(infos.values(), key=lambda t: (t.begin, t.end)):
        if t.begin != pos or t.end < t.begin:
            what = "overlaps the previous tensor" if t.begin < pos else "leaves a gap before it"
            if t.end < t.begin:
                what = "ends before it begins"
            raise SafetensorsError(
                f"unreadable: tensor {_brief(t.name)} has data_offsets [{t.begin}, {t.end}]: it {what} "
                f"(tensors must tile the data block from 0 without gaps or overlaps)"
            )
        pos = t.end
        numel = 1
        for d in t.shape:
            numel *= d
            if numel > _U64_MAX:
                raise SafetensorsError(
                    f"unreadable: tensor {_brief(t.name)} shape {_brief(list(t.shape))} overflows"
                )
        need = numel * DTYPES[t.dtype].itemsize
        if need > _U64_MAX:
            raise SafetensorsError(
                f"unreadable: tensor {_brief(t.name)} shape {_brief(list(t.shape))} overflows"
            )
        if not array_can_hold(t.shape, DTYPES[t.dtype].itemsize):
            # Stricter than the reference: numpy cannot hold such a shape, even
            # in an empty tensor ([2^62, 0] of F32, say).
            raise SafetensorsError(
                f"unreadable: tensor {_brief(t.name)} shape {_brief(list(t.shape))} is beyond "
                f"what an array can hold (its non-zero dimensions span more than {_INTP_MAX} bytes)"
            )
        if t.nbytes != need:
            raise SafetensorsError(
                f"unreadable: tensor {_brief(t.name)} ({t.dtype}, shape {_brief(list(t.shape))}) needs {need} "
                f"bytes, data_offsets give {t.nbytes}"
            )
    if pos > data_size:
        raise SafetensorsError(
            f"truncated: the tensors end at data byte {pos} but the file holds only "
            f"{data_size} data bytes"
        )
    if pos < data_size:
        raise SafetensorsError(
            f"unreadable: {data_size - pos} trailing data bytes belong to no tensor "
            f"(the tensors end at data byte {pos} of {data_size})"
        )
    return meta, infos


class SafetensorsFile:
    """Read-only safetensors file (a regular file).  Use as a context manager or call close()."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        p = self.path
        try:
            f = os.fdopen(open_regular(p, "shard"), "rb", buffering=0)
        except OSError as e:
            raise SafetensorsError(f"cannot read shard {p}: {e.strerror or e}") from None
        try:
            st = os.fstat(f.fileno())
            size = st.st_size
            head = f.read(8)
            if len(head) < 8:
                raise SafetensorsError(
                    f"truncated shard {p}: {size} bytes, shorter than the 8-byte header length"
                )
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or n > size - 8:
                raise SafetensorsError(
                    f"unreadable shard {p}: header length {n} does not fit the file "
                    f"({size} bytes) or exceeds {MAX_HEADER_BYTES}; not a safetensors file, "
                    "or truncated"
                )
            raw = f.read(n)
            if len(raw) != n:
                raise SafetensorsError(f"truncated shard {p}: it ended inside its header")
            self.data_start = 8 + n
            try:
                self.metadata, self._infos = parse_header(raw, size - self.data_start)
            except SafetensorsError as e:
                kind, _, rest = str(e).partition(": ")
                raise SafetensorsError(f"{kind} shard {p}: {rest}") from None
        except OSError as e:
            f.close()
            raise SafetensorsError(f"cannot read shard {p}: {e.strerror or e}") from None
        except BaseException:
            f.close()
            raise
        self._f: io.RawIOBase | None = f
        # What the file was when its header was checked: every read compares.
        self._stamp = (st.st_size, st.st_mtime_ns)

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

    def _read(self, offset: int, nbytes: int) -> np.ndarray:
        """``nbytes`` bytes at data offset ``offset``, into a new array; refuses a changed file."""
        if self._f is None:
            raise SafetensorsError(f"shard {self.path} is closed")
        buf = np.empty(nbytes, np.uint8)
        try:
            self._check_unchanged()
            self._f.seek(self.data_start + offset)
            view, got = memoryview(buf), 0
            while got < nbytes:
                k = self._f.readinto(view[got:])
                if not k:
                    raise SafetensorsError(
                        f"shard {self.path} changed while being read: it ends "
                        f"{nbytes - got} bytes short of its tensors (truncated); "
                        "convert a checkpoint that nothing is writing"
                    )
                got += k
        except OSError as e:
            raise SafetensorsError(f"cannot read shard {self.path}: {e.strerror or e}") from None
        return buf

    def _check_unchanged(self) -> None:
        st = os.fstat(self._f.fileno())
        if (st.st_size, st.st_mtime_ns) != self._stamp:
            raise SafetensorsError(
                f"shard {self.path} changed while being read (size {self._stamp[0]} -> "
                f"{st.st_size} bytes, or modified); convert a checkpoint that nothing is writing"
            )

    def get(self, name: str) -> np.ndarray:
        """The whole tensor, read into a new array."""
        t = self.info(name)
        if t.nbytes == 0:
            return np.zeros(t.shape, t.np_dtype)
        return self._read(t.begin, t.nbytes).view(t.np_dtype).reshape(t.shape)

    def rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of a tensor (along its first axis), read into a new array."""
        t = self.info(name)
        if not t.shape:
            raise SafetensorsError(f"{name!r} is a scalar; it has no rows")
        row = math.prod(t.shape[1:]) * t.np_dtype.itemsize
        stop = min(stop, t.shape[0])
        if stop <= start or row == 0:
            return np.zeros((max(stop - start, 0), *t.shape[1:]), t.np_dtype)
        raw = self._read(t.begin + start * row, (stop - start) * row)
        return raw.view(t.np_dtype).reshape((stop - start, *t.shape[1:]))

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None

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
