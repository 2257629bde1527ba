r"""Scale rules at DeepSeek-V3's sites: amax floors on gradients, power-of-two re-quantization.

Settings: configs/study/scale_sites.py.  What it prints:

1. Dgrad dy of the small config (configs/small.py model, deepseek_v3, one
   forward+backward at init and after ``steps`` training steps): per GEMM
   kind (dense / routed expert), the share of 1x128 tiles with amax below
   1e-4 and the fraction of nonzero elements flushed to zero by E4M3
   quantization, with DeepSeek's amax floor of 1e-4 and without it; the same
   for the GEMMs' Fprop inputs x and weights w (whether the floor matters
   for them).
2. The relative error (Frobenius) of quantizing Gaussian dy with std 1e-9
   and 1e-10, with and without the floor.
3. Wgrad's x (128x1 tiles along tokens): relative error quantized directly
   from the high-precision x, or re-quantized from the cached FP8 1x128
   tensor (or from an E5M6 copy), with arbitrary and with power-of-two
   scales, on the small model's captured activations and on Gaussian tokens
   with log-normal magnitudes.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

import fp8jax
from fp8jax import data as data_lib
from fp8jax.models import MoETransformer, loss_fn
from fp8jax.numerics.captured import GemmSite, tap_gemms
from fp8jax.operands import e5m6_tiles
from fp8jax.train import loop
from fp8jax.train.defaults import config_file, model_config, seq_len
from fp8jax.train.fields import integer

FLOOR = 1e-4


def _by_operand(sites: dict[str, GemmSite]) -> dict[str, list[np.ndarray]]:
    """Captured operands per "kind/operand" (x, w, dy), contraction axis last: (rows, n)."""
    out: dict[str, list[np.ndarray]] = defaultdict(list)
    for s in sites.values():
        n = s.w.shape[-1]
        out[f"{s.scope}/x"].append(s.x)
        out[f"{s.scope}/w"].append(s.w.reshape(-1, n))
        out[f"{s.scope}/dy"].append(s.dy)
    return out


def _flush_stats(t: np.ndarray, gran: str, floor: float) -> tuple[float, float, float]:
    """(share of groups with amax < 1e-4, flushed fraction, relative error) of E4M3 quantization."""
    x = jnp.asarray(t)
    q = fp8jax.quantize(x, fp8jax.E4M3, gran, axis=-1, amax_floor=floor)
    d = np.asarray(fp8jax.dequantize(q), np.float64)
    data = np.asarray(q.data.astype(jnp.float32))
    nz = t != 0
    flushed = float(np.sum(nz & (data == 0)) / max(1, np.sum(nz)))
    amax = np.asarray(fp8jax.quant.group_amax(x, gran, -1, 128))
    below = float(np.mean(amax < FLOOR))
    err = float(np.linalg.norm(d - t) / max(np.linalg.norm(t.astype(np.float64)), 1e-300))
    return below, flushed, err


def _report_capture(label: str, sites: dict[str, GemmSite]) -> None:
    print(f"\n## {label}")
    print(
        "operand        groups<1e-4  flushed(floor 1e-4)  flushed(no floor)  rel.err floor / none"
    )
    captured = _by_operand(sites)
    for name in sorted(captured):
        # Weights: 128x128 blocks (rows = K, experts stacked); the rest: 1x128 tiles.
        gran = "block" if name.endswith("/w") else "tile"
        t = np.concatenate([a.reshape(-1, 128) for a in _by_width(captured[name])], axis=0)
        b1, f1, e1 = _flush_stats(t, gran, FLOOR)
        _, f0, e0 = _flush_stats(t, gran, 0.0)
        print(f"{name:<14} {b1:>10.1%}  {f1:>18.2%}  {f0:>17.2%}  {e1:>9.2%} / {e0:.2%}")


def _by_width(arrs):
    """(rows, n) arrays cut into (rows, 128) column slices (n padded with zeros)."""
    for a in arrs:
        pad = (-a.shape[1]) % 128
        a = np.pad(a, ((0, 0), (0, pad)))
        rows = a.shape[0] - a.shape[0] % 128 if a.shape[0] >= 128 else a.shape[0]
        for j in range(0, a.shape[1], 128):
            yield a[:rows, j : j + 128]


def _loss_and_grad(graphdef, rest):
    def loss(params, tokens):
        return loss_fn(nnx.merge(graphdef, params, rest), tokens)[0]

    return jax.jit(jax.value_and_grad(loss))


def _capture(step_fn, params, tokens) -> None:
    jax.block_until_ready(step_fn(params, tokens))
    jax.effects_barrier()


def _synthetic_dy() -> None:
    print("\n## Gaussian dy (256 x 1024), 1x128 tiles, E4M3")
    print("std      rel.err floor 1e-4  flushed   rel.err no floor  flushed")
    rng = np.random.default_rng(0)
    for std in (1e-9, 1e-10):
        t = (rng.standard_normal((256, 1024)) * std).astype(np.float32)
        _, f1, e1 = _flush_stats(t, "tile", FLOOR)
        _, f0, e0 = _flush_stats(t, "tile", 0.0)
        print(f"{std:<8.0e} {e1:>17.2%}  {f1:>7.2%}  {e0:>16.2%}  {f0:>7.2%}")


def _wgrad_x_errors(x: np.ndarray) -> dict[str, float]:
    """Wgrad's x error: (tokens, features) x, 128x1 tiles along tokens (axis 0)."""
    xj = jnp.asarray(x)
    ref = x.astype(np.float64)
    nrm = np.linalg.norm(ref)

    def err(q):
        return float(np.linalg.norm(np.asarray(fp8jax.dequantize(q), np.float64) - ref) / nrm)

    out = {}
    for label, cache_pow2, wgrad_pow2 in [
        ("arbitrary", False, False),
        ("pow2 re-quantization only", False, True),
        ("pow2 cache and re-quantization", True, True),
    ]:
        direct = fp8jax.quantize(xj, fp8jax.E4M3, "tile", axis=0, pow2=wgrad_pow2)
        cached = fp8jax.dequantize(fp8jax.quantize(xj, fp8jax.E4M3, "tile", -1, pow2=cache_pow2))
        requant = fp8jax.quantize(cached, fp8jax.E4M3, "tile", axis=0, pow2=wgrad_pow2)
        out[label] = (err(direct), err(requant))
    # The E5M6 cache (the paper's format for the input of the linear after
    # attention: 1x128 tiles, power-of-two scales): Wgrad re-quantizes from it.
    e5m6 = e5m6_tiles(xj, axis=-1).astype(jnp.float32)
    for label, pow2 in [("E5M6 cache, arbitrary", False), ("E5M6 cache, pow2", True)]:
        direct = fp8jax.quantize(xj, fp8jax.E4M3, "tile", axis=0, pow2=pow2)
        requant = fp8jax.quantize(e5m6, fp8jax.E4M3, "tile", axis=0, pow2=pow2)
        out[label] = (err(direct), err(requant))
    return out


