"""Token directories: shards found or listed, rows read back exactly, every kind of bad
data refused in one line naming the shard, and a fingerprint that follows the bytes."""

import json
import re

import numpy as np
import pytest
from data_files import random_tokens, write_tokens

from fp8jax.data import DataError, check_corpus, load_corpus, load_tokens, train_batch
from fp8jax.data.shards import read_rows


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_listed_and_found_shards_read_back_the_written_tokens(tmp_path):
    rng = np.random.default_rng(1)
    a, b, v = (rng.integers(0, 70_000, n) for n in (300, 200, 150))
    for listed in (True, False):
        root = write_tokens(
            tmp_path / str(listed), {"train": [a, b], "val": [v]}, 70_000, "uint32", listed=listed
        )
        c = load_corpus("tokens", path=str(root))
        assert c.vocab_size == 70_000 and c.dtype == "uint32" and c.unit == "tokens"
        assert [s.name for s in c.train_shards] == ["train-00000.bin", "train-00001.bin"]
        assert [s.size for s in c.train_shards] == [300, 200]
        # Global row starts count shard 0's 300 - 10 + 1 starts first, then shard 1's.
        rows = read_rows(c.train_shards, np.array([0, 290, 291, 291 + 190]), 10)
        np.testing.assert_array_equal(rows[0], a[:10])
        np.testing.assert_array_equal(rows[1], a[290:300])
        np.testing.assert_array_equal(rows[2], b[:10])
        np.testing.assert_array_equal(rows[3], b[190:200])
        assert rows.dtype == np.int32
        # tokens.json itself names the directory too.
        assert load_tokens(root / "tokens.json").sha256 == c.sha256


def test_training_rows_are_windows_of_one_shard(tmp_path):
    c = load_tokens(random_tokens(tmp_path / "t", sizes=(40, 45)))
    streams = [np.fromfile(s.path, np.uint16) for s in c.train_shards]
    for step in range(20):
        for row in train_batch(c, step, 8, 33, seed=3):
            hits = [
                any(np.array_equal(row, s[i : i + 33]) for i in range(s.size - 32)) for s in streams
            ]
            assert any(hits)


def test_fingerprint_changes_with_any_byte_and_with_the_split(tmp_path):
    root = random_tokens(tmp_path / "t")
    sha = load_tokens(root).sha256
    assert load_tokens(root).sha256 == sha
    blob = bytearray((root / "train-00001.bin").read_bytes())
    blob[100] ^= 1
    (root / "train-00001.bin").write_bytes(bytes(blob))
    assert load_tokens(root).sha256 != sha
    # The same bytes moved from train to validation are another corpus.
    meta = json.loads((root / "tokens.json").read_text())
    meta["shards"][1]["split"] = "val"
    (root / "tokens.json").write_text(json.dumps(meta))
    assert load_tokens(root).sha256 != sha


@pytest.mark.parametrize(
    "damage, match",
    [
        ("id_at_vocab", "holds id 500 .* not below the vocabulary size 500"),
        ("truncated", "holds 5999 bytes, not 3000 tokens of uint16"),
        ("odd_bytes", "not a whole number of uint16 tokens"),
        ("mixed_dtypes", "mixed dtypes across shards: train-00001.bin is uint32"),
        ("missing", "train-00001.bin is unreadable"),
        ("sha", "differs from the sha256"),
        ("no_val", "has no val shard"),
        ("no_meta", "has no tokens.json"),
        ("bad_dtype", "dtype must be one of"),
        ("vocab_too_big", r"vocab_size must be an integer in \[2, 65536\]"),
        ("outside", "lies outside"),
    ],
)
def test_bad_token_data_is_one_line_naming_the_shard(tmp_path, damage, match):
    root = random_tokens(tmp_path / "t", vocab=500)
    meta = json.loads((root / "tokens.json").read_text())
    if damage == "id_at_vocab":
        ids = np.fromfile(root / "train-00001.bin", np.uint16)
        ids[7] = 500
        ids.tofile(root / "train-00001.bin")
    elif damage == "truncated":
        (root / "train-00000.bin").write_bytes((root / "train-00000.bin").read_bytes()[:-1])
    elif damage == "odd_bytes":
        del meta["shards"]  # sizes then come from the files alone
        (root / "train-00000.bin").write_bytes((root / "train-00000.bin").read_bytes()[:-1])
    elif damage == "mixed_dtypes":
        meta["shards"][1]["dtype"] = "uint32"
    elif damage == "missing":
        (root / "train-00001.bin").unlink()
    elif damage == "sha":
        meta["shards"][0]["sha256"] = "0" * 64
    elif damage == "no_val":
        meta["shards"] = [s for s in meta["shards"] if s["split"] == "train"]
    elif damage == "no_meta":
        (root / "tokens.json").unlink()
    elif damage == "bad_dtype":
        meta["dtype"] = "int8"
    elif damage == "vocab_too_big":
        meta["vocab_size"] = 65537
    elif damage == "outside":
        meta["shards"][0]["path"] = "../elsewhere.bin"
    if (root / "tokens.json").exists():
        (root / "tokens.json").write_text(json.dumps(meta))
    with pytest.raises(DataError) as e:
        load_tokens(root)
    assert re.search(match, _one_line(e))


def test_short_shard_and_small_corpus_are_refused_with_the_fix(tmp_path):
    c = load_tokens(random_tokens(tmp_path / "a", sizes=(3000, 40)))
    check_corpus(c, 39, 4)
    with pytest.raises(ValueError) as e:
        check_corpus(c, 40, 4)
    assert "train-00001.bin 40 tokens" in _one_line(e) and "--config.seq_len" in str(e.value)
    small = load_tokens(random_tokens(tmp_path / "b", sizes=(100,), val=(100,)))
    check_corpus(small, 10, 10)
    with pytest.raises(ValueError) as e:
        check_corpus(small, 10, 11)
    assert "holds 100 training tokens, fewer than one batch of 11 rows x 10" in _one_line(e)


def test_a_file_or_a_missing_directory_is_not_a_token_directory(tmp_path):
    root = random_tokens(tmp_path / "t")
    with pytest.raises(DataError, match="give the directory that holds it"):
        load_tokens(root / "train-00000.bin")
    with pytest.raises(DataError, match="does not exist"):
        load_tokens(tmp_path / "nope")
