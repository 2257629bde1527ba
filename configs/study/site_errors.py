r"""GEMM error of deepseek_v3 at each of its scale sites, its power-of-two variant and DeepSeek's act_quant.

Commands:
  python experiments/study.py --config=configs/study/site_errors.py --out_dir=experiments/results/recipe_sites
  python experiments/study.py --config=configs/study/site_errors.py --run=RUN   # adds a trained run's captured tensors

What it prints: "<inputs>, seed <s>: done" per draw, then the Markdown table:
per input kind ("massive3", "lognormal", and a run's captured sites) and
quantization (DeepSeek's act_quant numpy reference, deepseek_v3 at a general
linear and at each scale site, deepseek_v3_pow2x, attn_out_e5m6_unscaled) the
relative error of Fprop y, Dgrad dx and Wgrad dW per draw, and the ratios of y
and dW to the reference's per draw with their geometric mean and its 95% interval
over the draws.  --out_dir=DIR writes
DIR/table.md and DIR/results.json (every value).  Logic:
fp8jax.numerics.studies.site_errors.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.study = "site_errors"  # fp8jax.numerics.studies.site_errors
    c.m = 384  # tokens (a multiple of 128)
    c.k = 1024  # input features (a multiple of 128)
    c.n = 512  # output features (a multiple of 128)
    c.seeds = "0,1,2"  # seeds of the synthetic inputs, one draw each, comma-separated
    return c
