"""Byte-level data: corpora, deterministic split, batches that depend only on (seed, step)."""

import hashlib

import numpy as np
import pytest

from fp8jax.data import corpus as data


def test_stdlib_corpus_is_deterministic_sorted_and_split_by_file():
    a = data.stdlib_corpus(max_bytes=2_000_000)
    b = data.stdlib_corpus(max_bytes=2_000_000)
    assert a.sha256 == b.sha256
    np.testing.assert_array_equal(a.train, b.train)
    np.testing.assert_array_equal(a.val, b.val)
    assert a.train.dtype == np.uint8 and a.val.size > 0 and a.train.size > 10 * a.val.size // 2
    # Independent reconstruction: sorted files, per-file sha256(path) split.
    root = data.stdlib_root()
    files = data.files_under(root, data.STDLIB_SUFFIXES)
    assert [str(f) for f in files] == sorted(str(f) for f in files)
    train, val, total = [], [], 0
    for f in files:
        blob = f.read_bytes()
        if not blob:
            continue
        if total + len(blob) > 2_000_000 and total > 0:
            break
        rel = f.relative_to(root).as_posix()
        h = int.from_bytes(hashlib.sha256(rel.encode()).digest()[:8], "big") / 2.0**64
        (val if h < 0.05 else train).append(blob)
        total += len(blob)
    assert bytes(a.train) == b"".join(train)
    assert bytes(a.val) == b"".join(val)
    assert a.train.size + a.val.size <= 2_000_000


def test_text_file_and_folder(tmp_path):
    f = tmp_path / "a.txt"
    f.write_bytes((bytes(range(32, 128)) * 30)[:2560])
    c = data.load_corpus("text", path=str(f), val_fraction=0.1)
    assert c.train.size == 2304 and c.val.size == 256
    assert bytes(c.train) + bytes(c.val) == f.read_bytes()
    d = tmp_path / "dir"
    d.mkdir()
    for i in range(40):
        (d / f"f{i:02d}.txt").write_text(f"file {i}\n" * 5)
    c2 = data.load_corpus("text", path=str(d), val_fraction=0.2)
    assert c2.n_files == 40
    assert c2.train.size + c2.val.size == sum(len(p.read_bytes()) for p in d.iterdir())
    with pytest.raises(FileNotFoundError):
        data.load_corpus("text", path=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="needs data.path"):
        data.load_corpus("text")
    with pytest.raises(ValueError, match="unknown data source"):
        data.load_corpus("web")


def test_synthetic_is_seeded_and_low_entropy():
    a = data.synthetic_corpus(20_000, seed=3)
    b = data.synthetic_corpus(20_000, seed=3)
    c = data.synthetic_corpus(20_000, seed=4)
    np.testing.assert_array_equal(a.train, b.train)
    assert not np.array_equal(a.train, c.train)
    s = np.concatenate([a.train, a.val])
    assert s.min() >= 32 and s.max() < 64
    # Conditional entropy given two previous bytes <= log2(4) = 2 bits (4 candidates).
    ctx = s[:-2].astype(np.int64) * 256 + s[1:-1]
    pairs = ctx * 256 + s[2:]
    _, counts_pair = np.unique(pairs, return_counts=True)
    _, counts_ctx = np.unique(ctx, return_counts=True)
    h = -(counts_pair * np.log2(counts_pair)).sum() + (counts_ctx * np.log2(counts_ctx)).sum()
    assert h / (s.size - 2) <= 2.0


def test_batches_are_a_function_of_seed_and_step():
    c = data.synthetic_corpus(10_000, seed=0)
    b1 = data.train_batch(c, 7, 4, 33, seed=1)
    b2 = data.train_batch(c, 7, 4, 33, seed=1)
    b3 = data.train_batch(c, 8, 4, 33, seed=1)
    assert b1.shape == (4, 33) and b1.dtype == np.int32
    np.testing.assert_array_equal(b1, b2)
    assert not np.array_equal(b1, b3)
    # Every row is a contiguous window of the train stream.
    stream = bytes(c.train)
    for row in b1:
        assert bytes(row.astype(np.uint8)) in stream
    v = data.val_batches(c, 3, 2, 17)
    assert v.shape == (3, 2, 17)
    np.testing.assert_array_equal(v, data.val_batches(c, 3, 2, 17))
    assert bytes(v[0, 0].astype(np.uint8)) == bytes(c.val[:17])
    assert bytes(v[-1, -1].astype(np.uint8)) == bytes(c.val[-17:])
    with pytest.raises(ValueError):
        data.train_batch(c, 0, 2, c.train.size + 1, seed=0)


def test_check_corpus_names_the_short_stream_and_the_fix():
    c = data.synthetic_corpus(2_000, seed=0, val_fraction=0.05)  # 100 validation bytes
    data.check_corpus(c, 64)
    with pytest.raises(ValueError, match="validation 100 bytes") as info:
        data.check_corpus(c, 100)
    msg = str(info.value)
    assert "train" not in msg.split(":")[1] and "--config.seq_len" in msg and "\n" not in msg
    tiny = data.Corpus("t", np.zeros(10, np.uint8), np.zeros(3, np.uint8), 1, "")
    with pytest.raises(ValueError, match="train 10 bytes, validation 3 bytes"):
        data.check_corpus(tiny, 16)
