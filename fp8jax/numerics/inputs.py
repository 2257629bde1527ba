"""LLM-like synthetic GEMM inputs: Gaussian, outlier channels, massive activations.

* ``gaussian``: x ~ N(0, 1).
* ``outlier_channels``: a few feature channels (columns of x) 100-1000x larger
  than the rest, as observed in LLM activations; per-tensor E4M3 absorbs these
  with its range.
* ``massive``: a handful of single values 1e4-1e5x the typical magnitude
  ("massive activations"); with one scale for the whole tensor they push the
  other tokens into E4M3's subnormals.
"""

from __future__ import annotations

import numpy as np

KINDS = ("gaussian", "outlier_channels", "massive")


def make_activations(kind: str, m: int, k: int, seed: int = 0) -> np.ndarray:
    """A float32 (m, k) activation matrix of the given kind."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    if kind == "gaussian":
        return x
    if kind == "outlier_channels":
        n_out = max(1, k // 128)
        cols = rng.choice(k, n_out, replace=False)
        x[:, cols] *= rng.uniform(100.0, 1000.0, size=n_out).astype(np.float32)
        return x
    if kind == "massive":
        n_mass = max(1, m // 256)
        rows = rng.choice(m, n_mass, replace=False)
        cols = rng.choice(k, n_mass)
        x[rows, cols] = (
            rng.uniform(1e4, 1e5, size=n_mass) * rng.choice([-1.0, 1.0], size=n_mass)
        ).astype(np.float32)
        return x
    raise ValueError(f"unknown input kind {kind!r}; known: {KINDS}")


def make_gemm_inputs(kind: str, m: int, k: int, n: int, seed: int = 0):
    """(x (m,k), w (k,n), dy (m,n)) float32; w ~ N(0, 1/k), dy ~ N(0, 1)."""
    rng = np.random.default_rng(seed + 1)
    x = make_activations(kind, m, k, seed)
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
    dy = rng.standard_normal((m, n)).astype(np.float32)
    return x, w, dy
