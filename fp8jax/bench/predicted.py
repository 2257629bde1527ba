"""What the accelerators' compilers predict for fp8jax's programs, as ratios to bf16.

Every case is compiled deviceless (:mod:`fp8jax.bench.compilers`) for each
target and compared with the same program on the standard ops
(``lax.dot_general`` / ``lax.ragged_dot`` with bfloat16 inputs and output,
whose VJP is bfloat16 GEMMs too; GPU and TPU GEMMs accumulate them in
float32) compiled for the same target:

* ``gemm``: fwd+bwd of one ``fp8jax.dot_general`` (x (M, K) @ w (K, N),
  bfloat16 inputs, the cotangent the output itself) per recipe x impl;
* ``grouped``: fwd+bwd of one ``fp8jax.ragged_dot`` over E equal groups;
* ``moe_step``: one train step of the MoE model (forward, backward, AdamW).

With ``reference=True`` a ``gemm`` case also holds the compiler's own FP8
GEMMs (recipe :data:`FP8_OPERANDS`): the three GEMMs of the fwd+bwd as
``lax.dot_general`` on E4M3 operands that are already FP8 (no scales, no
quantization), float32 accumulation, bfloat16 out.  Its ratio is what the
target's cost model credits FP8 matrix units with: the floor of any FP8
recipe's GEMMs there (libtpu prices tpu7x's E4M3 dot as its bfloat16 one).

Each record holds the census (GEMM kernels, fusions, loops, temporaries,
HBM bytes, predicted time) and ``ratio``: predicted time / the bf16 twin's.
On a GPU target ``non_gemm_vs_bf16_gemms`` is the predicted time of every
kernel but the GEMMs over the bf16 GEMMs' time at the card's BF16 peak.
These are compiler predictions, not measurements.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

import fp8jax
from fp8jax import path_record, registry
from fp8jax.bench import compilers
from fp8jax.bench.gemm_cases import Shape, parse_shape

_MM = (((1,), (0,)), ((), ()))
#: The recipe name of the compiler's own FP8 GEMMs in a ``gemm`` case.
FP8_OPERANDS = "e4m3 operands"


def _recipe(name: str, impl: str):
    """The preset ``name`` with ``impl`` ("auto" keeps the preset's own), or None for "bf16"."""
    if name == "bf16":
        return None
    r = registry.get(name)
    return r if impl == "auto" else dataclasses.replace(r, impl=impl)


def gemm_program(recipe) -> Callable:
    """fwd+bwd of x @ w: fp8jax.dot_general under ``recipe``, or bf16 lax.dot_general (None)."""

    def f(x, w):
        if recipe is None:
            # bf16 in and out, as a bf16 model calls it: its VJP is bf16 GEMMs too.
            # (A float32 output cast to bf16 would make the backward dot float32
            # operands: TF32 GEMMs behind converts on a GPU, not a bf16 baseline.)
            return lax.dot_general(x, w, _MM)
        return fp8jax.dot_general(x, w, _MM, recipe=recipe)

    return _fwd_bwd(f)


def fp8_operand_gemms(x8: jax.Array, w8: jax.Array, dy8: jax.Array):
    """Fprop, Dgrad and Wgrad of x @ w as XLA's own dots on FP8 operands: (y, dx, dw).

    x8 (M, K), w8 (K, N), dy8 (M, N), all E4M3; float32 accumulation,
    bfloat16 results, as the bf16 baseline writes them.  The compiler picks
    each dot's kernel and any transposes its FP8 GEMMs need.
    """

    def mm(a, b, contract):
        dims = (contract, ((), ()))
        return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)

    y = mm(x8, w8, ((1,), (0,)))
    dx = mm(dy8, w8, ((1,), (1,)))
    dw = mm(x8, dy8, ((0,), (0,)))
    return tuple(t.astype(jnp.bfloat16) for t in (y, dx, dw))


