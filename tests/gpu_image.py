"""The GPU image's missing packages, blocked in a child interpreter as they are missing there.

The GPU image has jax, flax, optax, numpy and matplotlib but no ml_collections,
tensorboardX, grain, qwix or tokenizers, and scripts/gpu_check_kernels.sh and
scripts/gpu_sweep.sh install nothing there.  :data:`BLOCKER` is Python source that
makes every import of those packages raise ImportError; :func:`blocked_script`
is the command line that runs a script after it.
"""

from __future__ import annotations

import sys

MISSING_ON_THE_GPU_IMAGE = ("ml_collections", "tensorboardX", "grain", "qwix", "tokenizers")

BLOCKER = f"""
import importlib.abc, sys
class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {MISSING_ON_THE_GPU_IMAGE!r}:
            raise ImportError("not on the GPU image: " + name)
sys.meta_path.insert(0, Missing())
"""

_RUN_SCRIPT = """
import runpy
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def blocked_script(script: str, *args: str) -> list[str]:
    """``python script args...`` with the GPU image's missing packages blocked."""
    return [sys.executable, "-c", BLOCKER + _RUN_SCRIPT, script, *args]
