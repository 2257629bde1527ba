"""The fp8jax console script: each subcommand, exit codes, and the installed entry point."""

from __future__ import annotations

import json
import shutil
import subprocess

import numpy as np
import pytest
from test_convert_helpers import write_fp8_checkpoint

from fp8jax.toolkit import cli


def run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_formats_and_gpus(capsys):
    code, out, _ = run(capsys, "formats")
    assert code == 0 and "fp8_e4m3" in out and "448" in out and "typed in" in out
    code, out, _ = run(capsys, "formats", "--json")
    rows = json.loads(out)
    assert {r["name"] for r in rows} >= {"fp64", "tf32", "nf4", "int4", "e8m0"}
    code, out, _ = run(capsys, "gpus")
    assert code == 0 and "ascend910b" in out and "1978.9" in out
    code, out, _ = run(capsys, "gpus", "--sources")
    assert "datasheet" in out
    code, out, _ = run(capsys, "gpus", "--json")
    assert all(r["source"] for r in json.loads(out))


def test_plan_deepseek_cases(capsys):
    code, out, _ = run(capsys, "plan", "--model", "deepseek-r1", "--gpu", "h800")
    assert code == 0
    assert "11 x 80 GB -> 2 nodes of 8" in out
    assert "16 cards (power of two) = 2 nodes" in out
    code, out, _ = run(
        capsys, "plan", "--model", "deepseek-r1", "--gpu", "ascend910b", "--weights", "fp8"
    )
    assert code == 0
    assert "25 x 64 GB -> 4 nodes of 8" in out and "no native FP8" in out
    code, out, _ = run(capsys, "plan", "--model", "deepseek-r1", "--gpu", "h800", "--json")
    d = json.loads(out)
    assert d["nodes"] == 2 and d["weights"] == "fp8"
    code, out, _ = run(
        capsys,
        "plan",
        "--params",
        "70e9",
        "--layers",
        "80",
        "--kv-per-layer",
        "2048",
        "--gpu",
        "h100",
    )
    assert code == 0 and "custom model" in out


def test_plan_errors(capsys):
    code, _, err = run(capsys, "plan", "--model", "deepseek-r1", "--gpu", "v100")
    assert code == 1 and "unknown accelerator" in err
    code, _, err = run(capsys, "plan", "--gpu", "h800")
    assert code == 1 and "--model" in err
    with pytest.raises(SystemExit) as e:
        cli.main(["plan"])  # --gpu is required: argparse usage error
    assert e.value.code == 2


def test_convert_ok_and_corrupt(tmp_path, capsys):
    src = tmp_path / "src"
    write_fp8_checkpoint(src)
    code, out, err = run(capsys, "convert", "fp8-to-bf16", str(src), str(tmp_path / "bf16"))
    assert code == 0 and "converted 4 of" in out and "fp8-to-bf16 [" in err
    assert (tmp_path / "bf16" / "model.safetensors.index.json").exists()
    code, out, err = run(
        capsys, "convert", "bf16-to-fp8", str(tmp_path / "bf16"), str(tmp_path / "fp8"), "--quiet"
    )
    assert code == 0 and err == ""
    # Corrupt: a shard cut short.  Non-zero exit, a clear message, no output.
    shard = sorted(src.glob("*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-10])
    code, out, err = run(capsys, "convert", "fp8-to-bf16", str(src), str(tmp_path / "bad"))
    assert code == 1 and "truncated shard" in err
    assert not (tmp_path / "bad").exists()


def test_quant_error_and_numerics(tmp_path, capsys):
    rng = np.random.default_rng(0)
    np.save(tmp_path / "x.npy", (rng.standard_normal((4, 200)) * 0.1).astype(np.float32))
    code, out, _ = run(capsys, "quant-error", str(tmp_path / "x.npy"), "--no-gemm")
    assert code == 0
    for s in ["deepseek_v3: weight", "block 128x128", "tile 1x128", "e5m2", "SQNR dB", "flushed"]:
        assert s in out
    code, _, err = run(capsys, "quant-error", str(tmp_path / "missing.npy"))
    assert code == 1 and "no such file" in err
    code, out, _ = run(capsys, "numerics")
    assert code == 0 and "absorption" in out and "9007199254740993" in out


def test_installed_console_script():
    exe = shutil.which("fp8jax")
    if exe is None:
        pytest.skip("fp8jax console script not installed")
    r = subprocess.run(
        [exe, "plan", "--model", "deepseek-r1", "--gpu", "h800"], capture_output=True, text=True
    )
    assert r.returncode == 0 and "2 nodes" in r.stdout
