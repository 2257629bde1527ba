r"""The headline: deepseek_v3, its pow2x variant, hybrid_delayed and current_tensor vs bf16 on configs/small.py.

Command (all seeds, one process):
  python experiments/compare_recipes.py --config=configs/compare/headline.py --workdir=/tmp/fp8jax_cmp/headline

The argument after the file name picks the seeds ("0-23" by default, or a
comma list such as "0,2,4"), so two processes can share one workdir, each
training its own seeds; the command above then re-reads every finished run
and tabulates all of them:
  python experiments/compare_recipes.py --config=configs/compare/headline.py:0-23:2 ...   (even)
  python experiments/compare_recipes.py --config=configs/compare/headline.py:1-23:2 ...   (odd)

What it prints: a progress line per run and logged step, then the table of
results.md: per recipe the paired relative gap of the final validation loss
(65,536+ held-out tokens) to bf16, per seed, its mean and 95% t-interval, and
the verdict on +-0.25%.  How many seeds +-0.25% needs follows from the spread of
the paired gap on this model (experiments/results/headline/README.md gives the
measured spread and the count it implies).  The runs of one table come from one
commit and a clean tree (the comparison refuses anything else): to add seeds to
the committed runs, run from a checkout of their commit, e.g.
  git worktree add --detach /tmp/fp8jax_at_7adfe88 7adfe88
"""

from pathlib import Path

from fp8jax.train.defaults import comparison_block, config_file, parse_seeds, set_comparison_eval


def get_config(seeds: str = "0-23"):
    c = config_file(Path(__file__).parents[1] / "small.py")
    set_comparison_eval(c)
    c.compare = comparison_block(
        "headline",
        dict(
            bf16=dict(recipe="bf16"),
            deepseek_v3=dict(recipe="deepseek_v3"),
            deepseek_v3_pow2x=dict(recipe="deepseek_v3_pow2x"),
            hybrid_delayed=dict(recipe="hybrid_delayed"),
            current_tensor=dict(recipe="current_tensor"),
        ),
        notes=(
            "configs/small.py (ModelConfig.small, ~9M params, 150 steps of 8 x 128 bytes of "
            "the stdlib corpus, AdamW with BF16 moments): DeepSeek-V3's recipe (1x128 / 128x128 "
            "E4M3, power-of-two scales only at the paper's sites), its variant with power-of-two "
            "scales for every linear's activation, per-tensor delayed scaling with E4M3 forward / E5M2 gradients, and "
            "per-tensor current scaling, each against BF16 on the same seeds."
        ),
        seeds=parse_seeds(seeds),
    )
    return c
