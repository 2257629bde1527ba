"""DeepSeek's quantized checkpoint layouts (V3, V3.1 / V3.2, V4): what a tensor holds, read from the files.

Three layouts, told apart by the files themselves (config.json and the
tensors' dtypes and names), never by a model name:

* **DeepSeek-V3** (``deepseek-v3``): an FP8 weight ``W`` (``F8_E4M3``) and a
  float32 ``W_scale_inv`` of shape ``(ceil(rows/128), ceil(cols/128))``,
  one scale per 128x128 block; config.json ``quantization_config`` has
  ``weight_block_size: [128, 128]`` and no ``scale_fmt``.
* **DeepSeek-V3.1 / V3.2** (``deepseek-v3.1``): the same tensors, but
  ``quantization_config.scale_fmt`` is ``"ue8m0"``: the scales are powers of
  two (the "UE8M0 FP8 scale data format"), still stored as float32.  A
  UE8M0 consumer keeps only the exponent of a scale, so a scale that is not a
  power of two would be read wrong without any error; such a checkpoint is
  refused unless the caller says to read its scales as the float32 values
  they are (``scale_fmt="float32"``).  (DeepSeek-V3.1's published
  ``self_attn.o_proj.weight_scale_inv`` tensors are such an exception:
  deepseek-ai/DeepSeek-V3 issue 961 reports that they share the mantissa
  1.3229 instead of 1.)
* **DeepSeek-V4** (``deepseek-v4``): names ``P.weight`` with the scale in
  ``P.scale``.  FP8 weights (attention, shared experts) are ``F8_E4M3``
  with ``F8_E8M0`` scales per 128x128 block; routed experts' weights
  (config.json ``expert_dtype: "fp4"``) are FP4 E2M1 packed two per byte
  into ``I8`` (``U8`` read the same) of shape ``(rows, cols / 2)``, with
  ``F8_E8M0`` scales of shape ``(rows, cols / 32)``: one per 1x32 block along
  the contraction axis (DeepSeek-V4 ``inference/model.py``, ``Linear``:
  "weight is [out, in//2] in float4_e2m1fn_x2 ... Scale is [out, in//32] in
  float8_e8m0fnu").  Norms, embeddings and the router stay BF16 / F32.

E8M0 (``float8_e8m0fnu``, OCP MX v1.0): an exponent-only byte ``e`` worth
``2^(e - 127)``, from 2^-127 (``0x00``) to 2^127 (``0xFE``); ``0xFF`` is NaN
and is refused.  E2M1 (OCP MX v1.0): sign, two exponent bits (bias 1), one
mantissa bit: ``0, 0.5, 1, 1.5, 2, 3, 4, 6`` and their negatives.

Nibble order of packed FP4: element ``2j`` is the low nibble of byte ``j``
(``byte & 0x0F``), element ``2j + 1`` the high nibble (``byte >> 4``), as
DeepSeek-V4's ``inference/convert.py`` (``cast_e2m1fn_to_e4m3fn``: ``low = x &
0x0F; high = (x >> 4) & 0x0F``, stacked low first), MaxText's
``checkpoint_conversion/standalone_scripts/deepseek_dequantize.py``
(``unpack_fp4``) and Hugging Face transformers' ``finegrained_fp8.py``
unpack it.  Code ``0b1000`` is -0 (OCP; ml_dtypes' ``float4_e2m1fn``);
DeepSeek's own ``FP4_TABLE`` maps it to +0, so a BF16 file DeepSeek's script
writes may differ from this module's in the sign of zeros, nowhere else.

* **DeepSeek-V4.1** (``deepseek-v4.1``; V4.1-Flash, 2026-09): V4's tensors,
  but the FP8 weights' E8M0 scales are one per 32x32 block
  (``quantization_config``: ``weight_block_size: [32, 32]``, ``scale_fmt:
  "ue8m0"``), and config.json holds the text model's settings, the
  ``quantization_config`` among them, under ``text_config`` (read there
  when the top level has none).  Its FP8 "Engram" lookup tables (tensor
  names containing ``engram``) are rows fetched by an n-gram hash, not GEMM
  weights: fp8-to-bf16 passes them through as they are, with their scale
  tensors if they have any, and says so (:func:`is_engram`).

Block sizes come from the files: each FP8 tensor's block is inferred from its
scale grid (:func:`infer_block`) and must agree with config.json's
``weight_block_size`` where it gives one (a disagreement is refused, naming the
tensor: a reader assuming the wrong block rescales every weight without an
error); 128x128 when neither decides.  The FP4 block comes from the scale grid.  A block is a power of two along each axis; for a
power of two ``b`` the grid ``ceil(n / b)`` determines ``b`` uniquely when
it has two or more entries along that axis, and with one entry every
candidate ``b >= n`` groups the axis the same way, so the grid alone says
how the tensor is blocked, for shapes that are multiples of the block and
for those that are not.

Dequantized values (:func:`fp8jax.toolkit.convert.blockwise.dequant_rows`)
are ``BF16(float32(value) * float32(scale))``.  With a power-of-two scale
(every E8M0 scale, every UE8M0 scale) that float32 product is exact (an E4M3
value has 4 significant bits with its last at 2^-9 or above, an E2M1 value 2
bits with its last at 2^-1 or above; times 2^-127 the last bit stays at or
above 2^-136, inside float32's subnormal range, which reaches 2^-149), so the
result is the exact product rounded once to BF16.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import ml_dtypes
import numpy as np

BLOCK = 128
# OCP MX v1.0 E2M1 values by code (sign bit 3): DeepSeek-V4's FP4_TABLE with -0 at 0b1000.
E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    np.float32,
)
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
E8M0_NAN = 0xFF
SCALE_FMTS = ("float32", "ue8m0")
LAYOUT_NAMES = {
    "deepseek-v3": "DeepSeek-V3 (FP8, float32 block scales)",
    "deepseek-v3.1": "DeepSeek-V3.1/V3.2 (FP8, power-of-two ue8m0 scales stored as float32)",
    "deepseek-v4": "DeepSeek-V4 (FP8 and FP4 weights, E8M0 scales)",
    "deepseek-v4.1": "DeepSeek-V4.1 (FP8 weights in 32x32 blocks, FP4 experts, E8M0 scales)",
}
_ENGRAM = re.compile(r"engram", re.IGNORECASE)


def is_engram(name: str) -> bool:
    """An Engram lookup table (DeepSeek-V4.1) or its scale: passed through by fp8-to-bf16."""
    return bool(_ENGRAM.search(name))


def decode_e2m1(packed: np.ndarray) -> np.ndarray:
    """float32 values of packed FP4 bytes: (..., n) bytes -> (..., 2n), low nibble first.

    Every E2M1 value is exact in float32.
    """
    u = np.ascontiguousarray(packed).view(np.uint8)
    out = np.empty((*u.shape[:-1], 2 * u.shape[-1]), np.float32)
    out[..., 0::2] = E2M1_VALUES[u & 0x0F]
    out[..., 1::2] = E2M1_VALUES[u >> 4]
    return out


def is_pow2(s: np.ndarray) -> np.ndarray:
    """Elementwise: is the positive finite float32 ``s`` a power of two (subnormals included)?"""
    bits = np.ascontiguousarray(s, np.float32).view(np.uint32)
    exp, mant = bits & np.uint32(0x7F800000), bits & np.uint32(0x007FFFFF)
    normal = (exp != 0) & (mant == 0)
    # A subnormal power of two has exactly one mantissa bit set.
    sub = (exp == 0) & (mant != 0) & ((mant & (mant - np.uint32(1))) == 0)
    return normal | sub


def grid_shape(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    """(ceil(rows / block rows), ceil(cols / block cols))."""
    return (-(-shape[0] // block[0]), -(-shape[1] // block[1]))


def _axis_block(n: int, g: int) -> int | None:
    """The power of two b with ceil(n / b) == g (the smallest when g == 1), or None."""
    if n == 0:
        return 1 if g == 0 else None
    if g <= 0 or g > n:
        return None
    # ceil(n / b) == g  <=>  n / g <= b < n / (g - 1): the smallest power of two >= n / g.
    b = 1 << max(math.ceil(n / g) - 1, 0).bit_length()
    return b if -(-n // b) == g else None


def infer_block(shape: tuple[int, int], grid: tuple[int, ...]) -> tuple[int, int] | None:
    """The power-of-two block (rows, cols) whose grid over ``shape`` is ``grid``, or None."""
    if len(grid) != 2:
        return None
    br, bc = _axis_block(shape[0], grid[0]), _axis_block(shape[1], grid[1])
    return None if br is None or bc is None else (br, bc)


@dataclass(frozen=True)
class QuantConfig:
    """What config.json says about the quantized tensors (defaults: DeepSeek-V3's)."""

    scale_fmt: str = "float32"  # "float32" or "ue8m0" (power-of-two scales)
    block: tuple[int, int] = (BLOCK, BLOCK)
    expert_dtype: str | None = None  # DeepSeek-V4's top-level "expert_dtype" ("fp4")
    from_config: bool = False
    block_from_config: bool = False  # config.json gave weight_block_size


def read_quant_config(cfg: dict | None, where: str) -> QuantConfig:
    """Parse config.json's ``quantization_config`` and ``expert_dtype``; ValueError, one line.

    ``scale_fmt`` absent or null means float32 scales, ``"ue8m0"`` power-of-two
    ones; any other value, or a ``weight_block_size`` that is not two positive
    integers, is refused.
    """
    if cfg is None:
        return QuantConfig()
    text = cfg.get("text_config")
    if text is not None and not isinstance(text, dict):
        raise ValueError(f"{where}: text_config is not a JSON object")
    q = cfg.get("quantization_config")
    key = "quantization_config"
    if q is None and text is not None:
        # DeepSeek-V4.1: the text model's settings, quantization included, in text_config.
        q, key = text.get("quantization_config"), "text_config.quantization_config"
    if q is None:
        q = {}
    if not isinstance(q, dict):
        raise ValueError(f"{where}: {key} is not a JSON object")
    fmt = q.get("scale_fmt")
    if fmt is None:
        fmt = "float32"
    if fmt not in SCALE_FMTS:
        raise ValueError(
            f"{where}: {key}.scale_fmt is {fmt!r}; known: 'ue8m0' (power-of-two "
            "scales) or none (float32 scales)"
        )
    block = q.get("weight_block_size", [BLOCK, BLOCK])
    ok = (
        isinstance(block, list)
        and len(block) == 2
        and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    )
    if not ok:
        raise ValueError(
            f"{where}: {key}.weight_block_size is {block!r}; expected two "
            "positive integers such as [128, 128]"
        )
    expert = cfg.get("expert_dtype", q.get("expert_dtype"))
    if expert is None and text is not None:
        expert = text.get("expert_dtype")
    if expert is not None and not isinstance(expert, str):
        raise ValueError(f"{where}: expert_dtype is {expert!r}; expected a string such as 'fp4'")
    return QuantConfig(fmt, (block[0], block[1]), expert, True, "weight_block_size" in q)


def scale_values(scale: np.ndarray) -> np.ndarray:
    """A scale tensor as float32 (exact for F32 / BF16 / F16 and for E8M0, 0xFF -> NaN)."""
    return np.asarray(scale).astype(np.float32)


def check_scale_values(
    scale_name: str, scale: np.ndarray, scale_fmt: str, float_dtypes: tuple[np.dtype, ...]
) -> None:
    """Refuse (ValueError, one line) a scale tensor a dequantization cannot trust.

    Accepted dtypes: ``float_dtypes`` (F32 / BF16 / F16) or E8M0.  An E8M0
    byte 0xFF is NaN; a float scale must be finite and > 0 (a zero scale
    zeroes its block, a negative one flips its signs) and, under
    ``scale_fmt="ue8m0"``, a power of two.
    """
    if scale.dtype == E8M0:
        bad = int((np.asarray(scale).view(np.uint8) == E8M0_NAN).sum())
        if bad:
            raise ValueError(
                f"NaN scale: {scale_name!r} (F8_E8M0) holds {bad} byte(s) 0xFF, E8M0's NaN; "
                "the checkpoint is corrupt"
            )
        return
    if scale.dtype not in float_dtypes:
        raise ValueError(
            f"scale tensor {scale_name!r} has dtype {scale.dtype}; expected float32 (also "
            "bfloat16 / float16) or float8_e8m0fnu (F8_E8M0)"
        )
    s = scale_values(scale)
    bad = int((~np.isfinite(s)).sum())
    if bad:
        raise ValueError(f"non-finite scale: {scale_name!r} holds {bad} inf/NaN value(s)")
    bad = int((s <= 0).sum())
    if bad:
        raise ValueError(
            f"non-positive scale: {scale_name!r} holds {bad} value(s) <= 0 "
            f"(smallest {float(s.min()):g}); a scale must be > 0"
        )
    if scale_fmt == "ue8m0":
        off = ~is_pow2(s)
        n = int(off.sum())
        if n:
            raise ValueError(
                f"scale {scale_name!r} holds {n} value(s) that are not powers of two (such as "
                f"{float(s[off].flat[0]):.9g}) although config.json says scale_fmt 'ue8m0': a "
                "UE8M0 reader keeps only their exponents; pass --scale-fmt float32 to "
                "dequantize them as the float32 values they are"
            )
