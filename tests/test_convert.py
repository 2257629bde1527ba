"""Checkpoint conversion: safetensors I/O, correct rounding and multi-shard round trips."""

from __future__ import annotations

import io
import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from test_convert_helpers import (
    BF16,
    E4M3,
    FP8_WEIGHTS,
    HARD_SCALE,
    HIGH_PRECISION,
    ref_block_scale,
    ref_deepseek_dequant,
    ref_deepseek_weight_quant,
    ref_round_bf16,
    ref_round_f32,
    write_fp8_checkpoint,
)

from fp8jax.toolkit import convert
from fp8jax.toolkit.convert import blockwise

# -- safetensors I/O ---------------------------------------------------------------


def test_safetensors_roundtrip_and_official_reader(tmp_path):
    rng = np.random.default_rng(1)
    tensors = {
        "f32": rng.standard_normal((3, 5)).astype(np.float32),
        "bf16": rng.standard_normal((4,)).astype(BF16),
        "e4m3": np.array([1.5, -448, 0.001953125], dtype=E4M3),
        "e5m2": np.array([57344, -1.5e-5], dtype=ml_dtypes.float8_e5m2),
        "i64": np.arange(7, dtype=np.int64),
        "empty": np.zeros((0, 3), np.float16),
        "scalar": np.array(2.5, np.float32),
    }
    p = tmp_path / "a.safetensors"
    convert.save_file(p, tensors, {"format": "pt"})
    back = convert.load_file(p)
    assert list(back) == list(tensors)
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape
        assert back[k].tobytes() == v.tobytes()
    with convert.SafetensorsFile(p) as f:
        assert f.metadata == {"format": "pt"}
        assert (f.data_start % 8) == 0
        np.testing.assert_array_equal(f.rows("f32", 1, 3), tensors["f32"][1:3])
    # The reference implementation reads our file ...
    st = pytest.importorskip("safetensors")
    ref = dict(st.deserialize(p.read_bytes()))
    for k, v in tensors.items():
        assert ref[k]["dtype"] == convert.safetensors_io.dtype_name(v.dtype)
        assert list(ref[k]["shape"]) == list(v.shape)
        assert bytes(ref[k]["data"]) == v.tobytes()
    # ... and we read a file put together by hand: unpadded header, data stored in
    # the reverse order of the header entries.
    names = list(tensors)[::-1]
    blob, header, off = b"", {}, 0
    for k in names:
        raw = tensors[k].tobytes()
        header[k] = {
            "dtype": convert.safetensors_io.dtype_name(tensors[k].dtype),
            "shape": list(tensors[k].shape),
            "data_offsets": [off, off + len(raw)],
        }
        blob, off = blob + raw, off + len(raw)
    hdr = json.dumps(dict(reversed(list(header.items())))).encode()
    q = tmp_path / "b.safetensors"
    q.write_bytes(struct.pack("<Q", len(hdr)) + hdr + blob)
    back2 = convert.load_file(q)
    for k, v in tensors.items():
        assert back2[k].tobytes() == v.tobytes() and back2[k].shape == v.shape


def test_arrays_outlive_close(tmp_path):
    """Arrays handed out are the reader's own copies: readable after close."""
    p = tmp_path / "v.safetensors"
    convert.save_file(p, {"a": np.arange(6, dtype=np.float32)})
    f = convert.SafetensorsFile(p)
    v = f.get("a")
    f.close()
    np.testing.assert_array_equal(v, np.arange(6))
    with pytest.raises(convert.SafetensorsError, match="closed"):
        f.get("a")


def test_writer_checks_order_and_completeness(tmp_path):
    w = convert.SafetensorsWriter(
        tmp_path / "x.safetensors", [("a", "F32", (2,)), ("b", "F32", (1,))]
    )
    with pytest.raises(ValueError, match="in order"):
        w.write("b", np.zeros(1, np.float32))
    w.write("a", np.zeros(2, np.float32))
    with pytest.raises(ValueError, match="not written in full"):
        w.close()


# -- rounding ------------------------------------------------------------------------


def test_round_to_rounds_float64_once():
    # 1 + 2^-8 + 2^-40 is above the midpoint between 1 and 1 + 2^-7: it must round up
    # (a cast through float32 would first drop the 2^-40 and then round the tie to 1).
    x = np.array([1 + 2**-8 + 2**-40, 1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8 + 2**-40)])
    got = convert.round_to(x, BF16).astype(np.float64)
    np.testing.assert_array_equal(got, [1 + 2**-7, 1.0, 1 + 2 * 2**-7, -(1 + 2**-7)])
    np.testing.assert_array_equal(got, ref_round_bf16(x))
    # Random values of every magnitude, subnormals included.
    rng = np.random.default_rng(0)
    v = rng.standard_normal(200_000) * 2.0 ** rng.integers(-140, 120, 200_000)
    np.testing.assert_array_equal(convert.round_to(v, BF16).astype(np.float64), ref_round_bf16(v))
    # E4M3: 1 + 2^-4 + 2^-30 rounds up to 1.125.
    assert convert.round_to(np.array([1 + 2**-4 + 2**-30]), E4M3).astype(float)[0] == 1.125


