"""Flax NNX layers whose GEMMs run through fp8jax (dense, einsum, grouped expert GEMM)."""

from fp8jax.nn.dense import Dense
from fp8jax.nn.einsum import Einsum
from fp8jax.nn.grouped import grouped_dot, grouped_gemm
from fp8jax.nn.variables import FP8State, RouterBias

__all__ = ["Dense", "Einsum", "FP8State", "RouterBias", "grouped_dot", "grouped_gemm"]
