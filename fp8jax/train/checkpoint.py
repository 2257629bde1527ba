"""Checkpoints: an orbax CheckpointManager in ``<workdir>/checkpoints``.

The whole :class:`~fp8jax.train.state.TrainState` is saved: step, FP32
master weights, AdamW moments (in their stored dtype, BF16 or FP32), the FP8
delayed-scaling state (amax histories and scales) and the router biases.
Data batches are a pure function of the step (:mod:`fp8jax.data.corpus`), so
restoring the state is enough to continue bit-for-bit: a run stopped at step
k and resumed reaches step n with exactly the losses of an uninterrupted run.

The training loop saves only states whose loss and gradient norm were finite
(:mod:`fp8jax.train.loop`), so the kept checkpoints are the last good ones.
Each save records the SHA-256 of every array (:mod:`fp8jax.train.checksums`)
in the step's own metadata file, written before orbax renames the step into
place.  Every reader checks a step before using it (:meth:`Checkpointer.try_restore`):
it must read, match its checksums (bytes damaged into other finite values
are caught here) and be finite.  :meth:`Checkpointer.restore_latest` falls
back to the previous checkpoint when the latest is unusable, moving the bad
one to ``<workdir>/checkpoints_unreadable/`` (kept for inspection, out of the
way of the next save at that step).  A step saved before checkpoints
recorded checksums is read unverified, with a note: refusing it would strand
every earlier run, and its values still pass the finiteness check.

A full disk: :meth:`Checkpointer.save` checks the free space against the
size of the newest kept checkpoint (the next one is as large; with none, half
the parameters' bytes) before writing anything, and turns the error of a save that still runs out of space into a
:class:`DiskFull` naming the path and the space needed, after removing the
partial checkpoint; the kept ones stay, so the run resumes from the last good
checkpoint once there is room.

:func:`run_lock` keeps two processes from training the same run directory at
once (they would interleave their metrics and overwrite each other's
checkpoints): a lock file per JAX process holds the owner's host and pid.
"""

from __future__ import annotations

import errno
import gc
import io
import json
import logging
import os
import shutil
import socket
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, redirect_stderr
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from fp8jax.process_liveness import owner_alive
from fp8jax.train import checksums
from fp8jax.train.state import TrainState


class CheckpointError(RuntimeError):
    """No readable checkpoint where one was expected (one-line message with the fix)."""


class RunInUse(CheckpointError):
    """Another live process is training the same run directory."""


class DiskFull(OSError):
    """No room for a checkpoint: ``filename`` is where it goes, ``needed`` / ``free`` in bytes."""

    def __init__(self, path: Path, needed: int, free: int | None):
        super().__init__(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        self.needed = int(needed)
        self.free = free


def free_bytes(path: str | Path) -> int:
    """Bytes free for this user on the filesystem that holds ``path`` (the disk's own answer)."""
    return shutil.disk_usage(path).free


def tree_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (0 when it does not exist)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def is_disk_full(e: BaseException) -> bool:
    """Whether ``e`` says the disk is full: an ENOSPC / EDQUOT OSError, or the same errno in
    the message of tensorstore's error (orbax raises it as ``ValueError: RESOURCE_EXHAUSTED:
    ... No space left on device [os_error_code='28']``)."""
    codes = (errno.ENOSPC, errno.EDQUOT)
    if isinstance(e, OSError) and e.errno in codes:
        return True
    text = str(e)
    return any(f"os_error_code='{c}'" in text for c in codes) or os.strerror(errno.ENOSPC) in text


@contextmanager
def run_lock(workdir: str | Path, process_index: int = 0) -> Iterator[Path]:
    """Hold ``<workdir>/.lock.<process_index>`` while training; RunInUse if it is held.

    A lock left by a process that no longer runs on this host is taken over
    (a killed run leaves its lock behind); one from another host is refused,
    with the path to remove once that run is known to be gone.
    """
    path = Path(workdir) / f".lock.{process_index}"
    host = socket.gethostname()
    # The lock is made by hard-linking a file that already holds the owner,
    # so it never exists empty: a reader cannot mistake a lock being created
    # for an unreadable one and take it over.
    mine = path.with_name(f"{path.name}.{host}.{os.getpid()}")
    mine.write_text(f"{host} {os.getpid()}\n")
    try:
        for _ in range(2):
            try:
                os.link(mine, path)
                break
            except FileExistsError:
                pass
            try:
                owner_host, owner_pid = path.read_text().split()
                pid = int(owner_pid)
            except (OSError, ValueError):
                # An unreadable (or vanished) lock names no owner: taken over.
                owner_host, pid = host, -1
            if (pid > 0 or owner_host != host) and owner_alive(owner_host, pid):
                raise RunInUse(
                    f"{workdir} is being trained by process {pid} on {owner_host}; wait for "
                    f"it to finish, or remove {path} if that process is gone"
                )
            path.unlink(missing_ok=True)
        else:
            # Another process took the freed lock first.
            raise RunInUse(f"{workdir}: another process took its lock {path}; try again later")
    finally:
        mine.unlink(missing_ok=True)
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)


