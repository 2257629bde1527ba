"""Which implementation runs a quantized GEMM: a Pallas kernel or XLA.

The recipe decides (``Recipe.impl``): "xla" never uses a kernel, "pallas"
insists on one (an error when none applies), "auto" uses the Pallas
block-scaled FP8 kernel on Hopper-class GPUs for GEMMs whose operands are
E4M3 1x128 tiles x 128x128 blocks, and XLA everywhere else.
"""

from __future__ import annotations

import jax

from fp8jax.recipes import Recipe


def maybe_block_gemm(a, b, recipe: Recipe, canon: str) -> jax.Array | None:
    """The GEMM through a kernel, or None to let the XLA path run it."""
    if recipe.impl == "xla":
        return None
    try:
        from fp8jax.kernels import integration
    except ImportError:
        integration = None
    if integration is not None:
        out = integration.block_gemm_or_none(a, b, recipe, canon)
        if out is not None:
            return out
    if recipe.impl == "pallas":
        raise ValueError(
            f"recipe {recipe.name!r} asks for impl='pallas' but no Pallas FP8 kernel applies to "
            f"this {canon} GEMM on {jax.default_backend()} (needs a Hopper GPU, E4M3 1x128 tiles "
            "x 128x128 blocks)"
        )
    return None
