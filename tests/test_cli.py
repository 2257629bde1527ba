"""The fp8jax console script: each subcommand, exit codes, and the installed entry point."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
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
    assert "hif8" in out and "hf32" in out and "w4a16-g128" in out and "4.1562" in out
    code, out, _ = run(capsys, "formats", "--json")
    d = json.loads(out)
    assert {r["name"] for r in d["formats"]} >= {"fp64", "tf32", "hf32", "hif8", "nf4", "int4"}
    groups = {g["name"]: g for g in d["group_formats"]}
    assert groups["nvfp4"]["bits_per_element"] == 4.5
    code, out, _ = run(capsys, "gpus")
    assert code == 0 and "ascend910b" in out and "1978.9" in out and "trainium2" in out
    code, out, _ = run(capsys, "gpus", "--sources")
    assert "datasheet" in out and "https://" in out
    code, out, _ = run(capsys, "gpus", "--json")
    rows = json.loads(out)
    assert all(r["source"] for r in rows)
    by_key = {r["key"]: r for r in rows}
    assert by_key["h800"]["fp8_native"] and "fp8_e4m3" in by_key["h800"]["native"]
    assert by_key["hygon-dcu"]["native"] is None


def test_gpus_formats_matrix(capsys):
    from fp8jax.toolkit import hardware

    code, out, _ = run(capsys, "gpus", "--formats")
    assert code == 0 and out.strip() == hardware.format_matrix()
    first = out.splitlines()[0].split()
    assert first[:3] == ["key", "fp64", "fp32"] and "hif8" in first and "int4" in first
    v100 = next(ln for ln in out.splitlines() if ln.startswith("v100 "))
    # V100: FP64, FP32 and FP16 (no TF32, HF32, BF16), no FP8.
    assert v100.split()[1:9] == ["x", "x", ".", ".", ".", "x", ".", "."]
    code, _, err = run(capsys, "gpus", "--formats", "--sources")
    assert code == 2 and len(err.strip().splitlines()) == 1


def test_version(capsys):
    from importlib import metadata

    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    out = capsys.readouterr().out.strip()
    assert out == f"fp8jax {metadata.version('fp8jax')}"


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
    code, _, err = run(capsys, "plan", "--model", "deepseek-r1", "--gpu", "p100")
    assert code == 2 and "unknown accelerator" in err and len(err.splitlines()) == 1
    code, _, err = run(capsys, "plan", "--gpu", "h800")
    assert code == 2 and "--model" in err
    code, _, err = run(capsys, "plan", "--model", "gpt-5", "--gpu", "h800")
    assert code == 2 and "unknown model" in err
    code, _, err = run(capsys, "plan", "--model", "deepseek-r1")
    assert code == 2 and "--compare" in err
    code, _, err = run(capsys, "plan", "--model", "deepseek-r1", "--compare", "--gpu", "h800")
    assert code == 2 and "not both" in err
    # A card without a memory figure needs --memory-gb: a usage mistake.
    code, _, err = run(capsys, "plan", "--model", "deepseek-r1", "--gpu", "hygon-dcu")
    assert code == 2 and "no memory figure" in err and len(err.splitlines()) == 1


# Bad numbers: one line on stderr, exit status 2, no traceback.
BAD_NUMBERS = [
    ["--params", "inf", "--gpu", "h100"],
    ["--params", "nan", "--gpu", "h100"],
    ["--params", "-7e9", "--gpu", "h100"],
    ["--params", "1e9", "--active", "2e9", "--gpu", "h100"],
    ["--params", "1e9", "--layers", "0", "--gpu", "h100"],
    ["--params", "1e9", "--kv-per-layer", "-1", "--gpu", "h100"],
    ["--model", "deepseek-r1", "--gpu", "h100", "--memory-gb", "inf"],
    ["--model", "deepseek-r1", "--gpu", "h100", "--memory-gb", "0"],
    ["--model", "deepseek-r1", "--gpu", "h100", "--bandwidth", "-100"],
    ["--model", "deepseek-r1", "--gpu", "h100", "--bandwidth", "nan"],
    ["--model", "deepseek-r1", "--gpu", "h100", "--context", "0"],
    ["--model", "deepseek-r1", "--gpu", "h100", "--batch", "1.5"],
    ["--model", "deepseek-r1", "--gpu", "h100", "--overhead", "inf"],
    ["--model", "deepseek-r1", "--gpu", "h100", "--overhead", "-0.1"],
    ["--model", "deepseek-r1", "--gpu", "h100", "--node-size", "0"],
    ["--model", "deepseek-r1", "--gpu", "h100", "--weights", "int3"],
    ["--model", "deepseek-r1", "--compare", "--sort", "price"],
    ["--model", "deepseek-r1", "--gpu", "h100", "--sort", "cards"],
    # Finite, positive and accepted once, but outside what can be planned.
    ["--model", "deepseek-r1", "--gpu", "h100", "--memory-gb", "1e308"],
    ["--model", "deepseek-r1", "--compare", "--memory-gb", "1e308"],
    ["--model", "deepseek-r1", "--gpu", "h100", "--memory-gb", "1e-300"],
    ["--model", "deepseek-r1", "--gpu", "h100", "--bandwidth", "1e308"],
    ["--model", "deepseek-r1", "--gpu", "h100", "--bandwidth", "1e-300"],
    ["--model", "deepseek-r1", "--gpu", "h100", "--context", "1" + "0" * 30],
    ["--model", "deepseek-r1", "--gpu", "h100", "--batch", "1" + "0" * 30],
    ["--model", "deepseek-r1", "--gpu", "h100", "--node-size", "1" + "0" * 30],
    ["--params", "1e308", "--gpu", "h100"],
    ["--params", "0.5", "--gpu", "h100"],
    ["--params", "1e9", "--active", "1e-3", "--gpu", "h100"],
    ["--params", "1e9", "--layers", "1" + "0" * 30, "--kv-per-layer", "1", "--gpu", "h100"],
    ["--params", "1e9", "--kv-per-layer", "1" + "0" * 400, "--gpu", "h100"],
    ["--params", "1e15", "--gpu", "h100", "--memory-gb", "0.001"],
]


@pytest.mark.parametrize("argv", BAD_NUMBERS, ids=lambda a: " ".join(a))
def test_plan_bad_numbers_one_line_exit_2(capsys, argv):
    try:
        code = cli.main(["plan", *argv])
    except SystemExit as e:  # argparse's own errors
        code = e.code
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fp8jax plan: error:"), err
    assert "Traceback" not in err


def test_plan_compare(capsys):
    from fp8jax.toolkit import hardware

    keys = [a.key for a in hardware.accelerators()]
    code, out, _ = run(capsys, "plan", "--model", "deepseek-r1", "--compare")
    assert code == 0
    listed = [ln.split()[0] for ln in out.splitlines() if ln.split() and ln.split()[0] in keys]
    assert listed == keys
    h800 = next(ln for ln in out.splitlines() if ln.startswith("h800 "))
    assert h800.split()[1:5] == ["fp8", "11", "2", "16=2x8"]
    ascend = next(ln for ln in out.splitlines() if ln.startswith("ascend910b "))
    assert ascend.split()[1:5] == ["bf16", "25", "4", "32=4x8"]
    code, out, _ = run(
        capsys, "plan", "--model", "deepseek-r1", "--compare", "--sort", "decode", "--json"
    )
    d = json.loads(out)
    assert d["sort"] == "decode" and len(d["rows"]) == len(keys)
    tps = [r["tokens_per_s_all_cards"] for r in d["rows"] if r.get("tokens_per_s_all_cards")]
    assert tps == sorted(tps, reverse=True)
    code, out, _ = run(
        capsys, "plan", "--model", "llama-3.1-70b", "--compare", "--weights", "int4", "--json"
    )
    rows = {r["accelerator"]: r for r in json.loads(out)["rows"]}
    assert rows["h100"]["weights"] == "int4" and rows["h100"]["execution"] == "dequantized"
    assert rows["hygon-dcu"]["planned"] is False


def test_plan_quantized_weights(capsys):
    code, out, _ = run(
        capsys, "plan", "--model", "deepseek-r1", "--gpu", "b200", "--weights", "fp4"
    )
    assert code == 0 and "NVFP4" in out and "multiplies FP4 (E2M1) natively" in out
    code, out, _ = run(
        capsys, "plan", "--model", "deepseek-r1", "--gpu", "h800", "--weights", "int4"
    )
    assert code == 0 and "6 x 80 GB -> 1 node of 8" in out and "dequantizes" in out


def _one_line_error(code: int, err: str, command: str, match: str) -> None:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"fp8jax {command}: error: "), err
    assert re.search(match, lines[0]), lines[0]
    assert "Traceback" not in err


def test_convert_ok_and_corrupt(tmp_path, capsys):
    src = tmp_path / "src"
    write_fp8_checkpoint(src)
    code, out, err = run(capsys, "convert", "fp8-to-bf16", str(src), str(tmp_path / "bf16"))
    assert code == 0 and "converted 4 of" in out and "fp8-to-bf16 [" in err
    assert "deepseek rounding" in out
    # Real elapsed times: the conversion's, and the whole command's since the process started.
    m = re.search(r"in (\d+\.\d\d) s \((\d+\.\d\d) s since the command started\)", out)
    assert m and 0 < float(m.group(1)) <= float(m.group(2)), out
    assert float(m.group(2)) <= cli._seconds_since_start() + 0.01  # printed to 0.01 s
    assert (tmp_path / "bf16" / "model.safetensors.index.json").exists()
    code, out, err = run(
        capsys, "convert", "bf16-to-fp8", str(tmp_path / "bf16"), str(tmp_path / "fp8"), "--quiet"
    )
    assert code == 0 and err == ""
    code, out, err = run(
        capsys,
        "convert",
        "fp8-to-bf16",
        str(src),
        str(tmp_path / "exact"),
        "--rounding",
        "exact",
        "--quiet",
    )
    assert code == 0 and "exact rounding" in out
    # Corrupt: a shard cut short.  One line, exit status 2, no output.
    shard = sorted(src.glob("*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-10])
    code, out, err = run(capsys, "convert", "fp8-to-bf16", str(src), str(tmp_path / "bad"))
    _one_line_error(code, err, "convert", "truncated shard")
    assert not (tmp_path / "bad").exists()


def test_convert_user_errors(tmp_path, capsys):
    src = tmp_path / "src"
    write_fp8_checkpoint(src)
    bf16 = tmp_path / "bf16"
    assert run(capsys, "convert", "fp8-to-bf16", str(src), str(bf16), "--quiet")[0] == 0
    cases = [
        (("bf16-to-fp8", str(bf16), str(tmp_path / "o"), "--keep", "["), "keep pattern '\\['"),
        (("fp8-to-bf16", str(bf16), str(tmp_path / "o")), "no FP8 tensor .* already is a high"),
        (("fp8-to-bf16", str(tmp_path / "missing"), str(tmp_path / "o")), "is not a directory"),
        (("fp8-to-bf16", str(src), str(src / "inside")), "inside the source"),
        (("fp8-to-bf16", str(src), str(bf16)), "exists and is not an empty directory"),
    ]
    for argv, match in cases:
        code, _, err = run(capsys, "convert", *argv)
        _one_line_error(code, err, "convert", match)
    assert not (tmp_path / "o").exists()
    # --rounding belongs to fp8-to-bf16 only: argparse refuses it elsewhere.
    with pytest.raises(SystemExit) as e:
        cli.main(["convert", "bf16-to-fp8", str(bf16), str(tmp_path / "o"), "--rounding", "exact"])
    assert e.value.code == 2


def test_convert_sigterm_exit_status(tmp_path, capsys, monkeypatch):
    src = tmp_path / "src"
    write_fp8_checkpoint(src)
    from fp8jax.toolkit.convert import fp8_bf16

    monkeypatch.setattr(
        fp8_bf16.Progress, "update", lambda self, *a: os.kill(os.getpid(), signal.SIGTERM)
    )
    code, out, err = run(capsys, "convert", "fp8-to-bf16", str(src), str(tmp_path / "o"))
    assert code == 128 + signal.SIGTERM and out == ""
    assert err.strip() == "fp8jax convert: terminated by signal SIGTERM; partial output removed"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_convert_example_then_round_trip(tmp_path, capsys):
    code, out, _ = run(capsys, "convert", "example", str(tmp_path / "ds_fp8"))
    assert code == 0 and "model.safetensors.index.json" in out and "config.json" in out
    code, out, _ = run(
        capsys, "convert", "fp8-to-bf16", str(tmp_path / "ds_fp8"), str(tmp_path / "ds_bf16")
    )
    assert code == 0 and "converted 18 of 45 tensors in 3 shard(s)" in out, out
    code, _, err = run(capsys, "convert", "example", str(tmp_path / "ds_fp8"))
    _one_line_error(code, err, "convert", "exists and is not an empty directory")


def test_quant_error_and_numerics(tmp_path, capsys):
    rng = np.random.default_rng(0)
    np.save(tmp_path / "x.npy", (rng.standard_normal((4, 200)) * 0.1).astype(np.float32))
    code, out, _ = run(capsys, "quant-error", str(tmp_path / "x.npy"), "--no-gemm")
    assert code == 0
    for s in ["deepseek_v3: weight", "block 128x128", "tile 1x128", "e5m2", "SQNR dB", "flushed"]:
        assert s in out
    code, out, _ = run(capsys, "numerics")
    assert code == 0 and "absorption" in out and "9007199254740993" in out


def test_quant_error_user_errors(tmp_path, capsys):
    x = np.ones((4, 200), np.float32)
    np.save(tmp_path / "x.npy", x)
    (tmp_path / "bad.npy").write_bytes(b"\x93NUMPY garbage")
    (tmp_path / "bad.safetensors").write_bytes(b"\x10" + bytes(7) + b"[" * 16)
    nested = tmp_path / "nested.safetensors"
    header = b'{"x":' + b"[" * 300 + b"]" * 300 + b"}"
    nested.write_bytes(len(header).to_bytes(8, "little") + header)
    np.save(tmp_path / "huge.npy", np.full((4, 200), 1e300))  # finite float64, not float32
    os.mkfifo(tmp_path / "pipe.npy")
    cases = [
        ((str(tmp_path / "x.npy"), "--tokens", "0"), "--tokens must be >= 1, got 0"),
        (
            (str(tmp_path / "x.npy"), "--tokens", "1000000000000"),
            r"--tokens 1000000000000 needs about .* GB, more than the .* GB available",
        ),
        ((str(tmp_path / "huge.npy"),), r"values up to 1e\+300, beyond float32's range"),
        ((str(tmp_path / "pipe.npy"),), "is a FIFO, not a regular file"),
        ((str(tmp_path / "x.npy"), "--axis", "7"), "--axis 7 is out of range for a 2-D tensor"),
        ((str(tmp_path / "x.npy"), "--axis", "-3", "--no-gemm"), "--axis -3 is out of range"),
        ((str(tmp_path / "missing.npy"),), "no such file"),
        ((str(tmp_path / "bad.npy"),), "unreadable .npy file"),
        ((str(tmp_path / "bad.safetensors"),), "unreadable shard"),
        ((str(nested),), "nested 301 levels"),
    ]
    for argv, match in cases:
        code, _, err = run(capsys, "quant-error", *argv)
        _one_line_error(code, err, "quant-error", match)


def test_installed_console_script():
    exe = shutil.which("fp8jax")
    if exe is None:
        pytest.skip("fp8jax console script not installed")
    r = subprocess.run(
        [exe, "plan", "--model", "deepseek-r1", "--gpu", "h800"], capture_output=True, text=True
    )
    assert r.returncode == 0 and "2 nodes" in r.stdout
