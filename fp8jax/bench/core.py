"""The numerics core's cost on this backend, as ratios measured in one run.

* quantize ratio: 1x128 tile quantization of a float32 tensor / a plain
  ``astype(bfloat16)`` of the same tensor (quantizing writes 1 byte + 1/32
  per element, the cast 2 bytes);
* GEMM ratio: deepseek_v3 ``dot_general`` forward + backward / the bf16
  recipe's forward + backward, at M = K = N, on each XLA path of the GEMM
  core ("xla": dequantize then dot; "chunked": dots of the FP8 codes per
  128-long chunk), with the dot algorithms the compiled modules run;
* residual ratio: bytes saved for the backward pass by deepseek_v3 / by bf16.

The functions compared in one ratio are timed round-robin in one run
(:func:`fp8jax.bench.timing.time_calls`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax import recipes
from fp8jax.bench.hlo import hlo_report
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


#: The fwd+bwd variants of gemm_ratio: the bf16 baseline and deepseek_v3 on each XLA path.
GEMM_VARIANTS = {
    "bf16": recipes.bf16(),
    "deepseek_v3/xla": dataclasses.replace(recipes.deepseek_v3(), impl="xla"),
    "deepseek_v3/xla-deqbf16": dataclasses.replace(
        recipes.deepseek_v3(), impl="xla", dequant_dtype="bfloat16"
    ),
    "deepseek_v3/chunked": dataclasses.replace(recipes.deepseek_v3(), impl="chunked"),
}


def gemm_ratio(size: int = 2048, iters: int = 5) -> dict[str, Any]:
    """fwd+bwd of ``dot_general`` at M = K = N = ``size`` for each of GEMM_VARIANTS.

    deepseek_v3 runs on the XLA paths of ``fp8jax.gemm``: "xla" (dequantize to
    float32 or bfloat16, then one dot) and "chunked" (128-long dots of the FP8
    codes in bfloat16, scales applied per chunk in float32).  Returns, per
    variant, the median time ``t_<name>_s``, its ratio to bf16
    ``ratio_<name>`` and the dot algorithms of the compiled module
    ``dot_algorithms_<name>``; and the residual bytes of deepseek_v3 and bf16.
    """
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((size, size)).astype(np.float32))
    w = jnp.asarray((rng.standard_normal((size, size)) / np.sqrt(size)).astype(np.float32))
    dy = jnp.asarray(rng.standard_normal((size, size)).astype(np.float32))
    backend = jax.default_backend()
    out: dict[str, Any] = {"backend": backend, "size": size}
    cases = {}
    for name, r in GEMM_VARIANTS.items():
        compiled = _fwd_bwd(r).lower(x, w, dy).compile()
        out[f"dot_algorithms_{name}"] = hlo_report(compiled.as_text(), backend)["dot_algorithms"]
        cases[name] = (compiled, (x, w, dy))
    times = time_calls(cases, iters=iters)
    for name, t in times.items():
        out[f"t_{name}_s"] = t["median_s"]
        out[f"ratio_{name}"] = t["median_s"] / times["bf16"]["median_s"]
    rb_bf16 = residual_bytes(recipes.bf16(), x, w)
    rb_ds = residual_bytes(recipes.deepseek_v3(), x, w)
    out.update(
        {
            "residual_bytes_bf16": rb_bf16,
            "residual_bytes_deepseek_v3": rb_ds,
            "residual_ratio": rb_ds / rb_bf16,
        }
    )
    return out
