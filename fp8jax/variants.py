"""Named variants of the presets: what the studies change, one property at a time.

``fp8jax.registry.get(name)`` resolves a preset of :mod:`fp8jax.recipes` or one
of these.  Each is built with ``dataclasses.replace`` on a preset's QuantSpecs
so that exactly one property changes:

  ``fine_hybrid``     deepseek_v3's 1x128 / 128x128 online scaling, E5M2 for the
                      gradient dy (dgrad lhs, wgrad rhs)
  ``tensor_delayed``  per-tensor delayed scaling (amax history 16, max), E4M3
                      everywhere (only the scaling differs from current_tensor)
  ``acc_no_promote``  current_tensor (one scale per tensor) with emulated 14-bit
                      tensor-core accumulation over all of K (slow)
  ``acc_promote128``  the same, promoted to FP32 every 128 elements
  ``acc_tiles``       deepseek_v3 with the emulator: its 1x128 / 128x128 scales
                      change every 128 elements, so its chains are promoted there
  ``tile_everywhere`` deepseek_v3 with 1x128 tiles for the weights too
  ``dgrad_blocks``    deepseek_v3 with 128x128 blocks for the Dgrad activation
                      gradient dy (DeepSeek-V3 appendix B.2)
  ``attn_out_e5m6_unscaled``  deepseek_v3 with the input of the linear after
                      attention cached in E5M6 without scales (values beyond
                      +-65,024 clip) instead of the paper's 1x128 tiles with
                      power-of-two scales
  ``nvfp4_no_rht`` / ``nvfp4_no_sr``  the ``nvfp4`` preset without the Wgrad
                      Hadamard transform / the gradient's stochastic rounding
  ``nvfp4_rtn``       both off (round-to-nearest; 16x16 weight blocks kept)

With per-tile scales a chain can only run until the scale changes (the scales
are applied outside the tensor core), so "no promotion" is only meaningful
with one scale along K: the accumulation arms use per-tensor scaling.

A name that only relabels a preset is not a recipe: comparison configs give a
run its own label (``compare.runs.<label>.recipe``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from fp8jax import recipes
from fp8jax.recipes import Accumulation, GemmSpec, QuantSpec, Recipe


def _with_dy(r: Recipe, spec_dy: QuantSpec, name: str) -> Recipe:
    """Replace the gradient operand's spec in dgrad (lhs) and wgrad (rhs)."""
    return dataclasses.replace(
        r,
        name=name,
        dgrad=dataclasses.replace(r.dgrad, lhs=spec_dy),
        wgrad=dataclasses.replace(r.wgrad, rhs=spec_dy),
    )


def fine_hybrid() -> Recipe:
    """deepseek_v3 granularity and online scaling, but E5M2 for the gradient dy."""
    r = recipes.deepseek_v3()
    return _with_dy(r, dataclasses.replace(r.dgrad.lhs, fmt="e5m2"), "fine_hybrid")


def tensor_delayed() -> Recipe:
    """Per-tensor delayed scaling, unified E4M3 (isolates scaling from format)."""
    spec = QuantSpec("e4m3", "tensor", scaling="delayed")
    return Recipe(
        "tensor_delayed", GemmSpec(spec, spec), GemmSpec(spec, spec), GemmSpec(spec, spec)
    )


def tile_everywhere() -> Recipe:
    """deepseek_v3 with 1x128 tiles (along each GEMM's contraction axis) for the weights too."""
    r = recipes.deepseek_v3()
    tile_w = dataclasses.replace(r.fprop.rhs, granularity="tile")
    return dataclasses.replace(
        r,
        name="tile_everywhere",
        fprop=dataclasses.replace(r.fprop, rhs=tile_w),
        dgrad=dataclasses.replace(r.dgrad, rhs=tile_w),
    )


def dgrad_blocks() -> Recipe:
    """deepseek_v3 with 128x128 blocks for dy in Dgrad (the setting of DeepSeek-V3 B.2)."""
    r = recipes.deepseek_v3()
    block_dy = dataclasses.replace(r.dgrad.lhs, granularity="block")
    return dataclasses.replace(
        r, name="dgrad_blocks", dgrad=dataclasses.replace(r.dgrad, lhs=block_dy)
    )


def attn_out_e5m6_unscaled() -> Recipe:
    """deepseek_v3 with attn_out's Wgrad cache in E5M6 unscaled (clipped at +-65,024)."""
    return dataclasses.replace(
        recipes.deepseek_v3(), name="attn_out_e5m6_unscaled", attn_out_cache="e5m6_unscaled"
    )


VARIANTS: dict[str, Callable[[], Recipe]] = {
    "fine_hybrid": fine_hybrid,
    "tensor_delayed": tensor_delayed,
    "acc_no_promote": lambda: dataclasses.replace(
        recipes.current_tensor(),
        accumulation=Accumulation(promote_every=None),
        name="acc_no_promote",
    ),
    "acc_promote128": lambda: dataclasses.replace(
        recipes.current_tensor(),
        accumulation=Accumulation(promote_every=128),
        name="acc_promote128",
    ),
    "acc_tiles": lambda: dataclasses.replace(
        recipes.deepseek_v3(accumulation=Accumulation(promote_every=128)), name="acc_tiles"
    ),
    "tile_everywhere": tile_everywhere,
    "dgrad_blocks": dgrad_blocks,
    "attn_out_e5m6_unscaled": attn_out_e5m6_unscaled,
    "nvfp4_no_rht": lambda: dataclasses.replace(recipes.nvfp4(hadamard=False), name="nvfp4_no_rht"),
    "nvfp4_no_sr": lambda: dataclasses.replace(recipes.nvfp4(stochastic=False), name="nvfp4_no_sr"),
    "nvfp4_rtn": lambda: dataclasses.replace(
        recipes.nvfp4(hadamard=False, stochastic=False), name="nvfp4_rtn"
    ),
}
