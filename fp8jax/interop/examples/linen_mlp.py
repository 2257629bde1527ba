"""A small Linen model: Dense, DenseGeneral and Einsum layers (standard Flax Linen only).

Module paths: ``embed``, ``proj`` (DenseGeneral to heads), ``mix`` (Einsum
over heads), ``up`` / ``down`` (Dense), ``head``.  ``dot_general`` is the
Flax hook of the Dense / DenseGeneral layers.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax import lax


class LinenMLP(nn.Module):
    vocab: int = 64
    d_model: int = 128
    n_heads: int = 2
    d_ff: int = 256
    dot_general: Callable = lax.dot_general

    @nn.compact
    def __call__(self, tokens_BxT: jax.Array) -> jax.Array:
        d, h = self.d_model, self.n_heads
        x = nn.Embed(self.vocab, d, name="embed")(tokens_BxT)
        heads = nn.DenseGeneral(
            (h, d // h), use_bias=False, dot_general=self.dot_general, name="proj"
        )(x)
        x = x + nn.Einsum((h, d // h, d), "bthk,hkd->btd", use_bias=False, name="mix")(heads)
        up = nn.Dense(self.d_ff, use_bias=False, dot_general=self.dot_general, name="up")(x)
        x = x + nn.Dense(d, use_bias=False, dot_general=self.dot_general, name="down")(
            jax.nn.gelu(up)
        )
        return nn.Dense(self.vocab, use_bias=False, name="head")(x).astype(jnp.float32)
