r"""Where a train step's bytes go, deepseek_v3 vs bf16: autodiff residuals and XLA's compiled peak.

    python experiments/bench_memory.py --compile      # seq 2048, 8 layers, batch 2 (~3 min)
    python experiments/bench_memory.py --seq=512 --layers=2 --batch=8

The default is a setting where activations dominate a step's memory (long
sequences, several layers, d_model 256): 4096 tokens per step through 8
blocks (one dense, seven MoE), attention in blocks of 512 queries.

Per recipe: the bytes kept from forward to backward (the VJP's residuals,
``fp8jax.bench.residuals``) in total and per dtype, the largest sources by
line of code, and with ``--compile`` XLA's compiled temporaries and peak for
the whole train step on one device (minutes per recipe on a CPU), each with
its ratio to the first recipe.
"""

from __future__ import annotations

import jax
import numpy as np
from absl import app, flags
from flax import nnx

from fp8jax import registry
from fp8jax.bench.parallel import ParallelBench, bench_model, build_step
from fp8jax.bench.residuals import residual_summary, saved_residuals
from fp8jax.bench.timing import memory_stats
from fp8jax.models import ModelConfig, MoETransformer, loss_fn
from fp8jax.parallel.mesh import make_mesh

_SEQ = flags.DEFINE_integer("seq", 2048, "sequence length")
_LAYERS = flags.DEFINE_integer("layers", 8, "transformer blocks (the first is dense)")
_BATCH = flags.DEFINE_integer("batch", 2, "sequences per step")
_DMODEL = flags.DEFINE_integer("d_model", 256, "model width")
_RECIPES = flags.DEFINE_list("recipes", ["bf16", "deepseek_v3"], "presets; the first is the base")
_TOP = flags.DEFINE_integer("top", 8, "largest residual sources shown per recipe")
_COMPILE = flags.DEFINE_bool("compile", False, "also compile the train step for XLA's peak")

MiB = 2**20


def main(argv):
    del argv
    model = bench_model(_DMODEL.value, _LAYERS.value)
    cfg = ModelConfig.tiny(**model, max_seq_len=max(_SEQ.value, 128))
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (_BATCH.value, _SEQ.value))
    tokens = tokens.astype(np.int32)
    print(f"model {model}, batch {_BATCH.value} x {_SEQ.value}, one device")
    rows = {}
    for name in _RECIPES.value:
        m = MoETransformer(cfg, registry.get(name), rngs=nnx.Rngs(0), telemetry=False)
        graph, params, rest = nnx.split(m, nnx.Param, ...)
        s = residual_summary(
            saved_residuals(
                lambda p, g=graph, r=rest: loss_fn(nnx.merge(g, p, r), tokens)[0], params
            ),
            top=_TOP.value,
        )
        if _COMPILE.value:
            bench = ParallelBench(model=model, batch=_BATCH.value, seq=_SEQ.value, mesh=(1, 1, 1))
            mesh = make_mesh(bench.mesh)
            _, step, state, batch = build_step(registry.get(name), bench, mesh)
            with jax.set_mesh(mesh):
                s.update(memory_stats(step.lower(state, batch).compile()))
        rows[name] = s
        print(
            f"\n## {name}: residuals {s['total_bytes'] / MiB:,.1f} MiB; by dtype: "
            + ", ".join(f"{k} {v / MiB:,.1f}" for k, v in s["by_dtype"].items())
        )
        for src, b in s["top_sources"]:
            print(f"  {b / MiB:8.1f} MiB  {src}")
    base = rows[_RECIPES.value[0]]
    keys = [("total_bytes", "residuals")]
    if _COMPILE.value:
        keys += [("temp_bytes", "compiled temporaries"), ("peak_bytes", "compiled peak")]
    print(f"\n| MiB | {' | '.join(rows)} | ratio to {_RECIPES.value[0]} |")
    print("|---|" + "---|" * (len(rows) + 1))
    for k, label in keys:
        vals = [rows[n][k] for n in rows]
        ratios = ", ".join(f"{v / base[k]:.3f}" for v in vals[1:])
        print(f"| {label} | " + " | ".join(f"{v / MiB:,.1f}" for v in vals) + f" | {ratios} |")


if __name__ == "__main__":
    app.run(main)
