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

import concurrent.futures
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
    """Compile and run two GEMMs on the attached GPU, 128 x 256 x 128 (whole tiles,
    float32 out) and 160 x 288 x 160 (edge tiles read and written in place, a
    last K run of 32, bfloat16 out); None if both match.

    Returns what failed (a compile error, or the relative error) otherwise.
    Asked only where :func:`hopper_gpu` holds.
    """
    return check_error(interpret=False)


def check_error(interpret: bool) -> str | None:
    """What :func:`self_check_error` answers, uncached; ``interpret``: Mosaic GPU interpret mode."""
    try:
        # JAX's trace state is per thread: in a fresh thread the check runs at
        # once even when first asked from inside a jit trace.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            err = pool.submit(_self_check, interpret).result()
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


def _self_check(interpret: bool = False) -> float:
    """Relative max error of the kernel against the jnp reference, run outside any trace.

    Both are compiled ahead of time from shapes and called on numpy arrays:
    the kernel's named grid axes are bound by its own lowering (evaluating it
    eagerly, under ``jax.ensure_compile_time_eval``, leaves them unbound on a
    GPU: "unbound axis name: m").  Call it outside any trace (a fresh thread).
    """
    rng = np.random.default_rng(0)
    worst = 0.0
    for (m, k, n), out_dtype in (((128, 256, 128), jnp.float32), ((160, 288, 160), jnp.bfloat16)):
        kc, nc = -(-k // 128), -(-n // 128)
        # Codes drawn in float64 and rounded to E4M3 by ml_dtypes; scales in float32.
        a = rng.uniform(-4, 4, (m, k)).astype(jnp.float8_e4m3fn)
        b = rng.uniform(-4, 4, (k, n)).astype(jnp.float8_e4m3fn)
        sa = rng.uniform(0.5, 2.0, (m, kc)).astype(np.float32)
        sb = rng.uniform(0.5, 2.0, (kc, nc)).astype(np.float32)
        args = (a, sa, b, sb)
        shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in args]
        kernel = functools.partial(block_scaled_matmul, out_dtype=out_dtype, interpret=interpret)
        reference = functools.partial(block_scaled_matmul_reference, out_dtype=jnp.float32)
        got = np.asarray(jax.jit(kernel).lower(*shapes).compile()(*args), np.float64)
        want = np.asarray(jax.jit(reference).lower(*shapes).compile()(*args), np.float64)
        worst = max(worst, float(np.max(np.abs(got - want)) / np.max(np.abs(want))))
    return worst
