"""Training: AdamW (FP32 master weights, optional BF16 moments), a jitted step that
replaces FP8 delayed-scaling state by its gradient, orbax checkpoints, metrics, the
``train(config, workdir)`` loop and the recipes x seeds comparison driver."""

from fp8jax.train.compare import run_comparison
from fp8jax.train.loop import train

__all__ = ["run_comparison", "train"]
