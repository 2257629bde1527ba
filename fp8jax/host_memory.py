"""Memory the host can still give a new allocation: checked before allocating, not after."""

from __future__ import annotations

import os


def available_memory() -> int | None:
    """Bytes available to a new allocation (Linux MemAvailable, else free pages; None if unknown)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None