def grouped_program(recipe, experts: int) -> Callable:
    """fwd+bwd of a ragged_dot over ``experts`` equal groups (fp8jax's, or lax's for None)."""

    def f(x, w):
        sizes = jnp.full((experts,), x.shape[0] // experts, jnp.int32)
        if recipe is None:
            # bf16 in and out, like the dense baseline above.
            return lax.ragged_dot(x, w, sizes)
        return fp8jax.ragged_dot(x, w, sizes, recipe=recipe)

    return _fwd_bwd(f)


def _fwd_bwd(f: Callable) -> Callable:
    """Forward and backward of ``f(x, w)``, the output itself its cotangent."""

    def fwd_bwd(x, w):
        y, vjp = jax.vjp(f, x, w)
        return vjp(y)

    return fwd_bwd


def _record(case: str, recipe: str, impl: str, census, paths: dict | None) -> dict[str, Any]:
    rec = {"case": case, "recipe": recipe, "impl": impl, **census.as_dict()}
    if paths:
        rec["paths"] = paths
    return rec


def _compile_case(fn: Callable, args: Sequence[Any], target: compilers.Target):
    with path_record.recording(target.platform) as paths:
        c = compilers.compile_for(fn, args, target)
    return compilers.census(c), path_record.as_table(paths)


def gemm_case(
    shape: Shape,
    recipes: Sequence[str],
    impls: Sequence[str],
    target: compilers.Target,
    *,
    reference: bool = False,
) -> list[dict[str, Any]]:
    """Records of one dense shape: bf16 first, then every recipe x impl (see module doc);
    ``reference``: then the compiler's own FP8 GEMMs (:func:`fp8_operand_gemms`)."""
    x = jax.ShapeDtypeStruct((shape.m, shape.k), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((shape.k, shape.n), jnp.bfloat16)
    case = f"gemm {shape.m}x{shape.k}x{shape.n}"
    out = [_one(case, "bf16", "lax", gemm_program(None), (x, w), target)]
    if reference:
        e4m3 = jnp.float8_e4m3fn
        fp8_args = [
            jax.ShapeDtypeStruct(dims, e4m3)
            for dims in ((shape.m, shape.k), (shape.k, shape.n), (shape.m, shape.n))
        ]
        out.append(_one(case, FP8_OPERANDS, "lax", fp8_operand_gemms, fp8_args, target))
    for name in recipes:
        for impl in impls:
            out.append(_one(case, name, impl, gemm_program(_recipe(name, impl)), (x, w), target))
    return _ratios(out)


def grouped_case(
    experts: int,
    rows: int,
    k: int,
    n: int,
    recipes: Sequence[str],
    impls: Sequence[str],
    target: compilers.Target,
) -> list[dict[str, Any]]:
    """Records of one grouped expert GEMM (``experts`` groups of ``rows`` tokens)."""
    x = jax.ShapeDtypeStruct((experts * rows, k), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((experts, k, n), jnp.bfloat16)
    case = f"ragged_dot {experts}x{rows}x{k}x{n}"
    out = [_one(case, "bf16", "lax", grouped_program(None, experts), (x, w), target)]
    for name in recipes:
        for impl in impls:
            prog = grouped_program(_recipe(name, impl), experts)
            out.append(_one(case, name, impl, prog, (x, w), target))
    return _ratios(out)


def moe_step_case(
    preset: str, batch: int, recipes: Sequence[str], target: compilers.Target
) -> list[dict[str, Any]]:
    """Records of one MoE train step (the model preset, ``batch`` sequences) per recipe."""
    from fp8jax.bench.moe_step import model_config, train_step_program

    cfg = model_config(preset)
    case = f"moe_step {preset} batch {batch}"
    out = []
    for name in ("bf16", *recipes):
        step, args = train_step_program(cfg, registry.get(name), batch)
        out.append(_one(case, name, "auto" if name != "bf16" else "lax", step, args, target))
    return _ratios(out)


def _one(case, recipe, impl, fn, args, target) -> dict[str, Any]:
    try:
        census, paths = _compile_case(fn, args, target)
    except Exception as e:  # noqa: BLE001 -- a case that does not compile is a result
        line = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return {
            "case": case,
            "recipe": recipe,
            "impl": impl,
            "target": target.name,
            "error": line[:300],
        }
    return _record(case, recipe, impl, census, paths)


def _ratios(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each record's predicted time and bytes over the first (bf16) record's."""
    base = records[0]
    for r in records:
        if "error" in r or "error" in base:
            continue
        if r["total_us"] is not None and base["total_us"]:
            r["ratio"] = r["total_us"] / base["total_us"]
        r["bytes_ratio"] = r["hbm_bytes"] / base["hbm_bytes"] if base["hbm_bytes"] else None
        r["compile_ratio"] = r["compile_seconds"] / base["compile_seconds"]
        bf16_gemms = compilers.bf16_gemm_us(base["gemm_flops"], r["target"])
        if bf16_gemms and r["other_us"] is not None:
            r["non_gemm_vs_bf16_gemms"] = r["other_us"] / bf16_gemms
    return records


def table(records: Sequence[dict[str, Any]]) -> str:
    """One line per record: kernels, loops, temporaries, bytes, predicted time and ratios,
    and the seconds to trace, lower and compile it with their ratio to bf16's (the same
    run, the same process)."""
    head = (
        f"{'target':7s} {'case':28s} {'recipe':16s} {'impl':8s} {'GEMM kernels':30s} "
        f"{'fus':>4s} {'loops':>5s} {'temp MiB':>8s} {'HBM MB':>8s} {'pred us':>8s} "
        f"{'x bf16':>6s} {'bytes':>5s} {'nonGEMM':>7s} {'compile s':>9s} {'x bf16':>6s}"
    )
    lines = [head]
    for r in records:
        if "error" in r:
            lines.append(
                f"{r['target']:7s} {r['case']:28s} {r['recipe']:16s} {r['impl']:8s} "
                f"error: {r['error'][:120]}"
            )
            continue
        kernels = ", ".join(f"{n} {k}" for k, n in sorted(r["gemm_kernels"].items())) or "-"
        loops = sum(1 for loop in r["loops"] if loop["gemms"])

        def f(v, fmt):
            return format(v, fmt) if v is not None else "-"

        lines.append(
            f"{r['target']:7s} {r['case']:28s} {r['recipe']:16s} {r['impl']:8s} {kernels:30s} "
            f"{r['fusions']:4d} {loops:5d} {r['temp_bytes'] / 2**20:8.1f} "
            f"{r['hbm_bytes'] / 1e6:8.1f} {f(r['total_us'], '8.1f')} "
            f"{f(r.get('ratio'), '6.2f')} {f(r.get('bytes_ratio'), '5.2f')} "
            f"{f(r.get('non_gemm_vs_bf16_gemms'), '7.2f')} {r['compile_seconds']:9.1f} "
            f"{f(r.get('compile_ratio'), '6.2f')}"
        )
    return "\n".join(lines)


def parse_shapes(text: str) -> list[Shape]:
    """'MxKxN,MxKxN' -> shapes (see :func:`fp8jax.bench.gemm_cases.parse_shape`)."""
    return [parse_shape(s) for s in text.split(",") if s.strip()]


def cpu_compile_ratio(preset: str, batch: int, recipe: str) -> dict[str, float]:
    """Seconds to trace, lower and compile the train step on this CPU: ``recipe`` and bf16.

    ``out[name]`` is the whole; ``out[f"{name} trace"]``, ``... lower"``,
    ``... compile"`` its phases; ``out[f"{name} fusions"]`` the kernels XLA
    made and ``... distinct kernels"``, ``... distinct instructions"``,
    ``... quantizer kernels"``, ``... quantizer instructions"`` what it built
    for them (:func:`fp8jax.bench.compilers.kernel_census`); ``out["ratio"]``
    is recipe / bf16.  bf16 goes first, so it pays the process's first-trace
    costs.
    """
    from fp8jax.bench.moe_step import model_config, train_step_program

    cfg = model_config(preset)
    out = {}
    for name in ("bf16", recipe):
        step, args = train_step_program(cfg, registry.get(name), batch)
        start = time.perf_counter()
        traced = jax.jit(step).trace(*args)
        t_trace = time.perf_counter()
        lowered = traced.lower()
        t_lower = time.perf_counter()
        compiled = lowered.compile()
        end = time.perf_counter()
        out[name] = end - start
        out[f"{name} trace"] = t_trace - start
        out[f"{name} lower"] = t_lower - t_trace
        out[f"{name} compile"] = end - t_lower
        # The fusions, and the distinct kernels XLA builds for them.
        for k, v in compilers.kernel_census(compiled.as_text()).items():
            out[f"{name} {k}"] = v
    out["ratio"] = out[recipe] / out["bf16"]
    return out


# A round's child process: one cpu_compile_ratio, its dict the last line printed.
_ROUND = """
import json, sys
import jax
jax.config.update("jax_enable_compilation_cache", False)
from fp8jax.bench import predicted
print(json.dumps(predicted.cpu_compile_ratio(sys.argv[1], int(sys.argv[2]), sys.argv[3])))
"""


def cpu_compile_rounds(
    preset: str, batch: int, recipe: str, rounds: int, log: Callable[[str], None] = print
) -> dict[str, Any]:
    """:func:`cpu_compile_ratio` in ``rounds`` fresh processes, one after another.

    Each round is a new Python process on the CPU backend with jax's
    persistent compilation cache off, so no round reuses another's traces,
    lowerings or executables, and each pays the first-trace costs a user's
    first run pays.  Within a round bf16 and ``recipe`` are compiled back to
    back, so a change in the machine's load between rounds moves both;
    the rounds' spread is the measurement's.  Returns :func:`summarize_rounds`.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    done = []
    for i in range(rounds):
        run = subprocess.run(
            [sys.executable, "-c", _ROUND, preset, str(batch), recipe],
            env=env,
            capture_output=True,
            text=True,
        )
        if run.returncode != 0:
            tail = (run.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise RuntimeError(f"CPU compile round {i + 1} of {rounds} failed: {tail}")
        last = (run.stdout.strip().splitlines() or [""])[-1]
        try:
            done.append(json.loads(last))
        except json.JSONDecodeError:
            raise RuntimeError(
                f"CPU compile round {i + 1} of {rounds} printed no result: {last[:200]!r}"
            ) from None
        log(f"  CPU compile round {i + 1}/{rounds}: ratio {done[-1]['ratio']:.2f}")
    return summarize_rounds(done)


def summarize_rounds(rounds: Sequence[dict[str, float]]) -> dict[str, Any]:
    """Per field the median over the rounds, ``"ratio min"`` / ``"ratio max"`` their
    extremes, and ``"rounds"`` the rounds themselves (each a :func:`cpu_compile_ratio`)."""
    if not rounds:
        raise ValueError("no rounds to summarize")
    out: dict[str, Any] = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    ratios = [r["ratio"] for r in rounds]
    out["ratio min"], out["ratio max"] = min(ratios), max(ratios)
    out["rounds"] = list(rounds)
    return out
