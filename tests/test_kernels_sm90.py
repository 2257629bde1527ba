"""The Pallas kernels compiled for sm_90 on a CPU machine (pip triton, the GPU image's).

Every layout (Fprop "kn", Dgrad "nk", Wgrad "tn", both grouped layouts) must
reach FP8 wgmma with no mma.sync fallback, fit an H200's shared memory and
pipeline its K loop (cp.async copies).  Needs pip ``triton``; where it is
installed these tests fail rather than skip.
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest

pytest.importorskip("triton")

from fp8jax.bench import triton_ir  # noqa: E402


@pytest.mark.parametrize("fmt", [jnp.float8_e4m3fn, jnp.float8_e5m2])
@pytest.mark.parametrize("layout", triton_ir.LAYOUTS)
def test_kernel_compiles_to_pipelined_fp8_wgmma(layout, fmt):
    fn, args = triton_ir.kernel_case(layout, fmt)
    code = triton_ir.compile_sm90(triton_ir.triton_module(fn, *args))
    assert code.fp8_wgmma > 0, code
    assert code.mma_sync == 0, code
    assert 0 < code.shared_bytes <= triton_ir.H200_SHARED_BYTES, code
    assert code.cp_async > 0, code  # loads overlap the math
