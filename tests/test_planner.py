"""Planner numbers for DeepSeek-R1, worked out by hand below (not by the planner)."""

import math
import re

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
    with pytest.raises(ValueError, match="positive integer"):
        planner.plan(m, hardware.get("h800"), context=0)
    with pytest.raises(ValueError, match="unknown model"):
        planner.get_model("gpt-5")
    with pytest.raises(ValueError, match="cannot exceed"):
        planner.ModelSpec("x", 1e9, 2e9, 1, 1, "gqa")


# Quantized weights, by hand.  Bytes per parameter = element bytes + the
# group's scale (and zero-point) bytes per parameter.
INT8_BPP = 1 + 4 / 16384  # INT8 + float32 per 128x128 block (block-INT8 R1)
INT4_BPP = 0.5 + (2 + 0.5) / 128  # INT4 + FP16 scale + 4-bit zero per 128 (W4A16)
FP4_BPP = 0.5 + 1 / 16  # FP4 E2M1 + E4M3 scale per 16 (NVFP4)


def _plan(weights, gpu, **kw):
    return planner.plan(
        planner.get_model("deepseek-r1"),
        hardware.get(gpu),
        weights=weights,
        context=CONTEXT,
        batch=BATCH,
        overhead=OVERHEAD,
        **kw,
    )


def test_int8_weights_on_h100_native():
    p = _plan("int8", "h100")
    assert p.weight_bytes + p.scale_bytes == pytest.approx(671e9 * INT8_BPP)
    total = (671e9 * INT8_BPP + KV_TOTAL) * 1.10  # 819.33 GB, as FP8
    assert p.total_bytes == pytest.approx(total)
    assert (p.cards, p.nodes, p.layout_cards) == (11, 2, 16)
    assert p.execution == "native" and any("multiplies INT8 natively" in n for n in p.notes)
    # Gaudi 3 lists no INT8 unit: the same weights are dequantized there.
    assert _plan("int8", "gaudi3").execution == "dequantized"


def test_int4_weights_on_h800_dequantized():
    p = _plan("int4", "h800")
    assert INT4_BPP == 0.51953125
    assert p.weight_bytes == pytest.approx(671e9 * 0.5)
    assert p.scale_bytes == pytest.approx(671e9 * 2.5 / 128)  # 13.11 GB
    total = (671e9 * INT4_BPP + KV_TOTAL) * 1.10  # 464.52 GB
    assert p.total_bytes == pytest.approx(total)
    assert total / 80e9 == pytest.approx(5.81, abs=0.01)
    assert (p.cards, p.nodes, p.layout_cards, p.layout_nodes) == (6, 1, 8, 1)
    per_token = 37e9 * INT4_BPP + KV_SEQ
    assert p.tokens_per_s_one_card == pytest.approx(3350e9 / per_token)
    # W4A16 is weight-only on every card, even one with INT4 units (A100).
    assert p.execution == "dequantized"
    a100 = _plan("int4", "a100-80g")
    assert a100.execution == "dequantized" and any("W4A4" in n for n in a100.notes)


@pytest.mark.parametrize("gpu,kind", [("b200", "native"), ("h100", "dequantized")])
def test_fp4_weights(gpu, kind):
    p = _plan("fp4", gpu)
    assert p.weight_bytes == pytest.approx(671e9 * 0.5)
    assert p.scale_bytes == pytest.approx(671e9 / 16)  # 41.94 GB of E4M3 scales
    total = (671e9 * FP4_BPP + KV_TOTAL) * 1.10
    assert p.total_bytes == pytest.approx(total)
    card = hardware.get(gpu).memory_gb * 1e9
    assert p.cards == math.ceil(total / card)
    assert p.execution == kind
    if gpu == "b200":
        assert (p.cards, p.layout_cards) == (3, 4)  # 496.24 GB over 180 GB cards
    # MXFP4: an E8M0 scale per 32 instead, half the scale bytes.
    mx = _plan("mxfp4", gpu)
    assert mx.scale_bytes == pytest.approx(671e9 / 32)


