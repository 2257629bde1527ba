"""Do the monitors move before the loss does?  Lead times from a run's metrics rows.

For one run (its metrics.jsonl rows), :func:`loss_event` finds the first
logged step where the training loss is non-finite or rises more than
``spike`` (relative) above its lowest value so far, and
:func:`first_crossings` the first logged step where each monitor crosses
its threshold at any site.  :func:`lead_table` puts them side by side per
run: a positive lead is how many steps a monitor warned before the loss.

Thresholds (:data:`THRESHOLDS`; what each monitor means: :mod:`fp8jax.monitors`):

* ``outlier_ratio`` > 448 / 2^-6 = 28672: one scale per tensor would put the
  median SwiGLU channel's largest value below E4M3's smallest normal;
* ``align_max`` > 0.9: a gate and an up column nearly parallel (a chosen
  level, far above the random baseline of :func:`fp8jax.monitors.
  random_alignment_max`; the papers give no number);
* ``amax_growth`` > 2: an operand's amax doubled past everything in the
  preceding window (a delayed scale with that history clips it by 2x);
* ``noise_ratio`` < sqrt(3): "FP4 All the Way"'s floor for block-format
  gradients.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

from fp8jax.monitors import NOISE_RATIO_FLOOR
from fp8jax.train.run_log import as_float
from fp8jax.train.telemetry_plot import split_key

# monitor -> (comparison that warns, threshold)
THRESHOLDS: dict[str, tuple[str, float]] = {
    "outlier_ratio": (">", 448.0 / 2.0**-6),
    "align_max": (">", 0.9),
    "amax_growth": (">", 2.0),
    "noise_ratio": ("<", NOISE_RATIO_FLOOR),
}
_OPS = {">": operator.gt, "<": operator.lt}


def loss_event(rows: Sequence[dict], spike: float = 0.1) -> int | None:
    """First logged step whose loss is non-finite or > (1 + spike) x the lowest loss before it."""
    best = math.inf
    for r in rows:
        if "loss" not in r:
            continue
        loss = as_float(r["loss"])
        if not math.isfinite(loss) or (math.isfinite(best) and loss > (1 + spike) * best):
            return int(r["step"])
        best = min(best, loss)
    return None


def first_crossings(
    rows: Sequence[dict], thresholds: dict[str, tuple[str, float]] = THRESHOLDS
) -> dict[str, dict]:
    """monitor -> {"step": first crossing step or None, "site": where, "extreme": worst value}.

    ``extreme``: the largest value reached (smallest for a "<" monitor) over
    all sites and logged steps (NaN when the monitor was never logged).
    """
    out = {m: {"step": None, "site": None, "extreme": math.nan} for m in thresholds}
    for r in rows:
        for key, value in r.items():
            parsed = split_key(key)
            if parsed is None or parsed[1] not in thresholds:
                continue
            site, stat = parsed
            v = as_float(value)
            if math.isnan(v):
                continue
            op, level = thresholds[stat]
            rec = out[stat]
            worse = max if op == ">" else min
            rec["extreme"] = v if math.isnan(rec["extreme"]) else worse(rec["extreme"], v)
            if rec["step"] is None and _OPS[op](v, level):
                rec["step"], rec["site"] = int(r["step"]), site
    return out


def lead_table(runs: dict[str, Sequence[dict]], spike: float = 0.1) -> str:
    """Markdown: per run, the loss event step and each monitor's crossing, lead and extreme."""
    monitors = list(THRESHOLDS)
    head = "| run | last step | loss event | " + " | ".join(
        f"{m} ({THRESHOLDS[m][0]} {THRESHOLDS[m][1]:.4g}): step / lead / extreme" for m in monitors
    )
    lines = [head + " |", "|" + "---|" * (3 + len(monitors))]
    for label, rows in runs.items():
        steps = [int(r["step"]) for r in rows if "loss" in r]
        event = loss_event(rows, spike)
        cross = first_crossings(rows)
        cells = []
        for m in monitors:
            c = cross[m]
            lead = "-" if c["step"] is None or event is None else str(event - c["step"])
            step = "-" if c["step"] is None else str(c["step"])
            cells.append(f"{step} / {lead} / {c['extreme']:.3g}")
        last = steps[-1] if steps else 0
        lines.append(
            f"| {label} | {last} | {'-' if event is None else event} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines)
