"""Do the monitors move before the loss does?  Lead times from a run's metrics rows.

For one run (its metrics.jsonl rows), :func:`loss_event` finds the first
logged step where the training loss is non-finite or rises more than
``spike`` (relative) above its lowest value so far, or above a baseline run
that saw the same batches (the stress comparison: bf16 at the same seed;
losses averaged over 10 logged steps), and
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

from fp8jax.lab.telemetry_plot import split_key
from fp8jax.monitors import NOISE_RATIO_FLOOR
from fp8jax.train.run_log import as_float

# monitor -> (comparison that warns, threshold)
THRESHOLDS: dict[str, tuple[str, float]] = {
    "outlier_ratio": (">", 448.0 / 2.0**-6),
    "align_max": (">", 0.9),
    "amax_growth": (">", 2.0),
    "noise_ratio": ("<", NOISE_RATIO_FLOOR),
}
_OPS = {">": operator.gt, "<": operator.lt}


def loss_event(
    rows: Sequence[dict],
    spike: float = 0.1,
    window: int = 1,
    baseline: Sequence[dict] | None = None,
) -> int | None:
    """First logged step whose training loss is non-finite or ``spike`` (relative) too high.

    Without ``baseline``: too high is above the run's own best so far.  With
    ``baseline`` (the rows of a reference run that saw the same batches,
    e.g. bf16 at the same seed): above that run's loss at the same step, so
    a rise every run shares (a harder stretch of data) is no event; steps
    the baseline did not log are skipped.

    With ``window`` > 1 the value compared is the mean over the last
    ``window`` logged steps (from the ``window``-th on): a training loss is
    one batch's, and at a high learning rate single batches swing by more
    than 10%.  A non-finite loss is an event at once, smoothed or not.
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    ref = None
    if baseline is not None:
        ref = {int(r["step"]): as_float(r["loss"]) for r in baseline if "loss" in r}
    best, recent = math.inf, []
    for r in rows:
        if "loss" not in r:
            continue
        loss = as_float(r["loss"])
        if not math.isfinite(loss):
            return int(r["step"])
        if ref is not None:
            base = ref.get(int(r["step"]))
            if base is None or not math.isfinite(base) or base <= 0:
                continue
            loss = loss / base
        recent = (recent + [loss])[-window:]
        if len(recent) < window:
            continue
        level = sum(recent) / window
        limit = (1 + spike) * (1.0 if ref is not None else best)
        if math.isfinite(limit) and level > limit:
            return int(r["step"])
        best = min(best, level)
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


# Logged steps whose training losses are averaged before looking for a loss
# event (10 at the stress comparison's log cadence of 10 steps: 100 steps).
LOSS_WINDOW = 10


def lead_records(
    runs: dict[str, Sequence[dict]],
    spike: float = 0.1,
    window: int = LOSS_WINDOW,
    baselines: dict[str, Sequence[dict]] | None = None,
) -> list[dict]:
    """Per run: its last step, loss event and each monitor's crossing, lead and extreme.

    One dict per run, in the order of ``runs``: ``run``, ``last_step``,
    ``loss_event`` (a step, None for none, or "no baseline") and
    ``monitors``: monitor -> {"step", "site", "extreme", "lead"} (lead: the
    loss event's step minus the crossing's, None when either is missing).
    The loss event is :func:`loss_event` with ``spike``, ``window`` and the
    run's entry of ``baselines`` (if any).  With ``baselines``, a run whose
    baseline is missing gets no event ("no baseline") rather than an event
    by the other rule.
    """
    records = []
    for label, rows in runs.items():
        steps = [int(r["step"]) for r in rows if "loss" in r]
        base = None if baselines is None else baselines.get(label)
        missing = baselines is not None and base is None
        event = None if missing else loss_event(rows, spike, window, base)
        monitors = {}
        for m, c in first_crossings(rows).items():
            lead = None if c["step"] is None or event is None else event - c["step"]
            monitors[m] = {**c, "lead": lead}
        records.append(
            {
                "run": label,
                "last_step": steps[-1] if steps else 0,
                "loss_event": "no baseline" if missing else event,
                "monitors": monitors,
            }
        )
    return records


def format_lead_table(records: Sequence[dict]) -> str:
    """Markdown of :func:`lead_records` (also as read back from JSON: null extremes are NaN)."""
    monitors = list(THRESHOLDS)
    head = "| run | last step | loss event | " + " | ".join(
        f"{m} ({THRESHOLDS[m][0]} {THRESHOLDS[m][1]:.4g}): step / lead / extreme" for m in monitors
    )
    lines = [head + " |", "|" + "---|" * (3 + len(monitors))]
    for rec in records:
        cells = []
        for m in monitors:
            c = rec["monitors"][m]
            step = "-" if c["step"] is None else str(c["step"])
            lead = "-" if c["lead"] is None else str(c["lead"])
            cells.append(f"{step} / {lead} / {as_float(c['extreme']):.3g}")
        event = "-" if rec["loss_event"] is None else rec["loss_event"]
        lines.append(f"| {rec['run']} | {rec['last_step']} | {event} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def lead_table(
    runs: dict[str, Sequence[dict]],
    spike: float = 0.1,
    window: int = LOSS_WINDOW,
    baselines: dict[str, Sequence[dict]] | None = None,
) -> str:
    """Markdown: per run, the loss event step and each monitor's crossing, lead and extreme.

    :func:`format_lead_table` of :func:`lead_records` (same arguments).
    """
    return format_lead_table(lead_records(runs, spike, window, baselines))
