r"""Tiny run: the CI smoke test (seconds of training on a CPU, plus compilation).

Command:
  python experiments/train.py --config=configs/tiny.py --workdir=/tmp/fp8jax_tiny

What it prints: the resolved mesh, the compilation and the time it took, then a
progress line every 10 steps, e.g.
  mesh data=1 x fsdp=1 x expert=1 on 1 cpu device(s), 1 process(es)
  compiling the training step ...
  compiled the training step in 20.1 s (with step 1)
  step 1/60 | loss 5.97 | - steps/s | - tok/s | ETA ?
  ...
  step 50/60 | loss 2.85 | val 2.80 @40 | 37.5 steps/s | 18,900 tok/s | ETA 0s
ending with
  step 60/60 | loss ~2.6 | val ~2.72 @60 | ...
  summary: {"recipe": "deepseek_v3", "steps": 60, "train_loss_final_window_mean": ~2.60, "final_window": 3, "final_val_loss": ~2.72, ...}
(``val ... @40``: the latest validation loss and its step; train_loss_final_window_mean:
the mean training loss of the last final_window = 3 logged steps).  The same command
again prints ``already complete: {...}``.  Takes about 30 s on an idle 2-core CPU
(compilation ~20 s, 60 steps at ~38 steps/s; a rerun with the compilation cache
in ~/.cache/fp8jax is faster, also with another --config.steps: the run's length is
an input of the compiled step).  The loss falls from ~5.5 (ln 256) to about 2.6
on the default stdlib corpus.
Override any field on the command line, e.g. --config.recipe=bf16 --config.steps=100.

On 8 simulated CPU devices, data x FSDP x expert parallel (FP8 expert dispatch
and FP8 weight gathers):
  XLA_FLAGS=--xla_force_host_platform_device_count=8 python experiments/train.py \
    --config=configs/tiny.py --workdir=/tmp/fp8jax_tiny8 \
    --config.mesh.data=2 --config.mesh.fsdp=2 --config.mesh.expert=2
prints "mesh data=2 x fsdp=2 x expert=2 on 8 cpu device(s), 1 process(es)" first and
ends at train_loss_final_window_mean ~2.60, final_val_loss ~2.71 (one device: 2.60 /
2.72), in about 50 s on a shared 2-core CPU.  Sizes that do not multiply to the device
count, or a batch that does not split over them, are refused in one line.
All fields and their defaults: python experiments/train.py --help.
All fields and their meaning: fp8jax/train/defaults.py.
"""

from fp8jax.train.defaults import base_config


def get_config():
    # The schema's defaults are this run: every field, its default and meaning
    # in fp8jax/train/defaults.py.  Written out here, the fields that make it:
    c = base_config()
    c.model = "tiny"  # ModelConfig.tiny: d_model 64, 2 layers, 8 experts top-2
    c.recipe = "deepseek_v3"  # 1x128 / 128x128 E4M3 (fp8jax.recipes)
    c.data.source = "stdlib"  # the interpreter's standard library as bytes (no download)
    c.seq_len = 64  # bytes per row
    c.batch_size = 8  # rows per step
    c.steps = 60
    c.lr = 3e-3  # peak learning rate
    c.warmup_steps = 10  # linear warm-up, then cosine decay to 0.1 x lr
    c.eval_every = 20  # validation loss every 20 steps ...
    c.eval_batches = 2  # ... on 2 batches ...
    c.eval_batch_size = 8  # ... of 8 rows
    c.log_every = 10  # a progress line and a metrics row every 10 steps
    c.final_window = 3  # final train loss: mean of the last 3 logged steps
    return c
