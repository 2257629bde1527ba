"""Documents from text, JSONL, Parquet and ArrayRecord files; binary and token files are
refused as text in one line; the byte-level text corpus reads shards' documents."""

import json

import numpy as np
import pytest
from data_files import random_tokens

from fp8jax.data import DataError, load_corpus
from fp8jax.data import documents as docs


def _texts():
    return ["first doc\nwith two lines", "second: ünïcödé", "third"]


def test_each_format_gives_its_documents_in_order(tmp_path):
    texts = _texts()
    j = tmp_path / "a.jsonl"
    j.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)))
    assert list(docs.documents(j)) == texts
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    p = tmp_path / "a.parquet"
    pq.write_table(pa.table({"body": texts, "n": [1, 2, 3]}), p)
    assert list(docs.documents(p, field="body")) == texts
    ar = pytest.importorskip("array_record.python.array_record_module")
    a = tmp_path / "a.array_record"
    w = ar.ArrayRecordWriter(str(a), "group_size:1")
    w.write(texts[0].encode())
    w.write(json.dumps({"text": texts[1]}).encode())
    w.write(texts[2].encode())
    w.close()
    assert list(docs.documents(a)) == texts


def test_a_text_file_comes_in_pieces_cut_after_newlines(tmp_path, monkeypatch):
    monkeypatch.setattr(docs, "PIECE_BYTES", 10)
    f = tmp_path / "a.txt"
    f.write_text("0123456789abc\nxy\n" + "é" * 20 + "\nend")
    pieces = list(docs.documents(f))
    assert "".join(pieces) == f.read_text()
    assert pieces[0] == "0123456789abc\n" and all(p.endswith("\n") for p in pieces[:-1])
    # A bad byte is reported at its offset in the file, not in its piece.
    f.write_bytes(b"0123456789abc\nxy\n" + b"z" * 8 + b"\xff\n")
    with pytest.raises(DataError, match=r"not UTF-8 text \(byte 25\)"):
        list(docs.documents(f))


def test_a_line_longer_than_the_largest_piece_is_cut_between_characters(tmp_path, monkeypatch):
    monkeypatch.setattr(docs, "PIECE_BYTES", 10)
    monkeypatch.setattr(docs, "MAX_PIECE_BYTES", 32)
    f = tmp_path / "a.txt"
    # One line of 2-byte characters with a 3-byte one among them, then short lines.
    text = "é" * 30 + "€" + "é" * 30 + "\nshort\n" + "x" * 5 + "\nend"
    f.write_text(text)
    pieces = list(docs.documents(f))
    assert "".join(pieces) == text
    assert all(len(p.encode()) <= 32 + 3 for p in pieces) and len(pieces) > 3
    assert pieces[-1].endswith("end")


@pytest.mark.parametrize(
    "name, content, match",
    [
        ("x.jsonl", b'{"text": "a"}\nnot json\n', r"x.jsonl:2 is not a JSON object"),
        ("y.jsonl", b'{"body": "a"}\n', r"y.jsonl:1 has no string field 'text'"),
        ("z.txt", b"abc\x00def", "is binary"),
        ("w.txt", b"abc\xff\xfe", r"is not UTF-8 text \(byte 3\)"),
        ("v.parquet", b"PAR1 not really", "not a readable Parquet file"),
    ],
)
def test_bad_documents_are_one_line(tmp_path, name, content, match):
    f = tmp_path / name
    f.write_bytes(content)
    with pytest.raises(DataError, match=match) as e:
        list(docs.documents(f))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("size", [1000, 70_000])
def test_a_garbage_array_record_file_is_one_line_naming_it(tmp_path, size):
    pytest.importorskip("array_record.python.array_record_module")
    f = tmp_path / "a.array_record"
    f.write_bytes(np.random.default_rng(0).integers(0, 256, size, np.uint8).tobytes())
    with pytest.raises(DataError) as e:
        list(docs.documents(f))
    msg = str(e.value)
    assert msg.startswith(f"{f} is not a readable ArrayRecord file") and "\n" not in msg
    # Stopping early (the consumer gone) lets the reader go without an error.
    good = tmp_path / "b.array_record"
    ar = pytest.importorskip("array_record.python.array_record_module")
    w = ar.ArrayRecordWriter(str(good), "group_size:1")
    for t in _texts():
        w.write(t.encode())
    w.close()
    it = docs.documents(good)
    assert next(it) == _texts()[0]
    it.close()


def test_text_source_refuses_token_files_and_binary_files(tmp_path):
    root = random_tokens(tmp_path / "tok")
    for path in (root, root / "train-00000.bin", root / "tokens.json"):
        with pytest.raises(DataError, match="--config.data.source=tokens") as e:
            load_corpus("text", path=str(path))
        assert "\n" not in str(e.value)
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "a.txt").write_text("hello\n" * 100)
    (mixed / "b.dat").write_bytes(np.arange(100, dtype=np.uint16).tobytes())
    with pytest.raises(DataError, match="b.dat is binary"):
        load_corpus("text", path=str(mixed))


def test_text_corpus_reads_the_documents_of_shards(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    (d / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in _texts()))
    (d / "b.txt").write_text("plain " * 50)
    c = load_corpus("text", path=str(d), val_fraction=0.5)
    a = "\n".join(_texts()).encode()
    b = ("plain " * 50).encode()
    got = (bytes(c.train), bytes(c.val))
    # Split per file (both splits non-empty), or, with every file on one side, by bytes.
    assert got in ((a, b), (b, a)) or got[0] + got[1] == a + b
    assert b'{"text"' not in got[0] + got[1]
