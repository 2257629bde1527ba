"""Whether the compiled Pallas block-scaled GEMM can run here.

``kernel_available()`` is True only on an NVIDIA GPU of compute capability >= 9.0
(Hopper and later) whose Pallas Triton lowering compiles and runs a small
block-scaled GEMM correctly (checked once per process against the jnp
reference).  Which implementation a GEMM uses is decided by the GEMM core,
``fp8jax.gemm.select_impl``; off a Hopper GPU an explicit ``impl="pallas"``
runs the kernel in Pallas interpret mode (slow, the same math; for tests).
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax.kernels.block_gemm import block_scaled_matmul, block_scaled_matmul_reference


def _hopper_gpu() -> bool:
    """An NVIDIA (CUDA) device with compute capability >= 9.0 is the default backend."""
    try:
        if jax.default_backend() != "gpu":
            return False
        dev = jax.devices()[0]
    except RuntimeError:
        return False
    vendor = f"{getattr(dev, 'device_kind', '')} {getattr(dev.client, 'platform_version', '')}"
    if "nvidia" not in vendor.lower() and "cuda" not in vendor.lower():
        # ROCm reports platform "gpu" too; its Triton FP8 path is not this kernel's target.
        return False
    # CUDA devices report "9.0"; ROCm ones "gfx942", which fails the parse below.
    cc = str(getattr(dev, "compute_capability", ""))
    try:
        major = int(cc.split(".")[0])
    except ValueError:
        return False
    return major >= 9


@functools.cache
def kernel_available() -> bool:
    """True on a Hopper+ NVIDIA GPU where the compiled kernel runs and matches the reference."""
    if not _hopper_gpu():
        return False
    try:
        # Evaluate eagerly even when first asked from inside a jit trace.
        with jax.ensure_compile_time_eval():
            return _self_check()
    except Exception as e:  # any lowering/compile failure means "not available"
        logging.warning("fp8jax: Pallas block GEMM unavailable: %s", e)
        return False


def _self_check() -> bool:
    """Compile and run a 128x256x128 GEMM; compare with the jnp reference."""
    rng = np.random.default_rng(0)
    m, k, n = 128, 256, 128
    a = jnp.asarray(rng.uniform(-4, 4, (m, k)), jnp.float8_e4m3fn)
    b = jnp.asarray(rng.uniform(-4, 4, (k, n)), jnp.float8_e4m3fn)
    sa = jnp.asarray(rng.uniform(0.5, 2.0, (m, 2)), jnp.float32)
    sb = jnp.asarray(rng.uniform(0.5, 2.0, (2, 1)), jnp.float32)
    got = block_scaled_matmul(a, sa, b, sb, out_dtype=jnp.float32, interpret=False)
    want = block_scaled_matmul_reference(a, sa, b, sb, out_dtype=jnp.float32)
    # FP32 vs tensor-core accumulation over 128-element chunks: far below 1e-2.
    err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
    ok = err < 1e-2
    if not ok:
        logging.warning("fp8jax: Pallas block GEMM self-check failed (rel err %.3g)", err)
    return ok
