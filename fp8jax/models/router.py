"""DeepSeek-V3 router: sigmoid scores, aux-loss-free bias, group-limited top-k.

All routing math runs in float32 (the paper keeps the gate in high
precision): the gating GEMM is a plain float32 matmul, not an FP8 GEMM.

* scores s = sigmoid(x W_g^T)                      (T, E)
* selection: top-k of (s + b), b the router bias (selection only, no gradient);
  group-limited routing first keeps the ``topk_groups`` groups with the
  highest sum of their two best biased scores and masks the others;
* gates g = s[selected] / sum s[selected] * routed_scaling  (unbiased scores);
* sequence-wise balance loss (per sequence, averaged over the batch):
  L = sum_i f_i P_i, f_i = E / (k T) * #tokens routed to i,
  P_i = mean_t s'_{t,i} with s' = s / sum_j s_j;
* bias update after each step: b += gamma * sign(mean_load - load).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from fp8jax.gemm import with_dot_algorithm
from fp8jax.nn.dense import fan_in_init


def route(
    scores_TxE: jax.Array,
    bias_E: jax.Array,
    top_k: int,
    *,
    n_groups: int = 1,
    topk_groups: int = 1,
) -> tuple[jax.Array, jax.Array]:
    """Top-k experts per token from biased scores (group-limited if n_groups > 1).

    Returns (expert indices int32 (T, k), gate weights float32 (T, k)) with the
    gates taken from the *unbiased* scores and normalised to sum 1.
    """
    t, e = scores_TxE.shape
    # The bias only selects: no gradient flows into it through the indices anyway,
    # and stop_gradient makes that explicit.
    biased = scores_TxE + jax.lax.stop_gradient(bias_E.astype(jnp.float32))[None, :]
    if n_groups > 1:
        per = e // n_groups
        grouped = biased.reshape(t, n_groups, per)
        # DeepSeek-V3: a group's score is the sum of its two best (biased) scores.
        top2 = jax.lax.top_k(grouped, min(2, per))[0].sum(-1)
        _, keep = jax.lax.top_k(top2, topk_groups)
        gmask = jnp.zeros((t, n_groups), bool).at[jnp.arange(t)[:, None], keep].set(True)
        emask = jnp.repeat(gmask, per, axis=1)
        biased = jnp.where(emask, biased, -jnp.inf)
    _, idx = jax.lax.top_k(biased, top_k)
    sel = jnp.take_along_axis(scores_TxE, idx, axis=1)
    # Normalise in float32; sigmoid scores are > 0, the floor only guards underflow.
    gates = sel / jnp.maximum(sel.sum(-1, keepdims=True), 1e-20)
    return idx.astype(jnp.int32), gates


def expert_load(idx_TxK: jax.Array, n_experts: int) -> jax.Array:
    """Tokens routed to each expert, float32 (E,)."""
    return jnp.zeros((n_experts,), jnp.float32).at[idx_TxK.reshape(-1)].add(1.0)


def seq_balance_loss(scores_BxTxE: jax.Array, idx_BxTxK: jax.Array) -> jax.Array:
    """DeepSeek-V3's complementary sequence-wise balance loss (without alpha), float32."""
    b, t, e = scores_BxTxE.shape
    k = idx_BxTxK.shape[-1]
    counts = jax.vmap(lambda i: expert_load(i, e))(idx_BxTxK.reshape(b, t * k))  # (B, E)
    f = counts * (e / (k * t))
    sn = scores_BxTxE / jnp.sum(scores_BxTxE, axis=-1, keepdims=True)
    p = jnp.mean(sn, axis=1)  # (B, E)
    return jnp.mean(jnp.sum(f * p, axis=-1))


def update_router_bias(bias: jax.Array, expert_load: jax.Array, rate: float) -> jax.Array:
    """Aux-loss-free balancing: b += rate * sign(mean load - load), per layer.

    bias, expert_load: float32 [..., E] (e.g. [n_moe_layers, E]); the mean is
    over the expert axis.  Overloaded experts lose score, underloaded gain.
    """
    load = expert_load.astype(jnp.float32)
    mean = jnp.mean(load, axis=-1, keepdims=True)
    return (bias + rate * jnp.sign(mean - load)).astype(bias.dtype)


class Router(nnx.Module):
    """The gate: float32 weight (E, D); returns scores, indices and gates."""

    def __init__(self, d_model: int, n_experts: int, *, rngs: nnx.Rngs):
        self.n_experts = n_experts
        self.weight = nnx.Param(fan_in_init(d_model)(rngs.params(), (n_experts, d_model)))

    def __call__(self, x_TxD: jax.Array) -> jax.Array:
        # The router stays in float32 (as in DeepSeek-V3): no FP8, no bf16;
        # each platform's float32 algorithm (TPUs refuse the F32_F32_F32 preset).
        x, w = x_TxD.astype(jnp.float32), self.weight[...].astype(jnp.float32).T
        logits = with_dot_algorithm(jnp.float32, lambda alg: jnp.dot(x, w, precision=alg))
        return jax.nn.sigmoid(logits)
