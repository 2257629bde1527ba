"""The comparison driver: paired gaps with 95% intervals, verdicts, table, plots, config
checks, and a whole (tiny) comparison kept under its own workdir (the statistics
themselves: test_lab_stats.py)."""

import io
import json
import math
from pathlib import Path

import numpy as np
import pytest

# Student-t quantiles t(0.975, df), checked against published values there.
from test_lab_stats import T_975

from fp8jax.lab import compare
from fp8jax.train import provenance
from fp8jax.train.defaults import (
    COMPARISON_VAL_TOKENS,
    ConfigError,
    comparison_block,
    config_file,
    model_config,
    parse_seeds,
    seq_len,
    tiny_config,
    validate,
)

ROOT = Path(__file__).resolve().parents[1]


def _cfg(seeds=(0, 1)):
    c = tiny_config()
    c.compare = comparison_block(
        "t",
        dict(
            bf16=dict(recipe="bf16"),
            fp8=dict(recipe="deepseek_v3", inject=dict(fp8_reset_every=3)),
        ),
        notes="",
        seeds=seeds,
    )
    return c


def _summary(recipe, val, train, tel=None):
    return {
        "recipe": recipe,
        "final_val_loss": val,
        "train_loss_final_window_mean": train,
        "final_window": 3,
        "tokens_per_s": 100.0,
        "fp8_telemetry": tel or {},
    }


def _rows(final):
    rows = [{"step": s, "loss": final + 1.0 / s} for s in range(1, 21)]
    return rows + [{"step": 10, "val_loss": final + 0.1}, {"step": 20, "val_loss": final}]


def test_aggregate_paired_gaps_intervals_table_and_plots(tmp_path):
    c = _cfg()
    runs = {
        "bf16": {0: _summary("bf16", 2.00, 2.10), 1: _summary("bf16", 2.02, 2.12)},
        "fp8": {
            0: _summary("deepseek_v3", 2.01, 2.10, {"saturated_max": 0.0, "flushed_mean": 1e-4}),
            1: _summary("deepseek_v3", 2.0402, 2.14, {"saturated_max": 1e-3, "flushed_mean": 3e-4}),
        },
    }
    res = compare.aggregate(c, runs, {})
    assert res["baseline_seed_spread_val"] == pytest.approx(0.02 / 2.01)
    fp8 = res["table"][1]
    # Paired gaps: (2.01-2.00)/2.00 = 0.5%, (2.0402-2.02)/2.02 = 1%; mean 0.75%,
    # half-width t(0.975, 1) * sd / sqrt(2) with sd = 0.005 / sqrt(2).
    gap = fp8["gap_val"]
    assert gap["per_seed"] == pytest.approx([0.005, 0.01])
    assert gap["mean"] == pytest.approx(0.0075)
    assert gap["half_width"] == pytest.approx(T_975[1] * 0.0025, rel=1e-9)
    assert fp8["verdict"] == "cannot resolve" and fp8["within_0.25%"] is False
    assert fp8["gap_train"]["per_seed"] == pytest.approx([0.0, 0.02 / 2.12])
    assert fp8["fp8_telemetry"]["saturated_max"] == 1e-3
    assert fp8["fp8_telemetry"]["flushed_mean"] == pytest.approx(2e-4)
    assert res["table"][0]["verdict"] == "baseline"
    md = compare.markdown(res, "python x.py")
    assert "| fp8 | deepseek_v3 | ? | 2.0251 | +0.75% [-2.43%, +3.93%] | +0.50%, +1.00% |" in md
    assert "cannot resolve 0.25%" in md and "python x.py" in md
    rows = {lab: {s: _rows(runs[lab][s]["final_val_loss"]) for s in (0, 1)} for lab in runs}
    paths = compare.plot(res, rows, tmp_path, smooth=3)
    assert all(p.exists() and p.stat().st_size > 10_000 for p in paths)
    (tmp_path / "results.json").write_text(json.dumps(res))
    head = compare.headline_table([tmp_path])
    assert head.count("\n") == 3
    assert (
        "| t | fp8 (deepseek_v3) | bf16 | ? | ? | 2.0251 | +0.75% [-2.43%, +3.93%] "
        "| +0.50%, +1.00% |" in head
    )


def test_diverged_seed_is_not_within():
    c = _cfg()
    runs = {
        "bf16": {0: _summary("bf16", 2.0, 2.0), 1: _summary("bf16", 2.0, 2.0)},
        "fp8": {0: _summary("x", 2.0, 2.0), 1: {**_summary("x", math.nan, 2.0), "diverged_at": 7}},
    }
    row = compare.aggregate(c, runs, {})["table"][1]
    assert row["verdict"] == "diverged" and row["diverged_at"] == {1: 7}
    assert row["within_0.25%"] is False


