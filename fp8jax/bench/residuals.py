"""Where the bytes of a training step go: the residuals autodiff keeps from forward to backward.

XLA's compiled memory analysis (``fp8jax.bench.timing.memory_stats``) gives
one number for all temporaries.  What FP8 training is meant to shrink is the
part of it that lives from the forward pass to the backward pass: the
residuals of the VJP (cached activations, softmax outputs, masks, FP8 codes
and scales).  :func:`saved_residuals` lists them, each with its dtype,
shape, bytes and the source line that produced it, straight from JAX's
autodiff (no compilation), and :func:`residual_summary` adds them up by
dtype and by source.  The two measures differ: the compiled peak also holds
the backward pass's own temporaries, and XLA may recompute or fuse away a
residual.

Uses ``jax._src.ad_checkpoint.saved_residuals`` (what the public
``jax.ad_checkpoint.print_saved_residuals`` prints).
"""

from __future__ import annotations

import collections
import math
import re
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["residual_summary", "saved_residuals"]


def saved_residuals(f: Callable[..., Any], *args: Any) -> list[dict[str, Any]]:
    """The residuals of ``jax.vjp(f, *args)``, largest first.

    Each: ``bytes``, ``dtype``, ``shape``, ``source`` ("file.py:line (function)"
    relative to the package, or "argument" for an input of ``f``).
    """
    try:
        from jax._src.ad_checkpoint import saved_residuals as _saved
    except ImportError as e:  # the private helper moved
        raise RuntimeError(f"this JAX has no ad_checkpoint.saved_residuals ({e})") from None
    rows = []
    for aval, src in _saved(f, *args):
        shape = tuple(int(d) for d in aval.shape)
        rows.append(
            {
                "bytes": math.prod(shape) * np.dtype(aval.dtype).itemsize,
                "dtype": str(aval.dtype),
                "shape": shape,
                "source": _short_source(src),
            }
        )
    return sorted(rows, key=lambda r: -r["bytes"])


def _short_source(src: str) -> str:
    """ "output of exp from /x/fp8jax/models/attention.py:67:12 (attention_core)" ->
    "models/attention.py:67 (attention_core)"."""
    if "argument" in src:
        return "argument"
    m = re.search(r"(\S+\.py):(\d+)(?::\d+)? \((.*)\)$", src)
    if not m:
        return src
    path = m.group(1)
    path = path.rsplit("fp8jax/", 1)[1] if "fp8jax/" in path else path.rsplit("/", 1)[-1]
    return f"{path}:{m.group(2)} ({m.group(3)})"


def residual_summary(rows: list[dict[str, Any]], top: int = 10) -> dict[str, Any]:
    """Total bytes (arguments excluded), bytes per dtype, and the ``top`` sources by bytes."""
    kept = [r for r in rows if r["source"] != "argument"]
    by_dtype: collections.Counter[str] = collections.Counter()
    by_source: collections.Counter[str] = collections.Counter()
    for r in kept:
        by_dtype[r["dtype"]] += r["bytes"]
        by_source[f"{r['dtype']}{list(r['shape'])} {r['source']}"] += r["bytes"]
    return {
        "total_bytes": sum(by_dtype.values()),
        "by_dtype": dict(by_dtype.most_common()),
        "top_sources": by_source.most_common(top),
    }
