"""Recipe comparisons: train recipes x seeds on the same data, then tabulate and plot.

A comparison config is a training config (see ``configs/tiny.py``) plus a
``compare`` block:

    compare.name      title of the comparison
    compare.labels    run labels, in table order (the baseline first)
    compare.baseline  label of the reference run (normally "bf16")
    compare.seeds     model-init / batch-order seeds; every label runs every seed
    compare.runs.<label>   ConfigDict(recipe=..., <any top-level config field>=...)

Each (label, seed) trains with :func:`fp8jax.train.loop.train` in
``<run_root>/<recipe>-<hash of its training config>/seed<k>`` (``run_root`` is
``compare.run_root`` or ``<workdir>/runs``): an interrupted comparison
resumes, a finished run is only re-read, and comparisons that share a
``run_root`` share identical runs (e.g. the bf16 baseline) instead of
repeating them.  Runs go seed by seed, so a partial comparison already pairs
every label with the baseline.  All runs with the same seed see the same
batches, so gaps are *paired*: the relative gap of a label is the mean over
seeds of ``(val(label, s) - val(baseline, s)) / val(baseline, s)``.  The noise
floor is the baseline's seed-to-seed spread, ``(max - min) / mean`` of its
final validation losses; a gap is called "within noise" when
``|gap| <= max(0.25%, noise floor)`` (DeepSeek-V3's 0.25% criterion).

Outputs in the workdir: ``results.json``, ``results.md`` (Markdown table),
``loss_curves.png`` (train and validation loss vs step, mean over seeds) and
``gap_to_bf16.png`` (relative validation/train-loss gap to the baseline vs
step; the validation panel shades the baseline's seed spread -- not drawn for
the train loss, whose per-step spread is mostly the seeds' different batches,
which the paired gap cancels).
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
from pathlib import Path

import numpy as np

from fp8jax.train.loop import train
from fp8jax.train.metrics import read_jsonl, to_jsonable

DEEPSEEK_TOLERANCE = 0.0025


def run_config(config, label: str, seed: int):
    """The training config of one (label, seed) run: base fields + the run's overrides."""
    c = copy.deepcopy(config)
    with c.unlocked():
        del c["compare"]
    run = config.compare.runs[label]
    for key, value in run.items():
        if key not in c:
            raise ValueError(f"compare.runs.{label}.{key}: not a field of the training config")
        c[key] = value
    c.seed = int(seed)
    c.data_seed = int(seed)
    return c


def run_dir(run_root: Path, config, seed: int) -> Path:
    """Directory of one run, keyed by its whole training config (seed excluded)."""
    blob = to_jsonable(config)
    blob = {k: v for k, v in blob.items() if k not in ("seed", "data_seed")}
    digest = hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:10]
    return Path(run_root) / f"{config.recipe}-{digest}" / f"seed{int(seed)}"


