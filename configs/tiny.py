r"""Tiny run: the CI smoke test (seconds on a CPU).

Command:
  python experiments/train.py --config=configs/tiny.py --workdir=/tmp/fp8jax_tiny

What it prints: a progress line per log interval, e.g.
  step 10/60 | loss 4.8 | 3.1 steps/s | 1,600 tok/s | ETA 16s
ending near
  step 60/60 | loss ~3.0 | val ~3.0 | ...
and then a one-line summary (final train/val loss, tokens/s).  The loss falls
from ~5.5 (ln 256) to about 3 on the default stdlib corpus.  Override any
field on the command line, e.g. --config.recipe=bf16 --config.steps=100.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    # Model: a fp8jax.models.ModelConfig preset, plus dataclasses.replace overrides.
    c.model = "tiny"
    c.model_overrides = ml_collections.ConfigDict()
    # Recipe: a preset of fp8jax.recipes or a variant of fp8jax.train.variants.
    c.recipe = "deepseek_v3"

    # Data: "stdlib" (the interpreter's standard library sources/docs, no
    # download), "text" (data.path: a file or a folder), or "synthetic".
    c.data = ml_collections.ConfigDict()
    c.data.source = "stdlib"
    c.data.path = ""
    c.data.val_fraction = 0.05
    c.data.max_bytes = 0  # 0: the whole corpus
    c.data.seed = 0  # synthetic source only

    c.seq_len = 64  # <= 0: the model's max_seq_len
    c.batch_size = 8
    c.microbatches = 1
    c.steps = 60
    c.seed = 0  # model init
    c.data_seed = -1  # batch order; -1: same as seed

    # AdamW (DeepSeek-V3 betas), warm-up + cosine to min_lr_ratio * lr.
    c.lr = 3e-3
    c.warmup_steps = 10
    c.min_lr_ratio = 0.1
    c.b1 = 0.9
    c.b2 = 0.95
    c.eps = 1e-8
    c.weight_decay = 0.1
    c.clip_norm = 1.0
    c.moment_dtype = "bfloat16"  # AdamW moments (DeepSeek-V3: BF16); "float32" also works

    # Delayed-scaling stress knobs (outlier experiments); off here.
    c.fp8_reset_every = 0
    c.fp8_amax_growth = 1.0

    c.eval_every = 20
    c.eval_batches = 2
    c.eval_batch_size = 8
    c.log_every = 10
    c.final_window = 10  # final train loss = mean of the last this-many logged steps
    c.checkpoint_every = 0  # 0: only at the end
    c.keep_checkpoints = 2
    c.tensorboard = True
    return c
