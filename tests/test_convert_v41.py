"""DeepSeek-V4.1-Flash's layout: 32x32 E8M0 blocks, settings under text_config, Engram tables.

A synthetic checkpoint of that layout (dense FP8 weights with one E8M0 scale per
32x32 block, FP4 routed experts with one per 1x32, an FP8 Engram table, the
``quantization_config`` under ``text_config``) converts bit for bit to the
float64 reference of tests/test_convert_layouts.py; one whose scale grid
contradicts its config is refused in one line naming the tensor.  The label
follows the files, and symlink loops at src or dst are one line.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from test_convert_layouts import (
    BF16,
    HIDDEN,
    INTER,
    bits,
    e2m1_values,
    e8m0_bytes,
    e8m0_values,
    expand,
    fp8_codes,
    make_v31,
    pack_nibbles,
    read_all,
    to_bf16_once,
    write_checkpoint,
)

from fp8jax.toolkit import cli, convert
from fp8jax.toolkit.convert import layouts

V41_CONFIG = {
    "architectures": ["DeepseekV41ForCausalLM"],
    "model_type": "deepseek_v41",
    "text_config": {
        "model_type": "deepseek_v41_text",
        "expert_dtype": "fp4",
        "quantization_config": {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "scale_fmt": "ue8m0",
            "weight_block_size": [32, 32],
        },
    },
    "vision_config": {"model_type": "deepseek_v41_vision"},
}


def make_v41(root, seed: int = 0, dense_block=(32, 32)) -> tuple[dict, dict]:
    """A V4.1-Flash-layout checkpoint; returns (tensors written, expected BF16 per name)."""
    rng = np.random.default_rng(seed)
    t: dict[str, np.ndarray] = {}
    want: dict[str, np.ndarray] = {}
    t["embed.weight"] = (0.02 * rng.standard_normal((64, HIDDEN))).astype(BF16)
    for name, shape in (("attn.wq_a", (136, HIDDEN)), ("attn.wo_a", (HIDDEN, 264))):
        w, grid = fp8_codes(rng, shape), layouts.grid_shape(shape, dense_block)
        s = e8m0_bytes(rng, grid)
        t[f"layers.0.{name}.weight"], t[f"layers.0.{name}.scale"] = w, s
        prod = w.astype(np.float64) * expand(e8m0_values(s.view(np.uint8)), dense_block, shape)
        want[f"layers.0.{name}.weight"] = to_bf16_once(prod)
    for wname, shape in (("w1", (INTER, HIDDEN)), ("w2", (HIDDEN, INTER))):
        codes = rng.integers(0, 16, shape, dtype=np.uint8)
        s = e8m0_bytes(rng, (shape[0], -(-shape[1] // 32)))
        base = f"layers.0.ffn.experts.0.{wname}"
        t[base + ".weight"], t[base + ".scale"] = pack_nibbles(codes), s
        prod = e2m1_values(codes) * expand(e8m0_values(s.view(np.uint8)), (1, 32), shape)
        want[base + ".weight"] = to_bf16_once(prod)
    # An Engram lookup table: FP8 rows, no scale tensor.
    t["layers.1.engram.table"] = fp8_codes(rng, (96, 48))
    t["norm.weight"] = np.ones(HIDDEN, BF16)
    write_checkpoint(root, t, V41_CONFIG, 2)
    return t, want


def test_v41_converts_bit_for_bit_and_passes_engram_through(tmp_path):
    src, dst = tmp_path / "v41", tmp_path / "bf16"
    tensors, want = make_v41(src)
    notes = []
    rep = convert.fp8_to_bf16(src, dst, quiet=True, warn=notes.append)
    assert rep.layout == "deepseek-v4.1" and rep.converted == len(want) == 4
    out = read_all(dst)
    for name, ref in want.items():
        assert out[name].dtype == BF16 and np.array_equal(bits(out[name]), bits(ref)), name
    table = tensors["layers.1.engram.table"]
    assert out["layers.1.engram.table"].dtype == table.dtype
    assert np.array_equal(out["layers.1.engram.table"].view(np.uint8), table.view(np.uint8))
    assert any("1 Engram lookup tensor(s)" in n and "passed through" in n for n in notes)
    cfg = json.loads((dst / "config.json").read_text())
    assert "quantization_config" not in cfg["text_config"]
    assert "expert_dtype" not in cfg["text_config"]
    assert cfg["vision_config"] == V41_CONFIG["vision_config"]


def test_a_scale_grid_contradicting_the_config_is_refused(tmp_path):
    src = tmp_path / "v41"
    make_v41(src, dense_block=(128, 128))  # grids of 128x128 blocks, config says 32x32
    with pytest.raises(convert.ConversionError) as e:
        convert.fp8_to_bf16(src, tmp_path / "o", quiet=True, warn=lambda m: None)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("'layers.0.attn.wq_a.weight'")
    assert "[2, 2] grid over [136, 200] (blocks of 128x128)" in msg
    assert "weight_block_size is [32, 32]" in msg
    assert not (tmp_path / "o").exists()


def test_without_weight_block_size_the_grid_must_be_128x128(tmp_path):
    src = tmp_path / "v41"
    make_v41(src)
    cfg = json.loads((src / "config.json").read_text())
    del cfg["text_config"]["quantization_config"]["weight_block_size"]
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(convert.ConversionError, match="no weight_block_size .*default"):
        convert.fp8_to_bf16(src, tmp_path / "o", quiet=True, warn=lambda m: None)


def test_nested_quantization_config_is_read():
    qc = layouts.read_quant_config(V41_CONFIG, "config")
    assert (qc.block, qc.scale_fmt, qc.expert_dtype) == ((32, 32), "ue8m0", "fp4")
    assert qc.block_from_config
    assert not layouts.read_quant_config({"quantization_config": {}}, "c").block_from_config
    with pytest.raises(ValueError, match="text_config.quantization_config.weight_block_size"):
        layouts.read_quant_config(
            {"text_config": {"quantization_config": {"weight_block_size": [32]}}}, "config"
        )


def test_label_follows_the_files_not_the_flag(tmp_path, capsys):
    make_v31(tmp_path / "v31", np.random.default_rng(4))
    args = ["convert", "fp8-to-bf16", str(tmp_path / "v31"), str(tmp_path / "p"), "--quiet"]
    assert cli.main([*args, "--scale-fmt", "float32"]) == 0
    assert capsys.readouterr().out.startswith("read DeepSeek-V3.1/V3.2")


@pytest.mark.parametrize("which", ["src", "dst"])
def test_a_symlink_loop_at_src_or_dst_is_one_line(tmp_path, capsys, which):
    make_v41(tmp_path / "v41")
    loop = tmp_path / "loop"
    os.symlink(loop, loop)
    src, dst = (loop, tmp_path / "o") if which == "src" else (tmp_path / "v41", loop)
    assert cli.main(["convert", "fp8-to-bf16", str(src), str(dst), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(loop) in err and "Traceback" not in err
