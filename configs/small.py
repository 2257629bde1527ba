r"""Small run: the default research size on CPU (minutes on 2 cores).

Command:
  python experiments/train.py --config=configs/small.py --workdir=/tmp/fp8jax_small
  (baseline: add --config.recipe=bf16)

What it prints: progress lines every 10 steps, e.g.
  step 70/150 | loss 2.13 | val 2.27 @50 | 1.83 steps/s | 1,860 tok/s | ETA 44s
and a summary line with final_val_loss ~1.90 (nats/byte).  Takes 1-2.5 minutes
on an idle 2-core CPU (bf16 ~1.5 min, deepseek_v3 ~2.3 min, compilation
included).  Recipes against bf16 on this config, with intervals over 20+
seeds: experiments/results/headline (configs/compare/headline.py).
"""

from fp8jax.train.defaults import small_config


def get_config():
    return small_config()
