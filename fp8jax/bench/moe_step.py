"""Train-step time, tokens/s and compiled memory of the MoE model, per recipe.

The step is ``fp8jax.train.step.make_train_step``'s (forward, backward, AdamW,
FP8-state overwrite, router-bias update) with its state donated, exactly as in
training; each timed call feeds the state the previous call returned.  Tokens
are uniform random ids: the time of a step does not depend on the data.  All
rows are compiled first, then timed round-robin
(:func:`fp8jax.bench.timing.time_calls`), so a change in machine load hits
every recipe alike and the ratios to bf16 stay meaningful.

A row is a spec ``name[:dequant_dtype][@notel]``: a recipe preset, optionally
with the XLA path's dequantization dtype replaced (``deepseek_v3:bfloat16``),
and ``@notel`` to switch the model's FP8 telemetry off for that row (to
measure what telemetry costs).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from fp8jax import recipes as recipes_lib
from fp8jax import registry
from fp8jax.bench.hlo import hlo_report
from fp8jax.bench.timing import memory_stats, time_calls
from fp8jax.models import ModelConfig, MoETransformer, loss_fn, update_router_bias
from fp8jax.train.optimizer import make_optimizer
from fp8jax.train.state import create_train_state
from fp8jax.train.step import make_train_step

PRESETS = ("tiny", "small")


def parse_spec(spec: str) -> tuple[recipes_lib.Recipe, bool]:
    """``name[:dequant_dtype][@notel]`` -> (recipe, telemetry on)."""
    body, _, flag = spec.partition("@")
    if flag not in ("", "notel"):
        raise ValueError(f"row {spec!r}: the only suffix is '@notel', got '@{flag}'")
    name, _, deq = body.partition(":")
    recipe = registry.get(name)
    if deq:
        recipe = dataclasses.replace(recipe, dequant_dtype=deq)
    return recipe, not flag


def model_config(preset: str, attention: str | None = None) -> ModelConfig:
    """ModelConfig.<preset>() (tiny or small), optionally with another attention type."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; known: {PRESETS}")
    cfg = getattr(ModelConfig, preset)()
    return cfg.replace(attention=attention) if attention else cfg


class _Stepper:
    """A compiled, donating train step that keeps its own state between calls."""

    def __init__(self, compiled, state):
        self.compiled = compiled
        self.state = state

    def __call__(self, tokens: jax.Array) -> jax.Array:
        self.state, metrics = self.compiled(self.state, tokens)
        return metrics["loss"]


def train_step_program(
    cfg: ModelConfig,
    recipe: recipes_lib.Recipe,
    batch: int,
    *,
    telemetry: bool = True,
    tokens: jax.Array | None = None,
):
    """(the jitted, donating train step, (its state, a batch of tokens)) for one recipe.

    The step is what training runs (forward, backward, AdamW, FP8-state
    overwrite, router-bias update); tokens default to ``batch`` rows of
    uniform random ids of the model's length.
    """
    model = MoETransformer(cfg, recipe, rngs=nnx.Rngs(0), telemetry=telemetry)
    tx, _ = make_optimizer(peak_lr=1e-3, total_steps=1000, warmup_steps=10)
    graphdef, state = create_train_state(model, tx)
    step = make_train_step(
        graphdef,
        tx,
        loss_fn,
        bias_rate=cfg.bias_update_rate,
        update_bias_fn=update_router_bias,
        donate=True,
    )
    if tokens is None:
        shape = (batch, cfg.max_seq_len)
        tokens = jax.random.randint(jax.random.key(0), shape, 0, cfg.vocab_size, jnp.int32)
    return step, (state, tokens)


def _compile_row(cfg: ModelConfig, spec: str, tokens: jax.Array) -> tuple[_Stepper, dict]:
    """Build the model and train state of one row and compile its step."""
    recipe, telemetry = parse_spec(spec)
    step, (state, tokens) = train_step_program(
        cfg, recipe, tokens.shape[0], telemetry=telemetry, tokens=tokens
    )
    t0 = time.perf_counter()
    compiled = step.lower(state, tokens).compile()
    info: dict[str, Any] = {"compile_s": time.perf_counter() - t0}
    info.update(memory_stats(compiled))
    info.update(hlo_report(compiled.as_text(), jax.default_backend()))
    return _Stepper(compiled, state), info


