"""GPU programs checked on a CPU machine: every preset x impl lowered for CUDA.

One traced ``fp8jax.dot_general`` (forward and both gradients) is lowered with
``lowering_platforms=("cuda",)`` and the StableHLO that XLA would receive is
read: FP8 operands and the named FP8 dot algorithm in runs of 128 for "fp8",
one Mosaic GPU kernel call per GEMM for "pallas" (no interpreter), cuDNN's
block GEMM for MXFP8 / NVFP4 on a Blackwell target.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import fp8jax
from fp8jax import path_record, platforms, recipes, registry, scaling
from fp8jax.kernels import gpu_quantize

DIMS = (((1,), (0,)), ((), ()))
M, K, N = 256, 384, 256
FP8_PRESETS = ["deepseek_v3", "deepseek_v3_pow2x", "hybrid_delayed", "current_tensor", "rowwise"]


def _args():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(M, K)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(K, N)), jnp.float32)
    return x, w


def _fwd_bwd(recipe):
    state = scaling.init_delayed_gemm_state(recipe) if fp8jax.needs_state(recipe) else None

    def loss(x, w):
        y = fp8jax.dot_general(x, w, DIMS, recipe=recipe, state=state)
        y = y[0] if isinstance(y, tuple) else y
        return jnp.sum(y.astype(jnp.float32) ** 2)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def _lower(recipe, platform="cuda", capability="9.0"):
    with platforms.lowering_for_cuda(capability), path_record.recording(platform) as paths:
        text = _fwd_bwd(recipe).trace(*_args()).lower(lowering_platforms=(platform,)).as_text()
    return text, path_record.as_table(paths)


def _fp8_dots(text):
    return [
        ln for ln in text.splitlines() if "dot_general" in ln and "lhs_precision_type = f8" in ln
    ]


@pytest.mark.parametrize("name", FP8_PRESETS)
@pytest.mark.parametrize("impl", ["fp8", "fp8_fast"])
def test_hardware_fp8_dots(name, impl):
    recipe = dataclasses.replace(registry.get(name), impl=impl)
    text, paths = _lower(recipe)
    dots = _fp8_dots(text)
    # Fprop, Dgrad, Wgrad: one FP8 x FP8 -> f32 dot each (per run, in a loop).
    assert len(dots) == 3, dots
    fast = "true" if impl == "fp8_fast" else "false"
    for ln in dots:
        assert f"allow_imprecise_accumulation = {fast}" in ln
        assert "accumulation_type = f32" in ln and "-> tensor<" in ln and "xf32>" in ln
    assert set(paths.values()) == {impl}
    types = " ".join(dots)
    if name == "hybrid_delayed":
        # E5M2 gradients meet E4M3 activations and weights in Dgrad and Wgrad.
        assert "f8E5M2" in types and "f8E4M3FN" in types
    else:
        assert "f8E5M2" not in types
    if name.startswith("deepseek_v3"):
        # 1x128 tiles / 128x128 blocks: every dot contracts one run of 128.
        for ln in dots:
            lhs = re.search(r"\(tensor<([0-9x]+)xf8", ln).group(1).split("x")
            assert "128" in lhs, ln
        assert "stablehlo.while" in text


@pytest.fixture
def quantizer(monkeypatch):
    """A quantizer asked for by FP8JAX_GPU_QUANTIZER (read at trace time: no trace
    kept across)."""

    def ask(kind):
        monkeypatch.setenv(gpu_quantize.OPT_IN, kind)
        jax.clear_caches()

    yield ask
    monkeypatch.delenv(gpu_quantize.OPT_IN, raising=False)
    jax.clear_caches()


@pytest.fixture
def triton_quantizers(quantizer):
    quantizer("triton")


#: The quantizer kernels of deepseek_v3's fwd+bwd: x's 1x128 tiles, W's 128x128
#: blocks in both layouts (the Fprop's K-major, the Dgrad's as stored), dy's two
#: tile layouts from one read, and Wgrad's 128x1 tiles of the cached x
#: (requantized from its FP8 codes).
QUANTIZERS = {"fp8_quantize_row", "fp8_quantize_block_both", "fp8_quantize_rows_cols"} | {
    "fp8_requantize_col_t"
}
#: The Triton quantizers write W's blocks in one layout (the GEMM transposes them).
TRITON_QUANTIZERS = QUANTIZERS - {"fp8_quantize_block_both"} | {"fp8_quantize_block"}


def _lower_with_names(recipe):
    """(StableHLO text with its locations, the GEMMs' paths): kernel names live in
    the locations (a kernel batched by vmap is renamed)."""
    with platforms.lowering_for_cuda("9.0"), path_record.recording("cuda") as paths:
        lowered = _fwd_bwd(recipe).trace(*_args()).lower(lowering_platforms=("cuda",))
    return lowered.as_text(debug_info=True), path_record.as_table(paths)


@pytest.mark.parametrize("impl", ["auto", "pallas"])
def test_pallas_kernels_and_quantizers_are_mosaic_gpu_calls(impl):
    recipe = dataclasses.replace(recipes.deepseek_v3(), impl=impl)
    text, paths = _lower_with_names(recipe)
    calls = [ln for ln in text.splitlines() if "stablehlo.custom_call @mosaic_gpu" in ln]
    # Fprop, Dgrad, Wgrad (tensor-core kernels) and the four quantizers.
    assert sum("wgmma" in ln for ln in calls) == 3
    assert len(calls) == 3 + len(QUANTIZERS)
    assert set(re.findall(r"fp8_(?:re)?quantize_[a-z_]*[a-z]", text)) >= QUANTIZERS
    assert "triton" not in text
    # No interpreter (its host callbacks), no per-run loop.
    assert "callback" not in text
    assert "stablehlo.while" not in text
    assert set(paths.values()) == {"pallas"}


def test_asked_for_xla_quantizes_with_fusions(quantizer):
    quantizer("xla")
    text, paths = _lower(recipes.deepseek_v3())
    calls = re.findall(r"stablehlo.custom_call @mosaic_gpu\w*", text)
    assert len(calls) == 3  # Fprop, Dgrad, Wgrad; XLA's fusions quantize
    assert "triton" not in text and "stablehlo.while" not in text
    assert set(paths.values()) == {"pallas"}


@pytest.mark.parametrize("impl", ["auto", "pallas"])
def test_asked_for_the_quantizers_are_triton_calls(impl, triton_quantizers):
    recipe = dataclasses.replace(recipes.deepseek_v3(), impl=impl)
    text, paths = _lower(recipe)
    calls = re.findall(r"stablehlo.custom_call @mosaic_gpu\w*", text)
    assert len(calls) == 3  # Fprop, Dgrad, Wgrad
    # The quantizers are Triton calls.
    triton = re.findall(r"stablehlo.custom_call @__gpu\$xla\.gpu\.triton", text)
    assert len(triton) == 4
    assert set(re.findall(r"fp8_(?:re)?quantize_\w+", text)) == TRITON_QUANTIZERS
    # No interpreter (its host callbacks), no per-run loop.
    assert "callback" not in text
    assert "stablehlo.while" not in text
    assert set(paths.values()) == {"pallas"}


@pytest.mark.parametrize("name", ["current_tensor", "rowwise", "hybrid_delayed", "bf16"])
def test_auto_elsewhere_is_what_the_docs_say(name):
    # Per-tensor / per-row layouts do not fit the kernel: "chunked" (the FP8
    # codes as bfloat16 with BF16_BF16_F32); bf16 is lax.dot_general.
    text, paths = _lower(registry.get(name))
    assert "triton" not in text and not _fp8_dots(text)
    if name == "bf16":
        assert all(v.startswith("lax.dot_general") for v in paths.values())
    else:
        assert set(paths.values()) == {"chunked"}
        assert "BF16_BF16_F32" in text or "lhs_precision_type = bf16" in text


@pytest.mark.parametrize(
    "name,data,scale", [("mxfp8", "f8E4M3FN", "f8E8M0FNU"), ("nvfp4", "f4E2M1FN", "f8E4M3FN")]
)
def test_block_formats_use_cudnn_on_blackwell(name, data, scale):
    text, paths = _lower(registry.get(name), capability="10.0")
    calls = [ln for ln in text.splitlines() if "custom_call @__op$block_scaled_dot" in ln]
    assert len(calls) == 3
    for ln in calls:
        operands = ln.split(":")[-1]
        assert f"x{data}>" in operands and f"x{scale}>" in operands
    scheme = "mx" if name == "mxfp8" else "nvfp4"
    assert set(paths.values()) == {f"{scheme}:scaled_matmul"}
    # On Hopper the same recipe dequantizes (no block-scaled tensor cores).
    text, paths = _lower(registry.get(name), capability="9.0")
    assert "block_scaled_dot" not in text
    assert set(paths.values()) == {f"{scheme}:xla dequant float32"}


@pytest.mark.parametrize("name", ["deepseek_v3", "hybrid_delayed", "current_tensor", "mxfp8"])
def test_presets_export_for_every_platform(name):
    x, w = _args()
    # The kernel is a Mosaic GPU custom call, which jax.export accepts only
    # when told that its compatibility is the exporter's business.
    # The same for the Triton call of dy's quantizer.
    kernels = ("mosaic_gpu", "mosaic_gpu_v2", "__gpu$xla.gpu.triton")
    unchecked = [export.DisabledSafetyCheck.custom_call(t) for t in kernels]
    with platforms.lowering_for_cuda("9.0"):
        exp = export.export(
            _fwd_bwd(registry.get(name)),
            platforms=["cpu", "cuda", "tpu"],
            disabled_checks=unchecked,
        )(x, w)
    assert exp.platforms == ("cpu", "cuda", "tpu")
    if name == "deepseek_v3":
        # The Mosaic GPU kernel in the CUDA branch, the Mosaic kernel in the TPU branch.
        assert "mosaic_gpu" in exp.mlir_module()
        assert "tpu_custom_call" in exp.mlir_module()


@pytest.mark.parametrize("name", ["bf16", "fp32"])
def test_baselines_name_each_platforms_algorithm(name):
    # lax.dot_general with the named algorithm of the platform lowered for:
    # TPUs reject F32_F32_F32 (HIGHEST there); XLA CPU's small dots reject
    # BF16_BF16_F32 (HIGHEST there).
    recipe = registry.get(name)
    text = {p: _lower(recipe, platform=p)[0] for p in ("cpu", "cuda", "tpu")}
    if name == "bf16":
        assert "BF16_BF16_F32" in text["cuda"] or "lhs_precision_type = bf16" in text["cuda"]
        assert "lhs_precision_type = bf16" in text["tpu"]
        assert "lhs_precision_type" not in text["cpu"] and "HIGHEST" in text["cpu"]
    else:
        assert "lhs_precision_type = f32" in text["cuda"]
        assert "lhs_precision_type" not in text["tpu"] and "HIGHEST" in text["tpu"]
