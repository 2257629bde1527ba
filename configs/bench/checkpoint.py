r"""What checkpoint checksums cost at save and at restore, on the small config's state.

Command:
  python experiments/bench.py --config=configs/bench/checkpoint.py   # ~1 min on a CPU

What it prints: the state's size, then per direction the median time of orbax's
own save (restore) and of the SHA-256 checksums a save records (a reader
verifies), and their ratio, e.g.
  save:    orbax    250.0 ms + checksums    40.0 ms  -> 1.160x  (...)
  restore: orbax    120.0 ms + checksums    40.0 ms  -> 1.333x  (...)
(fp8jax/bench/checkpoint_cost.py says what each part times).  --out_dir=DIR
writes DIR/results.json.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.benchmark = "checkpoint"  # fp8jax.bench.experiments.checkpoint
    c.config = "configs/small.py"  # the training config whose state is saved and restored
    c.repeats = 5  # saves and restores timed; the medians are reported
    return c
