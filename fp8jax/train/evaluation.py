"""A trained checkpoint's cross-entropy on held-out data or any file, in bits per byte.

The text is cut into consecutive, non-overlapping windows of the run's
``seq_len`` bytes; in each window position t predicts byte t + 1, so a window
gives ``seq_len - 1`` predictions and the first byte of a window has no
context from the window before (the same convention as training's
validation loss).  Windows are grouped into batches of ``batch_size``; a
remainder that fills no batch is left out, and the result says how many
bytes it covered.  The mean cross-entropy is taken in float32 by the run's
own evaluation step (its recipe, its FP8 state), then reported in nats and
in bits per byte (= bits per token: the vocabulary is bytes).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from fp8jax.data import corpus as data_lib
from fp8jax.parallel.mesh import put_batch
from fp8jax.train.checkpoint import CheckpointError
from fp8jax.train.defaults import ConfigError
from fp8jax.train.loop import Run
from fp8jax.train.runtime import compile_wait
from fp8jax.train.state import TrainState


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """Mean next-byte cross-entropy of a checkpoint on a text."""

    source: str
    step: int
    nats_per_byte: float
    windows: int
    seq_len: int
    predictions: int

    @property
    def bits_per_byte(self) -> float:
        return self.nats_per_byte / math.log(2.0)

    def line(self) -> str:
        return (
            f"step {self.step} on {self.source}: {self.nats_per_byte:.4f} nats/byte = "
            f"{self.bits_per_byte:.4f} bits per byte ({self.predictions:,} predicted bytes in "
            f"{self.windows} windows of {self.seq_len})"
        )


#: The largest text file a reader scores (bytes).  64 MiB is half a million windows of
#: 128 bytes (hours of scoring on a CPU); read whole, then widened to int32 windows,
#: it takes five times that in memory.
MAX_TEXT_BYTES = 64 << 20

#: The flags of experiments/evaluate.py that set a batch and a cap on windows.
EVALUATE_FLAGS = ("--batch_size", "--max_windows")


def check_window_settings(
    batch_size: int, max_windows: int, flags: tuple[str, str] = EVALUATE_FLAGS
) -> None:
    """ConfigError (one line, naming ``flags``: batch size, max windows) unless
    ``batch_size`` >= 1 and ``max_windows`` is 0 (all) or at least one batch."""
    batch_flag, max_flag = flags
    if batch_size < 1:
        raise ConfigError(f"{batch_flag} must be >= 1, got {batch_size}")
    if max_windows < 0:
        raise ConfigError(f"{max_flag} must be >= 0 (0: all windows), got {max_windows}")
    if 0 < max_windows < batch_size:
        raise ConfigError(
            f"{max_flag} {max_windows} is less than one batch of {batch_size} windows (whole "
            f"batches are scored): raise {max_flag} or lower {batch_flag}"
        )


def windows(
    stream: np.ndarray,
    seq_len: int,
    batch_size: int,
    max_windows: int = 0,
    flags: tuple[str, str] = EVALUATE_FLAGS,
) -> np.ndarray:
    """Tokens int32 [n_batches, batch_size, seq_len]: consecutive windows of ``stream``.

    ``max_windows`` > 0 keeps at most that many (rounded down to whole
    batches).  ConfigError (naming ``flags``, see :func:`check_window_settings`)
    for settings that score nothing, or when the stream does not fill one batch.
    """
    check_window_settings(batch_size, max_windows, flags)
    n = stream.size // seq_len
    if max_windows > 0:
        n = min(n, int(max_windows))
    n_batches = n // batch_size
    if n_batches == 0:
        raise ConfigError(
            f"{stream.size} bytes make {stream.size // seq_len} windows of {seq_len}, fewer than "
            f"one batch of {batch_size}: give a longer text or a smaller {flags[0]}"
        )
    used = n_batches * batch_size * seq_len
    # int32 tokens: what the embedding lookup expects.
    return stream[:used].astype(np.int32).reshape(n_batches, batch_size, seq_len)


def check_text_file(path: str | Path, flag: str = "--file") -> Path:
    """``path`` as a regular, readable file of at most MAX_TEXT_BYTES; ConfigError (one line
    naming ``flag`` and the cap) otherwise.  Checked before anything is restored."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"{flag} {str(path)!r} is not a file: give a text file with {flag}")
    try:
        size = p.stat().st_size
        readable = os.access(p, os.R_OK)
    except OSError as e:
        raise ConfigError(f"cannot read {flag} {str(path)!r}: {e.strerror}") from None
    if size > MAX_TEXT_BYTES:
        raise ConfigError(
            f"{flag} {str(path)!r} holds {size:,} bytes, more than the {MAX_TEXT_BYTES:,} "
            f"(64 MiB) a reader scores: score a part of it, e.g. head -c 64M {path} > part.txt"
        )
    if not readable:
        raise ConfigError(f"cannot read {flag} {str(path)!r}: permission denied")
    return p


