r"""Benchmark sweep: FP8 GEMMs (every recipe x implementation) and the MoE train step.

Writes results.json, results.csv and time/tflops/ratio_bf16/memory PNGs to --out_dir
and prints a speedup-vs-bf16 table.  Logic: fp8jax.bench.

CPU (minutes on 2 cores):
  python experiments/bench_sweep.py --small --out_dir=/tmp/bench_cpu
GPU (H100/H200; see scripts/gpu_sweep.sh):
  python experiments/bench_sweep.py --out_dir=$OUT/bench_gpu --time_budget_s=420
Selected shapes only:
  python experiments/bench_sweep.py --groups=dsv3 --m_tokens=2048 --recipes=bf16,deepseek_v3 \
      --out_dir=/tmp/bench_dsv3
  python experiments/bench_sweep.py --shapes=4096x7168x2112,512x512x512 --passes=fwd \
      --out_dir=/tmp/bench_shapes
"""

from __future__ import annotations

import os

from absl import app, flags

from fp8jax import bench
from fp8jax.bench.moe_step import step_table

_OUT = flags.DEFINE_string("out_dir", None, "Where results.json/csv and PNGs go.", required=True)
_SMALL = flags.DEFINE_bool(
    "small", False, "CPU sizes: squares 256-1024, M=64 tokens, 1 warmup / 3 iters, tiny MoE."
)
_GROUPS = flags.DEFINE_list("groups", ["square", "dsv3", "moe"], "Shape groups: square,dsv3,moe.")
_SHAPES = flags.DEFINE_list("shapes", [], "Explicit MxKxN shapes (replace --groups).")
_SQUARE = flags.DEFINE_list(
    "square_sizes", [], "Square sizes (default 1024..8192; small 256..1024)."
)
_M = flags.DEFINE_integer("m_tokens", None, "M (tokens) of DeepSeek-V3 shapes (4096; small 64).")
_DSV3_N = flags.DEFINE_list("dsv3_n", [], "N of the DeepSeek-V3 K=7168 shapes (default all four).")
_EM = flags.DEFINE_integer("expert_m", None, "M of the MoE expert shapes (default --m_tokens).")
_RECIPES = flags.DEFINE_list("recipes", [], "Recipe presets (default: all of recipes.PRESETS).")
_IMPLS = flags.DEFINE_list(
    "impls", [], "Implementations: xla,chunked,fp8,fp8_fast,pallas,reference (default: all)."
)
_DEQ = flags.DEFINE_list("dequant_dtypes", ["float32", "bfloat16"], "XLA-path dequant dtypes.")
_PASSES = flags.DEFINE_list("passes", ["fwd", "fwd_bwd"], "fwd and/or fwd_bwd.")
_DTYPE = flags.DEFINE_string("dtype", "bfloat16", "dtype of x, w and dy.")
_WARMUP = flags.DEFINE_integer("warmup", None, "Untimed calls after compile (2; small 1).")
_ITERS = flags.DEFINE_integer("iters", None, "Timed calls, median reported (10; small 3).")
_BUDGET = flags.DEFINE_float("time_budget_s", None, "Skip remaining cases after this many s.")
_MOE = flags.DEFINE_bool("moe_step", True, "Also time the MoE model's train step.")
_MOE_PRESET = flags.DEFINE_string(
    "moe_preset", None, "ModelConfig preset (small: tiny; else small)."
)
_MOE_BATCH = flags.DEFINE_integer("moe_batch", 8, "MoE step batch size.")
_MOE_SEQ = flags.DEFINE_integer("moe_seq", None, "MoE step sequence length (default max_seq_len).")
_DUMP = flags.DEFINE_bool("dump_hlo", False, "Save the first shape's compiled HLO to out_dir/hlo.")
_PLOTS = flags.DEFINE_bool("plots", True, "Write PNG plots.")


def main(argv):
    del argv
    small = _SMALL.value
    if _SHAPES.value:
        shapes = [bench.parse_shape(s) for s in _SHAPES.value]
    else:
        sq = [int(s) for s in _SQUARE.value] or None
        dsv3_n = [int(n) for n in _DSV3_N.value] or None
        shapes = bench.default_shapes(small, _GROUPS.value, _M.value, _EM.value, sq, dsv3_n)
    cfg = bench.SweepConfig(
        shapes=shapes,
        recipes=_RECIPES.value or None,
        impls=_IMPLS.value or None,
        dequant_dtypes=tuple(_DEQ.value),
        passes=tuple(_PASSES.value),
        dtype=_DTYPE.value,
        warmup=_WARMUP.value if _WARMUP.value is not None else (1 if small else 2),
        iters=_ITERS.value if _ITERS.value is not None else (3 if small else 10),
        time_budget_s=_BUDGET.value,
        moe_step=_MOE.value,
        moe_preset=_MOE_PRESET.value or ("tiny" if small else "small"),
        moe_batch=_MOE_BATCH.value,
        moe_seq=_MOE_SEQ.value,
        moe_iters=3 if small else 10,
        hlo_dump_dir=os.path.join(_OUT.value, "hlo") if _DUMP.value else None,
        partial_json=os.path.join(_OUT.value, "results.partial.json"),
    )
    results = bench.run_sweep(cfg)
    paths = bench.write_results(results, _OUT.value, plots=_PLOTS.value)
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
