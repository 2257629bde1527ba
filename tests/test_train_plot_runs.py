"""`fp8jax runs plot`: runs found under the paths given, one panel per metric, each run
one colour and line style in every panel, no two of the first twenty alike."""

import json

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from fp8jax.lab.plot_runs import figure, find_runs, run_styles  # noqa: E402
from fp8jax.toolkit.cli import main  # noqa: E402
from fp8jax.train.defaults import ConfigError  # noqa: E402


def _run(path, final):
    path.mkdir(parents=True)
    rows = [{"step": s, "loss": final + 1.0 / s} for s in range(1, 11)]
    rows += [{"step": 5, "val_loss": final + 0.2}, {"step": 10, "val_loss": None}]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_runs_are_found_in_run_directories_and_folders_of_runs(tmp_path):
    _run(tmp_path / "a", 2.0)
    _run(tmp_path / "cmp" / "runs" / "x" / "seed0", 2.5)
    _run(tmp_path / "cmp" / "runs" / "x" / "seed1", 2.6)
    found = find_runs([tmp_path / "a", tmp_path / "cmp"])
    assert [m.parent.name for _, m in found] == ["a", "seed0", "seed1"]
    assert found[1][0].endswith("cmp/runs/x/seed0")
    with pytest.raises(ConfigError, match="not a run directory"):
        find_runs([tmp_path / "nope"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no metrics.jsonl under"):
        find_runs([tmp_path / "empty"])


def test_gzipped_logs_are_runs_too_and_plot_as_the_plain_ones(tmp_path, capsys):
    from fp8jax.train.run_log import read_jsonl, write_gz

    _run(tmp_path / "cmp" / "runs" / "x" / "seed0", 2.5)
    _run(tmp_path / "cmp" / "runs" / "x" / "seed1", 2.6)
    log = tmp_path / "cmp" / "runs" / "x" / "seed1" / "metrics.jsonl"
    write_gz(log.with_name("metrics.jsonl.gz"), read_jsonl(log))
    log.unlink()
    found = find_runs([tmp_path / "cmp", tmp_path / "cmp" / "runs" / "x" / "seed1"])
    assert [m.name for _, m in found] == ["metrics.jsonl", "metrics.jsonl.gz", "metrics.jsonl.gz"]
    out = tmp_path / "runs.png"
    assert main(["runs", "plot", str(tmp_path / "cmp"), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_each_run_keeps_its_colour_and_style_in_every_panel(tmp_path):
    rows = {}
    for i in range(12):
        _run(tmp_path / f"r{i}", 2.0 + i / 10)
        rows[f"r{i}"] = [json.loads(x) for x in (tmp_path / f"r{i}/metrics.jsonl").open()]
    fig = figure(rows, ("loss", "val_loss"))
    try:
        ax_t, ax_v = fig.axes[:2]
        looks = []
        for lt, lv in zip(ax_t.get_lines(), ax_v.get_lines()):
            assert lt.get_label() == lv.get_label()
            assert lt.get_color() == lv.get_color() and lt.get_linestyle() == lv.get_linestyle()
            looks.append((lt.get_color(), lt.get_linestyle()))
        assert len(looks) == 12 and len(set(looks)) == 12
        # A null (NaN) validation loss is a gap, not an error.
        assert len(ax_v.get_lines()[0].get_xdata()) == 2
    finally:
        plt.close(fig)
    styles = run_styles(20)
    assert len({(s["color"], s["linestyle"]) for s in styles}) == 20
    # Neighbours differ in colour and in line style.
    assert all(
        a["color"] != b["color"] and a["linestyle"] != b["linestyle"]
        for a, b in zip(styles, styles[1:])
    )
    with pytest.raises(ConfigError, match="no run logs grad_norm"):
        figure(rows, ("loss", "grad_norm"))


def test_cli_writes_the_png_and_refuses_mistakes_in_one_line(tmp_path, capsys):
    _run(tmp_path / "a", 2.0)
    _run(tmp_path / "b", 2.1)
    out = tmp_path / "plots" / "runs.png"
    assert main(["runs", "plot", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["runs", "plot", str(tmp_path / "missing"), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fp8jax runs: error: ")
    assert main(["runs", "plot", str(tmp_path / "a"), "--keys", "nope", "--out", str(out)]) == 2


def test_malformed_rows_are_left_out_with_one_line_and_a_fifo_is_refused(tmp_path, capsys):
    import os

    _run(tmp_path / "a", 2.0)
    log = tmp_path / "a" / "metrics.jsonl"
    good = log.read_text()
    log.write_text(
        good + '{"loss": 1.0}\n{"step": 1e400, "loss": 1.0}\n{"step": 11, "loss": [1]}\n'
        '{"step": 12, "loss": 1.5}\n'
    )
    out = tmp_path / "runs.png"
    assert main(["runs", "plot", str(tmp_path / "a"), "--out", str(out)]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"fp8jax runs plot: {log}: skipped line 13: ")
    assert 'no integer "step"' in err[0] and "line 14" in err[0] and "line 15" in err[0]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "f").mkdir()
    os.mkfifo(tmp_path / "f" / "metrics.jsonl")  # nobody writes it: a plain open would block
    assert main(["runs", "plot", str(tmp_path / "f"), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not a regular file" in err[0]


def test_out_is_the_path_written_and_a_directory_is_refused(tmp_path, capsys):
    _run(tmp_path / "a", 2.0)
    out = tmp_path / "plot_without_suffix"
    assert main(["runs", "plot", str(tmp_path / "a"), "--out", str(out)]) == 0
    assert capsys.readouterr().out.startswith(f"wrote {out}: ")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "plot_without_suffix.png").exists()
    (tmp_path / "somedir").mkdir()
    assert main(["runs", "plot", str(tmp_path / "a"), "--out", str(tmp_path / "somedir")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a directory: give a file" in err[0]
    assert list((tmp_path / "somedir").iterdir()) == []
