"""Recipe comparisons: train recipes x seeds on the same data, then tabulate and plot.

A comparison config is a training config (see ``configs/tiny.py``) plus a
``compare`` block (built by ``fp8jax.train.defaults.comparison_block``):

    compare.name      title of the comparison
    compare.labels    run labels, in table order (the baseline first)
    compare.baseline  label of the reference run (normally "bf16")
    compare.seeds     model-init / batch-order seeds; every label runs every seed
    compare.notes     what the comparison is, for the table
    compare.smooth    moving-average window of the plotted train-loss curves
    compare.runs.<label>   ConfigDict(recipe=..., <any top-level config field>=...)
    compare.contrasts (optional) "a:b" pairs of labels compared directly, e.g.
                      "dgrad_blocks:tile_block" (see Statistics)

A label names a run, not a recipe: several labels may train the same recipe.
Each (label, seed) trains with :func:`fp8jax.train.loop.train` in
``<workdir>/runs/<recipe>-<hash of its training config>/seed<k>``: every run
stays under the comparison's own workdir; an interrupted comparison resumes,
a finished run is only re-read, and two labels with identical training
configs share one run.  Runs go seed by seed, so a partial comparison already
pairs every label with the baseline.  A run that diverges is recorded as such
(its final losses are NaN) and the comparison goes on.

Statistics.  All runs with the same seed see the same initialization and the
same batches, so gaps are *paired*: per seed,
``gap_s = (val(label, s) - val(baseline, s)) / val(baseline, s)``; the table
gives the per-seed gaps, their mean and a 95% t-interval over seeds
(``mean +- t(0.975, n - 1) * sd / sqrt(n)``, sample standard deviation;
:mod:`fp8jax.lab.stats`).
DeepSeek-V3's criterion, a relative gap within 0.25%, holds when the whole
interval lies inside +-0.25%; an interval wider than 0.5% cannot lie inside
it (unless centred exactly), so the table then says the run cannot resolve
0.25% rather than claiming either way.  The same statistics are computed for
the training loss (mean of the last ``final_window`` logged steps).  A
contrast "a:b" applies the same paired statistics to label a against label b
(``(val(a, s) - val(b, s)) / val(b, s)``): two variants of one recipe
compared with each other rather than each with the baseline.

Outputs in the workdir: ``results.json`` (per label: per-seed values, means,
intervals, verdict), ``results.md`` (Markdown table), ``loss_curves.png``
(train and validation loss vs step, mean over seeds) and ``gap_to_bf16.png``
(paired relative gap to the baseline vs step: mean over seeds, its 95%
interval shaded, each seed as a thin line, the +-0.25% band), drawn by
:mod:`fp8jax.lab.compare_plot`.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
from pathlib import Path

import ml_collections
import numpy as np

from fp8jax.lab.compare_plot import plot
from fp8jax.lab.stats import (
    DEEPSEEK_TOLERANCE,
    VERDICT_TEXT,
    interval_text,
    mean_interval,
    pct,
    prediction_interval,
    stats_from_json,
    verdict,
)
from fp8jax.parallel.mesh import maybe_initialize_distributed
from fp8jax.train import preflight, provenance
from fp8jax.train.compiled import StepCache
from fp8jax.train.defaults import (
    OPTIONAL_BLOCKS,
    ConfigError,
    check_workdir,
    model_config,
    seq_len,
    validate,
)
from fp8jax.train.loop import TrainingDiverged, load_data, summarize, train, train_loss_key
from fp8jax.train.run_log import as_float, read_jsonl, to_jsonable

COMPARE_FIELDS = ("name", "labels", "baseline", "seeds", "notes", "smooth", "runs")
OPTIONAL_COMPARE_FIELDS = ("contrasts",)


# --- runs --------------------------------------------------------------------


def run_config(config, label: str, seed: int):
    """The training config of one (label, seed) run: base fields + the run's overrides."""
    c = copy.deepcopy(config)
    with c.unlocked():
        del c["compare"]
    run = config.compare.runs[label]
    for key, value in run.items():
        if key in OPTIONAL_BLOCKS:
            # A run's block fields update the base config's block (if any);
            # the run records the whole block, every field written out.
            merged = c[key].to_dict() if key in c else {}
            merged.update(
                value.to_dict() if isinstance(value, ml_collections.ConfigDict) else value
            )
            try:
                block = OPTIONAL_BLOCKS[key](**merged)
            except ValueError as e:
                raise ConfigError(f"compare.runs.{label}: {e}") from None
            with c.unlocked():
                c[key] = block
            continue
        if key not in c:
            raise ConfigError(f"compare.runs.{label}.{key}: not a field of the training config")
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


