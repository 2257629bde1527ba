r"""Benchmark sweep: FP8 GEMMs (every recipe x implementation) and the MoE train step.

Writes results.json, results.csv and time/tflops/ratio_bf16/memory PNGs to --out_dir
and prints a speedup-vs-bf16 table.  What it runs is configs/bench/sweep.py (every
field with its meaning; override one with --config.<field>=...).  Logic: fp8jax.bench.

CPU (minutes on 2 cores):
  python experiments/bench_sweep.py --config=configs/bench/sweep.py:cpu --out_dir=/tmp/bench_cpu
GPU (H100/H200; see scripts/gpu_sweep.sh):
  python experiments/bench_sweep.py --config=configs/bench/sweep.py --out_dir=$OUT/bench_gpu \
      --config.time_budget_s=420
Selected shapes only:
  python experiments/bench_sweep.py --config=configs/bench/sweep.py --config.groups=dsv3 \
      --config.m_tokens=2048 --config.recipes=bf16,deepseek_v3 --out_dir=/tmp/bench_dsv3
"""

from __future__ import annotations

import os

from absl import app, flags
from ml_collections import config_flags

from fp8jax import bench
from fp8jax.bench import gemm_cases
from fp8jax.bench.moe_step import step_table
from fp8jax.train.runtime import usage_error

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Sweep config file (configs/bench/sweep.py[:cpu]).", lock_config=True
)
_OUT = flags.DEFINE_string("out_dir", None, "Where results.json/csv and PNGs go.")
flags.mark_flags_as_required(["config", "out_dir"])


def _items(text: str) -> list[str]:
    """A comma-separated config field as a list ("" -> [])."""
    return [s.strip() for s in str(text).split(",") if s.strip()]


def sweep_config(c, out_dir: str) -> bench.SweepConfig:
    """The bench.SweepConfig of a sweep config file's fields (ValueError for a bad value)."""
    if c.shapes:
        shapes = [bench.parse_shape(s) for s in _items(c.shapes)]
    else:
        shapes = gemm_cases.gemm_shapes(
            _items(c.groups),
            m_tokens=int(c.m_tokens),
            expert_m=int(c.expert_m) or None,
            square_sizes=[int(s) for s in _items(c.square_sizes)],
            dsv3_n=[int(n) for n in _items(c.dsv3_n)] or gemm_cases.DSV3_N,
        )
    for name in ("warmup", "iters", "moe_batch", "moe_iters"):
        if int(c[name]) < (0 if name == "warmup" else 1):
            raise ValueError(f"config.{name} = {c[name]} is out of range")
    return bench.SweepConfig(
        shapes=shapes,
        recipes=_items(c.recipes) or None,
        impls=_items(c.impls) or None,
        dequant_dtypes=tuple(_items(c.dequant_dtypes)),
        passes=tuple(_items(c.passes)),
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


def main(argv):
    if len(argv) > 1:
        usage_error(f"unexpected arguments {argv[1:]}")
    try:
        cfg = sweep_config(_CONFIG.value, _OUT.value)
    except ValueError as e:
        usage_error(str(e))
    results = bench.run_sweep(cfg)
    paths = bench.write_results(results, _OUT.value, plots=bool(_CONFIG.value.plots))
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


if __name__ == "__main__":
    app.run(main)
