"""Deterministic batches from any corpus: a pure function of (seed, step, rows).

A corpus (bytes: :mod:`fp8jax.data.corpus`; token files:
:mod:`fp8jax.data.tokens`) exposes ``train_shards`` and ``val_shards``
(:mod:`fp8jax.data.shards`), ``name``, ``unit`` and ``vocab_size``.

Training rows: ``batch_size`` row starts drawn uniformly (with replacement)
over every row start of every train shard, by a generator seeded with
``(seed, step)``.  A process that feeds only some rows of the global batch
(``rows``) draws the same starts and reads only its own rows, so N processes
read disjoint 1/N parts of the batch one process would read, and a resumed run
reads exactly the batches of an uninterrupted one.

Validation rows: evenly spaced row starts over the validation shards, no
randomness: the same set for every run, recipe and seed on that corpus.
"""

from __future__ import annotations

import hashlib
from typing import Protocol

import numpy as np

from fp8jax.data.shards import Shard, read_rows, row_counts


class TokenCorpus(Protocol):
    name: str
    unit: str
    vocab_size: int

    @property
    def train_shards(self) -> list[Shard]: ...

    @property
    def val_shards(self) -> list[Shard]: ...


def check_corpus(corpus: TokenCorpus, length: int, batch_size: int = 1) -> None:
    """Raise ValueError (one line with the fix) unless ``corpus`` holds rows of ``length``.

    Every shard needs more than ``length`` tokens (a row never crosses a
    shard), and the train split at least one batch of ``batch_size`` rows.
    """
    short = [
        f"{s.name} {s.size} {corpus.unit}"
        for s in [*corpus.train_shards, *corpus.val_shards]
        if s.size < length + 1
    ]
    if short:
        raise ValueError(
            f"corpus {corpus.name!r} is too small for seq_len {length}: "
            f"{', '.join(short[:4])}{' ...' if len(short) > 4 else ''} (each needs more than "
            f"{length}); give a larger corpus (--config.data.path) or a smaller --config.seq_len"
        )
    n_train = sum(s.size for s in corpus.train_shards)
    if n_train < batch_size * length:
        raise ValueError(
            f"corpus {corpus.name!r} holds {n_train} training {corpus.unit}, fewer than one "
            f"batch of {batch_size} rows x {length}; give a larger corpus or a smaller "
            "--config.batch_size / --config.seq_len"
        )


def train_batch(
    corpus: TokenCorpus,
    step: int,
    batch_size: int,
    length: int,
    seed: int,
    rows: tuple[int, int] | None = None,
) -> np.ndarray:
    """Tokens int32 [hi - lo, length]: rows ``lo:hi`` (default all) of ``step``'s batch.

    A pure function of (seed, step, rows); a model predicts tokens[:, 1:]
    from the prefixes, i.e. ``length - 1`` predictions per row.
    """
    shards = corpus.train_shards
    total = int(row_counts(shards, length).sum())
    if total <= 0 or length < 2:
        raise ValueError(f"train split of {corpus.name!r} too short for length {length}")
    rng = np.random.default_rng([seed, step])
    positions = rng.integers(0, total, size=batch_size)
    lo, hi = (0, batch_size) if rows is None else rows
    return read_rows(shards, positions[lo:hi], length)


def val_batches(corpus: TokenCorpus, n_batches: int, batch_size: int, length: int) -> np.ndarray:
    """The fixed validation set int32 [n_batches, batch_size, length]: evenly spaced rows."""
    shards = corpus.val_shards
    total = int(row_counts(shards, length).sum())
    if total <= 0 or length < 2:
        raise ValueError(f"validation split of {corpus.name!r} too short for length {length}")
    positions = np.linspace(0, total - 1, n_batches * batch_size).astype(np.int64)
    return read_rows(shards, positions, length).reshape(n_batches, batch_size, length)


def describe_val_set(corpus: TokenCorpus, batches: np.ndarray) -> dict:
    """What names a validation set in the results: its source, shape and a SHA-256 of its tokens."""
    n_batches, batch_size, length = batches.shape
    return {
        "corpus": corpus.name,
        "shards": [s.name for s in corpus.val_shards][:16],
        "rows": int(n_batches * batch_size),
        "seq_len": int(length),
        "predicted_tokens": int(n_batches * batch_size * (length - 1)),
        "sha256": hashlib.sha256(np.ascontiguousarray(batches, "<i4").tobytes()).hexdigest(),
    }