def validate_comparison(config: ml_collections.ConfigDict, workdir: str | Path) -> Path:
    """ConfigError (one line) for a bad comparison config or workdir; checks every run's config.

    Loads each distinct corpus once to check it fits the runs' sequence length.
    Creates nothing.
    """
    if "compare" not in config:
        raise ConfigError(
            "not a comparison config (it has no 'compare' block): train it with "
            "python experiments/train.py --config=FILE --workdir=DIR"
        )
    validate(config, extra=("compare",))
    cmp = config.compare
    for name in cmp:
        if name not in COMPARE_FIELDS + OPTIONAL_COMPARE_FIELDS:
            raise ConfigError(
                f"unknown field compare.{name}; fields: "
                f"{', '.join(COMPARE_FIELDS + OPTIONAL_COMPARE_FIELDS)}"
                + (" (runs live under --workdir/runs)" if name == "run_root" else "")
            )
    for name in COMPARE_FIELDS:
        if name not in cmp:
            raise ConfigError(f"compare.{name} is missing (build it with comparison_block)")
    labels = list(cmp.labels)
    if str(cmp.baseline) not in labels:
        raise ConfigError(f"baseline {cmp.baseline!r} is not among compare.labels {labels}")
    missing = [lab for lab in labels if lab not in cmp.runs]
    if missing:
        raise ConfigError(f"compare.runs has no entry for {missing}")
    for a, b in contrast_pairs(cmp):
        if a not in labels or b not in labels:
            raise ConfigError(f"compare.contrasts: {a}:{b} names a label not in {labels}")
    if not list(cmp.seeds):
        raise ConfigError("compare.seeds is empty: give at least one seed (two for an interval)")
    workdir = check_workdir(workdir)
    # Before anything touches a device (several processes), as a run's setup does.
    maybe_initialize_distributed(config.mesh)
    checked: set[str] = set()
    for label in labels:
        rc = run_config(config, label, int(cmp.seeds[0]))
        try:
            validate(rc)
            # Every run's mesh, batch split and memory, before the first run trains.
            mcfg = model_config(rc)
            sizes = preflight.resolve_mesh(rc)
            preflight.check_batches(rc, sizes)
            preflight.check_memory(rc, mcfg, seq_len(rc, mcfg), math.prod(sizes.values()))
        except ConfigError as e:
            raise ConfigError(f"compare.runs.{label}: {e}") from None
        n = seq_len(rc, model_config(rc))
        key = json.dumps([to_jsonable(rc.data), n], sort_keys=True)
        if key not in checked:
            load_data(rc, n)
            checked.add(key)
    return workdir


def contrast_pairs(cmp) -> list[tuple[str, str]]:
    """The ``compare.contrasts`` entries "a:b" as (a, b) pairs (none when absent)."""
    pairs = []
    for spec in cmp.get("contrasts", None) or ():
        a, sep, b = str(spec).partition(":")
        if not (sep and a and b):
            raise ConfigError(f"compare.contrasts: {spec!r} is not 'label:label'")
        pairs.append((a, b))
    return pairs


def _diverged_summary(rdir: Path, rc, step: int) -> dict:
    s = summarize(read_jsonl(rdir / "metrics.jsonl"), int(rc.final_window))
    # A diverged run has no final losses: NaN keeps it out of every mean.
    s[train_loss_key(s)] = math.nan
    s.update(final_val_loss=math.nan, recipe=str(rc.recipe), diverged_at=step)
    return s


# --- statistics --------------------------------------------------------------


def run_records(run_dirs: dict[str, dict[int, str]]) -> dict[str, dict]:
    """The provenance record of every run (``config.json``'s "provenance"), by "label/seedK"."""
    records = {}
    for label, by_seed in run_dirs.items():
        for seed, rdir in by_seed.items():
            cfg = json.loads((Path(rdir) / "config.json").read_text())
            records[f"{label}/seed{seed}"] = cfg.get("provenance") or {}
    return records


