"""Sampling from a checkpoint: greedy equals the argmax of the model on the text so far
(no padding), top_k=1 is greedy, a seed fixes the draw; bad settings are one line."""

import re

import jax
import numpy as np
import pytest
from flax import nnx
from test_train_restore import untrained_run

from fp8jax.train.defaults import ConfigError
from fp8jax.train.restore import load_run
from fp8jax.train.sampling import check_sampling, sample


def test_greedy_top1_and_seeded_samples(tmp_path):
    untrained_run(tmp_path, "deepseek_v3")
    run, state, _ = load_run(tmp_path)
    prompt = b"def f(x):\n    return"
    greedy = sample(run, state, prompt, length=3, temperature=0.0)
    # Reference: the model on the unpadded text so far, its most likely next byte.
    model = nnx.merge(run.graphdef, state.params, state.fp8, state.bias, state.rest)
    text = list(prompt)
    for _ in range(3):
        logits = np.asarray(model(np.asarray([text[-run.seq_len :]], np.int32))[0])
        text.append(int(np.argmax(logits[0, -1, :256])))
    assert greedy == bytes(text[len(prompt) :])
    assert sample(run, state, prompt, length=3, temperature=1.0, top_k=1, seed=5) == greedy
    a = sample(run, state, prompt, length=6, temperature=1.0, seed=1)
    assert len(a) == 6 and a == sample(run, state, prompt, length=6, temperature=1.0, seed=1)
    assert sample(run, state, prompt, length=0) == b""
    # A prompt longer than seq_len: the last seq_len bytes are the context.
    assert len(sample(run, state, b"x" * 50, length=2, temperature=0.0)) == 2
    with pytest.raises(ConfigError, match="prompt is empty"):
        sample(run, state, b"", length=2)
    jax.clear_caches()


@pytest.mark.parametrize(
    "temperature,top_k,length,match",
    [
        (-1.0, 0, 5, "temperature"),
        (float("nan"), 0, 5, "temperature"),
        (1.0, -2, 5, "top_k"),
        (1.0, 0, -1, "length"),
    ],
)
def test_bad_settings_are_one_line(temperature, top_k, length, match):
    with pytest.raises(ConfigError, match=match):
        check_sampling(temperature, top_k, length)


def test_length_is_capped_and_output_streams(tmp_path):
    from fp8jax.train.sampling import MAX_LENGTH

    with pytest.raises(ConfigError, match="--length must be in"):
        check_sampling(0.8, 0, MAX_LENGTH + 1)
    untrained_run(tmp_path, "bf16")
    run, state, _ = load_run(tmp_path)
    got, said = [], []
    out = sample(run, state, b"ab", length=4, temperature=0.0, emit=got.append, say=said.append)
    assert b"".join(got) == out and len(got) == 4
    # What it waits for is said before the first byte, and how long it took after it.
    assert len(said) == 2 and said[0].startswith("compiling the model for sampling (first call")
    assert re.fullmatch(r"compiled in \d+\.\d s; generating 4 bytes", said[1]), said
    jax.clear_caches()


def test_a_model_with_non_finite_scores_is_an_error(tmp_path):
    from fp8jax.train.checkpoint import CheckpointError

    untrained_run(tmp_path, "bf16")
    run, state, _ = load_run(tmp_path)
    bad = state._replace(params=jax.tree.map(lambda a: a * np.nan, state.params))
    with pytest.raises(CheckpointError, match="not finite after 0 bytes"):
        sample(run, bad, b"ab", length=3, temperature=0.0)
    jax.clear_caches()
