"""Checkpoints: an orbax CheckpointManager in ``<workdir>/checkpoints``.

The whole :class:`~fp8jax.train.state.TrainState` is saved: step, FP32
master weights, AdamW moments (in their stored dtype, BF16 or FP32), the FP8
delayed-scaling state (amax histories and scales) and the router biases.
Data batches are a pure function of the step (:mod:`fp8jax.data.corpus`), so
restoring the state is enough to continue bit-for-bit: a run stopped at step
k and resumed reaches step n with exactly the losses of an uninterrupted run.
"""

from __future__ import annotations

from pathlib import Path

import jax
import orbax.checkpoint as ocp

from fp8jax.train.state import TrainState


class Checkpointer:
    """Thin wrapper: save every ``every`` steps, keep ``keep``, restore the latest."""

    def __init__(self, workdir: str | Path, every: int = 0, keep: int = 2):
        self.directory = Path(workdir).absolute() / "checkpoints"
        self.every = int(every)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            create=True,
            # Synchronous saves: a checkpoint is complete when save() returns,
            # so a run killed right after cannot leave a half-written latest.
            enable_async_checkpointing=False,
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, state: TrainState, *, force: bool = False) -> bool:
        step = int(jax.device_get(state.step))
        if not force and (self.every <= 0 or step % self.every):
            return False
        if step in self.manager.all_steps():
            return False
        self.manager.save(step, args=ocp.args.StandardSave(state), force=True)
        self.manager.wait_until_finished()
        return True

    def restore(self, template: TrainState, step: int | None = None) -> TrainState:
        """Restore into the structure, shapes and dtypes of ``template``."""
        step = self.manager.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
        return self.manager.restore(step, args=ocp.args.StandardRestore(abstract))

    def close(self) -> None:
        self.manager.close()
