"""Throughput of the block-scaled FP8 Pallas kernels vs BF16 and per-tensor FP8 XLA dots.

Used by configs/bench/kernels.py (``experiments/bench.py``).  Every implementation computes
(M, K) x (K, N) -> (M, N) bfloat16 on ready-made FP8 operands (quantization is
not timed here; :mod:`fp8jax.bench.sweep` times whole ``dot_general`` calls)
and is timed with :func:`fp8jax.bench.timing.time_calls` after compilation.
TFLOP/s = 2 M N K / time.

Implementations:

* ``bf16``: ``jnp.dot`` of bfloat16 operands, FP32 accumulation
  (``preferred_element_type=float32``), bfloat16 output.
* ``fp8_tensor_xla``: per-tensor scaled FP8 in the canonical pattern
  :func:`fp8jax.bench.gemm_cases.dequantized_dot`, which XLA's GPU GEMM rewriter
  turns into a cuBLASLt FP8 GEMM (read from the compiled HLO by
  :mod:`fp8jax.bench.hlo`).
* ``block_xla``: the block-scaled math through XLA (the jnp reference of the
  kernel: a scan of per-chunk dots), the path taken without the kernel.
* ``fp8_runs``: the GEMM core's ``impl="fp8"``: one hardware FP8 dot
  (``ANY_F8_ANY_F8_F32``) per 128-long run of K, scaled and summed in FP32.
* ``pallas_kn`` / ``pallas_nt``: the Pallas kernel with B as (K, N) / (N, K).
* ``pallas_tn_wgrad``: the 1D1D kernel computing the Wgrad of the same layer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from fp8jax import gemm, kernels, recipes
from fp8jax.bench.gemm_cases import GroupedShape, Shape, dequantized_dot
from fp8jax.bench.hlo import summarize_hlo
from fp8jax.bench.timing import time_calls
from fp8jax.kernels.block_gemm import CHUNK, cdiv
from fp8jax.layout import Layout
from fp8jax.quant import QTensor

DENSE_IMPLS = (
    "bf16",
    "fp8_tensor_xla",
    "block_xla",
    "fp8_runs",
    "pallas_kn",
    "pallas_nt",
    "pallas_tn_wgrad",
)
_MM_DIMS = (((1,), (0,)), ((), ()))
_INTERPRET_NOTE = "Mosaic GPU interpret mode: not a performance number"


@dataclasses.dataclass
class Result:
    """One (shape, implementation) measurement; seconds/tflops are None on failure."""

    shape: str
    impl: str
    m: int
    k: int
    n: int
    seconds: float | None
    tflops: float | None
    note: str = ""
    ratio_to_bf16: float | None = None


def make_operands(key: jax.Array, m: int, k: int, n: int, *, groups: int = 0):
    """Random FP8 operands with DeepSeek-V3 scale layouts: a (M, K) with 1x128 tile
    scales (M, K/128), b (K, N) (or (groups, K, N)) with 128x128 block scales."""
    ka, kb, ks1, ks2 = jax.random.split(key, 4)
    kc, nc = cdiv(k, CHUNK), cdiv(n, CHUNK)
    b_shape = (groups, k, n) if groups else (k, n)
    # Clip before the cast: a plain cast to E4M3 does not saturate.
    a = jnp.clip(jax.random.normal(ka, (m, k)) * 64, -448, 448).astype(jnp.float8_e4m3fn)
    b = jnp.clip(jax.random.normal(kb, b_shape) * 64, -448, 448).astype(jnp.float8_e4m3fn)
    sa = jax.random.uniform(ks1, (m, kc), jnp.float32, 1e-3, 1e-2)
    sb_shape = (groups, kc, nc) if groups else (kc, nc)
    sb = jax.random.uniform(ks2, sb_shape, jnp.float32, 1e-3, 1e-2)
    return a, sa, b, sb


def _bf16_dot(a, b):
    # FP32 accumulation, one rounding to bfloat16: the usual BF16 training GEMM.
    return jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16)


def _fp8_tensor_dot(a, sa, b, sb):
    return dequantized_dot(a, sa, b, sb, _MM_DIMS, jnp.bfloat16)


def _fp8_runs(a, sa, b, sb):
    # The operands as the GEMM core's tile / block QTensors, impl "fp8".
    qa = QTensor(a[None], sa[None], Layout("tile", 2, CHUNK))
    qb = QTensor(b[None], sb[None], Layout("block", 1, CHUNK))
    recipe = dataclasses.replace(recipes.deepseek_v3(), impl="fp8")
    return gemm.gemm(qa, qb, "fprop", recipe)[0].astype(jnp.bfloat16)


def cublaslt_fp8_compiles(m: int, k: int, n: int) -> bool:
    """Does XLA compile the per-tensor FP8 pattern to a cuBLASLt FP8 GEMM here?"""
    args = (
        jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn),
        jax.ShapeDtypeStruct((), jnp.float32),
        jax.ShapeDtypeStruct((k, n), jnp.float8_e4m3fn),
        jax.ShapeDtypeStruct((), jnp.float32),
    )
    text = jax.jit(_fp8_tensor_dot).lower(*args).compile().as_text()
    return summarize_hlo(text)["cublaslt_fp8"]


def _measure(
    name: str,
    m: int,
    k: int,
    n: int,
    fns: dict[str, tuple[Callable, tuple]],
    *,
    iters: int,
    interpret: bool,
    base: str,
) -> list[Result]:
    """Time every case (round-robin); a case that fails is reported, the others go on."""
    flops = 2.0 * m * n * k
    results: dict[str, Result] = {}
    runnable: dict[str, tuple[Callable, tuple]] = {}
    for impl, (fn, args) in fns.items():
        try:
            jax.block_until_ready(fn(*args))  # compile, and catch a kernel that does not apply
            runnable[impl] = (fn, args)
        except Exception as e:  # report, keep benchmarking the others
            results[impl] = Result(name, impl, m, k, n, None, None, f"failed: {e!r}"[:500])
    times = time_calls(runnable, warmup=1, iters=iters) if runnable else {}
    for impl, t in times.items():
        note = _INTERPRET_NOTE if impl.startswith("pallas") and interpret else ""
        s = t["median_s"]
        results[impl] = Result(name, impl, m, k, n, s, flops / s / 1e12, note)
    out = [results[impl] for impl in fns]
    ref = next((r for r in out if r.impl == base and r.tflops), None)
    for r in out:
        # Interpret-mode timings measure the emulator, not the kernel: no ratio.
        if ref is not None and r.tflops and not r.note:
            r.ratio_to_bf16 = r.tflops / ref.tflops
    return out


def bench_dense(
    shape: Shape,
    *,
    impls: Sequence[str],
    iters: int,
    interpret: bool,
    kernel_kwargs: dict[str, Any] | None = None,
) -> list[Result]:
    """Every implementation in ``impls`` (see DENSE_IMPLS) at one shape."""
    bad = set(impls) - set(DENSE_IMPLS)
    if bad:
        raise ValueError(f"unknown implementations {sorted(bad)}; known: {DENSE_IMPLS}")
    kw = dict(kernel_kwargs or {}, interpret=interpret)
    m, k, n = shape.m, shape.k, shape.n
    a, sa, b, sb = make_operands(jax.random.key(0), m, k, n)
    fns: dict[str, tuple[Callable, tuple]] = {}
    if "bf16" in impls:
        fns["bf16"] = (jax.jit(_bf16_dot), (a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)))
    if "fp8_tensor_xla" in impls:
        scale = jnp.float32(0.01)
        fns["fp8_tensor_xla"] = (jax.jit(_fp8_tensor_dot), (a, scale, b, scale))
    if "block_xla" in impls:
        fns["block_xla"] = (jax.jit(kernels.block_scaled_matmul_reference), (a, sa, b, sb))
    if "fp8_runs" in impls:
        fns["fp8_runs"] = (jax.jit(_fp8_runs), (a, sa, b, sb))
    if "pallas_kn" in impls:
        fns["pallas_kn"] = (
            jax.jit(lambda *x: kernels.block_scaled_matmul(*x, **kw)),
            (a, sa, b, sb),
        )
    if "pallas_nt" in impls:
        fns["pallas_nt"] = (
            jax.jit(lambda *x: kernels.block_scaled_matmul_nt(*x, **kw)),
            (a, sa, jnp.asarray(b.T), jnp.asarray(sb.T)),
        )
    if "pallas_tn_wgrad" in impls:
        # Wgrad of the same layer: dW (K, N) = x^T dy, 128x1 tiles along the
        # M tokens on both operands; same 2MNK FLOPs.
        dy = jnp.clip(jax.random.normal(jax.random.key(3), (m, n)) * 64, -448, 448).astype(a.dtype)
        mc = cdiv(m, CHUNK)
        sx = jnp.full((mc, k), 1e-2, jnp.float32)
        sdy = jnp.full((mc, n), 1e-2, jnp.float32)
        fns["pallas_tn_wgrad"] = (
            jax.jit(lambda *x: kernels.block_scaled_matmul_tn(*x, **kw)),
            (a, sx, dy, sdy),
        )
    return _measure(shape.name, m, k, n, fns, iters=iters, interpret=interpret, base="bf16")


def bench_grouped(
    shape: GroupedShape, *, iters: int, interpret: bool, b_layout: str = "kn"
) -> list[Result]:
    """The grouped kernel vs ``jax.lax.ragged_dot`` in bfloat16 (XLA's grouped GEMM)."""
    e, k, n = shape.experts, shape.k, shape.n
    a, sa, b, sb = make_operands(jax.random.key(1), shape.m, k, n, groups=e)
    gs = jnp.full((e,), shape.rows, jnp.int32)

    def ragged_bf16(x, w, g):
        # FP32 accumulation, one rounding to bfloat16, as the dense baseline.
        return jax.lax.ragged_dot(x, w, g, preferred_element_type=jnp.float32).astype(jnp.bfloat16)

    kb, ksb = (b, sb) if b_layout == "kn" else (jnp.swapaxes(b, 1, 2), jnp.swapaxes(sb, 1, 2))
    fns = {
        "bf16_ragged_dot": (
            jax.jit(ragged_bf16),
            (a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), gs),
        ),
        f"pallas_grouped_{b_layout}": (
            jax.jit(
                lambda *x: kernels.grouped_block_scaled_matmul(
                    *x, interpret=interpret, b_layout=b_layout
                )
            ),
            (a, sa, kb, ksb, gs),
        ),
    }
    return _measure(
        shape.name, shape.m, k, n, fns, iters=iters, interpret=interpret, base="bf16_ragged_dot"
    )


def sweep_launch_params(shape: Shape, *, iters: int) -> list[Result]:
    """Pipeline depth (K steps of 128 in flight in shared memory) of the NT kernel at one shape (GPU)."""
    out = []
    # Five stages of 33 KiB and a bfloat16 epilogue tile fill the H100's 227 KiB.
    for stages in (2, 3, 4, 5):
        (r,) = bench_dense(
            shape,
            impls=["pallas_nt"],
            iters=iters,
            interpret=False,
            kernel_kwargs={"stages": stages},
        )
        r.impl = f"pallas_nt stages={stages}"
        out.append(r)
    return out
