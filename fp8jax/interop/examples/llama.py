"""A Llama-style dense decoder written with standard Flax NNX layers only.

Token embedding, pre-norm blocks (RMSNorm, causal multi-head attention with
rotary positions, SwiGLU MLP), final RMSNorm and an untied output head.
Module paths: ``embed``, ``layers/<i>/attn/{q,k,v,o}``,
``layers/<i>/mlp/{gate,up,down}``, ``head``.  ``dot_general`` is handed to
every projection (the Flax hook); the attention core is ``jnp.einsum`` of
two activations.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab: int = 256
    d_model: int = 128
    n_heads: int = 4
    d_ff: int = 256
    n_layers: int = 2


def rope(x_BxTxHxD: jax.Array) -> jax.Array:
    """Rotary position embedding on the last axis (pairs of halves), float32."""
    t, d = x_BxTxHxD.shape[1], x_BxTxHxD.shape[-1]
    freq = 1.0 / (10000.0 ** (jnp.arange(0, d // 2, dtype=jnp.float32) / (d // 2)))
    ang = jnp.arange(t, dtype=jnp.float32)[:, None] * freq[None, :]
    cos, sin = jnp.cos(ang)[None, :, None, :], jnp.sin(ang)[None, :, None, :]
    x1, x2 = jnp.split(x_BxTxHxD.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def causal_attention(q, k, v) -> jax.Array:
    """softmax(q k^T / sqrt(d)) v with a causal mask, in float32 (B, T, H, D)."""
    d = q.shape[-1]
    s = jnp.einsum("bthd,bshd->bhts", q, k) / jnp.sqrt(jnp.float32(d))
    t = q.shape[1]
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e30)
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), v)


class Attention(nnx.Module):
    def __init__(self, cfg: LlamaConfig, dot_general: Callable, *, rngs: nnx.Rngs):
        d = cfg.d_model
        lin = dict(use_bias=False, dot_general=dot_general, rngs=rngs)
        self.n_heads = cfg.n_heads
        self.q, self.k, self.v, self.o = (nnx.Linear(d, d, **lin) for _ in range(4))

    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        b, t, d = x_BxTxD.shape
        heads = lambda y: y.reshape(b, t, self.n_heads, d // self.n_heads)
        q, k = rope(heads(self.q(x_BxTxD))), rope(heads(self.k(x_BxTxD)))
        out = causal_attention(q, k, heads(self.v(x_BxTxD)).astype(jnp.float32))
        return self.o(out.reshape(b, t, d))


class MLP(nnx.Module):
    def __init__(self, cfg: LlamaConfig, dot_general: Callable, *, rngs: nnx.Rngs):
        lin = dict(use_bias=False, dot_general=dot_general, rngs=rngs)
        self.gate = nnx.Linear(cfg.d_model, cfg.d_ff, **lin)
        self.up = nnx.Linear(cfg.d_model, cfg.d_ff, **lin)
        self.down = nnx.Linear(cfg.d_ff, cfg.d_model, **lin)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class Block(nnx.Module):
    def __init__(self, cfg: LlamaConfig, dot_general: Callable, *, rngs: nnx.Rngs):
        self.attn_norm = nnx.RMSNorm(cfg.d_model, rngs=rngs)
        self.attn = Attention(cfg, dot_general, rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(cfg.d_model, rngs=rngs)
        self.mlp = MLP(cfg, dot_general, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Llama(nnx.Module):
    """Decoder-only LM: tokens (B, T) int -> logits (B, T, vocab) float32."""

    def __init__(
        self, cfg: LlamaConfig, *, rngs: nnx.Rngs, dot_general: Callable = lax.dot_general
    ):
        self.embed = nnx.Embed(cfg.vocab, cfg.d_model, rngs=rngs)
        self.layers = nnx.List([Block(cfg, dot_general, rngs=rngs) for _ in range(cfg.n_layers)])
        self.norm = nnx.RMSNorm(cfg.d_model, rngs=rngs)
        # The head keeps the model's own dot_general: it is left in high precision.
        self.head = nnx.Linear(cfg.d_model, cfg.vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens_BxT: jax.Array) -> jax.Array:
        x = self.embed(tokens_BxT)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x)).astype(jnp.float32)


def next_token_loss(model: nnx.Module, tokens_BxT: jax.Array) -> jax.Array:
    """Mean cross-entropy of predicting token t+1 from tokens <= t (nats)."""
    logits = model(tokens_BxT[:, :-1])
    logp = jax.nn.log_softmax(logits, axis=-1)
    target = tokens_BxT[:, 1:]
    return -jnp.mean(jnp.take_along_axis(logp, target[..., None], axis=-1))
