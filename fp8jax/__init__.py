"""fp8jax: DeepSeek-V3-style fine-grained FP8 training in JAX.

Public contract (see README.md): formats, quantize/dequantize, Recipe and its
presets, a differentiable FP8 ``dot_general`` and the expert GEMM
``ragged_dot`` (``lax.ragged_dot``'s signature).
"""

from fp8jax import accumulate, formats, platforms, recipes, registry, scaling, schemes
from fp8jax.dot_general import dot_general, dot_general_with_stats
from fp8jax.formats import E4M3, E4M3FNUZ, E5M2, E5M2FNUZ, E8M0, saturating_cast
from fp8jax.grouped import grouped_dot, grouped_dot_with_stats
from fp8jax.layout import Layout
from fp8jax.quant import QTensor, quantize
from fp8jax.ragged_dot import ragged_dot, ragged_dot_with_stats
from fp8jax.recipes import Accumulation, DelayedConfig, GemmSpec, QuantSpec, Recipe, needs_state
from fp8jax.schemes import dequantize

# Recipe names used to resolve in fp8jax.recipes; they resolve in fp8jax.registry
# now, which sits above recipes (it lists the variants built from the presets).
# The old name stays an alias, set here above both so that recipes imports neither.
recipes.get = registry.get

__all__ = [
    "E4M3",
    "E5M2",
    "E4M3FNUZ",
    "E5M2FNUZ",
    "E8M0",
    "saturating_cast",
    "dot_general",
    "dot_general_with_stats",
    "grouped_dot",
    "grouped_dot_with_stats",
    "ragged_dot",
    "ragged_dot_with_stats",
    "needs_state",
    "Layout",
    "QTensor",
    "quantize",
    "dequantize",
    "Recipe",
    "QuantSpec",
    "GemmSpec",
    "Accumulation",
    "DelayedConfig",
    "accumulate",
    "formats",
    "platforms",
    "recipes",
    "registry",
    "scaling",
    "schemes",
]


def __getattr__(name: str):
    # The door for other models (Flax layers, optional Qwix) loads on first use.
    if name == "interop":
        import importlib

        return importlib.import_module("fp8jax.interop")
    raise AttributeError(f"module 'fp8jax' has no attribute {name!r}")
