"""Accelerator table: every row sourced, figures parse, native formats agree with the catalog."""

import math
import re

import pytest

from fp8jax.toolkit import catalog, hardware

# The cards the table must cover (the original 14 and the ones deployments ask about).
REQUIRED = [
    "a100-80g",
    "a100-40g",
    "h100",
    "h100-pcie",
    "h800",
    "h20",
    "h200",
    "b200",
    "l40s",
    "rtx4090",
    "mi300x",
    "ascend910b",
    "tpu-v5e",
    "tpu-v6e",
    "v100",
    "t4",
    "a10",
    "l4",
    "l20",
    "gb200",
    "b300",
    "dgx-spark",
    "ascend910c",
    "hygon-dcu",
    "kunlun-k200",
    "thead-ppu",
    "mlu370-x8",
    "mi250x",
    "mi325x",
    "mi355x",
    "tpu-v4",
    "tpu-v5p",
    "gaudi3",
    "trainium2",
]

# Domains of vendor documents; a row citing none of them must say it rests on
# secondary sources.
VENDOR_DOMAINS = (
    "nvidia.com",
    "amd.com",
    "intel.com",
    "google.com",
    "awsdocs-neuron",
    "hiascend.com",
    "huawei.com",
    "cambricon.com",
)

HEAD = (
    "key,name,vendor,memory_gb,bandwidth_gbs,fp64_tflops,fp32_tflops,tf32_tflops,bf16_tflops,"
    "fp16_tflops,fp8_tflops,fp4_tflops,int8_tops,int4_tops,native,source,note\n"
)


def _figures(a: hardware.Accelerator) -> list[float]:
    vals = [a.memory_gb, a.bandwidth_gbs, *a.tflops.values()]
    return [v for v in vals if v is not None]


def test_required_rows_present():
    keys = [a.key for a in hardware.accelerators()]
    assert len(keys) == len(set(keys))
    assert set(REQUIRED) <= set(keys)


@pytest.mark.parametrize("a", hardware.accelerators(), ids=lambda a: a.key)
def test_every_row_parses_and_carries_a_source(a):
    for v in _figures(a):
        assert isinstance(v, float) and math.isfinite(v) and v > 0
    assert a.note
    if _figures(a):
        # Figures come with at least one address to check them against.
        assert re.search(r"https?://\S+", a.source), a.key
        if not any(d in a.source for d in VENDOR_DOMAINS):
            assert "secondary" in a.note.lower(), a.key
    else:
        assert "no figure" in a.note.lower()
    # An empty memory/bandwidth figure, or an empty FP8 figure on an FP8 card,
    # is explained in the note.
    if a.memory_gb is None or a.bandwidth_gbs is None:
        assert "left empty" in a.note or "no figure" in a.note.lower(), a.key
    if a.fp8_native and a.tflops["fp8"] is None:
        assert "left empty" in a.note, a.key


@pytest.mark.parametrize("a", hardware.accelerators(), ids=lambda a: a.key)
def test_native_formats_agree_with_catalog_and_figures(a):
    names = {r.name for r in catalog.catalog()}
    assert {f for f, _ in hardware.MATRIX_FORMATS} <= names
    if a.native is None:
        assert all(v is None for v in a.tflops.values())
        assert not a.fp8_native
        return
    assert set(a.native) <= names
    # Every format with a figure is listed as native.
    for col, v in a.tflops.items():
        if v is not None:
            assert set(hardware.COLUMN_FORMATS[col]) & set(a.native), (a.key, col)
    assert a.fp8_native == bool({"fp8_e4m3", "fp8_e4m3fnuz"} & set(a.native))


def test_format_matrix_matches_rows():
    lines = hardware.format_matrix().splitlines()
    labels = lines[0].split()[1:]
    assert labels == [lab for _, lab in hardware.MATRIX_FORMATS]
    rows = {ln.split()[0]: ln.split()[1:] for ln in lines[2:] if ln and not ln.startswith(" ")}
    for a in hardware.accelerators():
        marks = rows[a.key]
        for (fmt, _), m in zip(hardware.MATRIX_FORMATS, marks, strict=True):
            want = "?" if a.native is None else ("x" if fmt in a.native else ".")
            assert m == want, (a.key, fmt)


