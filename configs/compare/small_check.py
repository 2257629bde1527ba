r"""A quick check on configs/small.py: deepseek_v3 vs bf16, three seeds each.

Three seeds cannot resolve 0.25% on this config (the paired gap varies by about
0.5% from seed to seed); configs/compare/headline.py runs enough seeds.

Command:
  python experiments/compare_recipes.py --config=configs/compare/small_check.py --workdir=/tmp/fp8jax_cmp/small_check

What it prints: progress lines per run, then the results table: deepseek_v3's
paired gap to bf16 per seed, its mean and 95% t-interval over the three seeds,
and whether the interval lies within +-0.25% ("cannot resolve 0.25%" when it
is wider than 0.5%).  Runs live under the workdir (``DIR/runs``).
"""

from pathlib import Path

from fp8jax.train.defaults import comparison_block, config_file, set_comparison_eval


def get_config():
    c = config_file(Path(__file__).parents[1] / "small.py")
    set_comparison_eval(c)
    c.compare = comparison_block(
        "small_check",
        dict(bf16=dict(recipe="bf16"), deepseek_v3=dict(recipe="deepseek_v3")),
        notes=(
            "configs/small.py (ModelConfig.small, ~9M params, 150 steps of 8 x 128 bytes of "
            "the stdlib corpus, AdamW with BF16 moments): the DeepSeek-V3 recipe vs BF16."
        ),
        seeds=(0, 1, 2),
    )
    return c
