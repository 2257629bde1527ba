"""The door for other people's models: fp8jax's recipes in any Flax (NNX or Linen) model.

* :class:`Rule` and :class:`QwixProvider`: rules by module path, applied by
  ``qwix.quantize_model(model, QwixProvider(rules), *example_inputs)``
  (needs ``pip install fp8jax[qwix]``; imported on first use, so
  ``import fp8jax`` never needs Qwix).
* :func:`make_dot_general`, :func:`make_einsum`, :func:`make_ragged_dot`
  (also named :func:`dot_general`, :func:`einsum`, :func:`ragged_dot`, the
  hooks they fill): factories of drop-in replacements with the signatures of
  ``lax.dot_general``, ``jnp.einsum`` and ``lax.ragged_dot``, for
  ``nnx.Linear(dot_general=...)``, ``nnx.Einsum(einsum_op=...)``, Linen
  ``Dense`` / ``DenseGeneral``.

docs/interop.md walks through both.
"""

from __future__ import annotations

from typing import Any

from fp8jax.interop.dropin import (
    dot_general,
    einsum,
    make_dot_general,
    make_einsum,
    make_ragged_dot,
    ragged_dot,
)
from fp8jax.interop.rules import OPS, Rule

__all__ = [
    "OPS",
    "QwixProvider",
    "Rule",
    "dot_general",
    "einsum",
    "make_dot_general",
    "make_einsum",
    "make_ragged_dot",
    "ragged_dot",
]


def __getattr__(name: str) -> Any:
    if name == "QwixProvider":
        try:
            from fp8jax.interop.qwix_provider import QwixProvider
        except ModuleNotFoundError as e:
            if e.name != "qwix":
                raise
            raise ImportError(
                "fp8jax.interop.QwixProvider needs Qwix: pip install 'fp8jax[qwix]'"
            ) from None
        return QwixProvider
    raise AttributeError(f"module 'fp8jax.interop' has no attribute {name!r}")
