"""Batches: a pure function of (seed, step, rows); processes read disjoint parts of the
one-process batch; a byte corpus gives uniform windows drawn by (seed, step); the validation set
is fixed and named by the SHA-256 of its tokens."""

import hashlib

import numpy as np
import pytest
from data_files import random_tokens

from fp8jax.data import describe_val_set, load_tokens, synthetic_corpus, train_batch, val_batches


def test_rows_of_n_processes_are_disjoint_parts_of_the_one_process_batch(tmp_path):
    c = load_tokens(random_tokens(tmp_path / "t", sizes=(700, 900, 300)))
    for step in (0, 5, 123):
        whole = train_batch(c, step, 8, 17, seed=2)
        for n_proc in (2, 4, 8):
            per = 8 // n_proc
            parts = [
                train_batch(c, step, 8, 17, seed=2, rows=(p * per, (p + 1) * per))
                for p in range(n_proc)
            ]
            assert all(part.shape == (per, 17) for part in parts)
            np.testing.assert_array_equal(np.concatenate(parts), whole)
    assert not np.array_equal(train_batch(c, 1, 8, 17, 2), train_batch(c, 2, 8, 17, 2))
    assert not np.array_equal(train_batch(c, 1, 8, 17, 2), train_batch(c, 1, 8, 17, 3))


def test_byte_corpus_batches_are_uniform_windows_drawn_by_seed_and_step():
    # Independent reconstruction: starts ~ U{0..n} from default_rng([seed, step]).
    c = synthetic_corpus(5_000, seed=1)
    stream = np.asarray(c.train, np.int64)
    for step in (0, 9):
        starts = np.random.default_rng([4, step]).integers(0, stream.size - 33 + 1, size=6)
        ref = np.stack([stream[s : s + 33] for s in starts])
        np.testing.assert_array_equal(train_batch(c, step, 6, 33, seed=4), ref)


def test_validation_set_is_evenly_spaced_and_named_by_its_tokens(tmp_path):
    c = load_tokens(random_tokens(tmp_path / "t", val=(100, 60)))
    v = val_batches(c, 2, 3, 11)
    starts = np.linspace(0, (100 - 10) + (60 - 10) - 1, 6).astype(np.int64)
    vals = [np.fromfile(s.path, np.uint16).astype(np.int64) for s in c.val_shards]
    ref = [vals[0][s : s + 11] if s < 90 else vals[1][s - 90 : s - 90 + 11] for s in starts]
    np.testing.assert_array_equal(v.reshape(6, 11), np.stack(ref))
    d = describe_val_set(c, v)
    assert d["rows"] == 6 and d["seq_len"] == 11 and d["predicted_tokens"] == 60
    assert d["shards"] == ["val-00000.bin", "val-00001.bin"]
    assert d["sha256"] == hashlib.sha256(v.astype("<i4").tobytes()).hexdigest()
    assert describe_val_set(c, val_batches(c, 2, 3, 11)) == d


def test_a_split_without_a_row_is_refused():
    c = synthetic_corpus(2_000, seed=0)
    with pytest.raises(ValueError, match="too short"):
        train_batch(c, 0, 2, c.train.size + 1, seed=0)
    with pytest.raises(ValueError, match="too short"):
        val_batches(c, 1, 2, c.val.size + 1)
