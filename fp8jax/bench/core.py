"""The numerics core's cost on this backend, as ratios measured in one run.

* quantize ratio: 1x128 tile quantization of a float32 tensor / a plain
  ``astype(bfloat16)`` of the same tensor (quantizing writes 1 byte + 1/32
  per element, the cast 2 bytes);
* GEMM ratio: deepseek_v3 ``dot_general`` forward + backward / the bf16
  recipe's forward + backward, at M = K = N;
* residual ratio: bytes saved for the backward pass by deepseek_v3 / by bf16.

The functions compared in one ratio are timed round-robin in one run
(:func:`fp8jax.bench.timing.time_calls`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax import recipes
from fp8jax.bench.timing import time_calls
from fp8jax.dot_general import dot_general
from fp8jax.formats import E4M3
from fp8jax.quant import quantize

_DN = (((1,), (0,)), ((), ()))


def tree_nbytes(tree) -> int:
    """Total bytes of the array leaves of a pytree."""
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree) if hasattr(x, "dtype")))


def quantize_ratio(rows: int = 4096, cols: int = 4096, iters: int = 10) -> dict[str, float]:
    """Median times of a 1x128 tile quantize and of ``astype(bfloat16)``, and their ratio."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32))
    cast = jax.jit(lambda x: x.astype(jnp.bfloat16))
    tile = jax.jit(lambda x: quantize(x, E4M3, "tile", axis=-1))
    t = time_calls({"cast": (cast, (x,)), "tile": (tile, (x,))}, iters=iters)
    t_cast, t_tile = t["cast"]["median_s"], t["tile"]["median_s"]
    return {"t_astype_bf16_s": t_cast, "t_tile_quantize_s": t_tile, "ratio": t_tile / t_cast}


def _fwd_bwd(recipe):
    # dy is an input (not the constant ones of a plain sum), so XLA cannot
    # constant-fold the backward quantization.
    def loss(x, w, dy):
        return jnp.sum(dot_general(x, w, _DN, recipe=recipe).astype(jnp.float32) * dy)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def residual_bytes(recipe, x, w) -> int:
    """Bytes of the arrays the VJP closes over (what is kept for backward)."""
    _, vjp = jax.vjp(lambda x, w: dot_general(x, w, _DN, recipe=recipe), x, w)
    return tree_nbytes(vjp)


def gemm_ratio(size: int = 2048, iters: int = 5) -> dict[str, float]:
    """fwd+bwd times of dot_general per recipe variant at M = K = N = ``size``, ratios to bf16."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((size, size)).astype(np.float32))
    w = jnp.asarray((rng.standard_normal((size, size)) / np.sqrt(size)).astype(np.float32))
    dy = jnp.asarray(rng.standard_normal((size, size)).astype(np.float32))
    ds = recipes.deepseek_v3()
    variants = {
        "bf16": recipes.bf16(),
        "deepseek_v3": ds,
        "deepseek_v3_dequant_bf16": dataclasses.replace(ds, dequant_dtype="bfloat16"),
        "deepseek_v3_pow2_dequant_bf16": dataclasses.replace(
            recipes.deepseek_v3(pow2=True), dequant_dtype="bfloat16"
        ),
    }
    times = time_calls(
        {name: (_fwd_bwd(r), (x, w, dy)) for name, r in variants.items()}, iters=iters
    )
    out: dict[str, float] = {f"t_{name}_s": t["median_s"] for name, t in times.items()}
    for name in variants:
        if name != "bf16":
            out[f"ratio_{name}"] = out[f"t_{name}_s"] / out["t_bf16_s"]
    rb_bf16 = residual_bytes(recipes.bf16(), x, w)
    rb_ds = residual_bytes(ds, x, w)
    out.update(
        {
            "residual_bytes_bf16": rb_bf16,
            "residual_bytes_deepseek_v3": rb_ds,
            "residual_ratio": rb_ds / rb_bf16,
        }
    )
    return out
