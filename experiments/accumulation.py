r"""FP8 GEMM error vs K with Hopper-style 13-bit accumulation, with and without promotion.

Reproduces DeepSeek-V3's observation (sec. 3.3.2): limited tensor-core
accumulation precision costs percent-level error at K = 4096, and promoting
the partial sums to FP32 every 128 elements of K fixes it.  Operands are
quantized the DeepSeek-V3 way (E4M3, 1x128 tiles / 128x128 blocks); errors are
against a float64 product of the same dequantized operands, so only the
accumulation is measured.  Also prints how much slower the emulator is than a
plain float32 matmul.

  python experiments/accumulation.py --out_dir=experiments/results/accumulation
"""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")

from absl import app, flags  # noqa: E402

from fp8jax import accumulate  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("out_dir", "experiments/results/accumulation", "Where the PNG and table go.")
flags.DEFINE_integer("m", 32, "Rows of x (tokens).")
flags.DEFINE_integer("n", 32, "Columns of w (output features).")
flags.DEFINE_list("distributions", list(accumulate.DISTRIBUTIONS), "uniform, gaussian, llm.")
flags.DEFINE_list("ks", [str(2**i) for i in range(8, 15)], "Contraction lengths K.")
flags.DEFINE_integer("seed", 0, "PRNG seed.")
flags.DEFINE_list("time_shape", ["128", "4096", "128"], "M,K,N of the speed comparison.")


def main(argv):
    del argv
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    ks = [int(k) for k in FLAGS.ks]
    rows = []
    for dist in FLAGS.distributions:
        rows += accumulate.error_vs_k(dist, ks, m=FLAGS.m, n=FLAGS.n, seed=FLAGS.seed)
    table = accumulate.format_table(rows)
    m, k, n = (int(v) for v in FLAGS.time_shape)
    t = accumulate.time_vs_f32(m, k, n)
    speed = (
        f"speed (M,K,N)=({m},{k},{n}), jitted, best of 3: emulated {t['emulated_s'] * 1e3:.1f} ms, "
        f"f32 matmul {t['f32_s'] * 1e3:.3f} ms, slowdown {t['slowdown']:.0f}x"
    )
    text = (
        f"relative error |y - xw| / (|x||w|) of an E4M3 GEMM (M={FLAGS.m}, N={FLAGS.n}), "
        f"Accumulation(block=32, frac_bits=13)\n{table}\n{speed}"
    )
    print(text)
    with open(os.path.join(FLAGS.out_dir, "table.txt"), "w") as f:
        f.write(text + "\n")
    png = os.path.join(FLAGS.out_dir, "error_vs_k.png")
    accumulate.plot_error_vs_k(rows, png, "E4M3 GEMM: 13-bit tensor-core accumulation vs K")
    print(f"wrote {png}")


if __name__ == "__main__":
    app.run(main)
