"""Whether the process that owns a file or directory (by host and pid) may still run.

Run locks (``fp8jax.train.checkpoint``) and the checkpoint converter's partial
outputs (``fp8jax.toolkit.convert``) both record their owner's host and pid
and clean up after an owner that is gone.
"""

from __future__ import annotations

import os
import socket


def pid_alive(pid: int) -> bool:
    """True when a process ``pid`` exists on this host (or cannot be checked)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    except OverflowError:
        return False
    return True


def owner_alive(owner_host: str, pid: int) -> bool:
    """False only when the owner is provably gone: a pid of this host that does not run.

    An owner on another host cannot be checked and counts as alive, as does
    this very process.
    """
    return owner_host != socket.gethostname() or pid == os.getpid() or pid_alive(pid)