def _report_wgrad(label: str, x: np.ndarray) -> None:
    print(f"\n## Wgrad x, {label} ({x.shape[0]} tokens x {x.shape[1]} features)")
    print("scales                           direct   re-quantized from cached FP8 1x128")
    for k, (d, r) in _wgrad_x_errors(x).items():
        print(f"{k:<32} {d:>6.2%}   {r:>6.2%}")


# The settings (configs/study/scale_sites.py) and what each accepts.
FIELDS = {"steps": integer(0), "seed": integer(0)}


def run(c: ml_collections.ConfigDict, runs: list[str], out_dir: str | None) -> None:
    del runs, out_dir
    steps, seed = int(c.steps), int(c.seed)
    config = config_file(Path(fp8jax.__file__).resolve().parents[1] / "configs" / "small.py")
    config.recipe = "deepseek_v3"
    config.seed = seed
    mcfg = model_config(config)
    corpus = loop.load_data(config, seq_len(config, mcfg))
    tokens = jnp.asarray(data_lib.train_batch(corpus, 0, 8, 128, seed))
    model = MoETransformer(mcfg, fp8jax.recipes.deepseek_v3(), rngs=nnx.Rngs(seed))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    # Traced inside the tap: every later call of grad_fn records into ``sites``.
    with tap_gemms() as sites:
        grad_fn = _loss_and_grad(graphdef, rest)
        _capture(grad_fn, params, tokens)
    _report_capture("small config at init (deepseek_v3, 8 x 128 tokens)", sites)
    x_init = np.concatenate(
        [a for a in _by_width(_by_operand(sites)["dense/x"]) if len(a) % 128 == 0]
    )
    if steps > 0:
        # A few Adam steps at the small config's peak learning rate; the
        # captures of these steps are discarded.
        tx = optax.adam(config.lr)
        opt = tx.init(params)
        for step in range(steps):
            batch = jnp.asarray(data_lib.train_batch(corpus, step + 1, 8, 128, seed))
            loss, grads = grad_fn(params, batch)
            updates, opt = tx.update(grads, opt, params)
            params = optax.apply_updates(params, updates)
        print(f"\nloss after {steps} steps: {float(loss):.3f}")
        _capture(grad_fn, params, tokens)
        _report_capture(f"small config after {steps} Adam steps (same batch as at init)", sites)
    _synthetic_dy()
    _report_wgrad("small config Fprop inputs at init, 128-feature slices", x_init)
    g = np.random.default_rng(1)
    gx = (g.standard_normal((1024, 512)) * np.exp(g.standard_normal((1024, 1)))).astype(np.float32)
    _report_wgrad("Gaussian tokens, log-normal token magnitudes", gx)
