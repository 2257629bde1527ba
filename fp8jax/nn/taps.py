"""Trace-time hooks on the model's GEMM calls, so studies see them without patching modules.

The layers that own a GEMM (:class:`fp8jax.nn.Dense` and the routed experts of
:mod:`fp8jax.models.moe`) call it through :func:`gemm`.  Outside
:func:`tapping` that is the call itself; inside, each open hook receives the
call first and returns its result, so it can look at the operands, wrap the
output (e.g. to see its gradient) or both.  Nothing is reassigned at run time
and a hook only reaches computations traced inside its block.

A hook is ``hook(kind, call, x, w, dims_or_groups, **kwargs)`` with ``kind``
"dense" (``dims_or_groups`` = dot_general dimension numbers) or "expert"
(``dims_or_groups`` = rows per expert); it must return ``call(x, w,
dims_or_groups, **kwargs)``'s value (y, stats), possibly with y wrapped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

__all__ = ["gemm", "tapping"]

Hook = Callable[..., Any]

# Trace-time only: hooks opened by `tapping`, outermost first.
_HOOKS: list[Hook] = []


@contextmanager
def tapping(hook: Hook) -> Iterator[None]:
    """Hand every layer GEMM traced inside the block to ``hook`` (module docstring)."""
    _HOOKS.append(hook)
    try:
        yield
    finally:
        _HOOKS.remove(hook)


def gemm(kind: str, fn: Callable[..., Any], x, w, dims_or_groups, **kwargs) -> Any:
    """``fn(x, w, dims_or_groups, **kwargs)``, through the open hooks (outermost sees it first)."""
    call = fn
    # The innermost hook wraps the GEMM itself; each outer one wraps the inner.
    for hook in reversed(_HOOKS):
        call = partial(hook, kind, call)
    return call(x, w, dims_or_groups, **kwargs)
