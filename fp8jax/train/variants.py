"""Named recipes for training configs and comparisons.

Configs name a recipe by string; this registry maps the name to a
:class:`fp8jax.Recipe`.  Besides the presets of :mod:`fp8jax.recipes`, it
holds the variants the comparisons need, each built with
``dataclasses.replace`` on the preset's QuantSpecs so that exactly one
property changes:

formats (both fine-grained 1x128 / 128x128, online):
  ``fine_e4m3``    unified E4M3 (= deepseek_v3)
  ``fine_hybrid``  E4M3 forward, E5M2 for the gradient dy (dgrad lhs, wgrad rhs)
scaling (E4M3 everywhere, so only the scaling differs):
  ``tensor_current``   per-tensor online (= current_tensor)
  ``tensor_delayed``   per-tensor delayed (amax history 16, max)
  ``fine_online``      1x128 / 128x128 online (= deepseek_v3); delayed scaling
                       is per-tensor only in the core, so there is no
                       fine-grained delayed variant
granularity (E4M3, online): ``tensor`` / ``row`` / ``tile_block``
accumulation (emulated Hopper tensor core, slow): ``acc_no_promote`` (14-bit
  accumulation over all of K) and ``acc_promote128`` (promoted to FP32 every 128)
below 8 bits (``mxfp8``, ``nvfp4`` are presets): ``nvfp4_no_rht`` / ``nvfp4_no_sr``
  switch off the Wgrad Hadamard transform / the gradient's stochastic
  rounding, ``nvfp4_rtn`` both (16x16 weight blocks in all three)
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


def _renamed(fn: Callable[[], Recipe], name: str) -> Callable[[], Recipe]:
    return lambda: dataclasses.replace(fn(), name=name)


VARIANTS: dict[str, Callable[[], Recipe]] = {
    **recipes.PRESETS,
    "fine_e4m3": _renamed(recipes.deepseek_v3, "fine_e4m3"),
    "fine_hybrid": fine_hybrid,
    "tensor_current": _renamed(recipes.current_tensor, "tensor_current"),
    "tensor_delayed": tensor_delayed,
    "fine_online": _renamed(recipes.deepseek_v3, "fine_online"),
    "tensor": _renamed(recipes.current_tensor, "tensor"),
    "row": _renamed(recipes.rowwise, "row"),
    "tile_block": _renamed(recipes.deepseek_v3, "tile_block"),
    "acc_no_promote": lambda: dataclasses.replace(
        recipes.deepseek_v3(accumulation=Accumulation(promote_every=None)),
        name="acc_no_promote",
    ),
    "acc_promote128": lambda: dataclasses.replace(
        recipes.deepseek_v3(accumulation=Accumulation(promote_every=128)),
        name="acc_promote128",
    ),
    "nvfp4_no_rht": lambda: dataclasses.replace(recipes.nvfp4(hadamard=False), name="nvfp4_no_rht"),
    "nvfp4_no_sr": lambda: dataclasses.replace(recipes.nvfp4(stochastic=False), name="nvfp4_no_sr"),
    "nvfp4_rtn": lambda: dataclasses.replace(
        recipes.nvfp4(hadamard=False, stochastic=False), name="nvfp4_rtn"
    ),
}


def get_recipe(name: str) -> Recipe:
    """A recipe by name: a preset of fp8jax.recipes or a variant above."""
    try:
        return VARIANTS[name]()
    except KeyError:
        raise ValueError(f"unknown recipe {name!r}; known: {sorted(VARIANTS)}") from None