def test_run_config_applies_overrides_and_rejects_unknown_fields(tmp_path):
    c = _cfg()
    rc = compare.run_config(c, "fp8", 1)
    assert rc.recipe == "deepseek_v3" and rc.inject.fp8_reset_every == 3
    # The run's block holds every injection field (the others at their off default).
    assert rc.inject.fp8_amax_growth == 1.0 and "inject" not in compare.run_config(c, "bf16", 1)
    assert rc.seed == 1 and rc.data_seed == 1 and "compare" not in rc
    # Identical training configs share a run directory; seeds and recipes do not.
    d0 = compare.run_dir(tmp_path, compare.run_config(c, "bf16", 0), 0)
    d1 = compare.run_dir(tmp_path, compare.run_config(c, "bf16", 1), 1)
    assert d0.parent == d1.parent and d0 != d1
    assert compare.run_dir(tmp_path, rc, 1).parent != d1.parent
    c.compare.runs.fp8.not_a_field = 1
    with pytest.raises(ConfigError, match="not a field"):
        compare.run_config(c, "fp8", 0)


def test_comparison_mistakes_raise_one_line_and_create_nothing(tmp_path):
    workdir = tmp_path / "cmp"
    c = _cfg()
    with c.compare.unlocked():
        c.compare.run_root = "/tmp/shared"
    with pytest.raises(ConfigError, match="runs live under --workdir/runs"):
        compare.run_comparison(c, workdir)
    c = _cfg()
    c.compare.runs.fp8.recipe = "deepseek_v4"
    with pytest.raises(ConfigError, match="compare.runs.fp8: unknown recipe") as info:
        compare.run_comparison(c, workdir)
    assert "\n" not in str(info.value)
    c = _cfg()
    # Checked against the machine for every run before the first one trains.
    c.compare.runs.fp8.batch_size = 10**12
    with pytest.raises(ConfigError, match="compare.runs.fp8: batch_size 1000000000000 .* needs"):
        compare.run_comparison(c, workdir)
    c = _cfg()
    c.compare.baseline = "fp16"
    with pytest.raises(ConfigError, match="baseline 'fp16' is not among"):
        compare.run_comparison(c, workdir)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="not a directory"):
        compare.run_comparison(_cfg(), tmp_path / "file")
    assert not workdir.exists()


def _load(path):
    return config_file(path)


# interop_llama.py is an interop comparison (fp8jax.lab.qwix_comparison), not a recipe comparison.
@pytest.mark.parametrize(
    "path",
    sorted(p for p in (ROOT / "configs" / "compare").glob("*.py") if p.stem != "interop_llama"),
    ids=str,
)
def test_comparison_configs_validate_and_hold_enough_validation_tokens(path):
    c = _load(path)
    validate(c, extra=("compare",))
    n = seq_len(c, model_config(c))
    predicted = c.eval_batches * c.eval_batch_size * (n - 1)
    assert predicted >= COMPARISON_VAL_TOKENS
    fields = set(c.compare.keys())
    assert set(compare.COMPARE_FIELDS) <= fields
    assert fields <= set(compare.COMPARE_FIELDS + compare.OPTIONAL_COMPARE_FIELDS)
    for label in c.compare.labels:
        validate(compare.run_config(c, label, 0))


CLEAN = {"commit": "a" * 40, "dirty": []}


def test_comparison_keeps_its_runs_under_its_workdir_and_reuses_them(tmp_path, monkeypatch):
    # The runs record a clean tree at one commit whatever the state of this checkout.
    monkeypatch.setattr(provenance, "git_state", lambda root=None: dict(CLEAN))
    c = tiny_config()
    c.steps, c.batch_size, c.seq_len, c.warmup_steps = 4, 4, 32, 1
    c.log_every, c.eval_every, c.eval_batches, c.eval_batch_size = 1, 2, 1, 4
    c.tensorboard, c.final_window = False, 2
    c.data.source, c.data.max_bytes = "synthetic", 20_000
    # Two labels that train identically (eval_every is not part of the step): the
    # paired gap is exactly zero for every seed, so the interval is [0, 0].
    c.compare = comparison_block(
        "same",
        dict(bf16=dict(recipe="bf16"), again=dict(recipe="bf16", eval_every=4)),
        notes="identical training",
        seeds=(0, 1),
    )
    out = io.StringIO()
    res = compare.run_comparison(c, tmp_path / "cmp", stream=out)
    again = res["table"][1]
    assert again["gap_val"]["per_seed"] == [0.0, 0.0] and again["verdict"] == "within"
    dirs = [Path(d) for label in res["run_dirs"].values() for d in label.values()]
    assert len(set(dirs)) == 4
    assert all((tmp_path / "cmp" / "runs") in d.parents for d in dirs)
    saved = json.loads((tmp_path / "cmp" / "results.json").read_text())
    assert saved["table"][1]["gap_val"]["lo"] == 0.0 and "[+0.00%, +0.00%]" in res["markdown"]
    # A rerun re-reads the finished runs instead of training them again.
    out2 = io.StringIO()
    compare.run_comparison(c, tmp_path / "cmp", stream=out2)
    assert out2.getvalue().count("already complete: ") == 4
    assert not any(line.startswith("step ") for line in out2.getvalue().splitlines())
    # Every run records its commit, machine and GEMM paths; the table names them.
    prov = saved["provenance"]
    assert prov["commits"] == ["a" * 40] and prov["clean"] and not prov["problems"]
    assert prov["gemm_paths"]["bf16"]["dense/fprop"] == "lax.dot_general bfloat16"
    assert "Code: commit aaaaaaaaaaaa, a clean tree, for all 4 runs." in res["markdown"]
    (row,) = [ln for ln in res["markdown"].splitlines() if ln.startswith("| bf16 | bf16 | ")]
    assert "lax.dot_general bfloat16" in row.split(" | ")[2]
    # A run made at another commit is not tabulated with the others ...
    cfg_path = dirs[0] / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["provenance"]["git"]["commit"] = "b" * 40
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="2 commits"):
        compare.run_comparison(c, tmp_path / "cmp", stream=io.StringIO())
    # ... unless asked, and then the table says so.
    res = compare.run_comparison(c, tmp_path / "cmp", stream=io.StringIO(), allow_mixed_code=True)
    assert "Provenance problems: runs come from 2 commits" in res["markdown"]


