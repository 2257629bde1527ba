"""Early-warning monitors for the late failures of low-precision training.

Pure functions of one step's tensors (float32 scalars out), cheap enough to
run every step; the layers sow them next to their FP8 telemetry
(:mod:`fp8jax.nn.recording`) and the training log writes them at its
cadence.  What each one measures, and the threshold that makes it a warning:

* :func:`channel_outlier_ratio`: the largest per-channel amax of a SwiGLU
  output (the down-projection's input, gate * up) over the median channel's.
  SwiGLU is quadratic in its input where a channel's gate and up weights
  align, so such a channel grows without bound late in training (Fishman et
  al. 2024, arXiv 2409.12517).  One scale per tensor puts the median channel's
  largest value at 448 / ratio: past 448 / 2^-6 = 28672 (E4M3's largest over
  its smallest normal) it is subnormal, past 448 / 2^-9 it is flushed.
* :func:`gate_up_alignment`: |cosine| between the gate and up weight
  vectors of each hidden channel (the columns feeding that channel).  Fishman
  et al. trace the outliers to this alignment growing towards 1.  For
  independent random columns of length D it is about 1/sqrt(D), and its
  maximum over F channels about sqrt(2 ln(2F) / D)
  (:func:`random_alignment_max`): values well above that are learned
  alignment.
* :func:`noise_ratio`: ||g|| / ||Q(g) - g|| for a quantized gradient g.
  "FP4 All the Way" (Chmiel et al. 2025, arXiv 2505.19115) finds that
  quantized training stops making progress once the gradient norm falls
  below about sqrt(3) times the quantization noise (:data:`NOISE_RATIO_FLOOR`).
* amax growth (:func:`amax_growth`, applied to the logged amax of every FP8
  operand): an operand's amax over the largest amax of the preceding window.
  Above 1 a delayed scale with a history of that window saturates the
  operand's largest values by that factor; a steady rise is the outlier
  growth the two monitors above explain.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

# "FP4 All the Way": below this gradient-to-noise norm ratio quantized training stalls.
NOISE_RATIO_FLOOR = math.sqrt(3.0)


def channel_amax(h: jax.Array, segments: jax.Array | None, n_segments: int) -> jax.Array:
    """Per-channel max |h| over the rows (float32; NaN where a segment has no rows)."""
    a = jnp.abs(h.astype(jnp.float32)).reshape(-1, h.shape[-1])
    a = jnp.where(jnp.isfinite(a), a, 0.0)
    if segments is None:
        return jnp.max(a, axis=0, initial=0.0)
    seg = jax.ops.segment_max(a, segments, num_segments=n_segments)
    counts = jax.ops.segment_sum(jnp.ones_like(segments), segments, num_segments=n_segments)
    # An expert that received no rows has no channel maxima (not zeros).
    return jnp.where(counts[:, None] > 0, seg, jnp.nan)


def channel_outlier_ratio(
    h: jax.Array, segments: jax.Array | None = None, n_segments: int = 1
) -> jax.Array:
    """max over channels of amax_c / median over channels of amax_c (float32 scalar).

    ``h``: (..., F), channels last; amax_c is the max |h| of channel c over
    all other axes.  ``segments`` (int (rows,)) splits the rows of a 2-d
    ``h`` into ``n_segments`` groups (the experts of a grouped GEMM): each
    (segment, channel) is then a channel of its own, and empty segments are
    left out.  A median of 0 gives +Inf when some channel is non-zero, 1
    when all are zero (no outlier).
    """
    if h.ndim == 0 or h.shape[-1] == 0:
        raise ValueError(f"channel_outlier_ratio needs a (..., F) tensor, got shape {h.shape}")
    if segments is not None and (h.ndim != 2 or segments.shape != h.shape[:1]):
        raise ValueError(
            f"segments must label the rows of a 2-d tensor: h {h.shape}, segments {segments.shape}"
        )
    return outlier_ratio_of_amax(channel_amax(h, segments, n_segments))


def outlier_ratio_of_amax(amax: jax.Array) -> jax.Array:
    """:func:`channel_outlier_ratio` from the channels' amax (any shape; NaN entries left out).

    The form that merges over shards: the per-shard :func:`channel_amax` of
    disjoint rows combine by an elementwise max (NaN-skipping), then one ratio.
    """
    amax = amax.reshape(-1)
    top = jnp.nanmax(amax)
    mid = jnp.nanmedian(amax)
    return jnp.where(mid > 0, top / jnp.where(mid > 0, mid, 1.0), jnp.where(top > 0, jnp.inf, 1.0))


def gate_up_alignment(w_gate: jax.Array, w_up: jax.Array) -> dict[str, jax.Array]:
    """{"align_max", "align_mean"}: max and mean |cosine| of matching gate / up columns.

    ``w_gate``, ``w_up``: (..., D, F) kernels (leading axes, e.g. experts, are
    more channels); channel f's vectors are ``w[..., :, f]``.  Computed in
    float32; a zero column has cosine 0.
    """
    if w_gate.shape != w_up.shape or w_gate.ndim < 2:
        raise ValueError(
            f"gate and up kernels must be (..., D, F) of one shape, got {w_gate.shape}, "
            f"{w_up.shape}"
        )
    g = w_gate.astype(jnp.float32)
    u = w_up.astype(jnp.float32)
    dot = jnp.sum(g * u, axis=-2)
    norms = jnp.sqrt(jnp.sum(g * g, axis=-2) * jnp.sum(u * u, axis=-2))
    cos = jnp.abs(jnp.where(norms > 0, dot / jnp.where(norms > 0, norms, 1.0), 0.0))
    return {"align_max": jnp.max(cos), "align_mean": jnp.mean(cos)}


def random_alignment_max(d: int, f: int) -> float:
    """sqrt(2 ln(2F) / D): the typical max |cosine| over F pairs of random length-D vectors."""
    if d < 1 or f < 1:
        raise ValueError(f"d and f must be >= 1, got {d}, {f}")
    return math.sqrt(2.0 * math.log(2.0 * f) / d)


def swiglu_monitors(
    h: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    segments: jax.Array | None = None,
    n_segments: int = 1,
) -> dict[str, jax.Array]:
    """{"outlier_ratio", "align_max", "align_mean"} of one SwiGLU layer (no gradient flows)."""
    h = jax.lax.stop_gradient(h)
    return swiglu_monitors_of_amax(channel_amax(h, segments, n_segments), w_gate, w_up)


def swiglu_monitors_of_amax(
    amax: jax.Array, w_gate: jax.Array, w_up: jax.Array
) -> dict[str, jax.Array]:
    """:func:`swiglu_monitors` from the SwiGLU output's :func:`channel_amax` (no gradient flows)."""
    amax, w_gate, w_up = jax.lax.stop_gradient((amax, w_gate, w_up))
    return {"outlier_ratio": outlier_ratio_of_amax(amax), **gate_up_alignment(w_gate, w_up)}


def signal_and_noise(g: jax.Array, g_quantized: jax.Array) -> jax.Array:
    """float32 (2,): (||g||, ||g_quantized - g||), non-finite elements left out of both."""
    if g.shape != g_quantized.shape:
        raise ValueError(f"shapes differ: {g.shape} vs {g_quantized.shape}")
    a = g.astype(jnp.float32)
    b = g_quantized.astype(jnp.float32)
    ok = jnp.isfinite(a) & jnp.isfinite(b)
    a = jnp.where(ok, a, 0.0)
    b = jnp.where(ok, b, 0.0)
    # Norms from sums of squares of values scaled by the largest one: a
    # float32 gradient's squares may underflow (or overflow) unscaled.
    m = jnp.maximum(jnp.max(jnp.abs(a), initial=0.0), jnp.max(jnp.abs(b), initial=0.0))
    inv = jnp.where(m > 0, 1.0 / jnp.where(m > 0, m, 1.0), 1.0)
    sig = jnp.sqrt(jnp.sum(jnp.square(a * inv)))
    err = jnp.sqrt(jnp.sum(jnp.square((b - a) * inv)))
    return jnp.stack([sig, err]) * jnp.where(m > 0, m, 1.0)


def ratio_of(signal_noise: jax.Array) -> jax.Array:
    """signal / noise of a (2,) pair: +Inf for zero noise, NaN when both are zero."""
    sig, err = signal_noise[0], signal_noise[1]
    safe = jnp.where(err > 0, err, 1.0)
    return jnp.where(err > 0, sig / safe, jnp.where(sig > 0, jnp.inf, jnp.nan))


def noise_ratio(g: jax.Array, g_quantized: jax.Array) -> jax.Array:
    """||g|| / ||g_quantized - g|| in float32 (+Inf when the quantization is exact).

    Non-finite elements are left out of both norms.
    """
    return ratio_of(signal_and_noise(g, g_quantized))


def amax_growth(amax_now: float, window: list[float]) -> float:
    """amax_now / max(window) (host floats): growth over the preceding window.

    NaN when the window is empty or holds no positive finite amax.
    """
    prev = [a for a in window if a is not None and math.isfinite(a) and a > 0]
    if not prev or amax_now is None or not math.isfinite(amax_now):
        return math.nan
    return float(amax_now) / max(prev)
