"""Byte-level language-model data: corpora and deterministic batches.

Tokens are raw bytes (vocabulary 256), so no tokenizer and no download is
needed.  Three sources:

* ``"stdlib"`` (default): the running interpreter's standard library sources
  and docs (``*.py``, ``*.rst``, ``*.txt`` under ``sysconfig``'s ``stdlib``
  directory; ``site-packages`` and test suites excluded), read in sorted path
  order.  Every machine with Python has it; its SHA-256 fingerprint is
  recorded so runs on different interpreters can be told apart.
* ``"text"``: any text file, or every file under a folder (sorted), that the
  user names; JSONL / Parquet / ArrayRecord shards give their documents' text
  (:mod:`fp8jax.data.documents`), one newline between documents.  Binary
  files and token files are refused.
* ``"synthetic"``: a seeded low-entropy Markov-chain byte stream for tests.

Train/validation split: whole files go to validation when the SHA-256 of
their relative path falls in the validation fraction, so the split does not
depend on which other files exist or on the order they were read; a single
file (or the synthetic stream) is split at ``1 - val_fraction`` of its bytes.

Batches are a pure function of ``(seed, step)`` (:mod:`fp8jax.data.batches`),
so a resumed run sees exactly the batches of an uninterrupted one without
checkpointing an iterator.  Token-file corpora: :mod:`fp8jax.data.tokens`.
"""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fp8jax.data.batches import check_corpus, train_batch, val_batches
from fp8jax.data.documents import (
    documents,
    files_under,
    is_plain_text,
    refuse_token_data,
    text_bytes,
)
from fp8jax.data.shards import MemoryShard
from fp8jax.data.tokens import TokenFiles, load_tokens

__all__ = ["check_corpus", "train_batch", "val_batches"]  # batching, re-exported

VOCAB_SIZE = 256
STDLIB_SUFFIXES = (".py", ".rst", ".txt")


@dataclass(frozen=True)
class Corpus:
    """A byte corpus split into train and validation streams (uint8 arrays)."""

    name: str
    train: np.ndarray
    val: np.ndarray
    n_files: int
    sha256: str
    unit = "bytes"
    vocab_size = VOCAB_SIZE

    @property
    def train_shards(self) -> list[MemoryShard]:
        return [MemoryShard("train", self.train)]

    @property
    def val_shards(self) -> list[MemoryShard]:
        return [MemoryShard("validation", self.val)]

    def summary(self) -> dict:
        return {
            "name": self.name,
            "vocab_size": VOCAB_SIZE,
            "train_bytes": int(self.train.size),
            "val_bytes": int(self.val.size),
            "n_files": self.n_files,
            "sha256": self.sha256,
        }


def _is_val(rel_path: str, val_fraction: float) -> bool:
    # A path hash (not Python's salted hash()) keeps the split stable across runs.
    h = int.from_bytes(hashlib.sha256(rel_path.encode()).digest()[:8], "big")
    return h / 2.0**64 < val_fraction


def _split_files(
    name: str,
    root: Path,
    files: list[Path],
    val_fraction: float,
    max_bytes: int | None,
    read: Callable[[Path], bytes] = Path.read_bytes,
) -> Corpus:
    if not files:
        raise ValueError(f"no text files found under {root}; give a folder that holds text files")
    train_parts: list[bytes] = []
    val_parts: list[bytes] = []
    total = 0
    digest = hashlib.sha256()
    n_used = 0
    for path in files:
        data = read(path)
        if not data:
            continue
        if max_bytes is not None and total + len(data) > max_bytes and n_used > 0:
            break
        rel = path.relative_to(root).as_posix()
        digest.update(rel.encode() + b"\0" + data)
        (val_parts if _is_val(rel, val_fraction) else train_parts).append(data)
        total += len(data)
        n_used += 1
    if not val_parts or not train_parts:
        # Too few files for a per-file split: fall back to a byte split.
        joined = b"".join(train_parts + val_parts)
        return _split_bytes(name, joined, val_fraction, n_used, digest.hexdigest())
    train = np.frombuffer(b"".join(train_parts), dtype=np.uint8)
    val = np.frombuffer(b"".join(val_parts), dtype=np.uint8)
    return Corpus(name, train, val, n_used, digest.hexdigest())


