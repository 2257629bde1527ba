"""Lead times of the monitors over the loss, and the stress comparison at a handful of steps."""

import json
import math
from pathlib import Path

import pytest

from fp8jax.lab import stress
from fp8jax.train.defaults import config_file

ROOT = Path(__file__).resolve().parents[1]


def _rows():
    rows = []
    for step, loss, ratio, noise in [
        (10, 3.0, 5.0, 10.0),
        (20, 2.5, 4e4, 9.0),  # outlier ratio crosses 28672 here
        (30, 2.4, 5e4, 1.5),  # noise ratio falls below sqrt(3) here
        (40, 2.8, 6e4, None),  # loss 2.8 > 1.1 x 2.4: the loss event
    ]:
        rows.append(
            {
                "step": step,
                "loss": loss,
                "layers/layer0/ffn/swiglu/outlier_ratio": ratio,
                "layers/layer0/ffn/swiglu/align_max": 0.3,
                "layers/layer1/moe/experts_w2/dy/noise_ratio": noise,
            }
        )
        rows.append({"step": step, "val_loss": loss})
    return rows


def test_loss_event_spike_and_nonfinite():
    assert stress.loss_event(_rows()) == 40
    assert stress.loss_event(_rows(), spike=0.2) is None
    assert stress.loss_event([{"step": 1, "loss": 3.0}, {"step": 2, "loss": None}]) == 2


def test_loss_event_on_the_smoothed_loss_ignores_single_batches():
    # Batches alternate 2.0 / 2.6 (+30%): raw, the first high batch is an
    # event; averaged over 4 logged steps the level stays 2.3 until the
    # losses rise for good (3.0 from step 110 on): the trailing mean at step
    # 110, (2.6 + 2.0 + 2.6 + 3.0) / 4 = 2.55, is 11% above 2.3.
    losses = [2.0, 2.6] * 5 + [3.0] * 6
    rows = [{"step": 10 * (i + 1), "loss": v} for i, v in enumerate(losses)]
    assert stress.loss_event(rows) == 20
    assert stress.loss_event(rows, window=4) == 110
    assert stress.loss_event(rows[:10], window=4) is None
    assert stress.loss_event(rows[:3] + [{"step": 40, "loss": float("nan")}], window=4) == 40
    with pytest.raises(ValueError, match="window"):
        stress.loss_event(rows, window=0)


def test_loss_event_against_a_baseline_ignores_what_both_runs_share():
    # Both runs climb from 2.0 to 2.6 (harder data): no event against the
    # baseline; from step 60 the run is 8% above the baseline: an event once
    # the 2-step mean of the ratio passes 6% (step 70), not at 60 (4%).
    base = [{"step": 10 * (i + 1), "loss": 2.0 + 0.1 * i} for i in range(7)]
    run = [dict(r) for r in base]
    assert stress.loss_event(run, spike=0.06) == 30
    assert stress.loss_event(run, spike=0.06, baseline=base) is None
    for r in run[5:]:
        r["loss"] *= 1.08
    assert stress.loss_event(run, spike=0.06, window=2, baseline=base) == 70
    # Steps the baseline did not log are skipped.
    assert stress.loss_event(run, spike=0.06, window=2, baseline=base[:6]) is None


def test_first_crossings_and_extremes():
    c = stress.first_crossings(_rows())
    assert c["outlier_ratio"] == {"step": 20, "site": "layer0/ffn/swiglu", "extreme": 6e4}
    assert c["noise_ratio"]["step"] == 30 and c["noise_ratio"]["extreme"] == 1.5
    assert c["align_max"]["step"] is None and c["align_max"]["extreme"] == 0.3
    assert c["amax_growth"]["step"] is None and math.isnan(c["amax_growth"]["extreme"])


def test_lead_table_gives_the_lead_in_steps():
    table = stress.lead_table({"run a": _rows()}, window=1)
    row = table.splitlines()[2]
    assert row.startswith(
        "| run a | 40 | 40 | 20 / 20 / 6e+04 | - / - / 0.3 | - / - / nan | 30 / 10 / 1.5 |"
    )


def test_lead_table_without_the_runs_baseline_says_so():
    # A baseline that is missing must not turn into the other rule (own best).
    rows = [{"step": 10 * (i + 1), "loss": 2.0 + 0.1 * i} for i in range(7)]
    table = stress.lead_table({"a": rows, "b": rows}, spike=0.06, window=1, baselines={"a": rows})
    a, b = table.splitlines()[2:4]
    assert a.startswith("| a | 70 | - |")
    assert b.startswith("| b | 70 | no baseline |")
    assert (
        stress.lead_table({"b": rows}, spike=0.06, window=1)
        .splitlines()[2]
        .startswith("| b | 70 | 30 |")
    )


def test_lead_records_read_back_from_json_give_the_same_table():
    from fp8jax.train.run_log import to_jsonable

    rows = [{"step": 10 * (i + 1), "loss": 2.0 + 0.1 * i} for i in range(7)]
    runs = {"run a": _rows(), "b": rows}
    records = stress.lead_records(runs, window=1, baselines={"run a": _rows()})
    assert records[0]["monitors"]["outlier_ratio"] == {
        "step": 20,
        "site": "layer0/ffn/swiglu",
        "extreme": 6e4,
        "lead": None,  # against its own rows as the baseline, no loss event
    }
    assert records[1]["loss_event"] == "no baseline"
    # NaN extremes are written as null and read back as NaN.
    back = json.loads(json.dumps(to_jsonable(records)))
    expected = stress.lead_table(runs, window=1, baselines={"run a": _rows()})
    assert stress.format_lead_table(back) == expected


@pytest.mark.slow
def test_stress_comparison_smoke(tmp_path):
    path = ROOT / "configs/compare/stress.py"
    config = config_file(path, "smoke")
    from fp8jax.lab.compare import run_comparison
    from fp8jax.numerics.studies.stress_monitors import analyze

    res = run_comparison(config, tmp_path)
    assert set(res["run_dirs"]) == {"bf16", "bf16_smooth"}
    table = analyze(config, tmp_path)
    assert (tmp_path / "monitors.png").stat().st_size > 0
    kept = json.loads((tmp_path / "monitors.json").read_text())
    assert stress.format_lead_table(kept["runs"]) == table
    assert "| bf16_smooth seed 0 | 3 |" in table
    # The long config holds the eight arms over three seeds.
    full = config_file(path)
    assert full.steps == 3000 and full.weight_decay == 0.0 and list(full.compare.seeds) == [0, 1, 2]
    assert len(full.compare.labels) == 8
