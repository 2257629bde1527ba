"""Byte-level LM data (vocabulary 256): corpora and deterministic batches."""

from fp8jax.data.corpus import (
    VOCAB_SIZE,
    Corpus,
    load_corpus,
    stdlib_corpus,
    synthetic_corpus,
    text_corpus,
    train_batch,
    val_batches,
)

__all__ = [
    "VOCAB_SIZE",
    "Corpus",
    "load_corpus",
    "stdlib_corpus",
    "synthetic_corpus",
    "text_corpus",
    "train_batch",
    "val_batches",
]
