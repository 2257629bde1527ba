"""The GPU check's Python steps, run on this CPU with the GPU image's missing packages blocked.

Each step runs in a fresh interpreter whose imports of ml_collections,
tensorboardX, grain, qwix and tokenizers (absent from the GPU image) raise,
as they would there.  Off a Hopper GPU the kernels run interpreted and the
hardware FP8 dots are left out; the records say so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from gpu_image import BLOCKER

from fp8jax.bench import gpu_check

ROOT = Path(__file__).resolve().parents[1]
_RUNNER = (
    BLOCKER
    + """
from fp8jax.bench.gpu_check import main
sys.exit(main(sys.argv[1:]))
"""
)


def _run(step: str, out: Path) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", _RUNNER, step, "--out", str(out), "--small"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert steps[-1]["step"] == step and steps[-1]["status"] == "ok", steps[-1]
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    return [r for r in records if r["step"] == step]


def test_the_blocker_blocks(tmp_path):
    code = _RUNNER.replace(
        "from fp8jax.bench.gpu_check import main\nsys.exit(main(sys.argv[1:]))",
        "import ml_collections",
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode != 0 and "not on the GPU image" in proc.stderr


def test_env_and_dense_steps(tmp_path):
    (env,) = _run("env", tmp_path)
    assert env["hopper_gpu"] is False and env["kernel_self_check"] == "n/a"
    assert env["quantizer_check"] == env["quantizer"] == "n/a"
    dense = _run("dense", tmp_path)
    impls = {r["impl"]: r for r in dense}
    assert "fp8_runs" not in impls  # no hardware FP8 dots on this CPU
    assert impls["bf16"]["tflops"] > 0 and impls["block_xla"]["ratio_to_bf16"] > 0
    for name in ("pallas_kn", "pallas_nt", "pallas_tn_wgrad"):
        assert "interpret" in impls[name]["note"] and impls[name]["ratio_to_bf16"] is None
    # Both steps appended to one file, in order.
    lines = (tmp_path / "steps.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == ["env", "dense"]


def test_programs_step_times_the_predicted_programs(tmp_path):
    records = _run("programs", tmp_path)
    by_case: dict[str, dict[str, dict]] = {}
    for r in records:
        by_case.setdefault(r["case"], {})[r["recipe"]] = r
    assert set(by_case) == {"gemm 256x256x256", "grouped 2x64x256x128"}
    for case, recs in by_case.items():
        base, fp8 = recs["bf16"], recs["deepseek_v3"]
        assert base["impl"] == "lax" and base["paths"] == {} and base["ratio_to_bf16"] == 1.0
        # The ratio is the two medians' of this run; the paths are what "auto" took on CPU.
        assert fp8["ratio_to_bf16"] == pytest.approx(fp8["median_s"] / base["median_s"])
        scope = "dense" if case.startswith("gemm") else "expert"
        assert set(fp8["paths"]) == {f"{scope}/{k}" for k in ("fprop", "dgrad", "wgrad")}
        # No device plane on a CPU: the profiler ran and saw no kernels.
        assert fp8["profile"] == {"lines": {}} and "census" not in fp8


@pytest.mark.slow
def test_grouped_and_moe_steps(tmp_path):
    grouped = _run("grouped", tmp_path)
    assert {r["impl"] for r in grouped} >= {"bf16_ragged_dot", "pallas_grouped_kn"}
    steps = _run("moe_step", tmp_path)
    assert [r["variant"] for r in steps] == ["bf16", "deepseek_v3"]
    assert all(r["status"] == "ok" for r in steps)


def test_quantizers_step_times_each_kernel_and_xlas_fusions(tmp_path):
    records = _run("quantizers", tmp_path)
    assert [(r["impl"], r["kernel"]) for r in records] == [
        ("xla", "row"),
        ("xla", "block"),
        ("xla", "rows_cols"),
        ("mosaic", "row"),
        ("mosaic", "block"),
        ("mosaic", "rows_cols"),
        ("mosaic", "requantize"),
        ("triton", "row"),
        ("triton", "block"),
        ("triton", "rows_cols"),
        ("triton", "requantize"),
    ]
    # No device plane on a CPU: each ran (interpreted) and the profiler saw no kernel.
    assert all(r["device_us"] == 0 and r["kernels"] == [] for r in records), records


def test_unknown_step_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown step"):
        gpu_check.run_step("benchmark", tmp_path)


@pytest.mark.slow  # the three parts of the sweep at tiny sizes: about 6 min on 2 loaded cores
def test_gpu_sweep_script_runs_with_the_gpu_images_packages(tmp_path):
    # The blocker as sitecustomize: every python3 the script starts has it.
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER)
    env = {
        **os.environ,
        "PYTHONPATH": str(site),
        "PYTHON": sys.executable,
        "SMOKE": "1",
        "OUT": str(tmp_path / "out"),
        "JAX_PLATFORMS": "cpu",
    }
    probe = subprocess.run(
        [sys.executable, "-c", "import ml_collections"], env=env, capture_output=True, text=True
    )
    assert probe.returncode != 0 and "not on the GPU image" in probe.stderr
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_sweep.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "failed/timed out" not in proc.stdout and "gpu_sweep.sh done" in proc.stdout
    for part in ("bench_gpu", "bench_gpu_square", "bench_gpu_moe"):
        records = json.loads((tmp_path / "out" / part / "results.json").read_text())["records"]
        assert records, part
