"""Checkpoint conversion between FP8 / FP4 (DeepSeek-V3, V3.1 / V3.2, V4 layouts) and BF16.

* :mod:`~fp8jax.toolkit.convert.layouts`: which layout a checkpoint is (from
  its files), E2M1 / E8M0 decoding, scale checks, block sizes from scale grids;

* :mod:`~fp8jax.toolkit.convert.safetensors_io`: a strict safetensors reader
  (plain reads of regular files; accepts what the reference library accepts) and a streaming
  writer, float8 dtypes via ml_dtypes;
* :mod:`~fp8jax.toolkit.convert.blockwise`: 128x128 block (de)quantization:
  DeepSeek's FP8 -> BF16 arithmetic bit for bit (or the correctly rounded
  one), BF16 -> FP8 through ``fp8jax.quantize``;
* :mod:`~fp8jax.toolkit.convert.fp8_bf16`: whole-directory conversion with
  verification and an all-or-nothing output, and a small example checkpoint.
"""

from fp8jax.toolkit.convert.blockwise import (
    ROUNDINGS,
    check_scale,
    dequant_rows,
    quant_rows,
    round_to,
    scale_shape,
)
from fp8jax.toolkit.convert.fp8_bf16 import (
    ConversionError,
    ConversionTerminated,
    Report,
    bf16_to_fp8,
    compile_keep,
    convert_checkpoint,
    fp8_to_bf16,
    make_example_checkpoint,
    open_source,
)
from fp8jax.toolkit.convert.safetensors_io import (
    DTYPES,
    SafetensorsError,
    SafetensorsFile,
    SafetensorsWriter,
    load_file,
    loads_json,
    save_file,
)

__all__ = [
    "DTYPES",
    "ROUNDINGS",
    "ConversionError",
    "ConversionTerminated",
    "Report",
    "SafetensorsError",
    "SafetensorsFile",
    "SafetensorsWriter",
    "bf16_to_fp8",
    "check_scale",
    "compile_keep",
    "convert_checkpoint",
    "dequant_rows",
    "fp8_to_bf16",
    "load_file",
    "loads_json",
    "make_example_checkpoint",
    "open_source",
    "quant_rows",
    "round_to",
    "save_file",
    "scale_shape",
]
