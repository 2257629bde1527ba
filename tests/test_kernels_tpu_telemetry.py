"""The Pallas TPU telemetry kernel in TPU interpret mode on CPU: the same max magnitude
bits, clipped and flushed counts as the XLA reduction of ``fp8jax.telemetry`` and as
numpy in float64, for tiles and blocks, both FP8 formats and both input widths; and,
where libtpu is installed, the kernel in a TPU program's telemetry.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8jax import quant, telemetry
from fp8jax.kernels import tpu_telemetry

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def _data(shape, dtype, seed=0):
    """Values over many binades with NaN, +-Inf, zeros and (float32) subnormals."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * np.exp2(rng.uniform(-30, 30, shape[:-1] + (1,)))
    flat = x.reshape(-1, shape[-1])
    flat[0, 1], flat[1, 0], flat[2, 2] = np.nan, np.inf, -np.inf
    flat[3, :] = 0.0
    if dtype == jnp.float32:
        flat[5, :] = rng.standard_normal(shape[-1]) * 1e-41
    return jnp.asarray(x.astype(np.float32)).astype(dtype)


def _operand(x, fmt, granularity, clip):
    """x quantized online, or (``clip``) with its online scales shrunk 16-fold (or to a
    float32 subnormal where tiny), so that the saturating cast clips."""
    axis = -1
    q = quant.quantize(x, fmt, granularity, axis=axis)
    if not clip:
        return q
    scale = jnp.maximum(q.scale / 16, jnp.float32(1e-42))
    return quant.quantize_with_scale(x, scale, fmt, granularity, axis=axis)


def _numpy_counts(x, q):
    """The three numbers in float64: max finite |x| bits (in x's width), |x| > (max +
    ulp(max) / 2) * scale with a positive scale, and finite non-zero x with a zero code."""
    xf = np.asarray(x.astype(jnp.float32)).astype(np.float64)
    s = np.asarray(q.layout.expand(quant.scale_values(q), x.shape)).astype(np.float64)
    finite = np.isfinite(xf)
    mag = np.where(finite, np.abs(xf), 0.0)
    width = {2: np.uint16, 4: np.uint32}[jnp.dtype(x.dtype).itemsize]
    bits = np.abs(np.asarray(x)).astype(x.dtype).view(width)
    top = int(bits[np.isfinite(np.asarray(x, np.float32))].max()) if finite.any() else 0
    clipped = finite & (s > 0) & (mag > telemetry.clip_threshold(q.data.dtype) * s)
    codes = np.asarray(q.data.astype(jnp.float32))
    flushed = finite & (mag > 0) & (codes == 0)
    return top, int(clipped.sum()), int(flushed.sum())


@pytest.mark.parametrize("granularity", ["tile", "block"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("fmt", [E4M3, E5M2])
@pytest.mark.parametrize("clip", [False, True])
def test_kernel_counts_are_the_xla_reductions(granularity, dtype, fmt, clip):
    # Not multiples of the blocks, a leading batch axis for the blocks.
    shape = (2, 300, 260) if granularity == "block" else (300, 260)
    x = _data(shape, dtype)
    q = _operand(x, fmt, granularity, clip)
    got = [int(v) for v in telemetry._kernel_counts(x, q, interpret=True)]
    want = [int(v) for v in telemetry._counts(x, q, "quotient")]
    assert want == [int(v) for v in telemetry._counts(x, q, "product")]
    assert got == want
    assert tuple(want) == _numpy_counts(x, q)
    if clip:
        assert want[1] > 0  # the case the clipped count is there for


@pytest.mark.parametrize("jit", [False, True])
def test_kernel_counts_under_jit_and_on_a_batch_of_tiles(jit):
    x = _data((3, 64, 384), jnp.bfloat16, seed=1)
    q = _operand(x, E4M3, "tile", clip=True)
    count = jax.jit(telemetry._kernel_counts, static_argnums=2) if jit else telemetry._kernel_counts
    got = [int(v) for v in count(x, q, True)]
    assert got == [int(v) for v in telemetry._counts(x, q, "quotient")]


def test_kernel_takes_fp8_tiles_along_the_last_axis_and_blocks_only():
    x = _data((256, 256), jnp.float32)
    assert not telemetry._kernel_fits(x, quant.quantize(x, E4M3, "tile", axis=0))
    assert not telemetry._kernel_fits(x, quant.quantize(x, E4M3, "tensor"))
    assert not telemetry._kernel_fits(x.astype(jnp.float16), quant.quantize(x, E4M3, "tile"))
    block = quant.quantize(x, E4M3, "block")
    assert telemetry._kernel_fits(x, block) and telemetry._kernel_fits(x, quant.quantize(x, E5M2))
    rows = telemetry._kernel_rows(x, block)
    assert [tuple(a.shape) for a in rows] == [(256, 256), (256, 256), (256, 2)]


def test_kernel_refuses_mismatched_operands():
    x = jnp.zeros((256, 256), jnp.float32)
    codes = jnp.zeros((256, 256), E4M3)
    with pytest.raises(ValueError, match="row_scales"):
        tpu_telemetry.operand_counts(x, codes, jnp.ones((256, 3)), threshold=464.0)
    with pytest.raises(ValueError, match="same 2-D shape"):
        tpu_telemetry.operand_counts(x, codes[:128], jnp.ones((256, 2)), threshold=464.0)


def _tpu_target():
    from fp8jax.bench import compilers

    t = compilers.target("tpu7x")
    why = compilers.unavailable(t)
    if why:
        pytest.skip(why)
    return compilers, t


def test_tpu_program_counts_with_the_kernel():
    compilers, t = _tpu_target()

    def stats(x):
        return telemetry.operand_stats(x, quant.quantize(x, E4M3, "tile"))

    x = jax.ShapeDtypeStruct((512, 1024), jnp.bfloat16)
    compiled = compilers.compile_for(stats, (x,), t)
    assert "fp8_operand_telemetry" in compiled.text
    # The compilers' census counts it with the quantizer, not as a GEMM.
    assert compilers.census(compiled).gemm_kernels == {}
