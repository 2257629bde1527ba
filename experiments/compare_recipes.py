r"""Compare recipes x seeds on the same data.

  python experiments/compare_recipes.py --config=configs/compare/formats.py --workdir=DIR

Writes DIR/results.md, results.json, loss_curves.png and gap_to_bf16.png;
finished runs under DIR/<label>/seed<k> are re-read, interrupted ones resumed.
"""

import sys

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from fp8jax.train.compare import run_comparison

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Comparison config file.", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory.")
_CACHE = flags.DEFINE_string(
    "jax_cache_dir",
    "/tmp/fp8jax_jax_cache",
    "Persistent XLA compilation cache ('' = off): reruns and other seeds skip recompiling.",
)
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    del argv
    # Orbax logs every checkpoint step at INFO; keep the progress lines readable.
    logging.set_verbosity(logging.WARNING)
    if _CACHE.value:
        jax.config.update("jax_compilation_cache_dir", _CACHE.value)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    command = "python " + " ".join(sys.argv)
    run_comparison(_CONFIG.value, _WORKDIR.value, command=command)
    print(open(f"{_WORKDIR.value}/results.md").read())


if __name__ == "__main__":
    app.run(main)
