r"""Granularity where it means something: contractions of 512 and 1024, so a 1x128 tile is not a row.

Command:
  python experiments/compare_recipes.py --config=configs/compare/granularity.py --workdir=/tmp/fp8jax_cmp/granularity

The argument after the file name picks the seeds ("0-4" by default): two
processes can share the workdir (``granularity.py:0-4:2`` and ``:1-4:2``), then
the command above re-reads every finished run and tabulates them.

What it prints: a progress line per run and logged step, then the Markdown
table of results.md: one row per run with the final validation loss (65,536+
held-out tokens), the paired relative gap to bf16 per seed, its mean and 95%
t-interval, the verdict on +-0.25%, tokens/s and FP8 telemetry (saturated /
flushed fractions).  Runs live under the workdir (``DIR/runs``).

The tiny model widened to d_model 512, d_ff 1024 and experts of 512, so every
GEMM contracts over 512 or more: per-tensor, per-row, 1x128 tiles / 128x128
blocks and 1x128 tiles for the weights too are four different quantizations.
``dgrad_blocks`` quantizes the Dgrad activation gradient in 128x128 blocks,
the setting DeepSeek-V3 (appendix B.2) reports to diverge; its flushed
fraction and loss gap against tile_block show the mechanism at this scale.
"""

import ml_collections

from fp8jax.train.defaults import parse_seeds, tiny_comparison_config


def get_config(seeds: str = "0-4"):
    """``seeds``: "a-b", "a-b:step" or "s1,s2" (fp8jax.train.defaults.parse_seeds)."""
    c = tiny_comparison_config(
        "granularity",
        {
            "bf16": dict(recipe="bf16"),
            "tensor": dict(recipe="current_tensor"),
            "row": dict(recipe="rowwise"),
            "tile_block": dict(recipe="deepseek_v3"),
            "tile_everywhere": dict(recipe="tile_everywhere"),
            "dgrad_blocks": dict(recipe="dgrad_blocks"),
        },
        notes=(
            "Tiny MoE model widened to d_model 512, d_ff 1024, experts of 512 (contractions of "
            "512-1024), stdlib corpus, E4M3 with online scaling: one scale per tensor, per row "
            "(activations / gradients) and column (weights), DeepSeek-V3's 1x128 tiles and "
            "128x128 weight blocks, 1x128 tiles for the weights too, and 128x128 blocks for "
            "the Dgrad activation gradient (DeepSeek-V3 appendix B.2)."
        ),
        seeds=parse_seeds(seeds),
        # Each finer granularity against the next coarser one, and the two
        # variants against DeepSeek-V3's own layout, paired seed by seed.
        contrasts=(
            "row:tensor",
            "tile_block:row",
            "tile_everywhere:tile_block",
            "dgrad_blocks:tile_block",
        ),
    )
    c.model_overrides = ml_collections.ConfigDict(dict(d_model=512, d_ff=1024, d_expert=512))
    return c
