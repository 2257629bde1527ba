"""Numbers the READMEs state, recomputed from the results.json files they come from.

Each check reads a committed results file, formats the value as the prose does
and looks for that text (or parses the prose's table and compares cell by cell).
"""

from __future__ import annotations

import json
import math
import re
import statistics
from pathlib import Path

import pytest
from scipy import stats

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"
HEADLINE = RESULTS / "headline"


def _read(path: Path) -> str:
    return path.read_text()


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def _rows(results: dict) -> dict[str, dict]:
    """label -> row of a comparison's results.json, the baseline left out."""
    return {r["label"]: r for r in results["table"] if r["label"] != results["baseline"]}


def _pct(v: float, digits: int = 2, sign: bool = True) -> str:
    return f"{100 * v:+.{digits}f}%" if sign else f"{100 * v:.{digits}f}%"


def _interval(gap: dict) -> str:
    """'-0.19% [-0.43%, +0.06%]' as the tables write a mean and its 95% interval."""
    mean = _pct(gap["mean"]).lstrip("+") if gap["mean"] < 0 else _pct(gap["mean"])
    return f"{mean} [{_pct(gap['lo'])}, {_pct(gap['hi'])}]"


def _seeds(n: int) -> str:
    return f"0-{n - 1}"


def _sd(gap: dict) -> float:
    return statistics.stdev(gap["per_seed"])


def _seeds_needed(sd: float, half: float = 0.0025) -> int:
    """The smallest n with t(n - 1) * sd / sqrt(n) <= half (95%, two-sided)."""
    n = 2
    while stats.t.ppf(0.975, n - 1) * sd / math.sqrt(n) > half:
        n += 1
    return n


def _headline_rows() -> list[tuple[str, dict]]:
    """(label, row): deepseek_v3 over 30 seeds first, then the 24-seed table's rows."""
    thirty = _rows(_json(HEADLINE / "deepseek_v3_30_seeds" / "results.json"))
    return [("deepseek_v3", thirty["deepseek_v3"])] + list(
        _rows(_json(HEADLINE / "results.json")).items()
    )


def _table_cells(text: str, first: str) -> list[list[str]]:
    """Cells of every Markdown table row whose first cell starts with ``first``."""
    out = []
    for line in text.splitlines():
        if line.startswith("| ") and line.split("|")[1].strip().startswith(first):
            out.append([c.strip() for c in line.strip().strip("|").split("|")])
    return out


def test_headline_readme_table_matches_results():
    rows = _table_cells(_read(HEADLINE / "README.md"), "deepseek_v3") + _table_cells(
        _read(HEADLINE / "README.md"), "hybrid_delayed"
    )
    rows += _table_cells(_read(HEADLINE / "README.md"), "current_tensor")
    expected = _headline_rows()
    assert len(rows) == len(expected)
    for cells, (label, row) in zip(rows, expected):
        gap = row["gap_val"]
        sd = _sd(gap)
        assert cells[0] == label
        assert cells[1] == _seeds(gap["n"])
        assert cells[2] == _interval(gap)
        assert cells[3] == _pct(gap["half_width"], 3, sign=False)
        assert cells[4].startswith(
            {"cannot resolve": "cannot resolve", "crosses": "crosses"}.get(
                row["verdict"].split()[0], row["verdict"]
            )
        )
        assert cells[5] == _pct(sd, 2, sign=False)
        assert cells[6] == f"about {_seeds_needed(sd)}"


def test_main_readme_headline_rows_and_ranges_match_results():
    text = _read(ROOT / "README.md")
    expected = _headline_rows()
    for label, row in expected:
        gap = row["gap_val"]
        pattern = (
            rf"^\| {re.escape(label)}( \([^|]*\))? \| {_seeds(gap['n'])} \| "
            rf"{re.escape(_interval(gap))} \| chunked \|"
        )
        assert re.search(pattern, text, flags=re.M), (label, _interval(gap))
    halves = [row["gap_val"]["half_width"] for _, row in expected]
    sds = [_sd(row["gap_val"]) for _, row in expected]
    assert (
        f"half-widths {100 * min(halves):.2f}-{100 * max(halves):.2f}%; "
        f"sd of the per-seed gap {100 * min(sds):.2f}-{100 * max(sds):.2f}%"
    ) in text


