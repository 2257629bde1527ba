"""Tests of fp8jax.bench: the sweep writes well-formed outputs; the reference GEMM's numerics.

No test asserts a time: timings are only checked to be positive and finite.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from gpu_image import blocked_script

from fp8jax import bench
from fp8jax.bench import hlo

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- reference GEMM numerics


def _np_quant(x64: np.ndarray, fmt) -> tuple[np.ndarray, np.float32]:
    """Independent per-tensor quantization: scale = amax / max (f32), saturate, round."""
    fmax = float(ml_dtypes.finfo(fmt).max)
    scale = np.float32(np.float32(np.max(np.abs(x64))) / np.float32(fmax))
    y = np.clip(x64.astype(np.float32) / scale, -fmax, fmax)
    return y.astype(fmt), scale


def _np_dq_bf16(q: np.ndarray, scale: np.float32) -> np.ndarray:
    # Convert and scale multiply both in bf16, as the canonical XLA pattern does.
    s = np.float32(ml_dtypes.bfloat16(scale))
    return (q.astype(np.float32) * s).astype(ml_dtypes.bfloat16).astype(np.float64)


def _fwd_bwd(x, w, dy):
    y, vjp = jax.vjp(bench.fp8_per_tensor_matmul, x, w)
    return (y, *vjp(dy))


def test_reference_fp8_per_tensor_matches_numpy():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((48, 96)) * 3.0
    w = rng.standard_normal((96, 40)) * 0.1
    dy = rng.standard_normal((48, 40))
    xb, wb, dyb = (jnp.asarray(a, jnp.bfloat16) for a in (x, w, dy))
    y, dx, dw = jax.jit(_fwd_bwd)(xb, wb, dyb)
    assert y.dtype == jnp.bfloat16 and dx.dtype == jnp.bfloat16 and dw.dtype == jnp.bfloat16

    x64, w64, dy64 = (np.asarray(a, np.float32).astype(np.float64) for a in (xb, wb, dyb))
    xq, sx = _np_quant(x64, ml_dtypes.float8_e4m3fn)
    wq, sw = _np_quant(w64, ml_dtypes.float8_e4m3fn)
    gq, sg = _np_quant(dy64, ml_dtypes.float8_e5m2)
    xd, wd, gd = _np_dq_bf16(xq, sx), _np_dq_bf16(wq, sw), _np_dq_bf16(gq, sg)
    for got, a, b in ((y, xd, wd), (dx, gd, wd.T), (dw, xd.T, gd)):
        want = a @ b
        # bf16 output rounding (2^-8) plus rare one-ulp FP8 code differences from
        # XLA's division: bounded relative to sum |a||b|.
        bound = 2.0**-6 * (np.abs(a) @ np.abs(b)) + 1e-6
        err = np.abs(np.asarray(got, np.float32) - want)
        assert np.all(err <= bound), float(np.max(err / bound))
    # And it is a real FP8 approximation: far from exact, close to the true product.
    rel = np.linalg.norm(np.asarray(y, np.float32) - x64 @ w64) / np.linalg.norm(x64 @ w64)
    assert 1e-4 < rel < 0.1


def test_reference_rejects_non_2d():
    with pytest.raises(ValueError, match="2-D"):
        bench.fp8_per_tensor_matmul(jnp.ones((2, 3, 4)), jnp.ones((4, 5)))


# ---------------------------------------------------------------- shapes and variants


def test_shapes_and_flops():
    shapes = bench.gemm_shapes(["square", "dsv3", "moe"], m_tokens=128, square_sizes=(256,))
    names = [s.name for s in shapes]
    assert names[0] == "sq256"
    assert {(s.k, s.n) for s in shapes if s.group == "dsv3"} == {
        (7168, 2112),
        (7168, 24576),
        (7168, 4096),
        (7168, 7168),
    }
    assert {(s.k, s.n) for s in shapes if s.group == "moe"} == {(7168, 4096), (2048, 7168)}
    assert all(s.m == 128 for s in shapes if s.group != "square")
    s = bench.parse_shape("8x16x32")
    assert (s.m, s.k, s.n) == (8, 16, 32)
    assert s.flops("fwd") == 2 * 8 * 16 * 32 and s.flops("fwd_bwd") == 6 * 8 * 16 * 32
    with pytest.raises(ValueError):
        bench.parse_shape("8x16")
    with pytest.raises(ValueError):
        bench.gemm_shapes(["nope"])
    with pytest.raises(ValueError):
        s.flops("bwd")


def test_variants_cover_presets_and_dequant_dtypes():
    variants, skipped = bench.backend_variants(impls=["xla", "reference"])
    names = {v.name for v in variants}
    assert "bf16/xla" in names and "fp32/xla" in names
    for r in ("deepseek_v3", "hybrid_delayed", "current_tensor", "rowwise"):
        assert {f"{r}/xla-deqf32", f"{r}/xla-deqbf16"} <= names
        assert f"{r}/chunked" not in names  # filtered out by impls
    assert "xla_fp8_per_tensor/xla" in names
    v = next(v for v in variants if v.name == "deepseek_v3/xla-deqbf16")
    r = v.make_recipe()
    assert r.impl == "xla" and r.dequant_dtype == "bfloat16"
    with pytest.raises(ValueError):
        bench.backend_variants(impls=["cuda"])
    variants, skipped = bench.backend_variants(["deepseek_v3"], impls=["chunked", "fp8"])
    assert [v.make_recipe().impl for v in variants] == ["chunked"] + (
        ["fp8"] if jax.default_backend() == "gpu" else []
    )
    if jax.default_backend() != "gpu":
        assert "deepseek_v3/fp8" in skipped


# ---------------------------------------------------------------- HLO inspection


_GPU_HLO = """HloModule jit_f, entry_computation_layout={(f8e4m3fn[64,128]{1,0}, f8e4m3fn[128,256]{1,0})->bf16[64,256]{1,0}}

