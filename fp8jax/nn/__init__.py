"""Thin Flax NNX layers whose GEMMs run through fp8jax (dense, einsum) and their variables."""

from fp8jax.nn.dense import Dense
from fp8jax.nn.einsum import Einsum
from fp8jax.nn.variables import FP8State, RouterBias

__all__ = ["Dense", "Einsum", "FP8State", "RouterBias"]
