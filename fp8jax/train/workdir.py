"""A run's workdir: what a run that fails before its first checkpoint leaves behind,
and the line that tells a user what a run left (:func:`outputs_line`).

A run that stops before it saved any checkpoint (a crash, an allocation that
fails, Ctrl-C during compilation) has nothing to resume, yet its
``config.json`` would make the corrected command refuse the workdir ("holds a
run with another config").  :func:`removed_unless_checkpointed` removes what
such a run created, so the next command may reuse the workdir.  What was
there before the run is never touched, and a workdir holding a checkpoint is
kept whole.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fp8jax.train.checkpoint import Checkpointer


@contextmanager
def removed_unless_checkpointed(
    workdir: str | Path, keep_on: tuple[type[BaseException], ...] = ()
) -> Iterator[Path]:
    """Create ``workdir``; if the block raises before a checkpoint exists, remove what it made.

    Entries that existed before are kept; a workdir this call created goes
    when it is left empty.  Exceptions of the ``keep_on`` types keep
    everything (e.g. a divergence, whose log tells what happened).  The
    exception is re-raised in every case.
    """
    path = Path(workdir)
    before = set(os.listdir(path)) if path.is_dir() else None
    path.mkdir(parents=True, exist_ok=True)
    try:
        yield path
    except keep_on:
        raise
    except BaseException:
        if not Checkpointer.steps_in(path):
            _remove_new(path, before or set())
            if before is None:
                try:
                    path.rmdir()
                except OSError:
                    # Not empty (another process's lock, say) or already gone.
                    pass
        raise


def _remove_new(path: Path, before: set[str]) -> None:
    try:
        names = os.listdir(path)
    except OSError:
        return
    for name in names:
        # Lock files belong to whoever holds them; the lock removes its own.
        if name in before or name.startswith(".lock"):
            continue
        p = path / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            try:
                p.unlink()
            except OSError:
                pass


def outputs_line(workdir: str | Path) -> str:
    """One line naming ``workdir`` and what a run keeps there, with the next command.

    e.g. ``outputs in /tmp/run: checkpoints/ (steps 40, 60), metrics.jsonl, config.json,
    tb/ (TensorBoard); evaluate: python experiments/evaluate.py --workdir=/tmp/run``
    """
    path = Path(workdir)
    parts = []
    steps = Checkpointer.steps_in(path)
    if steps:
        parts.append(
            f"checkpoints/ (step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))})"
        )
    parts += [name for name in ("metrics.jsonl", "config.json") if (path / name).is_file()]
    if (path / "tb").is_dir():
        parts.append("tb/ (TensorBoard)")
    held = ", ".join(parts) if parts else "nothing yet"
    return f"outputs in {path}: {held}; evaluate: python experiments/evaluate.py --workdir={path}"