ENTRY %main.9 (a.1: f8e4m3fn[64,128], b.1: f8e4m3fn[256,128], sa: f32[], sb: f32[]) -> bf16[64,256] {
  %a.1 = f8e4m3fn[64,128]{1,0} parameter(0)
  %b.1 = f8e4m3fn[256,128]{1,0} parameter(1)
  %sa = f32[] parameter(2)
  %sb = f32[] parameter(3)
  %cublas-gemm.1 = (bf16[64,256]{1,0}, s8[33554432]{0}) custom-call(%a.1, %b.1, %sa, %sb), custom_call_target="__cublas$lt$matmul$f8", backend_config={"gemm_backend_config":{"alpha_real":1}}
  ROOT %get-tuple-element = bf16[64,256]{1,0} get-tuple-element(%cublas-gemm.1), index=0
}
"""


def test_hlo_finds_cublaslt_fp8_call():
    s = hlo.summarize_hlo(_GPU_HLO)
    assert s["cublaslt_fp8"] and s["fp8_gemm"]
    (g,) = s["gemms"]
    assert g["target"] == hlo.CUBLASLT_FP8_TARGET
    assert g["operand_types"][:2] == ["f8e4m3fn", "f8e4m3fn"]
    assert g["result_type"] == "bf16"
    assert hlo.kernel_path(s, "gpu").startswith("cuBLASLt FP8 GEMM (f8e4m3fnxf8e4m3fn)")


def test_hlo_of_a_cpu_fp8_dot_general_reports_dequantized_dot():
    import fp8jax
    from fp8jax import recipes

    x = jnp.ones((32, 64), jnp.float32)
    w = jnp.ones((64, 48), jnp.float32)
    # The dequantize-then-dot implementation (impl="xla").
    recipe = dataclasses.replace(recipes.current_tensor(), impl="xla")
    f = lambda x, w: fp8jax.dot_general(x, w, (((1,), (0,)), ((), ())), recipe=recipe)
    txt = jax.jit(f).lower(x, w).compile().as_text()
    s = hlo.summarize_hlo(txt)
    assert not s["cublaslt_fp8"]
    assert len(s["gemms"]) >= 1
    assert s["fp8_values"]  # the quantize is there ...
    if jax.default_backend() == "cpu":
        # ... but XLA on CPU dots the dequantized float32 operands.
        assert not s["fp8_gemm"]
        assert all(t == "f32" for g in s["gemms"] for t in g["operand_types"][:2])
        assert hlo.kernel_path(s, "cpu").startswith("FP8 dequantized, then XLA CPU dot")


def test_hlo_names_the_dot_algorithm():
    from jax import lax

    x = jnp.ones((8, 16), jnp.float32)
    dn = (((1,), (0,)), ((), ()))
    cases = {
        "dot_f32_f32_f32": lax.DotAlgorithmPreset.F32_F32_F32,
        "dot_bf16_bf16_f32": lax.DotAlgorithmPreset.BF16_BF16_F32,
        "precision=highest,highest": lax.Precision.HIGHEST,
        "default": None,
    }
    for want, precision in cases.items():
        f = lambda a, b, p=precision: lax.dot_general(a, b, dn, precision=p)
        rep = hlo.hlo_report(jax.jit(f).lower(x, x.T).compile().as_text(), jax.default_backend())
        assert rep["dot_algorithms"] == want
        assert rep["kernel_path"].endswith(f"[{want}]")
        assert rep["n_gemms"] == 1
    # A cuBLAS call states its algorithm in its backend config.
    line = (
        '%c = f32[2,2]{1,0} custom-call(%a, %b), custom_call_target="__cublas$gemm", '
        'backend_config={"gemm_backend_config":{"precision_config":{"algorithm":'
        '"ALG_DOT_BF16_BF16_F32","operand_precision":["DEFAULT","DEFAULT"]}}}'
    )
    assert hlo.dot_algorithm(line) == "ALG_DOT_BF16_BF16_F32"
    assert hlo.dot_algorithm(line.replace("ALG_DOT_BF16_BF16_F32", "ALG_UNSET")) == "default"


# ---------------------------------------------------------------- kernel benchmark


def test_kernel_bench_shapes_and_cpu_cases():
    from fp8jax.bench import gemm_cases, kernel

    small = gemm_cases.kernel_shapes(small=True)
    assert any(s.k % 128 or s.n % 128 for s in small)  # an odd shape
    full = gemm_cases.kernel_shapes(small=False)
    assert {(s.k, s.n) for s in full} >= {(7168, 2112), (7168, 24576), (2048, 7168)}
    (g,) = gemm_cases.grouped_shapes(small=True)
    assert g.m == g.experts * g.rows
    assert {(s.k, s.n) for s in gemm_cases.grouped_shapes(small=False)} == set(gemm_cases.MOE_KN)

    res = kernel.bench_dense(
        gemm_cases.parse_shape("32x256x128"),
        impls=["bf16", "fp8_tensor_xla", "block_xla"],
        iters=1,
        interpret=False,
    )
    assert [r.impl for r in res] == ["bf16", "fp8_tensor_xla", "block_xla"]
    for r in res:
        assert r.seconds > 0 and r.tflops > 0 and r.ratio_to_bf16 > 0, r
    assert res[0].ratio_to_bf16 == pytest.approx(1.0)
    res = kernel.bench_dense(
        gemm_cases.INTERPRET_SHAPE, impls=["bf16", "pallas_nt"], iters=1, interpret=True
    )
    assert res[1].note.startswith("Mosaic GPU interpret mode") and res[1].ratio_to_bf16 is None
    with pytest.raises(ValueError, match="unknown implementations"):
        kernel.bench_dense(gemm_cases.INTERPRET_SHAPE, impls=["cuda"], iters=1, interpret=True)
    if jax.default_backend() != "gpu":
        # No cuBLASLt on this backend: the per-tensor FP8 pattern stays an XLA dot.
        assert kernel.cublaslt_fp8_compiles(64, 128, 64) is False


def test_core_gemm_ratio_names_both_xla_paths_and_their_dot_algorithms():
    from fp8jax.bench import core

    g = core.gemm_ratio(size=256, iters=1)
    assert g["ratio_bf16"] == 1.0
    for name in core.GEMM_VARIANTS:
        assert g[f"t_{name}_s"] > 0 and g[f"ratio_{name}"] > 0
    # Every dot names its algorithm: bf16 operands for the baseline and for the
    # FP8 codes of the chunked path (BF16_BF16_F32; on XLA CPU Precision.HIGHEST,
    # see fp8jax.gemm.dot_algorithm), float32 for the float32-dequantized dot.
    bf16_alg = (
        "precision=highest,highest" if jax.default_backend() == "cpu" else "dot_bf16_bf16_f32"
    )
    assert g["dot_algorithms_bf16"] == bf16_alg
    assert g["dot_algorithms_deepseek_v3/xla"] == "dot_f32_f32_f32"
    assert g["dot_algorithms_deepseek_v3/chunked"] == bf16_alg
    # FP8 data + one float32 scale per 128 values kept for backward, vs bf16 operands.
    assert 0.5 < g["residual_ratio"] < 0.55


# ---------------------------------------------------------------- the sweep end to end


def test_sweep_writes_wellformed_outputs(tmp_path):
    shape = bench.parse_shape("32x64x48")
    cfg = bench.SweepConfig(
        shapes=[shape],
        recipes=["bf16", "hybrid_delayed"],
        impls=["xla", "chunked", "reference"],
        dequant_dtypes=("bfloat16",),
        warmup=0,
        iters=2,
        moe_step=False,
    )
    res = bench.run_sweep(cfg, log=lambda *_: None)
    paths = bench.write_results(res, str(tmp_path))
    variants = ["bf16/xla", "hybrid_delayed/xla-deqbf16", "hybrid_delayed/chunked"]
    variants.append("xla_fp8_per_tensor/xla")

    data = json.loads(Path(paths["json"]).read_text())
    assert data["device"]["backend"] == jax.default_backend()
    recs = data["records"]
    assert sorted((r["variant"], r["pass"]) for r in recs) == sorted(
        (v, p) for v in variants for p in ("fwd", "fwd_bwd")
    )
    for r in recs:
        assert r["status"] == "ok", r.get("error")
        assert r["flops"] == shape.flops(r["pass"])
        assert 0 < r["min_s"] <= r["median_s"] <= r["max_s"]
        assert math.isfinite(r["tflops"]) and r["tflops"] > 0
        assert r["peak_bytes"] is None or r["peak_bytes"] > 0
        assert r["kernel_path"] and r["kernel_path"] != "no GEMM found in HLO"
        assert r["dot_algorithms"] and r["n_gemms"] == len(r["gemms"])
        assert r["cublaslt_fp8"] in (
            ("found", "not found") if data["device"]["backend"] == "gpu" else ("n/a",)
        )
        assert r["time_ratio_to_bf16"] * r["speedup_vs_bf16"] == pytest.approx(1.0)
        if r["recipe"] == "bf16":
            assert r["speedup_vs_bf16"] == pytest.approx(1.0)
        if r["variant"] != "xla_fp8_per_tensor/xla":
            # The GEMM core names every dot's algorithm; the bf16 baseline, the
            # bf16-dequantized dot and the chunked FP8 codes all run as bf16 x bf16 -> f32
            # (named Precision.HIGHEST on XLA CPU: fp8jax.gemm.dot_algorithm).
            cpu = data["device"]["backend"] == "cpu"
            want = "precision=highest,highest" if cpu else "dot_bf16_bf16_f32"
            assert r["dot_algorithms"] == want, r["dot_algorithms"]
        # fwd_bwd runs three GEMMs (Fprop, Dgrad, Wgrad), fwd at least one.
        assert len(r["gemms"]) >= (3 if r["pass"] == "fwd_bwd" else 1)

    with open(paths["csv"]) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(recs)
    assert set(bench.sweep.CSV_FIELDS) == set(rows[0])
    assert all(float(r["median_s"]) > 0 for r in rows)

    for key in ("png_time", "png_tflops", "png_ratio_bf16", "png_memory"):
        assert Path(paths[key]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = bench.summary_table(data, "fwd")
    assert "| bf16/xla | 1.00 |" in table


def test_sweep_time_budget_marks_cases_skipped(tmp_path):
    cfg = bench.SweepConfig(
        shapes=[bench.parse_shape("16x32x16")],
        recipes=["bf16"],
        impls=["xla"],
        warmup=0,
        iters=1,
        time_budget_s=0.0,
        moe_step=False,
    )
    res = bench.run_sweep(cfg, log=lambda *_: None)
    assert [r["status"] for r in res["records"]] == ["skipped", "skipped"]
    paths = bench.write_results(res, str(tmp_path), plots=True)
    assert Path(paths["png_time"]).exists()


def _bench_command(blocked: bool, *args: str) -> list[str]:
    """experiments/bench.py with ``args``; ``blocked``: the GPU image's missing packages blocked."""
    script = str(REPO / "experiments" / "bench.py")
    return blocked_script(script, *args) if blocked else [sys.executable, script, *args]


