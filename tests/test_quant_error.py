"""quant-error report: rows checked against an independent numpy/ml_dtypes quantizer."""

import math

import ml_dtypes
import numpy as np
import pytest

from fp8jax.toolkit import quant_error as qe
from fp8jax.toolkit.convert import round_to, save_file

E4M3 = ml_dtypes.float8_e4m3fn


def _ref_qdq(x: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """Dequantized E4M3 of x with one scale per group id (amax / 448, float32), in float64."""
    out = np.empty_like(x)
    for g in np.unique(groups):
        m = groups == g
        amax = np.float32(np.abs(x[m]).max())
        s = np.float64(amax / np.float32(448)) if amax > 0 else 1.0
        q = round_to(np.clip(x[m] / s, -448, 448), E4M3).astype(np.float64)
        out[m] = q * s
    return out


def _rel(a, b):
    return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.fixture(scope="module")
def tensor():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((130, 260)) * 0.05).astype(np.float32).astype(np.float64)
    x[7, 11] = 3.0  # an outlier
    return x


@pytest.fixture(scope="module")
def rows(tensor):
    return {
        (r.section, r.label, r.fmt): r
        for r in qe.quant_error_report(
            tensor, tokens=16, gemm_recipes=("deepseek_v3", "hybrid_delayed", "bf16")
        )
    }


