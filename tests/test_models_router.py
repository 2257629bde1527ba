"""Router: selection, gates, group-limited routing, balance loss, bias balancing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import fp8jax
from fp8jax.models import ModelConfig, MoETransformer, update_router_bias
from fp8jax.models.router import route, seq_balance_loss
from fp8jax.nn import RouterBias


def _ref_route(s, b, k, n_groups=1, topk_groups=1):
    t, e = s.shape
    idx = np.zeros((t, k), int)
    gates = np.zeros((t, k))
    for i in range(t):
        biased = s[i] + b
        allowed = np.ones(e, bool)
        if n_groups > 1:
            per = e // n_groups
            gscore = [np.sort(biased[g * per : (g + 1) * per])[-2:].sum() for g in range(n_groups)]
            keep = np.argsort(gscore)[::-1][:topk_groups]
            allowed[:] = False
            for g in keep:
                allowed[g * per : (g + 1) * per] = True
        cand = np.where(allowed, biased, -np.inf)
        sel = np.argsort(-cand, kind="stable")[:k]
        idx[i] = sel
        gates[i] = s[i, sel] / s[i, sel].sum()
    return idx, gates


def test_route_matches_reference_and_bias_only_selects():
    rng = np.random.default_rng(0)
    s = rng.uniform(0.05, 0.95, (40, 8))
    b = rng.normal(0, 0.3, 8)
    for n_groups, tg in [(1, 1), (4, 2)]:
        idx, gates = route(
            jnp.asarray(s, jnp.float32),
            jnp.asarray(b, jnp.float32),
            3,
            n_groups=n_groups,
            topk_groups=tg,
        )
        ridx, rgates = _ref_route(s, b, 3, n_groups, tg)
        np.testing.assert_array_equal(np.sort(np.asarray(idx), 1), np.sort(ridx, 1))
        order = np.argsort(np.asarray(idx), 1)
        rorder = np.argsort(ridx, 1)
        np.testing.assert_allclose(
            np.take_along_axis(np.asarray(gates), order, 1),
            np.take_along_axis(rgates, rorder, 1),
            rtol=1e-6,
        )
    # The gates use unbiased scores: a bias gradient would be zero.
    g = jax.grad(lambda bb: jnp.sum(route(jnp.asarray(s, jnp.float32), bb, 3)[1] * 1.0))(
        jnp.asarray(b, jnp.float32)
    )
    assert np.all(np.asarray(g) == 0)


def test_group_limited_routing_stays_in_groups():
    rng = np.random.default_rng(1)
    s = jnp.asarray(rng.uniform(0, 1, (64, 16)), jnp.float32)
    idx, _ = route(s, jnp.zeros(16), 4, n_groups=8, topk_groups=2)
    groups = np.asarray(idx) // 2
    assert max(len(set(r)) for r in groups) <= 2


def test_seq_balance_loss_reference():
    rng = np.random.default_rng(2)
    b, t, e, k = 2, 10, 6, 2
    s = rng.uniform(0.1, 0.9, (b, t, e))
    idx = np.stack([[rng.choice(e, k, replace=False) for _ in range(t)] for _ in range(b)])
    want = 0.0
    for i in range(b):
        f = np.zeros(e)
        for row in idx[i]:
            f[row] += 1
        f *= e / (k * t)
        p = (s[i] / s[i].sum(-1, keepdims=True)).mean(0)
        want += (f * p).sum() / b
    got = seq_balance_loss(jnp.asarray(s, jnp.float32), jnp.asarray(idx))
    np.testing.assert_allclose(float(got), want, rtol=1e-5)


def test_update_router_bias():
    bias = jnp.zeros((2, 4))
    load = jnp.asarray([[10.0, 2.0, 4.0, 4.0], [5.0, 5.0, 5.0, 5.0]])
    new = update_router_bias(bias, load, 0.1)
    np.testing.assert_allclose(np.asarray(new), [[-0.1, 0.1, 0.1, 0.1], [0, 0, 0, 0]])


def test_bias_balancing_lowers_max_over_mean_load_on_skewed_input():
    cfg = ModelConfig.tiny(n_layers=2, n_dense_layers=1, max_seq_len=32)
    model = MoETransformer(cfg, fp8jax.recipes.bf16(), rngs=nnx.Rngs(0), telemetry=False)
    # Skew: the router prefers experts 0 and 1 for every token.
    w = model.blocks[1].ffn.router.weight
    w[...] = w[...].at[:2].add(0.5 * jnp.sign(jnp.mean(w[...], axis=0)))
    graph, bias_state, rest = nnx.split(model, RouterBias, ...)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 16, (8, 32)), jnp.int32)

    @jax.jit(compiler_options={"xla_backend_optimization_level": 0})
    def forward(bias_state):
        _, aux = nnx.merge(graph, bias_state, rest)(tokens)
        return aux["expert_load"], aux["load_max_over_mean"]

    ratios = []
    for _ in range(60):
        load, ratio = forward(bias_state)
        ratios.append(float(ratio[0]))
        bias_state = jax.tree.map(
            lambda b, load=load: update_router_bias(b, load, 0.02), bias_state
        )
    assert ratios[0] > 2.0  # really skewed at the start
    assert np.mean(ratios[-10:]) < 0.6 * ratios[0]