# Without ml_collections (the GPU image, where scripts/gpu_sweep.sh runs it) the
# entry point reads the config file and its flags itself: the same run.
@pytest.mark.parametrize("blocked", [False, True], ids=["ml_collections", "gpu_image"])
def test_bench_sweep_entry_point(tmp_path, blocked):
    out = tmp_path / "out"
    proc = subprocess.run(
        _bench_command(
            blocked,
            "--config=configs/bench/sweep.py:cpu",
            "--config.shapes=16x32x24",
            "--config.recipes=bf16,deepseek_v3",
            "--config.impls=xla",
            "--config.dequant_dtypes=float32",
            "--config.passes=fwd",
            "--config.warmup=0",
            "--config.iters=1",
            "--config.moe_step=false",
            f"--out_dir={out}",
        ),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env={**__import__("os").environ, "MPLBACKEND": "Agg", "JAX_PLATFORMS": "cpu"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "deepseek_v3/xla-deqf32" in proc.stdout
    data = json.loads((out / "results.json").read_text())
    assert {r["variant"] for r in data["records"]} == {"bf16/xla", "deepseek_v3/xla-deqf32"}
    for name in ("results.csv", "time.png", "tflops.png", "ratio_bf16.png", "memory.png"):
        assert (out / name).stat().st_size > 0


@pytest.mark.parametrize(
    "args, line",
    [
        (["--config.itres=3"], "unknown config field --config.itres"),
        (["--config.iters=three"], "--config.iters='three': give int"),
        (["--config.plots=maybe"], "--config.plots='maybe': give true or false"),
        (["--outdir=x"], "unknown flag --outdir"),
        (["--config.iters"], "'--config.iters': flags are --config=FILE"),
    ],
)
def test_config_file_refuses_what_config_flags_would(monkeypatch, args, line):
    from fp8jax.bench.config_file import parse_argv

    monkeypatch.chdir(REPO)
    with pytest.raises(ValueError, match=re.escape(line)):
        parse_argv(["--config=configs/bench/sweep.py:cpu", *args])
    with pytest.raises(ValueError, match="'configs/bench/nope.py' not found"):
        parse_argv(["--config=configs/bench/nope.py"])


def test_config_file_types_overrides_as_their_defaults(monkeypatch):
    from fp8jax.bench.config_file import FieldDict, parse_argv

    monkeypatch.chdir(REPO)
    c, out = parse_argv(
        [
            "--config=configs/bench/sweep.py:cpu",
            "--config.iters=7",
            "--config.time_budget_s=2.5",
            "--config.plots=False",
            "--config.groups=",
            "--out_dir=/tmp/x",
        ]
    )
    assert isinstance(c, FieldDict) and out == "/tmp/x"
    assert (c.iters, c.time_budget_s, c.plots, c.groups) == (7, 2.5, False, "")
    assert c.m_tokens == 64 and c["benchmark"] == "sweep"  # the :cpu size, untouched
    c.warmup = 3
    assert c["warmup"] == 3
    with pytest.raises(AttributeError):
        _ = c.nope


def test_bench_without_ml_collections_refuses_in_one_line(tmp_path):
    out = tmp_path / "out"
    cmd = _bench_command(
        True, "--config=configs/bench/sweep.py:cpu", "--config.itres=3", f"--out_dir={out}"
    )
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "bench.py: error: unknown config field --config.itres (fields: configs/bench/sweep.py)"
    )
    assert not out.exists()


@pytest.mark.slow  # compiles the MoE model's train step per row: about a minute on 2 cores
def test_moe_train_steps():
    from fp8jax.bench import moe_step

    recs, note = moe_step.bench_train_steps(
        ["bf16", "current_tensor@notel"], preset="tiny", batch=2, seq=8, iters=2, log=lambda _: None
    )
    assert "ModelConfig.tiny()" in note
    assert [r["variant"] for r in recs] == ["bf16", "current_tensor@notel"]
    for r in recs:
        assert r["status"] == "ok", r.get("error")
        assert r["tokens"] == 2 * 7  # predicted tokens per step
        assert r["tokens_per_s"] > 0 and r["n_gemms"] > 0
        assert 0 < r["min_s"] <= r["median_s"] <= r["max_s"]
    assert recs[0]["speedup_vs_bf16"] == pytest.approx(1.0)
    assert "| bf16 |" in moe_step.step_table(recs)


def test_moe_step_specs():
    from fp8jax.bench import moe_step

    r, tel = moe_step.parse_spec("deepseek_v3:bfloat16@notel")
    assert r.dequant_dtype == "bfloat16" and r.name == "deepseek_v3" and tel is False
    r, tel = moe_step.parse_spec("bf16")
    assert not r.is_fp8 and tel is True
    with pytest.raises(ValueError, match="notel"):
        moe_step.parse_spec("bf16@fast")
    with pytest.raises(ValueError, match="unknown recipe"):
        moe_step.parse_spec("nope")
    with pytest.raises(ValueError, match="preset"):
        moe_step.model_config("huge")


@pytest.mark.slow
def test_checkpoint_cost_times_every_part_on_a_configs_state():
    from fp8jax.bench import checkpoint_cost

    root = Path(__file__).resolve().parents[1]
    r = checkpoint_cost.measure(root / "configs" / "tiny.py", repeats=1)
    parts = {"save_s", "record_s", "checkpointer_save_s", "restore_s", "verify_s", "try_restore_s"}
    assert set(r["median_s"]) == parts and all(v > 0 for v in r["median_s"].values())
    m = r["median_s"]
    assert r["save_ratio"] == (m["save_s"] + m["record_s"]) / m["save_s"]
    assert r["restore_ratio"] == (m["restore_s"] + m["verify_s"]) / m["restore_s"]
    lines = checkpoint_cost.report(r).splitlines()
    assert len(lines) == 3 and lines[1].startswith("save: ") and lines[2].startswith("restore: ")


def test_checkpoint_cost_config_mistakes_are_one_line_naming_the_field():
    import ml_collections

    from fp8jax.bench.experiments import BenchConfigError, checkpoint

    root = Path(__file__).resolve().parents[1]
    c = ml_collections.ConfigDict({"config": str(root / "configs" / "tiny.py"), "repeats": 0})
    with pytest.raises(BenchConfigError, match="config.repeats = 0"):
        checkpoint(c, None)
    c.config = "nope.py"
    with pytest.raises(BenchConfigError, match="config.config = 'nope.py' is not a file"):
        checkpoint(c, None)
