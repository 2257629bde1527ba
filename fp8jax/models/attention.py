"""Attention: multi-head with RoPE, or DeepSeek-V3 multi-head latent attention (MLA).

Every projection is an fp8jax layer (its GEMMs follow the recipe); the
attention core -- QK^T, softmax and PV -- runs in float32, as DeepSeek-V3
keeps it in high precision.  RMSNorm (also used by the transformer blocks)
computes in float32.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from fp8jax.gemm import with_dot_algorithm
from fp8jax.layout import pad_axis
from fp8jax.models.config import ModelConfig
from fp8jax.nn import Dense
from fp8jax.recipes import Recipe, for_site


class RMSNorm(nnx.Module):
    """y = x / sqrt(mean(x^2) + eps) * g, computed in float32, returned in ``dtype``."""

    def __init__(self, dim: int, *, eps: float = 1e-6, dtype=jnp.bfloat16, param_dtype=jnp.float32):
        self.eps = eps
        self.dtype = jnp.dtype(dtype)
        self.scale = nnx.Param(jnp.ones((dim,), jnp.dtype(param_dtype)))

    def __call__(self, x: jax.Array) -> jax.Array:
        # Norms stay in float32 (paper): the mean of squares of bf16 values
        # would lose the small channels.
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (y * self.scale[...].astype(jnp.float32)).astype(self.dtype)


def rope(x_BxTxHxD: jax.Array, theta: float) -> jax.Array:
    """Rotary position embedding (half-split pairs), positions 0..T-1, in float32."""
    _, t, _, d = x_BxTxHxD.shape
    half = d // 2
    inv = 1.0 / (theta ** (jnp.arange(half, dtype=jnp.float32) / half))
    ang = jnp.arange(t, dtype=jnp.float32)[:, None] * inv[None, :]  # (T, half)
    cos = jnp.cos(ang)[None, :, None, :]
    sin = jnp.sin(ang)[None, :, None, :]
    # Rotation in float32: positions up to max_seq_len need more than bf16's 8 bits.
    xf = x_BxTxHxD.astype(jnp.float32)
    x1, x2 = xf[..., :half], xf[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxTxHxD.dtype)


def _causal_attention_rows(q, k, v, scale: float, first_row) -> jax.Array:
    """Causal softmax(q k^T * scale) v in float32 for the query rows ``first_row`` + 0..Tq-1.

    q: (B, Tq, H, Dk); k: (B, T, H, Dk); v: (B, T, H, Dv) -> (B, Tq, H, Dv) float32.
    Row i attends to keys 0..first_row + i (``first_row`` may be traced).
    """
    # High-precision core (paper): float32 logits, softmax and PV.
    qf, kf, vf = (a.astype(jnp.float32) for a in (q, k, v))
    # Each platform's float32 algorithm (TPUs refuse the F32_F32_F32 preset).
    logits = (
        with_dot_algorithm(
            jnp.float32, lambda alg: jnp.einsum("bthd,bshd->bhts", qf, kf, precision=alg)
        )
        * scale
    )
    rows = first_row + jnp.arange(q.shape[1])
    causal = rows[:, None] >= jnp.arange(k.shape[1])[None, :]
    # The mask as an additive (Tq, T) bias (x + 0 is x, x - inf is -inf):
    # a select against -inf would have XLA materialize a (B, H, Tq, T) -inf.
    logits = logits + jnp.where(causal, 0.0, -jnp.inf)[None, None]
    probs = jax.nn.softmax(logits, axis=-1)
    return with_dot_algorithm(
        jnp.float32, lambda alg: jnp.einsum("bhts,bshd->bthd", probs, vf, precision=alg)
    )


def stored_attention_core(q, k, v, scale: float) -> jax.Array:
    """Causal softmax(q k^T * scale) v in float32, its intermediates stored for backward.

    q, k: (B, T, H, Dk); v: (B, T, H, Dv) -> (B, T, H, Dv) float32.
    """
    return _causal_attention_rows(q, k, v, scale, 0)


# Recomputed in the backward pass (jax.checkpoint): kept across the step are
# only q, k, v as given, not the float32 (B, H, T, T) logits, exponentials and
# probabilities of every layer, the largest activations of a long sequence.
# The recomputation repeats the same operations, so with one block of queries
# the gradients are the ones autodiff would give from stored values
# (tests/test_models_attention.py checks them bit for bit against
# stored_attention_core).
def attention_core(q, k, v, scale: float, block_q: int = 0) -> jax.Array:
    """:func:`stored_attention_core`, recomputed in the backward pass from q, k, v.

    ``block_q`` > 0 and < T: the queries go through in blocks of ``block_q``
    rows (a scan), each block's softmax over all of its keys, so the float32
    (B, H, block_q, T) logits of one block are the largest temporaries of the
    forward and the backward pass instead of (B, H, T, T).  A row's output is
    computed from the same values as unblocked; dK and dV become a sum over
    the blocks (float32 reduction order).  T is padded to a multiple of
    ``block_q`` with zero queries, whose outputs are dropped.
    """
    t = q.shape[1]
    if block_q <= 0 or t <= block_q:
        return jax.checkpoint(stored_attention_core, static_argnums=(3,))(q, k, v, scale)
    n = -(-t // block_q)
    # Zero queries past T: each still sees key 0, so its softmax is finite; dropped below.
    qp = pad_axis(q, 1, block_q)
    q_blocks = jnp.moveaxis(qp.reshape(q.shape[0], n, block_q, *q.shape[2:]), 1, 0)

    @jax.checkpoint
    def one_block(args):
        qb, first = args
        return _causal_attention_rows(qb, k, v, scale, first)

    firsts = jnp.arange(n, dtype=jnp.int32) * block_q
    out = jax.lax.map(one_block, (q_blocks, firsts))  # (n, B, block_q, H, Dv)
    out = jnp.moveaxis(out, 0, 1).reshape(q.shape[0], n * block_q, *out.shape[3:])
    return out[:, :t]


class MHA(nnx.Module):
    """Multi-head attention with RoPE; fused QKV projection and an output projection."""

    def __init__(self, cfg: ModelConfig, recipe: Recipe, *, name: str, rngs: nnx.Rngs):
        h, hd, d = cfg.n_heads, cfg.head_dim, cfg.d_model
        kw = dict(recipe=recipe, dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)
        self.cfg = cfg
        self.wqkv = Dense(d, (3, h, hd), name=f"{name}/wqkv", **kw)
        # The linear after attention is its own site (DeepSeek-V3 caches its input in E5M6).
        self.wo = Dense(
            (h, hd), d, name=f"{name}/wo", **{**kw, "recipe": for_site(recipe, "attn_out")}
        )

    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        qkv = self.wqkv(x_BxTxD)  # (B, T, 3, H, hd)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        q = rope(q, self.cfg.rope_theta)
        k = rope(k, self.cfg.rope_theta)
        o = attention_core(q, k, v, 1.0 / math.sqrt(self.cfg.head_dim), self.cfg.attention_block_q)
        # Back to the activation dtype for the FP8/bf16 output projection.
        return self.wo(o.astype(self.cfg.dtype))


class MLA(nnx.Module):
    """DeepSeek-V3 multi-head latent attention (training form, no KV-cache absorption).

    q = W_qb RMSNorm(W_qa x) (or W_q x when q_lora_rank == 0), split into a
    no-RoPE part (qk_nope_head_dim) and a RoPE part (qk_rope_head_dim) per head;
    [c_kv, k_pe] = W_kva x: c_kv is the compressed latent (kv_lora_rank),
    k_pe a single RoPE key shared by all heads (decoupled RoPE);
    [k_nope, v] = W_kvb RMSNorm(c_kv).  Scores use [q_nope, q_pe] . [k_nope, k_pe].
    """

    def __init__(self, cfg: ModelConfig, recipe: Recipe, *, name: str, rngs: nnx.Rngs):
        h, d = cfg.n_heads, cfg.d_model
        nope, rp, vd = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        kw = dict(recipe=recipe, dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)
        nkw = dict(eps=cfg.norm_eps, dtype=cfg.dtype, param_dtype=cfg.param_dtype)
        self.cfg = cfg
        if cfg.q_lora_rank > 0:
            self.wq_a = Dense(d, cfg.q_lora_rank, name=f"{name}/wq_a", **kw)
            self.q_norm = RMSNorm(cfg.q_lora_rank, **nkw)
            self.wq_b = Dense(cfg.q_lora_rank, (h, nope + rp), name=f"{name}/wq_b", **kw)
            self.wq = None
        else:
            self.wq_a = self.q_norm = self.wq_b = None
            self.wq = Dense(d, (h, nope + rp), name=f"{name}/wq", **kw)
        self.wkv_a = Dense(d, cfg.kv_lora_rank + rp, name=f"{name}/wkv_a", **kw)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, **nkw)
        self.wkv_b = Dense(cfg.kv_lora_rank, (h, nope + vd), name=f"{name}/wkv_b", **kw)
        # The linear after attention is its own site (DeepSeek-V3 caches its input in E5M6).
        self.wo = Dense(
            (h, vd), d, name=f"{name}/wo", **{**kw, "recipe": for_site(recipe, "attn_out")}
        )

    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        cfg = self.cfg
        nope, rp = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        if self.wq is not None:
            q = self.wq(x_BxTxD)
        else:
            q = self.wq_b(self.q_norm(self.wq_a(x_BxTxD)))
        q_nope, q_pe = q[..., :nope], rope(q[..., nope:], cfg.rope_theta)
        kv_a = self.wkv_a(x_BxTxD)
        c_kv, k_pe = kv_a[..., : cfg.kv_lora_rank], kv_a[..., cfg.kv_lora_rank :]
        # One RoPE key per token, shared by all heads (decoupled RoPE).
        k_pe = rope(k_pe[:, :, None, :], cfg.rope_theta)
        kv = self.wkv_b(self.kv_norm(c_kv))  # (B, T, H, nope + v)
        k_nope, v = kv[..., :nope], kv[..., nope:]
        k = jnp.concatenate([k_nope, jnp.broadcast_to(k_pe, k_nope.shape[:-1] + (rp,))], -1)
        qf = jnp.concatenate([q_nope, q_pe], -1)
        o = attention_core(qf, k, v, 1.0 / math.sqrt(nope + rp), cfg.attention_block_q)
        # Back to the activation dtype for the output projection.
        return self.wo(o.astype(cfg.dtype))


def make_attention(cfg: ModelConfig, recipe: Recipe, *, name: str, rngs: nnx.Rngs):
    if cfg.attention == "mla":
        return MLA(cfg, recipe, name=name, rngs=rngs)
    return MHA(cfg, recipe, name=name, rngs=rngs)
