"""GEMM weights quantized once per optimizer step, their codes shared by every microbatch.

A step of M microbatches runs the model M times on the same parameters.  A
GEMM weight whose recipe quantizes it online in 128x128 blocks (current
scaling, :func:`fp8jax.parallel.fsdp.is_block_fp8`) gets the same codes and
scales every time, so the step (``make_train_step``'s ``weights_once``, on
by default) quantizes it once, before the microbatch loop
(:func:`quantize_weights`), and every microbatch's model holds the
:class:`~fp8jax.QTensor` in its GEMM's layout ((K, N) for a Dense kernel,
(E, K, N) for routed experts) in the weight's place (:func:`with_codes`),
as after an FP8 FSDP gather: the GEMM takes the codes as they are and
serves Dgrad with the same blocks (a block's scale serves W and W^T alike).

Numerics: the codes are those the GEMM would make itself
(``schemes.quantize`` over the same blocks), so products, loss and
gradients are bit for bit those of quantizing in every microbatch.  The
gradient goes straight through to the master weight: the GEMM gives a
quantized weight the gradient of the values it represents
(:func:`fp8jax.operands.value_cotangent`), which is what the weight gets
when the GEMM quantizes it, and this module hands it on reshaped to the
weight's shape and dtype.

The weight itself travels with its codes (``QTensor.source``): what must
see its values (the GEMM's ``w`` telemetry, a SwiGLU's gate/up alignment,
a weight rescaled by smooth SwiGLU or a Dense ``kernel_scale``) reads them
through :func:`fp8jax.operands.source_values`, so every metric is that of
quantizing in every microbatch too.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from fp8jax import schemes
from fp8jax.parallel.fsdp import KernelLayout, is_block_fp8, param_keys
from fp8jax.quant import QTensor


def quantize_weights(
    params: Any, layouts: dict[tuple[str, ...], KernelLayout]
) -> dict[tuple[str, ...], QTensor]:
    """``{path: QTensor}`` of every weight in ``layouts`` whose spec quantizes it in FP8 blocks.

    ``params``: the model's parameter tree; ``layouts``:
    :func:`fp8jax.parallel.fsdp.kernel_layouts` of the model.  Each weight is
    quantized in its GEMM's layout (``KernelLayout.gemm_shape``), blocks over
    its last two axes, as the GEMM quantizes it.  Weights that ``layouts``
    does not name, or whose spec is not block FP8 with current scaling
    (delayed scaling needs the values for its amax history), are left out.
    """
    out = {}
    for path, w in jax.tree_util.tree_leaves_with_path(params):
        keys = param_keys(path)
        layout = layouts.get(keys)
        if layout is None or not is_block_fp8(layout.spec):
            continue
        w_kn = w.reshape(layout.gemm_shape(tuple(w.shape)))
        q = schemes.quantize(w_kn, layout.spec, w_kn.ndim - 1)
        # The weight itself rides along for what must see its values.
        out[keys] = dataclasses.replace(q, source=w_kn)
    return out


def with_codes(params: Any, codes: dict[tuple[str, ...], QTensor]) -> Any:
    """``params`` with each weight named in ``codes`` replaced by its QTensor, differentiably:
    the gradient of the values a QTensor represents goes to its weight."""
    if not codes:
        return params

    def one(path, w):
        q = codes.get(param_keys(path))
        return w if q is None else _as_codes(w, q)

    return jax.tree_util.tree_map_with_path(one, params)


@jax.custom_vjp
def _as_codes(w: jax.Array, q: QTensor) -> QTensor:
    """``q`` (the codes of ``w``), with ``w``'s gradient that of the values ``q`` represents."""
    return q


def _as_codes_fwd(w, q):
    # An empty array carries the weight's shape and dtype to the backward pass.
    return q, (jnp.zeros((0, *w.shape), w.dtype), q)


def _as_codes_bwd(res, ct):
    empty, q = res
    # ct.data: the gradient of the values (operands.value_cotangent), in the
    # GEMM's layout; the codes and scales themselves get none (they were
    # computed outside the differentiated step).
    g = ct.data.reshape(empty.shape[1:]).astype(empty.dtype)
    return g, jax.tree.map(jnp.zeros_like, q)


_as_codes.defvjp(_as_codes_fwd, _as_codes_bwd)
