r"""Tiny run: the CI smoke test (seconds of training on a CPU, plus compilation).

Command:
  python experiments/train.py --config=configs/tiny.py --workdir=/tmp/fp8jax_tiny

What it prints: a progress line every 10 steps, e.g.
  step 50/60 | loss 2.85 | val 2.80 @40 | 37.5 steps/s | 18,900 tok/s | ETA 0s
ending with
  step 60/60 | loss ~2.6 | val ~2.72 @60 | ...
  summary: {"recipe": "deepseek_v3", "steps": 60, "train_loss_last3_mean": ~2.60, "final_val_loss": ~2.72, ...}
(``val ... @40``: the latest validation loss and its step; train_loss_last3_mean:
the mean training loss of the last 3 logged steps).  The same command again
prints ``already complete: {...}``.  Takes about 30 s on an idle 2-core CPU
(compilation ~20 s, 60 steps at ~38 steps/s; a rerun with the compilation cache
in ~/.cache/fp8jax is faster).  The loss falls from ~5.5 (ln 256) to about 2.6
on the default stdlib corpus.
Override any field on the command line, e.g. --config.recipe=bf16 --config.steps=100.

On 8 simulated CPU devices, data x FSDP x expert parallel (FP8 expert dispatch
and FP8 weight gathers):
  XLA_FLAGS=--xla_force_host_platform_device_count=8 python experiments/train.py \
    --config=configs/tiny.py --workdir=/tmp/fp8jax_tiny8 \
    --config.mesh.data=2 --config.mesh.fsdp=2 --config.mesh.expert=2
ends at final_train_loss ~2.60, final_val_loss ~2.71 (one device: 2.60 / 2.72), in
about 50 s on a shared 2-core CPU.
All fields and their meaning: fp8jax/train/defaults.py.
"""

from fp8jax.train.defaults import tiny_config


def get_config():
    return tiny_config()
