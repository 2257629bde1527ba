"""DeepSeek's inference amax floor (1e-4): an option of the quantizer, off in training.

``fp8jax.quantize(..., amax_floor=DEEPSEEK_AMAX_FLOOR)`` is bit for bit the
floored act_quant (DeepSeek-V3's inference code since 2025-08-27, DeepGEMM's
``per_token_cast_to_fp8``), with and without its power-of-two scales, checked
against the numpy reference in tests/reference.py; without the option it is the
2024 act_quant.  No training preset sets a floor, and the converter's
bf16-to-fp8 applies it with ue8m0 scales only.
"""

import dataclasses
import json

import ml_dtypes
import numpy as np
import pytest
from reference import ref_act_quant

import fp8jax
from fp8jax import registry
from fp8jax.recipes import QuantSpec
from fp8jax.scaling import DEEPSEEK_AMAX_FLOOR
from fp8jax.toolkit import cli, convert

# One 1x128 tile per amax: far below, just below, at and above the floor.
AMAXES = (1e-6, 5e-5, 9.99e-5, 1e-4, 1.5e-4, 0.3, 7.0)


def _tiles(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((len(AMAXES), 128)).astype(np.float32)
    for i, a in enumerate(AMAXES):
        x[i] *= np.float32(a) / np.abs(x[i]).max()
    return x


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("floor", [0.0, DEEPSEEK_AMAX_FLOOR])
def test_quantize_is_the_act_quant_of_its_floor(pow2, floor):
    x = _tiles()
    q = fp8jax.quantize(x, fp8jax.E4M3, "tile", axis=-1, pow2=pow2, amax_floor=floor)
    data, scale = ref_act_quant(x, amax_floor=floor, pow2=pow2)
    np.testing.assert_array_equal(np.asarray(q.data).view(np.uint8), data.view(np.uint8))
    np.testing.assert_array_equal(
        np.asarray(q.scale, np.float32).reshape(scale.shape).view(np.uint32),
        scale.view(np.uint32),
    )


def test_the_floor_changes_only_tiles_below_it():
    x = _tiles()
    below = (np.array(AMAXES) < np.float32(DEEPSEEK_AMAX_FLOOR))[:, None]
    _, floored = ref_act_quant(x, amax_floor=DEEPSEEK_AMAX_FLOOR)
    _, plain = ref_act_quant(x)
    assert np.all(np.where(below, floored > plain, floored == plain))
    # Power-of-two scales of a 1e-6 tile: 2^-22 (1e-4 / 448 rounded up) instead of 2^-28.
    _, floored = ref_act_quant(x, amax_floor=DEEPSEEK_AMAX_FLOOR, pow2=True)
    _, plain = ref_act_quant(x, pow2=True)
    assert floored[0, 0] == 2.0**-22 and plain[0, 0] == 2.0**-28


def test_training_presets_set_no_floor():
    def specs(obj):
        if isinstance(obj, QuantSpec):
            yield obj
        elif dataclasses.is_dataclass(obj):
            for f in dataclasses.fields(obj):
                yield from specs(getattr(obj, f.name))

    for name in registry.RECIPES:
        found = list(specs(registry.get(name)))
        assert all(s.amax_floor == 0 for s in found), name
    assert any(specs(registry.get("deepseek_v3")))


def _tiny_block_checkpoint(root) -> None:
    w = np.full((128, 128), 1e-6, np.float32)
    w[0, 0] = -1e-6
    root.mkdir()
    convert.save_file(
        root / "model.safetensors",
        {"layers.0.w.weight": w.astype(ml_dtypes.bfloat16)},
        {"format": "pt"},
    )
    (root / "config.json").write_text(json.dumps({"model_type": "x"}))


@pytest.mark.parametrize(
    "args,scale",
    [
        (["--scale-fmt", "ue8m0"], 2.0**-22),  # DeepGEMM's per_block_cast_to_fp8
        (["--scale-fmt", "ue8m0", "--amax-floor", "0"], 2.0**-28),
        ([], None),  # float32 scales: no floor, amax / 448
    ],
)
def test_bf16_to_fp8_floors_ue8m0_scales_by_default(tmp_path, capsys, args, scale):
    _tiny_block_checkpoint(tmp_path / "src")
    dst = tmp_path / "dst"
    assert (
        cli.main(["convert", "bf16-to-fp8", str(tmp_path / "src"), str(dst), "--quiet", *args]) == 0
    )
    s = convert.load_file(dst / "model.safetensors")["layers.0.w.weight_scale_inv"]
    amax = np.float32(ml_dtypes.bfloat16(1e-6))
    want = np.float32(amax / np.float32(448)) if scale is None else np.float32(scale)
    assert s.shape == (1, 1) and s[0, 0] == want
    out = capsys.readouterr().out
    assert ("amax floored at 0.0001" in out) == (scale == 2.0**-22)


def test_a_negative_floor_is_one_line(tmp_path, capsys):
    _tiny_block_checkpoint(tmp_path / "src")
    args = ["convert", "bf16-to-fp8", str(tmp_path / "src"), str(tmp_path / "d")]
    assert cli.main([*args, "--amax-floor", "-1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "amax_floor must be a finite number >= 0" in err
    assert not (tmp_path / "d").exists()
