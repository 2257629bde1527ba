"""The benchmarks ``experiments/bench.py`` runs, one function per ``config.benchmark``.

Each takes the benchmark's config (configs/bench/<name>.py: every field with its
meaning) and an optional output directory, prints its report and, given the
directory, writes what it measured there (``results.json``; the sweep also CSV and
PNGs).  ``BENCHMARKS`` maps the config's ``benchmark`` field to the function;
:func:`checked_benchmark` returns it once every field is checked
(:mod:`fp8jax.bench.bench_fields`: types, ranges, names, memory).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    # Type hints only: the sweep also runs where ml_collections is not installed
    # (its config then a fp8jax.bench.config_file.FieldDict).
    import ml_collections

from fp8jax.bench.bench_fields import FIELDS, FOOTPRINTS
from fp8jax.train.fields import ConfigError, check_allocation, check_fields, choice, items

MiB = 2**20


class BenchConfigError(ConfigError):
    """A config value the benchmark cannot run with (the message names the field)."""


def _write_json(out_dir: str | None, record: dict) -> None:
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, "results.json")
        with open(path, "w") as f:
            json.dump(record, f, indent=1, default=str)
            f.write("\n")
        print("wrote", path)


def core(c: ml_collections.ConfigDict, out_dir: str | None) -> None:
    """Tile-quantize / astype(bf16), fwd+bwd of each XLA GEMM path / bf16, residual bytes."""
    import jax

    from fp8jax import gemm, host_cpu
    from fp8jax.bench.core import GEMM_VARIANTS, gemm_ratio, quantize_ratio

    print(f"backend: {jax.default_backend()} ({jax.devices()[0].device_kind})")
    rows, size, iters = int(c.quant_rows), int(c.size), int(c.iters)
    q = quantize_ratio(rows, rows, iters=2 * iters)
    print(
        f"tile quantize / astype(bf16) [{rows}x{rows}]: {q['ratio']:.2f}x  "
        f"({q['t_tile_quantize_s'] * 1e3:.1f} ms vs {q['t_astype_bf16_s'] * 1e3:.1f} ms; "
        "goal <= 1.2x)"
    )
    g = gemm_ratio(size, iters=iters)
    print(
        f"fwd+bwd at {size}^3 on {g['backend']} (median of {iters}, "
        "timed round-robin; goal <= 1.2x bf16):"
    )
    for name in GEMM_VARIANTS:
        print(
            f"  {name:24s} {g[f't_{name}_s'] * 1e3:8.1f} ms  {g[f'ratio_{name}']:5.2f}x  "
            f"[{g[f'dot_algorithms_{name}']}]"
        )
    if jax.default_backend() == "cpu":
        bf16_dot = {True: "yes", False: "no", None: "unknown"}[host_cpu.has_bf16_dot()]
        print(
            f'  "auto" runs {gemm.auto_impl("fp8", "cpu")} on this CPU '
            f"(bfloat16 dot instructions: {bf16_dot})"
        )
    print(
        f"residual bytes deepseek_v3 / bf16: {g['residual_ratio']:.3f} "
        f"({g['residual_bytes_deepseek_v3']} / {g['residual_bytes_bf16']}; goal <= 0.55)"
    )
    _write_json(out_dir, {"quantize": q, "gemm": g, "size": size})


def kernels(c: ml_collections.ConfigDict, out_dir: str | None) -> None:
    """TFLOP/s of the block-scaled Pallas kernels vs BF16 and per-tensor FP8 (XLA/cuBLASLt)."""
    import jax

    from fp8jax.bench import gemm_cases, kernel
    from fp8jax.kernels import kernel_available

    on_gpu = kernel_available()
    small = (not on_gpu) if c.size == "auto" else c.size == "small"
    header = {
        "backend": jax.default_backend(),
        "device_kind": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "kernel_available": on_gpu,
        "small": small,
    }
    notes = []
    if not on_gpu:
        notes.append(
            "no Hopper GPU: the Pallas kernel runs only in interpret mode on one tiny shape "
            "(not a performance number)"
        )
    print(json.dumps(header))
    size = 256 if small else 4096
    cublas = kernel.cublaslt_fp8_compiles(size, size, size)
    print(f"per-tensor FP8 pattern compiled to a cuBLASLt FP8 GEMM: {cublas}")

    iters = 3 if small else int(c.iters)
    impls = list(kernel.DENSE_IMPLS if on_gpu else ("bf16", "fp8_tensor_xla", "block_xla"))
    results: list[kernel.Result] = []
    for shape in gemm_cases.kernel_shapes(small):
        results += kernel.bench_dense(shape, impls=impls, iters=iters, interpret=False)
    if not on_gpu:
        results += kernel.bench_dense(
            gemm_cases.INTERPRET_SHAPE, impls=["bf16", "pallas_nt"], iters=1, interpret=True
        )
    if c.grouped:
        for shape in gemm_cases.grouped_shapes(small):
            for layout in ("kn", "nk"):
                results += kernel.bench_grouped(
                    shape, iters=iters if on_gpu else 1, interpret=not on_gpu, b_layout=layout
                )
    if c.sweep and on_gpu:
        results += kernel.sweep_launch_params(gemm_cases.parse_shape("4096x4096x4096"), iters=iters)

    for r in results:
        tf = f"{r.tflops:9.2f}" if r.tflops is not None else "      n/a"
        ratio = f"{r.ratio_to_bf16:6.2f}x" if r.ratio_to_bf16 is not None else "     -"
        print(
            f"{r.shape:28s} {r.impl:42s} M={r.m:5d} K={r.k:5d} N={r.n:5d} {tf} TFLOP/s "
            f"{ratio}  {r.note}"
        )
    for note in notes:
        print("NOTE:", note)
    _write_json(
        out_dir,
        {
            **header,
            "cublaslt_fp8_found": cublas,
            "notes": notes,
            "results": [dataclasses.asdict(r) for r in results],
        },
    )


def memory(c: ml_collections.ConfigDict, out_dir: str | None) -> None:
    """Autodiff residuals per recipe (total, per dtype, largest sources); XLA's peak if asked."""
    import jax
    import numpy as np
    from flax import nnx

    from fp8jax import registry
    from fp8jax.bench.parallel import ParallelBench, bench_model, build_step
    from fp8jax.bench.residuals import residual_summary, saved_residuals
    from fp8jax.bench.timing import memory_stats
    from fp8jax.models import ModelConfig, MoETransformer, loss_fn
    from fp8jax.parallel.mesh import make_mesh

    names = items(c.recipes)  # at least one (bench_fields)
    seq, batch = int(c.seq), int(c.batch)
    model = bench_model(int(c.d_model), int(c.layers))
    cfg = ModelConfig.tiny(**model, max_seq_len=max(seq, 128))
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, seq)).astype(np.int32)
    print(f"model {model}, batch {batch} x {seq}, one device")
    rows = {}
    for name in names:
        m = MoETransformer(cfg, registry.get(name), rngs=nnx.Rngs(0), telemetry=False)
        graph, params, rest = nnx.split(m, nnx.Param, ...)
        s = residual_summary(
            saved_residuals(
                lambda p, g=graph, r=rest: loss_fn(nnx.merge(g, p, r), tokens)[0], params
            ),
            top=int(c.top),
        )
        if c.compile:
            bench = ParallelBench(model=model, batch=batch, seq=seq, mesh=(1, 1, 1))
            mesh = make_mesh(bench.mesh)
            _, step, state, batch_ = build_step(registry.get(name), bench, mesh)
            with jax.set_mesh(mesh):
                s.update(memory_stats(step.lower(state, batch_).compile()))
        rows[name] = s
        print(
            f"\n## {name}: residuals {s['total_bytes'] / MiB:,.1f} MiB; by dtype: "
            + ", ".join(f"{k} {v / MiB:,.1f}" for k, v in s["by_dtype"].items())
        )
        for src, b in s["top_sources"]:
            print(f"  {b / MiB:8.1f} MiB  {src}")
    base = rows[names[0]]
    keys = [("total_bytes", "residuals")]
    if c.compile:
        keys += [("temp_bytes", "compiled temporaries"), ("peak_bytes", "compiled peak")]
    print(f"\n| MiB | {' | '.join(rows)} | ratio to {names[0]} |")
    print("|---|" + "---|" * (len(rows) + 1))
    for k, label in keys:
        vals = [rows[n][k] for n in rows]
        ratios = ", ".join(f"{v / base[k]:.3f}" for v in vals[1:])
        print(f"| {label} | " + " | ".join(f"{v / MiB:,.1f}" for v in vals) + f" | {ratios} |")
    _write_json(out_dir, {"model": model, "batch": batch, "seq": seq, "recipes": rows})


