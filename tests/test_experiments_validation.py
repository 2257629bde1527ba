"""The study and benchmark entry points check every setting before any work.

Types, ranges, names (recipes, studies, benchmarks, implementations) and the
memory the sizes ask for are refused in one line (exit 2 from the entry
points), before an array or a file exists.  Each check is the entry point's own
(``checked_runner``, ``checked_benchmark``), run here in-process on the configs
of configs/study and configs/bench; a few cases go through the scripts.
"""

import re
from pathlib import Path

import ml_collections
import pytest
from test_experiments_imports import _entry

from fp8jax.bench.experiments import checked_benchmark
from fp8jax.numerics.studies import checked_runner
from fp8jax.train import fields
from fp8jax.train.defaults import config_file
from fp8jax.train.fields import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def _config(name: str, *args: str, **overrides) -> ml_collections.ConfigDict:
    """The config file's config with ``overrides`` (of any type, as a config file may set)."""
    return ml_collections.ConfigDict({**config_file(ROOT / "configs" / name, *args), **overrides})


@pytest.fixture
def memory_16gb(monkeypatch):
    monkeypatch.setattr(fields, "available_memory", lambda: 16 * 10**9)


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"m": -4}, "config.m must be >= 1, got -4"),
        ({"k": 0}, "config.k must be >= 1, got 0"),
        ({"n": 2.5}, "config.n must be an integer, got 2.5"),
        ({"seed": True}, "config.seed must be an integer, got True"),
        ({"m": 10**11}, "the gemm_error study at these sizes needs at least 2457.6 TB"),
        ({"recipes": "bf16,deepseek_v4"}, "config.recipes: unknown recipe 'deepseek_v4'"),
        ({"recipes": ""}, "config.recipes is empty"),
        ({"recipes": " , "}, "config.recipes is empty"),
        ({"study": "gemm_errors"}, "config.study = 'gemm_errors': give one of"),
    ],
)
def test_gemm_error_study_refuses(memory_16gb, overrides, message):
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        checked_runner(_config("study/gemm_error.py", **overrides))


def test_memory_check_is_against_the_memory_available(monkeypatch):
    # 12 bytes x 3 x 1024^2 elements = 37.7 MB at M = K = N = 1024.
    need = 12 * 3 * 1024**2
    monkeypatch.setattr(fields, "available_memory", lambda: need)
    checked_runner(_config("study/gemm_error.py"))
    monkeypatch.setattr(fields, "available_memory", lambda: need - 1)
    with pytest.raises(ConfigError, match="needs at least 37.7 MB .* has 37.7 MB available"):
        checked_runner(_config("study/gemm_error.py"))
    monkeypatch.setattr(fields, "available_memory", lambda: None)  # unknown: let through
    checked_runner(_config("study/gemm_error.py", m=10**11))


@pytest.mark.parametrize(
    "name,overrides,message",
    [
        ("accumulation.py", {"ks": "256,0"}, "config.ks must be >= 1, got 0"),
        ("accumulation.py", {"ks": "256,x"}, "config.ks = '256,x': give comma-separated"),
        ("accumulation.py", {"distributions": "gauss"}, "config.distributions: unknown name"),
        ("accumulation.py", {"time_shapes": "64x0x64"}, "config.time_shapes: '64x0x64' is no"),
        ("site_errors.py", {"m": 100}, "config.m must be >= 128 and a multiple of 128"),
        ("site_errors.py", {"seeds": "0,-1"}, "config.seeds must be >= 0, got -1"),
        ("captured_gemm_error.py", {"batch": 0}, "config.batch must be >= 1"),
        ("plot_telemetry.py", {"sites": "w2/(x"}, "config.sites = 'w2/(x' is no regular"),
        ("plot_telemetry.py", {"png": "../t.png"}, "config.png = '../t.png': give a file name"),
        (
            "stress_monitors.py",
            {"loss_spike": 0.0},
            "config.loss_spike must be a finite number > 0",
        ),
        ("scale_sites.py", {"steps": -1}, "config.steps must be >= 0"),
    ],
)
def test_study_settings_refused(memory_16gb, name, overrides, message):
    with pytest.raises(ConfigError) as e:
        checked_runner(_config("study/" + name, **overrides))
    assert str(e.value).startswith(message), str(e.value)