def provenance_summary(records: dict[str, dict]) -> dict:
    """One commit, clean or not, the machine types and each label's GEMM paths."""
    commits = sorted({(r.get("git") or {}).get("commit") or "unknown" for r in records.values()})
    machines = sorted(
        {provenance.machine_type(r["machine"]) for r in records.values() if r.get("machine")}
    )
    paths: dict[str, dict[str, str]] = {}
    for name, r in records.items():
        label = name.rsplit("/seed", 1)[0]
        paths.setdefault(label, r.get("gemm_paths") or {})
    return {
        "commits": commits,
        "clean": all(r.get("git") and not r["git"].get("dirty") for r in records.values()),
        "machines": machines,
        "gemm_paths": paths,
        "problems": provenance.check_same_code(records),
        "n_runs": len(records),
    }


def aggregate(config, runs: dict[str, dict[int, dict]], run_rows: dict) -> dict:
    """Per-label statistics: per-seed paired gaps to the baseline, means, 95% t-intervals."""
    cmp = config.compare
    base = str(cmp.baseline)
    seeds = [int(s) for s in cmp.seeds]

    def per_seed(label: str, key: str | None = None) -> np.ndarray:
        vals = []
        for s in seeds:
            summary = runs[label][s]
            vals.append(as_float(summary[key or train_loss_key(summary)]))
        return np.asarray(vals, dtype=np.float64)

    base_val = per_seed(base, "final_val_loss")
    base_train = per_seed(base)
    spread = float((base_val.max() - base_val.min()) / base_val.mean()) if len(seeds) > 1 else 0.0
    table = []
    for label in cmp.labels:
        val = per_seed(label, "final_val_loss")
        trn = per_seed(label)
        gap_val = mean_interval((val - base_val) / base_val)
        gap_train = mean_interval((trn - base_train) / base_train)
        tel: dict[str, float] = {}
        for s in seeds:
            for k, v in runs[label][s]["fp8_telemetry"].items():
                tel[k] = (
                    max(tel.get(k, -math.inf), v) if "max" in k else tel.get(k, 0) + v / len(seeds)
                )
        diverged = {
            s: runs[label][s]["diverged_at"] for s in seeds if "diverged_at" in runs[label][s]
        }
        table.append(
            {
                "label": label,
                "recipe": runs[label][seeds[0]]["recipe"],
                "final_val_loss": mean_interval(val),
                "train_loss_last_mean": mean_interval(trn),
                "gap_val": gap_val,
                "gap_train": gap_train,
                "verdict": "baseline" if label == base else verdict(gap_val),
                "within_0.25%": label != base and verdict(gap_val) == "within",
                "diverged_at": diverged,
                "tokens_per_s": float(
                    np.nanmean([as_float(runs[label][s]["tokens_per_s"]) for s in seeds])
                ),
                "fp8_telemetry": tel,
                "overrides": {k: to_jsonable(v) for k, v in cmp.runs[label].items()},
            }
        )
    contrasts = []
    for a, b in contrast_pairs(cmp):
        va, vb = per_seed(a, "final_val_loss"), per_seed(b, "final_val_loss")
        gap = mean_interval((va - vb) / vb)
        contrasts.append({"label": a, "reference": b, "gap_val": gap, "verdict": verdict(gap)})
    return {
        "name": str(cmp.name),
        "baseline": base,
        "seeds": seeds,
        "level": 0.95,
        "tolerance": DEEPSEEK_TOLERANCE,
        "train_loss_window": int(config.final_window),
        "baseline_seed_spread_val": spread,
        "table": table,
        "contrasts": contrasts,
    }


def _sci(x: float | None) -> str:
    if x is None or not math.isfinite(x):
        return "-"
    return f"{x:.1e}" if x else "0"


def _seeds(st: dict) -> str:
    return ", ".join(pct(x) for x in st["per_seed"])


def provenance_text(prov: dict) -> str:
    """One paragraph: which commit and machine made the runs, and what does not agree."""
    commits = ", ".join(c[:12] for c in prov["commits"])
    tree = "a clean tree" if prov["clean"] else "a MODIFIED tree"
    text = (
        f"Code: commit {commits}, {tree}, for all {prov['n_runs']} runs. "
        f"Machine: {'; '.join(prov['machines']) or 'not recorded'}."
    )
    if prov["problems"]:
        text += " Provenance problems: " + "; ".join(prov["problems"]) + "."
    return text


