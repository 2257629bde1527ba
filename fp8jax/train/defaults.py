"""The training config schema with its defaults (configs/*.py start from these).

``base_config()`` lists every field :func:`fp8jax.train.loop.train` reads;
``tiny_config()`` / ``small_config()`` / ``gpu_config()`` are the three sizes
the ``configs/`` files expose (they live here so comparison configs can build
on them by import, whatever directory the entry point runs from).
"""

from __future__ import annotations

import ml_collections


def base_config() -> ml_collections.ConfigDict:
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

    c.seq_len = 64  # tokens per row fed to the model (<= max_seq_len; <= 0: max_seq_len)
    c.batch_size = 8
    c.microbatches = 1  # gradient accumulation: batch_size must divide by this
    c.steps = 60
    c.seed = 0  # model init
    c.data_seed = -1  # batch order; -1: same as seed

    # AdamW (DeepSeek-V3 betas), warm-up + cosine decay to min_lr_ratio * lr.
    c.lr = 3e-3
    c.warmup_steps = 10
    c.min_lr_ratio = 0.1
    c.b1 = 0.9
    c.b2 = 0.95
    c.eps = 1e-8
    c.weight_decay = 0.1
    c.clip_norm = 1.0  # global norm of the Param gradients (FP8 state is never clipped)
    c.moment_dtype = "bfloat16"  # AdamW mu and nu storage (DeepSeek-V3: BF16)

    # Delayed-scaling stress knobs (outlier experiments); off by default.
    c.fp8_reset_every = 0  # reset FP8 state to fresh (scale 1) every this many steps
    c.fp8_amax_growth = 1.0  # stored amax lags the tensor's by this factor each step

    c.eval_every = 20
    c.eval_batches = 2
    c.eval_batch_size = 8
    c.log_every = 10
    c.final_window = 3  # final train loss = mean over the last this-many *logged* steps
    c.checkpoint_every = 0  # 0: only at the end
    c.keep_checkpoints = 2
    c.tensorboard = True

    # Device mesh (fp8jax.parallel): axis sizes, one may be -1 ("the rest");
    # the default is data parallelism over every device.  batch_size and
    # eval_batch_size must divide by the device count.  num_processes > 1
    # (or JAX_COORDINATOR_ADDRESS in the environment) runs
    # jax.distributed.initialize first; coordinator_address "" and
    # process_id -1 leave them to the environment / cluster detection.
    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = -1
    c.mesh.fsdp = 1
    c.mesh.expert = 1
    c.mesh.num_processes = 1
    c.mesh.coordinator_address = ""
    c.mesh.process_id = -1
    return c


def tiny_config() -> ml_collections.ConfigDict:
    """ModelConfig.tiny (d_model 64, 2 layers, 8 experts top-2), 60 steps of 8 x 64 bytes."""
    return base_config()


def small_config() -> ml_collections.ConfigDict:
    """ModelConfig.small (d_model 256, 4 layers, ~9M params), 8 x 128 bytes per step."""
    c = base_config()
    c.model = "small"
    c.seq_len = 128
    c.batch_size = 8
    c.steps = 150
    c.lr = 2e-3
    c.warmup_steps = 15
    c.eval_every = 50
    c.eval_batches = 4
    c.eval_batch_size = 16
    c.log_every = 10
    c.final_window = 10
    c.checkpoint_every = 50
    return c


def gpu_config() -> ml_collections.ConfigDict:
    """ModelConfig.gpu_1b (~1B params, MLA, 64 experts top-6) with a byte vocabulary."""
    c = base_config()
    c.model = "gpu_1b"
    # Byte-level data: 256 tokens, not the preset's 32k vocabulary.
    c.model_overrides = ml_collections.ConfigDict({"vocab_size": 256})
    c.seq_len = 2048
    c.batch_size = 32
    c.microbatches = 4
    c.steps = 5000
    c.lr = 4e-4
    c.warmup_steps = 500
    c.eval_every = 250
    c.eval_batches = 8
    c.eval_batch_size = 8
    c.log_every = 10
    c.final_window = 50
    c.checkpoint_every = 500
    return c


def tiny_comparison_config(
    name: str, runs: dict, notes: str, *, seeds=(0, 1)
) -> ml_collections.ConfigDict:
    """The tiny model's 120-step comparison setup shared by formats/scaling/granularity.

    ``runs`` maps a label to {"recipe": ...}; "bf16" must be one of them (the
    baseline).  All tiny comparisons share one run_root, so a run that two
    comparisons contain (same config) is trained once.
    """
    c = tiny_config()
    c.steps = 120
    c.warmup_steps = 12
    c.eval_every = 30
    c.log_every = 3
    c.eval_batches = 4
    c.eval_batch_size = 8
    c.final_window = 10
    c.compare = ml_collections.ConfigDict(
        dict(
            name=name,
            labels=list(runs),
            baseline="bf16",
            run_root="/tmp/fp8jax_cmp/runs_tiny",
            seeds=list(seeds),
            notes=notes,
            runs=ml_collections.ConfigDict(runs),
        )
    )
    return c
