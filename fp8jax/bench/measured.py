"""The programs the compilers priced (:mod:`fp8jax.bench.predicted`), run and timed here.

What :mod:`fp8jax.bench.predicted` compiles deviceless for a target is the
program this module runs on the attached device, built by the same
functions (``gemm_program``, ``grouped_program``), so a measured time sits
next to a predicted one for the same program:

* dense: fwd+bwd of ``fp8jax.dot_general`` under deepseek_v3 on "auto"
  against bf16 ``lax.dot_general``, at 4096^3 and DeepSeek-V3's K = 7168
  and N = 7168 projections;
* grouped: fwd+bwd of ``fp8jax.ragged_dot`` against ``lax.ragged_dot`` over
  8 equal groups of 512 tokens, K 7168, N 2048.

Each record holds the wall time (median of round-robin samples,
:func:`fp8jax.bench.timing.time_calls`), its ratio to the bf16 twin's, the
GEMM paths "auto" resolved (:mod:`fp8jax.path_record`), the executable's
memory, and where JAX's profiler reads the device (CUPTI on a GPU) the time
of every kernel and of every HLO operation in one call: that is where a
prediction is checked kernel by kernel.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from fp8jax import path_record, registry
from fp8jax.bench import compilers, predicted
from fp8jax.bench.timing import memory_stats, time_calls

#: Dense fwd+bwd shapes (M, K, N) of the compilers' table.
FULL_DENSE = ((4096, 4096, 4096), (4096, 7168, 2048), (4096, 2048, 7168))
SMALL_DENSE = ((256, 256, 256),)
#: Grouped (experts, rows per expert, K, N).
FULL_GROUPED = ((8, 512, 7168, 2048),)
SMALL_GROUPED = ((2, 64, 256, 128),)
#: Kernels kept per profiled line (the dearest).
TOP_KERNELS = 25


def cases(small: bool) -> list[tuple[str, Callable[[Any], Callable], tuple[jax.Array, ...]]]:
    """(case name, recipe -> fwd+bwd program, bf16 inputs) for every measured case."""
    out = []
    key = jax.random.key(0)
    for m, k, n in SMALL_DENSE if small else FULL_DENSE:
        kx, kw, key = jax.random.split(key, 3)
        # Unit-variance x and w scaled by 1/sqrt(K): outputs of order one, like a layer's.
        x = jax.random.normal(kx, (m, k), jnp.bfloat16)
        w = (jax.random.normal(kw, (k, n), jnp.float32) * k**-0.5).astype(jnp.bfloat16)
        out.append((f"gemm {m}x{k}x{n}", predicted.gemm_program, (x, w)))
    for e, rows, k, n in SMALL_GROUPED if small else FULL_GROUPED:
        kx, kw, key = jax.random.split(key, 3)
        x = jax.random.normal(kx, (e * rows, k), jnp.bfloat16)
        w = (jax.random.normal(kw, (e, k, n), jnp.float32) * k**-0.5).astype(jnp.bfloat16)

        def make(recipe, e=e):
            return predicted.grouped_program(recipe, e)

        out.append((f"grouped {e}x{rows}x{k}x{n}", make, (x, w)))
    return out


def measure(
    case: str,
    make: Callable[[Any], Callable],
    args: Sequence[jax.Array],
    recipes: Sequence[str] = ("deepseek_v3",),
    *,
    iters: int = 10,
    profile: bool = True,
) -> Iterator[dict[str, Any]]:
    """Records of one case: bf16 (the standard op) first, then each recipe on "auto"."""
    compiled: dict[str, Any] = {}
    records: dict[str, dict[str, Any]] = {}
    for name in ("bf16", *recipes):
        recipe = None if name == "bf16" else registry.get(name)
        with path_record.recording() as paths:
            t0 = time.perf_counter()
            lowered = jax.jit(make(recipe)).lower(*args)
            # On a GPU, XLA's cost model annotates the executable it runs (it
            # changes no kernel), so the same census that prices the deviceless
            # compile prices the autotuned one.
            exe = lowered.compile(compiler_options=_census_options())
        records[name] = {
            "case": case,
            "recipe": name,
            "impl": "lax" if recipe is None else "auto",
            "compile_s": round(time.perf_counter() - t0, 2),
            "paths": path_record.as_table(paths),
            **memory_stats(exe),
        }
        census = _census(exe, records[name].get("temp_bytes") or 0)
        if census is not None:
            records[name]["census"] = census
        compiled[name] = exe
    times = time_calls({n: (exe, args) for n, exe in compiled.items()}, warmup=3, iters=iters)
    base = times["bf16"]["median_s"]
    for name, rec in records.items():
        rec.update(times[name])
        rec["median_us"] = round(times[name]["median_s"] * 1e6, 2)
        rec["ratio_to_bf16"] = times[name]["median_s"] / base
        if profile:
            rec["profile"] = kernel_profile(compiled[name], args)
        yield rec


def _gpu_target() -> str | None:
    """The compilers' target of the attached GPU ("h100", "h200"), None off those.

    Asks the attached device, not a lowering platform: the programs here run
    where they are compiled, and no GEMM path depends on the answer.
    """
    if jax.default_backend() != "gpu":
        return None
    kind = jax.devices()[0].device_kind.upper()
    return next((t for t in ("H200", "H100") if t in kind), None)


def _census_options() -> dict[str, Any]:
    return {"xla_gpu_collect_cost_model_stats": True} if _gpu_target() else {}


def _census(exe: Any, temp: int) -> dict[str, Any] | None:
    """The compilers' census of the executable that runs here (GPU targets only)."""
    name = _gpu_target()
    if name is None:
        return None
    try:
        c = compilers.census_of_text(exe.as_text(), compilers.target(name.lower()), temp)
    except Exception as e:  # noqa: BLE001 -- a census that fails leaves the timing
        return {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    keep = ("gemm_kernels", "fusions", "other_kernels", "gemm_us", "other_us", "total_us")
    out = {k: getattr(c, k) for k in keep}
    out.update(hbm_bytes=c.hbm_bytes, top_other=c.top_other[:12], gemm_in_loop=c.gemm_in_loop)
    return out


def kernel_profile(fn: Callable, args: Sequence[Any], calls: int = 3) -> dict[str, Any]:
    """Device time per kernel and per HLO op over ``calls`` calls, from JAX's profiler.

    ``{"lines": {line name: {"total_us": per call, "top": [[event, us per call,
    count per call], ...]}}}`` for every line of every device plane (on the
    H200, one CUDA stream's); ``{"error": ...}`` where the profiler cannot
    run, ``{"lines": {}}`` where it sees no device.  The trace is kept in
    memory (JAX's profiler object, which ``jax.profiler.start_trace`` would
    write to files).
    """
    from jax._src import profiler as jax_profiler

    try:
        jax.block_until_ready(fn(*args))
        tracer = jax_profiler._profiler.ProfilerSession()
        for _ in range(calls):
            jax.block_until_ready(fn(*args))
        data = jax.profiler.ProfileData.from_serialized_xspace(tracer.stop())
    except Exception as e:  # noqa: BLE001 -- a profiler that cannot run is a result
        return {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    lines: dict[str, Any] = {}
    for plane in data.planes:
        if not plane.name.startswith("/device:"):
            continue
        for line in plane.lines:
            per_name: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
            for ev in line.events:
                per_name[ev.name][0] += ev.duration_ns
                per_name[ev.name][1] += 1
            if not per_name:
                continue
            top = sorted(per_name.items(), key=lambda kv: -kv[1][0])[:TOP_KERNELS]
            total = sum(v[0] for v in per_name.values())
            lines[f"{plane.name} {line.name}"] = {
                "total_us": round(total / calls / 1e3, 2),
                "kernels_per_call": sum(v[1] for v in per_name.values()) / calls,
                "top": [[n, round(v[0] / calls / 1e3, 2), v[1] / calls] for n, v in top],
            }
    return {"lines": lines}
