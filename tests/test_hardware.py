"""Accelerator table: every row sourced, figures parse, the cards the issue names are present."""

import pytest

from fp8jax.toolkit import hardware

REQUIRED = [
    "a100-80g",
    "h100",
    "h800",
    "h20",
    "h200",
    "b200",
    "l40s",
    "rtx4090",
    "mi300x",
    "ascend910b",
]


def test_required_rows_and_sources():
    keys = [a.key for a in hardware.accelerators()]
    for k in REQUIRED:
        assert k in keys
    for a in hardware.accelerators():
        assert a.source and len(a.source) > 20
        assert a.note
        # An empty memory/bandwidth figure must be explained in the note, and so
        # must an empty FP8 figure on a card that has FP8.
        if a.memory_gb is None or a.bandwidth_gbs is None:
            assert "left empty" in a.note, a.key
        if a.fp8_native and a.tflops["fp8"] is None:
            assert "left empty" in a.note, a.key


def test_fp8_native_flags():
    assert hardware.get("H800").fp8_native
    assert hardware.get("h100").fp8_native
    assert hardware.get("mi300x").fp8_native
    assert not hardware.get("Ascend 910B").fp8_native
    assert not hardware.get("a100-80g").fp8_native
    # No FP8 figure on a card without FP8.
    assert hardware.get("a100-80g").tflops["fp8"] is None
    assert hardware.get("ascend910b").memory_gb == 64


def test_dense_not_sparse():
    # Dense FP8 on Hopper is 2x dense BF16, and the dense BF16 figure is below 1000.
    for key in ["h100", "h200", "h800"]:
        a = hardware.get(key)
        assert a.tflops["bf16"] < 1000
        assert a.tflops["fp8"] == pytest.approx(2 * a.tflops["bf16"], rel=1e-3)
    assert hardware.get("b200").tflops["fp8"] == 4500


def test_lookup_and_errors():
    assert hardware.get("ascend-910b").key == "ascend910b"
    assert hardware.get("H200 SXM 141GB").key == "h200"
    with pytest.raises(ValueError, match="ambiguous"):
        hardware.get("a100")
    with pytest.raises(ValueError, match="unknown accelerator"):
        hardware.get("v100")


def test_parse_rejects_bad_rows():
    head = "key,name,vendor,memory_gb,bandwidth_gbs,fp64_tflops,fp32_tflops,tf32_tflops,bf16_tflops,fp16_tflops,fp8_tflops,fp4_tflops,int8_tops,fp8_native,source,note\n"
    good = "x,X,V,80,1000,,,,1,,,,,no,some vendor datasheet,n\n"
    assert hardware.parse_table(head + good)[0].tflops["bf16"] == 1.0
    with pytest.raises(ValueError, match="no source"):
        hardware.parse_table(head + "x,X,V,80,1000,,,,1,,,,,no,,n\n")
    with pytest.raises(ValueError, match="not a number"):
        hardware.parse_table(head + "x,X,V,eighty,1000,,,,1,,,,,no,src,n\n")
    with pytest.raises(ValueError, match="duplicate"):
        hardware.parse_table(head + good + good)


def test_table_text():
    text = hardware.format_table()
    assert "h800" in text and "ascend910b" in text and "sparsity" in text
    assert "datasheet" in hardware.format_table(sources=True)
