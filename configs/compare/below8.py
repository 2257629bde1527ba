r"""Below 8 bits: MXFP8 (scales rounded down / up) and NVFP4 (with and without the Hadamard transform / stochastic rounding / high-precision last block) vs bf16 and deepseek_v3.

Command (seeds 0-3):
  python experiments/compare_recipes.py --config=configs/compare/below8.py --workdir=/tmp/fp8jax_cmp/below8
Two processes sharing the work, then the command above to tabulate all seeds:
  python experiments/compare_recipes.py --config=configs/compare/below8.py:0-3:2 --workdir=/tmp/fp8jax_cmp/below8
  python experiments/compare_recipes.py --config=configs/compare/below8.py:1-3:2 --workdir=/tmp/fp8jax_cmp/below8

What it prints: a progress line per run and logged step, then the Markdown
table of results.md: one row per run with the final validation loss (65,536+
held-out tokens), the paired relative gap to bf16 per seed, its mean and 95%
t-interval, whether the interval lies within +-0.25% (or cannot resolve it),
tokens/s and FP8 telemetry (saturated / flushed fractions).  Runs live under
the workdir (``DIR/runs``).
Expected: mxfp8 within noise of deepseek_v3 (same E4M3 elements, finer
power-of-two blocks); the NVFP4 runs clearly above bf16 (4-bit elements),
with the full recipe (RHT + stochastic rounding + 16x16 weight blocks) the
closest of them; mxfp8_ceil with no saturated elements (its scales never let
an element past 448).  All block formats run as the exact emulation on a CPU.

Smoke check (2 steps, both seeds, every run; about 6.5 min on a loaded 2-core CPU):
  python experiments/compare_recipes.py --config=configs/compare/below8.py --workdir=/tmp/below8_smoke --config.steps=2 --config.warmup_steps=1 --config.log_every=1 --config.eval_every=2 --config.eval_batches=1 --config.final_window=1
"""

from fp8jax.train.defaults import parse_seeds, tiny_comparison_config


def get_config(seeds: str = "0-3"):
    """``seeds``: "a-b", "a-b:step" or a comma list (two processes can split them)."""
    return tiny_comparison_config(
        "below8",
        {
            "bf16": dict(recipe="bf16"),
            "deepseek_v3": dict(recipe="deepseek_v3"),
            "mxfp8": dict(recipe="mxfp8"),
            "mxfp8_ceil": dict(recipe="mxfp8_ceil"),
            "nvfp4": dict(recipe="nvfp4"),
            "nvfp4_all_layers": dict(recipe="nvfp4_all_layers"),
            "nvfp4_no_rht": dict(recipe="nvfp4_no_rht"),
            "nvfp4_no_sr": dict(recipe="nvfp4_no_sr"),
            "nvfp4_rtn": dict(recipe="nvfp4_rtn"),
        },
        notes=(
            "Tiny MoE model, stdlib corpus. mxfp8 = E4M3 elements with one E8M0 (power-of-two, "
            "OCP MX v1.0: rounded down) scale per 32 elements along every GEMM's contraction "
            "axis; mxfp8_ceil = the same with the scale rounded up (nothing clips); nvfp4 = "
            "NVIDIA's NVFP4 training recipe: E2M1 elements, E4M3 scales per 16 elements (16x16 "
            "blocks for weights) and an FP32 tensor scale, a 16-point random Hadamard transform "
            "on both Wgrad operands, stochastic rounding of the gradient dy, and the last "
            "ceil(0.16 x 2) = 1 of the 2 blocks unquantized (BF16 GEMMs); nvfp4_all_layers "
            "quantizes both blocks; nvfp4_no_rht / nvfp4_no_sr switch the RHT / SR off, "
            "nvfp4_rtn both (all three keep the last block in BF16). The embedding, head, gate "
            "and attention core are BF16/FP32 in every recipe."
        ),
        seeds=parse_seeds(seeds),
    )