def test_unknown_formats_are_said():
    p = _plan("int4", "thead-ppu", bandwidth_gbs=1000.0)
    assert p.execution == "unknown"
    auto = _plan("auto", "thead-ppu")
    assert auto.weights.name == "bf16" and any("formats are unknown" in n for n in auto.notes)
    with pytest.raises(ValueError, match="no memory figure"):
        _plan("auto", "hygon-dcu")
    assert _plan("auto", "hygon-dcu", memory_gb=64.0).cards == 25


@pytest.mark.parametrize("bad", [math.inf, math.nan, -100.0, 0.0])
def test_plan_rejects_bad_overrides(bad):
    for kw in ("memory_gb", "bandwidth_gbs"):
        with pytest.raises(ValueError, match="positive finite"):
            _plan("auto", "h800", **{kw: bad})
    with pytest.raises(ValueError, match="positive finite"):
        planner.ModelSpec("x", bad, 1e9, 1, 1, "gqa")


def test_compare_lists_every_card_in_the_order_asked():
    m = planner.get_model("deepseek-r1")
    cards = hardware.accelerators()
    budget = dict(context=CONTEXT, batch=BATCH, overhead=OVERHEAD)
    rows = planner.compare(m, cards, **budget)
    assert [r.accel.key for r in rows] == [a.key for a in cards]
    by_key = {r.accel.key: r for r in rows}
    # The seed example, inside the comparison too.
    assert (by_key["h800"].plan.nodes, by_key["h800"].plan.weights.name) == (2, "fp8")
    assert (by_key["ascend910b"].plan.nodes, by_key["ascend910b"].plan.weights.name) == (4, "bf16")
    assert by_key["hygon-dcu"].plan is None and "no memory figure" in by_key["hygon-dcu"].reason
    for r in rows:
        if r.plan is not None:
            assert r.plan == planner.plan(m, r.accel, **budget)

    def keys(sort):
        return [r.accel.key for r in planner.compare(m, cards, sort=sort, **budget)]

    assert keys("name") == sorted(a.key for a in cards)
    planned = [r for r in rows if r.plan is not None]
    by_cards = keys("cards")
    assert sorted(by_cards) == sorted(a.key for a in cards)
    lay = [by_key[k].plan.layout_cards for k in by_cards if by_key[k].plan is not None]
    assert lay == sorted(lay) and by_cards[-1] == "hygon-dcu"
    by_decode = keys("decode")
    tps = [by_key[k].plan.tokens_per_s_all_cards for k in by_decode[: len(planned) - 2]]
    assert tps == sorted(tps, reverse=True)
    # Cards with no bandwidth (910B, T-Head PPU) or no plan come last, in table order.
    assert by_decode[-3:] == ["ascend910b", "hygon-dcu", "thead-ppu"]
    mem = [by_key[k].plan.total_bytes / by_key[k].plan.layout_cards for k in keys("memory")[:-1]]
    assert mem == sorted(mem)
    with pytest.raises(ValueError, match="unknown sort"):
        planner.compare(m, cards, sort="price")
    text = planner.format_compare(rows, m)
    for a in cards:
        assert re.search(rf"^{re.escape(a.key)}\s", text, re.M)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"memory_gb": 1e308}, "memory_gb must be between"),
        ({"memory_gb": 1e-300}, "memory_gb must be between"),
        ({"bandwidth_gbs": 1e308}, "bandwidth_gbs must be between"),
        ({"context": 10**30}, "context must be between"),
        ({"batch": 10**30}, "batch must be between"),
        ({"node_size": 10**30}, "node size must be between"),
    ],
)
def test_plan_refuses_what_it_cannot_compute(kw, match):
    # --memory-gb 1e308 used to plan "0 x inf GB" cards.
    with pytest.raises(ValueError, match=match):
        planner.plan(planner.get_model("deepseek-r1"), hardware.get("h800"), **kw)


def test_model_and_card_count_limits():
    with pytest.raises(ValueError, match="parameters must be between"):
        planner.ModelSpec("x", 0.5, 0.5, 1, 0, "gqa")
    with pytest.raises(ValueError, match="layers must be between"):
        planner.ModelSpec("x", 1e9, 1e9, 10**30, 1, "gqa")
    huge = planner.ModelSpec("x", 1e15, 1e15, 1, 0, "gqa")
    with pytest.raises(ValueError, match="over 1,000,000,000 cards"):
        planner.plan(huge, hardware.get("h800"), memory_gb=1e-3)
    # The limits themselves plan: every number finite.
    p = planner.plan(huge, hardware.get("h800"), context=10**12, batch=10**9, memory_gb=1e6)
    assert math.isfinite(p.total_bytes) and p.cards >= 1


