r"""deepseek_v3 vs bf16 on BPE tokens (configs/small_bpe.py), paired over seeds.

Needs the token directory of configs/small_bpe.py (its docstring has the
`fp8jax data prepare` command).

Command:
  python experiments/compare_recipes.py --config=configs/compare/small_bpe.py --workdir=/tmp/fp8jax_cmp/small_bpe

What it prints: progress lines per run, then the results table: deepseek_v3's
paired gap to bf16 per seed (validation loss in nats per token), its mean and
95% t-interval over the seeds, and whether the interval lies within +-0.25%
("cannot resolve 0.25%" when it is wider than 0.5%).  Seeds: the default
0-3; more with --config=configs/compare/small_bpe.py:0-15.  Runs live under
the workdir (``DIR/runs``).
"""

from pathlib import Path

from fp8jax.train.defaults import comparison_block, config_file, parse_seeds, set_comparison_eval


def get_config(seeds: str = "0-3"):
    c = config_file(Path(__file__).parents[1] / "small_bpe.py")
    set_comparison_eval(c)
    c.compare = comparison_block(
        "small_bpe",
        dict(bf16=dict(recipe="bf16"), deepseek_v3=dict(recipe="deepseek_v3")),
        notes=(
            "configs/small_bpe.py (ModelConfig.small with an 8192-entry BPE vocabulary, 150 "
            "steps of 8 x 128 tokens of the stdlib corpus, AdamW with BF16 moments): the "
            "DeepSeek-V3 recipe vs BF16."
        ),
        seeds=parse_seeds(seeds),
    )
    return c
