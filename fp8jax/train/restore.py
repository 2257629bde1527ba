"""A trained run read back from its workdir: config, model and a checkpoint.

:func:`load_run` is what evaluation, sampling and the numerics studies share:
the run's own ``config.json``, the run set up on this machine's devices (data
parallelism over all of them, whatever mesh it trained on: checkpoints
restore onto any mesh) and the state of a checkpoint.  Mistakes (no run, no
checkpoint, a step that was not kept) raise a one-line
:class:`~fp8jax.train.defaults.ConfigError`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import ml_collections

from fp8jax.parallel.mesh import DEFAULT_SIZES
from fp8jax.train.checkpoint import Checkpointer
from fp8jax.train.defaults import ConfigError
from fp8jax.train.loop import Run, setup
from fp8jax.train.state import TrainState


def run_config(run_dir: str | Path) -> ml_collections.ConfigDict:
    """The training config recorded in ``<run_dir>/config.json``."""
    path = Path(run_dir) / "config.json"
    try:
        return ml_collections.ConfigDict(json.loads(path.read_text())["config"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(
            f"{path}: not a training run's config ({type(e).__name__}); give the --workdir "
            "of a run made by experiments/train.py"
        ) from None


def load_run(
    run_dir: str | Path, step: int | None = None, say: Callable[[str], None] = print
) -> tuple[Run, TrainState, int]:
    """(run, restored state, its step) of the checkpoint ``step`` (default: the newest usable).

    A checkpoint that does not read or holds non-finite values is unusable
    (:meth:`~fp8jax.train.checkpoint.Checkpointer.restore_for_reading`):
    a named step then raises CheckpointError; the default passes over it
    with a note through ``say``.

    The run is set up on every device of this process (one process, the
    default mesh: only mesh fields change, the config check of a resume
    holds); its batch sizes must split over those devices.
    """
    run_dir = Path(run_dir)
    cfg = run_config(run_dir)
    with cfg.unlocked():
        # Restored onto this machine: all devices data-parallel, one process.
        for axis, size in DEFAULT_SIZES.items():
            cfg.mesh[axis] = size
        cfg.mesh.num_processes, cfg.mesh.coordinator_address, cfg.mesh.process_id = 1, "", -1
    run = setup(cfg, run_dir)
    ckpt = Checkpointer(run_dir)
    try:
        kept = ckpt.all_steps()
        if not kept:
            raise ConfigError(f"{run_dir} holds no checkpoint: train the run first")
        if step is not None and step not in kept:
            raise ConfigError(
                f"{run_dir} keeps no checkpoint of step {step}; kept: {', '.join(map(str, kept))}"
            )
        # Training's integrity rule; a reader moves nothing aside.
        state, step = ckpt.restore_for_reading(run.state, None if step is None else int(step), say)
    finally:
        ckpt.close()
    return run, state, step