def test_grid_matches_reference(tensor, rows):
    r, c = tensor.shape
    ii, jj = np.indices((r, c))
    refs = {
        "tensor": np.zeros((r, c), int),
        "row": ii,
        "tile 1x128": ii * 10 + jj // 128,
        "block 128x128": (ii // 128) * 10 + jj // 128,
    }
    for label, groups in refs.items():
        ref = _ref_qdq(tensor, groups)
        row = rows[("grid", label, "e4m3")]
        assert row.rel_error == pytest.approx(_rel(ref, tensor), rel=1e-4), label
        assert row.sqnr_db == pytest.approx(-20 * math.log10(_rel(ref, tensor)), abs=1e-3)
        assert row.saturated == 0.0
    # The outlier's tile / block / row are coarser than the others: tile beats tensor.
    assert (
        rows[("grid", "tile 1x128", "e4m3")].rel_error < rows[("grid", "tensor", "e4m3")].rel_error
    )
    # E5M2 has one mantissa bit less: about twice the error.
    ratio = rows[("grid", "tensor", "e5m2")].rel_error / rows[("grid", "tensor", "e4m3")].rel_error
    assert 1.5 < ratio < 2.5


def test_recipe_rows_and_gemm(rows):
    ds_w = rows[("operands", "deepseek_v3: weight", "e4m3")]
    assert ds_w.rel_error == rows[("grid", "block 128x128", "e4m3")].rel_error
    # Activations and gradients share 1x128 tiles with amax scales (DeepSeek-V3's
    # general rule; power-of-two scales belong to particular sites only).
    ds_x = rows[("operands", "deepseek_v3: activation/gradient", "e4m3")]
    assert ds_x.rel_error == rows[("grid", "tile 1x128", "e4m3")].rel_error
    fresh = rows[("operands", "hybrid_delayed: activation/weight (fresh state)", "e4m3")]
    steady = rows[("operands", "hybrid_delayed: activation/weight (steady state)", "e4m3")]
    # Scale 1 on values ~0.05 pushes many into E4M3 subnormals / zero.
    assert fresh.flushed > 0.001 and fresh.rel_error > steady.rel_error
    bf = rows[("operands", "bf16: activation/weight/gradient", "bfloat16")]
    assert bf.rel_error < 2.0**-8
    gemm = {k[1]: v for k, v in rows.items() if k[0] == "gemm"}
    assert set(gemm) >= {
        "deepseek_v3",
        "bf16",
        "hybrid_delayed (fresh state)",
        "hybrid_delayed (after 1 step)",
    }
    assert gemm["bf16"].rel_error < gemm["deepseek_v3"].rel_error < 0.06
    assert (
        gemm["hybrid_delayed (after 1 step)"].rel_error
        < gemm["hybrid_delayed (fresh state)"].rel_error
    )


def test_saturation_of_fresh_delayed_state():
    x = np.array([1000.0, -600.0, 300.0, 1.0, 0.5, 2.0, 0.0, 10.0])
    got = {r.label: r for r in qe.operand_rows(x)}
    fresh = got["hybrid_delayed: activation/weight (fresh state)"]
    assert fresh.saturated == pytest.approx(2 / 8)  # 1000 and -600 clip at 448
    assert got["current_tensor: activation/weight/gradient"].saturated == 0.0


def test_load_tensor(tmp_path, tensor):
    np.save(tmp_path / "t.npy", tensor.astype(np.float32))
    a, desc = qe.load_tensor(tmp_path / "t.npy")
    assert a.shape == tensor.shape and "t.npy" in desc
    w = np.array([[1.0, 2.0], [3.0, -4.0]], np.float32).astype(E4M3)
    save_file(
        tmp_path / "m.safetensors",
        {
            "l.weight": w,
            "l.weight_scale_inv": np.array([[0.25]], np.float32),
            "b": np.ones(3, np.float32),
        },
    )
    a, desc = qe.load_tensor(tmp_path / "m.safetensors", "l.weight")
    np.testing.assert_array_equal(a, [[0.25, 0.5], [0.75, -1.0]])
    assert "dequantized" in desc
    with pytest.raises(ValueError, match="pick one with --tensor"):
        qe.load_tensor(tmp_path / "m.safetensors")
    with pytest.raises(ValueError, match="no tensor"):
        qe.load_tensor(tmp_path / "m.safetensors", "nope")
    np.save(tmp_path / "bad.npy", np.array([1.0, np.nan, np.inf]))
    with pytest.raises(ValueError, match="holds 1 NaN and 1 Inf value"):
        qe.load_tensor(tmp_path / "bad.npy")


def _fp8_file(tmp_path, w_codes: np.ndarray, scale: np.ndarray):
    p = tmp_path / "w.safetensors"
    save_file(p, {"l.weight": w_codes.view(E4M3), "l.weight_scale_inv": scale})
    return p


def test_load_tensor_refuses_bad_scales_and_codes(tmp_path):
    codes = np.full((130, 5), 0x38, np.uint8)  # E4M3 1.0
    ok = _fp8_file(tmp_path, codes, np.array([[0.5], [2.0]], np.float32))
    a, _ = qe.load_tensor(ok, "l.weight")
    assert a[0, 0] == 0.5 and a[129, 4] == 2.0
    # A scale larger than the weight's blocks was cropped silently: now refused.
    big = _fp8_file(tmp_path, codes, np.ones((3, 2), np.float32))
    with pytest.raises(ValueError, match=r"wrong scale shape .*\[3, 2\], expected \[2, 1\]"):
        qe.load_tensor(big, "l.weight")
    for bad, match in [(0.0, "non-positive scale"), (-1.0, "non-positive"), (np.nan, "non-finite")]:
        p = _fp8_file(tmp_path, codes, np.array([[1.0], [bad]], np.float32))
        with pytest.raises(ValueError, match=match):
            qe.load_tensor(p, "l.weight")
    nan = codes.copy()
    nan[3, 3] = 0x7F
    p = _fp8_file(tmp_path, nan, np.array([[0.5], [2.0]], np.float32))
    with pytest.raises(ValueError, match=r"l\.weight holds 1 NaN value"):
        qe.load_tensor(p, "l.weight")


def test_report_validates_axis_and_tokens():
    x = np.ones((3, 130))
    for axis in (-2, -1, 0, 1):
        assert qe.check_axis(axis, 2) == axis % 2
    for axis in (2, 7, -3):
        with pytest.raises(ValueError, match=f"--axis {axis} is out of range for a 2-D tensor"):
            qe.quant_error_report(x, axis=axis, gemm=False)
    with pytest.raises(ValueError, match="tokens must be >= 1, got 0"):
        qe.quant_error_report(x, tokens=0)
    with pytest.raises(ValueError, match="tokens must be >= 1"):
        qe.gemm_rows(x, tokens=0)


def test_gemm_section_that_cannot_fit_is_refused_before_allocating():
    w = np.ones((3, 200))
    # 10^12 tokens of a 200-wide activation: petabytes, on any machine.
    with pytest.raises(ValueError, match=r"--tokens 1000000000000 needs about .* GB"):
        qe.quant_error_report(w, tokens=10**12)
    assert qe.gemm_bytes((3, 200), 10) == 10 * (200 * 21 + 3 * 20)
    with pytest.raises(ValueError, match="more than the 1e-06 GB available"):
        qe.check_gemm_fits((3, 200), 10, available=1000)
    qe.check_gemm_fits((3, 200), 10, available=10**6)


def test_values_beyond_float32_are_refused(tmp_path):
    np.save(tmp_path / "big.npy", np.array([[1.0, 4e38], [2.0, 3.0]]))
    with pytest.raises(ValueError, match="beyond float32's range"):
        qe.load_tensor(tmp_path / "big.npy")
