"""The Pallas TPU kernel of SwiGLU's cached backward in TPU interpret mode on CPU: the
same bits as the XLA gradient at the dequantized FP8 cache (``fp8jax.models.moe``), and
near numpy's float64 gradient at the same dequantized values; and, where libtpu is
installed, the kernel in a TPU program's backward pass.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8jax import quant
from fp8jax.kernels import tpu_swiglu
from fp8jax.models import moe

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def _cache(shape, dtype, fmt, seed=0, subnormal=False):
    """(h, its FP8 cache in 1x128 tiles along F, a cotangent of SwiGLU's output).

    ``subnormal``: one row of h so tiny that its tiles' scales are float32
    subnormals (the dequantization's bit-pattern product)."""
    rng = np.random.default_rng(seed)
    h = rng.standard_normal(shape) * np.exp2(rng.uniform(-6, 6, shape[:-1] + (1,)))
    if subnormal:
        h.reshape(-1, shape[-1])[1] *= 1e-40
    h = jnp.asarray(h.astype(np.float32)).astype(dtype)
    g = jnp.asarray(rng.standard_normal(shape[:-2] + shape[-1:]), jnp.float32).astype(dtype)
    return h, quant.quantize(h, fmt, "tile", axis=-1), g


def _bits(a):
    a = np.asarray(a)
    return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _numpy_grad(q, g):
    """SwiGLU's gradient in float64 at the dequantized cache (codes times scales)."""
    codes = np.asarray(q.data.astype(jnp.float32)).astype(np.float64)
    s = np.asarray(q.layout.expand(quant.scale_values(q), q.shape)).astype(np.float64)
    h = codes * s
    a, b = h[..., 0, :], h[..., 1, :]
    sig = 1 / (1 + np.exp(-a))
    gg = np.asarray(g.astype(jnp.float32)).astype(np.float64)
    return np.stack([gg * b * sig * (1 + a * (1 - sig)), gg * a * sig], axis=-2)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("fmt", [E4M3, E5M2])
@pytest.mark.parametrize("subnormal", [False, True])
def test_kernel_gradient_is_the_xla_gradient(dtype, fmt, subnormal):
    # F not a multiple of 128 (padded), rows not a multiple of the block, a batch axis.
    h, q, g = _cache((3, 37, 2, 200), dtype, fmt, subnormal=subnormal)
    got = moe._cached_grad_kernel(jnp.dtype(dtype), q, g, interpret=True)
    want = moe._cached_grad(jnp.dtype(dtype), q, g)
    assert got.shape == h.shape and got.dtype == jnp.dtype(dtype)
    np.testing.assert_array_equal(_bits(got), _bits(want))
    ref = _numpy_grad(q, g)
    # float32 arithmetic (a rounding in the dtype's width at the end).
    rtol = 1e-2 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(
        np.asarray(got, np.float64), ref, rtol=rtol, atol=rtol * np.abs(ref).max()
    )
    if subnormal:
        assert np.any(np.asarray(quant.scale_values(q)) < np.finfo(np.float32).tiny)
        # The tiny row's gradient is not flushed away.
        assert np.any(np.asarray(got, np.float32).reshape(-1, 2, 200)[1] != 0)


@pytest.mark.parametrize("jit", [False, True])
def test_kernel_gradient_under_jit(jit):
    _, q, g = _cache((256, 2, 256), jnp.bfloat16, E4M3, seed=1)
    grad = moe._cached_grad_kernel
    if jit:
        grad = jax.jit(grad, static_argnums=(0, 3))
    got = grad(jnp.dtype(jnp.bfloat16), q, g, True)
    np.testing.assert_array_equal(_bits(got), _bits(moe._cached_grad(jnp.bfloat16, q, g)))


def test_kernel_takes_fp8_tiles_along_f_only():
    h = jnp.ones((8, 2, 256), jnp.float32)
    assert moe._grad_kernel_fits(quant.quantize(h, E4M3, "tile", axis=-1))
    assert moe._grad_kernel_fits(quant.quantize(h, E5M2, "tile", axis=-1, pow2=True))
    assert not moe._grad_kernel_fits(quant.quantize(h, E4M3, "tile", axis=0))
    assert not moe._grad_kernel_fits(quant.quantize(h, E4M3, "tile", axis=-1, tile=64))
    assert not moe._grad_kernel_fits(quant.quantize(h, E4M3, "tensor"))
    # Not a (..., 2, F) gate / up pair.
    assert not moe._grad_kernel_fits(quant.quantize(h.reshape(8, 512), E4M3, "tile", axis=-1))


def test_kernel_refuses_mismatched_operands():
    codes = jnp.zeros((8, 2, 256), E4M3)
    flag = jnp.bool_(False)
    with pytest.raises(ValueError, match="multiple of 128"):
        tpu_swiglu.swiglu_grad(
            codes[..., :200], jnp.ones((8, 2, 2)), jnp.ones((8, 200)), flag, dtype="float32"
        )
    with pytest.raises(ValueError, match="scales must be"):
        tpu_swiglu.swiglu_grad(
            codes, jnp.ones((8, 2, 3)), jnp.ones((8, 256)), flag, dtype="float32"
        )
    with pytest.raises(ValueError, match="g"):
        tpu_swiglu.swiglu_grad(
            codes, jnp.ones((8, 2, 2)), jnp.ones((8, 128)), flag, dtype="float32"
        )


def test_tpu_program_takes_the_kernel():
    from fp8jax.bench import compilers
    from fp8jax.registry import get

    t = compilers.target("tpu7x")
    why = compilers.unavailable(t)
    if why:
        pytest.skip(why)
    recipe = get("deepseek_v3")

    def grad(h, g):
        return jax.vjp(lambda h: moe.swiglu(h, jnp.bfloat16, recipe), h)[1](g)[0]

    args = (
        jax.ShapeDtypeStruct((512, 2, 256), jnp.bfloat16),
        jax.ShapeDtypeStruct((512, 256), jnp.bfloat16),
    )
    compiled = compilers.compile_for(grad, args, t)
    assert "fp8_swiglu_grad" in compiled.text
    # The compilers' census counts it as no GEMM.
    assert compilers.census(compiled).gemm_kernels == {}
