r"""Formats: unified E4M3 vs hybrid E4M3/E5M2, both fine-grained (1x128 / 128x128) online.

Command:
  python experiments/compare_recipes.py --config=configs/compare/formats.py --workdir=/tmp/fp8jax_cmp/formats

What it prints: a progress line per run and step interval, then the Markdown
table of results.md: one row per run with final validation/train loss, the
paired relative gap to bf16, whether it is within max(0.25%, bf16 seed
spread), tokens/s and FP8 telemetry (saturated / flushed fractions).
Expected: both within noise of bf16 on this short run; E5M2's 2 mantissa bits show, if at all, as a small positive gap.
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
            name="formats",
            labels=["bf16", "fine_e4m3", "fine_hybrid"],
            baseline="bf16",
            # Shared with the other tiny comparisons: identical runs are trained once.
            run_root="/tmp/fp8jax_cmp/runs_tiny",
            seeds=[0, 1],
            notes=(
                "Tiny MoE model, stdlib corpus. fine_e4m3 = the deepseek_v3 recipe (E4M3 everywhere); "
                "fine_hybrid = the same tiles/blocks and online scaling with E5M2 for the "
                "gradient dy in Dgrad and Wgrad (built with dataclasses.replace on the QuantSpecs)."
            ),
            runs=_runs(
                bf16=dict(recipe="bf16"),
                fine_e4m3=dict(recipe="deepseek_v3"),
                fine_hybrid=dict(recipe="fine_hybrid"),
            ),
        )
    )

    return c