def markdown(results: dict, command: str | None = None, notes: str = "") -> str:
    """The results table in Markdown (one row per label)."""
    base = results["baseline"]
    n = len(results["seeds"])
    lines = [f"# Comparison: {results['name']}", ""]
    if notes:
        lines += [notes.strip(), ""]
    lines += [
        f"Seeds: {results['seeds']} (each seed: the same initialization and batch order for "
        f"every run). Gap = paired relative gap of the final validation loss to `{base}`, per "
        f"seed; the table gives its mean and 95% t-interval over the {n} seeds. "
        '"Within 0.25%" = the whole interval inside +-0.25%; an interval wider than 0.5% '
        "cannot resolve 0.25%. "
        f"Train loss: mean of the last {results['train_loss_window']} logged steps. "
        f"{base} seed-to-seed spread of the final validation loss, (max-min)/mean: "
        f"{100 * results['baseline_seed_spread_val']:.2f}%.",
        "",
    ]
    prov = results.get("provenance")
    paths = prov["gemm_paths"] if prov else {}
    if prov:
        lines += [provenance_text(prov), ""]
    lines += [
        f"| run | recipe | GEMM path | final val loss | val gap to {base} [95% CI] | per-seed "
        "val gaps | within 0.25% | train gap [95% CI] | tokens/s | saturated max | flushed mean |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["table"]:
        tel = r["fp8_telemetry"]
        verdict_text = VERDICT_TEXT[r["verdict"]]
        if r["diverged_at"]:
            verdict_text += (
                " (diverged: "
                + ", ".join(f"seed {s} at step {k}" for s, k in r["diverged_at"].items())
                + ")"
            )
        is_base = r["label"] == base
        lines.append(
            f"| {r['label']} | {r['recipe']} | {provenance.paths_text(paths.get(r['label']))} | "
            f"{r['final_val_loss']['mean']:.4f} | "
            f"{'--' if is_base else interval_text(r['gap_val'])} | "
            f"{'--' if is_base else _seeds(r['gap_val'])} | {verdict_text} | "
            f"{'--' if is_base else interval_text(r['gap_train'])} | {r['tokens_per_s']:,.0f} | "
            f"{_sci(tel.get('saturated_max'))} | {_sci(tel.get('flushed_mean'))} |"
        )
    if results.get("contrasts"):
        lines += [
            "",
            "Contrasts: the same paired statistics between two runs (gap of the first to the "
            "second).",
            "",
            "| run | vs | val gap [95% CI] | per-seed val gaps | within 0.25% |",
            "|---|---|---|---|---|",
        ]
        for c in results["contrasts"]:
            gap = stats_from_json(c["gap_val"])
            lines.append(
                f"| {c['label']} | {c['reference']} | {interval_text(gap)} | {_seeds(gap)} | "
                f"{VERDICT_TEXT[c['verdict']]} |"
            )
    lines += [
        "",
        "Saturated / flushed: fraction of forward FP8 operand elements clipped to the format max "
        "/ flushed to zero (max over GEMMs and steps; mean over GEMMs and steps).",
        "",
        "![loss curves](loss_curves.png)",
        "",
        f"![gap to {base}](gap_to_bf16.png)",
    ]
    if command:
        lines += ["", "Command:", "", "```", command, "```"]
    return "\n".join(lines) + "\n"


def run_comparison(
    config,
    workdir: str | Path,
    *,
    command: str | None = None,
    stream=None,
    allow_mixed_code: bool = False,
) -> dict:
    """Train every (label, seed) under ``workdir/runs``, then write results and plots.

    Checks the whole comparison first (ConfigError, nothing created).  The
    runs of one comparison must come from one commit and a clean tree: a
    modified tree is refused before anything runs, and runs that record
    different commits (or a modified tree) are refused before they are
    tabulated, unless ``allow_mixed_code`` (the table then says so).  The
    returned results hold ``markdown``, the text of results.md.
    """
    workdir = validate_comparison(config, workdir)
    provenance.require_clean_tree(allow_mixed_code)
    cmp = config.compare
    labels = list(cmp.labels)
    run_root = workdir / "runs"
    runs: dict[str, dict[int, dict]] = {label: {} for label in labels}
    run_rows: dict[str, dict[int, list]] = {label: {} for label in labels}
    dirs: dict[str, dict[int, str]] = {label: {} for label in labels}
    # One compilation per distinct training step, shared by every seed.
    steps = StepCache()
    for seed in cmp.seeds:
        for label in labels:
            rc = run_config(config, label, int(seed))
            rdir = run_dir(run_root, rc, int(seed))
            print(f"== {cmp.name}: {label} seed {seed} -> {rdir}", file=stream, flush=True)
            try:
                summary = train(rc, rdir, stream=stream, steps=steps)
            except TrainingDiverged as e:
                print(f"{label} seed {seed}: {e}", file=stream, flush=True)
                summary = _diverged_summary(rdir, rc, e.step)
            runs[label][int(seed)] = summary
            run_rows[label][int(seed)] = read_jsonl(rdir / "metrics.jsonl")
            dirs[label][int(seed)] = str(rdir)
    prov = provenance_summary(run_records(dirs))
    if prov["problems"] and not allow_mixed_code:
        raise ConfigError(
            "these runs cannot be tabulated together: "
            + "; ".join(prov["problems"])
            + " (rerun them at one commit, or pass --allow_mixed_code)"
        )
    results = aggregate(config, runs, run_rows)
    results["provenance"] = prov
    results["run_dirs"] = dirs
    results["command"] = command
    results["config"] = to_jsonable(config)
    notes = str(cmp.notes)
    results["notes"] = notes
    (workdir / "results.json").write_text(json.dumps(to_jsonable(results), indent=2) + "\n")
    text = markdown(results, command, notes)
    (workdir / "results.md").write_text(text)
    plot(results, run_rows, workdir, smooth=int(cmp.smooth))
    results["markdown"] = text
    return results


def reproduction_check(committed: dict, rerun: dict, level: float = 0.95) -> list[dict]:
    """Does a rerun on another machine reproduce a committed comparison?

    Per-seed values do not carry across machines (last-bit differences grow
    during training), so each rerun seed's paired gap is checked against the
    committed per-seed gaps of the same label: it reproduces when it falls in
    their ``level`` prediction interval for one new seed, mean +- t(n - 1) *
    sd * sqrt(1 + 1/n).  ``committed`` and ``rerun`` are results.json dicts.
    Returns one row per (label, rerun seed): gap, interval, inside.
    """
    ref = {r["label"]: r for r in committed["table"]}
    rows = []
    for r in rerun["table"]:
        if r["label"] == rerun["baseline"] or r["label"] not in ref:
            continue
        gaps = ref[r["label"]]["gap_val"]["per_seed"]
        if len(gaps) < 2:
            raise ValueError(
                f"{r['label']}: the committed comparison has {len(gaps)} seed(s); need 2+"
            )
        lo, hi = prediction_interval(gaps, level)
        for seed, gap in zip(rerun["seeds"], r["gap_val"]["per_seed"]):
            gap = as_float(gap)
            rows.append(
                {
                    "label": r["label"],
                    "seed": int(seed),
                    "gap": gap,
                    "lo": lo,
                    "hi": hi,
                    "inside": bool(lo <= gap <= hi),
                }
            )
    return rows


def headline_table(result_dirs: list[str | Path]) -> str:
    """One Markdown table over several comparisons' results.json (non-baseline rows).

    Each row's gap is to its own comparison's baseline (named in the row).
    """
    lines = [
        "| comparison | run (recipe) | baseline | commit | GEMM path | final val loss "
        "| val gap [95% CI] | per seed | within 0.25% | saturated max | flushed mean |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for d in result_dirs:
        res = json.loads((Path(d) / "results.json").read_text())
        prov = res.get("provenance") or {"commits": ["?"], "gemm_paths": {}}
        commit = ", ".join(c[:10] for c in prov["commits"])
        for r in res["table"]:
            if r["label"] == res["baseline"]:
                continue
            tel = r["fp8_telemetry"]
            gap = stats_from_json(r["gap_val"])
            path = provenance.paths_text(prov["gemm_paths"].get(r["label"]))
            lines.append(
                f"| {res['name']} | {r['label']} ({r['recipe']}) | {res['baseline']} | "
                f"{commit} | {path} | "
                f"{as_float(r['final_val_loss']['mean']):.4f} | {interval_text(gap)} | "
                f"{_seeds(gap)} | {VERDICT_TEXT[r['verdict']]} | "
                f"{_sci(tel.get('saturated_max'))} | {_sci(tel.get('flushed_mean'))} |"
            )
    return "\n".join(lines) + "\n"
