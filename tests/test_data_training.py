"""Training on token files: the vocabulary comes from the data, a resumed run reads exactly
the batches of an uninterrupted one, resume refuses changed data, a shard that becomes
unreadable mid-run stops the run in one line keeping its last checkpoint, and a token
file given as text is refused in one line (exit 2) before anything is created.  Slow:
two processes on 8 simulated devices read disjoint rows and match one process."""

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from data_files import random_tokens, write_tokens

from fp8jax.data import loader
from fp8jax.train.defaults import ConfigError, tiny_config, validate
from fp8jax.train.loop import train
from fp8jax.train.run_log import read_jsonl

ROOT = Path(__file__).resolve().parents[1]


def _config(path, **overrides):
    """bf16 (the quickest to compile), 6 short steps; every test here shares one compilation."""
    c = tiny_config()
    c.recipe = "bf16"
    c.data.source, c.data.path = "tokens", str(path)
    c.steps, c.batch_size, c.seq_len, c.warmup_steps = 6, 4, 32, 2
    c.log_every, c.eval_every, c.eval_batches, c.eval_batch_size = 1, 3, 1, 4
    c.tensorboard = False
    for k, v in overrides.items():
        c[k] = v
    return c


def _structured_tokens(root, vocab=300, n=4000):
    # A repeating sequence: a model can learn it, so the loss visibly falls.
    seq = np.random.default_rng(0).integers(0, vocab, 50)
    stream = np.tile(seq, n // 50)
    return write_tokens(root, {"train": [stream[:3000], stream[:2000]], "val": [stream]}, vocab)


def test_token_files_train_with_the_datas_vocabulary_and_resume_exactly(tmp_path):
    data = _structured_tokens(tmp_path / "tok")
    c = _config(data)
    whole = train(c, tmp_path / "a", stream=io.StringIO())
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    assert cfg["model_config"]["vocab_size"] == 300
    assert cfg["corpus"]["vocab_size"] == 300 and cfg["corpus"]["name"].startswith("tokens:")
    assert cfg["validation_set"]["shards"] == ["val-00000.bin"]
    assert cfg["validation_set"]["rows"] == 4 and len(cfg["validation_set"]["sha256"]) == 64
    # About uniform over 300 ids at the start (ln 300 = 5.70; the fresh head's logits
    # add up to about 1), lower after 6 steps.
    losses = [loss for _, loss in whole["train_curve"]]
    assert np.log(300) - 0.5 < losses[0] < np.log(300) + 1.5 and losses[-1] < losses[0]
    rows = read_jsonl(tmp_path / "a" / "metrics.jsonl")
    assert all(r["data_wait_s"] >= 0 for r in rows if "loss" in r)
    part = train(c, tmp_path / "b", stop_at=3, stream=io.StringIO())
    assert part["steps"] == 3
    out = io.StringIO()
    resumed = train(c, tmp_path / "b", stream=out)
    assert out.getvalue().splitlines()[0] == "resuming from step 3"
    assert resumed["train_curve"] == whole["train_curve"]
    assert resumed["val_curve"] == whole["val_curve"]


def test_resume_refuses_changed_data(tmp_path):
    data = random_tokens(tmp_path / "tok", vocab=300)
    c = _config(data)
    train(c, tmp_path / "run", stop_at=2, stream=io.StringIO())
    ids = np.fromfile(data / "train-00000.bin", np.uint16)
    ids[0] = (ids[0] + 1) % 300
    ids.tofile(data / "train-00000.bin")
    with pytest.raises(ConfigError, match="trained on other data") as e:
        train(c, tmp_path / "run", stream=io.StringIO())
    assert "\n" not in str(e.value) and "use a new --workdir" in str(e.value)
    # The same holds for a byte corpus: its SHA-256 is the fingerprint.
    text = tmp_path / "a.txt"
    text.write_text("some text to learn from\n" * 400)
    b = _config("", checkpoint_every=2)
    b.data.source, b.data.path = "text", str(text)
    train(b, tmp_path / "bytes", stop_at=2, stream=io.StringIO())
    text.write_text("other text to learn from\n" * 400)
    with pytest.raises(ConfigError, match="trained on other data"):
        train(b, tmp_path / "bytes", stream=io.StringIO())


def test_resume_refuses_a_run_whose_data_record_is_missing(tmp_path):
    data = random_tokens(tmp_path / "tok", vocab=300)
    c = _config(data)
    train(c, tmp_path / "run", stop_at=2, stream=io.StringIO())
    cfg_path = tmp_path / "run" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    del cfg["corpus"]
    cfg_path.write_text(json.dumps(cfg))
    # Other data in place of the run's: without the record nothing could tell.
    ids = np.fromfile(data / "train-00000.bin", np.uint16)
    ((ids + 1) % 300).astype(np.uint16).tofile(data / "train-00000.bin")
    with pytest.raises(ConfigError, match="holds no record of the data") as e:
        train(c, tmp_path / "run", stream=io.StringIO())
    assert "\n" not in str(e.value) and str(cfg_path) in str(e.value)
    assert "corpus is missing" in str(e.value)
    # A "corpus" of the wrong type is no record either: refused the same way.
    for held, said in ((None, "null"), ("x", '"x"'), ([], "[]"), ({"sha256": 5}, '{"sha256": 5}')):
        cfg_path.write_text(json.dumps({**cfg, "corpus": held}))
        with pytest.raises(ConfigError, match="holds no record of the data") as e:
            train(c, tmp_path / "run", stream=io.StringIO())
        assert f"corpus is {said})" in str(e.value)
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["2"]


def test_a_shard_unreadable_mid_run_stops_with_its_name_and_keeps_the_checkpoint(
    tmp_path, monkeypatch
):
    data = write_tokens(
        tmp_path / "tok",
        {"train": [np.arange(3000) % 300], "val": [np.arange(500) % 300]},
        300,
    )
    shard = data / "train-00000.bin"
    good = shard.read_bytes()
    real = loader.train_batch
    # One read thread: batches are read in step order, so the damage lands at step 5.
    monkeypatch.setattr(loader, "READ_THREADS", 1)

    def damaging(corpus, step, *args):
        if step == 4:
            shard.write_bytes(b"")
        return real(corpus, step, *args)

    monkeypatch.setattr(loader, "train_batch", damaging)
    c = _config(data, checkpoint_every=2)
    with pytest.raises(ConfigError) as e:
        train(c, tmp_path / "run", stream=io.StringIO())
    msg = str(e.value)
    assert "\n" not in msg and str(shard) in msg
    assert msg.startswith("step 5: token shard") and "checkpoint of step 4 kept" in msg
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["2", "4"]
    # Restored, the run resumes from its checkpoint.
    monkeypatch.setattr(loader, "train_batch", real)
    shard.write_bytes(good)
    out = io.StringIO()
    s = train(c, tmp_path / "run", stream=out)
    assert out.getvalue().startswith("resuming from step 4") and s["steps"] == 6


def test_vocabulary_override_smaller_than_the_data_is_refused(tmp_path):
    c = _config(random_tokens(tmp_path / "tok", vocab=300))
    c.model_overrides.vocab_size = 256
    with pytest.raises(ConfigError, match="smaller than the data's vocabulary 300"):
        train(c, tmp_path / "run", stream=io.StringIO())
    assert not (tmp_path / "run").exists()


def test_token_config_mistakes_are_one_line(tmp_path):
    c = _config(tmp_path / "missing")
    validate(c)  # a config may name a directory still to be made
    with pytest.raises(ConfigError, match="`fp8jax data prepare SRC .*missing --vocab N`"):
        train(c, tmp_path / "run", stream=io.StringIO())
    c.data.max_bytes = 1000
    with pytest.raises(ConfigError, match="data.max_bytes applies to byte sources"):
        validate(c)
    c = _config("")
    with pytest.raises(ConfigError, match="needs a token directory: --config.data.path"):
        validate(c)
    assert not (tmp_path / "run").exists()


def test_token_file_given_as_text_is_one_line_and_exit_2(tmp_path):
    data = random_tokens(tmp_path / "tok")
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", FP8JAX_CACHE_DIR="")
    for path in (data / "train-00000.bin", data):
        p = subprocess.run(
            [
                sys.executable,
                str(ROOT / "experiments" / "train.py"),
                "--config=configs/tiny.py",
                f"--workdir={tmp_path / 'run'}",
                "--config.data.source=text",
                f"--config.data.path={path}",
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert p.returncode == 2, p.stderr
        lines = p.stderr.splitlines()
        assert len(lines) == 1 and "--config.data.source=tokens" in lines[0], p.stderr
        assert not (tmp_path / "run").exists()


_TWO_PROCESS = """
import json, sys
import jax
from fp8jax.parallel.mesh import process_rows
from fp8jax.train.defaults import tiny_config
from fp8jax.train.loop import setup, train
data, workdir, n_proc, pid, port = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
c = tiny_config()
c.recipe = "bf16"
c.data.source, c.data.path = "tokens", data
c.steps, c.batch_size, c.seq_len, c.warmup_steps = 4, 8, 32, 1
c.log_every, c.eval_every, c.eval_batches, c.eval_batch_size = 1, 0, 1, 8
c.tensorboard = False
if n_proc > 1:
    c.mesh.num_processes, c.mesh.process_id = n_proc, pid
    c.mesh.coordinator_address = f"localhost:{port}"
s = train(c, workdir)
mesh = setup(c, workdir + "_probe").mesh
losses = dict(s["train_curve"])  # one loss per step, however many processes log it
print("RESULT", json.dumps({"rows": process_rows((8, 32), mesh),
                            "losses": [losses[k] for k in sorted(losses)]}))
"""


@pytest.mark.slow
def test_two_processes_read_disjoint_rows_and_match_one_process(tmp_path):
    """2 processes x 4 simulated devices = 1 process x 8 devices, same global batch."""
    import socket

    data = _structured_tokens(tmp_path / "tok")

    def launch(n_devices, n_proc, pid, port):
        env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", FP8JAX_CACHE_DIR="")
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={n_devices}"
        return subprocess.Popen(
            [
                sys.executable,
                "-c",
                _TWO_PROCESS,
                str(data),
                str(tmp_path / "w"),
                str(n_proc),
                str(pid),
                str(port),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def result(proc):
        out, err = proc.communicate(timeout=1200)
        assert proc.returncode == 0, err[-3000:]
        line = next(ln for ln in out.splitlines() if ln.startswith("RESULT"))
        return json.loads(line.split(" ", 1)[1])

    one = result(launch(8, 1, 0, 0))
    (tmp_path / "w").rename(tmp_path / "w_one")
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    procs = [launch(4, 2, pid, port) for pid in (0, 1)]
    two = [result(p) for p in procs]
    assert one["rows"] == [0, 8]
    assert sorted(tuple(r["rows"]) for r in two) == [(0, 4), (4, 8)]
    for r in two:
        np.testing.assert_allclose(r["losses"], one["losses"], rtol=1e-6)
