"""Say in one line, before pip resolves anything, when this Python is too old for fp8jax.

    python scripts/check_python.py && pip install -e ".[dev]"

pip on an older Python answers fp8jax's pins with "No matching distribution
found for jax..." and never names the Python version; this script reads the
minimum from pyproject.toml's ``requires-python`` and, below it, prints what
fp8jax needs and how to get it, and exits 2.  It uses nothing newer than Python
3.6 (no tomllib), so it can speak on the interpreter it refuses.
"""

import os
import re
import sys

PYPROJECT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "pyproject.toml")


def required(pyproject: str = PYPROJECT) -> "tuple[int, int]":
    """The (major, minor) of pyproject.toml's ``requires-python = ">=X.Y"``."""
    with open(pyproject) as f:
        match = re.search(r'^requires-python\s*=\s*">=\s*(\d+)\.(\d+)"', f.read(), flags=re.M)
    if match is None:
        raise ValueError('no requires-python = ">=X.Y" in ' + pyproject)
    return int(match.group(1)), int(match.group(2))


def problem(version: tuple, executable: str, need: "tuple[int, int]") -> "str | None":
    """The one line for a Python ``version`` older than ``need``, else None."""
    if tuple(version[:2]) >= need:
        return None
    want = f"{need[0]}.{need[1]}"
    have = ".".join(str(v) for v in version[:3])
    return (
        f"fp8jax needs Python >= {want} (jax 0.11 and later do); {executable} is {have}. "
        f"Make a Python {want} environment and run the command in it, e.g. "
        f"python{want} -m venv .venv && . .venv/bin/activate"
    )


def main() -> int:
    line = problem(sys.version_info, sys.executable or "python", required())
    if line:
        print(line, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
