r"""Evaluate a trained checkpoint: cross-entropy in bits per byte.

  python experiments/evaluate.py --workdir=/tmp/fp8jax_tiny                   # validation split
  python experiments/evaluate.py --workdir=/tmp/fp8jax_tiny --file=README.md  # any text file

Prints one line, e.g.
  step 60 on the validation split of 'stdlib': 2.7301 nats/byte = 3.9387 bits per byte
  (63,000 predicted bytes in 1000 windows of 64)
On stderr it says what it waits for: the restore, then the compilation of the
model's forward pass (most of the time on a CPU) and how long it took.
The text is cut into consecutive windows of the run's seq_len (see
fp8jax/train/evaluation.py); --file takes a text of at most 64 MiB; --step
picks a kept checkpoint (default: the newest whose arrays match their
checksums).  Mistakes print one line and exit 2.
"""

import sys

from absl import app, flags

from fp8jax.train.checkpoint import CheckpointError
from fp8jax.train.defaults import ConfigError
from fp8jax.train.evaluation import check_text_file, check_window_settings, evaluate
from fp8jax.train.restore import load_run
from fp8jax.train.runtime import (
    CACHE_HELP,
    default_jax_cache_dir,
    parse_flags,
    setup_runtime,
    usage_error,
)

_WORKDIR = flags.DEFINE_string("workdir", None, "The run's directory (experiments/train.py).")
_FILE = flags.DEFINE_string("file", None, "A text file to score (default: the validation split).")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
_BATCH = flags.DEFINE_integer("batch_size", 8, "Windows per evaluation batch.")
_MAX = flags.DEFINE_integer("max_windows", 0, "Score at most this many windows (0: all).")
_CACHE = flags.DEFINE_string("jax_cache_dir", default_jax_cache_dir(), CACHE_HELP)
flags.mark_flags_as_required(["workdir"])


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def main(argv):
    if len(argv) > 1:
        usage_error(f"unexpected arguments {argv[1:]}: flags are --workdir=... [--file=...]")
    setup_runtime(_CACHE.value)
    try:
        # The flags first: a mistake costs no restore.
        if _FILE.value is not None:
            check_text_file(_FILE.value)
        check_window_settings(_BATCH.value, _MAX.value)
        _say(f"restoring {_WORKDIR.value} ...")
        run, state, step = load_run(_WORKDIR.value, _STEP.value, say=_say)
        _say(f"restored step {step}")
        result = evaluate(
            run,
            state,
            step,
            path=_FILE.value,
            batch_size=_BATCH.value,
            max_windows=_MAX.value,
            say=_say,
        )
    except ConfigError as e:
        usage_error(str(e))
    except CheckpointError as e:
        usage_error(str(e), code=1)
    print(result.line())


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
