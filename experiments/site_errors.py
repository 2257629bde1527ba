r"""GEMM error of deepseek_v3 at each of its scale sites, its power-of-two variant and DeepSeek's act_quant.

    python experiments/site_errors.py --out=experiments/results/recipe_sites/table.md
    python experiments/site_errors.py --run_dir=RUN   # adds a trained run's captured tensors

Heavy-tailed inputs (M, K, N = 384, 1024, 512 by default): "massive3" (N(0, 1)
with 3 massive activations of 1e4-1e5) and "lognormal" (random signs times a
log-normal magnitude with sigma 2); x and the gradient dy are drawn from the
same kind, w ~ N(0, 1/K).  For each: the relative error (Frobenius, against
float64 products of the unquantized tensors) of Fprop y, Dgrad dx and Wgrad
dW, for deepseek_v3 at a general linear and at each site of
``fp8jax.recipes.for_site``, for ``deepseek_v3_pow2x``, and for the numpy
reference of DeepSeek's quantization (``fp8jax.numerics.act_quant_reference``).
The last column is each row's Fprop and Wgrad error over the reference's.
"""

import numpy as np
from absl import app, flags

from fp8jax import recipes
from fp8jax.numerics.act_quant_reference import reference_linear
from fp8jax.numerics.gemm_error import linear_outputs
from fp8jax.numerics.metrics import relative_error

FLAGS = flags.FLAGS
flags.DEFINE_integer("m", 384, "tokens (a multiple of 128)")
flags.DEFINE_integer("k", 1024, "input features (a multiple of 128)")
flags.DEFINE_integer("n", 512, "output features (a multiple of 128)")
flags.DEFINE_integer("seed", 0, "random seed of the synthetic inputs")
flags.DEFINE_string("run_dir", None, "a trained run whose captured GEMM operands are added")
flags.DEFINE_string("out", None, "optional path for the Markdown table")


def heavy_tailed(kind: str, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """float32 tensor of the named kind (module docstring), drawn in float64, rounded once."""
    if kind == "massive3":
        x = rng.standard_normal(shape)
        flat = rng.choice(x.size, 3, replace=False)
        x.flat[flat] = rng.choice([-1.0, 1.0], 3) * 10.0 ** rng.uniform(4, 5, 3)
    elif kind == "lognormal":
        x = rng.choice([-1.0, 1.0], shape) * np.exp(2.0 * rng.standard_normal(shape))
    else:
        raise ValueError(kind)
    return x.astype(np.float32)


def arms() -> dict[str, recipes.Recipe]:
    r = recipes.deepseek_v3()
    out = {"deepseek_v3 (general linear)": r}
    for site in recipes.SITES:
        out[f"deepseek_v3 at {site}"] = recipes.for_site(r, site)
    out["deepseek_v3_pow2x (general linear)"] = recipes.deepseek_v3_pow2x()
    return out


def errors(x, w, dy) -> dict[str, tuple[float, float, float]]:
    x64, w64, dy64 = (np.asarray(a, np.float64) for a in (x, w, dy))
    exact = (x64 @ w64, dy64 @ w64.T, x64.T @ dy64)
    rows = {"DeepSeek act_quant (numpy reference)": reference_linear(x, w, dy)}
    for name, recipe in arms().items():
        rows[name] = linear_outputs(recipe, x, w, dy)
    return {
        name: tuple(relative_error(got, ref) for got, ref in zip(outs, exact))
        for name, outs in rows.items()
    }


def table(results: dict[str, dict[str, tuple[float, float, float]]]) -> str:
    ref_name = "DeepSeek act_quant (numpy reference)"
    lines = [
        "| inputs | quantization | Fprop y | Dgrad dx | Wgrad dW | y / ref, dW / ref |",
        "|---|---|---|---|---|---|",
    ]
    for inputs, rows in results.items():
        ry, _, rw = rows[ref_name]
        for name, (ey, ex, ew) in rows.items():
            lines.append(
                f"| {inputs} | {name} | {ey:.4f} | {ex:.4f} | {ew:.4f} | "
                f"{ey / ry:.2f}, {ew / rw:.2f} |"
            )
    return "\n".join(lines) + "\n"


def captured_inputs(run_dir: str) -> dict[str, tuple]:
    """Each captured dense site's (x, w, dy), cropped to multiples of 128."""
    from fp8jax.numerics.captured import trained_run_operands

    sites, _ = trained_run_operands(run_dir)
    out = {}
    for name, site in sites.items():
        x, w, dy = site.operands()
        if dy is None or x.ndim != 2 or w.ndim != 2:
            continue
        m, k, n = (d - d % 128 for d in (x.shape[0], x.shape[1], w.shape[1]))
        if min(m, k, n) == 0:
            continue
        out[f"captured {name}"] = (x[:m, :k], w[:k, :n], dy[:m, :n])
    return out


def main(argv):
    del argv
    rng = np.random.default_rng(FLAGS.seed)
    m, k, n = FLAGS.m, FLAGS.k, FLAGS.n
    inputs = {}
    for kind in ("massive3", "lognormal"):
        x = heavy_tailed(kind, (m, k), rng)
        w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
        inputs[f"{kind} ({m}x{k}x{n})"] = (x, w, heavy_tailed(kind, (m, n), rng))
    if FLAGS.run_dir:
        inputs.update(captured_inputs(FLAGS.run_dir))
    results = {}
    for name, (x, w, dy) in inputs.items():
        results[name] = errors(x, w, dy)
        print(f"{name}: done", flush=True)
    text = table(results)
    print(text)
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    app.run(main)
