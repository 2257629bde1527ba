"""The Pallas kernels' Triton IR, lowered for CUDA here and compiled for sm_90 by pip ``triton``.

No GPU is needed: Pallas lowers a kernel to a Triton module on any machine
(under :func:`fp8jax.platforms.lowering_for_cuda`), and ``triton.compile``
turns that module into PTX and a cubin for a given architecture (pip
``triton`` ships its own ``ptxas``).  XLA carries its own Triton, so the
machine code on a GPU may differ in detail; what this shows is whether the
kernel's IR reaches FP8 ``wgmma``, how much shared memory it asks for and
whether its K loop is software-pipelined (``cp.async`` copies).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import re
import tempfile
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp

from fp8jax import platforms
from fp8jax.kernels import block_gemm
from fp8jax.kernels import grouped_block_gemm as grouped

LAYOUTS = ("kn", "nk", "tn", "grouped_kn", "grouped_nk")

#: Shared memory one thread block may use on an H100 / H200 (227 KiB).
H200_SHARED_BYTES = 227 * 1024


@dataclasses.dataclass(frozen=True)
class KernelCode:
    """What a kernel compiles to: counts read from its PTX, its shared memory."""

    fp8_wgmma: int
    mma_sync: int
    cp_async: int
    shared_bytes: int


def triton_module(fn: Callable, *args: jax.ShapeDtypeStruct, capability: str = "9.0") -> str:
    """The Triton module (MLIR text, locations stripped) of the one Pallas call in ``fn``.

    ``fn`` must call a kernel of :mod:`fp8jax.kernels` (``interpret=False``);
    Pallas prints the module when asked for debug output.
    """
    orig = block_gemm.pl.pallas_call
    out = io.StringIO()
    try:
        block_gemm.pl.pallas_call = lambda *a, **k: orig(*a, **{**k, "debug": True})
        with contextlib.redirect_stdout(out), platforms.lowering_for_cuda(capability):
            jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    finally:
        block_gemm.pl.pallas_call = orig
    text = out.getvalue()
    if "The Triton module" not in text:
        raise ValueError("no Pallas Triton call was lowered (is interpret=False?)")
    text = text[text.index("The Triton module") :]
    text = text[text.index("\n") + 1 :]
    # Pallas' pretty debug locations are not parseable MLIR: drop them.
    text = re.sub(r"^#loc.*$", "", text, flags=re.M)
    text = re.sub(r' \[unknown\]| "[^"\n]*"\(#loc\d*\)| #loc\d*\b', "", text)
    return text[: re.search(r"^}$", text, flags=re.M).end()] + "\n"


def compile_sm90(module_text: str) -> KernelCode:
    """Compile a Triton module for sm_90 with pip ``triton``; count what its PTX holds."""
    import triton
    from triton.backends.compiler import GPUTarget

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.ttir"
        path.write_text(module_text)
        compiled = triton.compile(str(path), target=GPUTarget("cuda", 90, 32))
    ptx = compiled.asm["ptx"]
    return KernelCode(
        fp8_wgmma=len(re.findall(r"wgmma\.mma_async\S*\.e[45]m[32]\.e[45]m[32]", ptx)),
        mma_sync=ptx.count("mma.sync"),
        cp_async=len(re.findall(r"cp\.async", ptx)),
        shared_bytes=int(compiled.metadata.shared),
    )


def kernel_case(layout: str, fmt=jnp.float8_e4m3fn) -> tuple[Callable, tuple]:
    """(compiled kernel function, abstract operands) of one layout at a small shape.

    "kn" Fprop, "nk" Dgrad, "tn" Wgrad, "grouped_kn" / "grouped_nk" the MoE
    kernel's two weight layouts; M = N = 256, K = 384, 4 experts.
    """
    s, f32 = jax.ShapeDtypeStruct, jnp.float32
    m, k, n, e = 256, 384, 256, 4
    cases = {
        "kn": (
            block_gemm.block_scaled_matmul,
            (s((m, k), fmt), s((m, 3), f32), s((k, n), fmt), s((3, 2), f32)),
        ),
        "nk": (
            block_gemm.block_scaled_matmul_nt,
            (s((m, k), fmt), s((m, 3), f32), s((n, k), fmt), s((2, 3), f32)),
        ),
        "tn": (
            block_gemm.block_scaled_matmul_tn,
            (s((k, m), fmt), s((3, m), f32), s((k, n), fmt), s((3, n), f32)),
        ),
        "grouped_kn": (
            functools.partial(grouped.grouped_block_scaled_matmul_aligned, b_layout="kn"),
            (
                s((m, k), fmt),
                s((m, 3), f32),
                s((e, k, n), fmt),
                s((e, 3, 2), f32),
                s((2,), jnp.int32),
            ),
        ),
        "grouped_nk": (
            functools.partial(grouped.grouped_block_scaled_matmul_aligned, b_layout="nk"),
            (
                s((m, k), fmt),
                s((m, 3), f32),
                s((e, n, k), fmt),
                s((e, 2, 3), f32),
                s((2,), jnp.int32),
            ),
        ),
    }
    fn, args = cases[layout]
    return functools.partial(fn, interpret=False), args


def main() -> None:
    """Print what every layout compiles to for sm_90 (a markdown table)."""
    print("| layout | FP8 `wgmma` | `mma.sync` | `cp.async` | shared memory |")
    print("|---|---|---|---|---|")
    for layout in LAYOUTS:
        fn, args = kernel_case(layout)
        c = compile_sm90(triton_module(fn, *args))
        print(
            f"| {layout} | {c.fp8_wgmma} | {c.mma_sync} | {c.cp_async} | "
            f"{c.shared_bytes // 1024} KiB |"
        )


if __name__ == "__main__":
    main()
