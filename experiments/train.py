r"""Train one run: python experiments/train.py --config=configs/tiny.py --workdir=DIR.

Resumes from the latest checkpoint in DIR ("resuming from step N"); a finished
run prints "already complete: <summary>".  The last line names DIR and what the
run keeps there (checkpoints, metrics.jsonl, config.json, tb/).  Any config
field can be overridden, e.g. --config.steps=200; a resume may change only the
resumable fields (docs/training.md). Mistakes print one line and exit 2; a diverged run exits 1
naming the first non-finite step; Ctrl-C / SIGTERM save a checkpoint and exit
130 / 143 with the command that resumes.
"""

import sys

from absl import app, flags
from ml_collections import config_flags

from fp8jax.train.checkpoint import CheckpointError
from fp8jax.train.defaults import ConfigError, fields_help
from fp8jax.train.loop import TrainingDiverged, TrainingInterrupted, summary_line, train
from fp8jax.train.runtime import (
    CACHE_HELP,
    default_jax_cache_dir,
    parse_flags,
    setup_runtime,
    usage_error,
)
from fp8jax.train.workdir import outputs_line

# --help prints this docstring: it ends with every config field and its default.
__doc__ += (
    "\nConfig fields (--config.FIELD=VALUE; defaults of fp8jax/train/defaults.py, which "
    "configs/*.py change; meanings there):\n" + fields_help() + "\n"
)

_CONFIG = config_flags.DEFINE_config_file("config", None, "Training config file.", lock_config=True)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Run directory (checkpoints, metrics, TensorBoard)."
)
_CACHE = flags.DEFINE_string("jax_cache_dir", default_jax_cache_dir(), CACHE_HELP)
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    if len(argv) > 1:
        usage_error(f"unexpected arguments {argv[1:]}: flags are --config=... --workdir=...")
    setup_runtime(_CACHE.value)
    try:
        s = train(_CONFIG.value, _WORKDIR.value)
    except ConfigError as e:
        usage_error(str(e))
    except (TrainingDiverged, CheckpointError) as e:
        usage_error(str(e), code=1)
    except TrainingInterrupted as e:
        resume = "python " + " ".join(sys.argv)
        usage_error(f"{e}; resume with: {resume}", code=128 + e.signum)
    except KeyboardInterrupt:
        usage_error("interrupted before the first step; nothing was saved", code=130)
    if not s["already_complete"]:
        print("summary:", summary_line(s))
    # The last line: where the run's outputs are.
    print(outputs_line(_WORKDIR.value))


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
