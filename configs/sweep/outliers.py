r"""Massive activations swept over magnitude: where per-tensor scaling breaks, where tiles do.

Command (every magnitude, every run of configs/compare/outlier_sweep.py, 2 seeds):
  python experiments/compare_recipes.py --config=configs/sweep/outliers.py --workdir=/tmp/fp8jax_cmp/outlier_sweep

A smaller sweep (four recipes, the injected faults left out):
  python experiments/compare_recipes.py --config=configs/sweep/outliers.py --workdir=DIR --config.sweep.labels=bf16,deepseek_v3,tensor_current,tensor_delayed

Runs configs/compare/outlier_sweep.py at each magnitude (in units of the median
|activation| at every FFN down-projection input) into DIR/<magnitude>
(resumable: finished runs are re-read).  What it prints: "=== magnitude 1e2"
and each comparison's progress and results table, then sweep.md: the paired
val-loss gap to bf16 with its 95% interval, the verdict on +-0.25%, flushed
and saturated fractions, per magnitude and run.  Writes DIR/sweep.md,
DIR/sweep.json and DIR/sweep.png (gap and flushed fraction against magnitude).
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.sweep = ml_collections.ConfigDict(
        dict(
            # The comparison config (under configs/) whose argument is swept.
            config="compare/outlier_sweep.py",
            points="1e2,1e3,1e4,1e5",  # its arguments: x median |h|, comma-separated
            labels="",  # runs of that config, comma-separated ("": all)
            seeds="0,1",  # seeds of every run (fp8jax.train.defaults.parse_seeds)
            value_name="magnitude (x median |h|)",  # column of sweep.md
            title="Massive activations: gap to bf16 vs magnitude",  # heading of sweep.md
            axis="injected magnitude (x median |h|)",  # x axis of sweep.png
            plot_title="Massive activations at every FFN down-projection input",
        )
    )
    return c
