"""GEMM error of each recipe on Gaussian and LLM-like inputs, against float64.

    python experiments/gemm_error.py                       # M=K=N=1024
    python experiments/gemm_error.py --m=512 --k=512 --n=512 --out=/tmp/gemm_error.md

Prints, per input distribution and preset, the relative error of y, dx and dW over the
whole tensor (*_rel) and the median over tokens of each token's relative error
(*_tok), then the massive-activation check: deepseek_v3's per-token median
forward error versus current_tensor's and hybrid_delayed's (goal: >= 2x lower).
"""

from absl import app, flags

from fp8jax import recipes, registry
from fp8jax.numerics.gemm_error import format_table, gemm_errors
from fp8jax.numerics.inputs import DISTRIBUTIONS, make_gemm_inputs

FLAGS = flags.FLAGS
flags.DEFINE_integer("m", 1024, "tokens")
flags.DEFINE_integer("k", 1024, "input features")
flags.DEFINE_integer("n", 1024, "output features")
flags.DEFINE_integer("seed", 0, "random seed")
flags.DEFINE_list(
    "recipes",
    ["bf16", "deepseek_v3", "current_tensor", "rowwise", "hybrid_delayed", "mxfp8", "nvfp4"],
    "presets",
)
flags.DEFINE_string("out", None, "optional path for the Markdown table")


def main(argv):
    del argv
    rows = []
    for distribution in DISTRIBUTIONS:
        x, w, dy = make_gemm_inputs(distribution, FLAGS.m, FLAGS.k, FLAGS.n, FLAGS.seed)
        for name in FLAGS.recipes:
            errs = gemm_errors(registry.get(name), x, w, dy)
            rows.append({"inputs": distribution, "recipe": name, **errs})
            print(
                f"{distribution:17s} {name:15s} "
                + " ".join(f"{k}={v:.3e}" for k, v in errs.items())
            )
        if distribution == "massive":
            x_fresh = gemm_errors(recipes.hybrid_delayed(), x, w, dy, warm_state=False)
            rows.append(
                {"inputs": distribution, "recipe": "hybrid_delayed (fresh state)", **x_fresh}
            )
    table = format_table(rows)
    print()
    print(table)
    mass = {r["recipe"]: r["y_tok"] for r in rows if r["inputs"] == "massive"}
    if "deepseek_v3" in mass:
        print()
        for other in ("current_tensor", "hybrid_delayed"):
            if other in mass:
                ratio = mass[other] / mass["deepseek_v3"]
                verdict = "OK" if ratio >= 2 else "BELOW GOAL"
                print(
                    f"massive activations, per-token median y error: {other} / deepseek_v3 = "
                    f"{ratio:.2f}x ({verdict}, goal >= 2x)"
                )
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    app.run(main)
