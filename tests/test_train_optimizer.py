"""AdamW with BF16 moments and the warm-up + cosine schedule vs float64 numpy references."""

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

from fp8jax.train.optimizer import lr_schedule, make_optimizer, scale_by_adam_lowp


def _ref_adam(grads, b1, b2, eps, store):
    """Reference Adam direction in float64; moments rounded by ``store`` after each update."""
    mu = np.zeros_like(grads[0], dtype=np.float64)
    nu = np.zeros_like(grads[0], dtype=np.float64)
    outs = []
    for t, g in enumerate(grads, start=1):
        g = g.astype(np.float64)
        mu = store(b1 * mu + (1 - b1) * g)
        nu = store(b2 * nu + (1 - b2) * g * g)
        outs.append((mu / (1 - b1**t)) / (np.sqrt(nu / (1 - b2**t)) + eps))
    return outs, mu, nu


@pytest.mark.parametrize("moment_dtype", ["float32", "bfloat16"])
def test_scale_by_adam_lowp_matches_reference(moment_dtype):
    rng = np.random.default_rng(0)
    grads = [
        rng.normal(size=(16, 8)).astype(np.float32) * 10.0 ** rng.uniform(-3, 1) for _ in range(6)
    ]
    np_dt = np.float32 if moment_dtype == "float32" else ml_dtypes.bfloat16
    store = lambda x: x.astype(np.float32).astype(np_dt).astype(np.float64)
    ref, mu_ref, nu_ref = _ref_adam(grads, 0.9, 0.95, 1e-8, store)
    tx = scale_by_adam_lowp(0.9, 0.95, 1e-8, moment_dtype)
    params = jnp.zeros((16, 8), jnp.float32)
    st = tx.init(params)
    assert st.mu.dtype == jnp.dtype(moment_dtype) and st.nu.dtype == jnp.dtype(moment_dtype)
    for g, r in zip(grads, ref):
        u, st = tx.update(jnp.asarray(g), st, params)
        assert u.dtype == jnp.float32
        # float32 arithmetic vs float64 reference on the same stored moments.
        np.testing.assert_allclose(np.asarray(u), r, rtol=2e-5, atol=1e-6)
    # Stored moments are the rounded float32 computation (bf16: within one bf16 ulp).
    tol = 2e-6 if moment_dtype == "float32" else 2.0**-8
    # (mu can cancel to near 0, so the absolute tolerance scales with its magnitude.)
    for got, ref_m in ((st.mu, mu_ref), (st.nu, nu_ref)):
        atol = 4 * tol * np.abs(ref_m).max() * 2.0**-8
        np.testing.assert_allclose(np.asarray(got, np.float64), ref_m, rtol=tol, atol=atol)


def test_float32_moments_equal_optax_adam():
    rng = np.random.default_rng(1)
    p = jnp.asarray(rng.normal(size=(5, 3)), jnp.float32)
    ours, theirs = scale_by_adam_lowp(0.9, 0.95, 1e-8), optax.scale_by_adam(0.9, 0.95, 1e-8)
    s1, s2 = ours.init(p), theirs.init(p)
    for _ in range(4):
        g = jnp.asarray(rng.normal(size=(5, 3)), jnp.float32)
        u1, s1 = ours.update(g, s1, p)
        u2, s2 = theirs.update(g, s2, p)
        np.testing.assert_allclose(np.asarray(u1), np.asarray(u2), rtol=1e-6, atol=1e-7)


def test_schedule_warmup_then_cosine():
    sched = lr_schedule(1e-3, total_steps=100, warmup_steps=10, min_lr_ratio=0.1)
    for step in (0, 5, 10, 40, 75, 100):
        if step <= 10:
            ref = 1e-3 * step / 10
        else:
            frac = (step - 10) / 90
            ref = 1e-4 + (1e-3 - 1e-4) * 0.5 * (1 + math.cos(math.pi * frac))
        assert float(sched(step)) == pytest.approx(ref, rel=1e-5, abs=1e-9)


def test_optimizer_clips_decays_matrices_only_and_keeps_fp32_params():
    tx, _ = make_optimizer(
        peak_lr=1.0,
        total_steps=10,
        warmup_steps=0,
        weight_decay=0.5,
        clip_norm=1.0,
        moment_dtype="bfloat16",
        min_lr_ratio=1.0,
    )
    params = {"w": jnp.ones((4, 4), jnp.float32), "b": jnp.ones((4,), jnp.float32)}
    st = tx.init(params)
    zero = jax.tree.map(jnp.zeros_like, params)
    upd, st = tx.update(zero, st, params)
    # Zero gradient: Adam direction 0, so the update is -lr * wd * p on matrices only.
    np.testing.assert_allclose(np.asarray(upd["w"]), -0.5 * np.ones((4, 4)))
    np.testing.assert_allclose(np.asarray(upd["b"]), np.zeros(4))
    new = optax.apply_updates(params, upd)
    assert new["w"].dtype == jnp.float32
    # Huge gradient: clipped to global norm 1 before Adam (direction unchanged, ~sign).
    big = {"w": jnp.full((4, 4), 1e6, jnp.float32), "b": jnp.full((4,), 1e6, jnp.float32)}
    clip = optax.clip_by_global_norm(1.0)
    clipped, _ = clip.update(big, clip.init(params))
    norm = float(optax.global_norm(clipped))
    assert norm == pytest.approx(1.0, rel=1e-5)


@pytest.mark.parametrize(
    "total,warmup", [(1, 0), (3, 10), (6, 2), (60, 10), (150, 15), (4000, 500)]
)
def test_schedule_of_a_traced_length_is_the_schedule_of_that_length(total, warmup):
    # A jitted step takes the run's length as an input: one program for every length.
    steps = np.arange(0, total + 4, dtype=np.int32)
    traced = jax.jit(lambda s, t: jax.vmap(lr_schedule(3e-3, t, warmup, 0.1))(s))
    got = np.asarray(traced(steps, np.int32(total)))
    fixed = np.asarray(jax.jit(jax.vmap(lr_schedule(3e-3, total, warmup, 0.1)))(steps))
    np.testing.assert_array_equal(got, fixed)
    # Reference in float64: linear warm-up (cut to the run when longer), then cosine.
    w = min(warmup, total)
    decay = max(total, w + 1) - w
    ref = np.where(
        steps < w,
        3e-3 * steps / max(w, 1),
        3e-4 + 2.7e-3 * 0.5 * (1 + np.cos(np.pi * np.minimum(steps - w, decay) / decay)),
    )
    np.testing.assert_allclose(got, ref, rtol=2e-6, atol=1e-10)
    # optax's schedule of the same length (what runs used before the length was an input).
    optax_ref = optax.warmup_cosine_decay_schedule(0.0, 3e-3, w, max(total, w + 1), 3e-4)
    # (Its warm-up ramp computes peak - peak * (1 - k / w): float32 cancellation near 0.)
    want = np.asarray(jax.jit(jax.vmap(optax_ref))(steps))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9)


def test_make_optimizer_defaults_to_the_training_configs_moment_dtype():
    from fp8jax.train.defaults import base_config

    tx, _ = make_optimizer(peak_lr=1e-3, total_steps=10, warmup_steps=1)
    state = tx.init({"w": jnp.zeros((3, 4), jnp.float32)})
    lowp = [
        s for s in jax.tree.leaves(state, is_leaf=lambda s: hasattr(s, "nu")) if hasattr(s, "nu")
    ]
    assert lowp and lowp[0].mu["w"].dtype == lowp[0].nu["w"].dtype == jnp.bfloat16
    assert base_config().moment_dtype == "bfloat16"
