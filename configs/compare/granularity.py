r"""Granularity: per-tensor vs per-row vs 1x128 tiles / 128x128 blocks (E4M3, online).

Command:
  python experiments/compare_recipes.py --config=configs/compare/granularity.py --workdir=/tmp/fp8jax_cmp/granularity

What it prints: a progress line per run and logged step, then the Markdown
table of results.md: one row per run with the final validation loss (65,536+
held-out tokens), the paired relative gap to bf16 per seed, its mean and 95%
t-interval, whether the interval lies within +-0.25% (or cannot resolve it),
tokens/s and FP8 telemetry (saturated / flushed fractions).  Runs live under
the workdir (``DIR/runs``).
Expected: all close to bf16 on a well-behaved model (see outliers.py for where granularity matters).
"""

from fp8jax.train.defaults import tiny_comparison_config


def get_config():
    return tiny_comparison_config(
        "granularity",
        {
            "bf16": dict(recipe="bf16"),
            "tensor": dict(recipe="current_tensor"),
            "row": dict(recipe="rowwise"),
            "tile_block": dict(recipe="deepseek_v3"),
        },
        notes=(
            "Tiny MoE model, stdlib corpus, E4M3 everywhere with online scaling: one scale per "
            "tensor, per row (activations/gradients) and column (weights), or DeepSeek-V3's "
            "1x128 tiles and 128x128 weight blocks."
        ),
    )