def test_deepseek_v4_checkpoint_bytes_fp4_experts():
    # Flash: 43 layers x 256 experts x 3 x 4096 x 2048 routed-expert parameters.
    m = planner.get_model("deepseek-v4-flash")
    expert = 43 * 256 * 3 * 4096 * 2048
    assert m.expert_params == expert
    rest = 284e9 - expert
    # FP4 E2M1 + an E8M0 byte per 32 = 0.5 + 1/32 B; FP8 + an E8M0 byte per 128x128.
    native = expert * (0.5 + 1 / 32) + rest * (1 + 1 / 16384)
    assert planner.checkpoint_bytes(m, "deepseek-v4") == pytest.approx(native)
    assert planner.checkpoint_bytes(m, "bf16") == pytest.approx(284e9 * 2)
    # BF16 is 3.7x the native bytes, not 2x: FP4 experts quadruple.
    assert 284e9 * 2 / native == pytest.approx(3.69, abs=0.01)
    assert planner.checkpoint_bytes(
        planner.get_model("deepseek-v3"), "deepseek-v3"
    ) == pytest.approx(671e9 * (1 + 4 / 16384))
    with pytest.raises(ValueError, match="unknown checkpoint layout"):
        planner.checkpoint_bytes(m, "v5")


def test_auto_plans_deepseek_v4_as_its_published_checkpoint():
    m = planner.get_model("deepseek-v4-flash")
    expert = 43 * 256 * 3 * 4096 * 2048
    rest = 284e9 - expert
    h800, a100, b200 = (hardware.get(k) for k in ("h800", "a100-80g", "b200"))
    p = planner.plan(m, h800)
    assert p.weights.name == "deepseek-v4" and p.weights.layout == "deepseek-v4"
    # Elements: FP4 experts half a byte, FP8 rest one byte; scales: an E8M0 byte per 32
    # expert values and one per 128x128 block of the rest.
    assert p.weight_bytes == pytest.approx(expert * 0.5 + rest * 1.0, rel=1e-12)
    assert p.scale_bytes == pytest.approx(expert / 32 + rest / 16384, rel=1e-12)
    kv = 32 * 32768 * 43 * 58 * 2
    total = 1.1 * (expert * (0.5 + 1 / 32) + rest * (1 + 1 / 16384) + kv)
    assert p.total_bytes == pytest.approx(total, rel=1e-12)
    assert p.cards == math.ceil(total / 80e9) == 3 and p.layout_cards == 4
    # Decode: every non-expert parameter active, the other 13B - rest are experts in FP4.
    act = rest * (1 + 1 / 16384) + (13e9 - rest) * (0.5 + 1 / 32)
    assert p.active_weight_bytes == pytest.approx(act, rel=1e-12)
    assert p.expert_execution == "dequantized" and "154.1 GB" in " ".join(p.notes)
    assert planner.plan(m, b200).expert_execution == "native"
    # No FP8: the BF16 conversion, 2 bytes per parameter throughout.
    q = planner.plan(m, a100)
    assert q.weights.name == "bf16" and q.weight_bytes == pytest.approx(284e9 * 2)
    assert q.cards == math.ceil(1.1 * (284e9 * 2 + kv) / 80e9) == 8
    # Asked for one precision, every parameter is priced at it, with a note.
    f = planner.plan(m, h800, weights="fp8")
    assert f.weights.name == "fp8" and f.weight_bytes == pytest.approx(284e9)
    assert any("checkpoint_bytes" in n for n in f.notes)


