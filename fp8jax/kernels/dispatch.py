"""Which block-scaled GEMM implementation runs: the Pallas kernel or XLA.

``kernel_available()`` is True only on an NVIDIA GPU of compute capability >= 9.0
(Hopper and later) whose Pallas Triton lowering compiles and runs a small
block-scaled GEMM correctly (checked once per process against the jnp
reference).  ``resolve_impl(impl)`` turns a recipe's ``impl`` field
("auto" | "xla" | "pallas") into "xla" or "pallas":

* "auto": "pallas" where ``kernel_available()``, else "xla";
* "xla": always "xla" (the kernel is disabled);
* "pallas": always "pallas"; off a Hopper GPU the kernel runs in Pallas
  interpret mode (slow, exact same math; meant for tests).

``maybe_block_gemm`` / ``maybe_grouped_block_gemm`` are what ``dot_general``
and the grouped expert GEMM call: they run the kernel and return its result
when the resolved implementation is "pallas", and return None otherwise, so
the caller keeps its current XLA path.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax.kernels.block_gemm import (
    block_scaled_matmul,
    block_scaled_matmul_nt,
    block_scaled_matmul_reference,
)
from fp8jax.kernels.grouped_block_gemm import grouped_block_scaled_matmul

IMPLS = ("auto", "xla", "pallas")


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


def resolve_impl(impl: str = "auto") -> str:
    """Recipe ``impl`` field -> "pallas" or "xla" (see module docstring)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        return "pallas" if kernel_available() else "xla"
    return impl


def maybe_block_gemm(
    a_data: jax.Array,
    a_scale: jax.Array,
    b_data: jax.Array,
    b_scale: jax.Array,
    *,
    impl: str = "auto",
    out_dtype=jnp.bfloat16,
    b_layout: str = "kn",
) -> jax.Array | None:
    """Run the block-scaled kernel if ``impl`` resolves to "pallas", else return None.

    2D operands only: a (M, K) FP8 with (M, ceil(K/128)) scales; ``b_layout``
    "kn": b (K, N) with (ceil(K/128), ceil(N/128)) scales, "nk": b (N, K) with
    (ceil(N/128), ceil(K/128)) scales (use "nk" for Dgrad: dy @ W^T with W (K, N)
    is b = W in "nk" layout).  The caller flattens batch dims into M.
    """
    if resolve_impl(impl) != "pallas":
        return None
    interpret = not kernel_available()
    if b_layout == "kn":
        return block_scaled_matmul(
            a_data, a_scale, b_data, b_scale, out_dtype=out_dtype, interpret=interpret
        )
    if b_layout == "nk":
        return block_scaled_matmul_nt(
            a_data, a_scale, b_data, b_scale, out_dtype=out_dtype, interpret=interpret
        )
    raise ValueError(f"b_layout must be 'kn' or 'nk', got {b_layout!r}")


def maybe_grouped_block_gemm(
    a_data: jax.Array,
    a_scale: jax.Array,
    b_data: jax.Array,
    b_scale: jax.Array,
    group_sizes: jax.Array,
    *,
    impl: str = "auto",
    out_dtype=jnp.bfloat16,
    b_layout: str = "kn",
) -> jax.Array | None:
    """Grouped (MoE, contiguous layout) counterpart of ``maybe_block_gemm``."""
    if resolve_impl(impl) != "pallas":
        return None
    return grouped_block_scaled_matmul(
        a_data,
        a_scale,
        b_data,
        b_scale,
        group_sizes,
        out_dtype=out_dtype,
        b_layout=b_layout,
        interpret=not kernel_available(),
    )
