"""Mosaic GPU's ptxas version question, asked once: a stand-in extension counts the questions."""

from __future__ import annotations

import types

import pytest

from fp8jax.kernels import mgpu_ptxas


def _extension(answers):
    asked = []

    def question():
        asked.append(1)
        answer = answers[min(len(asked), len(answers)) - 1]
        if isinstance(answer, Exception):
            raise answer
        return answer

    return types.SimpleNamespace(_get_ptxas_isa_version=question), asked


def test_the_question_is_asked_once_and_its_answer_kept():
    ext, asked = _extension([90, 85])
    assert mgpu_ptxas.ask_ptxas_once(ext)
    assert [ext._get_ptxas_isa_version() for _ in range(3)] == [90, 90, 90]
    assert len(asked) == 1
    # Installing again keeps the one remembered answer.
    assert mgpu_ptxas.ask_ptxas_once(ext)
    assert ext._get_ptxas_isa_version() == 90 and len(asked) == 1


def test_a_failed_question_is_asked_again():
    ext, asked = _extension([RuntimeError("no ptxas"), 88])
    mgpu_ptxas.ask_ptxas_once(ext)
    with pytest.raises(RuntimeError, match="no ptxas"):
        ext._get_ptxas_isa_version()
    assert ext._get_ptxas_isa_version() == 88
    assert ext._get_ptxas_isa_version() == 88 and len(asked) == 2


def test_no_extension_is_nothing_to_ask():
    assert not mgpu_ptxas.ask_ptxas_once(types.SimpleNamespace())


def test_lowering_a_kernel_for_cuda_asks_the_plugin_once():
    ext = mgpu_ptxas._plugin_extension()
    if ext is None:
        pytest.skip("no CUDA plugin's Mosaic GPU extension here")
    import jax
    import jax.numpy as jnp

    from fp8jax import platforms
    from fp8jax.kernels import mgpu_quantize

    x = jax.ShapeDtypeStruct((128, 256), jnp.bfloat16)
    fn = lambda x: mgpu_quantize.quantize_2d(x, fmt=jnp.float8_e4m3fn, orient="row")
    with platforms.lowering_for_cuda("9.0"):
        jax.jit(fn).trace(x).lower(lowering_platforms=("cuda",))
    assert getattr(ext._get_ptxas_isa_version, mgpu_ptxas._REMEMBERED, False)