def test_fp8_native_flags():
    assert hardware.get("H800").fp8_native
    assert hardware.get("h100").fp8_native
    assert hardware.get("mi300x").fp8_native  # FNUZ E4M3
    assert hardware.get("mi355x").supports("fp8_e4m3")  # CDNA 4: OCP FP8
    for key in ["ascend910b", "ascend910c", "a100-80g", "v100", "t4", "mi250x", "tpu-v5p"]:
        assert not hardware.get(key).fp8_native, key
    # Volta and Turing have FP16 but no BF16 units.
    for key in ["v100", "t4"]:
        assert hardware.get(key).supports("fp16") and not hardware.get(key).supports("bf16")
    assert hardware.get("b200").supports("fp4_e2m1") and not hardware.get("h100").supports(
        "fp4_e2m1"
    )
    assert hardware.get("ascend910b").supports("hf32")
    assert hardware.get("hygon-dcu").native is None
    assert hardware.get("a100-80g").tflops["fp8"] is None
    assert hardware.get("ascend910b").memory_gb == 64


def test_dense_not_sparse():
    # Dense FP8 on Hopper is 2x dense BF16, and the dense BF16 figure is below 1000.
    for key in ["h100", "h200", "h800"]:
        a = hardware.get(key)
        assert a.tflops["bf16"] < 1000
        assert a.tflops["fp8"] == pytest.approx(2 * a.tflops["bf16"], rel=1e-3)
    assert hardware.get("b200").tflops["fp8"] == 4500
    # L4: the datasheet's 485 (FP8, sparse) halved.
    assert hardware.get("l4").tflops["fp8"] == 485 / 2
    # GiB figures converted to 1e9 bytes: TPU v4 32 GiB, Trainium2 96 GiB.
    assert hardware.get("tpu-v4").memory_gb == pytest.approx(32 * 2**30 / 1e9, abs=0.005)
    assert hardware.get("trainium2").memory_gb == pytest.approx(96 * 2**30 / 1e9, abs=0.005)


def test_lookup_and_errors():
    assert hardware.get("ascend-910b").key == "ascend910b"
    assert hardware.get("H200 SXM 141GB").key == "h200"
    assert hardware.get("V100").key == "v100"
    with pytest.raises(ValueError, match="ambiguous"):
        hardware.get("a100")
    with pytest.raises(ValueError, match="unknown accelerator"):
        hardware.get("p100")


def test_parse_rejects_bad_rows():
    good = "x,X,V,80,1000,,,,1,,,,,,bf16,some vendor datasheet,n\n"
    assert hardware.parse_table(HEAD + good)[0].tflops["bf16"] == 1.0
    bad = {
        "no source": "x,X,V,80,1000,,,,1,,,,,,bf16,,n\n",
        "no note": "x,X,V,80,1000,,,,1,,,,,,bf16,src,\n",
        "is not a number": "x,X,V,eighty,1000,,,,1,,,,,,bf16,src,n\n",
    }
    for msg, row in bad.items():
        with pytest.raises(ValueError, match=msg):
            hardware.parse_table(HEAD + row)
    for cell in ["inf", "nan", "-5", "0"]:
        with pytest.raises(ValueError, match="not a positive finite number"):
            hardware.parse_table(HEAD + f"x,X,V,{cell},1000,,,,1,,,,,,bf16,src,n\n")
    with pytest.raises(ValueError, match="duplicate"):
        hardware.parse_table(HEAD + good + good)
    # Formats: unknown names, a figure without its format, figures with '?'.
    with pytest.raises(ValueError, match="not in the catalog"):
        hardware.parse_table(HEAD + "x,X,V,80,1000,,,,1,,,,,,bf16;fp7,src,n\n")
    with pytest.raises(ValueError, match="fp8 figure 10 but no"):
        hardware.parse_table(HEAD + "x,X,V,80,1000,,,,1,,10,,,,bf16,src,n\n")
    with pytest.raises(ValueError, match="unknown"):
        hardware.parse_table(HEAD + "x,X,V,80,1000,,,,1,,,,,,?,src,n\n")
    unknown = hardware.parse_table(HEAD + "x,X,V,80,,,,,,,,,,,?,src,n\n")[0]
    assert unknown.native is None and not unknown.fp8_native


def test_table_text():
    text = hardware.format_table()
    assert "h800" in text and "ascend910b" in text and "sparsity" in text
    assert "gpus --formats" in text
    sources = hardware.format_table(sources=True)
    assert "datasheet" in sources and "https://docs.cloud.google.com/tpu/docs/v4" in sources
