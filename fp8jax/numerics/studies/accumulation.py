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

Writes error_vs_k.json (rows, timings, settings), error_vs_k.png and table.txt
to the output directory (a new temporary one when none is given).  Each K's
inputs are drawn from (seed, K), so ks="4096" alone gives the K = 4096 row of
the full table.  Settings: configs/study/accumulation.py.
"""

from __future__ import annotations

import json
import os
import tempfile

import matplotlib

matplotlib.use("Agg")

import ml_collections  # noqa: E402

from fp8jax.bench.experiments import items  # noqa: E402
from fp8jax.numerics import accumulation_study as study  # noqa: E402
from fp8jax.train.fields import integer, integers, names, shapes  # noqa: E402


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


# The settings (configs/study/accumulation.py) and what each accepts.
FIELDS = {
    "m": integer(1),
    "n": integer(1),
    "distributions": names(study.DISTRIBUTIONS, empty=True),
    "ks": integers(1),
    "seed": integer(0),
    "time_shapes": shapes(empty=True),
}


def footprint(v: dict) -> int:
    """Bytes at least, of the checked settings ``v``: the float64 dequantized x (M, K) and
    w (K, N) of the longest K, or a timed shape's float32 x, w and y."""
    m, n, k = v["m"], v["n"], max(v["ks"])
    timed = [4 * (a * b + b * d + a * d) for a, b, d in v["time_shapes"]]
    return max([8 * (m * k + k * n), *timed])


def run(c: ml_collections.ConfigDict, runs: list[str], out_dir: str | None) -> None:
    del runs
    out_dir = out_dir or tempfile.mkdtemp(prefix="fp8jax_accumulation_")
    os.makedirs(out_dir, exist_ok=True)
    m, n, seed = int(c.m), int(c.n), int(c.seed)
    ks = [int(k) for k in items(c.ks)]
    distributions = items(c.distributions) or list(study.DISTRIBUTIONS)  # checked: FIELDS
    rows = []
    for dist in distributions:
        rows += study.error_vs_k(dist, ks, m=m, n=n, seed=seed)
    timings = []
    for text in items(c.time_shapes):
        tm, tk, tn = (int(v) for v in text.lower().split("x"))
        timings.append(study.time_vs_f32(tm, tk, tn))
    speed = "\n".join(
        f"speed (M,K,N)={t['shape']}: emulated {t['emulated_s'] * 1e3:.2f} ms, f32 matmul "
        f"{t['f32_s'] * 1e3:.3f} ms (medians, jitted), ratio {t['slowdown']:.0f}x"
        for t in timings
    )
    text = (
        f"E4M3 GEMM, M={m}, N={n}, Accumulation(block=32, frac_bits=13)\n"
        f"{_legend()}\n\n{study.format_table(rows)}\n{speed}"
    )
    print(text)
    with open(os.path.join(out_dir, "table.txt"), "w") as f:
        f.write(text + "\n")
    record = {
        "settings": {"m": m, "n": n, "ks": ks, "seed": seed, "fmt": "e4m3"},
        "distributions": {d: study.DISTRIBUTIONS[d] for d in distributions},
        "accumulations": study.ACCUMULATIONS,
        "rows": rows,
        "timings": timings,
    }
    with open(os.path.join(out_dir, "error_vs_k.json"), "w") as f:
        json.dump(record, f, indent=1)
    png = os.path.join(out_dir, "error_vs_k.png")
    study.plot_error_vs_k(rows, png, "E4M3 GEMM under 13-bit tensor-core accumulation")
    print(f"wrote {out_dir}/table.txt, error_vs_k.json, error_vs_k.png")
