"""Process set-up shared by the training entry points."""

from __future__ import annotations

import jax
from absl import logging

CACHE_HELP = "Persistent XLA compilation cache ('' = off): reruns and other seeds skip recompiling."


def setup_runtime(jax_cache_dir: str) -> None:
    """Quiet absl logging and switch on the persistent compilation cache.

    Orbax logs every checkpoint step at INFO; WARNING keeps the progress lines
    readable.  A non-empty ``jax_cache_dir`` caches compiles that take at least
    0.5 s, so reruns and other seeds of the same config skip recompiling.
    """
    logging.set_verbosity(logging.WARNING)
    if jax_cache_dir:
        jax.config.update("jax_compilation_cache_dir", jax_cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