@pytest.mark.parametrize(
    "name,overrides,message",
    [
        ("core.py", {"size": 0}, "config.size must be >= 128 and a multiple of 128, got 0"),
        ("core.py", {"size": -128}, "config.size must be >= 128"),
        ("core.py", {"quant_rows": -1}, "config.quant_rows must be >= 128"),
        ("core.py", {"iters": 0}, "config.iters must be >= 1, got 0"),
        ("core.py", {"iters": -3}, "config.iters must be >= 1, got -3"),
        ("core.py", {"size": 10**7 - 10**7 % 128}, "the core benchmark at these sizes needs"),
        ("kernels.py", {"grouped": 1}, "config.grouped must be true or false, got 1"),
        ("memory.py", {"recipes": ""}, "config.recipes is empty"),
        ("memory.py", {"d_model": 30}, "config.d_model must be >= 4 and a multiple of 4"),
        ("model_step.py", {"recipes": "bf16@x"}, "config.recipes: row 'bf16@x'"),
        ("model_step.py", {"preset": "huge"}, "config.preset = 'huge': give one of tiny, small"),
        ("parallel.py", {"mesh": "1,8"}, "config.mesh = '1,8': give three sizes"),
        ("sweep.py", {"impls": "xla,cublas"}, "config.impls: unknown name 'cublas'"),
        ("sweep.py", {"iters": 0}, "config.iters must be >= 1"),
        ("sweep.py", {"time_budget_s": float("nan")}, "config.time_budget_s must be a finite"),
        ("core.py", {"benchmark": "cores"}, "config.benchmark = 'cores': give one of "),
    ],
)
def test_benchmark_settings_refused(memory_16gb, name, overrides, message):
    with pytest.raises(ConfigError) as e:
        checked_benchmark(_config("bench/" + name, **overrides))
    assert str(e.value).startswith(message), str(e.value)


def test_a_field_without_a_check_is_refused_not_ignored():
    c = _config("bench/core.py")
    with c.unlocked():
        c.sizes = 512
    with pytest.raises(ConfigError, match="config.sizes is not a setting of the core benchmark"):
        checked_benchmark(c)


@pytest.mark.parametrize(
    "script,args,message",
    [
        ("study.py", ["--config=configs/study/gemm_error.py", "--config.m=-4"], "config.m"),
        ("study.py", ["--config=configs/study/gemm_error.py", "--config.recipes="], "empty"),
        ("study.py", ["--config=configs/study/accumulation.py", "--config.m=0"], "config.m"),
        ("bench.py", ["--config=configs/bench/core.py", "--config.size=0"], "config.size"),
        ("bench.py", ["--config=configs/bench/sweep.py:cpu", "--config.iters=0"], "config.iters"),
        ("bench.py", ["--config=configs/bench/core.py", "--config.size=1e7"], "is an integer"),
    ],
)
def test_entry_points_refuse_in_one_line_and_create_nothing(tmp_path, script, args, message):
    out = tmp_path / "out"
    p = _entry(script, *args, f"--out_dir={out}")
    assert p.returncode == 2, p.stderr[-2000:]
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith(f"{script}: error:")]
    assert len(lines) == 1 and message in lines[0], p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    assert not out.exists()


def test_a_config_file_with_a_syntax_error_is_one_line(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import ml_collections\n\ndef get_config(:\n    pass\n")
    p = _entry("study.py", f"--config={bad}")
    assert p.returncode == 2, p.stderr[-2000:]
    assert p.stderr.strip().splitlines()[-1] == (
        f"study.py: error: config file '{bad}' line 3: invalid syntax: fix the file "
        "(it is Python: python -m py_compile FILE shows the spot)"
    )
