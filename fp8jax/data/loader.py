"""The training input pipeline: Grain reading a run's batches ahead of the step.

Record ``i`` of the Grain source is the batch of step ``i``
(:func:`fp8jax.data.batches.train_batch`, this process's rows only), so the
pipeline holds no state worth checkpointing: a run resumed at step ``k``
slices the source at ``k`` and reads exactly the batches an uninterrupted
run reads.  Grain's read threads fetch the next batches while the device
runs the current step; a read error (an unreadable shard) surfaces, with its
one-line message, at the step that needs the batch.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from fp8jax.data.batches import TokenCorpus, train_batch

# Batches read ahead of the step, and the threads that read them: one batch
# is a few hundred small reads, so one thread keeps up with the step; two
# hide a slow disk's latency without taking a core from XLA on small machines.
PREFETCH_BATCHES = 4
READ_THREADS = 2


class StepBatches:
    """Random-access source for Grain: item ``step`` is that step's rows of this process."""

    def __init__(
        self,
        corpus: TokenCorpus,
        steps: int,
        batch_size: int,
        length: int,
        seed: int,
        rows: tuple[int, int] | None = None,
    ):
        self.corpus, self.steps = corpus, steps
        self.batch_size, self.length, self.seed, self.rows = batch_size, length, seed, rows

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, step: int) -> np.ndarray:
        return train_batch(
            self.corpus, int(step), self.batch_size, self.length, self.seed, self.rows
        )


def train_batches(
    corpus: TokenCorpus,
    start: int,
    end: int,
    batch_size: int,
    length: int,
    seed: int,
    rows: tuple[int, int] | None = None,
) -> Iterator[np.ndarray]:
    """The batches of steps ``start .. end - 1`` in order, read ahead by Grain."""
    import grain  # imported here: only training needs it (about 1.5 s to import)

    source = StepBatches(corpus, end, batch_size, length, seed, rows)
    ds = grain.MapDataset.source(source)[start:end]
    options = grain.ReadOptions(num_threads=READ_THREADS, prefetch_buffer_size=PREFETCH_BATCHES)
    return iter(ds.to_iter_dataset(options))
