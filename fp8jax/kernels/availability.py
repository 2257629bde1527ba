"""Whether the compiled block-scaled GEMM (Mosaic GPU) runs here: two separate questions.

* :func:`hopper_gpu`: is an NVIDIA GPU of compute capability >= 9.0 (Hopper
  and later) attached?  Where none is, the GPU tests skip.
* :func:`self_check_error`: on such a GPU, does the compiled kernel run a
  small block-scaled GEMM and match the jnp reference?  None when it does,
  else what went wrong.  A Hopper GPU that fails it is a broken kernel, not
  a missing GPU: the tests fail on it, and "auto" falls back (logged once).

``kernel_available()`` is True where both hold.  Which implementation a
GEMM uses is decided per lowering platform by the GEMM core
(``fp8jax.gemm.select_impl``): a program lowered for CUDA from a machine
without a GPU takes the compiled kernel on the assumption that its target
runs it; only an attached GPU is asked.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax import platforms
from fp8jax.kernels.block_gemm import block_scaled_matmul, block_scaled_matmul_reference


def hopper_gpu() -> bool:
    """An NVIDIA GPU with compute capability >= 9.0 is the default device."""
    cc = platforms.local_cuda_capability()
    if cc is None:
        return False
    try:
        major = int(cc.split(".")[0])
    except ValueError:
        return False
    return major >= 9


@functools.cache
def self_check_error() -> str | None:
    """Compile and run a 128x256x128 GEMM on the attached GPU; None if it matches.

    Returns what failed (a compile error, or the relative error) otherwise.
    Asked only where :func:`hopper_gpu` holds.
    """
    try:
        # Evaluate eagerly even when first asked from inside a jit trace.
        with jax.ensure_compile_time_eval():
            err = _self_check()
    except Exception as e:  # a lowering / compile / run failure is the answer
        return f"{type(e).__name__}: {e}"
    # FP32 vs tensor-core accumulation over 128-element chunks: far below 1e-2.
    if not err < 1e-2:
        return f"relative error {err:.3g} against the jnp reference (limit 1e-2)"
    return None


@functools.cache
def kernel_available() -> bool:
    """True on a Hopper+ NVIDIA GPU where the compiled kernel passes its self-check."""
    if not hopper_gpu():
        return False
    error = self_check_error()
    if error is not None:
        logging.warning(
            "fp8jax: the compiled Mosaic GPU block GEMM fails its self-check: %s", error
        )
        return False
    return True


def _self_check() -> float:
    """Relative max error of the compiled kernel against the jnp reference."""
    rng = np.random.default_rng(0)
    m, k, n = 128, 256, 128
    a = jnp.asarray(rng.uniform(-4, 4, (m, k)), jnp.float8_e4m3fn)
    b = jnp.asarray(rng.uniform(-4, 4, (k, n)), jnp.float8_e4m3fn)
    sa = jnp.asarray(rng.uniform(0.5, 2.0, (m, 2)), jnp.float32)
    sb = jnp.asarray(rng.uniform(0.5, 2.0, (2, 1)), jnp.float32)
    got = block_scaled_matmul(a, sa, b, sb, out_dtype=jnp.float32, interpret=False)
    want = block_scaled_matmul_reference(a, sa, b, sb, out_dtype=jnp.float32)
    return float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
