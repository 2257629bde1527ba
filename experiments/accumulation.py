r"""FP8 GEMM error vs K under the Hopper accumulation model, per input distribution.

For each distribution and K: x (M, K) and w (K, N) coded in E4M3, multiplied by
the bit-exact tensor-core model (fp8jax.accumulate.emulated_gemm: 13 fraction
bits, blocks of 32), without promotion and with promotion to FP32 every 128,
and with DeepSeek-V3's 1x128 / 128x128 scales; the max and median relative
error of y against the exact float64 product of the same dequantized operands
(fp8jax/numerics/accumulation_study.py says exactly what each column is).
DeepSeek-V3's "nearly 2% at K = 4096" is one point of such a table: how large
the error gets depends on the input distribution, so every number here comes
with the distribution it was measured on.  Also times the emulator against a
float32 matmul of the same shape.

  python experiments/accumulation.py                      # results in a new temporary directory
  python experiments/accumulation.py --out_dir=/tmp/acc --ks=256,1024,4096

Writes error_vs_k.json (rows, timings, settings), error_vs_k.png and table.txt
to --out_dir.  Each K's inputs are drawn from (--seed, K), so ``--ks=4096`` alone
gives the K = 4096 row of the full table.  (Before this, K was seeded by its
position in --ks; tables made that way, such as the README's from commit 7806fae,
are not reproduced by a rerun's draws.)
"""

from __future__ import annotations

import json
import os
import tempfile

import matplotlib

matplotlib.use("Agg")

from absl import app, flags  # noqa: E402

from fp8jax.numerics import accumulation_study as study  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("out_dir", "", "Where the JSON, PNG and table go (default: a new temp dir).")
flags.DEFINE_integer("m", 32, "Rows of x (tokens).")
flags.DEFINE_integer("n", 32, "Columns of w (output features).")
flags.DEFINE_list("distributions", list(study.DISTRIBUTIONS), "Input distributions.")
flags.DEFINE_list("ks", [str(2**i) for i in range(8, 15)], "Contraction lengths K.")
flags.DEFINE_integer("seed", 0, "Seed of the inputs (each K draws from (seed, K)).")
flags.DEFINE_list("time_shapes", ["256x1024x256", "64x256x64"], "MxKxN shapes to time ('' skips).")


def _legend() -> str:
    lines = ["distributions:"]
    lines += [f"  {name:>8}: {text}" for name, text in study.DISTRIBUTIONS.items()]
    lines += ["columns (max and median over the M x N outputs of |y - y_exact| / |y_exact|):"]
    lines += [f"  {name:>12}: {text}" for name, text in study.ACCUMULATIONS.items()]
    lines += [
        "signed inputs: the few outputs whose exact value nearly cancels set the max;",
        "the median is the typical output.",
    ]
    return "\n".join(lines)


def main(argv):
    del argv
    out_dir = FLAGS.out_dir or tempfile.mkdtemp(prefix="fp8jax_accumulation_")
    os.makedirs(out_dir, exist_ok=True)
    ks = [int(k) for k in FLAGS.ks]
    rows = []
    for dist in FLAGS.distributions:
        rows += study.error_vs_k(dist, ks, m=FLAGS.m, n=FLAGS.n, seed=FLAGS.seed)
    timings = []
    for text in filter(None, FLAGS.time_shapes):
        m, k, n = (int(v) for v in text.lower().split("x"))
        timings.append(study.time_vs_f32(m, k, n))
    speed = "\n".join(
        f"speed (M,K,N)={t['shape']}: emulated {t['emulated_s'] * 1e3:.2f} ms, f32 matmul "
        f"{t['f32_s'] * 1e3:.3f} ms (medians, jitted), ratio {t['slowdown']:.0f}x"
        for t in timings
    )
    text = (
        f"E4M3 GEMM, M={FLAGS.m}, N={FLAGS.n}, Accumulation(block=32, frac_bits=13)\n"
        f"{_legend()}\n\n{study.format_table(rows)}\n{speed}"
    )
    print(text)
    with open(os.path.join(out_dir, "table.txt"), "w") as f:
        f.write(text + "\n")
    record = {
        "settings": {"m": FLAGS.m, "n": FLAGS.n, "ks": ks, "seed": FLAGS.seed, "fmt": "e4m3"},
        "distributions": {d: study.DISTRIBUTIONS[d] for d in FLAGS.distributions},
        "accumulations": study.ACCUMULATIONS,
        "rows": rows,
        "timings": timings,
    }
    with open(os.path.join(out_dir, "error_vs_k.json"), "w") as f:
        json.dump(record, f, indent=1)
    png = os.path.join(out_dir, "error_vs_k.png")
    study.plot_error_vs_k(rows, png, "E4M3 GEMM under 13-bit tensor-core accumulation")
    print(f"wrote {out_dir}/table.txt, error_vs_k.json, error_vs_k.png")


if __name__ == "__main__":
    app.run(main)
