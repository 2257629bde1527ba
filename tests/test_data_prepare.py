"""fp8jax data prepare: a BPE tokenizer trained here, token shards that decode back to the
source, a deterministic split, a reused tokenizer giving the same ids, and output that
appears complete or not at all."""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest

pytest.importorskip("tokenizers")

from fp8jax.data import DataError, load_tokens  # noqa: E402
from fp8jax.data import prepare as prep  # noqa: E402
from fp8jax.toolkit.cli import main  # noqa: E402


def _corpus(root, n=40):
    root.mkdir()
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "scale", "tile", "block", "amax", "448"]
    texts = []
    for i in range(n):
        t = " ".join(rng.choice(words, 60)) + f"\ndocument {i}\n"
        (root / f"d{i:03d}.txt").write_text(t)
        texts.append(t)
    return texts


def test_prepare_writes_shards_that_decode_to_the_source(tmp_path):
    from tokenizers import Tokenizer

    texts = _corpus(tmp_path / "src")
    rep = prep.prepare(
        tmp_path / "src",
        tmp_path / "out",
        vocab=300,
        shard_tokens=500,
        val_fraction=0.1,
        quiet=True,
    )
    c = load_tokens(tmp_path / "out")
    meta = json.loads((tmp_path / "out" / "tokens.json").read_text())
    assert c.vocab_size == rep.vocab_size <= 300 and c.dtype == "uint16"
    assert rep.documents == 40 and meta["documents"] == 40
    tok = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    eot = tok.token_to_id(prep.EOT)
    assert meta["eot_id"] == eot
    # Split: documents k with floor((k + 1) / 10) > floor(k / 10) -> 9, 19, 29, 39.
    streams = {
        split: np.concatenate([np.fromfile(s.path, np.uint16) for s in shards])
        for split, shards in (("train", c.train_shards), ("val", c.val_shards))
    }
    for split, want in (
        ("train", [t for k, t in enumerate(texts) if k % 10 != 9]),
        ("val", [t for k, t in enumerate(texts) if k % 10 == 9]),
    ):
        ids = streams[split].tolist()
        docs, cur = [], []
        for i in ids:
            if i == eot:
                docs.append(tok.decode(cur))
                cur = []
            else:
                cur.append(i)
        assert cur == [] and docs == want
    # Shards roll over at document boundaries past 500 tokens; none but a lone one under 250.
    sizes = [s.size for s in c.train_shards]
    assert len(sizes) > 2 and all(n >= 250 for n in sizes)
    assert all(np.fromfile(s.path, np.uint16)[-1] == eot for s in c.train_shards)


def test_a_reused_tokenizer_gives_the_same_ids_and_jsonl_reads_like_text(tmp_path):
    texts = _corpus(tmp_path / "src")
    prep.prepare(tmp_path / "src", tmp_path / "a", vocab=300, quiet=True)
    j = tmp_path / "j"
    j.mkdir()
    (j / "all.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    prep.prepare(j, tmp_path / "b", tokenizer=tmp_path / "a" / "tokenizer.json", quiet=True)
    a, b = load_tokens(tmp_path / "a"), load_tokens(tmp_path / "b")
    assert a.sha256 == b.sha256


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(vocab=100), "below 257"),
        (dict(vocab=300, tokenizer="x"), "either --vocab"),
        (dict(vocab=300, val_fraction=0.01), "holds one back for validation only from 100 "),
        (dict(vocab=10**9), "above the largest accepted, 1,048,576"),
        (dict(vocab=10**20), "above the largest accepted, 1,048,576"),
        (dict(tokenizer="/nonexistent/tok.json"), "is unreadable"),
    ],
)
def test_mistakes_are_one_line_and_leave_nothing(tmp_path, kwargs, match):
    _corpus(tmp_path / "src")
    with pytest.raises(DataError, match=match) as e:
        prep.prepare(tmp_path / "src", tmp_path / "out", quiet=True, **kwargs)
    assert "\n" not in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_vocab_beyond_what_the_text_gives_and_empty_text_are_refused_before_training(
    tmp_path, monkeypatch
):
    def never(*args):
        raise AssertionError("the tokenizer was trained")

    monkeypatch.setattr(prep, "train_tokenizer", never)
    (tmp_path / "a.txt").write_text("hi\n")
    with pytest.raises(DataError, match=r"needs 743 merges, more than the 3 bytes .*--vocab 260"):
        prep.prepare(tmp_path / "a.txt", tmp_path / "out", vocab=1000, quiet=True)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "e.txt").write_text("")
    for kwargs in (dict(vocab=300), dict(tokenizer="unused.json")):
        with pytest.raises(DataError, match="holds no text: its 1 file"):
            prep.prepare(tmp_path / "empty", tmp_path / "out", quiet=True, **kwargs)
    monkeypatch.undo()
    with pytest.raises(DataError, match="one document cannot be split"):
        prep.prepare(tmp_path / "a.txt", tmp_path / "out", vocab=260, quiet=True)
    assert not (tmp_path / "out").exists()


