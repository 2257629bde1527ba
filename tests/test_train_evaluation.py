"""A checkpoint's cross-entropy on the validation split or any file: consecutive windows,
the mean over every prediction against a float64 reference, bits = nats / ln 2."""

import math
import re

import jax
import numpy as np
import pytest
from flax import nnx
from test_train_restore import untrained_run

from fp8jax.train.defaults import ConfigError
from fp8jax.train.evaluation import MAX_TEXT_BYTES, evaluate, windows
from fp8jax.train.restore import load_run


def test_windows_are_consecutive_and_fill_whole_batches():
    stream = np.arange(250, dtype=np.uint8)
    w = windows(stream, 10, 4)
    # 25 windows of 10 bytes, 6 batches of 4 (one window left out).
    assert w.shape == (6, 4, 10) and w.dtype == np.int32
    np.testing.assert_array_equal(w.reshape(-1), np.arange(240))
    assert windows(stream, 10, 4, max_windows=9).shape == (2, 4, 10)
    with pytest.raises(ConfigError, match="fewer than one batch of 4"):
        windows(stream[:35], 10, 4)


def _reference_nats(run, state, tokens_NxT):
    def logits_of(state, tokens):
        model = nnx.merge(run.graphdef, state.params, state.fp8, state.bias, state.rest)
        return model(tokens)[0]

    # The same compiled forward, batch by batch as evaluated (eager FP8 numerics may
    # round a scale differently); the reduction over windows is what is checked.
    fwd = jax.jit(logits_of)
    logits = np.concatenate(
        [
            np.asarray(fwd(state, tokens_NxT[i : i + 4]), np.float64)
            for i in range(0, len(tokens_NxT), 4)
        ]
    )
    lg, tgt = logits[:, :-1], tokens_NxT[:, 1:]
    top = lg.max(-1, keepdims=True)
    logz = np.log(np.exp(lg - top).sum(-1)) + top[..., 0]
    picked = np.take_along_axis(lg, tgt[..., None], -1)[..., 0]
    return float(np.mean(logz - picked))


@pytest.mark.parametrize("recipe", ["bf16", "deepseek_v3"])
def test_validation_split_and_a_file_against_a_float64_reference(tmp_path, recipe):
    untrained_run(tmp_path / "run", recipe)
    run, state, step = load_run(tmp_path / "run")
    said = []
    res = evaluate(run, state, step, batch_size=4, max_windows=8, say=said.append)
    assert res.windows == 8 and res.predictions == 8 * 31 and res.step == 0
    # What it waits for is said before the call that compiles, and how long it took after.
    assert len(said) == 2 and said[0].startswith(
        "compiling the model for evaluation, then scoring 8 windows (first call: XLA compiles"
    )
    assert re.fullmatch(r"compiled and scored in \d+\.\d s", said[1]), said
    want = _reference_nats(run, state, windows(run.corpus.val, 32, 4, 8).reshape(8, 32))
    assert res.nats_per_byte == pytest.approx(want, rel=2e-6)
    assert res.bits_per_byte == res.nats_per_byte / math.log(2)
    assert "validation split of 'stdlib'" in res.line() and "bits per byte" in res.line()
    text = tmp_path / "t.txt"
    text.write_bytes(bytes(range(32, 127)) * 11)  # 1045 bytes: 32 windows, 8 batches
    res = evaluate(run, state, step, path=text, batch_size=4)
    assert res.windows == 32 and res.source == str(text)
    stream = np.frombuffer(text.read_bytes(), np.uint8)
    want = _reference_nats(run, state, windows(stream, 32, 4).reshape(32, 32))
    assert res.nats_per_byte == pytest.approx(want, rel=2e-6)
    with pytest.raises(ConfigError, match="is not a file"):
        evaluate(run, state, step, path=tmp_path / "missing.txt")
    with pytest.raises(ConfigError, match="--batch_size must be >= 1, got 0"):
        evaluate(run, state, step, batch_size=0)


def test_negative_max_windows_and_a_non_finite_loss_are_refused(tmp_path):
    from fp8jax.train.checkpoint import CheckpointError

    untrained_run(tmp_path / "run", "bf16")
    run, state, step = load_run(tmp_path / "run")
    with pytest.raises(ConfigError, match="--max_windows must be >= 0"):
        evaluate(run, state, step, batch_size=4, max_windows=-1)
    # A cap below one batch scores nothing: said so, with this command's flag names.
    with pytest.raises(ConfigError, match="--max_windows 3 is less than one batch of 4 windows"):
        evaluate(run, state, step, batch_size=4, max_windows=3)
    # A text file over the cap is refused unread, the cap said.
    huge = tmp_path / "huge.txt"
    with open(huge, "wb") as f:
        f.truncate(MAX_TEXT_BYTES + 1)
    with pytest.raises(ConfigError, match=f"more than the {MAX_TEXT_BYTES:,} \\(64 MiB\\)"):
        evaluate(run, state, step, path=huge, batch_size=4)
    bad = state._replace(params=jax.tree.map(lambda a: a * np.nan, state.params))
    with pytest.raises(CheckpointError, match="does not give a usable model"):
        evaluate(run, bad, step, batch_size=4, max_windows=4)
