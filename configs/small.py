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

from fp8jax.train.defaults import base_config


def get_config():
    # The schema: every field, its default and meaning (fp8jax/train/defaults.py).
    # This run sets the fields below; the rest keep their defaults (recipe
    # deepseek_v3, the stdlib byte corpus, AdamW with BF16 moments, ...).
    c = base_config()
    c.model = "small"  # ModelConfig.small: d_model 256, 4 layers (1 dense, 3 MoE), ~9M params
    c.seq_len = 128  # bytes per row
    c.batch_size = 8  # rows per step
    c.steps = 150  # 150 x 8 x 128 = 153,600 training bytes
    c.lr = 2e-3  # peak learning rate
    c.warmup_steps = 15  # linear warm-up, then cosine decay to 0.1 x lr
    c.eval_every = 50  # validation loss every 50 steps ...
    c.eval_batches = 4  # ... on 4 batches ...
    c.eval_batch_size = 16  # ... of 16 rows (8,128 held-out predictions)
    c.log_every = 10  # a progress line and a metrics row every 10 steps
    c.final_window = 10  # final train loss: mean of the last 10 logged steps
    c.checkpoint_every = 50  # resumable every 50 steps
    return c
