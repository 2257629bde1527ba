"""The attention core: causal softmax attention against a float64 numpy reference, and
its recomputation in the backward pass (only q, k, v kept; gradients bit for bit those
of the stored version), with and without jit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8jax.bench.residuals import saved_residuals
from fp8jax.models.attention import attention_core, stored_attention_core


def _reference(q, k, v, scale):
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    logits = np.einsum("bthd,bshd->bhts", q, k) * scale
    t = q.shape[1]
    logits = np.where(np.tril(np.ones((t, t), bool))[None, None], logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhts,bshd->bthd", p, v)


def _qkv(t=12, h=2, d=8, dtype=jnp.bfloat16):
    rng = np.random.default_rng(0)
    return tuple(jnp.asarray(rng.normal(size=(2, t, h, d)), dtype) for _ in range(3))


@pytest.mark.parametrize("jit", [False, True])
def test_matches_float64_reference(jit):
    q, k, v = _qkv()
    f = jax.jit(attention_core, static_argnums=(3,)) if jit else attention_core
    out = f(q, k, v, 0.3)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), _reference(q, k, v, 0.3), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("jit", [False, True])
def test_recomputed_gradients_equal_stored_bit_for_bit(jit):
    q, k, v = _qkv()
    w = jnp.asarray(np.random.default_rng(1).normal(size=(2, 12, 2, 8)), jnp.float32)

    def loss(core):
        g = jax.grad(lambda q, k, v: jnp.sum(core(q, k, v, 0.3) * w), argnums=(0, 1, 2))
        return jax.jit(g) if jit else g

    for a, b in zip(loss(attention_core)(q, k, v), loss(stored_attention_core)(q, k, v)):
        assert a.dtype == b.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_keeps_only_its_inputs():
    q, k, v = _qkv(t=16)
    f = lambda q, k, v: jnp.sum(attention_core(q, k, v, 0.3))
    made = [r for r in saved_residuals(f, q, k, v) if r["source"] != "argument"]
    # Nothing of (B, H, T, T) -- logits, exponentials, probabilities, mask --
    # survives to the backward pass.
    assert not [r for r in made if r["shape"][-2:] == (16, 16)]
    stored = [
        r for r in saved_residuals(lambda *a: jnp.sum(stored_attention_core(*a, 0.3)), q, k, v)
    ]
    assert [r for r in stored if r["shape"][-2:] == (16, 16)]
