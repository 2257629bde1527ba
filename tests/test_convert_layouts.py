"""DeepSeek-V3.1 (ue8m0) and DeepSeek-V4 (E8M0 scales, packed FP4 experts) checkpoints to BF16.

Synthetic checkpoints are built here in each layout, with shapes that are not
multiples of the blocks and several shards, and the converter's BF16 output
is compared bit for bit with a float64 reference written independently of
the converter: FP4 codes decoded by ml_dtypes' float4_e2m1fn, E8M0 bytes as
2^(e - 127) in float64, scales expanded with np.repeat over the whole grid,
the product taken in float64 and rounded once to BF16 (the test checks that
the float64 product is a float32, so float32 -> BF16 is that one rounding).
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from fp8jax.toolkit import cli, convert
from fp8jax.toolkit.convert import layouts

BF16 = ml_dtypes.bfloat16
E4M3 = ml_dtypes.float8_e4m3fn
E8M0 = ml_dtypes.float8_e8m0fnu
HIDDEN, INTER, VOCAB = 200, 72, 300


# -- the independent reference ------------------------------------------------------------


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """Logical (r, 2n) E2M1 codes -> (r, n) int8 bytes: element 2j low nibble, 2j+1 high."""
    lo, hi = codes[:, 0::2].astype(np.uint8), codes[:, 1::2].astype(np.uint8)
    return (lo | (hi << 4)).view(np.int8)


def e2m1_values(codes: np.ndarray) -> np.ndarray:
    return codes.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)


def e8m0_values(exps: np.ndarray) -> np.ndarray:
    return np.ldexp(1.0, exps.astype(np.int64) - 127)


def expand(scale64: np.ndarray, block: tuple[int, int], shape: tuple[int, int]) -> np.ndarray:
    return np.repeat(np.repeat(scale64, block[0], 0), block[1], 1)[: shape[0], : shape[1]]


def to_bf16_once(x64: np.ndarray) -> np.ndarray:
    x32 = x64.astype(np.float32)
    # Power-of-two scales keep the product exact in float32: one rounding, to BF16.
    assert np.array_equal(x32.astype(np.float64), x64)
    return x32.astype(BF16)


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint16)


# -- synthetic checkpoints -----------------------------------------------------------------


def fp8_codes(rng, shape):
    c = rng.integers(0, 256, shape, dtype=np.uint8)
    c[(c & 0x7F) == 0x7F] = 0x3C  # no NaN codes
    return c.view(E4M3)


def e8m0_bytes(rng, shape, lo=100, hi=130):
    return rng.integers(lo, hi, shape, dtype=np.uint8).view(E8M0)


def write_checkpoint(root: Path, tensors: dict, config: dict, shards: int) -> None:
    root.mkdir()
    names = list(tensors)
    per = -(-len(names) // shards)
    wm = {}
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i * per : (i + 1) * per]
        convert.save_file(root / fname, {n: tensors[n] for n in part}, {"format": "pt"})
        wm.update({n: fname for n in part})
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": wm})
    )
    (root / "config.json").write_text(json.dumps(config))


V4_CONFIG = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "expert_dtype": "fp4",
    "torch_dtype": "bfloat16",
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128],
    },
}


def make_v4(root: Path, seed: int = 0, shards: int = 3) -> tuple[dict, dict]:
    """A DeepSeek-V4-layout checkpoint; returns (tensors written, expected BF16 per name)."""
    rng = np.random.default_rng(seed)
    t: dict[str, np.ndarray] = {}
    want: dict[str, np.ndarray] = {}
    t["embed.weight"] = (0.02 * rng.standard_normal((VOCAB, HIDDEN))).astype(BF16)
    t["layers.0.attn_norm.weight"] = np.ones(HIDDEN, BF16)
    for name, shape in (("attn.wq_a", (136, HIDDEN)), ("attn.wo_a", (HIDDEN, 264))):
        w, grid = fp8_codes(rng, shape), layouts.grid_shape(shape, (128, 128))
        s = e8m0_bytes(rng, grid)
        t[f"layers.0.{name}.weight"], t[f"layers.0.{name}.scale"] = w, s
        prod = w.astype(np.float64) * expand(e8m0_values(s.view(np.uint8)), (128, 128), shape)
        want[f"layers.0.{name}.weight"] = to_bf16_once(prod)
    t["layers.0.ffn.gate.weight"] = (0.02 * rng.standard_normal((4, HIDDEN))).astype(BF16)
    t["layers.0.ffn.gate.bias"] = rng.standard_normal(4).astype(np.float32)
    for e in (0, 1):
        for wname, shape in (
            ("w1", (INTER, HIDDEN)),
            ("w2", (HIDDEN, INTER)),
            ("w3", (INTER, HIDDEN)),
        ):
            codes = rng.integers(0, 16, shape, dtype=np.uint8)
            grid = (shape[0], -(-shape[1] // 32))
            s = e8m0_bytes(rng, grid)
            base = f"layers.0.ffn.experts.{e}.{wname}"
            t[base + ".weight"], t[base + ".scale"] = pack_nibbles(codes), s
            prod = e2m1_values(codes) * expand(e8m0_values(s.view(np.uint8)), (1, 32), shape)
            want[base + ".weight"] = to_bf16_once(prod)
    w = fp8_codes(rng, (INTER, HIDDEN))
    s = e8m0_bytes(rng, (1, 2))
    t["layers.0.ffn.shared_experts.w1.weight"], t["layers.0.ffn.shared_experts.w1.scale"] = w, s
    want["layers.0.ffn.shared_experts.w1.weight"] = to_bf16_once(
        w.astype(np.float64) * expand(e8m0_values(s.view(np.uint8)), (128, 128), w.shape)
    )
    t["layers.0.ffn_norm.weight"] = np.ones(HIDDEN, BF16)
    t["norm.weight"] = np.ones(HIDDEN, BF16)
    t["head.weight"] = (0.02 * rng.standard_normal((VOCAB, HIDDEN))).astype(BF16)
    # A weight whose scale lives in another shard: move the scale to the end.
    t["layers.0.attn.wq_a.scale"] = t.pop("layers.0.attn.wq_a.scale")
    write_checkpoint(root, t, V4_CONFIG, shards)
    return t, want


def read_all(root: Path) -> dict[str, np.ndarray]:
    out = {}
    for p in sorted(root.glob("*.safetensors")):
        out.update(convert.load_file(p))
    return out


# -- the layouts module's pieces --------------------------------------------------------------


def test_e2m1_decoding_is_ocp_low_nibble_first():
    codes = np.arange(16, dtype=np.uint8)
    pairs = np.stack(np.meshgrid(codes, codes, indexing="ij"), -1).reshape(1, -1)
    got = layouts.decode_e2m1(pack_nibbles(pairs))
    assert np.array_equal(
        got.view(np.uint32), e2m1_values(pairs).astype(np.float32).view(np.uint32)
    )


def test_pow2_test_and_block_inference():
    s = np.array([1.0, 0.5, 2.0**-140, 2.0**127, 3.0, 1.3229 * 2**-14, 2.0**-149 * 3], np.float32)
    assert layouts.is_pow2(s).tolist() == [True, True, True, True, False, False, False]
    assert layouts.infer_block((72, 200), (72, 7)) == (1, 32)
    assert layouts.infer_block((128, 256), (1, 2)) == (128, 128)
    assert layouts.infer_block((200, 72), (200, 3)) == (1, 32)
    # ceil(200 / b) == 5 only for 40 <= b < 50: no power of two.
    assert layouts.infer_block((72, 200), (72, 5)) is None
    assert layouts.infer_block((72, 200), (71, 7)) is None
    # Every power-of-two block gives the grid it was inferred from, for odd shapes too.
    for n in range(1, 300, 7):
        for b in (1, 2, 16, 32, 128, 512):
            g = -(-n // b)
            got = layouts._axis_block(n, g)
            assert -(-n // got) == g and (g == 1 or got == b)


# -- DeepSeek-V4 ------------------------------------------------------------------------------


@pytest.mark.parametrize("rounding", ["deepseek", "exact"])
def test_v4_checkpoint_converts_to_the_float64_reference(tmp_path, rounding):
    src, dst = tmp_path / "v4", tmp_path / "bf16"
    tensors, want = make_v4(src)
    rep = convert.fp8_to_bf16(src, dst, rounding=rounding, quiet=True, warn=lambda m: None)
    assert rep.layout == "deepseek-v4" and rep.converted == len(want) == 9
    out = read_all(dst)
    assert not any(n.endswith(".scale") for n in out)
    for name, ref in want.items():
        assert out[name].dtype == BF16 and out[name].shape == ref.shape, name
        assert np.array_equal(bits(out[name]), bits(ref)), name
    for name, a in tensors.items():
        if name not in want and not name.endswith(".scale"):
            assert out[name].dtype == a.dtype and np.array_equal(
                out[name].view(np.uint8), a.view(np.uint8)
            )
    cfg = json.loads((dst / "config.json").read_text())
    assert "quantization_config" not in cfg and "expert_dtype" not in cfg
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(out)


def test_v4_refusals(tmp_path):
    src = tmp_path / "v4"
    tensors, _ = make_v4(src, shards=1)
    shard = src / "model-00001-of-00001.safetensors"

    def fails(match, **kw):
        with pytest.raises(convert.ConversionError, match=match) as e:
            convert.fp8_to_bf16(src, tmp_path / "out", quiet=True, warn=lambda m: None, **kw)
        assert "\n" not in str(e.value)
        assert not (tmp_path / "out").exists()

    def rewrite(**changes):
        t = dict(tensors)
        for k, v in changes.items():
            if v is None:
                t.pop(k)
            else:
                t[k] = v
        convert.save_file(shard, t, {"format": "pt"})
        idx = {"metadata": {}, "weight_map": {n: shard.name for n in t}}
        (src / "model.safetensors.index.json").write_text(json.dumps(idx))

    e1 = "layers.0.ffn.experts.1.w1"
    nan = np.asarray(tensors[e1 + ".scale"]).copy()
    nan.view(np.uint8)[3, 2] = 0xFF
    rewrite(**{e1 + ".scale": nan})
    fails(r"NaN scale: '.*experts\.1\.w1\.scale' \(F8_E8M0\) holds 1 byte\(s\) 0xFF")
    rewrite(**{e1 + ".scale": np.asarray(tensors[e1 + ".scale"])[:, :5].copy()})
    fails(
        r"packed FP4 tensor .* stores \[72, 100\] bytes = \[72, 200\] values, .* \[72, 5\]: no power-of-two block"
    )
    rewrite(**{e1 + ".scale": np.ones((72, 7), np.int32)})
    fails(r"scale tensor '.*w1\.scale' has dtype int32; expected float32 .* float8_e8m0fnu")
    rewrite(**{e1 + ".scale": None})
    fails(r"missing scale tensor '.*experts\.1\.w1\.scale' for the routed expert weight")
    q = "layers.0.attn.wq_a"
    rewrite(**{q + ".weight_scale_inv": np.ones((2, 2), np.float32)})
    fails(r"has two scale tensors, '.*wq_a\.weight_scale_inv' and '.*wq_a\.scale'")
    rewrite(**{q + ".scale": np.asarray(tensors[q + ".scale"])[:1].copy()})
    fails(
        r"'layers\.0\.attn\.wq_a\.weight' .* is a \[1, 2\] grid over \[136, 200\] "
        r"\(blocks of 256x128\), but config\.json's weight_block_size is \[128, 128\]"
    )
    rewrite(
        **{e1 + ".weight": np.zeros((2, 72, 50), np.int8), e1 + ".scale": np.ones((2, 72, 4), E8M0)}
    )
    fails(r"packed FP4 tensor '.*w1\.weight' .* has shape \[2, 72, 50\]; expected 2-D")
    rewrite()
    cfg = dict(V4_CONFIG, quantization_config={"scale_fmt": "e4m3"})
    (src / "config.json").write_text(json.dumps(cfg))
    fails(r"quantization_config\.scale_fmt is 'e4m3'; known: 'ue8m0'")
    (src / "config.json").write_text(
        json.dumps(dict(V4_CONFIG, quantization_config={"weight_block_size": [128]}))
    )
    fails(r"weight_block_size is \[128\]; expected two positive integers")


# -- DeepSeek-V3.1 (ue8m0 scales stored as float32) ---------------------------------------------


def make_v31(root: Path, rng, scale_fmt="ue8m0") -> dict:
    t, want = {}, {}
    for name, shape in (
        ("a.weight", (136, HIDDEN)),
        ("b.weight", (HIDDEN, 264)),
        ("c.weight", (7, 5)),
    ):
        w = fp8_codes(rng, shape)
        exps = rng.integers(-20, 3, layouts.grid_shape(shape, (128, 128)))
        s = np.ldexp(np.float32(1), exps).astype(np.float32)
        t[name], t[name + "_scale_inv"] = w, s
        want[name] = to_bf16_once(
            w.astype(np.float64) * expand(s.astype(np.float64), (128, 128), shape)
        )
    t["norm.weight"] = np.ones(HIDDEN, BF16)
    q = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    if scale_fmt:
        q["scale_fmt"] = scale_fmt
    write_checkpoint(root, t, {"model_type": "deepseek_v3", "quantization_config": q}, 2)
    return want


def test_v31_pow2_scales_convert_and_non_pow2_are_refused(tmp_path):
    rng = np.random.default_rng(1)
    src = tmp_path / "v31"
    want = make_v31(src, rng)
    rep = convert.fp8_to_bf16(src, tmp_path / "o1", quiet=True)
    assert rep.layout == "deepseek-v3.1" and rep.scale_fmt == "ue8m0"
    out = read_all(tmp_path / "o1")
    for name, ref in want.items():
        assert np.array_equal(bits(out[name]), bits(ref)), name
    # One scale off a power of two (DeepSeek-V3.1's o_proj scales have mantissa 1.3229).
    shard = next(
        p for p in sorted(src.glob("*.safetensors")) if "b.weight_scale_inv" in convert.load_file(p)
    )
    t = convert.load_file(shard)
    t["b.weight_scale_inv"][1, 0] *= np.float32(1.3229)
    convert.save_file(shard, t, {"format": "pt"})
    with pytest.raises(
        convert.ConversionError,
        match=r"'b\.weight_scale_inv' holds 1 value\(s\) that are not powers of two .* scale_fmt 'ue8m0'.*--scale-fmt float32",
    ):
        convert.fp8_to_bf16(src, tmp_path / "o2", quiet=True)
    assert not (tmp_path / "o2").exists()
    rep = convert.fp8_to_bf16(src, tmp_path / "o3", quiet=True, scale_fmt="float32")
    # Read as float32 values, still named by what the files are.
    assert rep.layout == "deepseek-v3.1" and rep.scale_fmt == "float32"
    # The same file read as plain V3 (no scale_fmt), and told ue8m0 explicitly.
    src2 = tmp_path / "v3"
    make_v31(src2, np.random.default_rng(2), scale_fmt=None)
    assert convert.fp8_to_bf16(src2, tmp_path / "o4", quiet=True).layout == "deepseek-v3"
    # Told to read them as ue8m0: the files still say DeepSeek-V3.
    rep = convert.fp8_to_bf16(src2, tmp_path / "o5", quiet=True, scale_fmt="ue8m0")
    assert rep.layout == "deepseek-v3" and rep.scale_fmt == "ue8m0"


def test_bf16_to_fp8_ue8m0_writes_power_of_two_scales(tmp_path):
    rng = np.random.default_rng(3)
    src = tmp_path / "bf16"
    x = {
        "l.weight": (rng.standard_normal((136, HIDDEN)) * 0.02).astype(BF16),
        "norm.weight": np.ones(HIDDEN, BF16),
    }
    write_checkpoint(src, x, {"model_type": "deepseek_v3"}, 1)
    rep = convert.bf16_to_fp8(src, tmp_path / "fp8", quiet=True, scale_fmt="ue8m0")
    assert rep.scale_fmt == "ue8m0"
    out = read_all(tmp_path / "fp8")
    s = out["l.weight_scale_inv"].astype(np.float64)
    # Reference: scale = 2^ceil(log2(amax / 448)) per 128x128 block, data = E4M3(x / scale).
    x64 = x["l.weight"].astype(np.float64)
    amax = np.zeros((2, 2))
    for i in range(2):
        for j in range(2):
            amax[i, j] = np.abs(x64[128 * i : 128 * i + 128, 128 * j : 128 * j + 128]).max()
    assert np.array_equal(s, np.exp2(np.ceil(np.log2(amax / 448))))
    q = x64 / expand(s, (128, 128), x64.shape)
    assert np.abs(q).max() <= 448
    assert np.array_equal(
        out["l.weight"].view(np.uint8), q.astype(np.float32).astype(E4M3).view(np.uint8)
    )
    cfg = json.loads((tmp_path / "fp8" / "config.json").read_text())
    assert cfg["quantization_config"]["scale_fmt"] == "ue8m0"
    back = convert.fp8_to_bf16(tmp_path / "fp8", tmp_path / "back", quiet=True)
    assert back.layout == "deepseek-v3.1"


def test_cli_reports_the_layout_and_takes_scale_fmt(tmp_path, capsys):
    make_v4(tmp_path / "v4")
    assert (
        cli.main(["convert", "fp8-to-bf16", str(tmp_path / "v4"), str(tmp_path / "o"), "--quiet"])
        == 0
    )
    out = capsys.readouterr().out
    assert out.startswith(
        "read DeepSeek-V4 (FP8 and FP4 weights, E8M0 scales)\nconverted 9 of 25 tensors"
    )
    rng = np.random.default_rng(4)
    make_v31(tmp_path / "v31", rng)
    t = convert.load_file(tmp_path / "v31" / "model-00001-of-00002.safetensors")
    name = next(n for n in t if n.endswith("_scale_inv"))
    t[name].flat[0] *= np.float32(3)
    convert.save_file(tmp_path / "v31" / "model-00001-of-00002.safetensors", t, {"format": "pt"})
    assert (
        cli.main(["convert", "fp8-to-bf16", str(tmp_path / "v31"), str(tmp_path / "p"), "--quiet"])
        == 2
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not powers of two" in err
    args = [
        "convert",
        "fp8-to-bf16",
        str(tmp_path / "v31"),
        str(tmp_path / "p"),
        "--quiet",
        "--scale-fmt",
        "float32",
    ]
    assert cli.main(args) == 0
