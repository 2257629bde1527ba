"""The Mosaic GPU kernels compiled for an H100 on a machine without a GPU.

:mod:`fp8jax.bench.compilers` compiles a program for a described GPU from a
CPU machine (XLA's compile-only CUDA client).  Mosaic GPU then writes what it
made of each kernel into ``MOSAIC_GPU_DUMP_TO``: the PTX, ``ptxas``'s report
(registers, spills) and the kernel's shared memory.  This module compiles one
kernel call that way and counts what the code holds: FP8 ``wgmma``
instructions, TMA copies (``cp.async.bulk.tensor``), the promotion's FP32
FFMA, any ``mma.sync`` fallback.  These are compiler output, not measurements.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import jax
import jax.numpy as jnp

from fp8jax.bench import compilers
from fp8jax.kernels import block_gemm
from fp8jax.kernels import grouped_block_gemm as grouped

#: Shared memory one thread block may use on an H100 / H200 (227 KiB).
H100_SHARED_BYTES = 227 * 1024
#: Registers one thread may use.
MAX_REGISTERS = 255
LAYOUTS = ("kn", "nk", "tn", "grouped_kn", "grouped_nk", "grouped_wgrad")
_DUMP_VARS = ("MOSAIC_GPU_DUMP_PTX", "MOSAIC_GPU_DUMP_PTXAS", "MOSAIC_GPU_DUMP_RESOURCES")


@dataclasses.dataclass(frozen=True)
class KernelCode:
    """What one Mosaic GPU kernel compiles to (read from its PTX and ptxas report)."""

    fp8_wgmma: tuple[str, ...]  # distinct FP8 wgmma instruction shapes/types
    fp8_wgmma_count: int
    tma_loads: int
    mma_sync: int
    ffma: int  # FP32 fused multiply-adds (the promotion: 64 per thread per K step)
    shared_bytes: int
    registers: int
    spill_bytes: int
    ptx: str = dataclasses.field(repr=False)


def unavailable() -> str | None:
    """Why no H100 program can be compiled here (one line), or None."""
    return compilers.unavailable(compilers.target("h100"))


@contextlib.contextmanager
def _mosaic_dump() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as tmp:
        saved = {k: os.environ.get(k) for k in (*_DUMP_VARS, "MOSAIC_GPU_DUMP_TO")}
        os.environ.update({k: "1" for k in _DUMP_VARS}, MOSAIC_GPU_DUMP_TO=tmp)
        try:
            yield Path(tmp)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def compile_h100(fn: Callable, *args: jax.ShapeDtypeStruct) -> list[KernelCode]:
    """Compile ``jax.jit(fn)`` for an H100 here; what each Mosaic GPU kernel in it became."""
    with _mosaic_dump() as dump:
        compilers.compile_for(fn, args, "h100")
        codes = [_read(ptx) for ptx in sorted(dump.glob("*.ptx"))]
    if not codes:
        raise ValueError("no Mosaic GPU kernel was compiled (is interpret=False?)")
    return codes


def _read(ptx_path: Path) -> KernelCode:
    ptx = ptx_path.read_text()
    report = ptx_path.with_suffix(".ptxas").read_text()
    resources = ptx_path.with_suffix(".resources.txt").read_text()
    wgmma = re.findall(r"wgmma\.mma_async\S*\.e[45]m[23]\.e[45]m[23]", ptx)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    return KernelCode(
        fp8_wgmma=tuple(sorted(set(wgmma))),
        fp8_wgmma_count=len(wgmma),
        tma_loads=len(re.findall(r"cp\.async\.bulk\.tensor\.\S*shared\S*\.global", ptx)),
        mma_sync=ptx.count("mma.sync"),
        ffma=len(re.findall(r"\bfma\.rn\.f32\b", ptx)),
        shared_bytes=int(re.search(r"smem_scratch_bytes=(\d+)", resources).group(1)),
        registers=int(re.search(r"Used (\d+) registers", report).group(1)),
        spill_bytes=int(spills.group(1)) + int(spills.group(2)),
        ptx=ptx,
    )


def kernel_case(
    layout: str, a_fmt=jnp.float8_e4m3fn, b_fmt=None, out_dtype=jnp.bfloat16
) -> tuple[Callable, tuple]:
    """(compiled kernel function, abstract operands) of one layout at a small shape.

    "kn" Fprop, "nk" Dgrad, "tn" Wgrad, "grouped_kn" / "grouped_nk" the MoE
    kernel's two weight layouts, "grouped_wgrad" the experts' Wgrad over K runs
    (token tiles); M = N = 256, K = 640, 4 experts.  ``b_fmt``
    (default ``a_fmt``): the second operand's FP8 format.
    """
    s, f32 = jax.ShapeDtypeStruct, jnp.float32
    b_fmt = a_fmt if b_fmt is None else b_fmt
    # K = 640: five runs of 128, more than the pipeline's stages.
    m, k, n, e = 256, 640, 256, 4
    kc, mc, nc = k // 128, m // 128, n // 128
    cases = {
        "kn": (
            block_gemm.block_scaled_matmul,
            (s((m, k), a_fmt), s((m, kc), f32), s((k, n), b_fmt), s((kc, nc), f32)),
        ),
        "nk": (
            block_gemm.block_scaled_matmul_nt,
            (s((m, k), a_fmt), s((m, kc), f32), s((n, k), b_fmt), s((nc, kc), f32)),
        ),
        "tn": (
            block_gemm.block_scaled_matmul_tn,
            (s((k, m), a_fmt), s((kc, m), f32), s((k, n), b_fmt), s((kc, n), f32)),
        ),
        "grouped_kn": (
            functools.partial(grouped.grouped_block_scaled_matmul_aligned, b_layout="kn"),
            (
                s((m, k), a_fmt),
                s((m, kc), f32),
                s((e, k, n), b_fmt),
                s((e, kc, nc), f32),
                s((mc,), jnp.int32),
            ),
        ),
        "grouped_nk": (
            functools.partial(grouped.grouped_block_scaled_matmul_aligned, b_layout="nk"),
            (
                s((m, k), a_fmt),
                s((m, kc), f32),
                s((e, n, k), b_fmt),
                s((e, nc, kc), f32),
                s((mc,), jnp.int32),
            ),
        ),
        "grouped_wgrad": (
            functools.partial(grouped.grouped_wgrad, num_groups=e),
            (
                s((kc, 128, m), a_fmt),
                s((kc, 1, m), f32),
                s((kc, 128, n), b_fmt),
                s((kc, 1, n), f32),
                s((kc,), jnp.int32),
            ),
        ),
    }
    fn, args = cases[layout]
    return functools.partial(fn, out_dtype=out_dtype, interpret=False), args


def main() -> None:
    """Print what every layout compiles to for an H100 (a markdown table)."""
    print(
        "| layout | FP8 `wgmma` | TMA loads | `mma.sync` | FP32 FFMA | shared memory | registers "
        "| spills |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for layout in LAYOUTS:
        fn, args = kernel_case(layout)
        for c in compile_h100(fn, *args):
            print(
                f"| {layout} | {c.fp8_wgmma_count} x {', '.join(c.fp8_wgmma)} | {c.tma_loads} | "
                f"{c.mma_sync} | {c.ffma} | {c.shared_bytes} B | {c.registers} | {c.spill_bytes} B |"
            )


if __name__ == "__main__":
    main()