def all_finite(tree) -> bool:
    """True when every floating-point leaf of ``tree`` is finite (checked on the host)."""
    for leaf in jax.tree.leaves(jax.device_get(tree)):
        a = np.asarray(leaf)
        # Integer leaves (the step, counters) cannot be NaN; BF16 moments are
        # widened to float32 for the check (numpy has no native bfloat16 isfinite).
        if np.issubdtype(a.dtype, np.integer) or a.dtype == np.bool_:
            continue
        if not np.all(np.isfinite(a.astype(np.float32))):
            return False
    return True


def _first_line(e: BaseException) -> str:
    """The first line of the innermost cause of ``e`` (the reader's own words), shortened."""
    while e.__cause__ is not None:
        e = e.__cause__
    text = (str(e).splitlines() or [""])[0]
    # tensorstore appends its whole spec to the message: not for a one-line report.
    text = text.split(" See full TensorStore details")[0]
    return f"{type(e).__name__}: {text[:200]}"


#: orbax's metadata file in each step folder (its custom metadata holds the checksums).
STEP_METADATA = "_CHECKPOINT_METADATA"

_ORBAX_DIR = os.path.dirname(ocp.__file__)
_LOOP_CLOSED = "Event loop is closed"


def _from_orbax_reads(exc: BaseException | None, obj: object = None) -> bool:
    """Whether an error printed by a thread is the echo of a failed checkpoint read.

    Pending reads of a damaged checkpoint fail after the restore has raised:
    their coroutines (orbax's) are dropped with the error, and their
    callbacks find orbax's event loop closed.
    """
    code = getattr(obj, "cr_code", None)
    if code is not None and code.co_filename.startswith(_ORBAX_DIR):
        return True
    return isinstance(exc, RuntimeError) and str(exc) == _LOOP_CLOSED