def test_seed_spreads_quoted_elsewhere_match_the_headline():
    thirty, *rest = _headline_rows()
    sd30 = _sd(thirty[1]["gap_val"])
    by_label = dict(rest)
    sd24 = _sd(by_label["deepseek_v3"]["gap_val"])
    llama = _read(RESULTS / "interop_llama" / "README.md")
    assert f"deepseek_v3:\n{100 * sd24:.2f}% over 24 seeds, {100 * sd30:.2f}% over 30" in llama
    sds24 = [_sd(r["gap_val"]) for r in by_label.values()]
    training = " ".join(_read(ROOT / "docs" / "training.md").split())
    assert (
        f"{100 * min(sds24):.2f}-{100 * max(sds24):.2f}% over seeds 0-23 "
        f"({100 * sd30:.2f}% for deepseek_v3 over seeds 0-29" in training
    )
    needed = [_seeds_needed(_sd(r["gap_val"])) for _, r in _headline_rows()]
    assert f"about {min(needed)}-{max(needed)} seeds" in training


SITES = RESULTS / "recipe_sites"
REF = "DeepSeek act_quant (numpy reference)"


def _site_table_cells() -> list[list[str]]:
    return _table_cells(_read(SITES / "README.md"), "massive3") + _table_cells(
        _read(SITES / "README.md"), "lognormal"
    )


def test_recipe_sites_table_matches_results():
    res = _json(SITES / "results.json")
    rows = _site_table_cells()
    expected = [(i, name) for i, table in res["errors"].items() for name in table]
    assert len(rows) == len(expected) > 0
    for cells, (inputs, name) in zip(rows, expected):
        draws = res["errors"][inputs][name]
        ref = res["errors"][inputs][REF]
        assert cells[:2] == [inputs, name]
        for j in range(3):
            assert cells[2 + j] == ", ".join(f"{d[j]:.4f}" for d in draws)
        for col, j in ((5, 0), (6, 2)):
            ratios = [d[j] / r[j] for d, r in zip(draws, ref)]
            mean, lo, hi = _geomean_interval(ratios)
            assert cells[col] == ", ".join(f"{v:.2f}" for v in ratios) + (
                f"; geomean {mean:.2f} [{lo:.2f}, {hi:.2f}]"
            )


def _geomean_interval(ratios: list[float]) -> tuple[float, float, float]:
    """Geometric mean of ``ratios`` and the 95% t-interval of their mean log, mapped back."""
    logs = [math.log(v) for v in ratios]
    n = len(logs)
    half = stats.t.ppf(0.975, n - 1) * statistics.stdev(logs) / math.sqrt(n)
    mean = statistics.fmean(logs)
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def _ratios(inputs_kind: str, name: str, column: int) -> list[float]:
    res = _json(SITES / "results.json")
    (inputs,) = [k for k in res["errors"] if k.startswith(inputs_kind)]
    table = res["errors"][inputs]
    return [d[column] / r[column] for d, r in zip(table[name], table[REF])]


@pytest.mark.parametrize(
    "path", [ROOT / "README.md", SITES / "README.md"], ids=lambda p: p.parent.name
)
def test_recipe_sites_prose_matches_results(path):
    text = " ".join(_read(path).split())
    pow2 = "deepseek_v3_pow2x (general linear)"
    for kind in ("massive3", "lognormal"):
        mean, lo, hi = _geomean_interval(_ratios(kind, pow2, 0))
        assert f"{mean:.2f}x [{lo:.2f}x, {hi:.2f}x]" in text, kind
    attn = _ratios("massive3", "deepseek_v3 at attn_out", 2)
    assert ", ".join(f"{v:.2f}x" for v in attn) in text
    mean, lo, hi = _geomean_interval(attn)
    assert f"{mean:.2f}x [{lo:.2f}x, {hi:.2f}x]" in text
    unscaled = _ratios("massive3", "attn_out_e5m6_unscaled at attn_out", 2)
    assert ", ".join(f"{v:.2f}x" for v in unscaled) in text


def test_recipe_sites_table_file_is_the_readme_table():
    table = _read(SITES / "table.md").strip()
    assert table in _read(SITES / "README.md")
