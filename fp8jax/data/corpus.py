"""Byte-level language-model data: corpora and deterministic batches.

Tokens are raw bytes (vocabulary 256), so no tokenizer and no download is
needed.  Three sources:

* ``"stdlib"`` (default): the running interpreter's standard library sources
  and docs (``*.py``, ``*.rst``, ``*.txt`` under ``sysconfig``'s ``stdlib``
  directory; ``site-packages`` and test suites excluded), read in sorted path
  order.  Every machine with Python has it; its SHA-256 fingerprint is
  recorded so runs on different interpreters can be told apart.
* ``"text"``: any text file, or every file under a folder (sorted), that the
  user names.
* ``"synthetic"``: a seeded low-entropy Markov-chain byte stream for tests.

Train/validation split: whole files go to validation when the SHA-256 of
their relative path falls in the validation fraction, so the split does not
depend on which other files exist or on the order they were read; a single
file (or the synthetic stream) is split at ``1 - val_fraction`` of its bytes.

Batches are a pure function of ``(seed, step)`` (see :func:`train_batch`),
so a resumed run sees exactly the batches of an uninterrupted one without
checkpointing an iterator.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

VOCAB_SIZE = 256
STDLIB_SUFFIXES = (".py", ".rst", ".txt")
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}


@dataclass(frozen=True)
class Corpus:
    """A byte corpus split into train and validation streams (uint8 arrays)."""

    name: str
    train: np.ndarray
    val: np.ndarray
    n_files: int
    sha256: str

    def summary(self) -> dict:
        return {
            "name": self.name,
            "train_bytes": int(self.train.size),
            "val_bytes": int(self.val.size),
            "n_files": self.n_files,
            "sha256": self.sha256,
        }


def _is_val(rel_path: str, val_fraction: float) -> bool:
    # A path hash (not Python's salted hash()) keeps the split stable across runs.
    h = int.from_bytes(hashlib.sha256(rel_path.encode()).digest()[:8], "big")
    return h / 2.0**64 < val_fraction


def _files_under(root: Path, suffixes: tuple[str, ...] | None) -> list[Path]:
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Sorted walk: the corpus is the same bytes in the same order every time.
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for f in sorted(filenames):
            if suffixes is None or f.endswith(suffixes):
                files.append(Path(dirpath) / f)
    return sorted(files)


def _split_files(
    name: str, root: Path, files: list[Path], val_fraction: float, max_bytes: int | None
) -> Corpus:
    if not files:
        raise ValueError(f"no text files found under {root}; give a folder that holds text files")
    train_parts: list[bytes] = []
    val_parts: list[bytes] = []
    total = 0
    digest = hashlib.sha256()
    n_used = 0
    for path in files:
        data = path.read_bytes()
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
    return _split_files(
        "stdlib", root, _files_under(root, STDLIB_SUFFIXES), val_fraction, max_bytes
    )


def text_corpus(path: str, val_fraction: float = 0.05, max_bytes: int | None = None) -> Corpus:
    """A text file (split by bytes) or every file in a folder (split per file)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"data path {path!r} does not exist")
    if p.is_file():
        data = p.read_bytes()
        if max_bytes is not None:
            data = data[:max_bytes]
        sha = hashlib.sha256(data).hexdigest()
        return _split_bytes(f"text:{p.name}", data, val_fraction, 1, sha)
    return _split_files(f"text:{p}", p, _files_under(p, None), val_fraction, max_bytes)


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
) -> Corpus:
    """Build a corpus by source name ("stdlib" | "text" | "synthetic")."""
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
    raise ValueError(f"unknown data source {source!r}; use 'stdlib', 'text' or 'synthetic'")


def check_corpus(corpus: Corpus, length: int) -> None:
    """Raise ValueError (one line with the fix) unless both streams hold a row of ``length``.

    A training row needs ``length`` bytes of the train stream; the validation
    windows need ``length`` bytes of the validation stream.
    """
    short = [
        f"{part} {stream.size} bytes"
        for part, stream in (("train", corpus.train), ("validation", corpus.val))
        if stream.size < length + 1
    ]
    if short:
        raise ValueError(
            f"corpus {corpus.name!r} is too small for seq_len {length}: "
            f"{', '.join(short)} (each needs more than {length}); give a larger corpus "
            "(--config.data.path) or a smaller --config.seq_len"
        )


def _windows(stream: np.ndarray, starts: np.ndarray, length: int) -> np.ndarray:
    idx = starts[:, None] + np.arange(length)[None, :]
    # int32 tokens: what the embedding lookup expects.
    return stream[idx].astype(np.int32)


def train_batch(corpus: Corpus, step: int, batch_size: int, length: int, seed: int) -> np.ndarray:
    """Tokens int32 [batch_size, length] for ``step``: a pure function of (seed, step).

    Window starts are drawn uniformly from the train stream with a generator
    seeded by (seed, step); a model predicts tokens[:, 1:] from the prefixes,
    i.e. ``length - 1`` predictions per row.
    """
    n = corpus.train.size - length
    if n <= 0 or length < 2:
        raise ValueError(f"train stream ({corpus.train.size} bytes) too short for length {length}")
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, n + 1, size=batch_size)
    return _windows(corpus.train, starts, length)


def val_batches(corpus: Corpus, n_batches: int, batch_size: int, length: int) -> np.ndarray:
    """A fixed validation set int32 [n_batches, batch_size, length].

    Evenly spaced windows over the validation stream (no randomness), the same
    for every run, recipe and seed that uses this corpus.
    """
    n = corpus.val.size - length
    if n < 0 or length < 2:
        raise ValueError(f"val stream ({corpus.val.size} bytes) too short for length {length}")
    total = n_batches * batch_size
    starts = np.linspace(0, n, total).astype(np.int64)
    return _windows(corpus.val, starts, length).reshape(n_batches, batch_size, length)
