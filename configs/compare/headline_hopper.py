r"""The headline's deepseek_v3 with the Hopper accumulator, on a few seeds.

Command (share the headline's workdir: its bf16 and deepseek_v3 runs are reused):
  python experiments/compare_recipes.py --config=configs/compare/headline_hopper.py --workdir=/tmp/fp8jax_cmp/headline

deepseek_v3 as in configs/compare/headline.py, and the same recipe with every
quantized GEMM run on the tensor-core accumulation emulator (fp8jax.accumulate:
blocks of 32 products, 13 fraction bits, promotion to FP32 every 128 elements
with DeepGEMM's FFMA rounding).  The contrast "deepseek_v3_hopper:deepseek_v3"
is the effect of the accumulator alone.  The emulator costs several times the
exact path, hence few seeds ("0-3" by default; the argument picks others).

What it prints: the table of results.md, as the headline's.
"""

from pathlib import Path

from fp8jax.train.defaults import comparison_block, config_file, parse_seeds, set_comparison_eval


def get_config(seeds: str = "0-3"):
    c = config_file(Path(__file__).parents[1] / "small.py")
    set_comparison_eval(c)
    c.compare = comparison_block(
        "headline_hopper",
        dict(
            bf16=dict(recipe="bf16"),
            deepseek_v3=dict(recipe="deepseek_v3"),
            deepseek_v3_hopper=dict(recipe="acc_tiles"),
        ),
        notes=(
            "configs/small.py as in the headline: deepseek_v3 with exact FP32 accumulation of its "
            "FP8 products (the chunked path) and with the Hopper accumulation emulator "
            "(promotion every 128, FFMA), each against BF16 on the same seeds."
        ),
        seeds=parse_seeds(seeds),
        contrasts=("deepseek_v3_hopper:deepseek_v3",),
    )
    return c
