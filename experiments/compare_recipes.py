r"""Compare recipes x seeds on the same data.

  python experiments/compare_recipes.py --config=configs/compare/formats.py --workdir=DIR

Writes DIR/results.md, results.json, loss_curves.png and gap_to_bf16.png;
finished runs under DIR/<label>/seed<k> are re-read, interrupted ones resumed.
"""

import sys

from absl import app, flags
from ml_collections import config_flags

from fp8jax.train.compare import run_comparison
from fp8jax.train.runtime import CACHE_HELP, setup_runtime

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Comparison config file.", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory.")
_CACHE = flags.DEFINE_string(
    "jax_cache_dir",
    "/tmp/fp8jax_jax_cache",
    CACHE_HELP,
)
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    del argv
    setup_runtime(_CACHE.value)
    command = "python " + " ".join(sys.argv)
    run_comparison(_CONFIG.value, _WORKDIR.value, command=command)
    print(open(f"{_WORKDIR.value}/results.md").read())


if __name__ == "__main__":
    app.run(main)
