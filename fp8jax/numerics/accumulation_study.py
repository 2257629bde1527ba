"""Error of an FP8 GEMM under the Hopper accumulation model, versus K and the inputs.

What configs/study/accumulation.py (``experiments/study.py``) and notebook 03
run.  For each K, x (M, K) and w (K, N) are drawn from one distribution, coded
in E4M3 and multiplied by :func:`fp8jax.accumulate.emulated_gemm`; the error of y is measured against
the exact (float64) product of the same dequantized operands, so only the
accumulation is measured, not the quantization.

Three accumulations of the same inputs:

* ``no_promotion``: one scale per row of x and per column of w (scale runs
  as long as K), one chain over the whole of K, scaled once at the end --
  what a per-tensor or per-row scaled GEMM without promotion does;
* ``promote``: the same codes, the chain promoted to FP32 every 128;
* ``tiles``: DeepSeek-V3's coding, 1 x 128 tiles of x and 128 x 128 blocks
  of w, so the chain restarts with each tile's scales every 128 elements.

``fp32`` is a float32 XLA matmul of the float32-dequantized operands, for
reference.  The size of the accumulation error depends on the inputs:
positive ones (``uniform``) never cancel and reach percents at K = 4096;
zero-mean ones much less.  Always say which distribution a number comes from.

The error of one output is |y - y_exact| / |y_exact| (the max and the median
over the M x N outputs are reported; outputs whose exact value is 0 are
skipped).  For signed inputs a few outputs cancel to near zero and dominate
the max; the median is the typical output.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from jax import lax

from fp8jax.accumulate import emulated_gemm
from fp8jax.bench.timing import time_call
from fp8jax.formats import E4M3
from fp8jax.numerics.inputs import make_gemm_inputs
from fp8jax.numerics.metrics import elementwise_relative_error
from fp8jax.quant import quantize
from fp8jax.recipes import Accumulation

__all__ = [
    "ACCUMULATIONS",
    "DISTRIBUTIONS",
    "CodedGemm",
    "code_operands",
    "emulate",
    "error_vs_k",
    "format_table",
    "frac_bits_sweep",
    "plot_error_vs_k",
    "sample_operands",
    "time_vs_f32",
]

DISTRIBUTIONS = {
    "uniform": "x, w ~ U[0, 1): every product positive, truncation errors never cancel",
    "gaussian": "x, w ~ N(0, 1)",
    "mixed": "x, w = +-2^u, u ~ U[-12, 8]: random signs over 20 binades",
    "llm": "x: numerics.inputs 'outlier_channels' (log-normal channel magnitudes, 1% of "
    "channels 1000x larger), w ~ N(0, 1/K)",
}
ACCUMULATIONS = {
    "no_promotion": "one scale per row / column, one chain over K",
    "promote": "same codes, promoted to FP32 every 128",
    "tiles": "1x128 / 128x128 scales, a chain per 128 (DeepSeek-V3)",
    "fp32": "float32 XLA dot of the dequantized operands",
}
PROMOTE_EVERY = 128
TILE = 128


def sample_operands(dist: str, m: int, k: int, n: int, seed: int | tuple[int, ...] = 0):
    """float32 x (m, k) and w (k, n) of one of DISTRIBUTIONS (``seed``: numpy's entropy)."""
    rng = np.random.default_rng(seed)
    if dist == "uniform":
        return rng.uniform(0, 1, (m, k)).astype(np.float32), rng.uniform(0, 1, (k, n)).astype(
            np.float32
        )
    if dist == "gaussian":
        return rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((k, n)).astype(
            np.float32
        )
    if dist == "mixed":

        def signed_log_uniform(shape):
            return rng.choice([-1.0, 1.0], shape) * np.exp2(rng.uniform(-12, 8, shape))

        return (
            signed_log_uniform((m, k)).astype(np.float32),
            signed_log_uniform((k, n)).astype(np.float32),
        )
    if dist == "llm":
        # make_gemm_inputs takes one integer seed: a (seed, K) pair maps to one.
        flat = (
            seed
            if isinstance(seed, int)
            else int(np.random.SeedSequence(list(seed)).generate_state(1)[0])
        )
        x, w, _ = make_gemm_inputs("outlier_channels", m, k, n, flat)
        return x, w
    raise ValueError(f"unknown distribution {dist!r}; choose from {sorted(DISTRIBUTIONS)}")


@dataclasses.dataclass(frozen=True)
class CodedGemm:
    """The operands of emulated_gemm for one GEMM (batch of 1) and their scale run."""

    a_codes: jax.Array  # (1, M, K) FP8
    a_scale: jax.Array  # (1, M, ceil(K / group)) float32
    b_codes: jax.Array  # (1, K, N) FP8
    b_scale: jax.Array  # (1, ceil(K / group), N) float32
    group: int

    def dequantized(self) -> tuple[np.ndarray, np.ndarray]:
        """x (M, K) and w (K, N) as code * scale in float64 (exact: 4 x 24 bits)."""
        k = self.a_codes.shape[2]
        sa = np.repeat(np.asarray(self.a_scale[0], np.float64), self.group, axis=1)[:, :k]
        sb = np.repeat(np.asarray(self.b_scale[0], np.float64), self.group, axis=0)[:k]
        return np.asarray(self.a_codes[0], np.float64) * sa, np.asarray(
            self.b_codes[0], np.float64
        ) * sb

    def exact(self) -> np.ndarray:
        """The product of the dequantized operands in float64, (M, N)."""
        x, w = self.dequantized()
        return x @ w


def code_operands(x, w, scaling: str, fmt=E4M3) -> CodedGemm:
    """Quantize x (M, K) and w (K, N) to ``fmt`` codes for :func:`emulate`.

    scaling "row": one scale per row of x and per column of w (group = K);
    "tile": 1 x 128 tiles of x along K (DeepSeek-V3's act_quant) and
    128 x 128 blocks of w (group = 128).
    """
    x, w = jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32)
    k, n = w.shape
    if scaling == "row":
        qx = quantize(x, fmt, granularity="row", axis=1)
        qw = quantize(w, fmt, granularity="row", axis=0)
        return CodedGemm(qx.data[None], qx.scale[None], qw.data[None], qw.scale[None], k)
    if scaling == "tile":
        qx = quantize(x, fmt, granularity="tile", axis=1, tile=TILE)
        qw = quantize(w, fmt, granularity="block", tile=TILE)
        # A block's scale serves each of its columns: one scale per (run of K, column).
        b_scale = jnp.repeat(qw.scale, TILE, axis=1)[:, :n]
        return CodedGemm(qx.data[None], qx.scale[None], qw.data[None], b_scale[None], TILE)
    raise ValueError(f"unknown scaling {scaling!r}; choose 'row' or 'tile'")


