"""The GPU check: one step at a time, each result saved the moment it exists.

``scripts/gpu_check_kernels.sh`` runs ``python -m fp8jax.bench.gpu_check STEP --out DIR``
for each step under its own time limit, so a step that hangs or fails costs
only itself.  Steps (in order: what the machine is, then timings):

* ``env``: jax / jaxlib versions, the devices, compute capability, whether a
  Hopper GPU is attached and whether the compiled kernel passes its
  self-check (the correctness tests run in the script's pytest step);
* ``programs``: the fwd+bwd programs the compilers priced
  (:mod:`fp8jax.bench.measured`), deepseek_v3 on "auto" against bf16
  ``lax.dot_general`` / ``lax.ragged_dot``: wall time, ratio, the GEMM paths
  taken and the device time of every kernel from JAX's profiler;
* ``dense``: TFLOP/s per implementation on ready FP8 operands
  (:func:`fp8jax.bench.kernel.bench_dense`): cuBLAS bf16, per-tensor FP8
  through cuBLASLt, hardware FP8 dots per 128-run (``fp8_runs``), the Pallas
  kernels (Fprop, Dgrad, Wgrad layouts), at 4096^3 and DeepSeek-V3's shapes
  (K = 7168); ratios to bf16 in the same run;
* ``grouped``: the grouped (MoE) kernel against ``lax.ragged_dot`` in bf16;
* ``moe_step``: one train step of the tiny MoE model, bf16 vs deepseek_v3;
* ``quantizers``: the device time of each Triton quantizer
  (:mod:`fp8jax.kernels.gpu_quantize`) at 4096 x 4096 per warp count, and of
  XLA's fusions for the same outputs.

Every record is one JSON line appended to ``DIR/results.jsonl`` (and
printed) as soon as it is measured; a step ends with a line in
``DIR/steps.jsonl``.  Imports only what the GPU image has (jax, flax,
optax, numpy): no config, logging or data libraries.  ``--small`` runs tiny
shapes (the CPU test of this script); on a machine without a Hopper GPU the
kernels run in Mosaic GPU interpret mode and their timings carry that note.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax

from fp8jax import quant
from fp8jax.bench import gemm_cases, kernel, measured, moe_step
from fp8jax.bench.gemm_cases import Shape
from fp8jax.kernels import availability, gpu_quantize

STEPS = ("env", "programs", "dense", "grouped", "moe_step", "quantizers")

#: Dense shapes (M, K, N): the 4096^3 goal, DeepSeek-V3's K = 7168 projections
#: (an expert's up-projection and the attention output's down-projection).
FULL_SHAPES = (
    Shape("square_4096", "square", 4096, 4096, 4096),
    Shape("dsv3_k7168_n2048", "dsv3", 4096, 7168, 2048),
    Shape("dsv3_k2048_n7168", "dsv3", 4096, 2048, 7168),
)
SMALL_SHAPES = (Shape("square_256", "square", 256, 256, 256),)


def _env(small: bool) -> Iterator[dict[str, Any]]:
    import jaxlib

    dev = jax.devices()[0]
    hopper = availability.hopper_gpu()
    yield {
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "device_kind": dev.device_kind,
        "compute_capability": getattr(dev, "compute_capability", None),
        "hopper_gpu": hopper,
        # A Hopper GPU that fails the self-check has a broken kernel, not no GPU.
        "kernel_self_check": (availability.self_check_error() or "passed") if hopper else "n/a",
        # The Mosaic GPU quantizers against the CPU's bits: "auto" takes them only if
        # passed (the Triton ones, taken only where asked for, are checked by the
        # pytest step: each check compiles every kernel variant, and this step has
        # a time limit).
        "quantizer_check": (gpu_quantize.check_error("mosaic") or "passed") if hopper else "n/a",
        # What "auto" quantizes with here: the kernels passed their check and were
        # no slower than XLA's fusions (quant.gpu_kernels), else "xla".
        "quantizer": (getattr(quant.gpu_kernels(), "__name__", "xla") if hopper else "n/a"),
    }


def _dense(small: bool) -> Iterator[dict[str, Any]]:
    on_gpu = availability.kernel_available()
    impls = list(kernel.DENSE_IMPLS)
    if not on_gpu:
        # Off a Hopper GPU: no hardware FP8 dots, the kernels interpreted.
        impls.remove("fp8_runs")
    for shape in SMALL_SHAPES if small else FULL_SHAPES:
        for r in kernel.bench_dense(
            shape, impls=impls, iters=3 if small else 10, interpret=not on_gpu
        ):
            yield dataclasses.asdict(r)


def _programs(small: bool) -> Iterator[dict[str, Any]]:
    for case, make, args in measured.cases(small):
        yield from measured.measure(case, make, args, iters=3 if small else 10)


def _grouped(small: bool) -> Iterator[dict[str, Any]]:
    on_gpu = availability.kernel_available()
    for shape in gemm_cases.grouped_shapes(small):
        for layout in ("kn", "nk"):
            for r in kernel.bench_grouped(
                shape, iters=3 if small else 10, interpret=not on_gpu, b_layout=layout
            ):
                yield dataclasses.asdict(r)


def _quantizers(small: bool) -> Iterator[dict[str, Any]]:
    """Device time at 4096 x 4096 (bfloat16 x, E4M3) of XLA's fusions for each quantizer's
    outputs (``quant.quantize`` with ``FP8JAX_GPU_QUANTIZER=xla``), of the Mosaic GPU
    kernels, and of the Triton kernels per warp count."""
    import jax.numpy as jnp

    from fp8jax import quant

    n = 256 if small else 4096
    on_gpu = availability.hopper_gpu()
    x = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    e4m3 = jnp.float8_e4m3fn
    with gpu_quantize.asking("xla"):
        cached = quant.quantize(x, e4m3, "tile", axis=-1)
    xla = {
        "row": lambda x: quant.quantize(x, e4m3, "tile", axis=-1),
        "block": lambda x: quant.quantize(x, e4m3, "block"),
        "rows_cols": lambda x: quant.quantize_rows_and_cols(x, e4m3),
    }
    for name, fn in xla.items():
        # Traced (and so decided) inside the block.
        with gpu_quantize.asking("xla"):
            timed = _device_time(jax.jit(fn), (x,))
        yield {"kernel": name, "impl": "xla", "shape": [n, n], **timed}
    runs = [("mosaic", {})] + [
        ("triton", {"num_warps": w}) for w in ((4,) if small else (4, 8, 16))
    ]
    for kind, extra in runs:
        module = gpu_quantize.module(kind)
        kw = dict(fmt=e4m3, interpret=not on_gpu, **extra)
        kernels = {
            "row": (functools.partial(module.quantize_2d, orient="row", **kw), (x,)),
            "block": (functools.partial(module.quantize_2d, orient="block", **kw), (x,)),
            "rows_cols": (functools.partial(module.quantize_rows_cols, **kw), (x,)),
            "requantize": (
                functools.partial(module.requantize_col_t, **kw),
                (cached.data, cached.scale),
            ),
        }
        for name, (fn, args) in kernels.items():
            rec = {"kernel": name, "impl": kind, **extra, "shape": [n, n]}
            yield {**rec, **_device_time(jax.jit(fn), args)}


def _device_time(fn: Callable, args: tuple) -> dict[str, Any]:
    """The device time per call of ``fn`` (all its kernels), or what failed."""
    try:
        profile = measured.kernel_profile(fn, args)
    except Exception as e:  # noqa: BLE001 -- a kernel that does not compile is a result
        return {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    if "error" in profile:
        return profile
    lines = profile["lines"].values()
    return {
        "device_us": round(sum(v["total_us"] for v in lines), 2),
        "kernels": [t for v in lines for t in v["top"]],
    }


def _moe_step(small: bool) -> Iterator[dict[str, Any]]:
    records, note = moe_step.bench_train_steps(
        ["bf16", "deepseek_v3"],
        preset="tiny",
        batch=2 if small else 8,
        seq=16 if small else None,
        iters=2 if small else 5,
        log=lambda line: None,
    )
    for rec in records:
        yield {**rec, "note": note}


_RUNNERS: dict[str, Callable[[bool], Iterator[dict[str, Any]]]] = {
    "env": _env,
    "programs": _programs,
    "dense": _dense,
    "grouped": _grouped,
    "moe_step": _moe_step,
    "quantizers": _quantizers,
}


def _append(path: Path, record: dict[str, Any]) -> None:
    with path.open("a") as f:
        f.write(json.dumps(record, default=str) + "\n")


def run_step(step: str, out: Path, *, small: bool = False) -> int:
    """Run ``step``, appending each record to ``out/results.jsonl`` as it comes.

    Returns 0 when the step finished, 1 when it raised (the error is recorded;
    the records before it stay).
    """
    if step not in _RUNNERS:
        raise ValueError(f"unknown step {step!r}; steps: {', '.join(STEPS)}")
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    status, count = "ok", 0
    try:
        for record in _RUNNERS[step](small):
            record = {"step": step, **record}
            _append(out / "results.jsonl", record)
            print(json.dumps(record, default=str), flush=True)
            count += 1
    except Exception as e:  # recorded, and the next step still runs
        status = f"error: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    line = {
        "step": step,
        "status": status,
        "records": count,
        "seconds": round(time.perf_counter() - start, 2),
    }
    _append(out / "steps.jsonl", line)
    print(json.dumps(line), flush=True)
    return 0 if status == "ok" else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=STEPS)
    parser.add_argument("--out", required=True, type=Path, help="folder for the JSON lines")
    parser.add_argument("--small", action="store_true", help="tiny shapes (a CPU test run)")
    args = parser.parse_args(argv)
    return run_step(args.step, args.out, small=args.small)


if __name__ == "__main__":
    sys.exit(main())
