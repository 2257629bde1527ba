"""Bit-for-bit fingerprints of every registered recipe's numerics on this machine.

For each recipe of ``fp8jax.registry`` (presets and variants), three
SHA-256 prefixes of the exact bytes it computes from fixed inputs:

* ``dense``: ``fp8jax.dot_general`` (256 x 384 @ 384 x 256, bfloat16) and the
  gradients of sum(y^2) with respect to both operands;
* ``ragged``: ``fp8jax.ragged_dot`` (512 tokens, 4 experts, one of them empty)
  and its gradients likewise;
* ``steps``: three train steps of the tiny model (batch 2), one hash each
  (state and metrics).

A recipe a case does not apply to prints ``ERR <exception>`` there.  Run it
at two commits and diff the outputs: a change that keeps every hash kept
the numbers.  CPUs of other makes round some operations differently, so
compare runs on the same machine type only.

    JAX_PLATFORMS=cpu python scripts/hash_numerics.py > hashes.txt
"""

from __future__ import annotations

import hashlib

import jax
import jax.numpy as jnp
import numpy as np

import fp8jax
from fp8jax import registry, scaling
from fp8jax.bench.moe_step import model_config, train_step_program

DIMS = (((1,), (0,)), ((), ()))


def fingerprint(tree) -> str:
    """The first 16 hex digits of SHA-256 over every leaf's dtype, shape and bytes."""
    m = hashlib.sha256()
    for leaf in jax.tree.leaves(tree):
        a = np.asarray(leaf)
        m.update(str(a.dtype).encode())
        m.update(str(a.shape).encode())
        m.update(np.ascontiguousarray(a).tobytes())
    return m.hexdigest()[:16]


def _squared_sum(y) -> jax.Array:
    y = y[0] if isinstance(y, tuple) else y
    return jnp.sum(y.astype(jnp.float32) ** 2)


def recipe_hashes(name: str, inputs: dict[str, jax.Array], steps: bool = True) -> dict[str, str]:
    """The three fingerprints of one recipe (see the module docstring); ``steps=False``
    leaves out the train steps."""
    r = registry.get(name)
    out = {}
    try:
        state = scaling.init_delayed_gemm_state(r) if fp8jax.needs_state(r) else None

        def dense(x, w):
            return _squared_sum(fp8jax.dot_general(x, w, DIMS, recipe=r, state=state))

        grads = jax.jit(jax.value_and_grad(dense, argnums=(0, 1)))(inputs["x"], inputs["w"])
        out["dense"] = fingerprint(grads)
    except Exception as e:  # noqa: BLE001 - a recipe a case does not apply to
        out["dense"] = f"ERR {type(e).__name__}"
    try:

        def ragged(x, w):
            return _squared_sum(fp8jax.ragged_dot(x, w, inputs["sizes"], recipe=r))

        grads = jax.jit(jax.value_and_grad(ragged, argnums=(0, 1)))(inputs["xe"], inputs["we"])
        out["ragged"] = fingerprint(grads)
    except Exception as e:  # noqa: BLE001
        out["ragged"] = f"ERR {type(e).__name__}"
    if not steps:
        return out
    try:
        step, (state, tokens) = train_step_program(model_config("tiny"), r, 2)
        hashes = []
        for _ in range(3):
            res = step(state, tokens)
            state = res[0]
            hashes.append(fingerprint(res))
        out["steps"] = ",".join(hashes)
    except Exception as e:  # noqa: BLE001
        out["steps"] = f"ERR {type(e).__name__}"
    return out


def make_inputs(m: int, k: int, n: int, sizes: list[int], ek: int, en: int) -> dict[str, jax.Array]:
    """Fixed bfloat16 operands (seed 0): x (m, k) and w (k, n) for the dense case; for
    the ragged one, sum(sizes) tokens of width ek and one (ek, en) weight per group.
    Weights are divided by round(sqrt(fan-in)), so that products stay near unit scale."""
    rng = np.random.default_rng(0)
    return {
        "x": jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16),
        "w": jnp.asarray(rng.standard_normal((k, n)) / round(np.sqrt(k)), jnp.bfloat16),
        "xe": jnp.asarray(rng.standard_normal((sum(sizes), ek)), jnp.bfloat16),
        "we": jnp.asarray(
            rng.standard_normal((len(sizes), ek, en)) / round(np.sqrt(ek)), jnp.bfloat16
        ),
        "sizes": jnp.asarray(sizes, jnp.int32),
    }


def main() -> None:
    inputs = make_inputs(256, 384, 256, [100, 156, 0, 256], 256, 256)
    for name in sorted(registry.RECIPES):
        h = recipe_hashes(name, inputs)
        print(name, h["dense"], h["ragged"], h["steps"], flush=True)


if __name__ == "__main__":
    main()