def emulate(op: CodedGemm, acc: Accumulation) -> np.ndarray:
    """y (M, N) float32 of the accumulation model ``acc``."""
    y = emulated_gemm(op.a_codes, op.a_scale, op.b_codes, op.b_scale, group=op.group, acc=acc)
    return np.asarray(y[0])


# The FP32 baseline: full float32 products and sums, no bf16 passes.
_f32_matmul = jax.jit(functools.partial(jnp.matmul, precision=lax.Precision.HIGHEST))


def _max_median(y, exact) -> tuple[float, float]:
    rel = elementwise_relative_error(y, exact)
    return float(rel.max()), float(np.median(rel))


def error_vs_k(
    dist: str, ks: Sequence[int], m: int = 32, n: int = 32, seed: int = 0, frac_bits: int = 13
) -> list[dict]:
    """Max and median relative error of y for each K and accumulation (module doc).

    Each row: dist, K, and ``{name}_max`` / ``{name}_median`` for every name in
    ACCUMULATIONS.  K's operands are drawn with ``numpy.random.default_rng((seed,
    K))``, so a K's row does not depend on which other Ks are in ``ks``.
    """
    no_promotion = Accumulation(frac_bits=frac_bits, promote_every=None)
    promote = Accumulation(frac_bits=frac_bits, promote_every=PROMOTE_EVERY)
    rows = []
    for k in ks:
        # Each K's inputs come from (seed, K) alone, not from K's place in ``ks``:
        # K = 4096 draws the same operands whether or not other Ks are asked for.
        x, w = sample_operands(dist, m, int(k), n, seed=(seed, int(k)))
        per_row = code_operands(x, w, "row")
        tiles = code_operands(x, w, "tile")
        exact_row, exact_tiles = per_row.exact(), tiles.exact()
        xd, wd = (v.astype(np.float32) for v in per_row.dequantized())
        results = {
            "no_promotion": (emulate(per_row, no_promotion), exact_row),
            "promote": (emulate(per_row, promote), exact_row),
            "tiles": (emulate(tiles, promote), exact_tiles),
            "fp32": (np.asarray(_f32_matmul(xd, wd)), xd.astype(np.float64) @ wd),
        }
        row = {"dist": dist, "K": int(k)}
        for name, (y, exact) in results.items():
            row[f"{name}_max"], row[f"{name}_median"] = _max_median(y, exact)
        rows.append(row)
    return rows


