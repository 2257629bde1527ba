"""Monitors against float64 numpy on synthetic tensors with known outliers, alignment and noise."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8jax import monitors


def _ratio_ref(h, segments=None, n=1):
    a = np.abs(h.astype(np.float64)).reshape(-1, h.shape[-1])
    if segments is None:
        amax = a.max(axis=0)
    else:
        amax = np.concatenate(
            [a[segments == s].max(axis=0) for s in range(n) if (segments == s).any()]
        )
    return amax.max() / np.median(amax)


def _maybe_jit(f, jit):
    return jax.jit(f) if jit else f


@pytest.mark.parametrize("jit", [False, True])
def test_outlier_ratio_matches_float64(jit):
    rng = np.random.default_rng(0)
    h = rng.standard_normal((4, 16, 33)).astype(np.float32)
    h[2, 5, 7] = 900.0  # one outlier channel
    got = float(_maybe_jit(monitors.channel_outlier_ratio, jit)(jnp.asarray(h)))
    np.testing.assert_allclose(got, _ratio_ref(h), rtol=1e-6)
    assert got > 100


@pytest.mark.parametrize("jit", [False, True])
def test_outlier_ratio_per_expert_skips_empty_experts(jit):
    rng = np.random.default_rng(1)
    h = rng.standard_normal((30, 8)).astype(np.float32)
    seg = np.repeat(np.array([0, 2, 3]), [10, 12, 8]).astype(np.int32)  # expert 1 empty
    h[12, 3] = -50.0
    f = lambda h, s: monitors.channel_outlier_ratio(h, s, 4)  # noqa: E731
    got = float(_maybe_jit(f, jit)(jnp.asarray(h), jnp.asarray(seg)))
    np.testing.assert_allclose(got, _ratio_ref(h, seg, 4), rtol=1e-6)


def test_outlier_ratio_edge_cases():
    assert float(monitors.channel_outlier_ratio(jnp.zeros((3, 4)))) == 1.0
    h = jnp.zeros((3, 5)).at[0, 0].set(1.0)
    assert math.isinf(float(monitors.channel_outlier_ratio(h)))
    with pytest.raises(ValueError, match="F"):
        monitors.channel_outlier_ratio(jnp.zeros((3, 0)))
    with pytest.raises(ValueError, match="segments"):
        monitors.channel_outlier_ratio(jnp.zeros((3, 4)), jnp.zeros((2,), jnp.int32), 2)


@pytest.mark.parametrize("jit", [False, True])
def test_alignment_matches_float64(jit):
    rng = np.random.default_rng(2)
    d, f = 64, 20
    g = rng.standard_normal((d, f))
    u = rng.standard_normal((d, f))
    u[:, 4] = -3.0 * g[:, 4] + 0.01 * rng.standard_normal(d)  # anti-aligned channel
    u[:, 9] = 0.0  # a zero column counts as cosine 0
    cos = np.abs((g * u).sum(0)) / np.maximum(
        np.linalg.norm(g, axis=0) * np.linalg.norm(u, axis=0), 1e-300
    )
    got = _maybe_jit(monitors.gate_up_alignment, jit)(
        jnp.asarray(g, jnp.float32), jnp.asarray(u, jnp.float32)
    )
    np.testing.assert_allclose(float(got["align_max"]), cos.max(), rtol=1e-5)
    np.testing.assert_allclose(float(got["align_mean"]), cos.mean(), rtol=1e-5)
    assert float(got["align_max"]) > 0.99


def test_random_alignment_baseline_holds_for_random_kernels():
    rng = np.random.default_rng(3)
    d, f = 256, 512
    g = jnp.asarray(rng.standard_normal((d, f)), jnp.float32)
    u = jnp.asarray(rng.standard_normal((d, f)), jnp.float32)
    got = float(monitors.gate_up_alignment(g, u)["align_max"])
    base = monitors.random_alignment_max(d, f)
    assert 0.5 * base < got < 1.5 * base


def test_alignment_of_expert_kernels_counts_every_expert_channel():
    rng = np.random.default_rng(4)
    g = rng.standard_normal((3, 16, 5)).astype(np.float32)
    u = rng.standard_normal((3, 16, 5)).astype(np.float32)
    u[1, :, 2] = g[1, :, 2]
    got = monitors.gate_up_alignment(jnp.asarray(g), jnp.asarray(u))
    np.testing.assert_allclose(float(got["align_max"]), 1.0, rtol=1e-6)
    with pytest.raises(ValueError, match="one shape"):
        monitors.gate_up_alignment(jnp.zeros((4, 3)), jnp.zeros((4, 2)))


@pytest.mark.parametrize("jit", [False, True])
def test_noise_ratio_matches_float64(jit):
    rng = np.random.default_rng(5)
    g = rng.standard_normal((40, 24)) * 1e-20  # tiny: squares underflow float32
    noise = rng.standard_normal((40, 24)) * 1e-20 / math.sqrt(3.0) * 0.5
    q = (g + noise).astype(np.float32)
    g32 = g.astype(np.float32)
    want = np.linalg.norm(g32.astype(np.float64)) / np.linalg.norm(q.astype(np.float64) - g32)
    got = float(_maybe_jit(monitors.noise_ratio, jit)(jnp.asarray(g32), jnp.asarray(q)))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert got > monitors.NOISE_RATIO_FLOOR
    assert math.isinf(float(monitors.noise_ratio(jnp.ones(3), jnp.ones(3))))


def test_amax_growth_over_window():
    assert monitors.amax_growth(8.0, [1.0, 4.0, 2.0]) == 2.0
    assert monitors.amax_growth(1.0, [2.0, None, math.nan]) == 0.5
    assert math.isnan(monitors.amax_growth(1.0, []))
    assert math.isnan(monitors.amax_growth(1.0, [0.0]))
