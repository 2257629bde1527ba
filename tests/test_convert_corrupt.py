"""One test per kind of corrupt input: a clear error, and no output that looks complete."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from test_convert_helpers import FP8_WEIGHTS, write_fp8_checkpoint, write_index

from fp8jax.toolkit import convert

WEIGHT = FP8_WEIGHTS[1][0]  # model.layers.0.mlp.down_proj.weight, (130, 257)
SCALE = WEIGHT + "_scale_inv"


def _index(root: Path) -> dict:
    return json.loads((root / "model.safetensors.index.json").read_text())


def _rewrite(root: Path, name: str, new: np.ndarray | None) -> None:
    """Replace (or with None, drop) one tensor in its shard, keeping the index in step."""
    idx = _index(root)
    shard = idx["weight_map"][name]
    part = convert.load_file(root / shard)
    if new is None:
        del part[name]
        del idx["weight_map"][name]
        write_index(root, idx["weight_map"])
    else:
        part[name] = new
    convert.save_file(root / shard, part)


def _fails(tmp_path: Path, src: Path, match: str, direction: str = "fp8-to-bf16") -> None:
    dst = tmp_path / "out"
    with pytest.raises(convert.ConversionError, match=match):
        convert.convert_checkpoint(direction, src, dst, quiet=True)
    # No output at all: neither the destination nor a leftover temporary directory.
    assert not dst.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


@pytest.fixture
def src(tmp_path):
    root = tmp_path / "src"
    write_fp8_checkpoint(root)
    return root


def test_missing_scale_tensor(tmp_path, src):
    _rewrite(src, SCALE, None)
    _fails(tmp_path, src, r"missing scale tensor '.*down_proj\.weight_scale_inv'")


def test_wrong_scale_shape(tmp_path, src):
    _rewrite(src, SCALE, np.ones((1, 2), np.float32))  # (130, 257) needs (2, 3)
    _fails(tmp_path, src, r"wrong scale shape .*\[1, 2\], expected \[2, 3\]")


def test_truncated_shard(tmp_path, src):
    shard = src / _index(src)["weight_map"][WEIGHT]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    _fails(tmp_path, src, r"truncated shard")


def test_unreadable_shard_garbage_header(tmp_path, src):
    shard = src / _index(src)["weight_map"][WEIGHT]
    data = bytearray(shard.read_bytes())
    data[8:40] = b"\x00garbage, not json at all!!\xff\xfe\x01"
    shard.write_bytes(bytes(data))
    _fails(tmp_path, src, r"unreadable shard .*not valid JSON")


def test_unreadable_shard_not_safetensors(tmp_path, src):
    shard = src / _index(src)["weight_map"][WEIGHT]
    shard.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4)
    _fails(tmp_path, src, r"unreadable shard .*header length")


@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_non_finite_scale(tmp_path, src, bad):
    s = np.ones((2, 3), np.float32)
    s[1, 2] = bad
    _rewrite(src, SCALE, s)
    _fails(tmp_path, src, r"non-finite scale: '.*down_proj\.weight_scale_inv' holds 1")


def test_index_names_missing_file(tmp_path, src):
    idx = _index(src)
    idx["weight_map"][WEIGHT] = "model-00009-of-00003.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps(idx))
    _fails(tmp_path, src, r"names a missing file: model-00009-of-00003\.safetensors")


def test_failure_mid_run_leaves_nothing(tmp_path, src):
    """A NaN in a later shard's weight is found only while converting (bf16-to-fp8),
    after the first shard was written."""
    bf16 = tmp_path / "bf16"
    convert.fp8_to_bf16(src, bf16, quiet=True)
    shutil.rmtree(src)
    bf16.rename(src)
    name = FP8_WEIGHTS[3][0]
    part_shard = _index(src)["weight_map"][name]
    assert part_shard != sorted(set(_index(src)["weight_map"].values()))[0]
    x = np.array([[1.0, 2.0, np.nan, 4.0, 5.0]], dtype=ml_dtypes.bfloat16)
    _rewrite(src, name, x)
    _fails(tmp_path, src, r"non-finite values in '.*gate_proj\.weight'", direction="bf16-to-fp8")


def test_index_disagrees_with_shard(tmp_path, src):
    idx = _index(src)
    del idx["weight_map"][WEIGHT]
    (src / "model.safetensors.index.json").write_text(json.dumps(idx))
    _fails(tmp_path, src, r"which the index puts in None")


def test_header_offsets_inconsistent(tmp_path, src):
    shard = src / _index(src)["weight_map"][WEIGHT]
    data = shard.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header[WEIGHT]["shape"] = [131, 257]
    raw = json.dumps(header).encode()
    shard.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])
    _fails(tmp_path, src, r"needs .* bytes, data_offsets give")