def test_comparison_refuses_a_modified_tree_before_running(tmp_path, monkeypatch):
    monkeypatch.setattr(
        provenance, "git_state", lambda root=None: {"commit": "a" * 40, "dirty": ["x.py"]}
    )
    with pytest.raises(ConfigError, match="clean tree.*x.py"):
        compare.run_comparison(_cfg(), tmp_path / "w")
    assert not (tmp_path / "w" / "runs").exists()


def test_reproduction_check_uses_the_prediction_interval_of_one_new_seed():
    gaps = [0.001, -0.002, 0.004, 0.0]
    committed = {"baseline": "bf16", "table": [{"label": "fp8", "gap_val": {"per_seed": gaps}}]}
    rerun = {
        "baseline": "bf16",
        "seeds": [0, 1],
        "table": [
            {"label": "bf16", "gap_val": {"per_seed": [0.0, 0.0]}},
            {"label": "fp8", "gap_val": {"per_seed": [0.009, 0.012]}},
        ],
    }
    rows = compare.reproduction_check(committed, rerun)
    # float64 reference: mean 0.00075, sd of the 4 gaps, t(0.975, 3) = 3.182446.
    g = np.asarray(gaps)
    half = T_975[3] * np.std(g, ddof=1) * np.sqrt(1 + 1 / 4)
    assert rows[0]["lo"] == pytest.approx(g.mean() - half)
    assert rows[0]["hi"] == pytest.approx(g.mean() + half)
    assert [r["inside"] for r in rows] == [g.mean() + half >= 0.009, g.mean() + half >= 0.012]
    assert rows[0]["inside"] and not rows[1]["inside"]


@pytest.mark.parametrize(
    "spec, seeds",
    [
        ("0-3", (0, 1, 2, 3)),
        ("0-15:2", tuple(range(0, 16, 2))),
        ("1-5:2", (1, 3, 5)),
        ("7", (7,)),
        ("3,1", (3, 1)),
    ],
)
def test_parse_seeds(spec, seeds):
    assert parse_seeds(spec) == seeds


@pytest.mark.parametrize("spec", ["a-b", "3-1", "0-3:x", ""])
def test_parse_seeds_refuses_nonsense(spec):
    with pytest.raises(ConfigError, match="seeds"):
        parse_seeds(spec)


def test_contrast_pairs_two_runs_directly():
    c = _cfg(seeds=(0, 1, 2))
    c.compare.labels = ["bf16", "fp8", "alt"]
    c.compare.runs.alt = dict(recipe="current_tensor")
    c.compare.contrasts = ["alt:fp8"]
    vals = {"bf16": [2.0, 2.1, 2.2], "fp8": [2.02, 2.1, 2.2], "alt": [2.02, 2.121, 2.178]}
    runs = {lab: {s: _summary(lab, v[s], v[s]) for s in range(3)} for lab, v in vals.items()}
    res = compare.aggregate(c, runs, {})
    (con,) = res["contrasts"]
    assert (con["label"], con["reference"]) == ("alt", "fp8")
    # Paired against fp8, not bf16: 0, +1%, -1% (float64 reference).
    expect = np.array([0.0, 0.021 / 2.1, -0.022 / 2.2])
    assert con["gap_val"]["per_seed"] == pytest.approx(expect)
    sd = np.std(expect, ddof=1)
    assert con["gap_val"]["half_width"] == pytest.approx(T_975[2] * sd / np.sqrt(3))
    assert con["verdict"] == "cannot resolve"
    md = compare.markdown(res)
    assert "| alt | fp8 | " in md and "| +0.00%, +1.00%, -1.00% | cannot resolve 0.25% |" in md


def test_contrast_with_unknown_label_is_a_config_error(tmp_path):
    c = _cfg()
    c.compare.contrasts = ["fp8:nope"]
    with pytest.raises(ConfigError, match="contrasts"):
        compare.validate_comparison(c, tmp_path / "w")
    c.compare.contrasts = ["fp8"]
    with pytest.raises(ConfigError, match="label:label"):
        compare.contrast_pairs(c.compare)
