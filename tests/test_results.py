"""The committed results as summaries: every results.json recomputes from what is committed.

* every mean and t-interval in a results.json recomputes from its per-seed
  values (scipy's Student t as the reference);
* every per-seed value of a comparison recomputes from that run's committed
  log (metrics.jsonl.gz, read by the comparisons' own reader), and every run
  the table counts has its config.json with the provenance results.json
  summarizes (commit, machine, GEMM paths);
* experiments/results stays under 5 MiB, also counted as du counts it on a
  filesystem of 4 KiB blocks.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from fp8jax.train import provenance
from fp8jax.train.loop import summarize
from fp8jax.train.run_log import LOG_NAMES, find_log, read_jsonl

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"
ALL_JSON = sorted(RESULTS.rglob("results.json"))
COMPARISONS = [p for p in ALL_JSON if "table" in json.loads(p.read_text())]
LIMIT = 5 * 2**20
BLOCK = 4096


def _name(path: Path) -> str:
    return str(path.parent.relative_to(RESULTS))


def _intervals(node, where: str = ""):
    """(where, dict) of every mean / interval record (it has per_seed) inside ``node``."""
    if isinstance(node, dict):
        if {"mean", "lo", "hi", "half_width", "n", "per_seed"} <= set(node):
            yield where, node
        for k, v in node.items():
            yield from _intervals(v, f"{where}/{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _intervals(v, f"{where}[{i}]")


def _f(x) -> float:
    return math.nan if x is None else float(x)


@pytest.mark.parametrize("path", ALL_JSON, ids=_name)
def test_every_interval_recomputes_from_its_per_seed_values(path):
    found = list(_intervals(json.loads(path.read_text())))
    if not found:
        pytest.skip("no intervals in this results.json")
    for where, st in found:
        v = np.asarray([_f(x) for x in st["per_seed"]], np.float64)
        assert st["n"] == v.size > 0, where
        assert math.isclose(_f(st["mean"]), float(np.mean(v)), rel_tol=1e-12, abs_tol=1e-15)
        if v.size < 2 or not np.all(np.isfinite(v)):
            continue
        half = stats.t.ppf(0.975, v.size - 1) * np.std(v, ddof=1) / math.sqrt(v.size)
        for key, want in (("half_width", half), ("lo", v.mean() - half), ("hi", v.mean() + half)):
            assert math.isclose(_f(st[key]), want, rel_tol=1e-9, abs_tol=1e-12), (where, key)


def _committed_run(results_dir: Path, run_dir: str) -> Path:
    """The committed folder of a run recorded as ``.../runs/<label-hash>/seed<k>``.

    A study that reuses another comparison's runs (the 30-seed headline arms)
    finds them in the folder above its own.
    """
    tail = Path(*Path(run_dir).parts[-3:])
    for base in (results_dir, results_dir.parent):
        if (base / tail).is_dir():
            return base / tail
    raise AssertionError(f"{run_dir}: no committed run folder {tail} under {results_dir}")


def _runs(path: Path) -> dict[str, dict[int, Path]]:
    res = json.loads(path.read_text())
    return {
        label: {int(s): _committed_run(path.parent, d) for s, d in by_seed.items()}
        for label, by_seed in res["run_dirs"].items()
    }


@pytest.mark.parametrize("path", COMPARISONS, ids=_name)
def test_per_seed_values_recompute_from_the_committed_logs(path):
    res = json.loads(path.read_text())
    runs = _runs(path)
    seeds = res["seeds"]
    window = int(res["train_loss_window"])
    summaries = {
        label: {s: summarize(read_jsonl(find_log(runs[label][s])), window) for s in seeds}
        for label in runs
    }
    base = {s: summaries[res["baseline"]][s] for s in seeds}
    for row in res["table"]:
        label = row["label"]
        val = [summaries[label][s]["final_val_loss"] for s in seeds]
        trn = [summaries[label][s]["train_loss_final_window_mean"] for s in seeds]
        gap = [
            (v - base[s]["final_val_loss"]) / base[s]["final_val_loss"] for v, s in zip(val, seeds)
        ]
        # Exact: the same float32 values, the same float64 arithmetic.
        assert row["final_val_loss"]["per_seed"] == val, label
        assert row["gap_val"]["per_seed"] == pytest.approx(gap, rel=1e-12, abs=1e-15), label
        if not row["diverged_at"]:
            assert row["train_loss_last_mean"]["per_seed"] == pytest.approx(trn, rel=1e-12), label


@pytest.mark.parametrize("path", COMPARISONS, ids=_name)
def test_each_run_has_the_provenance_results_json_summarizes(path):
    res = json.loads(path.read_text())
    prov = res["provenance"]
    runs = _runs(path)
    assert sum(len(by_seed) for by_seed in runs.values()) == prov["n_runs"]
    for label, by_seed in runs.items():
        for seed, run in by_seed.items():
            rec = json.loads((run / "config.json").read_text())["provenance"]
            where = f"{label} seed {seed}"
            assert rec["git"]["commit"] in prov["commits"], where
            assert provenance.machine_type(rec["machine"]) in prov["machines"], where
            assert rec["gemm_paths"] == prov["gemm_paths"][label], where


def test_committed_logs_are_gzipped_and_results_stay_under_5_mib():
    files = [p for p in RESULTS.rglob("*") if p.is_file()]
    dirs = [p for p in RESULTS.rglob("*") if p.is_dir()]
    assert not [p for p in files if p.name == LOG_NAMES[0]], "commit logs as metrics.jsonl.gz"
    apparent = sum(p.stat().st_size for p in files)
    blocks = sum(max(1, math.ceil(p.stat().st_size / BLOCK)) * BLOCK for p in files)
    blocks += BLOCK * (len(dirs) + 1)
    assert apparent < LIMIT, f"{apparent:,} bytes"
    assert blocks < LIMIT, f"{blocks:,} bytes in 4 KiB blocks"


def test_the_stress_monitor_table_recomputes_from_its_committed_values():
    # The logs keep no per-site columns: monitors.json holds what monitors.md shows.
    from fp8jax.lab.stress import format_lead_table

    folder = RESULTS / "stress"
    kept = json.loads((folder / "monitors.json").read_text())
    table = (folder / "monitors.md").read_text().rstrip("\n")
    assert format_lead_table(kept["runs"]) == table
    res = json.loads((folder / "results.json").read_text())
    assert len(kept["runs"]) == res["provenance"]["n_runs"]


def test_packing_a_run_keeps_its_run_level_columns_and_a_second_pass_changes_nothing(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("pack", ROOT / "scripts" / "pack_results.py")
    pack = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pack)
    run = tmp_path / "cmp" / "runs" / "bf16-0123" / "seed0"
    run.mkdir(parents=True)
    rows = [
        {"step": 1, "loss": 3.0, "fp8/amax_max": 9.5, "layers/layer0/ffn/w2/x/amax": 4.0},
        {"step": 1, "val_loss": None},
        {"step": 2, "layers/layer0/ffn/w2/x/amax": 5.0},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "config.json").write_text(
        json.dumps({"provenance": {"git": {"commit": "abc"}}}, indent=2)
    )
    pack.pack(tmp_path / "cmp")
    assert sorted(p.name for p in run.iterdir()) == ["config.json", "metrics.jsonl.gz"]
    assert read_jsonl(run / "metrics.jsonl") == [
        {"step": 1, "loss": 3.0, "fp8/amax_max": 9.5},
        {"step": 1, "val_loss": None},
    ]
    assert json.loads((run / "config.json").read_text())["provenance"]["git"]["commit"] == "abc"
    packed = {p: p.read_bytes() for p in run.iterdir()}
    pack.pack(tmp_path / "cmp")
    assert {p: p.read_bytes() for p in run.iterdir()} == packed
