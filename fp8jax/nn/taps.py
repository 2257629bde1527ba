"""Trace-time hooks on the model's GEMM calls and activation sites, so studies reach them without patching modules.

The layers that own a GEMM (:class:`fp8jax.nn.Dense`, :class:`fp8jax.nn.Einsum`
and the routed experts of :mod:`fp8jax.models.moe`, on one device and under
expert parallelism) call it through :func:`gemm`, by way of
:func:`fp8jax.nn.observed.run_gemm`.  Outside
:func:`tapping` that is the call itself; inside, each open hook receives the
call first and returns its result, so it can look at the operands, wrap the
output (e.g. to see its gradient) or both.  Nothing is reassigned at run time
and a hook only reaches computations traced inside its block.  Under expert
parallelism the expert GEMMs are traced once inside a ``shard_map`` body: the
hook sees each once, with one shard's operands.

A hook is ``hook(scope, call, x, w, dims_or_groups, **kwargs)`` with ``scope``
"dense" (``dims_or_groups`` = dot_general dimension numbers) or "expert"
(``dims_or_groups`` = rows per expert), the scopes of :mod:`fp8jax.path_record`; it
must return ``call(x, w, dims_or_groups, **kwargs)``'s value (y, stats),
possibly with y wrapped.

Activation sites are the places an experiment may change an activation (the
outlier-injection experiments add massive activations there): the model
passes each through :func:`site`, which is the identity unless a hook for
that site is open (:func:`injecting`).  :data:`ACTIVATION_SITES` names them
(the GEMM sites a recipe treats apart are :data:`fp8jax.recipes.GEMM_SITES`):

* ``"residual"``: the residual stream after the embedding, (B*T, D);
* ``"ffn_hidden"``: the input of every FFN down projection (dense, shared
  and routed experts), (rows, F).

A site hook is ``hook(x, first)`` -> x of the same shape and dtype, where
``first`` (bool, one per row) marks the rows of each sequence's first token.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

__all__ = ["ACTIVATION_SITES", "gemm", "injecting", "site", "site_open", "tapping"]

Hook = Callable[..., Any]

ACTIVATION_SITES = ("residual", "ffn_hidden")

# Trace-time only: hooks opened by `tapping`, outermost first.
_HOOKS: list[Hook] = []
# Trace-time only: (site, hook) pairs opened by `injecting`, outermost first.
_SITE_HOOKS: list[tuple[str, Hook]] = []


@contextmanager
def tapping(hook: Hook) -> Iterator[None]:
    """Hand every layer GEMM traced inside the block to ``hook`` (module docstring)."""
    _HOOKS.append(hook)
    try:
        yield
    finally:
        _HOOKS.remove(hook)


def gemm(scope: str, fn: Callable[..., Any], x, w, dims_or_groups, **kwargs) -> Any:
    """``fn(x, w, dims_or_groups, **kwargs)``, through the open hooks (outermost sees it first)."""
    call = fn
    # The innermost hook wraps the GEMM itself; each outer one wraps the inner.
    for hook in reversed(_HOOKS):
        call = partial(hook, scope, call)
    return call(x, w, dims_or_groups, **kwargs)


@contextmanager
def injecting(name: str, hook: Hook) -> Iterator[None]:
    """Pass activation site ``name`` through ``hook`` in every model traced inside the block."""
    if name not in ACTIVATION_SITES:
        raise ValueError(f"unknown activation site {name!r}; known: {', '.join(ACTIVATION_SITES)}")
    entry = (name, hook)
    _SITE_HOOKS.append(entry)
    try:
        yield
    finally:
        _SITE_HOOKS.remove(entry)


def site_open(name: str) -> bool:
    """Whether a hook is open for activation site ``name`` (layers pick a local path then)."""
    return any(n == name for n, _ in _SITE_HOOKS)


def site(name: str, x, first) -> Any:
    """``x`` through the hooks open for activation site ``name`` (outermost first); x if none."""
    for n, hook in _SITE_HOOKS:
        if n == name:
            x = hook(x, first)
    return x
