"""The model on a ('data', 'expert') mesh of 8 simulated CPU devices = the unsharded model.

JAX fixes its device count at initialisation, so the check runs in a
subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=8.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    import fp8jax
    from fp8jax.models import ModelConfig, MoETransformer, loss_fn
    from fp8jax.models.sharding import make_mesh, shard_model, batch_sharding
    from fp8jax.nn import FP8State

    assert jax.device_count() == 8, jax.devices()
    FAST = {"xla_backend_optimization_level": 0}
    cfg = ModelConfig.tiny(max_seq_len=32, dtype="float32")
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (8, 32)), jnp.int32)
    mesh = make_mesh(n_expert=4)
    assert dict(mesh.shape) == {"data": 2, "expert": 4}

    def run(recipe, sharded):
        model = MoETransformer(cfg, recipe, rngs=nnx.Rngs(0), telemetry=False)
        tok = tokens
        if sharded:
            shard_model(model, mesh)
            tok = jax.device_put(tokens, batch_sharding(mesh))
            w = model.blocks[1].ffn.w13[...]
            assert w.sharding.spec[0] == "expert", w.sharding
            assert len(w.addressable_shards[0].data) == 2  # 8 experts / 4 shards
        graph, params, st, rest = nnx.split(model, nnx.Param, FP8State, ...)

        @jax.jit(compiler_options=FAST)
        def step(params, st, tok):
            f = lambda p, s: loss_fn(nnx.merge(graph, p, s, rest), tok)
            return jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(params, st)

        (loss, aux), grads = step(params, st, tok)
        if sharded:
            g = jax.tree.leaves(grads[0])
            assert any(len(x.sharding.device_set) == 8 for x in g)
        return float(loss), np.asarray(aux["expert_load"]), jax.tree.map(np.asarray, grads)

    for name, tol in (("deepseek_v3", 1e-3),):
        r = fp8jax.recipes.get(name)
        l1, load1, g1 = run(r, False)
        l8, load8, g8 = run(r, True)
        np.testing.assert_array_equal(load1, load8)
        assert abs(l1 - l8) <= 1e-5 * abs(l1), (name, l1, l8)
        for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g8)):
            err = np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-30)
            assert err < tol, (name, a.shape, err)
        print(name, "loss", l1, l8, "ok")
    print("SHARDING OK")
    """
)


def test_sharded_model_matches_unsharded():
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
    env["JAX_PLATFORMS"] = "cpu"
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    assert "SHARDING OK" in out.stdout
