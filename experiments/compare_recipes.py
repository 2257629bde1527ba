r"""Compare recipes x seeds on the same data.

  python experiments/compare_recipes.py --config=configs/compare/headline.py --workdir=DIR

Writes DIR/results.md, results.json, loss_curves.png and gap_to_bf16.png; every
run lives under DIR/runs/ (finished runs there are re-read, interrupted ones
resumed). The runs must come from one commit and a clean tree (see
--allow_mixed_code). Mistakes print one line and exit 2; Ctrl-C / SIGTERM save the current
run's checkpoint and exit 130 / 143 with the command that resumes.
"""

import sys

from absl import app, flags
from ml_collections import config_flags

from fp8jax.lab.compare import run_comparison
from fp8jax.train.checkpoint import CheckpointError
from fp8jax.train.defaults import ConfigError
from fp8jax.train.loop import TrainingDiverged, TrainingInterrupted
from fp8jax.train.runtime import (
    CACHE_HELP,
    default_jax_cache_dir,
    parse_flags,
    setup_runtime,
    usage_error,
)

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Comparison config file.", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory (results and every run).")
_CACHE = flags.DEFINE_string("jax_cache_dir", default_jax_cache_dir(), CACHE_HELP)
_MIXED = flags.DEFINE_bool(
    "allow_mixed_code",
    False,
    "Run from a modified tree and tabulate runs of different commits (a scratch comparison; "
    "the table says so). Off: a comparison's runs come from one commit and a clean tree.",
)
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    if len(argv) > 1:
        usage_error(f"unexpected arguments {argv[1:]}: flags are --config=... --workdir=...")
    setup_runtime(_CACHE.value)
    command = "python " + " ".join(sys.argv)
    try:
        results = run_comparison(
            _CONFIG.value, _WORKDIR.value, command=command, allow_mixed_code=_MIXED.value
        )
    except ConfigError as e:
        usage_error(str(e))
    except (TrainingDiverged, CheckpointError) as e:
        usage_error(str(e), code=1)
    except TrainingInterrupted as e:
        usage_error(f"{e}; resume the comparison with: {command}", code=128 + e.signum)
    except KeyboardInterrupt:
        usage_error("interrupted before the first step of a run; nothing was saved", code=130)
    print(results["markdown"])


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
