"""LM data: byte corpora (vocabulary 256), token-file corpora, deterministic batches.

Sources: :mod:`fp8jax.data.corpus` (bytes: stdlib, text, synthetic),
:mod:`fp8jax.data.tokens` (``uint16`` / ``uint32`` token shards); batches:
:mod:`fp8jax.data.batches`; the background loader: :mod:`fp8jax.data.loader`;
``fp8jax data prepare``: :mod:`fp8jax.data.prepare`.
"""

from fp8jax.data.batches import check_corpus, describe_val_set, train_batch, val_batches
from fp8jax.data.corpus import (
    VOCAB_SIZE,
    Corpus,
    load_corpus,
    stdlib_corpus,
    synthetic_corpus,
    text_corpus,
)
from fp8jax.data.shards import DataError
from fp8jax.data.tokens import TokenFiles, load_tokens

__all__ = [
    "VOCAB_SIZE",
    "Corpus",
    "DataError",
    "TokenFiles",
    "check_corpus",
    "describe_val_set",
    "load_corpus",
    "load_tokens",
    "stdlib_corpus",
    "synthetic_corpus",
    "text_corpus",
    "train_batch",
    "val_batches",
]