def model_step(c: ml_collections.ConfigDict, out_dir: str | None) -> None:
    """Train-step time, tokens/s and compiled peak memory of the MoE model per row."""
    import jax

    from fp8jax.bench import moe_step

    rows = items(c.recipes)  # rows and preset checked (bench_fields)
    records, note = moe_step.bench_train_steps(
        rows,
        preset=str(c.preset),
        attention=str(c.attention),
        batch=int(c.batch),
        seq=int(c.seq) or None,
        warmup=1,
        iters=int(c.steps),
        log=lambda line: None,
    )
    print(f"{note}; backend {jax.default_backend()}")
    print(moe_step.step_table(records))
    _write_json(out_dir, {"note": note, "records": records})


def parallel(c: ml_collections.ConfigDict, out_dir: str | None) -> None:
    """A train step on simulated CPU devices: collective bytes, memory and time per recipe."""
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        # JAX reads the device count once, when its backend starts (after this).
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
        ).strip()
    from fp8jax.bench.parallel import ParallelBench, bench_model, compare, table

    model = bench_model(int(c.d_model), int(c.layers), int(c.experts))
    bench = ParallelBench(
        model=model,
        batch=int(c.batch),
        seq=int(c.seq),
        mesh=tuple(int(s) for s in items(c.mesh)),
        iters=int(c.iters),
    )
    print(
        f"model {model}, batch {bench.batch} x {bench.seq}, mesh (data, fsdp, expert) {bench.mesh}"
    )
    result = compare(bench)
    print(table(result))
    _write_json(out_dir, {"bench": dataclasses.asdict(bench), "result": result})


