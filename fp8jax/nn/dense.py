"""Dense (DenseGeneral) layer whose GEMM runs through :func:`fp8jax.dot_general`.

y = x W (+ b): the recipe decides the precision of the Fprop, Dgrad and Wgrad
GEMMs (DeepSeek-V3: E4M3 with 1x128 activation tiles and 128x128 weight
blocks, float32 accumulation).  The kernel is stored in ``param_dtype``
(float32 master weights); the output is returned in ``dtype``.

With a delayed-scaling recipe (``fp8jax.needs_state(recipe)``) the layer owns
an :class:`~fp8jax.nn.FP8State` variable holding the amax histories of its
GEMM; otherwise it holds only its parameters.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from fp8jax.dot_general import dot_general_with_stats
from fp8jax.nn.grad_noise import init_grad_noise
from fp8jax.nn.observed import observed_gemm
from fp8jax.nn.variables import FP8State
from fp8jax.operands import source_values
from fp8jax.quant import is_quantized
from fp8jax.recipes import Recipe, needs_state
from fp8jax.scaling import init_delayed_gemm_state


def _as_tuple(v: int | Sequence[int]) -> tuple[int, ...]:
    return (int(v),) if isinstance(v, int) else tuple(int(a) for a in v)


def fan_in_init(fan_in: int) -> nnx.Initializer:
    """Truncated normal with std 1/sqrt(fan_in) (LeCun), for any kernel layout."""
    std = 1.0 / math.sqrt(max(fan_in, 1))

    def init(key: jax.Array, shape, dtype=jnp.float32) -> jax.Array:
        # 0.8796... makes the truncated (at +-2 sigma) normal have unit variance.
        z = jax.random.truncated_normal(key, -2.0, 2.0, shape, jnp.float32) / 0.87962566
        return (z * std).astype(dtype)

    return init


class Dense(nnx.Module):
    """DenseGeneral through fp8jax: contracts ``axis`` of x with the kernel's leading axes.

    Args:
      in_features: size(s) of the contracted input axes.
      out_features: size(s) of the output feature axes.
      recipe: precision of the layer's three GEMMs.
      axis: input axes to contract (default the last ``len(in_features)``).
      use_bias: add a float32 bias after the GEMM.
      dtype: output (activation) dtype.
      param_dtype: storage dtype of the kernel (float32 master weights).
      name: telemetry name of this GEMM.
      rngs: nnx.Rngs for the initializer.
    """

    def __init__(
        self,
        in_features: int | Sequence[int],
        out_features: int | Sequence[int],
        *,
        recipe: Recipe,
        axis: int | Sequence[int] | None = None,
        use_bias: bool = False,
        dtype=jnp.bfloat16,
        param_dtype=jnp.float32,
        kernel_init: nnx.Initializer | None = None,
        name: str = "dense",
        rngs: nnx.Rngs,
    ):
        self.in_features = _as_tuple(in_features)
        self.out_features = _as_tuple(out_features)
        n_in = len(self.in_features)
        if axis is None:
            axis = tuple(range(-n_in, 0))
        self.axis = _as_tuple(axis)
        if len(self.axis) != n_in:
            raise ValueError(f"axis {self.axis} does not match in_features {self.in_features}")
        self.recipe = recipe
        self.dtype = jnp.dtype(dtype)
        self.param_dtype = jnp.dtype(param_dtype)
        self.name = name
        init = kernel_init or fan_in_init(math.prod(self.in_features))
        self.kernel = nnx.Param(
            init(rngs.params(), self.in_features + self.out_features, jnp.dtype(param_dtype))
        )
        self.bias = (
            nnx.Param(jnp.zeros(self.out_features, jnp.dtype(param_dtype))) if use_bias else None
        )
        self.fp8_state = FP8State(init_delayed_gemm_state(recipe)) if needs_state(recipe) else None
        # Block-format gradients: their noise ratio (fp8jax.nn.grad_noise).
        self.grad_noise = init_grad_noise(recipe)

    def kernel_values(self) -> jax.Array:
        """The kernel's values in its DenseGeneral shape (in_features + out_features).

        A kernel gathered in FP8 (fp8jax.parallel.fsdp: a QTensor in its
        GEMM's (K, N) layout) is dequantized to its storage dtype; one
        quantized once per step (fp8jax.train.weight_codes) gives the values
        it was made from.
        """
        kernel = self.kernel.get_value()
        if not is_quantized(kernel):
            return kernel
        values = source_values(kernel, self.param_dtype)
        return values.reshape(self.in_features + self.out_features)

    def __call__(self, x: jax.Array, kernel_scale: jax.Array | None = None) -> jax.Array:
        """y = x W (+ b); ``kernel_scale`` (shaped like ``in_features``) multiplies W's
        rows first (W's contracted axes), e.g. to fold a per-channel scale of x
        back into W."""
        axes = tuple(a % x.ndim for a in self.axis)
        for a, n in zip(axes, self.in_features):
            if x.shape[a] != n:
                raise ValueError(
                    f"{self.name}: input axis {a} has size {x.shape[a]}, expected {n} "
                    f"(input shape {x.shape})"
                )
        dn = ((axes, tuple(range(len(axes)))), ((), ()))
        kernel = self.kernel.get_value()
        if kernel_scale is not None:
            if kernel_scale.shape != self.in_features:
                raise ValueError(
                    f"{self.name}: kernel_scale shape {kernel_scale.shape} is not in_features "
                    f"{self.in_features}"
                )
            # In the kernel's dtype: exact when the scales are powers of two.
            # (Scaled values are new values: a gathered FP8 kernel is
            # dequantized first and the GEMM quantizes the product.)
            pad = (1,) * len(self.out_features)
            kernel = self.kernel_values()
            kernel = kernel * kernel_scale.reshape(kernel_scale.shape + pad).astype(kernel.dtype)
        free = None
        if is_quantized(kernel):
            # An FP8-gathered kernel is in its GEMM's (K, N) layout: x's
            # contracted axes go last and merge into K, in the order
            # dot_general flattens them (transposes and reshapes are exact).
            n = len(axes)
            x = jnp.moveaxis(x, axes, tuple(range(x.ndim - n, x.ndim)))
            free = x.shape[: x.ndim - n]
            x = x.reshape(free + (-1,))
            dn = (((x.ndim - 1,), (0,)), ((), ()))
        out = observed_gemm(
            self,
            self.name,
            "dense",
            dot_general_with_stats,
            x,
            kernel,
            dn,
            recipe=self.recipe,
            state_var=self.fp8_state,
            noise_var=self.grad_noise,
            # GEMM output straight in the activation dtype (accumulation is float32).
            preferred_element_type=self.dtype,
        )
        if free is not None:
            out = out.reshape(free + self.out_features)
        # dot_general puts x's free axes first (in order), then the kernel's output
        # axes: the DenseGeneral layout.
        if self.bias is not None:
            # Bias added in float32, then one rounding to the activation dtype.
            out = (out.astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(self.dtype)
        return out
