"""Training: AdamW (FP32 master weights, optional BF16 moments), a jitted step that
replaces FP8 delayed-scaling state by its gradient, orbax checkpoints, metrics and the
``train(config, workdir)`` loop.

The package imports nothing on its own: ``fp8jax.train.step`` (the jitted step, what
benchmarks use) needs no config or logging library, while ``fp8jax.train.loop`` (the
loop, configs, TensorBoard) needs ml_collections and tensorboardX.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    # ``fp8jax.train.train`` on first use, so that importing a submodule does not
    # load the loop and its dependencies.
    if name == "train":
        from fp8jax.train.loop import train

        return train
    raise AttributeError(f"module 'fp8jax.train' has no attribute {name!r}")


__all__ = ["train"]