def sweep_config(c: ml_collections.ConfigDict, out_dir: str):
    """The bench.SweepConfig of a sweep config file's fields (ValueError for a bad value)."""
    from fp8jax import bench
    from fp8jax.bench import gemm_cases

    if c.shapes:
        shapes = [bench.parse_shape(s) for s in items(c.shapes)]
    else:
        shapes = gemm_cases.gemm_shapes(
            items(c.groups),
            m_tokens=int(c.m_tokens),
            expert_m=int(c.expert_m) or None,
            square_sizes=[int(s) for s in items(c.square_sizes)],
            dsv3_n=[int(n) for n in items(c.dsv3_n)] or gemm_cases.DSV3_N,
        )
    return bench.SweepConfig(
        shapes=shapes,
        recipes=items(c.recipes) or None,
        impls=items(c.impls) or None,
        dequant_dtypes=tuple(items(c.dequant_dtypes)),
        passes=tuple(items(c.passes)),
        dtype=str(c.dtype),
        warmup=int(c.warmup),
        iters=int(c.iters),
        time_budget_s=float(c.time_budget_s) or None,
        moe_step=bool(c.moe_step),
        moe_preset=str(c.moe_preset),
        moe_batch=int(c.moe_batch),
        moe_seq=int(c.moe_seq) or None,
        moe_iters=int(c.moe_iters),
        hlo_dump_dir=os.path.join(out_dir, "hlo") if c.dump_hlo else None,
        partial_json=os.path.join(out_dir, "results.partial.json"),
    )


def sweep(c: ml_collections.ConfigDict, out_dir: str | None) -> None:
    """FP8 GEMMs (recipe x implementation) on GEMM shapes and the MoE train step."""
    from fp8jax import bench
    from fp8jax.bench.moe_step import step_table

    if not out_dir:
        raise BenchConfigError("the sweep writes results.json, CSV and PNGs: give --out_dir=DIR")
    try:
        cfg = sweep_config(c, out_dir)
    except ValueError as e:
        raise BenchConfigError(str(e)) from None
    results = bench.run_sweep(cfg)
    paths = bench.write_results(results, out_dir, plots=bool(c.plots))
    if cfg.partial_json and os.path.exists(cfg.partial_json):
        os.remove(cfg.partial_json)  # superseded by results.json
    print("\nspeedup vs bf16 (t_bf16 / t), fwd+bwd:")
    print(bench.summary_table(results, "fwd_bwd"))
    print("\nspeedup vs bf16 (t_bf16 / t), fwd:")
    print(bench.summary_table(results, "fwd"))
    if results["skipped_variants"]:
        print("\nimplementations not offered here:")
        for k, v in results["skipped_variants"].items():
            print(f"  {k}: {v}")
    print(f"\nMoE train step: {results['moe_step']}")
    print(step_table([r for r in results["records"] if r.get("kind") == "moe_step"]))
    print(f"wall {results['wall_s']:.1f} s; wrote {', '.join(sorted(paths.values()))}")


