"""Helpers shared by the converter tests (no tests here): generate small DeepSeek-layout checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np

from fp8jax.toolkit.convert import save_file

E4M3 = ml_dtypes.float8_e4m3fn
BF16 = ml_dtypes.bfloat16

# (name, shape): FP8 linear weights with shapes that are not multiples of 128.
FP8_WEIGHTS = [
    ("model.layers.0.self_attn.q_proj.weight", (300, 200)),
    ("model.layers.0.mlp.down_proj.weight", (130, 257)),
    ("model.layers.1.mlp.experts.0.up_proj.weight", (129, 128)),
    ("model.layers.1.mlp.experts.0.gate_proj.weight", (1, 5)),
]
# Tensors that stay BF16 in DeepSeek's FP8 checkpoint.
HIGH_PRECISION = [
    ("model.embed_tokens.weight", (50, 64)),
    ("model.norm.weight", (64,)),
    ("model.layers.0.mlp.gate.weight", (8, 64)),
    ("lm_head.weight", (50, 64)),
]


# (2^26 + 2^18 + 2) / 5 * 2^-24 is a float32, and 1.25 times it is 1 + 2^-8 + 2^-25.
HARD_SCALE = np.float32((2**26 + 2**18 + 2) // 5 * 2.0**-24)
assert float(HARD_SCALE) * 1.25 == 1 + 2**-8 + 2**-25


def random_e4m3(rng: np.random.Generator, shape) -> np.ndarray:
    """Uniform random finite E4M3 codes (NaN codes 0x7F / 0xFF excluded)."""
    codes = rng.integers(0, 256, size=shape, dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x7E
    return codes.view(E4M3)


def random_scales(rng: np.random.Generator, shape) -> np.ndarray:
    """Float32 scales with full 24-bit significands, around 2^-12 .. 2^-4."""
    return (2.0 ** rng.uniform(-12, -4, size=shape)).astype(np.float32)


def write_fp8_checkpoint(root: Path, seed: int = 0) -> dict[str, np.ndarray]:
    """Three shards + index + config.json; one scale lives in another shard than its weight."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, np.ndarray] = {}
    for name, shape in FP8_WEIGHTS:
        tensors[name] = random_e4m3(rng, shape)
        tensors[name + "_scale_inv"] = random_scales(
            rng, (-(-shape[0] // 128), -(-shape[1] // 128))
        )
    # A product that a float32 intermediate would round twice: 1.25 * s =
    # 1 + 2^-8 + 2^-25 exactly, just above the midpoint of BF16 1 and 1 + 2^-7.
    first = FP8_WEIGHTS[0][0]
    tensors[first][0, 0] = 1.25
    tensors[first + "_scale_inv"][0, 0] = HARD_SCALE
    for name, shape in HIGH_PRECISION:
        tensors[name] = rng.standard_normal(shape).astype(BF16)
    names = list(tensors)
    shards = {
        "model-00001-of-00003.safetensors": names[0:1] + names[4:6],  # q_proj without its scale
        "model-00002-of-00003.safetensors": names[1:4] + names[6:9],  # q_proj's scale is here
        "model-00003-of-00003.safetensors": names[9:],
    }
    assert sorted(n for v in shards.values() for n in v) == sorted(names)
    weight_map = {}
    for fname, members in shards.items():
        save_file(root / fname, {n: tensors[n] for n in members}, {"format": "pt"})
        weight_map.update({n: fname for n in members})
    write_index(root, weight_map)
    cfg = {"model_type": "deepseek_v3", "quantization_config": {"quant_method": "fp8"}}
    (root / "config.json").write_text(json.dumps(cfg))
    (root / "tokenizer.json").write_text('{"dummy": true}')
    return tensors


def write_index(root: Path, weight_map: dict[str, str]) -> None:
    idx = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(idx))


def ref_round(x64: np.ndarray, bits: int, min_exp: int) -> np.ndarray:
    """Float64 -> nearest value with ``bits`` significant bits (ties to even), in float64.

    Independent of ml_dtypes: x = m 2^e with 0.5 <= |m| < 1; the quantum is
    2^(e - bits), but never below 2^min_exp (the format's smallest
    subnormal).  Scaling by a power of two is exact in float64, and np.rint
    rounds half to even.  No overflow handling: callers stay in range.
    """
    _, e = np.frexp(x64)
    q = np.maximum(e - bits, min_exp)
    return np.ldexp(np.rint(np.ldexp(x64, -q)), q)


def ref_round_bf16(x64: np.ndarray) -> np.ndarray:
    """Float64 -> nearest BF16 value (8 significant bits, smallest subnormal 2^-133)."""
    return ref_round(x64, 8, -133)


def ref_round_f32(x64: np.ndarray) -> np.ndarray:
    """Float64 -> nearest float32 value (24 significant bits, smallest subnormal 2^-149)."""
    return ref_round(x64, 24, -149)


def ref_round_e4m3(x64: np.ndarray) -> np.ndarray:
    """Float64 -> nearest E4M3 value, saturating at +-448 (4 bits, smallest subnormal 2^-9)."""
    return ref_round(np.clip(x64, -448, 448), 4, -9)


def ref_block_scale(s: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """Each 128x128 block's scale repeated over its block, cropped to (rows, cols), float64."""
    full = np.repeat(np.repeat(s.astype(np.float64), 128, axis=0), 128, axis=1)
    return full[:rows, :cols]


def ref_deepseek_dequant(w: np.ndarray, s: np.ndarray) -> np.ndarray:
    """DeepSeek-V3 fp8_cast_bf16.py / weight_dequant, transcribed: BF16(float32(w * s)), float64.

    The kernel loads the FP8 value as float32 and multiplies by the float32
    scale (one float32 rounding of the exact product), then stores to BF16
    (a second rounding, of the float32 result).
    """
    exact = w.astype(np.float64) * ref_block_scale(s, *w.shape)
    return ref_round_bf16(ref_round_f32(exact))


def ref_deepseek_weight_quant(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek-V3 weight_quant, transcribed: per 128x128 block s = amax / 448 in float32,
    data = E4M3(float32(x / s)).  Returns (data as float64, s as float32); all-zero blocks
    get s = 1 (DeepSeek's kernel divides 0 by 0 there)."""
    x64 = x.astype(np.float64)
    r, c = x64.shape
    sr, sc = -(-r // 128), -(-c // 128)
    s = np.empty((sr, sc), np.float32)
    for i in range(sr):
        for j in range(sc):
            amax = np.abs(x64[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]).max()
            s[i, j] = ref_round_f32(np.float64(amax) / 448.0) if amax > 0 else 1.0
    q = ref_round_f32(x64 / ref_block_scale(s, r, c))
    return ref_round_e4m3(q), s
