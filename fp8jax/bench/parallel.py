"""A training step on a device mesh, FP8 vs BF16: collective bytes, peak memory, time.

For each recipe the real training step (``fp8jax.train.step``: forward,
backward, AdamW with BF16 moments) is compiled on a ("data", "fsdp",
"expert") mesh with the model's parameters, master weights and moments
sharded by :mod:`fp8jax.parallel.placement`, FSDP gathers at the top of the loss
and expert parallelism in the MoE layers.  From the compiled module:

* bytes per device of the collectives the program writes (expert dispatch,
  tokens out and their gradients back; combine; FSDP weight gathers and
  gradient reduce-scatters), in the element types it asks for, from the
  lowered module (``fp8jax.bench.hlo.lowered_collective_bytes``: XLA on CPU
  widens BF16 and FP8 collectives when it compiles, which the compiled
  module would count), and the all-reduce bytes the SPMD partitioner adds
  (gradients of replicated parameters and at the boundary of the FSDP
  gather), from the compiled module;
* the memory XLA assigns (``fp8jax.bench.timing.memory_stats``): arguments,
  temporaries, peak;
* the step's wall time (median of ``iters`` after one warm-up).

Tokens are uniform random ids: neither bytes nor time depend on the data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from flax import nnx

from fp8jax import recipes as recipes_lib
from fp8jax import registry
from fp8jax.bench.hlo import collective_bytes, lowered_collective_bytes
from fp8jax.bench.timing import memory_stats, time_call
from fp8jax.models import ModelConfig, MoETransformer, loss_fn
from fp8jax.parallel import placement
from fp8jax.parallel.fsdp import fsdp_loss, kernel_layouts
from fp8jax.parallel.mesh import global_batch, make_mesh
from fp8jax.train.optimizer import make_optimizer
from fp8jax.train.state import create_train_state
from fp8jax.train.step import make_train_step

SCOPES = ("dispatch", "combine", "dispatch_plan", "gemm_weights", "other_params")


@dataclass(frozen=True)
class ParallelBench:
    """One benchmark setting: the model, the batch and the mesh."""

    model: dict[str, Any] = field(default_factory=dict)
    batch: int = 8
    seq: int = 256
    mesh: tuple[int, int, int] = (1, 4, 2)
    iters: int = 3


def bench_model(d_model: int, layers: int, experts: int = 8) -> dict[str, Any]:
    """ModelConfig.tiny overrides of the benchmarks: 4 heads, FFN 2 d_model, experts of
    d_model, the first of ``layers`` blocks dense."""
    return dict(
        d_model=d_model,
        n_heads=4,
        head_dim=d_model // 4,
        d_ff=2 * d_model,
        d_expert=d_model,
        n_layers=layers,
        n_dense_layers=1,
        n_routed_experts=experts,
    )


def build_step(recipe: recipes_lib.Recipe, bench: ParallelBench, mesh):
    """(model config, jitted train step, sharded train state, global batch) on ``mesh``."""
    cfg = ModelConfig.tiny(**bench.model)
    if bench.seq > cfg.max_seq_len:
        cfg = cfg.replace(max_seq_len=bench.seq)
    make = lambda: MoETransformer(cfg, recipe, rngs=nnx.Rngs(0), telemetry=False)
    abstract = nnx.eval_shape(make)
    graph, _ = nnx.split(abstract)
    # Initialised under jit (fast on many simulated devices), then sharded.
    model = nnx.merge(graph, jax.jit(lambda: nnx.state(make()))())
    tx, _ = make_optimizer(peak_lr=1e-3, total_steps=100, warmup_steps=10)
    graphdef, state = create_train_state(model, tx)
    state = jax.device_put(
        state, placement.train_state_shardings(state, mesh, cfg.n_routed_experts)
    )
    loss = fsdp_loss(loss_fn, mesh, recipe, cfg.n_routed_experts, kernel_layouts(abstract))
    step = make_train_step(graphdef, tx, loss, donate=False)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (bench.batch, bench.seq))
    return cfg, step, state, global_batch(tokens.astype(np.int32), mesh)


def run_recipe(recipe: recipes_lib.Recipe, bench: ParallelBench) -> dict[str, Any]:
    """Compile and time one train step of ``recipe`` on the mesh; a flat record."""
    mesh = make_mesh(bench.mesh)
    cfg, step, state, tokens = build_step(recipe, bench, mesh)
    with jax.set_mesh(mesh):
        lowered = step.lower(state, tokens)
    compiled = lowered.compile()
    # The program's own collectives in the dtypes it asks for (the CPU
    # compiler widens BF16 / FP8 collectives), and the partitioner's from
    # the compiled module.
    coll = lowered_collective_bytes(lowered.as_text(debug_info=True), SCOPES)
    auto = collective_bytes(compiled.as_text())
    mem = memory_stats(compiled)
    t = time_call(compiled, (state, tokens), warmup=1, iters=bench.iters, min_sample_s=0.0)
    a2a, ag = coll["all-to-all"], coll["all-gather"]
    return {
        "recipe": recipe.name,
        "mesh": bench.mesh,
        "params": cfg.param_count(),
        "a2a_bytes": a2a["bytes"],
        "dispatch_bytes": a2a["by_scope"].get("dispatch", 0),
        "combine_bytes": a2a["by_scope"].get("combine", 0),
        "gather_bytes": ag["bytes"],
        "gemm_gather_bytes": ag["by_scope"].get("gemm_weights", 0),
        "other_gather_bytes": ag["by_scope"].get("other_params", 0),
        "reduce_scatter_bytes": coll["reduce-scatter"]["bytes"],
        "all_reduce_bytes": auto["all-reduce"]["bytes"],
        "a2a_types": a2a["by_type"],
        "gather_types": ag["by_type"],
        **mem,
        "step_s": t["median_s"],
    }


def compare(bench: ParallelBench, names=("bf16", "deepseek_v3")) -> list[dict[str, Any]]:
    """``run_recipe`` for each recipe name, in order (the first is the baseline of the ratios)."""
    return [run_recipe(registry.get(n), bench) for n in names]


def table(rows: list[dict[str, Any]]) -> str:
    """The records side by side, with each later recipe's ratio to the first."""
    keys = [
        ("dispatch_bytes", "dispatch all-to-all (B)"),
        ("combine_bytes", "combine all-to-all (B)"),
        ("a2a_bytes", "all-to-all total (B)"),
        ("gemm_gather_bytes", "FSDP GEMM-weight gather (B)"),
        ("other_gather_bytes", "FSDP other-param gather (B)"),
        ("gather_bytes", "all-gather total (B)"),
        ("reduce_scatter_bytes", "reduce-scatter (B)"),
        ("all_reduce_bytes", "all-reduce (B)"),
        ("argument_bytes", "arguments / device (B)"),
        ("temp_bytes", "temporaries / device (B)"),
        ("peak_bytes", "peak / device (B)"),
        ("step_s", "step time (s)"),
    ]
    base = rows[0]
    head = f"{'':28s}" + "".join(f"{r['recipe']:>16s}" for r in rows)
    head += "".join(f"{r['recipe'] + '/' + base['recipe']:>22s}" for r in rows[1:])
    lines = [head]
    for k, label in keys:
        line = f"{label:28s}" + "".join(
            f"{r[k]:16.3f}" if k == "step_s" else f"{r[k]:16,d}" for r in rows
        )
        for r in rows[1:]:
            line += f"{r[k] / base[k]:22.3f}" if base[k] else f"{'-':>22s}"
        lines.append(line)
    return "\n".join(lines)
