"""Train-step time, tokens/s and compiled peak memory of the MoE model: FP8 vs bf16.

    python experiments/bench_model.py                      # small config, batch 8 x 128
    python experiments/bench_model.py --config=tiny --steps=5

Prints, per recipe, the train-step time (median of --steps timed steps after
one warm-up, the recipes' steps interleaved), tokens/s and the step's memory from XLA's compiled memory
analysis, then the ratios deepseek_v3 / bf16 (goal: time <= 1.5x).  The step
is fp8jax.train's real one (AdamW, FP8 state replacement, router-bias update).
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx

import fp8jax
from fp8jax.models import ModelConfig, MoETransformer, loss_fn, update_router_bias
from fp8jax.train.optimizer import make_optimizer
from fp8jax.train.state import create_train_state
from fp8jax.train.step import make_train_step

_CONFIG = flags.DEFINE_enum("config", "small", ["tiny", "small"], "model size preset")
_ATTN = flags.DEFINE_enum("attention", "mha", ["mha", "mla"], "attention type")
_BATCH = flags.DEFINE_integer("batch", 8, "sequences per step")
_SEQ = flags.DEFINE_integer("seq", 0, "sequence length (0: the config's max_seq_len)")
_STEPS = flags.DEFINE_integer("steps", 5, "timed steps")
_TELEMETRY = flags.DEFINE_bool("telemetry", True, "collect FP8 telemetry in the step")
_RECIPES = flags.DEFINE_list(
    "recipes",
    ["bf16", "deepseek_v3", "deepseek_v3:bfloat16", "deepseek_v3@notel"],
    "recipe[:dequant_dtype][@notel] list (@notel: telemetry off for that row)",
)


def _recipe(spec: str) -> fp8jax.Recipe:
    name, _, deq = spec.split("@")[0].partition(":")
    r = fp8jax.recipes.get(name)
    return dataclasses.replace(r, dequant_dtype=deq) if deq else r


def _mib(n: int) -> float:
    return n / 2**20


def build(cfg: ModelConfig, spec: str, tokens: jax.Array, telemetry: bool) -> dict:
    """Model, train state and the compiled train step of one recipe row."""
    recipe = _recipe(spec)
    # "name@notel": this row without FP8 telemetry (to measure its cost).
    telemetry = telemetry and not spec.endswith("@notel")
    model = MoETransformer(cfg, recipe, rngs=nnx.Rngs(0), telemetry=telemetry)
    tx, _ = make_optimizer(peak_lr=1e-3, total_steps=100, warmup_steps=10)
    graphdef, state = create_train_state(model, tx)
    step = make_train_step(
        graphdef,
        tx,
        loss_fn,
        bias_rate=cfg.bias_update_rate,
        update_bias_fn=update_router_bias,
        donate=True,
    )
    t0 = time.perf_counter()
    compiled = step.lower(state, tokens).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    state, m = compiled(state, tokens)  # warm-up
    jax.block_until_ready(m["loss"])
    temp = int(getattr(mem, "temp_size_in_bytes", 0))
    args = int(getattr(mem, "argument_size_in_bytes", 0))
    outs = int(getattr(mem, "output_size_in_bytes", 0))
    alias = int(getattr(mem, "alias_size_in_bytes", 0))
    return {
        "recipe": spec,
        "compiled": compiled,
        "state": state,
        "compile_s": compile_s,
        "temp_mib": _mib(temp),
        # Live at the peak: inputs + outputs (minus the donated, aliased ones) + scratch.
        "peak_mib": _mib(temp + args + outs - alias),
        "times": [],
    }


def time_rows(rows: list[dict], tokens: jax.Array, steps: int) -> None:
    """Round-robin timing: step i of every row runs back to back, so a change in
    machine load hits all rows alike and the ratios stay meaningful."""
    for _ in range(steps):
        for r in rows:
            t = time.perf_counter()
            r["state"], m = r["compiled"](r["state"], tokens)
            jax.block_until_ready(m["loss"])
            r["times"].append(time.perf_counter() - t)
            r["loss"] = float(m["loss"])
    for r in rows:
        r["step_s"] = statistics.median(r["times"])
        r["tokens_per_s"] = tokens.size / r["step_s"]


def main(argv):
    del argv
    cfg = ModelConfig.tiny() if _CONFIG.value == "tiny" else ModelConfig.small()
    cfg = cfg.replace(attention=_ATTN.value)
    seq = _SEQ.value or cfg.max_seq_len
    tokens = jnp.asarray(
        np.random.default_rng(0).integers(0, cfg.vocab_size, (_BATCH.value, seq)), jnp.int32
    )
    print(
        f"config={_CONFIG.value} attention={cfg.attention} params={cfg.param_count() / 1e6:.2f}M "
        f"batch={_BATCH.value}x{seq} backend={jax.default_backend()} telemetry={_TELEMETRY.value}"
    )
    rows = [build(cfg, s, tokens, _TELEMETRY.value) for s in _RECIPES.value]
    time_rows(rows, tokens, _STEPS.value)
    print(
        f"{'recipe':24s} {'step ms':>9s} {'tok/s':>9s} {'peak MiB':>9s} {'temp MiB':>9s} {'compile s':>9s}"
    )
    for r in rows:
        print(
            f"{r['recipe']:24s} {r['step_s'] * 1e3:9.1f} {r['tokens_per_s']:9.0f} "
            f"{r['peak_mib']:9.1f} {r['temp_mib']:9.1f} {r['compile_s']:9.1f}"
        )
    base = next((r for r in rows if r["recipe"] == "bf16"), None)
    if base is not None:
        for r in rows:
            if r is base:
                continue
            print(
                f"{r['recipe']} / bf16: step time {r['step_s'] / base['step_s']:.2f}x "
                f"(goal <= 1.5x), tokens/s {r['tokens_per_s'] / base['tokens_per_s']:.2f}x, "
                f"peak memory {r['peak_mib'] / base['peak_mib']:.2f}x"
            )


if __name__ == "__main__":
    app.run(main)
