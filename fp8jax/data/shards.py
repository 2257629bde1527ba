"""Token shards: where rows of tokens are read from.

A split (train or validation) is a list of shards; a row is ``length``
consecutive tokens of one shard (rows never cross a shard boundary, so a
shard boundary may fall anywhere, e.g. between two unrelated corpora).

* :class:`MemoryShard`: an array in memory (the byte corpora).
* :class:`FileShard`: a raw ``uint16`` / ``uint32`` token file read with
  positioned reads (``os.pread``): only the rows asked for are read, the OS
  page cache does the caching, and a shard that is deleted, truncated or
  unreadable while a run reads it raises :class:`DataError` naming the file
  (a memory map would turn a truncated file into SIGBUS, which kills the
  process without a word).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np


class DataError(ValueError):
    """Bad or unreadable data: the message is one line naming the file and the fix."""


class Shard(Protocol):
    name: str

    @property
    def size(self) -> int: ...

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray: ...


@dataclass(frozen=True)
class MemoryShard:
    """Tokens held in memory (any integer dtype)."""

    name: str
    tokens: np.ndarray

    @property
    def size(self) -> int:
        return int(self.tokens.size)

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        idx = np.asarray(starts, np.int64)[:, None] + np.arange(length)[None, :]
        # int32 tokens: what the embedding lookup expects.
        return self.tokens[idx].astype(np.int32)


@dataclass(frozen=True)
class FileShard:
    """A file of ``n_tokens`` little-endian ``dtype`` tokens, read row by row."""

    name: str
    path: Path
    dtype: np.dtype
    n_tokens: int

    @property
    def size(self) -> int:
        return self.n_tokens

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        item = self.dtype.itemsize
        nbytes = length * item
        out = np.empty((len(starts), length), np.int32)
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError as e:
            raise DataError(
                f"token shard {self.path} became unreadable ({e.strerror}); restore it and "
                "resume from the workdir"
            ) from None
        try:
            for i, s in enumerate(np.asarray(starts, np.int64).tolist()):
                blob = os.pread(fd, nbytes, s * item)
                if len(blob) != nbytes:
                    raise DataError(
                        f"token shard {self.path} is shorter than its {self.n_tokens} tokens "
                        "(truncated while in use); restore it and resume from the workdir"
                    )
                out[i] = np.frombuffer(blob, self.dtype)
        except OSError as e:
            raise DataError(
                f"token shard {self.path} became unreadable ({e.strerror}); restore it and "
                "resume from the workdir"
            ) from None
        finally:
            os.close(fd)
        return out


def row_counts(shards: list[Shard], length: int) -> np.ndarray:
    """Number of row starts in each shard (``size - length + 1``, at least 0)."""
    return np.maximum(np.asarray([s.size for s in shards], np.int64) - length + 1, 0)


def read_rows(shards: list[Shard], positions: np.ndarray, length: int) -> np.ndarray:
    """Rows int32 [len(positions), length] at global row-start ``positions``.

    Position ``g`` counts the row starts of all shards in order: the first
    ``row_counts[0]`` positions lie in shard 0, the next ones in shard 1, ...
    With one shard a position is the row's first token.
    """
    counts = row_counts(shards, length)
    ends = np.cumsum(counts)
    positions = np.asarray(positions, np.int64)
    which = np.searchsorted(ends, positions, side="right")
    offsets = positions - (ends[which] - counts[which])
    out = np.empty((positions.size, length), np.int32)
    for k in np.unique(which).tolist():
        sel = which == k
        out[sel] = shards[k].windows(offsets[sel], length)
    return out