def bench_train_steps(
    specs: Sequence[str],
    *,
    preset: str = "tiny",
    attention: str | None = None,
    batch: int = 8,
    seq: int | None = None,
    warmup: int = 1,
    iters: int = 5,
    over_budget: Callable[[], bool] = lambda: False,
    log: Callable[[str], None] = print,
) -> tuple[list[dict[str, Any]], str]:
    """One record per row: step time (median of ``iters``), tokens/s, memory, compile time.

    Rows that fail to build are recorded with ``status="error"``; rows not
    built because ``over_budget()`` turned true get ``status="skipped"``.
    Returns (records, a line saying what ran).  Ratios are against the first
    row whose spec is ``bf16``.
    """
    cfg = model_config(preset, attention)
    t = min(seq or cfg.max_seq_len, cfg.max_seq_len)
    if t < 2:
        raise ValueError(f"seq must be >= 2 (next-token loss), got {t}")
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    # loss_fn predicts tokens[:, 1:] from tokens[:, :-1] inside one [B, T] row.
    tokens = jax.random.randint(jax.random.key(0), (batch, t), 0, cfg.vocab_size, jnp.int32)
    shape = f"moe_{preset}_b{batch}_t{t}"
    records: list[dict[str, Any]] = []
    steppers: dict[str, _Stepper] = {}
    for spec in specs:
        rec: dict[str, Any] = {
            "kind": "moe_step",
            "shape": shape,
            "group": "moe_step",
            "variant": spec,
            "recipe": spec.partition("@")[0].partition(":")[0],
            "impl": "auto",
            "pass": "train_step",
            # Predicted tokens per step (as the training loop counts them).
            "tokens": batch * (t - 1),
        }
        records.append(rec)
        if over_budget():
            rec.update(status="skipped", error="time budget exhausted")
            continue
        try:
            steppers[spec], info = _compile_row(cfg, spec, tokens)
            rec.update(info)
        except Exception as e:  # record and go on: one failing row must not stop the others
            logging.exception("MoE step %s failed", spec)
            rec["status"] = "error"
            rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            log(f"{shape:>22s} {spec:>34s} train_step ERROR {rec['error']}")
    times = time_calls(
        {spec: (fn, (tokens,)) for spec, fn in steppers.items()}, warmup=warmup, iters=iters
    )
    for rec in records:
        if rec["variant"] in times:
            rec.update(times[rec["variant"]])
            rec["tokens_per_s"] = rec["tokens"] / rec["median_s"]
            rec["status"] = "ok"
            log(
                f"{shape:>22s} {rec['variant']:>34s} train_step "
                f"{rec['median_s'] * 1e3:10.2f} ms {rec['tokens_per_s']:10.0f} tok/s"
            )
    base = next((r for r in records if r["variant"] == "bf16" and r["status"] == "ok"), None)
    for r in records:
        if base is not None and r["status"] == "ok":
            r["time_ratio_to_bf16"] = r["median_s"] / base["median_s"]
            r["speedup_vs_bf16"] = base["median_s"] / r["median_s"]
            if r.get("peak_bytes") and base.get("peak_bytes"):
                r["peak_ratio_to_bf16"] = r["peak_bytes"] / base["peak_bytes"]
    note = (
        f"ModelConfig.{preset}() attention={cfg.attention} "
        f"({cfg.param_count() / 1e6:.2f}M parameters), batch {batch} x {t} tokens, "
        f"fp8jax.train.step.make_train_step"
    )
    return records, note


def step_table(records: Sequence[dict[str, Any]]) -> str:
    """Markdown table of train-step records (time, tokens/s, ratios, memory, compile time)."""
    if not records:
        return "(no MoE train-step records)"
    lines = [
        "| row | step [ms] | tokens/s | time / bf16 | peak MiB | peak / bf16 | compile s | status |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        if r.get("status") != "ok":
            lines.append(
                f"| {r['variant']} | | | | | | | {r.get('status')}: {r.get('error', '')} |"
            )
            continue
        peak = r.get("peak_bytes")
        ratio = r.get("time_ratio_to_bf16")
        pratio = r.get("peak_ratio_to_bf16")
        lines.append(
            f"| {r['variant']} | {r['median_s'] * 1e3:.1f} | {r['tokens_per_s']:.0f} | "
            f"{'' if ratio is None else f'{ratio:.2f}'} | "
            f"{'' if peak is None else f'{peak / 2**20:.1f}'} | "
            f"{'' if pratio is None else f'{pratio:.2f}'} | {r['compile_s']:.1f} | ok |"
        )
    return "\n".join(lines)
