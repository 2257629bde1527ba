"""TPU programs compiled on a CPU machine, through libtpu's topology descriptions.

``jax.experimental.topologies.get_topology_desc`` describes a TPU slice
without one; a program traced here and lowered for "tpu" compiles for it.
Every preset x impl that "auto" allows on TPU, forward and backward, for
v5e, v6e and Ironwood (tpu7x); the named "fp8" impl too, whose FP8 dots
reach Ironwood's FP8 matrix units.  "auto" takes the Mosaic TPU kernel
(``fp8jax.kernels.tpu_block_gemm``) where the operands have its layouts.  Needs ``libtpu`` (``pip install
"jax[tpu]"``); where it is installed these tests fail rather than skip.
One small case is in the default suite, the rest behind ``-m slow``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import fp8jax
from fp8jax import path_record, recipes, registry, scaling
from fp8jax.kernels import tpu_block_gemm

pytest.importorskip("libtpu")
from jax.experimental import topologies  # noqa: E402

DIMS = (((1,), (0,)), ((), ()))
TOPOLOGIES = {"v5e": "v5e:2x2", "v6e": "v6e:2x2", "tpu7x": "tpu7x:2x2x1"}
PRESETS = [
    "bf16",
    "deepseek_v3",
    "deepseek_v3_pow2x",
    "hybrid_delayed",
    "current_tensor",
    "rowwise",
    "mxfp8",
    "nvfp4",
]


@functools.cache
def _device(chip: str):
    return topologies.get_topology_desc(TOPOLOGIES[chip], "tpu").devices[0]


def _compile(recipe, chip: str, m=256, k=384, n=256, dtype=jnp.float32):
    """Compiled fwd+bwd of one dot_general for ``chip``; its HLO text and resolved paths."""
    sharding = NamedSharding(jax.sharding.Mesh(np.array([_device(chip)]), ("x",)), PartitionSpec())
    x = jax.ShapeDtypeStruct((m, k), dtype, sharding=sharding)
    w = jax.ShapeDtypeStruct((k, n), dtype, sharding=sharding)
    state = scaling.init_delayed_gemm_state(recipe) if fp8jax.needs_state(recipe) else None

    def loss(x, w):
        y = fp8jax.dot_general(x, w, DIMS, recipe=recipe, state=state)
        y = y[0] if isinstance(y, tuple) else y
        return jnp.sum(y.astype(jnp.float32) ** 2)

    with path_record.recording("tpu") as paths:
        traced = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).trace(x, w)
    compiled = traced.lower(lowering_platforms=("tpu",)).compile()
    return compiled.as_text(), path_record.as_table(paths)


def test_deepseek_v3_compiles_for_v6e():
    # The Mosaic kernel, one per GEMM (v6e widens the FP8 codes to bfloat16
    # in its matrix unit): Fprop quantizing x's 1x128 tiles itself, Wgrad
    # requantizing x's FP8 cache into 128-token tiles itself.  Around them
    # the quantizer's Mosaic kernels: W's blocks, and dy's two layouts from
    # one read of dy.
    text, paths = _compile(recipes.deepseek_v3(), "v6e", 128, 256, 128)
    assert set(paths.values()) == {"pallas tpu"}
    assert len(paths) == 3
    calls = [line for line in text.splitlines() if 'custom_call_target="tpu_custom_call"' in line]
    assert sum("fp8_block_scaled_matmul" in line for line in calls) == 3
    assert sum("fp8_block_scaled_matmul_nn_quantizing" in line for line in calls) == 1
    assert sum("fp8_block_scaled_matmul_tn_requant" in line for line in calls) == 1
    assert sum("fp8_quantize_" in line for line in calls) == 2
    assert sum("fp8_quantize_rows_cols" in line for line in calls) == 1
    assert len(calls) == 5


def test_deepseek_v3_dgrad_quantizes_bfloat16_dy_itself():
    # bfloat16 operands, dx one column block: the Dgrad kernel quantizes dy's
    # 1x128 tiles itself and writes its 128-token tiles (the Wgrad's) from the
    # same read: no quantizer kernel on dy at all.  W's blocks are the one
    # quantizer left.
    text, paths = _compile(recipes.deepseek_v3(), "tpu7x", 128, 256, 128, jnp.bfloat16)
    assert set(paths.values()) == {"pallas tpu"}
    calls = [line for line in text.splitlines() if 'custom_call_target="tpu_custom_call"' in line]
    assert sum("fp8_block_scaled_matmul_nt_quantizing" in line for line in calls) == 1
    assert sum("fp8_block_scaled_matmul_nn_quantizing" in line for line in calls) == 1
    assert sum("fp8_block_scaled_matmul_tn_requant" in line for line in calls) == 1
    assert sum("fp8_quantize_block" in line for line in calls) == 1
    assert len(calls) == 4


@pytest.mark.slow
@pytest.mark.parametrize("chip", list(TOPOLOGIES))
@pytest.mark.parametrize("name", PRESETS)
def test_presets_compile_on_auto(chip, name):
    _, paths = _compile(registry.get(name), chip)
    if name == "bf16":
        assert all(v.startswith("lax.dot_general") for v in paths.values())
    elif name in ("mxfp8", "nvfp4"):
        assert all("xla dequant float32" in v for v in paths.values())
    elif name.startswith("deepseek_v3"):
        # 1x128 tiles and 128x128 blocks: the Mosaic kernel.
        assert set(paths.values()) == {"pallas tpu"}
    else:
        assert set(paths.values()) <= {"chunked", "pallas tpu"}


@pytest.mark.slow
@pytest.mark.parametrize("chip", list(TOPOLOGIES))
@pytest.mark.parametrize("impl", ["xla", "chunked", "fp8", "fp8_fast", "pallas"])
def test_named_impls_compile(chip, impl):
    recipe = dataclasses.replace(recipes.deepseek_v3(), impl=impl)
    text, paths = _compile(recipe, chip)
    assert len(paths) == 3
    if impl in ("fp8", "fp8_fast") and chip == "tpu7x":
        # Ironwood multiplies the FP8 operands themselves.
        assert "f8e4m3fn" in text.lower()


@pytest.mark.parametrize(
    "kernel, name",
    [
        (tpu_block_gemm.block_scaled_matmul_quantizing, "nn_quantizing"),
        (
            functools.partial(tpu_block_gemm.block_scaled_matmul_nt_quantizing, col_codes=True),
            "nt_quantizing",
        ),
    ],
)
def test_quantizing_kernels_of_one_k_step_fit_tpu7x_vmem(kernel, name):
    # K in one step of the kernel (1024) with a 2048 x 1024 output block: the
    # quantizer's squares unrolled over the whole block overflowed tpu7x's VMEM
    # with spilled registers; a loop over the rows of squares compiles.  The
    # Dgrad also writes the block's 128-token tiles: 16 rows of their scales
    # gathered in the loop and stored 8 at a time.
    sharding = NamedSharding(
        jax.sharding.Mesh(np.array([_device("tpu7x")]), ("x",)), PartitionSpec()
    )
    args = [
        jax.ShapeDtypeStruct((2048, 1024), jnp.bfloat16, sharding=sharding),
        jax.ShapeDtypeStruct((1024, 1024), jnp.float8_e4m3fn, sharding=sharding),
        jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=sharding),
    ]

    def gemm(a, b, sb):
        return kernel(a, b, sb, fmt=jnp.float8_e4m3fn, pow2=True, interpret=False)

    lowered = jax.jit(gemm).trace(*args).lower(lowering_platforms=("tpu",))
    text = lowered.compile().as_text()
    assert f"fp8_block_scaled_matmul_{name}" in text
