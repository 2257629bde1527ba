"""The benchmark sweep: run every case, collect records, write JSON / CSV / plots.

One record per (shape, variant, pass) with: shape and flops, the median /
min / max time, TFLOP/s, the time ratio and speedup against the bf16 recipe
on the same shape and pass, XLA's static memory (peak = args + outputs +
temporaries - aliases), the compile time, and which GEMM kernel path ran
and the dot algorithm of every GEMM (from the compiled HLO, see
:mod:`fp8jax.bench.hlo`).  On GPU, ``cublaslt_fp8`` says "found" / "not found"
for the cuBLASLt FP8 GEMM custom call; elsewhere it is "n/a".

Cases that fail (out of memory, a kernel that does not apply) are recorded
with ``status="error"`` and the message; cases not run because the time
budget ran out get ``status="skipped"``.  Nothing is retried.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import logging
import math
import os
import platform
import time
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp

from fp8jax import recipes as recipes_lib
from fp8jax.bench import gemm_cases as gemm_lib
from fp8jax.bench.hlo import hlo_report
from fp8jax.bench.moe_step import bench_train_steps
from fp8jax.bench.plots import plot_results
from fp8jax.bench.timing import memory_stats, time_call

CSV_FIELDS = (
    "kind",
    "shape",
    "group",
    "m",
    "k",
    "n",
    "variant",
    "recipe",
    "impl",
    "dequant_dtype",
    "pass",
    "status",
    "median_s",
    "min_s",
    "max_s",
    "tflops",
    "time_ratio_to_bf16",
    "speedup_vs_bf16",
    "peak_bytes",
    "temp_bytes",
    "compile_s",
    "fp8_gemm",
    "cublaslt_fp8",
    "dot_algorithms",
    "kernel_path",
    "error",
)


@dataclass
class SweepConfig:
    """What to run (built from configs/bench/sweep.py by experiments/bench.py)."""

    shapes: list[gemm_lib.Shape]
    recipes: list[str] | None = None  # None: every preset
    impls: list[str] | None = None  # None: every implementation offered
    dequant_dtypes: tuple[str, ...] = ("float32", "bfloat16")
    passes: tuple[str, ...] = gemm_lib.PASSES
    dtype: str = "bfloat16"
    warmup: int = 2
    iters: int = 10
    time_budget_s: float | None = None
    moe_step: bool = True
    moe_preset: str = "tiny"
    moe_batch: int = 8
    moe_seq: int | None = None
    moe_iters: int = 5
    hlo_dump_dir: str | None = None  # optimized HLO of the first shape's cases goes here
    partial_json: str | None = None  # records so far, rewritten after every shape
    extra: dict[str, Any] = field(default_factory=dict)


def device_info() -> dict[str, Any]:
    dev = jax.devices()[0]
    return {
        "backend": jax.default_backend(),
        "device_kind": getattr(dev, "device_kind", str(dev)),
        "device_count": jax.device_count(),
        "jax_version": jax.__version__,
        "platform_version": getattr(dev.client, "platform_version", ""),
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }


def _gemm_record(shape, variant, pass_: str) -> dict[str, Any]:
    """The identifying fields of one GEMM case's record (shape, variant, pass)."""
    return {
        "kind": "gemm",
        "shape": shape.name,
        "group": shape.group,
        "m": shape.m,
        "k": shape.k,
        "n": shape.n,
        "variant": variant.name,
        "recipe": variant.recipe,
        "impl": variant.impl,
        "dequant_dtype": variant.dequant_dtype or "",
        "pass": pass_,
        "flops": shape.flops(pass_),
    }


def run_case(
    shape: gemm_lib.Shape,
    variant: gemm_lib.Variant,
    pass_: str,
    inputs: dict[str, jax.Array],
    *,
    warmup: int,
    iters: int,
    hlo_dump_dir: str | None = None,
) -> dict[str, Any]:
    """Compile, inspect and time one case; a record (status "ok" or "error")."""
    backend = jax.default_backend()
    rec = _gemm_record(shape, variant, pass_)
    try:
        fn, args = gemm_lib.build_case(variant, pass_, inputs)
        t0 = time.perf_counter()
        compiled = jax.jit(fn).lower(*args).compile()
        rec["compile_s"] = time.perf_counter() - t0
        text = compiled.as_text()
        if hlo_dump_dir:
            os.makedirs(hlo_dump_dir, exist_ok=True)
            fname = f"{shape.name}__{variant.name.replace('/', '_')}__{pass_}.hlo.txt"
            with open(os.path.join(hlo_dump_dir, fname), "w") as f:
                f.write(text)
        rec.update(hlo_report(text, backend))
        rec.update(memory_stats(compiled))
        rec.update(time_call(compiled, args, warmup=warmup, iters=iters))
        rec["tflops"] = rec["flops"] / rec["median_s"] / 1e12
        rec["status"] = "ok"
    except Exception as e:  # record and go on: one failing case must not stop a sweep
        logging.exception("case %s %s %s failed", shape.name, variant.name, pass_)
        rec["status"] = "error"
        rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    return rec


def add_bf16_ratios(records: list[dict[str, Any]]) -> None:
    """time_ratio_to_bf16 = t / t_bf16 and speedup_vs_bf16 = t_bf16 / t per (shape, pass)."""
    base = {
        (r["shape"], r["pass"]): r["median_s"]
        for r in records
        if r.get("kind") == "gemm" and r.get("recipe") == "bf16" and r.get("status") == "ok"
    }
    for r in records:
        b = base.get((r.get("shape"), r.get("pass")))
        if r.get("kind") == "gemm" and r.get("status") == "ok" and b:
            r["time_ratio_to_bf16"] = r["median_s"] / b
            r["speedup_vs_bf16"] = b / r["median_s"]