class _DropOrbaxTasks(logging.Filter):
    """Drops asyncio's "Task exception was never retrieved" for orbax's read tasks."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.name == "asyncio" and _ORBAX_DIR in record.getMessage())


_echoes_dropped = False


def _drop_echoes_of_failed_reads() -> None:
    """Keep the echoes of failed checkpoint reads (:func:`_from_orbax_reads`) off stderr.

    Installed once, for the rest of the process: they arrive from orbax's
    threads at any time after the restore failed.  Every other error still
    reaches the hooks that were there before.
    """
    global _echoes_dropped
    if _echoes_dropped:
        return
    _echoes_dropped = True
    unraisable, excepthook = sys.unraisablehook, sys.excepthook

    def on_unraisable(u) -> None:
        if not _from_orbax_reads(u.exc_value, u.object):
            unraisable(u)

    def on_exception(kind, value, tb) -> None:
        if not _from_orbax_reads(value):
            excepthook(kind, value, tb)

    sys.unraisablehook, sys.excepthook = on_unraisable, on_exception
    logging.getLogger("asyncio").addFilter(_DropOrbaxTasks())


@contextmanager
def _quiet_reader_threads() -> Iterator[list]:
    """Keep what orbax's reader threads print about a damaged file off stderr.

    A truncated or corrupt checkpoint makes every pending read fail; orbax
    and asyncio then print hundreds of lines (tasks never retrieved,
    coroutines ignored, a closed event loop) besides raising one exception,
    which the caller reports in one line.  While the restore runs, stderr
    and orbax's logger are muted; the echoes that come later are dropped by
    :func:`_drop_echoes_of_failed_reads`.  The caller appends to the list it
    gets when the restore failed: only then are the failed reads collected
    (a full collection takes seconds in a process holding a model).
    """
    _drop_echoes_of_failed_reads()
    absl_logger = logging.getLogger("absl")
    level = absl_logger.level
    absl_logger.setLevel(logging.CRITICAL)
    try:
        with redirect_stderr(io.StringIO()):
            failed: list = []
            try:
                yield failed
            finally:
                # Failed reads are collected here, not after stderr is back: the caller
                # lets go of the exception (and the reads its traceback holds) inside.
                if failed:
                    gc.collect()
    finally:
        absl_logger.setLevel(level)


class Checkpointer:
    """Thin wrapper: save every ``every`` steps, keep ``keep``, restore the latest readable."""

    def __init__(self, workdir: str | Path, every: int = 0, keep: int = 2):
        self.workdir = Path(workdir).absolute()
        self.directory = self.workdir / "checkpoints"
        self.every = int(every)
        self.keep = int(keep)
        self.manager = self._manager()

    def _manager(self) -> ocp.CheckpointManager:
        options = ocp.CheckpointManagerOptions(
            max_to_keep=self.keep,
            create=True,
            # Synchronous saves: a checkpoint is complete when save() returns,
            # so a run killed right after cannot leave a half-written latest.
            enable_async_checkpointing=False,
        )
        try:
            return ocp.CheckpointManager(self.directory, options=options)
        except ValueError:
            # orbax reads every step's metadata here and raises on one of the wrong shape.
            bad = [s for s in self.steps_in(self.workdir) if self.checksum_record(s)[1]]
            if not bad:
                raise
            raise CheckpointError(
                f"checkpoint step {bad[0]} in {self.directory} is unusable: "
                f"{self.checksum_record(bad[0])[1]}; move {self.directory / str(bad[0])} out "
                "of the way, then run the command again"
            ) from None

    @staticmethod
    def steps_in(workdir: str | Path) -> list[int]:
        """Checkpointed steps under ``<workdir>/checkpoints``, read from the folder names."""
        try:
            names = os.listdir(Path(workdir) / "checkpoints")
        except OSError:
            return []
        return sorted(int(n) for n in names if n.isdigit())

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def due(self, step: int) -> bool:
        """Whether ``step`` is a periodic checkpoint step."""
        return self.every > 0 and step % self.every == 0

    def save(self, state: TrainState, *, force: bool = False) -> bool:
        """Save ``state`` at its step (when due or forced); :class:`DiskFull` when it cannot fit."""
        step = int(jax.device_get(state.step))
        if not force and not self.due(step):
            return False
        if step in self.manager.all_steps():
            return False
        dest = self.directory / str(step)
        kept = self.all_steps()
        # The next checkpoint is as large as the newest one (same state, same shapes).  With
        # none kept, half the parameters' bytes: a lower bound (float weights do not
        # compress 2:1), so a save that could fit is never refused.
        needed = (
            tree_bytes(self.directory / str(kept[-1]))
            if kept
            else sum(np.asarray(leaf).nbytes for leaf in jax.tree.leaves(state.params)) // 2
        )
        free = free_bytes(self.directory)
        if needed > free:
            raise DiskFull(dest, needed, free)
        try:
            # The record goes into the step's own metadata file, written before the step is
            # renamed into place: no step exists without it.
            self.manager.save(
                step,
                args=ocp.args.StandardSave(state),
                custom_metadata={checksums.KEY: checksums.record(state)},
                force=True,
            )
            self.manager.wait_until_finished()
        except Exception as e:  # orbax wraps the disk's error in its own types
            if not is_disk_full(e):
                raise
            self._remove_partial(step)
            state_bytes = sum(np.asarray(leaf).nbytes for leaf in jax.tree.leaves(state))
            raise DiskFull(dest, max(needed, state_bytes), free_bytes(self.directory)) from None
        return True

    def _remove_partial(self, step: int) -> None:
        """Remove what a failed save of ``step`` wrote (orbax's temporary folder); rebuild the
        manager, whose view of the folder is stale."""
        try:
            self.manager.close()
        except Exception:  # its pending writes failed already
            pass
        for p in self.directory.glob(f"{step}.orbax-checkpoint-tmp*"):
            shutil.rmtree(p, ignore_errors=True)
        self.manager = self._manager()

    def restore(self, template: TrainState, step: int | None = None) -> TrainState:
        """Restore ``step`` (default: the latest) into the structure, shapes and dtypes of ``template``."""
        step = self.manager.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no checkpoint in {self.directory}")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
        return self.manager.restore(step, args=ocp.args.StandardRestore(abstract))

    def restore_latest(
        self, template: TrainState, say: Callable[[str], None] = print
    ) -> TrainState | None:
        """The newest checkpoint that reads and is finite; None when there is no checkpoint.

        An unreadable or non-finite one is moved to ``checkpoints_unreadable/``
        and the previous one is tried, each time saying so through ``say``.
        Raises :class:`CheckpointError` when checkpoints exist but none is usable.
        """
        steps = self.all_steps()
        if not steps:
            return None
        for step in reversed(steps):
            state, problem = self.try_restore(template, step, say)
            if problem is None:
                return state
            moved = self._move_aside(step)
            earlier = [s for s in steps if s < step]
            then = f"falling back to step {earlier[-1]}" if earlier else "no earlier checkpoint"
            say(
                f"warning: checkpoint step {step} is unusable ({problem}); moved to {moved}; {then}"
            )
        raise CheckpointError(
            f"no usable checkpoint in {self.directory} (see the warnings above); start again "
            "with a new --workdir"
        )

    def checksum_record(self, step: int) -> tuple[dict | None, str | None]:
        """(record, None) of step ``step``'s checksums (:mod:`~fp8jax.train.checksums`),
        (None, None) for a step saved before checkpoints recorded them, or (None, why) when
        its metadata or record does not read.

        Read from orbax's step metadata file directly: orbax's own reader
        answers a damaged file with an empty metadata, which would pass for
        a step without a record.
        """
        path = self.directory / str(step) / STEP_METADATA
        try:
            meta = json.loads(path.read_text())
        except FileNotFoundError:
            return None, None
        except (OSError, ValueError) as e:
            return None, f"its {STEP_METADATA} does not read ({type(e).__name__})"
        if not isinstance(meta, dict):
            return None, f"its {STEP_METADATA} is not a JSON object"
        custom = meta.get("custom_metadata")
        if custom is None or (isinstance(custom, dict) and checksums.KEY not in custom):
            return None, None  # saved before checkpoints recorded checksums
        if not isinstance(custom, dict):
            return None, f"its {STEP_METADATA} is damaged (custom_metadata is not an object)"
        rec = custom[checksums.KEY]
        problem = checksums.record_problem(rec)
        return (None, problem) if problem else (rec, None)

    def _integrity_problem(
        self, tree, step: int, rec: dict | None, say: Callable[[str], None] | None
    ) -> str | None:
        """Why restored ``tree`` of ``step`` is unusable (checksums, then finiteness), or None."""
        if rec is not None:
            mismatch = checksums.first_mismatch(tree, rec)
            if mismatch is not None:
                return mismatch
        elif say is not None:
            say(
                f"note: checkpoint step {step} holds no checksums (saved before checkpoints "
                "recorded them): its arrays are read unverified"
            )
        if not all_finite(tree):
            return "it holds non-finite values"
        return None

    def try_restore(
        self, template: TrainState, step: int, say: Callable[[str], None] | None = None
    ) -> tuple[TrainState | None, str | None]:
        """(state, None) when checkpoint ``step`` reads, matches its checksums and is finite,
        else (None, why).

        The integrity rule of training, for every reader of a run: a
        checkpoint that orbax cannot read (truncated, empty, corrupt), whose
        arrays differ from the checksums recorded when it was saved (bytes
        damaged into other finite values), or that holds a non-finite value
        is unusable.  ``why`` is one line naming the array; what orbax's
        reader threads print about the damage is kept off stderr.  A step
        saved before checkpoints recorded checksums is read unverified, with
        a note through ``say``.
        """
        folder = self.directory / str(step)
        if folder.is_dir() and not any(p.is_file() for p in folder.rglob("*")):
            return None, "its folder holds no file"
        rec, problem = self.checksum_record(step)
        if problem is not None:
            return None, problem
        with _quiet_reader_threads() as failed:
            try:
                state, problem = self.restore(template, step), None
            except Exception as e:  # orbax raises many types for damaged files
                failed.append(step)
                state, problem = None, f"it does not read: {_first_line(e)}"
                # A failed restore can leave the manager's view of the step stale.
                self.manager.close()
                self.manager = self._manager()
            # Leaving the context collects the failed reads (the exception is gone by then).
        if problem is not None:
            return None, problem
        problem = self._integrity_problem(state, step, rec, say)
        return (None, problem) if problem else (state, None)

    def holds_usable(self, step: int) -> bool:
        """Whether checkpoint ``step`` reads, matches its checksums and is finite, read as
        saved (no model needed).

        The same integrity rule as :meth:`try_restore`, for a caller that has
        no template state (it restores the arrays as orbax recorded them).
        """
        folder = self.directory / str(step)
        if not folder.is_dir() or not any(p.is_file() for p in folder.rglob("*")):
            return False
        rec, problem = self.checksum_record(step)
        if problem is not None:
            return False
        with _quiet_reader_threads() as failed:
            try:
                tree = self.manager.restore(step, args=ocp.args.StandardRestore())
                ok = int(np.asarray(tree["step"])) == step
            except Exception:  # orbax raises many types for damaged files
                failed.append(step)
                ok = False
                self.manager.close()
                self.manager = self._manager()
        return ok and self._integrity_problem(tree, step, rec, None) is None

    def restore_for_reading(
        self, template: TrainState, step: int | None, say: Callable[[str], None] = print
    ) -> tuple[TrainState, int]:
        """(state, step) for a program that reads a run (evaluate, sample); moves nothing.

        ``step`` given: that checkpoint, or a :class:`CheckpointError` saying
        why it is unusable.  None: the newest usable one, with a one-line note
        through ``say`` for each newer one passed over.
        """
        steps = self.all_steps()
        for candidate in reversed(steps if step is None else [step]):
            state, problem = self.try_restore(template, candidate, say)
            if problem is None:
                return state, candidate
            if step is not None:
                raise CheckpointError(
                    f"checkpoint step {step} in {self.directory} is unusable: {problem}"
                )
            then = "trying an earlier one" if candidate > steps[0] else "no earlier checkpoint"
            say(f"note: checkpoint step {candidate} is unusable ({problem}); {then}")
        seen = " (see the notes above)" if steps else ""
        raise CheckpointError(
            f"no usable checkpoint in {self.directory}{seen}: train the run again"
        )

    def _move_aside(self, step: int) -> Path:
        dest_root = self.workdir / "checkpoints_unreadable"
        dest_root.mkdir(exist_ok=True)
        dest = dest_root / str(step)
        n = 1
        while dest.exists():
            dest, n = dest_root / f"{step}.{n}", n + 1
        self.manager.close()
        shutil.move(str(self.directory / str(step)), str(dest))
        # The manager caches its step list: rebuild it without the moved step.
        self.manager = self._manager()
        return dest

    def close(self) -> None:
        self.manager.close()