def frac_bits_sweep(
    dist: str, k: int, bits: Sequence[int], m: int = 16, n: int = 16, seed: int = 7
) -> dict[tuple[int, int | None], float]:
    """Max relative error for each accumulator width, without and with promotion every 128."""
    x, w = sample_operands(dist, m, k, n, seed)
    op = code_operands(x, w, "row")
    exact = op.exact()
    out = {}
    for fb in bits:
        for prom in (None, PROMOTE_EVERY):
            y = emulate(op, Accumulation(frac_bits=fb, promote_every=prom))
            out[(fb, prom)] = _max_median(y, exact)[0]
    return out


def time_vs_f32(m: int, k: int, n: int, acc: Accumulation | None = None, iters: int = 5) -> dict:
    """Median wall time of the emulator (tiles of 128) and of a float32 matmul of one shape."""
    acc = acc or Accumulation()
    x, w = sample_operands("gaussian", m, k, n)
    op = code_operands(x, w, "tile")
    emu = functools.partial(emulated_gemm, group=op.group, acc=acc)
    t_emu = time_call(emu, (op.a_codes, op.a_scale, op.b_codes, op.b_scale), iters=iters)
    t_f32 = time_call(_f32_matmul, (jnp.asarray(x), jnp.asarray(w)), iters=iters)
    return {
        "shape": (m, k, n),
        "emulated_s": t_emu["median_s"],
        "f32_s": t_f32["median_s"],
        "slowdown": t_emu["median_s"] / t_f32["median_s"],
    }


def format_table(rows: Sequence[dict]) -> str:
    """The rows of :func:`error_vs_k` as a fixed-width text table (max and median per column)."""
    names = list(ACCUMULATIONS)
    head1 = f"{'dist':>8} {'K':>6} |" + "|".join(f"{name:^21}" for name in names)
    head2 = f"{'':>8} {'':>6} |" + "|".join(f"{'max':>10} {'median':>10}" for _ in names)
    lines = [head1, head2, "-" * len(head1)]
    for r in rows:
        cells = "|".join(f"{r[f'{nm}_max']:10.2e} {r[f'{nm}_median']:10.2e}" for nm in names)
        lines.append(f"{r['dist']:>8} {r['K']:>6} |{cells}")
    return "\n".join(lines)


def plot_error_vs_k(rows: Sequence[dict], path: str | None = None, title: str = ""):
    """Log-log max (solid) and median (dotted) relative error vs K, one panel per distribution.

    Saves a PNG when ``path`` is given; returns the matplotlib figure.
    """
    dists = list(dict.fromkeys(r["dist"] for r in rows))
    fig, axes = plt.subplots(1, len(dists), figsize=(4.2 * len(dists), 3.8), squeeze=False)
    colors = {"no_promotion": "tab:red", "promote": "tab:blue", "tiles": "tab:green"}
    colors["fp32"] = "tab:gray"
    for ax, dist in zip(axes[0], dists):
        sub = [r for r in rows if r["dist"] == dist]
        ks = [r["K"] for r in sub]
        for name, color in colors.items():
            label = ACCUMULATIONS[name]
            ax.loglog(ks, [r[f"{name}_max"] for r in sub], "o-", color=color, label=label)
            ax.loglog(ks, [r[f"{name}_median"] for r in sub], ":", color=color)
        ax.set_xscale("log", base=2)
        ax.set_title(dist)
        ax.set_xlabel("K (contraction length)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("relative error |y - xw| / |xw|")
    axes[0][0].plot([], [], ":", color="k", label="dotted: median over outputs")
    axes[0][0].legend(fontsize=6, loc="lower right")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig
