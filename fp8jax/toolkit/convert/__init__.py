"""Checkpoint conversion between FP8 (DeepSeek-V3 block-scaled layout) and BF16.

* :mod:`~fp8jax.toolkit.convert.safetensors_io`: safetensors reader (memory-mapped)
  and streaming writer, float8 dtypes via ml_dtypes;
* :mod:`~fp8jax.toolkit.convert.blockwise`: correctly rounded 128x128 block
  (de)quantization;
* :mod:`~fp8jax.toolkit.convert.checkpoint`: whole-directory conversion with
  verification and an all-or-nothing output.
"""

from fp8jax.toolkit.convert.blockwise import dequant_rows, quant_rows, round_to, scale_shape
from fp8jax.toolkit.convert.checkpoint import (
    ConversionError,
    Report,
    bf16_to_fp8,
    convert_checkpoint,
    fp8_to_bf16,
    open_source,
)
from fp8jax.toolkit.convert.safetensors_io import (
    DTYPES,
    SafetensorsError,
    SafetensorsFile,
    SafetensorsWriter,
    load_file,
    save_file,
)

__all__ = [
    "DTYPES",
    "ConversionError",
    "Report",
    "SafetensorsError",
    "SafetensorsFile",
    "SafetensorsWriter",
    "bf16_to_fp8",
    "convert_checkpoint",
    "dequant_rows",
    "fp8_to_bf16",
    "load_file",
    "open_source",
    "quant_rows",
    "round_to",
    "save_file",
    "scale_shape",
]
