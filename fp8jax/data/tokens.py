"""Token-file corpora: raw ``uint16`` / ``uint32`` shards plus a ``tokens.json``.

A token directory (``fp8jax data prepare`` writes one; a nanoGPT-style
``train.bin`` / ``val.bin`` pair becomes one by adding the file) holds::

    tokens.json          {"vocab_size": 8192, "dtype": "uint16", ...}
    train-00000.bin      little-endian token ids, no header
    val-00000.bin

``tokens.json`` fields: ``vocab_size`` and ``dtype`` (``"uint16"`` or
``"uint32"``) are required; ``shards`` (a list of ``{"split": "train" |
"val", "path", "n_tokens", "dtype", "sha256"}``, each field but split and
path optional) names the shards, else every ``train*.bin`` and ``val*.bin``
beside it is one, in sorted order; ``tokenizer`` names the tokenizer file and
``eot_id`` the end-of-document token (informational).

Loading checks everything before a run starts and raises :class:`DataError`
(one line naming the shard) for: a missing or unreadable shard, a size that
is not ``n_tokens`` whole tokens of the dtype, shards of mixed dtypes, a
shard whose bytes differ from its recorded ``sha256``, and a token id at or
above ``vocab_size``.  Every shard is read once to check its ids; the same
pass hashes it, giving the corpus fingerprint (SHA-256 over the metadata and
every shard's split, name and bytes) that a resumed run must match.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fp8jax.data.documents import TOKENS_META
from fp8jax.data.shards import DataError, FileShard

DTYPES = ("uint16", "uint32")
SPLITS = ("train", "val")
# Tokens read per chunk while checking a shard (32 MiB at uint16).
_SCAN_TOKENS = 1 << 24


@dataclass(frozen=True)
class TokenFiles:
    """A token-file corpus: its shards per split, vocabulary and fingerprint."""

    name: str
    root: Path
    vocab_size: int
    dtype: str
    train_shards: list[FileShard]
    val_shards: list[FileShard]
    sha256: str
    meta: dict = field(default_factory=dict)
    unit = "tokens"

    @property
    def n_files(self) -> int:
        return len(self.train_shards) + len(self.val_shards)

    def summary(self) -> dict:
        return {
            "name": self.name,
            "vocab_size": self.vocab_size,
            "dtype": self.dtype,
            "train_tokens": sum(s.size for s in self.train_shards),
            "val_tokens": sum(s.size for s in self.val_shards),
            "n_files": self.n_files,
            "tokenizer": self.meta.get("tokenizer"),
            "sha256": self.sha256,
        }


def read_meta(root: Path) -> dict:
    """``root / tokens.json`` checked for the required fields (DataError otherwise)."""
    path = root / TOKENS_META
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DataError(
            f'{root} has no {TOKENS_META}; write one ({{"vocab_size": N, "dtype": '
            '"uint16"}) or make the directory with `fp8jax data prepare`'
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path} is unreadable ({type(e).__name__})") from None
    if not isinstance(meta, dict):
        raise DataError(f"{path} must hold a JSON object")
    dtype, vocab = meta.get("dtype"), meta.get("vocab_size")
    if dtype not in DTYPES:
        raise DataError(f"{path}: dtype must be one of {DTYPES}, got {dtype!r}")
    top = int(np.iinfo(np.dtype(dtype)).max) + 1
    if not isinstance(vocab, int) or isinstance(vocab, bool) or not 2 <= vocab <= top:
        raise DataError(f"{path}: vocab_size must be an integer in [2, {top}], got {vocab!r}")
    return meta


def _listed_shards(root: Path, meta: dict) -> list[dict]:
    entries = meta.get("shards")
    if entries is None:
        found = [
            {"split": split, "path": p.name}
            for split in SPLITS
            for p in sorted(root.glob(f"{split}*.bin"))
        ]
        return found
    if not isinstance(entries, list):
        raise DataError(f"{root / TOKENS_META}: shards must be a list")
    for e in entries:
        if not isinstance(e, dict) or e.get("split") not in SPLITS or not e.get("path"):
            raise DataError(
                f"{root / TOKENS_META}: every shard needs split ('train' or 'val') and path, "
                f"got {e!r}"
            )
    return entries


def _open_shard(root: Path, entry: dict, dtype: np.dtype) -> FileShard:
    path = root / str(entry["path"])
    if not path.resolve().is_relative_to(root.resolve()):
        raise DataError(f"shard {entry['path']!r} lies outside {root}")
    if "dtype" in entry and entry["dtype"] != dtype.name:
        raise DataError(
            f"mixed dtypes across shards: {path.name} is {entry['dtype']}, {TOKENS_META} says "
            f"{dtype.name}; re-make the corpus with one dtype"
        )
    try:
        nbytes = path.stat().st_size
    except OSError as e:
        raise DataError(f"token shard {path} is unreadable ({e.strerror})") from None
    if not path.is_file():
        raise DataError(f"token shard {path} is not a regular file")
    n = entry.get("n_tokens")
    if n is not None and nbytes != int(n) * dtype.itemsize:
        raise DataError(
            f"token shard {path} holds {nbytes} bytes, not {n} tokens of {dtype.name} "
            f"({int(n) * dtype.itemsize} bytes): truncated, or written with another dtype"
        )
    if nbytes % dtype.itemsize:
        raise DataError(
            f"token shard {path} holds {nbytes} bytes, not a whole number of {dtype.name} "
            "tokens: written with another dtype?"
        )
    return FileShard(path.name, path, dtype, nbytes // dtype.itemsize)


def _scan(shard: FileShard, vocab: int, expect_sha: str | None, digest) -> None:
    """Hash the shard into ``digest`` and check its ids are below ``vocab``."""
    own = hashlib.sha256()
    item = shard.dtype.itemsize
    try:
        with open(shard.path, "rb") as f:
            pos = 0
            while blob := f.read(_SCAN_TOKENS * item):
                ids = np.frombuffer(blob, shard.dtype)
                top = int(ids.max())
                if top >= vocab:
                    at = pos + int(np.argmax(ids >= vocab))
                    raise DataError(
                        f"token shard {shard.path} holds id {top} (first bad id at token {at}), "
                        f"not below the vocabulary size {vocab} of {TOKENS_META}"
                    )
                own.update(blob)
                digest.update(blob)
                pos += ids.size
    except OSError as e:
        raise DataError(f"token shard {shard.path} is unreadable ({e.strerror})") from None
    if expect_sha is not None and own.hexdigest() != expect_sha:
        raise DataError(
            f"token shard {shard.path} differs from the sha256 in {TOKENS_META} (changed "
            "since it was made); restore it or re-make the corpus"
        )


def load_tokens(path: str | Path) -> TokenFiles:
    """The token corpus at ``path`` (its directory or its ``tokens.json``), fully checked."""
    p = Path(path).expanduser()
    if p.is_file() and p.name == TOKENS_META:
        p = p.parent
    if p.is_file():
        raise DataError(
            f"{p} is a file; give the directory that holds it and a {TOKENS_META} "
            "(--config.data.path=DIR)"
        )
    if not p.is_dir():
        raise DataError(
            f"token directory {p} does not exist; make one with "
            f"`fp8jax data prepare SRC {p} --vocab N`"
        )
    meta = read_meta(p)
    dtype = np.dtype(meta["dtype"]).newbyteorder("<")
    vocab = int(meta["vocab_size"])
    entries = _listed_shards(p, meta)
    shards = {s: [_open_shard(p, e, dtype) for e in entries if e["split"] == s] for s in SPLITS}
    for split in SPLITS:
        if not shards[split]:
            raise DataError(
                f"{p} has no {split} shard: list one in {TOKENS_META} or name it {split}*.bin"
            )
    digest = hashlib.sha256(json.dumps([vocab, dtype.name]).encode())
    sha_of = {(e["split"], Path(str(e["path"])).name): e.get("sha256") for e in entries}
    for split in SPLITS:
        for s in shards[split]:
            digest.update(f"\0{split}\0{s.name}\0".encode())
            _scan(s, vocab, sha_of.get((split, s.name)), digest)
    return TokenFiles(
        f"tokens:{p}",
        p,
        vocab,
        dtype.name,
        shards["train"],
        shards["val"],
        digest.hexdigest(),
        meta,
    )
