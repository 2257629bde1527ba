"""Outputs that appear complete or not at all: a hidden partial directory, renamed at the end.

A command that writes a directory (the checkpoint converter, ``fp8jax data
prepare``) writes into ``.<dst>.partial-<pid>-<random>`` next to ``dst``,
marked with a small JSON file naming its process and host, and renames it
to ``dst`` only once everything is written.  Any failure, Ctrl-C, SIGTERM or
SIGHUP removes the partial directory (:class:`TerminationSignals` turns the
two signals into an exception while active); a partial directory left by a
process that no longer exists (kill -9, power loss) is removed by the next
such command writing into the same parent.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import threading
from collections.abc import Callable
from pathlib import Path

from fp8jax.process_liveness import owner_alive


def remove_stale_partials(
    parent: Path, marker: str, what: str, warn: Callable[[str], None]
) -> None:
    """Remove hidden partial outputs (carrying ``marker``) whose process no longer exists.

    Only directories that carry the marker, written on this host by a
    process id that is not running, are touched.  ``what`` names the command
    in the warning ("conversion", ...).
    """
    for d in sorted(parent.glob(".*.partial-*")):
        mark = d / marker
        if not d.is_dir() or d.is_symlink() or not mark.is_file():
            continue
        try:
            info = json.loads(mark.read_text(encoding="utf-8"))
            pid, owner_host = int(info["pid"]), str(info["host"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if owner_alive(owner_host, pid):
            continue
        shutil.rmtree(d, ignore_errors=True)
        warn(f"removed {d}, the partial output of an earlier {what} (process {pid} is gone)")


def make_partial_dir(dst: Path, marker: str, info: dict) -> Path:
    """A new hidden directory next to ``dst`` holding ``marker`` (pid, host and ``info``).

    Raises FileExistsError when no fresh name could be made.
    """
    # os.mkdir applies the umask to 0o777, as for any directory the user makes
    # (tempfile.mkdtemp would force 0o700 onto the final output).
    for _ in range(100):
        tmp = dst.parent / f".{dst.name}.partial-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            os.mkdir(tmp, 0o777)
        except FileExistsError:
            continue
        mark = {"pid": os.getpid(), "host": socket.gethostname(), **info}
        (tmp / marker).write_text(json.dumps(mark) + "\n", encoding="utf-8")
        return tmp
    raise FileExistsError(f"cannot create a temporary directory in {dst.parent}")


def publish(tmp: Path, dst: Path, marker: str) -> None:
    """Drop the marker and rename ``tmp`` to ``dst`` (an empty ``dst`` is replaced)."""
    (tmp / marker).unlink()
    if dst.exists():
        dst.rmdir()  # empty: callers refuse a non-empty destination up front
    os.replace(tmp, dst)


class TerminationSignals:
    """Turns SIGTERM / SIGHUP into ``make_error(signum)`` while active (main thread only)."""

    SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGHUP") if hasattr(signal, n))

    def __init__(self, make_error: Callable[[int], BaseException]):
        self.make_error = make_error

    def __enter__(self):
        self._old = {}
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._old[sig] = signal.signal(sig, self._raise)
        return self

    def _raise(self, signum, frame):
        raise self.make_error(signum)

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)
