"""The DeepSeek-V3-style MoE transformer (Flax NNX) and its loss.

tokens -> embedding (float32 table) -> [activation site "residual"] ->
n_layers x (x += attn(RMSNorm(x)); x += FFN(RMSNorm(x))) -> RMSNorm ->
output head (float32 GEMM) -> logits float32.

The embedding and the output head stay in high precision (float32); every
other GEMM runs through the recipe.  Activations between layers are in
``cfg.dtype`` (bfloat16 by default); parameters in ``cfg.param_dtype``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from fp8jax.gemm import with_dot_algorithm
from fp8jax.models.attention import RMSNorm, make_attention
from fp8jax.models.config import ModelConfig
from fp8jax.models.moe import MoE, SwiGLU, first_token_rows
from fp8jax.nn import taps
from fp8jax.nn.dense import fan_in_init
from fp8jax.nn.recording import capture
from fp8jax.nn.variables import RouterBias
from fp8jax.recipes import Recipe, for_layer


class Block(nnx.Module):
    """RMSNorm -> attention -> residual; RMSNorm -> FFN (dense SwiGLU or MoE) -> residual."""

    def __init__(self, cfg: ModelConfig, recipe: Recipe, layer: int, *, rngs: nnx.Rngs):
        nkw = dict(eps=cfg.norm_eps, dtype=cfg.dtype, param_dtype=cfg.param_dtype)
        self.attn_norm = RMSNorm(cfg.d_model, **nkw)
        self.attn = make_attention(cfg, recipe, name=f"layer{layer}/attn", rngs=rngs)
        self.ffn_norm = RMSNorm(cfg.d_model, **nkw)
        self.is_moe = layer >= cfg.n_dense_layers
        if self.is_moe:
            self.ffn = MoE(cfg, recipe, name=f"layer{layer}/moe", rngs=rngs)
        else:
            self.ffn = SwiGLU(cfg, recipe, cfg.d_ff, name=f"layer{layer}/ffn", rngs=rngs)

    def __call__(self, x, bias_E):
        # Residual adds in float32, one rounding back to the activation dtype.
        x = (x.astype(jnp.float32) + self.attn(self.attn_norm(x)).astype(jnp.float32)).astype(
            x.dtype
        )
        h = self.ffn_norm(x)
        if self.is_moe:
            y, aux = self.ffn(h, bias_E)
        else:
            y, aux = self.ffn(h), None
        x = (x.astype(jnp.float32) + y.astype(jnp.float32)).astype(x.dtype)
        return x, aux


class MoETransformer(nnx.Module):
    """DeepSeek-V3-style MoE transformer whose projections and experts follow ``recipe``.

    ``__call__(tokens int32 [B, T]) -> (logits float32 [B, T, V], aux)`` with
    aux["aux_loss"] (sequence-wise balance loss x coef, 0 when off),
    aux["expert_load"] float32 [n_moe_layers, E] (tokens per expert this call),
    aux["load_max_over_mean"] float32 [n_moe_layers], aux["router_bias"]
    [n_moe_layers, E], and aux["fp8"] ({} when ``telemetry=False``): what
    the layers sow, by site: "<gemm>/x" and "<gemm>/w" -> {"amax",
    "saturated", "flushed"} for the forward operands of every GEMM,
    "<ffn>/swiglu" -> {"outlier_ratio", "align_max", "align_mean"} for every
    SwiGLU (:mod:`fp8jax.monitors`), "<moe>/tokens" -> {"count": (E,)}.
    """

    def __init__(self, cfg: ModelConfig, recipe: Recipe, *, rngs: nnx.Rngs, telemetry: bool = True):
        self.cfg = cfg
        self.recipe = recipe
        self.telemetry = telemetry
        pdt = jnp.dtype(cfg.param_dtype)
        # Embedding table: unit-variance rows (the first RMSNorm sees O(1) inputs),
        # drawn in float32 and stored in param_dtype (the float32 master copy).
        self.embed = nnx.Param(
            jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.d_model), jnp.float32).astype(pdt)
        )
        # A recipe may keep its last blocks in high precision (Recipe.high_precision_last).
        self.blocks = nnx.List(
            [
                Block(cfg, for_layer(recipe, i, cfg.n_layers), i, rngs=rngs)
                for i in range(cfg.n_layers)
            ]
        )
        self.final_norm = RMSNorm(
            cfg.d_model, eps=cfg.norm_eps, dtype=jnp.float32, param_dtype=cfg.param_dtype
        )
        self.head = nnx.Param(
            fan_in_init(cfg.d_model)(rngs.params(), (cfg.d_model, cfg.vocab_size), pdt)
        )
        self.router_bias = RouterBias(
            jnp.zeros((cfg.n_moe_layers, cfg.n_routed_experts), jnp.float32)
        )

    def __call__(self, tokens: jax.Array) -> tuple[jax.Array, dict]:
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [B, T], got shape {tokens.shape}")
        if tokens.shape[1] > self.cfg.max_seq_len:
            raise ValueError(
                f"sequence length {tokens.shape[1]} > max_seq_len {self.cfg.max_seq_len}"
            )
        (logits, aux), stats = capture(self._forward, tokens)
        aux["fp8"] = stats if self.telemetry else {}
        return logits, aux

    def _forward(self, tokens: jax.Array) -> tuple[jax.Array, dict]:
        cfg = self.cfg
        # High-precision embedding lookup; activations then live in cfg.dtype.
        x = self.embed[...][tokens].astype(cfg.dtype)
        if taps.site_open("residual"):
            b, t, d = x.shape
            x = taps.site("residual", x.reshape(b * t, d), first_token_rows(b, t)).reshape(b, t, d)
        bias = self.router_bias.get_value()
        loads, bal = [], []
        for i, blk in enumerate(self.blocks):
            j = i - cfg.n_dense_layers
            x, aux = blk(x, bias[j] if j >= 0 else None)
            if aux is not None:
                loads.append(aux["load"])
                bal.append(aux["balance_loss"])
        h = self.final_norm(x)
        # Output head in float32 (high precision, as in DeepSeek-V3), with each
        # platform's float32 algorithm (TPUs refuse the F32_F32_F32 preset).
        hf, wf = h.astype(jnp.float32), self.head[...].astype(jnp.float32)
        logits = with_dot_algorithm(jnp.float32, lambda alg: jnp.dot(hf, wf, precision=alg))
        e = cfg.n_routed_experts
        load = jnp.stack(loads) if loads else jnp.zeros((0, e), jnp.float32)
        aux_loss = (
            cfg.seq_aux_loss_coef * jnp.sum(jnp.stack(bal)) if bal else jnp.zeros((), jnp.float32)
        )
        aux = {
            "aux_loss": aux_loss.astype(jnp.float32),
            "expert_load": load,
            "load_max_over_mean": jnp.max(load, axis=-1)
            / jnp.maximum(jnp.mean(load, axis=-1), 1e-9),
            "router_bias": bias,
        }
        return logits, aux


def cross_entropy(logits_BxTxV: jax.Array, tokens_BxT: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy in float32 (position t predicts token t+1)."""
    lg = logits_BxTxV[:, :-1].astype(jnp.float32)
    tgt = tokens_BxT[:, 1:]
    logz = jax.nn.logsumexp(lg, axis=-1)
    picked = jnp.take_along_axis(lg, tgt[..., None], axis=-1)[..., 0]
    return jnp.mean(logz - picked)


def loss_fn(model: MoETransformer, tokens: jax.Array) -> tuple[jax.Array, dict]:
    """(cross-entropy + aux_loss, aux with aux["ce"]) in float32."""
    logits, aux = model(tokens)
    ce = cross_entropy(logits, tokens)
    return ce + aux["aux_loss"], {**aux, "ce": ce}