def compilers(c: ml_collections.ConfigDict, out_dir: str | None) -> None:
    """The accelerators' compilers' predictions, per target x case x recipe x impl, vs bf16."""
    # Deviceless: the CUDA plugin must not look for a GPU (it fails without one,
    # and then offers no compile-only client either).  Read when JAX starts its
    # backends, which happens after this.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    from fp8jax.bench import compilers as compilers_lib
    from fp8jax.bench import predicted
    from fp8jax.train import provenance

    # Which code made these predictions: read before the run, not after it.
    git = provenance.git_state()
    targets = []
    for name in items(c.targets):
        try:
            t = compilers_lib.target(name)
        except ValueError as e:
            raise BenchConfigError(f"config.targets: {e}") from None
        why = compilers_lib.unavailable(t)
        if why:
            print(f"skipped: {why}")
            continue
        targets.append(t)
    recipes, impls = items(c.recipes), items(c.impls)
    shapes = predicted.parse_shapes(c.shapes)
    records: list[dict] = []
    for t in targets:
        print(f"== {t.name}: {t.source}")
        for shape in shapes:
            records += predicted.gemm_case(
                shape, recipes, impls, t, reference=bool(c.fp8_reference)
            )
        for spec in items(c.grouped):
            e, rows, k, n = (int(v) for v in spec.lower().split("x"))
            records += predicted.grouped_case(e, rows, k, n, recipes, impls, t)
        if c.moe_step:
            records += predicted.moe_step_case(str(c.moe_step), int(c.batch), recipes, t)
        print(predicted.table([r for r in records if r["target"] == t.name]))
    compile_times = None
    if c.cpu_compile_recipe:
        rounds = int(c.cpu_compile_rounds)
        compile_times = predicted.cpu_compile_rounds(
            str(c.cpu_compile_preset), int(c.batch), str(c.cpu_compile_recipe), rounds
        )
        print(
            f"CPU compile of the {c.cpu_compile_preset} train step, median of {rounds} "
            f"round(s), each a fresh process: {c.cpu_compile_recipe} "
            f"{compile_times[c.cpu_compile_recipe]:.1f} s, bf16 {compile_times['bf16']:.1f} s, "
            f"ratio {compile_times['ratio']:.2f} (rounds {compile_times['ratio min']:.2f}"
            f"-{compile_times['ratio max']:.2f}; goal <= 2)"
        )
        for name in ("bf16", str(c.cpu_compile_recipe)):
            phases = ", ".join(
                f"{p} {compile_times[f'{name} {p}']:.1f} s" for p in ("trace", "lower", "compile")
            )
            kernels = ", ".join(
                f"{compile_times[f'{name} {k}']:.0f} {k}"
                for k in ("distinct kernels", "distinct instructions", "quantizer kernels")
            )
            print(
                f"  {name} (medians): {phases}; "
                f"{compile_times[f'{name} fusions']:.0f} fusions ({kernels})"
            )
    print(
        "Predictions of the compilers, not measurements: GEMMs priced as a roofline "
        "(no autotuning without a device), other GPU kernels by XLA's cost model, TPU by libtpu."
    )
    _write_json(
        out_dir,
        {
            "records": records,
            "cpu_compile": compile_times,
            "git": git,
            "machine": provenance.machine(),
        },
    )


def checkpoint(c: ml_collections.ConfigDict, out_dir: str | None) -> None:
    """Checkpoint checksums' cost at save and restore on a training config's state."""
    from fp8jax.bench import checkpoint_cost
    from fp8jax.train.runtime import setup_runtime

    setup_runtime("")  # orbax's INFO lines off; no compilation cache (nothing is compiled)
    if not os.path.isfile(str(c.config)):
        raise BenchConfigError(
            f"config.config = {c.config!r} is not a file: give a training config"
        )
    repeats = int(c.repeats)
    if not 1 <= repeats <= 100:
        raise BenchConfigError(f"config.repeats = {c.repeats!r}: give 1 to 100")
    r = checkpoint_cost.measure(c.config, repeats)
    print(checkpoint_cost.report(r))
    _write_json(out_dir, r)


BENCHMARKS: dict[str, Callable[[ml_collections.ConfigDict, str | None], None]] = {
    "checkpoint": checkpoint,
    "compilers": compilers,
    "core": core,
    "kernels": kernels,
    "memory": memory,
    "model_step": model_step,
    "parallel": parallel,
    "sweep": sweep,
}


def checked_benchmark(
    c: ml_collections.ConfigDict,
) -> Callable[[ml_collections.ConfigDict, str | None], None]:
    """The benchmark ``c.benchmark`` names, once every field of ``c`` is checked.

    Raises ConfigError (one line naming the field) for an unknown benchmark, a
    field of the wrong type or range, an unknown name, or sizes whose arrays
    alone exceed the memory available.
    """
    name = choice(*BENCHMARKS)("benchmark", c.get("benchmark"))
    what = f"the {name} benchmark"
    values = check_fields(c, {"benchmark": choice(*BENCHMARKS), **FIELDS[name]}, what)
    if name in FOOTPRINTS:
        check_allocation(FOOTPRINTS[name](values), f"{what} at these sizes")
    return BENCHMARKS[name]
