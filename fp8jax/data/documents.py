"""Documents of text from files: plain text, JSONL, Parquet and ArrayRecord shards.

One reader for everything that takes text: the byte-level ``text`` corpus
and ``fp8jax data prepare``.  A file's format comes from its name:

* ``*.jsonl`` / ``*.ndjson``: one JSON object per line, its ``field`` (default
  ``"text"``) is a document;
* ``*.parquet``: the string column ``field``, one document per row (needs
  ``pyarrow``);
* ``*.array_record`` / ``*.arrayrecord``: one document per record, UTF-8
  text or a JSON object holding ``field`` (needs ``array_record``);
* anything else: a UTF-8 text file.  A plain file is one document; it is
  handed out in pieces of about ``PIECE_BYTES`` cut after a newline so that
  a single large file can still be split into train and validation parts (a
  line longer than ``MAX_PIECE_BYTES`` is cut between two characters).

Binary files are refused (a NUL byte, or bytes that are not UTF-8), and so is
a token file or a token directory given as text, each with one line naming
the file and what to do instead.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

from fp8jax.data.shards import DataError

PIECE_BYTES = 1 << 16
# A line longer than this is cut (at a character boundary) into pieces of at most so many
# bytes: one line of hundreds of MB is not held, or searched, as one piece.
MAX_PIECE_BYTES = 1 << 20
JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
ARRAY_RECORD_SUFFIXES = (".array_record", ".arrayrecord")
TOKEN_SUFFIXES = (".bin", ".npy", ".npz")
TOKENS_META = "tokens.json"
SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}
_TOKENS_HINT = (
    "for token files use --config.data.source=tokens --config.data.path=DIR (a directory "
    f"with {TOKENS_META}; `fp8jax data prepare` makes one)"
)


def files_under(root: Path, suffixes: tuple[str, ...] | None = None) -> list[Path]:
    """``root`` itself if a file, else every file under it (sorted walk; ``suffixes`` filter).

    Skips ``SKIP_DIRS`` (byte caches, installed packages, test suites).
    """
    if root.is_file():
        return [root]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Sorted walk: the corpus is the same bytes in the same order every time.
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for f in sorted(filenames):
            if suffixes is None or f.endswith(suffixes):
                files.append(Path(dirpath) / f)
    return sorted(files)


def refuse_token_data(path: Path) -> None:
    """DataError when ``path`` is (or holds) token data rather than text."""
    if path.is_dir() and (path / TOKENS_META).is_file():
        raise DataError(f"{path} is a token directory ({TOKENS_META}), not text; {_TOKENS_HINT}")
    if path.name == TOKENS_META or path.suffix in TOKEN_SUFFIXES:
        raise DataError(f"{path} is a token file, not text; {_TOKENS_HINT}")


def _decode(blob: bytes, where: str, offset: int = 0) -> str:
    if b"\0" in blob:
        raise DataError(f"{where} is binary (it holds NUL bytes), not text; {_TOKENS_HINT}")
    try:
        return blob.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"{where} is not UTF-8 text (byte {offset + e.start}); convert it to UTF-8, or "
            f"{_TOKENS_HINT}"
        ) from None


def text_bytes(path: Path) -> bytes:
    """The bytes of a plain text file, refused (DataError) when binary or not UTF-8."""
    refuse_token_data(path)
    blob = path.read_bytes()
    _decode(blob, str(path))
    return blob


def _field(obj, field: str, where: str) -> str:
    if not isinstance(obj, dict) or not isinstance(obj.get(field), str):
        raise DataError(f"{where} has no string field {field!r}; name the text field with --field")
    return obj[field]


def _jsonl(path: Path, field: str) -> Iterator[str]:
    with open(path, "rb") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{i}"
            try:
                obj = json.loads(_decode(line, where))
            except json.JSONDecodeError as e:
                raise DataError(f"{where} is not a JSON object ({e.msg})") from None
            yield _field(obj, field, where)


def _parquet(path: Path, field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(
            f"reading {path} needs pyarrow: pip install 'fp8jax[data]' (or pyarrow)"
        ) from None
    try:
        f = pq.ParquetFile(path)
        if field not in f.schema_arrow.names:
            raise DataError(
                f"{path} has no column {field!r} (columns: {', '.join(f.schema_arrow.names)}); "
                "name the text column with --field"
            )
        for batch in f.iter_batches(columns=[field], batch_size=1024):
            for text in batch.column(0).to_pylist():
                if text is not None:
                    yield str(text)
    except DataError:
        raise
    except Exception as e:  # pyarrow raises its own types for corrupt files
        raise DataError(f"{path} is not a readable Parquet file ({type(e).__name__})") from None


def _array_record(path: Path, field: str) -> Iterator[str]:
    try:
        from array_record.python.array_record_module import ArrayRecordReader
    except ImportError:
        raise DataError(
            f"reading {path} needs array_record: pip install 'fp8jax[data]' (or array_record)"
        ) from None
    try:
        reader = ArrayRecordReader(str(path))
    except Exception as e:  # the C++ reader raises RuntimeError / ValueError variants
        raise DataError(_unreadable_array_record(path, e)) from None
    try:
        try:
            n = reader.num_records()
        except Exception as e:  # garbage is found when the records are counted
            raise DataError(_unreadable_array_record(path, e)) from None
        for start in range(0, n, 1024):
            try:
                recs = reader.read(list(range(start, min(start + 1024, n))))
            except Exception as e:
                raise DataError(_unreadable_array_record(path, e, start)) from None
            for j, rec in enumerate(recs):
                where = f"{path} record {start + j}"
                text = _decode(rec, where)
                if text.lstrip().startswith("{"):
                    try:
                        text = _field(json.loads(text), field, where)
                    except json.JSONDecodeError:
                        pass  # a text record that happens to start with a brace
                yield text
    except BaseException:
        # Stopped early (an error above, the consumer gone): the reader is let go quietly.
        try:
            reader.close()
        except Exception:
            pass
        raise
    # Some damage is found only when the reader closes (a file under 64 KB counts no
    # records and fails there): said here, not from a ``finally``.
    try:
        reader.close()
    except Exception as e:
        raise DataError(_unreadable_array_record(path, e)) from None


def _unreadable_array_record(path: Path, e: Exception, record: int | None = None) -> str:
    at = "" if record is None else f" at record {record}"
    why = (str(e).splitlines() or [type(e).__name__])[0][:120]
    return f"{path} is not a readable ArrayRecord file{at} ({why}); remove it or fix it"


def _utf8_cut(blob: bytes, at: int) -> int:
    """The largest index <= ``at`` that starts a UTF-8 character of ``blob`` (> 0)."""
    cut = at
    # Continuation bytes are 0b10xxxxxx; a character is at most 4 bytes long.
    while cut > at - 3 and blob[cut] & 0xC0 == 0x80:
        cut -= 1
    return cut


def _pieces(path: Path) -> Iterator[str]:
    """A text file in pieces, read as it goes: each ends at the first newline at or past
    ``PIECE_BYTES`` from its start (so no line and no UTF-8 character is split), or, in a
    line longer than ``MAX_PIECE_BYTES``, at the last character that fits in that many bytes
    (memory and time stay linear in the file whatever its lines)."""
    refuse_token_data(path)
    offset = 0
    buf = b""
    with open(path, "rb") as f:
        while True:
            blob = f.read(PIECE_BYTES)
            # Bytes before ``scan`` were searched for a newline already.
            scan = max(PIECE_BYTES, len(buf))
            buf += blob
            while len(buf) > PIECE_BYTES:
                cut = buf.find(b"\n", scan, MAX_PIECE_BYTES) + 1
                if not cut:
                    if len(buf) < MAX_PIECE_BYTES + 4:
                        break
                    cut = _utf8_cut(buf, MAX_PIECE_BYTES)
                yield _decode(buf[:cut], str(path), offset)
                offset += cut
                buf = buf[cut:]
                scan = PIECE_BYTES
            if not blob:
                if buf:
                    yield _decode(buf, str(path), offset)
                return


def documents(path: Path, field: str = "text") -> Iterator[str]:
    """The documents of one file, in order (see the module docstring for the formats)."""
    name = path.name.lower()
    if name.endswith(JSONL_SUFFIXES):
        return _jsonl(path, field)
    if name.endswith(PARQUET_SUFFIXES):
        return _parquet(path, field)
    if name.endswith(ARRAY_RECORD_SUFFIXES):
        return _array_record(path, field)
    return _pieces(path)


def is_plain_text(path: Path) -> bool:
    """True for a file read as plain text (not a JSONL / Parquet / ArrayRecord shard)."""
    return not path.name.lower().endswith(JSONL_SUFFIXES + PARQUET_SUFFIXES + ARRAY_RECORD_SUFFIXES)
