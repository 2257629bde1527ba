r"""Tiny run: the CI smoke test (1 min idle to 5+ min loaded on 2 cores, mostly compiling).

Command:
  python experiments/train.py --config=configs/tiny.py --workdir=/tmp/fp8jax_tiny

What it prints: the resolved mesh, the compilation and the time it took, then a
progress line every 10 steps, e.g.
  mesh data=1 x fsdp=1 x expert=1 on 1 cpu device(s), 1 process(es)
  compiling the training step ...
  compiled the training step in 38.9 s (with step 1)
  step 1/60 | loss 6.3762 | - steps/s | - tok/s | ETA ?
  step 10/60 | loss 3.6599 | 21.54 steps/s | 10,858 tok/s | ETA 2s
  ...
  step 60/60 | loss 2.7680 | val 2.7422 @60 | 26.64 steps/s | 13,425 tok/s | ETA 0s
  summary: {"recipe": "deepseek_v3", "steps": 60, "train_loss_final_window_mean": 2.8587, "final_window": 3, "final_val_loss": 2.7422, ...}
  outputs in /tmp/fp8jax_tiny: checkpoints/ (step 60), metrics.jsonl, config.json, tb/ (TensorBoard); evaluate: ...
(``val ... @60``: the latest validation loss and its step; train_loss_final_window_mean:
the mean training loss of the last final_window = 3 logged steps; the values were
printed on a 2-core Intel Xeon 6/167, other CPUs can differ in the last digits;
tests/test_config_examples.py checks the first lines and step 1's loss to 0.01).  The same command
again prints ``already complete: {...}`` without building the model.  Measured: 69 s
wall (compilation 39 s, 60 steps at ~27 steps/s) on that Xeon shared with other jobs
(load average 5-11); on a 2-core AMD EPYC, 69 s wall with compilation 36 s idle (load
average below 1) and 4 min 47 s with compilation 154 s loaded (load average 5-8),
nothing in the compilation cache; a rerun with the compilation cache in ~/.cache/fp8jax compiles in
a few seconds, also with another --config.steps (the run's length is an input of the
compiled step).  The loss starts near 6.4 (above ln 256 = 5.55, the loss of a uniform
guess: the initial logits are not flat) and ends near 2.86 on the default stdlib corpus.
Override any field on the command line, e.g. --config.recipe=bf16 --config.steps=100.

On 8 simulated CPU devices, data x FSDP x expert parallel (FP8 expert dispatch
and FP8 weight gathers):
  XLA_FLAGS=--xla_force_host_platform_device_count=8 python experiments/train.py \
    --config=configs/tiny.py --workdir=/tmp/fp8jax_tiny8 \
    --config.mesh.data=2 --config.mesh.fsdp=2 --config.mesh.expert=2
prints "mesh data=2 x fsdp=2 x expert=2 on 8 cpu device(s), 1 process(es)" first and
ends at train_loss_final_window_mean 2.8579, final_val_loss 2.7433 (one device: 2.8587 /
2.7422), in 3 min 40 s on the same shared Xeon (load average 11; the 8 simulated devices
share its 2 cores).  Sizes that do not multiply to the device
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
