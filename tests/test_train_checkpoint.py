"""The run lock: one process trains a run directory at a time; a lock left by a dead
process is taken over, one held by a live process (or another host) is refused."""

import os
import socket
import subprocess
import sys

import pytest

from fp8jax.train.checkpoint import CheckpointError, RunInUse, run_lock


def test_lock_is_held_then_released(tmp_path):
    with run_lock(tmp_path) as path:
        assert path.read_text().split() == [socket.gethostname(), str(os.getpid())]
        with pytest.raises(RunInUse, match="being trained by process"):
            with run_lock(tmp_path):
                pass
        # Another JAX process of the same run has its own lock.
        with run_lock(tmp_path, process_index=1):
            pass
    assert not path.exists()
    with run_lock(tmp_path):
        pass


def test_lock_of_a_dead_process_is_taken_over(tmp_path):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    (tmp_path / ".lock.0").write_text(f"{socket.gethostname()} {dead.stdout.strip()}\n")
    with run_lock(tmp_path) as path:
        assert path.read_text().split()[1] == str(os.getpid())


def test_lock_from_another_host_is_refused_with_the_fix(tmp_path):
    (tmp_path / ".lock.0").write_text("elsewhere 12345\n")
    with pytest.raises(RunInUse, match="remove .*lock.0") as e:
        with run_lock(tmp_path):
            pass
    # Front ends that report CheckpointError report this one too.
    assert isinstance(e.value, CheckpointError)
    assert (tmp_path / ".lock.0").exists()


def test_lock_taken_by_another_process_in_between_is_refused(tmp_path, monkeypatch):
    # The stale lock is removed, but every attempt to create it finds it again
    # (another process got there first): refused, never held without the lock.
    (tmp_path / ".lock.0").write_text(f"{socket.gethostname()} {2**40}\n")

    def taken(src, dst):
        raise FileExistsError(dst)

    monkeypatch.setattr(os, "link", taken)
    with pytest.raises(RunInUse, match="another process took its lock"):
        with run_lock(tmp_path):
            pass
    assert not list(tmp_path.glob(".lock.0.*"))