def read_text(path: str | Path, flag: str = "--file") -> np.ndarray:
    """The bytes of a file as uint8 (ConfigError naming the fix when it cannot be read or is
    larger than MAX_TEXT_BYTES: :func:`check_text_file`)."""
    p = check_text_file(path, flag)
    try:
        with open(p, "rb") as f:
            # At most the cap, even from a file that grew since it was checked.
            blob = f.read(MAX_TEXT_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"cannot read {str(path)!r}: {e.strerror}") from None
    if len(blob) > MAX_TEXT_BYTES:
        raise ConfigError(f"{flag} {str(path)!r} grew past {MAX_TEXT_BYTES:,} bytes while read")
    return np.frombuffer(blob, np.uint8)


def text_stream(run: Run, path: str | Path | None = None) -> tuple[np.ndarray, str]:
    """(bytes as uint8, what they are) a reader scores: ``path``, or the run's validation split.

    ConfigError when the run is not byte-level, its vocabulary cannot hold
    every byte, or the text is empty.
    """
    if run.corpus.unit != "bytes":
        raise ConfigError(
            f"this run trains on {run.corpus.unit} of {run.corpus.name!r}; readers score "
            "runs on byte-level data (stdlib, text, synthetic)"
        )
    if path is None:
        stream, source = run.corpus.val, f"the validation split of {run.corpus.name!r}"
    else:
        stream, source = read_text(path), str(path)
    if stream.size == 0:
        raise ConfigError(f"{source} is empty: give a text with at least one window of bytes")
    if run.mcfg.vocab_size < data_lib.VOCAB_SIZE:
        raise ConfigError(
            f"the model's vocabulary has {run.mcfg.vocab_size} tokens, fewer than the "
            f"{data_lib.VOCAB_SIZE} byte values: it cannot score arbitrary bytes"
        )
    return stream, source


def evaluate(
    run: Run,
    state: TrainState,
    step: int,
    *,
    path: str | Path | None = None,
    batch_size: int = 8,
    max_windows: int = 0,
    say: Callable[[str], None] = lambda line: None,
) -> Evaluation:
    """The checkpoint's cross-entropy on ``path`` (default: the run's validation split).

    ``say`` gets a line naming what is compiled before the first call, and one
    with the seconds it took after it."""
    check_window_settings(batch_size, max_windows)
    if batch_size % run.mesh.size:
        raise ConfigError(
            f"--batch_size {batch_size} must be a positive multiple of the {run.mesh.size} devices"
        )
    stream, source = text_stream(run, path)
    tokens = windows(stream, run.seq_len, batch_size, max_windows)
    n_windows = tokens.shape[0] * tokens.shape[1]
    say(compile_wait(f"the model for evaluation, then scoring {n_windows} windows"))
    t0 = time.perf_counter()
    # One call: the forward pass over every batch (lax.map), compiled on its first call.
    loss = float(run.eval_fn(state, put_batch(tokens, run.mesh, batch_axis=1)))
    say(f"compiled and scored in {time.perf_counter() - t0:.1f} s")
    if not np.isfinite(loss):
        raise CheckpointError(
            f"the loss on {source} is {loss}: the checkpoint of step {step} does not give a "
            "usable model"
        )
    return Evaluation(
        source=source,
        step=step,
        nats_per_byte=loss,
        windows=n_windows,
        seq_len=run.seq_len,
        predictions=n_windows * (run.seq_len - 1),
    )
