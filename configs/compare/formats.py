r"""Formats: unified E4M3 vs hybrid E4M3/E5M2, both fine-grained (1x128 / 128x128) online.

Command:
  python experiments/compare_recipes.py --config=configs/compare/formats.py --workdir=/tmp/fp8jax_cmp/formats

What it prints: a progress line per run and logged step, then the Markdown
table of results.md: one row per run with the final validation loss (65,536+
held-out tokens), the paired relative gap to bf16 per seed, its mean and 95%
t-interval, whether the interval lies within +-0.25% (or cannot resolve it),
tokens/s and FP8 telemetry (saturated / flushed fractions).  Runs live under
the workdir (``DIR/runs``).
Expected: both close to bf16 on this short run; E5M2's 2 mantissa bits show, if at all, as a small
positive gap (two seeds give wide intervals).
"""

from fp8jax.train.defaults import tiny_comparison_config


def get_config():
    return tiny_comparison_config(
        "formats",
        {
            "bf16": dict(recipe="bf16"),
            "fine_e4m3": dict(recipe="deepseek_v3"),
            "fine_hybrid": dict(recipe="fine_hybrid"),
        },
        notes=(
            "Tiny MoE model, stdlib corpus. fine_e4m3 = the deepseek_v3 recipe (E4M3 everywhere); "
            "fine_hybrid = the same tiles/blocks and online scaling with E5M2 for the "
            "gradient dy in Dgrad and Wgrad (built with dataclasses.replace on the QuantSpecs)."
        ),
    )
