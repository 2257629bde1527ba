"""The operands of a model's GEMMs, captured from a forward and backward pass.

Synthetic inputs say what a recipe does to a distribution someone chose; the
tensors a trained model produces say what it does in training.  Inside
:func:`tap_gemms` every dense projection (``fp8jax.nn.Dense``) and every
grouped expert GEMM (``fp8jax.models.moe``) records, per call site, its Fprop
input ``x``, its weight ``w`` and the gradient ``dy`` arriving at its output
(the Dgrad input), all in float32 with the contraction axis last (``x``:
(tokens, K), ``w``: (K, N) or (experts, K, N), ``dy``: (tokens, N)).  Sites
are numbered in the order the model traces them: ``dense0``, ``dense1``, ...,
``expert0``, ...

:func:`trained_run_operands` restores the last checkpoint of a training run
(any ``experiments/train.py`` or comparison run directory) and captures one
batch of its held-out data.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from fp8jax.nn import taps
from fp8jax.quant import is_quantized
from fp8jax.schemes import dequantize

__all__ = ["GemmSite", "tap_gemms", "trained_run_operands"]


@dataclasses.dataclass
class GemmSite:
    """One GEMM call site's operands (module docstring); ``dy`` is None without a backward."""

    name: str
    scope: str  # "dense" or "expert"
    x: np.ndarray | None = None
    w: np.ndarray | None = None
    dy: np.ndarray | None = None
    group_sizes: np.ndarray | None = None  # experts only: rows of x per expert

    def expert(self, e: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """x, w, dy of expert ``e`` of a grouped site (its rows of the sorted tokens)."""
        if self.group_sizes is None:
            raise ValueError(f"{self.name} is a dense site; it has no experts")
        start = int(np.sum(self.group_sizes[:e]))
        rows = slice(start, start + int(self.group_sizes[e]))
        return self.x[rows], self.w[e], None if self.dy is None else self.dy[rows]

    def busiest_expert(self) -> int:
        """The expert that received the most tokens."""
        return int(np.argmax(self.group_sizes))

    def operands(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """x, w, dy of one dense GEMM: the site's own, or its busiest expert's."""
        if self.scope == "expert":
            return self.expert(self.busiest_expert())
        return self.x, self.w, self.dy


def _host(t, n: int) -> np.ndarray:
    # Captures are float32 whatever the compute dtype (bf16 values are exact in it).
    return np.asarray(t, np.float32).reshape(-1, n)


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def _tap_grad(y, record):
    return y


def _tap_grad_fwd(y, record):
    return y, None


def _tap_grad_bwd(record, _, g):
    # The cotangent of a GEMM output is that GEMM's Dgrad input dy.
    jax.debug.callback(record, g)
    return (g,)


_tap_grad.defvjp(_tap_grad_fwd, _tap_grad_bwd)


@contextlib.contextmanager
def tap_gemms() -> Iterator[dict[str, GemmSite]]:
    """Record the operands of every GEMM traced inside the block (module docstring).

    Yields the dict of sites, filled as the traced computations run.  Only
    computations traced inside the block are tapped (through the layers' GEMM
    hook, :mod:`fp8jax.nn.taps`): call a fresh (not yet compiled) function and
    block on its result.  A function compiled inside keeps its taps: each later
    call overwrites the sites with its operands.
    """
    sites: dict[str, GemmSite] = {}
    counts = {"dense": 0, "expert": 0}

    def setter(site: GemmSite, field: str, n: int):
        def record(t):
            setattr(site, field, _host(t, n))

        return record

    def hook(scope, call, x, w, dims_or_groups, **kwargs):
        site = GemmSite(f"{scope}{counts[scope]}", scope)
        counts[scope] += 1
        sites[site.name] = site
        xv = dequantize(x) if is_quantized(x) else x
        if scope == "expert":  # w: (experts, K, N); dims_or_groups: rows per expert
            k, n = w.shape[-2], w.shape[-1]
            jax.debug.callback(partial(_set_groups, site), dims_or_groups)
            jax.debug.callback(lambda t: setattr(site, "w", np.asarray(t, np.float32)), w)
        else:  # the kernel's leading axes are contracted with x's trailing ones
            nc = len(dims_or_groups[0][1])
            k, n = math.prod(w.shape[:nc]), math.prod(w.shape[nc:])
            jax.debug.callback(setter(site, "w", n), w)
        jax.debug.callback(setter(site, "x", k), xv)
        out = call(x, w, dims_or_groups, **kwargs)
        tapped = _tap_grad(out[0], setter(site, "dy", n))
        return (tapped, *out[1:])

    with taps.tapping(hook):
        yield sites


def _set_groups(site: GemmSite, g) -> None:
    site.group_sizes = np.asarray(g, np.int64)


def trained_run_operands(
    run_dir: str | Path, batch_size: int = 8, seed: int = 0
) -> tuple[dict[str, GemmSite], ml_collections.ConfigDict]:
    """GEMM operands of a trained run on ``batch_size`` held-out sequences.

    Restores the run's last checkpoint with its own ``config.json``, takes
    ``batch_size`` windows of the validation stream (chosen by ``seed``) and
    runs the loss and its gradient under :func:`tap_gemms`.  Returns the sites
    and the run's config.
    """
    from flax import nnx

    from fp8jax.models import loss_fn
    from fp8jax.train.restore import load_run

    run, state, _ = load_run(run_dir)
    cfg = run.config
    model = nnx.merge(run.graphdef, state.params, state.fp8, state.bias, state.rest)
    val = np.asarray(run.corpus.val)
    n = run.seq_len
    starts = np.random.default_rng(seed).integers(0, len(val) - n, batch_size)
    tokens = jnp.asarray(np.stack([val[s : s + n] for s in starts]), jnp.int32)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params, tokens):
        return loss_fn(nnx.merge(graphdef, params, rest), tokens)[0]

    with tap_gemms() as sites:
        jax.block_until_ready(jax.jit(jax.grad(loss))(params, tokens))
        jax.effects_barrier()
    return sites, cfg
