r"""Granularity: per-tensor vs per-row vs 1x128 tiles / 128x128 blocks (E4M3, online).

Command:
  python experiments/compare_recipes.py --config=configs/compare/granularity.py --workdir=/tmp/fp8jax_cmp/granularity

What it prints: a progress line per run and step interval, then the Markdown
table of results.md: one row per run with final validation/train loss, the
paired relative gap to bf16, whether it is within max(0.25%, bf16 seed
spread), tokens/s and FP8 telemetry (saturated / flushed fractions).
Expected: all close to bf16 on a well-behaved model (see outliers.py for where granularity matters).
"""

import ml_collections

from fp8jax.train.defaults import tiny_config


def _runs(**runs):
    return ml_collections.ConfigDict(runs)


def get_config():
    c = tiny_config()
    c.steps = 120
    c.warmup_steps = 12
    c.eval_every = 30
    c.log_every = 3
    c.eval_batches = 4
    c.eval_batch_size = 8
    c.final_window = 10
    c.compare = ml_collections.ConfigDict(
        dict(
            name="granularity",
            labels=["bf16", "tensor", "row", "tile_block"],
            baseline="bf16",
            # Shared with the other tiny comparisons: identical runs are trained once.
            run_root="/tmp/fp8jax_cmp/runs_tiny",
            seeds=[0, 1],
            notes=(
                "Tiny MoE model, stdlib corpus, E4M3 everywhere with online scaling: one scale per "
                "tensor, per row (activations/gradients) and column (weights), or DeepSeek-V3's "
                "1x128 tiles and 128x128 weight blocks."
            ),
            runs=_runs(
                bf16=dict(recipe="bf16"),
                tensor=dict(recipe="current_tensor"),
                row=dict(recipe="rowwise"),
                tile_block=dict(recipe="deepseek_v3"),
            ),
        )
    )

    return c