def test_an_over_long_word_is_cut_so_training_stays_linear(tmp_path, capsys):
    from tokenizers import Tokenizer

    # One "word" of 300 KB: letters without a space (quadratic BPE time uncut).
    rng = np.random.default_rng(0)
    word = "".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), 300_000))
    pieces = prep.pre_tokenizer().pre_tokenize_str("a short line\n" + word + " " * 500)
    assert max(len(p) for p, _ in pieces) == prep.MAX_WORD_BYTES
    # Ordinary words are not touched: the pre-tokens of GPT-2's byte-level step.
    assert [p for p, _ in pieces[:4]] == ["a", "Ġshort", "Ġline", "Ċ"]
    src = tmp_path / "src"
    src.mkdir()
    for i in range(20):
        (src / f"{i:02d}.txt").write_text(word[i * 15_000 : (i + 1) * 15_000])
    rep = prep.prepare(src, tmp_path / "out", vocab=400, progress_stream=sys.stdout)
    tok = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    assert max(len(t) for t in tok.get_vocab()) <= prep.MAX_WORD_BYTES
    ids = np.fromfile(load_tokens(tmp_path / "out").train_shards[0].path, np.uint16)
    first = ids[: list(ids).index(tok.token_to_id(prep.EOT))]
    assert tok.decode(first.tolist()) == word[:15_000] and rep.documents == 20
    # The merges are announced once the text is read (they take a while on a large corpus).
    assert "train BPE: 20 documents read; computing 143 merges ..." in capsys.readouterr().out


def test_destination_inside_source_or_not_empty_is_refused(tmp_path):
    _corpus(tmp_path / "src")
    with pytest.raises(DataError, match="inside the source"):
        prep.prepare(tmp_path / "src", tmp_path / "src" / "out", vocab=300, quiet=True)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(DataError, match="not an empty directory"):
        prep.prepare(tmp_path / "src", tmp_path / "full", vocab=300, quiet=True)


def test_cli_prepare_prints_the_training_flags_and_mistakes_exit_2(tmp_path, capsys):
    _corpus(tmp_path / "src")
    assert (
        main(
            [
                "data",
                "prepare",
                str(tmp_path / "src"),
                str(tmp_path / "o"),
                "--vocab",
                "300",
                "--quiet",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert f"--config.data.source=tokens --config.data.path={tmp_path / 'o'}" in out
    assert main(["data", "info", str(tmp_path / "o")]) == 0
    assert json.loads(capsys.readouterr().out)["vocab_size"] <= 300
    assert (
        main(["data", "prepare", str(tmp_path / "o"), str(tmp_path / "p"), "--vocab", "300"]) == 2
    )
    err = capsys.readouterr().err
    assert "is a token directory" in err and len(err.strip().splitlines()) == 1
    assert main(["data", "info", str(tmp_path / "src")]) == 2
    assert "has no tokens.json" in capsys.readouterr().err


_SLOW_PREPARE = textwrap.dedent(
    """
    import sys, time
    from fp8jax.data import prepare as prep
    real = prep._ShardWriter.write
    def slow(self, ids):
        real(self, ids)
        print("WRITING", flush=True)
        time.sleep(0.2)
    prep._ShardWriter.write = slow
    from fp8jax.toolkit.cli import main
    sys.exit(main(["data", "prepare", sys.argv[1], sys.argv[2], "--vocab", "300", "--quiet"]))
    """
)


# Timing-dependent (the signal must land while the child writes): -m slow.
@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_prepare_leaves_no_output(tmp_path, sig):
    _corpus(tmp_path / "src")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen(
        [sys.executable, "-c", _SLOW_PREPARE, str(tmp_path / "src"), str(tmp_path / "out")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout.readline().strip() == "WRITING"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig
    assert "partial output removed" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_a_partial_output_of_a_dead_process_is_removed_next_time(tmp_path):
    _corpus(tmp_path / "src")
    stale = tmp_path / ".out.partial-999999999-abcd"
    stale.mkdir()
    (stale / prep.PARTIAL_MARKER).write_text(
        json.dumps({"pid": 999_999_999, "host": socket.gethostname()})
    )
    (stale / "train-00000.bin").write_bytes(b"xx")
    warnings = []
    prep.prepare(tmp_path / "src", tmp_path / "out", vocab=300, quiet=True, warn=warnings.append)
    assert not stale.exists() and "partial output of an earlier data preparation" in warnings[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]