@pytest.mark.parametrize("rounding", ["deepseek", "exact"])
def test_dequant_rows_matches_reference(rounding):
    rng = np.random.default_rng(3)
    w = rng.integers(0, 256, (200, 300), dtype=np.uint8)
    w[(w & 0x7F) == 0x7F] = 0
    w = w.view(E4M3)
    s = (2.0 ** rng.uniform(-20, 10, (2, 3))).astype(np.float32)
    w[5, 7], s[0, 0] = 1.25, HARD_SCALE
    out = blockwise.dequant_rows(w, s, rounding=rounding)
    ref = np.empty((200, 300))
    for i in range(200):
        for j in range(0, 300, 64):  # 64 divides 128: no run crosses a block edge
            ref[i, j : j + 64] = w[i, j : j + 64].astype(np.float64) * float(s[i // 128, j // 128])
    if rounding == "exact":
        assert float(out[5, 7]) == 1 + 2**-7  # the exact product is above the BF16 midpoint
        np.testing.assert_array_equal(out.astype(np.float64), ref_round_bf16(ref))
    else:
        # The float32 product 1 + 2^-8 is a BF16 tie, which goes to even: 1.0.
        assert float(out[5, 7]) == 1.0
        np.testing.assert_array_equal(out.astype(np.float64), ref_round_bf16(ref_round_f32(ref)))
    with pytest.raises(ValueError, match="rounding must be"):
        blockwise.dequant_rows(w, s, rounding="nearest")


# -- whole checkpoints ---------------------------------------------------------------


def _load_dir(root: Path) -> dict[str, np.ndarray]:
    idx = json.loads((root / "model.safetensors.index.json").read_text())
    out = {}
    for shard in sorted(set(idx["weight_map"].values())):
        part = convert.load_file(root / shard)
        for k in part:
            assert idx["weight_map"][k] == shard
        out.update(part)
    assert set(out) == set(idx["weight_map"])
    return out


def test_fp8_to_bf16_is_deepseeks_arithmetic_bit_for_bit(tmp_path):
    """Default rounding: BF16(float32(w * s)), DeepSeek's weight_dequant, on odd shapes."""
    src, dst = tmp_path / "fp8", tmp_path / "bf16"
    tensors = write_fp8_checkpoint(src)
    err = io.StringIO()
    rep = convert.fp8_to_bf16(src, dst, progress_stream=err)
    assert rep.converted == len(FP8_WEIGHTS) and rep.shards == 3 and rep.rounding == "deepseek"
    assert "fp8-to-bf16 [" in err.getvalue() and "100.0%" in err.getvalue()
    out = _load_dir(dst)
    assert not any(k.endswith("_scale_inv") for k in out)
    assert set(out) == {n for n, _ in FP8_WEIGHTS} | {n for n, _ in HIGH_PRECISION}
    for name, shape in FP8_WEIGHTS:
        assert out[name].dtype == BF16 and out[name].shape == shape
        ref = ref_deepseek_dequant(tensors[name], tensors[name + "_scale_inv"])
        np.testing.assert_array_equal(out[name].astype(np.float64), ref)
    # The planted product 1.25 * HARD_SCALE: float32 rounds it onto a BF16 tie.
    assert float(out[FP8_WEIGHTS[0][0]][0, 0]) == 1.0
    for name, _ in HIGH_PRECISION:
        assert out[name].tobytes() == tensors[name].tobytes()
    cfg = json.loads((dst / "config.json").read_text())
    assert "quantization_config" not in cfg
    assert (dst / "tokenizer.json").read_text() == '{"dummy": true}'
    idx = json.loads((dst / "model.safetensors.index.json").read_text())
    assert idx["metadata"]["total_size"] == sum(v.nbytes for v in out.values())
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_fp8_to_bf16_exact_rounding_is_float64_reference(tmp_path):
    src, dst = tmp_path / "fp8", tmp_path / "bf16"
    tensors = write_fp8_checkpoint(src)
    rep = convert.fp8_to_bf16(src, dst, rounding="exact", quiet=True)
    assert rep.rounding == "exact"
    out = _load_dir(dst)
    for name, shape in FP8_WEIGHTS:
        exact = tensors[name].astype(np.float64) * ref_block_scale(
            tensors[name + "_scale_inv"], *shape
        )
        np.testing.assert_array_equal(out[name].astype(np.float64), ref_round_bf16(exact))
    assert float(out[FP8_WEIGHTS[0][0]][0, 0]) == 1 + 2**-7


def _bf16_checkpoint(root: Path, seed: int = 0) -> dict[str, np.ndarray]:
    """One shard of BF16 weights with odd shapes, heavy tails, an all-zero block and subnormals."""
    rng = np.random.default_rng(seed)
    root.mkdir()
    tensors = {}
    for name, shape in FP8_WEIGHTS:
        x = rng.standard_normal(shape) * np.exp(2 * rng.standard_normal(shape)) * 0.02
        tensors[name] = x.astype(np.float32).astype(BF16)
    big = FP8_WEIGHTS[0][0]
    tensors[big][:128, :128] = 0  # an all-zero block
    tensors[big][200:, 128:] *= BF16(2.0**-100)  # a block of tiny (float32-normal) values
    for name, shape in HIGH_PRECISION:
        tensors[name] = rng.standard_normal(shape).astype(BF16)
    convert.save_file(root / "model.safetensors", tensors)
    return tensors


def test_bf16_to_fp8_is_fp8jax_quantize_element_for_element(tmp_path):
    import jax

    import fp8jax

    src, dst = tmp_path / "bf16", tmp_path / "fp8"
    tensors = _bf16_checkpoint(src)
    rep = convert.bf16_to_fp8(src, dst, quiet=True)
    assert rep.converted == len(FP8_WEIGHTS) and rep.rounding is None
    out = convert.load_file(dst / "model.safetensors")
    quant = lambda x: fp8jax.quantize(x, fp8jax.E4M3, "block")
    for name, shape in FP8_WEIGHTS:
        x = tensors[name]
        for q in (quant(x), jax.jit(quant)(x)):
            assert out[name].dtype == E4M3 and out[name].shape == shape
            assert out[name].tobytes() == np.asarray(q.data).tobytes(), name
            assert out[name + "_scale_inv"].tobytes() == np.asarray(q.scale).tobytes(), name
        # ... which is DeepSeek's weight_quant arithmetic, transcribed in float64.
        data, scale = ref_deepseek_weight_quant(x)
        np.testing.assert_array_equal(out[name].astype(np.float64), data)
        np.testing.assert_array_equal(out[name + "_scale_inv"], scale)
    for name, _ in HIGH_PRECISION:
        assert out[name].tobytes() == tensors[name].tobytes()


def test_bf16_to_fp8_to_bf16_within_e4m3_error(tmp_path):
    src, fp8, back = tmp_path / "fp8src", tmp_path / "bf16", tmp_path / "fp8"
    write_fp8_checkpoint(src, seed=5)
    convert.fp8_to_bf16(src, fp8, quiet=True)
    original = _load_dir(fp8)
    # Make the weights less tame: heavy tails and an all-zero block.
    rng = np.random.default_rng(9)
    name0 = FP8_WEIGHTS[0][0]
    x = original[name0].astype(np.float64) * np.exp(2 * rng.standard_normal(original[name0].shape))
    x[:128, :128] = 0.0
    original[name0] = x.astype(BF16)
    idx = json.loads((fp8 / "model.safetensors.index.json").read_text())
    shard0 = idx["weight_map"][name0]
    part = convert.load_file(fp8 / shard0)
    part[name0] = original[name0]
    convert.save_file(fp8 / shard0, part)

    convert.bf16_to_fp8(fp8, back, keep=[r"down_proj"], quiet=True)
    q = _load_dir(back)
    roundtrip = tmp_path / "rt"
    convert.fp8_to_bf16(back, roundtrip, quiet=True)
    rt = _load_dir(roundtrip)
    assert json.loads((back / "config.json").read_text())["quantization_config"][
        "weight_block_size"
    ] == [128, 128]

    for name, shape in FP8_WEIGHTS:
        if "down_proj" in name:  # kept by the user's pattern
            assert q[name].dtype == BF16 and name + "_scale_inv" not in q
            continue
        assert q[name].dtype == E4M3
        s = q[name + "_scale_inv"]
        assert s.dtype == np.float32 and s.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
        x = original[name].astype(np.float64)
        # DeepSeek's scale: amax / 448 as a float32 division, per 128x128 block.
        for bi in range(s.shape[0]):
            for bj in range(s.shape[1]):
                blk = x[bi * 128 : (bi + 1) * 128, bj * 128 : (bj + 1) * 128]
                amax = np.float32(np.abs(blk).max())
                want = amax / np.float32(448) if amax > 0 else np.float32(1)
                assert s[bi, bj] == want
        # E4M3 keeps 4 significant bits: relative error <= 2^-4 for normals, and
        # <= half the subnormal step (2^-10 * scale) below; BF16 rounding adds 2^-8.
        scale = np.repeat(np.repeat(s.astype(np.float64), 128, 0), 128, 1)[: shape[0], : shape[1]]
        y = rt[name].astype(np.float64)
        tol = (2.0**-4 + 2.0**-8) * np.abs(x) * (1 + 2.0**-8) + 2.0**-10 * scale
        assert np.all(np.abs(y - x) <= tol), name
        assert np.abs(y - x).max() > 0  # it did quantize
    for name, _ in HIGH_PRECISION:
        assert q[name].dtype == BF16 and q[name].tobytes() == original[name].tobytes()
    assert np.all(rt[name0].astype(np.float64)[:128, :128] == 0)


def test_single_file_without_index(tmp_path):
    src, dst = tmp_path / "s", tmp_path / "d"
    src.mkdir()
    w = np.array([[1.0, -2.0, 3.0]], dtype=np.float32).astype(E4M3)
    convert.save_file(
        src / "model.safetensors",
        {"l.weight": w, "l.weight_scale_inv": np.array([[0.5]], np.float32)},
    )
    convert.fp8_to_bf16(src, dst, quiet=True)
    out = convert.load_file(dst / "model.safetensors")
    np.testing.assert_array_equal(out["l.weight"].astype(np.float32), [[0.5, -1.0, 1.5]])
    assert not (dst / "model.safetensors.index.json").exists()


def test_destination_must_not_exist(tmp_path):
    src = tmp_path / "src"
    write_fp8_checkpoint(src)
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("x")
    with pytest.raises(convert.ConversionError, match="exists"):
        convert.fp8_to_bf16(src, dst, quiet=True)
    assert (dst / "keep.txt").read_text() == "x"


def test_example_checkpoint_has_deepseeks_layout(tmp_path):
    root = convert.make_example_checkpoint(tmp_path / "ex", seed=1)
    cfg = json.loads((root / "config.json").read_text())
    assert cfg["quantization_config"]["weight_block_size"] == [128, 128]
    t = _load_dir(root)
    fp8 = [k for k, v in t.items() if v.dtype == E4M3]
    assert len(fp8) == 18 and not any("embed" in k or "norm" in k or "lm_head" in k for k in fp8)
    assert t["model.layers.1.mlp.gate.weight"].dtype == BF16  # the router stays BF16
    for k in fp8:
        s = t[k + "_scale_inv"]
        assert s.dtype == np.float32 and s.shape == blockwise.scale_shape(t[k].shape)
        w = t[k].astype(np.float64) * ref_block_scale(s, *t[k].shape)
        assert 0.015 < w.std() < 0.025 and all(dim % 128 for dim in t[k].shape)
    with pytest.raises(convert.ConversionError, match="not an empty directory"):
        convert.make_example_checkpoint(root)
    # Same seed, same bytes.
    again = convert.make_example_checkpoint(tmp_path / "ex2", seed=1)
    for p in sorted(root.iterdir()):
        assert (again / p.name).read_bytes() == p.read_bytes()


def test_zero_size_weights(tmp_path):
    src = tmp_path / "s"
    src.mkdir()
    convert.save_file(
        src / "model.safetensors",
        {
            "a.weight": np.zeros((0, 5), E4M3),
            "a.weight_scale_inv": np.zeros((0, 1), np.float32),
            "b.weight": np.array([[2.0, -3.0]], np.float32).astype(E4M3),
            "b.weight_scale_inv": np.array([[0.5]], np.float32),
        },
    )
    convert.fp8_to_bf16(src, tmp_path / "bf16", quiet=True)
    out = convert.load_file(tmp_path / "bf16" / "model.safetensors")
    assert out["a.weight"].shape == (0, 5) and out["a.weight"].dtype == BF16
    np.testing.assert_array_equal(out["b.weight"].astype(np.float64), [[1.0, -1.5]])
    # Back to FP8: the empty weight is copied (no blocks, nothing to scale).
    convert.bf16_to_fp8(tmp_path / "bf16", tmp_path / "fp8", quiet=True)
    back = convert.load_file(tmp_path / "fp8" / "model.safetensors")
    assert back["a.weight"].dtype == BF16 and "a.weight_scale_inv" not in back
    assert back["b.weight"].dtype == E4M3 and back["b.weight_scale_inv"].shape == (1, 1)
