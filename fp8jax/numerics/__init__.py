"""Numerics lab: compensated and pairwise summation in JAX, error metrics, and
demonstrations of the classic floating-point losses with their remedies.

>>> from fp8jax import numerics
>>> print(numerics.format_demos())
"""

from fp8jax.numerics.demos import (
    Demo,
    SpeedDemo,
    absorption,
    all_demos,
    float64_to_float32,
    float_to_int,
    format_demos,
    format_speed,
    fp8_overflow,
    ill_conditioned,
    large_integers,
    nan_propagation,
    point_one,
    subnormal_operands,
    subnormal_speed,
    subnormals,
    summation_order,
)
from fp8jax.numerics.metrics import (
    max_relative_error,
    relative_error,
    saturated_fraction,
    sqnr_db,
    ulp_distance,
)
from fp8jax.numerics.summation import kahan_sum, naive_sum, neumaier_sum, pairwise_sum
from fp8jax.telemetry import flushed_fraction

__all__ = [
    "Demo",
    "SpeedDemo",
    "absorption",
    "all_demos",
    "float64_to_float32",
    "float_to_int",
    "flushed_fraction",
    "format_demos",
    "format_speed",
    "fp8_overflow",
    "ill_conditioned",
    "kahan_sum",
    "large_integers",
    "max_relative_error",
    "naive_sum",
    "nan_propagation",
    "neumaier_sum",
    "pairwise_sum",
    "point_one",
    "relative_error",
    "saturated_fraction",
    "sqnr_db",
    "subnormal_operands",
    "subnormal_speed",
    "subnormals",
    "summation_order",
    "ulp_distance",
]
