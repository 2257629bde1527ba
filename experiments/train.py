r"""Train one run: python experiments/train.py --config=configs/tiny.py --workdir=DIR.

Resumes from the latest checkpoint in DIR. Any config field can be overridden,
e.g. --config.recipe=bf16 --config.steps=200.
"""

import json

from absl import app, flags
from ml_collections import config_flags

from fp8jax.train.loop import train
from fp8jax.train.runtime import CACHE_HELP, setup_runtime

_CONFIG = config_flags.DEFINE_config_file("config", None, "Training config file.", lock_config=True)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Run directory (checkpoints, metrics, TensorBoard)."
)
_CACHE = flags.DEFINE_string(
    "jax_cache_dir",
    "/tmp/fp8jax_jax_cache",
    CACHE_HELP,
)
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    del argv
    setup_runtime(_CACHE.value)
    s = train(_CONFIG.value, _WORKDIR.value)
    keys = ("recipe", "steps", "final_train_loss", "final_val_loss", "tokens_per_s", "wall_s")
    print("summary:", json.dumps({k: s[k] for k in keys}))


if __name__ == "__main__":
    app.run(main)
