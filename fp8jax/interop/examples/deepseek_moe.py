"""A DeepSeek-style MoE decoder written with standard Flax NNX layers and ``lax.ragged_dot``.

Pre-norm blocks: causal attention whose projections are ``nnx.Einsum``
layers, then a mixture of experts: a router (``nnx.Linear``, softmax over
experts, top-k), one shared SwiGLU expert (``nnx.Linear``) and routed SwiGLU
experts whose weights are (E, D, 2F) and (E, F, D) parameters applied to the
tokens sorted by expert with ``jax.lax.ragged_dot`` (dropless).  Module
paths: ``embed``, ``layers/<i>/attn/{qkv,o}``, ``layers/<i>/moe/router``,
``layers/<i>/moe/shared/{up,down}``, ``layers/<i>/moe`` (the two ragged
dots), ``head``.  The hooks ``dot_general``, ``einsum_op`` and
``ragged_dot`` default to the ``jax`` ops.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from .llama import causal_attention, rope


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    vocab: int = 256
    d_model: int = 128
    n_heads: int = 4
    n_experts: int = 4
    top_k: int = 2
    d_expert: int = 128
    n_layers: int = 2


class Attention(nnx.Module):
    def __init__(self, cfg: MoEConfig, einsum_op: Callable, *, rngs: nnx.Rngs):
        h, d = cfg.n_heads, cfg.d_model
        self.qkv = nnx.Einsum("btd,dshk->btshk", (d, 3, h, d // h), einsum_op=einsum_op, rngs=rngs)
        self.o = nnx.Einsum("bthk,hkd->btd", (h, d // h, d), einsum_op=einsum_op, rngs=rngs)

    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        qkv = self.qkv(x_BxTxD)
        q, k, v = (qkv[:, :, i] for i in range(3))
        return self.o(causal_attention(rope(q), rope(k), v.astype(jnp.float32)))


class SharedExpert(nnx.Module):
    def __init__(self, cfg: MoEConfig, dot_general: Callable, *, rngs: nnx.Rngs):
        lin = dict(use_bias=False, dot_general=dot_general, rngs=rngs)
        self.up = nnx.Linear(cfg.d_model, 2 * cfg.d_expert, **lin)
        self.down = nnx.Linear(cfg.d_expert, cfg.d_model, **lin)

    def __call__(self, x: jax.Array) -> jax.Array:
        gate, up = jnp.split(self.up(x), 2, axis=-1)
        return self.down(jax.nn.silu(gate) * up)


class MoE(nnx.Module):
    def __init__(
        self, cfg: MoEConfig, dot_general: Callable, ragged_dot: Callable, *, rngs: nnx.Rngs
    ):
        e, d, f = cfg.n_experts, cfg.d_model, cfg.d_expert
        self.top_k = cfg.top_k
        self.ragged_dot = ragged_dot
        # The router keeps the model's own dot_general: it is left in high precision.
        self.router = nnx.Linear(d, e, use_bias=False, rngs=rngs)
        init = nnx.initializers.lecun_normal()
        self.w_up = nnx.Param(init(rngs.params(), (e, d, 2 * f)))
        self.w_down = nnx.Param(init(rngs.params(), (e, f, d)))
        self.shared = SharedExpert(cfg, dot_general, rngs=rngs)

    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        b, t, d = x_BxTxD.shape
        n_experts = self.w_up.shape[0]
        x = x_BxTxD.reshape(b * t, d)
        probs = jax.nn.softmax(self.router(x).astype(jnp.float32), axis=-1)
        gates, idx = lax.top_k(probs, self.top_k)
        # Dropless dispatch: every (token, slot) pair is one row, rows sorted by expert.
        order = jnp.argsort(idx.reshape(-1), stable=True)
        rows = x[order // self.top_k]
        group_sizes = jnp.bincount(idx.reshape(-1), length=n_experts).astype(jnp.int32)
        gate_up = self.ragged_dot(rows, self.w_up[...], group_sizes)
        g, u = jnp.split(gate_up, 2, axis=-1)
        y = self.ragged_dot(jax.nn.silu(g) * u, self.w_down[...], group_sizes)
        # Combine: un-sort and weight each slot by its gate, in float32.
        y = y[jnp.argsort(order)].astype(jnp.float32).reshape(b * t, self.top_k, d)
        out = jnp.sum(y * gates[..., None], axis=1)
        return (out + self.shared(x).astype(jnp.float32)).reshape(b, t, d)


class Block(nnx.Module):
    def __init__(self, cfg, dot_general, einsum_op, ragged_dot, *, rngs: nnx.Rngs):
        self.attn_norm = nnx.RMSNorm(cfg.d_model, rngs=rngs)
        self.attn = Attention(cfg, einsum_op, rngs=rngs)
        self.moe_norm = nnx.RMSNorm(cfg.d_model, rngs=rngs)
        self.moe = MoE(cfg, dot_general, ragged_dot, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.attn_norm(x))
        return x + self.moe(self.moe_norm(x))


class DeepSeekMoE(nnx.Module):
    """Decoder-only MoE LM: tokens (B, T) int -> logits (B, T, vocab) float32."""

    def __init__(
        self,
        cfg: MoEConfig,
        *,
        rngs: nnx.Rngs,
        dot_general: Callable = lax.dot_general,
        einsum_op: Callable = jnp.einsum,
        ragged_dot: Callable = lax.ragged_dot,
    ):
        self.embed = nnx.Embed(cfg.vocab, cfg.d_model, rngs=rngs)
        self.layers = nnx.List(
            [Block(cfg, dot_general, einsum_op, ragged_dot, rngs=rngs) for _ in range(cfg.n_layers)]
        )
        self.norm = nnx.RMSNorm(cfg.d_model, rngs=rngs)
        self.head = nnx.Linear(cfg.d_model, cfg.vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens_BxT: jax.Array) -> jax.Array:
        x = self.embed(tokens_BxT)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x)).astype(jnp.float32)