def _order_variants(variants: list[gemm_lib.Variant]) -> list[gemm_lib.Variant]:
    # bf16 first: the baseline of every ratio must exist even if the budget runs out.
    return sorted(variants, key=lambda v: (v.recipe != "bf16",))


def run_sweep(cfg: SweepConfig, log=print) -> dict[str, Any]:
    """Run every GEMM case (then the MoE train step) and return the results dict."""
    t_start = time.perf_counter()
    variants, skipped_variants = gemm_lib.backend_variants(
        cfg.recipes, cfg.impls, dequant_dtypes=cfg.dequant_dtypes
    )
    variants = _order_variants(variants)
    dtype = jnp.dtype(cfg.dtype)
    records: list[dict[str, Any]] = []

    def over_budget() -> bool:
        return cfg.time_budget_s is not None and time.perf_counter() - t_start > cfg.time_budget_s

    for i_shape, shape in enumerate(cfg.shapes):
        inputs = None if over_budget() else gemm_lib.make_inputs(shape, dtype)
        for variant in variants:
            for pass_ in cfg.passes:
                if inputs is None or over_budget():
                    records.append(
                        {
                            **_gemm_record(shape, variant, pass_),
                            "status": "skipped",
                            "error": "time budget exhausted",
                        }
                    )
                    continue
                rec = run_case(
                    shape,
                    variant,
                    pass_,
                    inputs,
                    warmup=cfg.warmup,
                    iters=cfg.iters,
                    hlo_dump_dir=cfg.hlo_dump_dir if i_shape == 0 else None,
                )
                records.append(rec)
                if rec["status"] == "ok":
                    log(
                        f"{shape.name:>22s} {variant.name:>34s} {pass_:>7s} "
                        f"{rec['median_s'] * 1e3:10.3f} ms {rec['tflops']:8.3f} TFLOP/s  "
                        f"{rec['kernel_path']}"
                    )
                else:
                    log(f"{shape.name:>22s} {variant.name:>34s} {pass_:>7s} ERROR {rec['error']}")
        del inputs
        if cfg.partial_json:
            # A run killed by a hard timeout still leaves the finished shapes.
            os.makedirs(os.path.dirname(cfg.partial_json) or ".", exist_ok=True)
            with open(cfg.partial_json, "w") as f:
                json.dump(
                    {"device": device_info(), "partial": True, "records": records},
                    f,
                    default=_json_default,
                )
    add_bf16_ratios(records)

    moe_note = "not requested"
    if cfg.moe_step:
        moe_records, moe_note = bench_train_steps(
            cfg.recipes or list(recipes_lib.PRESETS),
            preset=cfg.moe_preset,
            batch=cfg.moe_batch,
            seq=cfg.moe_seq,
            warmup=max(1, cfg.warmup),
            iters=cfg.moe_iters,
            over_budget=over_budget,
            log=log,
        )
        records += moe_records
        log(f"MoE train step: {moe_note}")

    return {
        "device": device_info(),
        "config": _config_json(cfg),
        "skipped_variants": skipped_variants,
        "moe_step": moe_note,
        "wall_s": time.perf_counter() - t_start,
        "records": records,
    }


def _config_json(cfg: SweepConfig) -> dict[str, Any]:
    d = dataclasses.asdict(cfg)
    d["shapes"] = [dataclasses.asdict(s) for s in cfg.shapes]
    return d


# --------------------------------------------------------------------------
# Output files
# --------------------------------------------------------------------------


def _json_default(o):
    if hasattr(o, "item"):
        return o.item()
    return str(o)


def write_results(results: dict[str, Any], out_dir: str, *, plots: bool = True) -> dict[str, str]:
    """results.json, results.csv and the PNG plots into ``out_dir``; returns the paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {
        "json": os.path.join(out_dir, "results.json"),
        "csv": os.path.join(out_dir, "results.csv"),
    }
    with open(paths["json"], "w") as f:
        json.dump(results, f, indent=1, default=_json_default, allow_nan=False)
    with open(paths["csv"], "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        wr.writeheader()
        for r in results["records"]:
            wr.writerow({k: _csv_value(r.get(k, "")) for k in CSV_FIELDS})
    if plots:
        paths.update(plot_results(results, out_dir))
    return paths


def _csv_value(v):
    if isinstance(v, float):
        if not math.isfinite(v):
            return ""
        return f"{v:.6g}"
    return v


def summary_table(results: dict[str, Any], pass_: str = "fwd_bwd") -> str:
    """Markdown table: speedup vs bf16 (bf16 time / time) per shape and variant."""
    recs = [
        r
        for r in results["records"]
        if r.get("kind") == "gemm" and r.get("pass") == pass_ and r.get("status") == "ok"
    ]
    if not recs:
        return "(no GEMM records)"
    shapes = list(dict.fromkeys(r["shape"] for r in recs))
    variants = list(dict.fromkeys(r["variant"] for r in recs))
    cell = {(r["shape"], r["variant"]): r.get("speedup_vs_bf16") for r in recs}
    lines = ["| variant | " + " | ".join(shapes) + " |", "|---" * (len(shapes) + 1) + "|"]
    for v in variants:
        vals = [cell.get((s, v)) for s in shapes]
        lines.append(f"| {v} | " + " | ".join("" if x is None else f"{x:.2f}" for x in vals) + " |")
    return "\n".join(lines)
