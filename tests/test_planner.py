"""Planner numbers for DeepSeek-R1, worked out by hand below (not by the planner)."""

import math

import pytest

from fp8jax.toolkit import hardware, planner

# Serving budget used in both cases.
CONTEXT, BATCH, OVERHEAD = 32768, 32, 0.10
# DeepSeek-R1: 671e9 parameters, 37e9 active, 61 layers, MLA caches 512 + 64
# elements per token per layer; BF16 KV cache = 2 bytes per element.
KV_PER_TOKEN = 61 * (512 + 64) * 2  # 70,272 bytes
KV_TOTAL = BATCH * CONTEXT * KV_PER_TOKEN  # 73,686,564,864 bytes
KV_SEQ = CONTEXT * KV_PER_TOKEN


def test_deepseek_r1_fp8_on_h800_fits_two_nodes():
    p = planner.plan(
        planner.get_model("deepseek-r1"),
        hardware.get("h800"),
        weights="fp8",
        context=CONTEXT,
        batch=BATCH,
        overhead=OVERHEAD,
    )
    # FP8: 1 byte per parameter + one float32 per 128x128 block (4/16384 B/param).
    weights = 671e9 * 1
    scales = 671e9 * 4 / 16384  # 163,818,359.375 bytes
    total = (weights + scales + KV_TOTAL) * 1.10  # 819.33 GB
    assert KV_PER_TOKEN == 70272
    assert p.weight_bytes == pytest.approx(weights)
    assert p.scale_bytes == pytest.approx(scales)
    assert p.kv_bytes == pytest.approx(KV_TOTAL)
    assert p.total_bytes == pytest.approx(total)
    assert total / 80e9 == pytest.approx(10.24, abs=0.01)
    assert p.cards == 11
    assert p.nodes == 2
    assert p.layout_cards == 16 and p.layout_nodes == 2
    # Decode: active weights (with their scales) + one sequence's KV, over 3.35 TB/s.
    per_token = 37e9 * (1 + 4 / 16384) + KV_SEQ
    assert p.bytes_per_token == pytest.approx(per_token)
    assert p.tokens_per_s_one_card == pytest.approx(3350e9 / per_token)
    assert p.tokens_per_s_one_card == pytest.approx(85.2, abs=0.1)
    assert p.tokens_per_s_all_cards == pytest.approx(16 * 3350e9 / per_token)
    # Batch 32 touches every expert: a step reads all weights + 32 KV caches.
    step = weights + scales + BATCH * KV_SEQ
    assert p.batch_tokens_per_s == pytest.approx(BATCH * 16 * 3350e9 / step)
    assert not p.notes


@pytest.mark.parametrize("requested", ["auto", "fp8", "bf16"])
def test_deepseek_r1_bf16_on_ascend_needs_four_nodes(requested):
    p = planner.plan(
        planner.get_model("deepseek-r1"),
        hardware.get("ascend910b"),
        weights=requested,
        context=CONTEXT,
        batch=BATCH,
        overhead=OVERHEAD,
        bandwidth_gbs=1000.0,
    )
    weights = 671e9 * 2  # BF16, twice FP8's bytes, no scales
    total = (weights + KV_TOTAL) * 1.10  # 1,557.25 GB
    assert p.weights.name == "bf16"
    assert p.weight_bytes == pytest.approx(weights) and p.scale_bytes == 0
    assert p.total_bytes == pytest.approx(total)
    assert total / 64e9 == pytest.approx(24.33, abs=0.01)
    assert p.cards == 25
    assert p.nodes == 4
    assert p.layout_cards == 32 and p.layout_nodes == 4
    assert p.tokens_per_s_one_card == pytest.approx(1000e9 / (37e9 * 2 + KV_SEQ))
    if requested != "bf16":
        assert any("no native FP8" in n for n in p.notes)


def test_weights_alone_double_without_fp8():
    m = planner.get_model("deepseek-v3")
    fp8 = planner.plan(m, hardware.get("h800"), weights="fp8")
    bf16 = planner.plan(m, hardware.get("h800"), weights="bf16")
    assert bf16.weight_bytes == 2 * fp8.weight_bytes


def test_unknown_bandwidth_gives_no_bound():
    p = planner.plan(planner.get_model("deepseek-r1"), hardware.get("ascend910b"))
    assert p.tokens_per_s_one_card is None
    assert "n/a" in p.format()


def test_dense_gqa_model_and_small_layout():
    m = planner.get_model("llama-3.1-8b")
    p = planner.plan(m, hardware.get("h100"), weights="bf16", context=8192, batch=1, overhead=0.0)
    kv = 8192 * 32 * (2 * 8 * 128) * 2
    assert p.total_bytes == pytest.approx(8e9 * 2 + kv)
    assert p.cards == 1 and p.layout_cards == 1 and p.nodes == 1
    p3 = planner.plan(m, hardware.get("rtx4090"), weights="bf16", context=131072, batch=8)
    assert p3.cards == math.ceil(p3.total_bytes / 24e9)
    assert p3.layout_cards == 1 << (p3.cards - 1).bit_length()


def test_bad_inputs():
    m = planner.get_model("deepseek-r1")
    with pytest.raises(ValueError, match="unknown weight precision"):
        planner.plan(m, hardware.get("h800"), weights="int3")
    with pytest.raises(ValueError, match="unknown model"):
        planner.get_model("gpt-5")
    with pytest.raises(ValueError, match="cannot exceed"):
        planner.ModelSpec("x", 1e9, 2e9, 1, 1, "gqa")