def _split_bytes(name: str, data: bytes, val_fraction: float, n_files: int, sha: str) -> Corpus:
    arr = np.frombuffer(data, dtype=np.uint8)
    cut = int(round(arr.size * (1.0 - val_fraction)))
    if cut <= 0 or cut >= arr.size:
        raise ValueError(
            f"corpus {name!r} of {arr.size} bytes is too small to split into train and "
            f"validation at val_fraction {val_fraction}; give a larger corpus"
        )
    return Corpus(name, arr[:cut], arr[cut:], n_files, sha)


def stdlib_root() -> Path:
    """The running interpreter's standard-library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_corpus(val_fraction: float = 0.05, max_bytes: int | None = None) -> Corpus:
    """The default corpus: standard-library sources and docs, sorted, split per file."""
    root = stdlib_root()
    return _split_files("stdlib", root, files_under(root, STDLIB_SUFFIXES), val_fraction, max_bytes)


def _text_of(path: Path) -> bytes:
    """A plain text file's bytes, or a shard's documents joined by newlines (UTF-8)."""
    if is_plain_text(path):
        return text_bytes(path)
    return "\n".join(documents(path)).encode("utf-8")


def text_corpus(path: str, val_fraction: float = 0.05, max_bytes: int | None = None) -> Corpus:
    """A text file (split by bytes) or every file in a folder (split per file).

    Raises DataError (a ValueError) for binary files and token data.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"data path {path!r} does not exist")
    if p.is_file():
        data = _text_of(p)
        if max_bytes is not None:
            data = data[:max_bytes]
        sha = hashlib.sha256(data).hexdigest()
        return _split_bytes(f"text:{p.name}", data, val_fraction, 1, sha)
    refuse_token_data(p)
    return _split_files(f"text:{p}", p, files_under(p), val_fraction, max_bytes, _text_of)


def synthetic_corpus(
    n_bytes: int = 100_000, seed: int = 0, alphabet: int = 32, val_fraction: float = 0.05
) -> Corpus:
    """A seeded order-2 Markov chain over ``alphabet`` printable bytes.

    Each (prev2, prev1) context has a sparse next-byte distribution (4
    candidates), so the entropy is far below log(256) and a model's loss
    visibly drops within a few dozen steps.
    """
    if not 2 <= alphabet <= 95:
        raise ValueError("alphabet must be in [2, 95]")
    rng = np.random.default_rng(seed)
    symbols = np.arange(32, 32 + alphabet, dtype=np.uint8)
    cand = rng.integers(0, alphabet, size=(alphabet, alphabet, 4))
    probs = rng.dirichlet(np.full(4, 0.5), size=(alphabet, alphabet))
    # Inverse-CDF sampling: pick candidate j with the first cumulative prob > u.
    cum = np.cumsum(probs, axis=-1)
    cum[..., -1] = 1.0
    u = rng.random(n_bytes)
    cum_l = cum.tolist()
    cand_l = cand.tolist()
    out = [0] * n_bytes
    a, b = 0, 1
    for i, ui in enumerate(u.tolist()):
        row = cum_l[a][b]
        j = 0 if ui < row[0] else 1 if ui < row[1] else 2 if ui < row[2] else 3
        c = cand_l[a][b][j]
        out[i] = c
        a, b = b, c
    out = np.asarray(out, dtype=np.int64)
    data = symbols[out].tobytes()
    sha = hashlib.sha256(data).hexdigest()
    return _split_bytes(f"synthetic:{seed}", data, val_fraction, 0, sha)


def load_corpus(
    source: str = "stdlib",
    path: str | None = None,
    val_fraction: float = 0.05,
    max_bytes: int | None = None,
    seed: int = 0,
) -> Corpus | TokenFiles:
    """Build a corpus by source name ("stdlib" | "text" | "synthetic" | "tokens").

    "tokens" reads a token directory (:mod:`fp8jax.data.tokens`); its split
    and vocabulary come from the directory, so ``val_fraction``,
    ``max_bytes`` and ``seed`` do not apply to it.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if source == "stdlib":
        return stdlib_corpus(val_fraction, max_bytes)
    if source == "text":
        if not path:
            raise ValueError("data source 'text' needs data.path (a file or folder)")
        return text_corpus(path, val_fraction, max_bytes)
    if source == "synthetic":
        return synthetic_corpus(max_bytes or 100_000, seed=seed, val_fraction=val_fraction)
    if source == "tokens":
        if not path:
            raise ValueError("data source 'tokens' needs data.path (a token directory)")
        return load_tokens(path)
    raise ValueError(
        f"unknown data source {source!r}; use 'stdlib', 'text', 'synthetic' or 'tokens'"
    )
