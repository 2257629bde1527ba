"""Thin Flax NNX layers whose GEMMs run through fp8jax (dense, einsum), the one observed
GEMM call they share, and their variables."""

from fp8jax.nn.dense import Dense
from fp8jax.nn.einsum import Einsum
from fp8jax.nn.observed import observed_gemm
from fp8jax.nn.variables import FP8State, RouterBias

__all__ = ["Dense", "Einsum", "FP8State", "RouterBias", "observed_gemm"]
