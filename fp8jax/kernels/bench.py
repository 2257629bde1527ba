"""GEMM throughput: the block-scaled FP8 kernel vs BF16 and per-tensor FP8 XLA dots.

Used by ``experiments/bench_gemm.py``.  Every implementation computes
(M, K) x (K, N) -> (M, N) bfloat16 and is timed after compilation as the median
of ``reps`` timings of ``iters`` back-to-back calls.  TFLOP/s = 2 M N K / time.

Implementations:

* ``bf16``: ``jnp.dot`` of bfloat16 operands, FP32 accumulation
  (``preferred_element_type=float32``), bfloat16 output.
* ``fp8_tensor_xla``: per-tensor scaled FP8, written as
  ``dot(convert(a_fp8) * sa, convert(b_fp8) * sb)``; XLA's GEMM rewriter turns
  this pattern into a cuBLASLt FP8 GEMM on Hopper (custom call
  ``__cublas$lt$matmul$f8``; we look for it in the compiled HLO).
* ``block_xla``: the block-scaled math through XLA (the jnp reference: a scan
  of per-chunk dots) - the path fp8jax takes without the kernel.
* ``pallas_kn`` / ``pallas_nt``: the Pallas kernel with B as (K, N) / (N, K).
* ``pallas_tn_wgrad``: the 1D1D kernel computing the Wgrad of the same layer.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

from fp8jax.kernels import block_gemm as bg
from fp8jax.kernels import grouped_block_gemm as gg

CUBLAS_F8_CALL = "__cublas$lt$matmul$f8"

#: (name, M, K, N): the square case and DeepSeek-V3 (4096 tokens, hidden 7168)
#: GEMMs: attention down-projections (N = 2112 = 1536 + 576), a 24576-wide
#: up-projection, and the expert shapes (K = 7168 -> N = 4096 = 2 x 2048 gate/up,
#: K = 2048 -> N = 7168 down).
FULL_SHAPES = [
    ("square_4096", 4096, 4096, 4096),
    ("dsv3_k7168_n2112", 4096, 7168, 2112),
    ("dsv3_k7168_n24576", 4096, 7168, 24576),
    ("dsv3_k7168_n4096", 4096, 7168, 4096),
    ("dsv3_k7168_n7168", 4096, 7168, 7168),
    ("dsv3_expert_k2048_n7168", 4096, 2048, 7168),
    ("dsv3_expert_k7168_n4096", 4096, 7168, 4096),
]
#: (name, experts, rows per expert, K, N) for the grouped kernel (contiguous layout).
FULL_GROUPED = [
    ("dsv3_grouped_e8_k7168_n4096", 8, 512, 7168, 4096),
    ("dsv3_grouped_e8_k2048_n7168", 8, 512, 2048, 7168),
]
SMALL_SHAPES = [("square_256", 256, 256, 256), ("dsv3_like_small", 128, 896, 264)]
SMALL_GROUPED = [("grouped_small", 4, 32, 256, 256)]
#: interpret mode is a correctness tool; one tiny shape shows it runs.
INTERPRET_SHAPE = ("interpret_tiny", 64, 256, 128)


@dataclasses.dataclass
class Result:
    shape: str
    impl: str
    m: int
    k: int
    n: int
    seconds: float | None
    tflops: float | None
    note: str = ""
    ratio_to_bf16: float | None = None


def time_fn(fn: Callable, args, *, iters: int, reps: int) -> float:
    """Median seconds per call over ``reps`` timings of ``iters`` calls (after warmup)."""
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = None
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / iters)
    return statistics.median(samples)


def make_operands(key, m, k, n, *, groups: int = 0):
    """Random FP8 operands with DeepSeek-V3 scale layouts (data clipped to +-448)."""
    ka, kb, ks1, ks2 = jax.random.split(key, 4)
    kc, nc = bg.cdiv(k, bg.CHUNK), bg.cdiv(n, bg.CHUNK)
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
    # convert(fp8) * scalar scale on each side, then a dot: the pattern XLA's
    # GEMM rewriter fuses into one cuBLASLt FP8 GEMM with per-tensor scales.
    a_dq = a.astype(jnp.bfloat16) * sa.astype(jnp.bfloat16)
    b_dq = b.astype(jnp.bfloat16) * sb.astype(jnp.bfloat16)
    return jnp.dot(a_dq, b_dq, preferred_element_type=jnp.bfloat16)


def compiled_hlo_has_cublas_f8(m: int, k: int, n: int) -> bool:
    """Does XLA compile the per-tensor FP8 pattern to a cuBLASLt FP8 GEMM here?"""
    args = (
        jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn),
        jax.ShapeDtypeStruct((), jnp.float32),
        jax.ShapeDtypeStruct((k, n), jnp.float8_e4m3fn),
        jax.ShapeDtypeStruct((), jnp.float32),
    )
    text = jax.jit(_fp8_tensor_dot).lower(*args).compile().as_text()
    return CUBLAS_F8_CALL in text


def bench_dense(
    name, m, k, n, *, impls, iters, reps, interpret, kernel_kwargs=None
) -> list[Result]:
    kernel_kwargs = kernel_kwargs or {}
    a, sa, b, sb = make_operands(jax.random.key(0), m, k, n)
    flops = 2.0 * m * n * k
    fns: dict[str, tuple[Callable, tuple]] = {}
    if "bf16" in impls:
        fns["bf16"] = (jax.jit(_bf16_dot), (a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)))
    if "fp8_tensor_xla" in impls:
        fns["fp8_tensor_xla"] = (
            jax.jit(_fp8_tensor_dot),
            (a, jnp.float32(0.01), b, jnp.float32(0.01)),
        )
    if "block_xla" in impls:
        fns["block_xla"] = (jax.jit(bg.block_scaled_matmul_reference), (a, sa, b, sb))
    if "pallas_kn" in impls:
        fns["pallas_kn"] = (
            jax.jit(lambda *x: bg.block_scaled_matmul(*x, interpret=interpret, **kernel_kwargs)),
            (a, sa, b, sb),
        )
    if "pallas_nt" in impls:
        bt, sbt = jnp.asarray(b.T), jnp.asarray(sb.T)
        fns["pallas_nt"] = (
            jax.jit(lambda *x: bg.block_scaled_matmul_nt(*x, interpret=interpret, **kernel_kwargs)),
            (a, sa, bt, sbt),
        )
    if "pallas_tn_wgrad" in impls:
        # Wgrad of the same layer: dW (K, N) = x^T dy, 128x1 tiles along the
        # M tokens on both operands; same 2MNK FLOPs.
        dy = jnp.clip(jax.random.normal(jax.random.key(3), (m, n)) * 64, -448, 448).astype(a.dtype)
        mc = bg.cdiv(m, bg.CHUNK)
        sx = jnp.full((mc, k), 1e-2, jnp.float32)
        sdy = jnp.full((mc, n), 1e-2, jnp.float32)
        fns["pallas_tn_wgrad"] = (
            jax.jit(lambda *x: bg.block_scaled_matmul_tn(*x, interpret=interpret, **kernel_kwargs)),
            (a, sx, dy, sdy),
        )
    results = []
    for impl, (fn, args) in fns.items():
        note = (
            "Pallas interpret mode: not a performance number"
            if (impl.startswith("pallas") and interpret)
            else ""
        )
        try:
            t = time_fn(fn, args, iters=iters, reps=reps)
            results.append(Result(name, impl, m, k, n, t, flops / t / 1e12, note))
        except Exception as e:  # report, keep benchmarking the others
            results.append(Result(name, impl, m, k, n, None, None, f"failed: {e!r}"[:500]))
    _add_ratios(results)
    return results


def bench_grouped(name, e, rows, k, n, *, iters, reps, interpret, b_layout="kn") -> list[Result]:
    m = e * rows
    a, sa, b, sb = make_operands(jax.random.key(1), m, k, n, groups=e)
    gs = jnp.full((e,), rows, jnp.int32)
    flops = 2.0 * m * n * k
    results = []
    # BF16 baseline for the grouped case: jax.lax.ragged_dot (XLA's grouped GEMM).
    bf16 = jax.jit(
        lambda x, w, g: jax.lax.ragged_dot(x, w, g, preferred_element_type=jnp.float32).astype(
            jnp.bfloat16
        )
    )
    if b_layout == "nk":
        b, sb = jnp.swapaxes(b, 1, 2), jnp.swapaxes(sb, 1, 2)
    kern = jax.jit(
        lambda *x: gg.grouped_block_scaled_matmul(*x, interpret=interpret, b_layout=b_layout)
    )
    cases = {
        "bf16_ragged_dot": (
            bf16,
            (
                a.astype(jnp.bfloat16),
                (b if b_layout == "kn" else jnp.swapaxes(b, 1, 2)).astype(jnp.bfloat16),
                gs,
            ),
        ),
        f"pallas_grouped_{b_layout}": (kern, (a, sa, b, sb, gs)),
    }
    for impl, (fn, args) in cases.items():
        note = (
            "Pallas interpret mode: not a performance number"
            if (impl.startswith("pallas") and interpret)
            else ""
        )
        try:
            t = time_fn(fn, args, iters=iters, reps=reps)
            results.append(Result(name, impl, m, k, n, t, flops / t / 1e12, note))
        except Exception as ex:
            results.append(Result(name, impl, m, k, n, None, None, f"failed: {ex!r}"[:500]))
    _add_ratios(results, base="bf16_ragged_dot")
    return results


def _add_ratios(results: list[Result], base: str = "bf16") -> None:
    ref = next((r for r in results if r.impl == base and r.tflops), None)
    for r in results:
        # Interpret-mode timings measure the emulator, not the kernel: no ratio.
        if ref is not None and r.tflops and "interpret" not in r.note:
            r.ratio_to_bf16 = r.tflops / ref.tflops


def sweep_configs(m, k, n, *, iters, reps) -> list[Result]:
    """Triton launch parameters of the NT kernel at one shape (GPU only)."""
    out = []
    a, sa, b, sb = make_operands(jax.random.key(2), m, k, n)
    bt, sbt = jnp.asarray(b.T), jnp.asarray(sb.T)
    flops = 2.0 * m * n * k
    for block_m in (64, 128):
        for num_warps in (4, 8):
            for num_stages in (3, 4, 5):
                kw = dict(block_m=block_m, num_warps=num_warps, num_stages=num_stages)
                fn = jax.jit(lambda *x, kw=kw: bg.block_scaled_matmul_nt(*x, interpret=False, **kw))
                label = f"pallas_nt bm={block_m} warps={num_warps} stages={num_stages}"
                try:
                    t = time_fn(fn, (a, sa, bt, sbt), iters=iters, reps=reps)
                    out.append(Result("sweep", label, m, k, n, t, flops / t / 1e12))
                except Exception as e:
                    out.append(Result("sweep", label, m, k, n, None, None, f"failed: {e!r}"[:300]))
    return out