def _smooth(y: np.ndarray, window: int) -> np.ndarray:
    if window <= 1 or y.size < window:
        return y
    k = np.ones(window) / window
    # 'valid' would shorten the curve; pad with edge values instead.
    pad = np.pad(y, (window // 2, window - 1 - window // 2), mode="edge")
    return np.convolve(pad, k, mode="valid")


def _curves(rows: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    pts = [(r["step"], r[key]) for r in rows if key in r]
    if not pts:
        return np.zeros(0), np.zeros(0)
    s, v = zip(*pts)
    return np.asarray(s), np.asarray(v, dtype=np.float64)


def aggregate(config, runs: dict[str, dict[int, dict]], run_rows: dict) -> dict:
    """Per-label statistics and paired gaps to the baseline."""
    cmp = config.compare
    base = str(cmp.baseline)
    seeds = [int(s) for s in cmp.seeds]
    base_val = np.array([runs[base][s]["final_val_loss"] for s in seeds])
    base_train = np.array([runs[base][s]["final_train_loss"] for s in seeds])
    noise = float((base_val.max() - base_val.min()) / base_val.mean()) if len(seeds) > 1 else 0.0
    noise_train = (
        float((base_train.max() - base_train.min()) / base_train.mean()) if len(seeds) > 1 else 0.0
    )
    threshold = max(DEEPSEEK_TOLERANCE, noise)
    table = []
    for label in cmp.labels:
        val = np.array([runs[label][s]["final_val_loss"] for s in seeds])
        trn = np.array([runs[label][s]["final_train_loss"] for s in seeds])
        gaps = (val - base_val) / base_val
        gaps_train = (trn - base_train) / base_train
        tel: dict[str, float] = {}
        for s in seeds:
            for k, v in runs[label][s]["fp8_telemetry"].items():
                tel[k] = (
                    max(tel.get(k, -math.inf), v) if "max" in k else tel.get(k, 0) + v / len(seeds)
                )
        gap = float(np.mean(gaps))
        finite = bool(np.all(np.isfinite(val)))
        table.append(
            {
                "label": label,
                "recipe": runs[label][seeds[0]]["recipe"],
                "final_val_loss": float(np.mean(val)),
                "final_val_loss_per_seed": val.tolist(),
                "final_train_loss": float(np.mean(trn)),
                "final_train_loss_per_seed": trn.tolist(),
                "rel_gap_val": gap,
                "rel_gap_val_per_seed": gaps.tolist(),
                "rel_gap_train": float(np.mean(gaps_train)),
                "within_noise": bool(finite and abs(gap) <= threshold),
                "tokens_per_s": float(np.mean([runs[label][s]["tokens_per_s"] for s in seeds])),
                "fp8_telemetry": tel,
                "overrides": {k: to_jsonable(v) for k, v in cmp.runs[label].items()},
            }
        )
    return {
        "name": str(cmp.name),
        "baseline": base,
        "seeds": seeds,
        "noise_floor_val": noise,
        "noise_floor_train": noise_train,
        "threshold": threshold,
        "table": table,
    }


def _pct(x: float) -> str:
    return f"{100 * x:+.2f}%" if math.isfinite(x) else "n/a"


def _sci(x: float | None) -> str:
    if x is None or not math.isfinite(x):
        return "-"
    return f"{x:.1e}" if x else "0"


def markdown(results: dict, command: str | None = None, notes: str = "") -> str:
    """The results table in Markdown (one row per label)."""
    base = results["baseline"]
    lines = [f"# Comparison: {results['name']}", ""]
    if notes:
        lines += [notes.strip(), ""]
    lines += [
        f"Seeds: {results['seeds']}. Gap = mean over seeds of the paired relative gap of the "
        f"final validation loss to `{base}`. Noise floor (bf16 seed-to-seed spread of the final "
        f"validation loss, (max-min)/mean): {100 * results['noise_floor_val']:.2f}%. "
        f'"Within" = |gap| <= max(0.25%, noise floor) = {100 * results["threshold"]:.2f}%.',
        "",
        "| run | recipe | final val loss | final train loss | gap to "
        + base
        + " (val) | gap (train) | within | tokens/s | saturated max | flushed mean |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["table"]:
        tel = r["fp8_telemetry"]
        lines.append(
            f"| {r['label']} | {r['recipe']} | {r['final_val_loss']:.4f} | "
            f"{r['final_train_loss']:.4f} | {_pct(r['rel_gap_val'])} | {_pct(r['rel_gap_train'])} | "
            f"{'yes' if r['within_noise'] else 'no'} | {r['tokens_per_s']:,.0f} | "
            f"{_sci(tel.get('saturated_max'))} | {_sci(tel.get('flushed_mean'))} |"
        )
    lines += [
        "",
        "Saturated / flushed: fraction of forward FP8 operand elements clipped to the format max "
        "/ flushed to zero (max over GEMMs and steps; mean over GEMMs and steps).",
        "",
        "![loss curves](loss_curves.png)",
        "",
        "![gap to bf16](gap_to_bf16.png)",
    ]
    if command:
        lines += ["", "Command:", "", "```", command, "```"]
    return "\n".join(lines) + "\n"


def plot(results: dict, run_rows: dict, workdir: Path, smooth: int = 10) -> list[Path]:
    """loss_curves.png and gap_to_bf16.png (means over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["label"] for r in results["table"]]
    base = results["baseline"]
    seeds = results["seeds"]

    def mean_curve(label: str, key: str):
        curves = [_curves(run_rows[label][s], key) for s in seeds]
        # Steps logged by every seed (and the baseline): runs may log extra steps.
        common = set(curves[0][0].tolist())
        for c in curves[1:] + [_curves(run_rows[base][s], key) for s in seeds]:
            common &= set(c[0].tolist())
        steps = np.asarray(sorted(common))
        vals = np.stack([c[1][np.isin(c[0], steps)] for c in curves])
        return steps, vals

    fig, (ax_t, ax_v) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label in labels:
        s, v = mean_curve(label, "loss")
        ax_t.plot(s, _smooth(v.mean(0), smooth), label=label, lw=1.2)
        s, v = mean_curve(label, "val_loss")
        ax_v.plot(s, v.mean(0), marker="o", ms=3, label=label, lw=1.2)
    ax_t.set(
        xlabel="step", ylabel=f"train loss (mean over seeds, {smooth}-step avg)", title="train"
    )
    ax_v.set(xlabel="step", ylabel="validation cross-entropy (nats/byte)", title="validation")
    for ax in (ax_t, ax_v):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{results['name']}: loss curves")
    fig.tight_layout()
    p1 = workdir / "loss_curves.png"
    fig.savefig(p1, dpi=110)
    plt.close(fig)

    fig, (ax_t, ax_v) = plt.subplots(1, 2, figsize=(12, 4.5))
    _, vb = mean_curve(base, "loss")
    svb, vvb = mean_curve(base, "val_loss")
    for label in labels:
        if label == base:
            continue
        s, v = mean_curve(label, "loss")
        # Paired (same seed) relative gap, then the mean over seeds.
        gap_t = (
            (_smooth_rows(v, smooth) - _smooth_rows(vb, smooth)) / _smooth_rows(vb, smooth)
        ).mean(0)
        ax_t.plot(s, 100 * gap_t, label=label, lw=1.2)
        s, v = mean_curve(label, "val_loss")
        ax_v.plot(s, 100 * ((v - vvb) / vvb).mean(0), marker="o", ms=3, label=label, lw=1.2)
    if len(seeds) > 1:
        spread_v = (vvb.max(0) - vvb.min(0)) / vvb.mean(0)
        ax_v.fill_between(
            svb,
            -100 * spread_v,
            100 * spread_v,
            color="gray",
            alpha=0.2,
            label=f"{base} seed spread",
        )
    for ax, what in ((ax_t, "train loss"), (ax_v, "validation loss")):
        ax.axhline(0, color="k", lw=0.8)
        ax.axhspan(-25 * 0.01, 25 * 0.01, color="green", alpha=0.08, label="±0.25%")
        ax.set(xlabel="step", ylabel=f"relative gap of {what} to {base} (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{results['name']}: gap to {base}")
    fig.tight_layout()
    p2 = workdir / "gap_to_bf16.png"
    fig.savefig(p2, dpi=110)
    plt.close(fig)
    return [p1, p2]


def _smooth_rows(v: np.ndarray, window: int) -> np.ndarray:
    return np.stack([_smooth(row, window) for row in v])


def run_comparison(config, workdir: str | Path, *, command: str | None = None, stream=None) -> dict:
    """Train every (label, seed), then write results.json, results.md and the plots."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    cmp = config.compare
    labels = list(cmp.labels)
    if str(cmp.baseline) not in labels:
        raise ValueError(f"baseline {cmp.baseline!r} is not among compare.labels {labels}")
    missing = [lab for lab in labels if lab not in cmp.runs]
    if missing:
        raise ValueError(f"compare.runs has no entry for {missing}")
    run_root = Path(str(cmp.get("run_root", "") or "") or workdir / "runs")
    runs: dict[str, dict[int, dict]] = {label: {} for label in labels}
    run_rows: dict[str, dict[int, list]] = {label: {} for label in labels}
    dirs: dict[str, dict[int, str]] = {label: {} for label in labels}
    for seed in cmp.seeds:
        for label in labels:
            rc = run_config(config, label, int(seed))
            rdir = run_dir(run_root, rc, int(seed))
            print(f"== {cmp.name}: {label} seed {seed} -> {rdir}", file=stream, flush=True)
            summary = train(rc, rdir, stream=stream)
            runs[label][int(seed)] = summary
            run_rows[label][int(seed)] = read_jsonl(rdir / "metrics.jsonl")
            dirs[label][int(seed)] = str(rdir)
    results = aggregate(config, runs, run_rows)
    results["run_dirs"] = dirs
    results["command"] = command
    results["config"] = to_jsonable(config)
    notes = str(cmp.get("notes", ""))
    results["notes"] = notes
    (workdir / "results.json").write_text(json.dumps(to_jsonable(results), indent=2) + "\n")
    (workdir / "results.md").write_text(markdown(results, command, notes))
    plot(results, run_rows, workdir, smooth=int(cmp.get("smooth", 10)))
    return results


def headline_table(result_dirs: list[str | Path]) -> str:
    """One Markdown table over several comparisons' results.json (non-baseline rows)."""
    lines = [
        "| comparison | run (recipe) | final val loss | gap to bf16 | bf16 noise floor | within "
        "| saturated max | flushed mean |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for d in result_dirs:
        res = json.loads((Path(d) / "results.json").read_text())
        for r in res["table"]:
            if r["label"] == res["baseline"]:
                continue
            tel = r["fp8_telemetry"]
            lines.append(
                f"| {res['name']} | {r['label']} ({r['recipe']}) | {r['final_val_loss']:.4f} | "
                f"{_pct(r['rel_gap_val'])} | {100 * res['noise_floor_val']:.2f}% | "
                f"{'yes' if r['within_noise'] else 'no'} | {_sci(tel.get('saturated_max'))} | "
                f"{_sci(tel.get('flushed_mean'))} |"
            )
    return "\n".join(lines) + "\n"
