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


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("block_q", [4, 5])
def test_query_blocks_match_float64_reference(jit, block_q):
    # T = 12: blocks of 4 divide it, blocks of 5 leave 3 padded query rows.
    q, k, v = _qkv()
    f = lambda q, k, v: attention_core(q, k, v, 0.3, block_q)
    out = (jax.jit(f) if jit else f)(q, k, v)
    assert out.shape == (2, 12, 2, 8) and out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), _reference(q, k, v, 0.3), rtol=1e-5, atol=1e-6)


def _reference_grads(q, k, v, w, scale):
    """d sum(attention * w) / d(q, k, v) in float64 (the softmax Jacobian written out)."""
    q, k, v, w = (np.asarray(a, np.float64) for a in (q, k, v, w))
    t = q.shape[1]
    logits = np.einsum("bthd,bshd->bhts", q, k) * scale
    logits = np.where(np.tril(np.ones((t, t), bool))[None, None], logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    dp = np.einsum("bthd,bshd->bhts", w, v)
    dv = np.einsum("bhts,bthd->bshd", p, w)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True)) * scale
    return np.einsum("bhts,bshd->bthd", ds, k), np.einsum("bhts,bthd->bshd", ds, q), dv


@pytest.mark.parametrize("jit", [False, True])
def test_query_block_gradients_match_float64_reference(jit):
    q, k, v = _qkv(dtype=jnp.float32)
    w = jnp.asarray(np.random.default_rng(1).normal(size=(2, 12, 2, 8)), jnp.float32)
    g = jax.grad(lambda q, k, v: jnp.sum(attention_core(q, k, v, 0.3, 5) * w), argnums=(0, 1, 2))
    got = (jax.jit(g) if jit else g)(q, k, v)
    for a, b in zip(got, _reference_grads(q, k, v, w, 0.3)):
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-4, atol=1e-5)


def test_query_blocks_keep_only_inputs_and_bound_temporaries():
    q, k, v = _qkv(t=16)
    f = lambda q, k, v: jnp.sum(attention_core(q, k, v, 0.3, 4))
    made = [r for r in saved_residuals(f, q, k, v) if r["source"] != "argument"]
    # No logits of any block survive to the backward pass.
    assert not [r for r in made if r["shape"][-1:] == (16,) and len(r["shape"]) >= 4]
    # The compiled step's temporaries hold a (B, H, 4, 16) block, not (B, H, 16, 16).
    hlo = jax.jit(jax.grad(f, argnums=(0, 1, 2))).lower(q, k, v).compile().as_text()
    assert "f32[2,2,4,16]" in hlo and "f32[2,2,16,16]" not in hlo


def test_block_size_at_least_the_sequence_is_the_unblocked_core():
    q, k, v = _qkv()
    for block_q in (0, 12, 64):
        np.testing.assert_array_equal(
            np.asarray(attention_core(q, k, v, 0.3, block_q)),
            np.asarray(attention_core(q, k, v, 0.3)),
        )
