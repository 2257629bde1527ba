r"""GPU-sized run: ModelConfig.gpu_1b (~1B parameters) with a byte vocabulary.

Command (one NVIDIA GPU with FP8 support, `pip install -e ".[gpu]"`):
  python experiments/train.py --config=configs/gpu.py --workdir=/tmp/fp8jax_gpu

What it prints: progress lines every 10 steps with steps/s, tokens/s and the
ETA for 5,000 steps of 32 x 2048 bytes (4 microbatches of 8).  Not run on CPU
(the first step alone would take hours there).
"""

from fp8jax.train.defaults import base_config


def get_config():
    # The schema: every field, its default and meaning (fp8jax/train/defaults.py).
    # This run sets the fields below; the rest keep their defaults.
    c = base_config()
    c.model = "gpu_1b"  # ModelConfig.gpu_1b: ~1B parameters, MLA, 64 experts top-6
    c.seq_len = 2048  # bytes per row
    c.batch_size = 32  # rows per step ...
    c.microbatches = 4  # ... in 4 accumulated microbatches of 8
    c.steps = 5000
    c.lr = 4e-4  # peak learning rate
    c.warmup_steps = 500  # linear warm-up, then cosine decay to 0.1 x lr
    c.eval_every = 250  # validation loss every 250 steps ...
    c.eval_batches = 8  # ... on 8 batches ...
    c.eval_batch_size = 8  # ... of 8 rows
    c.log_every = 10  # a progress line and a metrics row every 10 steps
    c.final_window = 50  # final train loss: mean of the last 50 logged steps
    c.checkpoint_every = 500  # resumable every 500 steps
    return c
