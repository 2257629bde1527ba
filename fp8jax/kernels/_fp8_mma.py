"""One FP8 tensor-core MMA of a (bm x 128) by (128 x bn) tile into a *fresh* FP32 tile.

Why a primitive of our own instead of ``pl.dot``: the Pallas Triton lowering
of ``lax.dot_general`` emits ``tt.dot`` without ``maxNumImpreciseAcc``, which
Triton reads as 0.  For FP8 operands with an FP32 accumulator, Triton then
keeps a separate partial accumulator and adds it into the main one after
*every* ``wgmma`` instruction (K = 32).  That is more precise than needed and
puts as many FP32 adds on the CUDA cores as there are MMA cycles on the tensor
cores, which caps the kernel near BF16 speed.  The block-scaled GEMM already
promotes every 128 K elements itself (DeepGEMM's two-level accumulation: each
128-K chunk goes into a fresh FP32 partial, which is scaled and added to the
main accumulator), so inside one chunk the tensor core may accumulate natively.
This module registers ``fp8_mma_p`` whose Triton lowering sets
``maxNumImpreciseAcc = 2**30`` (what Triton itself uses for ``tl.dot`` on
sm_90), i.e. native Hopper accumulation over at most one 128-K chunk.

Numerics of the primitive: ``result = a @ b`` (or ``a @ b.T``), products exact,
summed in FP32 on CPU / in interpret mode; on Hopper the sum of the 128 products
uses the tensor core's own accumulation (about 13-14 fraction bits, see
fp8jax.accumulate), then leaves the tensor core as FP32.

If the private Triton lowering API is not importable (a future jax), the
primitive falls back to the stock ``lax.dot_general`` lowering: still correct,
only slower.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import mlir

fp8_mma_p = Primitive("fp8jax_fp8_mma")

# Triton's "never split the accumulation" value (sm_90 default of tl.dot).
_MAX_NUM_IMPRECISE_ACC = 2**30


def fp8_mma(
    a: jax.Array, b: jax.Array, *, trans_a: bool = False, trans_b: bool = False
) -> jax.Array:
    """FP32 product of two FP8 tiles: ``op(a) @ op(b)``, ``op`` transposing when asked.

    ``a``: (bm, bk) FP8, or (bk, bm) when ``trans_a``; ``b``: (bk, bn), or
    (bn, bk) when ``trans_b``.  Both operands must have the same FP8 dtype (a
    Triton requirement).
    """
    return fp8_mma_p.bind(a, b, trans_a=trans_a, trans_b=trans_b)


def _dot_f32(a, b, *, trans_a=False, trans_b=False):
    lhs_contract = 0 if trans_a else 1
    rhs_contract = 1 if trans_b else 0
    # preferred_element_type=float32: FP8 x FP8 products are exact in FP32 and
    # the sum is kept in FP32 (XLA on CPU upcasts the FP8 operands to FP32).
    return lax.dot_general(
        a,
        b,
        (((lhs_contract,), (rhs_contract,)), ((), ())),
        preferred_element_type=jnp.float32,
    )


def _abstract_eval(a, b, *, trans_a, trans_b):
    if a.ndim != 2 or b.ndim != 2:
        raise ValueError(f"fp8_mma wants 2D tiles, got {a.shape} and {b.shape}")
    m, k_a = (a.shape[1], a.shape[0]) if trans_a else a.shape
    k_b = b.shape[1] if trans_b else b.shape[0]
    n = b.shape[0] if trans_b else b.shape[1]
    if k_a != k_b:
        raise ValueError(f"fp8_mma contraction mismatch: {a.shape} x {b.shape} (trans_b={trans_b})")
    if a.dtype != b.dtype:
        raise ValueError(f"fp8_mma wants equal operand dtypes, got {a.dtype} and {b.dtype}")
    return jax.core.ShapedArray((m, n), jnp.float32)


fp8_mma_p.def_abstract_eval(_abstract_eval)
fp8_mma_p.def_impl(functools.partial(jax.jit, static_argnames=("trans_a", "trans_b"))(_dot_f32))
mlir.register_lowering(fp8_mma_p, mlir.lower_fun(_dot_f32, multiple_results=False))


def _register_triton_rule() -> bool:
    """Install the Pallas-Triton lowering of ``fp8_mma_p``; False if the private API moved."""
    try:
        from jax._src.lib import triton as _triton_lib
        from jax._src.pallas.triton import lowering as tl

        tt_dialect = _triton_lib.dialect
        ir = tl.ir
    except Exception:  # pragma: no cover - depends on the jax build
        return False

    def rule(ctx, a, b, *, trans_a, trans_b):
        if trans_a:
            a = tt_dialect.trans(a, (1, 0))
        if trans_b:
            b = tt_dialect.trans(b, (1, 0))
        [out_aval] = ctx.avals_out
        a_type = ir.RankedTensorType(a.type)
        b_type = ir.RankedTensorType(b.type)
        m, n = a_type.shape[0], b_type.shape[1]
        # A zero accumulator: each 128-K chunk starts a fresh FP32 partial,
        # which the kernel scales and adds to its main accumulator.
        acc = tl._zeros(ir.RankedTensorType.get([m, n], ir.F32Type.get()))
        del out_aval
        return tt_dialect.dot(a, b, acc, max_num_imprecise_acc=_MAX_NUM_IMPRECISE_ACC)

    tl.triton_lowering_rules[fp8_mma_p] = rule
    return True


TRITON_RULE_INSTALLED: bool = _register_triton_rule()
