"""The Pallas kernels compiled for sm_90 on a CPU machine (pip triton, the GPU image's).

Every layout (Fprop "kn", Dgrad "nk", Wgrad "tn", both grouped layouts) must
reach FP8 wgmma with no mma.sync fallback, fit an H200's shared memory and
pipeline its K loop (cp.async copies).  Needs pip ``triton``; where it is
installed these tests fail rather than skip.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

pytest.importorskip("triton")

from fp8jax.bench import triton_ir  # noqa: E402
from fp8jax.kernels import block_gemm as bg  # noqa: E402
from fp8jax.kernels import grouped_block_gemm as gbg  # noqa: E402

S = jax.ShapeDtypeStruct
F32 = jnp.float32


def _cases(fmt):
    m, k, n, e = 256, 384, 256, 4
    return {
        "kn": (
            bg.block_scaled_matmul,
            (S((m, k), fmt), S((m, 3), F32), S((k, n), fmt), S((3, 2), F32)),
        ),
        "nk": (
            bg.block_scaled_matmul_nt,
            (S((m, k), fmt), S((m, 3), F32), S((n, k), fmt), S((2, 3), F32)),
        ),
        "tn": (
            bg.block_scaled_matmul_tn,
            (S((k, m), fmt), S((3, m), F32), S((k, n), fmt), S((3, n), F32)),
        ),
        "grouped_kn": (
            lambda *x: gbg.grouped_block_scaled_matmul_aligned(*x, b_layout="kn", interpret=False),
            (
                S((m, k), fmt),
                S((m, 3), F32),
                S((e, k, n), fmt),
                S((e, 3, 2), F32),
                S((2,), jnp.int32),
            ),
        ),
        "grouped_nk": (
            lambda *x: gbg.grouped_block_scaled_matmul_aligned(*x, b_layout="nk", interpret=False),
            (
                S((m, k), fmt),
                S((m, 3), F32),
                S((e, n, k), fmt),
                S((e, 2, 3), F32),
                S((2,), jnp.int32),
            ),
        ),
    }


@pytest.mark.parametrize("fmt", [jnp.float8_e4m3fn, jnp.float8_e5m2])
@pytest.mark.parametrize("layout", ["kn", "nk", "tn", "grouped_kn", "grouped_nk"])
def test_kernel_compiles_to_pipelined_fp8_wgmma(layout, fmt):
    fn, args = _cases(fmt)[layout]
    if layout in ("kn", "nk", "tn"):
        kernel = lambda *x: fn(*x, interpret=False)  # noqa: E731
    else:
        kernel = fn
    code = triton_ir.compile_sm90(triton_ir.triton_module(kernel, *args))
    assert code.fp8_wgmma > 0, code
    assert code.mma_sync == 0, code
    assert 0 < code.shared_bytes <= triton_ir.H200_SHARED_BYTES, code
    assert code.cp_async > 0, code  # loads overlap the math
