"""Synthetic LLM-like activations: the one generator of the GEMM studies and notebooks.

Typical values: x[t, c] ~ N(0, s_c^2) with a log-normal magnitude s_c per
channel (``channel_sigma``; channels of real activations differ by ~10x; 0
gives N(0, 1)).  On top of that, by ``distribution``:

* ``gaussian``: nothing else;
* ``outlier_channels``: 1% of the channels (at least 2), in every token,
  multiplied by ``magnitude`` (default 1e3), as observed in LLM activations
  (Dettmers et al. 2022, LLM.int8()).  Per-tensor E4M3 absorbs these with its
  range (2^-6 .. 448 spans 2^15);
* ``massive``: 2 tokens x 2 channels set to +-``magnitude`` (default 1e5) x
  the typical RMS ("massive activations", Sun et al. 2024): with one scale
  for the whole tensor they push the other tokens into E4M3's subnormals.

Which channels carry outliers is a property of the model, not of the batch:
the per-channel magnitudes and the outlier channels are drawn from
``channel_seed`` and stay fixed as ``seed`` (the values, the massive tokens)
changes.  Values are drawn in float64 and rounded once to float32.
"""

from __future__ import annotations

import numpy as np

DISTRIBUTIONS = ("gaussian", "outlier_channels", "massive")
DEFAULT_MAGNITUDE = {"gaussian": 1.0, "outlier_channels": 1e3, "massive": 1e5}


def make_activations(
    distribution: str,
    m: int,
    k: int,
    *,
    magnitude: float | None = None,
    seed: int = 0,
    channel_seed: int = 1234,
    channel_sigma: float = 0.5,
) -> np.ndarray:
    """A float32 (m tokens, k channels) activation matrix of ``distribution`` (module docstring)."""
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"unknown input distribution {distribution!r}; known: {DISTRIBUTIONS}")
    if m < 1 or k < 2:
        raise ValueError(f"need m >= 1 tokens and k >= 2 channels, got m={m}, k={k}")
    mag = DEFAULT_MAGNITUDE[distribution] if magnitude is None else float(magnitude)
    if not np.isfinite(mag) or mag <= 0:
        raise ValueError(f"magnitude must be finite and > 0, got {magnitude}")
    feat = np.random.default_rng(channel_seed)
    ch_scale = np.exp(feat.normal(0.0, channel_sigma, k))
    outlier_ch = feat.choice(k, max(2, k // 100), replace=False)
    massive_ch = feat.choice(k, 2, replace=False)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)) * ch_scale
    if distribution == "outlier_channels":
        x[:, outlier_ch] *= mag
    elif distribution == "massive":
        rms = np.sqrt(np.mean(x**2))
        for t in rng.choice(m, min(2, m), replace=False):
            x[t, massive_ch] = mag * rms * rng.choice([-1.0, 1.0], 2)
    # One rounding of the float64 draw to the float32 activations of a model.
    return x.astype(np.float32)


def make_gemm_inputs(
    distribution: str, m: int, k: int, n: int, seed: int = 0, *, magnitude: float | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(x (m,k), w (k,n), dy (m,n)) float32: x from :func:`make_activations`,
    w ~ N(0, 1/k) (unit-variance outputs for unit-variance inputs), dy ~ N(0, 1)."""
    x = make_activations(distribution, m, k, magnitude=magnitude, seed=seed)
    rng = np.random.default_rng(seed + 1)
    # float64 draw, one rounding to float32 (as for x).
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
    dy = rng.standard_normal((m, n)).astype(np.float32)
    return x, w, dy
