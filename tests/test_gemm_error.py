"""Synthetic LLM-like inputs (fp8jax.numerics.inputs) and the GEMM error study (gemm_error)."""

from __future__ import annotations

import numpy as np
import pytest

from fp8jax import recipes, registry
from fp8jax.numerics.gemm_error import gemm_errors, median_token_relative_error
from fp8jax.numerics.inputs import DISTRIBUTIONS, make_activations, make_gemm_inputs


def test_activations_distributions():
    g = make_activations("gaussian", 64, 300)
    assert g.shape == (64, 300) and g.dtype == np.float32
    o1 = make_activations("outlier_channels", 64, 300, magnitude=500.0, seed=1)
    o2 = make_activations("outlier_channels", 64, 300, magnitude=500.0, seed=2)
    # The outlier channels are a property of the model: the same for every seed.
    rms1, rms2 = np.sqrt(np.mean(o1**2, axis=0)), np.sqrt(np.mean(o2**2, axis=0))
    big1, big2 = np.flatnonzero(rms1 > 50), np.flatnonzero(rms2 > 50)
    assert len(big1) == 3 and np.array_equal(big1, big2)  # max(2, 300 // 100)
    # Same channels and values as the plain draw, times the magnitude (float64 reference).
    base = make_activations("gaussian", 64, 300, seed=1).astype(np.float64)
    np.testing.assert_allclose(o1[:, big1], 500.0 * base[:, big1], rtol=1e-6)
    others = np.setdiff1d(np.arange(300), big1)
    assert np.array_equal(o1[:, others], base[:, others].astype(np.float32))

    m = make_activations("massive", 64, 300, magnitude=1e4, seed=3).astype(np.float64)
    plain = make_activations("gaussian", 64, 300, seed=3).astype(np.float64)
    changed = np.argwhere(m != plain)
    assert len(changed) == 4  # 2 tokens x 2 channels
    assert len(set(changed[:, 0])) == 2 and len(set(changed[:, 1])) == 2
    rms = np.sqrt(np.mean(plain**2))
    np.testing.assert_allclose(np.abs(m[m != plain]), 1e4 * rms, rtol=1e-6)


@pytest.mark.parametrize(
    "bad", [dict(distribution="nope"), dict(magnitude=0.0), dict(magnitude=np.inf)]
)
def test_activations_reject_bad_input(bad):
    args = dict(distribution="massive", m=8, k=16) | bad
    with pytest.raises(ValueError):
        make_activations(args.pop("distribution"), args.pop("m"), args.pop("k"), **args)


def test_median_token_relative_error_matches_a_loop():
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((7, 5))
    a = ref + 1e-3 * rng.standard_normal((7, 5))
    want = np.median([np.linalg.norm(a[i] - ref[i]) / np.linalg.norm(ref[i]) for i in range(7)])
    assert median_token_relative_error(a, ref) == pytest.approx(want, rel=1e-12)
    zero = np.zeros((3, 4))
    assert median_token_relative_error(zero, zero) == 0.0


def test_gemm_errors_fp32_exact_and_fine_grained_wins_on_massive():
    x, w, dy = make_gemm_inputs("massive", 256, 256, 128)
    exact = gemm_errors(registry.get("fp32"), x, w, dy)
    assert max(exact.values()) < 1e-5  # float32 GEMMs against float64
    ds = gemm_errors(recipes.deepseek_v3(), x, w, dy)
    ct = gemm_errors(recipes.current_tensor(), x, w, dy)
    # E4M3 everywhere: a few percent over the whole tensor ...
    for errs in (ds, ct):
        assert all(1e-3 < v < 0.1 for k, v in errs.items() if k.endswith("_rel"))
    # ... but one per-tensor scale flushes the ordinary tokens: per token, tiles win >= 2x.
    assert ct["y_tok"] > 2 * ds["y_tok"]
    assert set(DISTRIBUTIONS) == {"gaussian", "outlier_channels", "massive"}