def test_compare_uses_each_cards_layout_and_v3_is_unchanged():
    m = planner.get_model("deepseek-v4-pro")
    rows = planner.compare(m, hardware.accelerators())
    for r in rows:
        if r.plan is None:
            continue
        want = "deepseek-v4" if r.accel.fp8_native else "bf16"
        assert r.plan.weights.name == want, r.accel.key
        if want == "deepseek-v4":
            assert r.plan.weight_bytes + r.plan.scale_bytes == pytest.approx(
                planner.checkpoint_bytes(m, "deepseek-v4"), rel=1e-12
            )
    text = planner.format_compare(rows, m)
    assert "deepseek-v4" in text and "FP4 experts native" in text
    # DeepSeek-V3's published layout is FP8 throughout: the same plan as before.
    v3 = planner.plan(planner.get_model("deepseek-v3"), hardware.get("h800"))
    assert v3.weights.name == "fp8" and v3.weight_bytes + v3.scale_bytes == pytest.approx(
        planner.checkpoint_bytes(planner.get_model("deepseek-v3"), "deepseek-v3")
    )
    assert (
        planner.plan(planner.get_model("llama-3.1-70b"), hardware.get("h800")).weights.name == "fp8"
    )
    with pytest.raises(ValueError, match="unknown checkpoint layout"):
        planner.ModelSpec("x", 1e9, 1e9, 1, 0, "gqa", layout="v9")


def test_card_counts_are_exact_at_the_boundary():
    # V4-Pro's BF16 conversion, 1.6e12 x 2 bytes, plus 10%: 3,520 GB = exactly 44 x 80 GB
    # and 55 x 64 GB.  Binary floats put 1.1 x 3200e9 just above (one card too many).
    v4 = planner.get_model("deepseek-v4-pro")
    bf16 = planner.exact_checkpoint_bytes(v4, "bf16")
    assert bf16 == 3_200_000_000_000
    assert math.ceil(1.1 * 3200e9 / 80e9) == 45  # what float arithmetic gives
    assert planner.cards_for(bf16, 80) == 44
    assert planner.cards_for(bf16, 64) == 55
    # One byte more needs one card more; the exact fit does not.
    assert planner.cards_for(bf16 + 1, 80) == 45
    assert planner.cards_for(80e9, 80, overhead=0.0) == 1
    assert planner.cards_for(80e9 + 1, 80, overhead=0.0) == 2
    assert planner.exact(0.1) * 10 == 1


@pytest.mark.parametrize("gpu,cards", [("a100-80g", 44), ("ascend910b", 55)])
def test_plan_counts_cards_exactly(gpu, cards):
    # A model of 1.6e12 BF16 parameters and no KV cache: weights + 10% fill whole cards.
    m = planner.ModelSpec("v4-pro-weights", 1.6e12, 49e9, 61, 0, "none")
    p = planner.plan(m, hardware.get(gpu), weights="bf16", context=1, batch=1)
    assert p.cards == cards
    more = planner.ModelSpec("v4-pro-weights+1", 1.6e12 + 1, 49e9, 61, 0, "none")
    assert planner.plan(more, hardware.get(gpu), weights="bf16", context=1, batch=1).cards == (
        cards + 1
    )


def test_deepseek_v41_flash_layout_by_hand():
    m = planner.get_model("deepseek-v4.1-flash")
    expert = 40 * 384 * 3 * 5120 * 2304  # 543.58B routed-expert parameters
    tables = 197 * 10**9  # Engram lookup rows, FP8, one byte each
    rest = 749 * 10**9 - expert - tables
    assert m.expert_params == expert and m.table_params == tables and m.layout == "deepseek-v4.1"
    # Experts: FP4 (1/2 byte) + one E8M0 byte per 32; rest: FP8 + one E8M0 byte per 32x32.
    from fractions import Fraction as F

    want = expert * (F(1, 2) + F(1, 32)) + rest * (1 + F(1, 1024)) + tables
    assert planner.exact_checkpoint_bytes(m, "deepseek-v4.1") == want
    # The BF16 conversion keeps the tables in FP8 (convert passes them through).
    assert planner.exact_checkpoint_bytes(m, "bf16") == (expert + rest) * 2 + tables
    p = planner.plan(m, hardware.get("h800"))
    assert p.weights.layout == "deepseek-v4.1"
    assert math.isclose(p.weight_bytes + p.scale_bytes, float(want), rel_tol=1e-12)
    kv = 32 * 32768 * 40 * 11 * 2
    assert p.cards == planner.cards_for(want + kv, 80)
    # Decode reads the 8.4B rest in FP8 and the other 7.6B active as FP4 experts; no table.
    active = rest * (1 + F(1, 1024)) + (16 * 10**9 - rest) * (F(1, 2) + F(1, 32))
    assert math.isclose(p.active_weight_bytes, float(active), rel_tol=1e-12)
