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


def ref_round_bf16(x64: np.ndarray) -> np.ndarray:
    """Float64 -> nearest BF16 value (ties to even), by exact power-of-two scaling.

    Independent of ml_dtypes: x = m 2^e with 0.5 <= |m| < 1; BF16 keeps 8
    significant bits, so the quantum is 2^(e-8), but never below 2^-133 (BF16's
    smallest subnormal).  Scaling by a power of two is exact in float64, and
    np.rint rounds half to even.
    """
    _, e = np.frexp(x64)
    q = np.maximum(e - 8, -133)
    return np.ldexp(np.rint(np.ldexp(x64, -q)), q)
