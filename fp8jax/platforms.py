"""Choices made per platform when a program is lowered, not on the machine that traces.

JAX traces a function once and may lower it for another platform than the
one it runs on (``jax.jit(f).trace(x).lower(lowering_platforms=("cuda",))``,
``jax.export(f, platforms=["cuda", "tpu", "cpu"])``).  So no GEMM may ask
``jax.default_backend()`` while tracing which implementation or dot algorithm
to use: :func:`choose` makes one branch per distinct decision and lets
``lax.platform_dependent`` keep, at lowering, the branch of the platform
being lowered for (every other branch is dropped before XLA sees it).
Given its operands, it traces only the branch of the platform traced for
(this machine's) and defers the others to a lowering for their platforms.

Two more pieces for what only one platform can lower:

* :func:`only_on` wraps a computation whose lowering exists on some
  platforms only (a compiled Mosaic GPU kernel, a dot with an FP8 algorithm
  preset, which JAX's CPU lowering refuses).  In a multi-platform export
  every branch of a ``platform_dependent`` is lowered for every exported
  platform; this wrapper lowers its computation only for its own platforms
  and emits zeros of the same shape for the others: dead code, since the
  enclosing :func:`choose` never takes that branch there.
* :func:`refuse` is a value whose lowering fails with a message: the branch
  of a platform that cannot run what a recipe asks for (hardware FP8 dots on
  a CPU) fails when, and only when, a program is lowered for that platform.

What a GPU branch targets: the compute capability of the local NVIDIA GPU
if there is one, else :data:`DEFAULT_CUDA_TARGET` (Hopper, the GPU people
train FP8 on), or what :func:`cuda_target` sets for a block of code (e.g.
"10.0" to lower the Blackwell paths from a CPU machine).  Whether a real
device passes a kernel's self-check is a run-time question, asked only where
such a device exists (``fp8jax.kernels.availability``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

#: The platforms every choice is made for (JAX's lowering platform names).
PLATFORMS: tuple[str, ...] = ("cpu", "cuda", "rocm", "tpu")

#: Compute capability a CUDA branch targets where no NVIDIA GPU is attached.
DEFAULT_CUDA_TARGET = "9.0"

_CUDA_TARGET: list[str] = []


def local_platform() -> str:
    """The lowering-platform name of the default device: "cpu", "cuda", "rocm" or "tpu"."""
    backend = jax.default_backend()
    if backend != "gpu":
        return backend
    dev = jax.devices()[0]
    version = str(getattr(dev.client, "platform_version", "")).lower()
    return "rocm" if ("rocm" in version or "hip" in version) else "cuda"


def local_cuda_capability() -> str | None:
    """Compute capability ("9.0") of the local NVIDIA GPU, or None where there is none."""
    try:
        if local_platform() != "cuda":
            return None
        return str(getattr(jax.devices()[0], "compute_capability", "")) or None
    except RuntimeError:
        return None


@contextlib.contextmanager
def cuda_target(capability: str) -> Iterator[None]:
    """CUDA branches traced inside the block target ``capability`` (e.g. "10.0")."""
    _major(capability)  # refuse a malformed value here, not at a distance
    _CUDA_TARGET.append(capability)
    try:
        yield
    finally:
        _CUDA_TARGET.pop()


#: A GPU of each compute capability, by the device kind JAX's Pallas GPU lowerings know.
CUDA_DEVICE_KINDS: dict[str, str] = {
    "8.9": "NVIDIA L4",
    "9.0": "NVIDIA H200",
    "10.0": "NVIDIA B200",
}


@contextlib.contextmanager
def lowering_for_cuda(capability: str = DEFAULT_CUDA_TARGET) -> Iterator[None]:
    """Trace and lower for a CUDA GPU of ``capability`` from any machine.

    Sets the CUDA target (:func:`cuda_target`) and, where JAX asks for one
    (Pallas' GPU lowerings on jax >= 0.11 with no GPU attached), an
    abstract device of that kind in an abstract mesh, so that
    ``jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))`` reaches
    GPU code on a CPU machine::

        with fp8jax.platforms.lowering_for_cuda("9.0"):
            text = jax.jit(f).trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    """
    try:
        kind = CUDA_DEVICE_KINDS[capability]
    except KeyError:
        raise ValueError(
            f"no known GPU of compute capability {capability!r}; known: {sorted(CUDA_DEVICE_KINDS)}"
        ) from None
    with contextlib.ExitStack() as stack:
        stack.enter_context(cuda_target(capability))
        device_cls = getattr(jax.sharding, "AbstractDevice", None)
        if device_cls is not None and local_cuda_capability() is None:
            device = device_cls(device_kind=kind, num_cores=None, platform="gpu")
            mesh = jax.sharding.AbstractMesh(
                (1,),
                ("_gpu",),
                axis_types=(jax.sharding.AxisType.Auto,),
                abstract_device=device,
            )
            stack.enter_context(jax.sharding.use_abstract_mesh(mesh))
        yield


def cuda_target_named() -> bool:
    """Whether CUDA branches are being traced inside :func:`cuda_target` (or
    :func:`lowering_for_cuda`): a target chosen by the caller, not the default."""
    return bool(_CUDA_TARGET)


def cuda_capability() -> str:
    """The compute capability a CUDA branch targets (see the module docstring)."""
    if _CUDA_TARGET:
        return _CUDA_TARGET[-1]
    return local_cuda_capability() or DEFAULT_CUDA_TARGET


def _major(capability: str) -> tuple[int, int]:
    try:
        major, _, minor = str(capability).partition(".")
        return int(major), int(minor or 0)
    except ValueError:
        raise ValueError(f"a compute capability looks like '9.0', not {capability!r}") from None


def cuda_at_least(capability: str) -> bool:
    """Whether the CUDA target is at least ``capability``."""
    return _major(cuda_capability()) >= _major(capability)


def choose[K: Hashable, T](
    decide: Callable[[str], K],
    build: Callable[[K], Callable[..., T]],
    operands: tuple[Any, ...] | None = None,
) -> T:
    """``build(decide(p))(*operands)`` on platform ``p``, decided per platform at lowering.

    ``decide`` maps each of :data:`PLATFORMS` to a hashable decision (an
    implementation name, a dot algorithm); ``build`` turns a decision into a
    function of ``operands`` (arrays, pytrees of arrays), or, where
    ``operands`` is None, of no arguments (closing over its operands).
    Where every platform decides alike there is no branch at all, and the
    program is what it was without the choice.

    Otherwise, given ``operands``, only the branch of the platform being
    traced for (:func:`tracing_platform`) is traced now; every other
    decision's branch is traced when, and only if, a program is lowered for
    one of its platforms (:func:`only_on` with the traced branch's result
    shapes), under the settings active then: lower where you traced.
    Without ``operands`` (a closure cannot be traced later), one branch is
    traced per distinct decision.
    """
    decisions = {p: decide(p) for p in PLATFORMS}
    distinct = list(dict.fromkeys(decisions.values()))
    here = tracing_platform() if operands is not None and len(distinct) > 1 else None
    if operands is None:
        fns = {d: build(d) for d in distinct}
    elif here is None:
        fns = {d: functools.partial(build(d), *operands) for d in distinct}
    else:
        fns = _traced_here_deferred_elsewhere(decisions, build, operands, here)
    if len(distinct) == 1:
        return fns[distinct[0]]()
    return lax.platform_dependent(**{p: fns[d] for p, d in decisions.items()})


def _traced_here_deferred_elsewhere(decisions, build, operands, here) -> dict[Any, Callable]:
    """:func:`choose`'s branches: ``here``'s traced once, every other one deferred."""
    # The traced branch is a jit, traced once: its result shapes are the
    # other branches' declared ones, and its call reuses the trace.  The jit
    # stays on where a caller traces with jax.numpy's jits off
    # (inline_ops.traced_inline), else the branch would be traced twice.
    local = jax.jit(build(decisions[here]), inline=True)
    with jax.disable_jit(False):
        out_shape = jax.eval_shape(local, *operands)

    def traced():
        with jax.disable_jit(False):
            return local(*operands)

    def branch(d):
        if d == decisions[here]:
            return traced
        plats = tuple(p for p, e in decisions.items() if e == d)
        return lambda: only_on(plats, build(d), *operands, out_shape=out_shape)

    return {d: branch(d) for d in dict.fromkeys(decisions.values())}


#: The platform a deferred branch is being lowered (and so traced) for.
_LOWERING_FOR: list[str] = []


def tracing_platform() -> str | None:
    """The platform whose branch :func:`choose` traces now: the one a deferred branch is
    being lowered for, else this machine's (None where it is not one of :data:`PLATFORMS`)."""
    if _LOWERING_FOR:
        return _LOWERING_FOR[-1]
    try:
        here = local_platform()
    except RuntimeError:
        return None
    return here if here in PLATFORMS else None


# --------------------------------------------------------------------------
# Computations that only some platforms can lower
# --------------------------------------------------------------------------

only_on_p = Primitive("fp8jax_only_on")
only_on_p.multiple_results = True


def only_on(
    platforms: tuple[str, ...], fn: Callable[..., Any], *args: Any, out_shape: Any = None
) -> Any:
    """``fn(*args)``, lowered only for ``platforms`` (zeros of its shape elsewhere).

    For a branch of :func:`choose` that only its platforms can lower; see the
    module docstring.  ``args`` are arrays (pytrees of arrays); the result
    has ``fn``'s structure.  ``out_shape`` (``fn``'s result as a pytree of
    ``jax.ShapeDtypeStruct``), where the caller knows it: ``fn`` is then
    traced only when the program is lowered for one of ``platforms``, not
    here (a Pallas kernel's trace is most of what tracing an FP8 program for
    every platform costs, and a CPU lowering never needs a TPU kernel's);
    a result that differs from ``out_shape`` fails that lowering.  ``fn``
    is then traced under the settings active at lowering (:func:`cuda_target`,
    :func:`lowering_for_cuda`): lower where you traced.
    """
    flat, in_tree = jax.tree.flatten(args)
    if out_shape is not None:
        leaves, out_tree = jax.tree.flatten(out_shape)
        avals = tuple(jax.core.ShapedArray(x.shape, jnp.dtype(x.dtype)) for x in leaves)
        body = _Deferred(fn, in_tree, avals)
        outs = only_on_deferred_p.bind(*flat, body=body, platforms=tuple(platforms))
        return jax.tree.unflatten(out_tree, outs)
    closed, out_shape = jax.make_jaxpr(
        lambda *xs: fn(*jax.tree.unflatten(in_tree, xs)), return_shape=True
    )(*flat)
    out_tree = jax.tree.structure(out_shape)
    outs = only_on_p.bind(
        *closed.consts,
        *flat,
        jaxpr=closed.jaxpr,
        n_consts=len(closed.consts),
        platforms=tuple(platforms),
    )
    return jax.tree.unflatten(out_tree, outs)


def _eval(jaxpr, n_consts, *args):
    return jax.core.eval_jaxpr(jaxpr, list(args[:n_consts]), *args[n_consts:])


def _only_on_impl(*args, jaxpr, n_consts, platforms):
    return _eval(jaxpr, n_consts, *args)


def _only_on_abstract(*args, jaxpr, n_consts, platforms):
    return [v.aval for v in jaxpr.outvars]


def _only_on_batch(args, dims, *, jaxpr, n_consts, platforms):
    # Batch the wrapped computation itself, and wrap the batched one.
    in_axes = tuple(dims)  # None where an operand is not batched
    batched = jax.vmap(functools.partial(_eval, jaxpr, n_consts), in_axes=in_axes)
    outs = only_on(platforms, batched, *args)
    return list(outs), [0] * len(outs)


def _only_on_rule(platform: str):
    """The lowering of :func:`only_on` for ``platform``: its computation, or dead zeros."""

    def rule(ctx, *args, jaxpr, n_consts, platforms):
        if platform in platforms:
            fn = functools.partial(_eval, jaxpr, n_consts)
        else:
            # Never run: the enclosing choice takes another branch on this platform.
            def fn(*_):
                return [jnp.zeros(v.aval.shape, v.aval.dtype) for v in jaxpr.outvars]

        return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)

    return rule


class _Deferred:
    """``fn`` on flattened arguments, checked against the results it was declared to give.

    Its own primitive (not :data:`only_on_p` with a Python callable in place
    of the jaxpr): a traced computation stays a jaxpr in the equation's
    params, where JAX looks for what lowering needs (a ``custom_partitioning``
    inside wants the device assignment, which JAX sets up only when it sees one).
    """

    def __init__(self, fn: Callable[..., Any], in_tree: Any, avals: tuple[Any, ...]):
        self.fn, self.in_tree, self.avals = fn, in_tree, avals

    def __call__(self, *flat: Any) -> list[Any]:
        outs = jax.tree.leaves(self.fn(*jax.tree.unflatten(self.in_tree, flat)))
        got = [(tuple(o.shape), jnp.dtype(o.dtype)) for o in outs]
        want = [(tuple(a.shape), a.dtype) for a in self.avals]
        if got != want:
            raise ValueError(f"{self.fn} gave {got}, declared as {want}")
        return outs


only_on_deferred_p = Primitive("fp8jax_only_on_deferred")
only_on_deferred_p.multiple_results = True


def _deferred_batch(args, dims, *, body, platforms):
    # The batched computation (batch axis first in every result), deferred alike.
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    batched = _Deferred(
        jax.vmap(body, in_axes=tuple(dims)),
        jax.tree.structure(tuple(args)),
        tuple(jax.core.ShapedArray((size, *a.shape), a.dtype) for a in body.avals),
    )
    outs = only_on_deferred_p.bind(*args, body=batched, platforms=platforms)
    return list(outs), [0] * len(outs)


def _deferred_rule(platform: str):
    """The lowering of a deferred :func:`only_on` for ``platform``: ``body`` traced now, or
    dead zeros."""

    def rule(ctx, *args, body, platforms):
        if platform in platforms:
            fn = body
        else:

            def fn(*_):
                return [jnp.zeros(a.shape, a.dtype) for a in body.avals]

        # Choices inside the body trace this platform's branch.
        _LOWERING_FOR.append(platform)
        try:
            return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)
        finally:
            _LOWERING_FOR.pop()

    return rule


def _deferred_jvp(primals, tangents, *, body, platforms):
    # Differentiated where it was traced: the body's own JVP, traced now (a
    # branch of a choice under autodiff is traced, as every branch once was).
    tangents = [ad.instantiate_zeros(t) for t in tangents]
    outs, out_tangents = jax.jvp(lambda *xs: list(body(*xs)), list(primals), list(tangents))
    return list(outs), list(out_tangents)


only_on_deferred_p.def_impl(lambda *args, body, platforms: body(*args))
only_on_deferred_p.def_abstract_eval(lambda *args, body, platforms: list(body.avals))
batching.primitive_batchers[only_on_deferred_p] = _deferred_batch
ad.primitive_jvps[only_on_deferred_p] = _deferred_jvp
for _p in PLATFORMS:
    mlir.register_lowering(only_on_deferred_p, _deferred_rule(_p), platform=_p)

only_on_p.def_impl(_only_on_impl)
only_on_p.def_abstract_eval(_only_on_abstract)
batching.primitive_batchers[only_on_p] = _only_on_batch
# One rule per platform: JAX lowers each with the platform it serves (in a
# multi-platform export, each inside its own branch of a platform switch).
for _p in PLATFORMS:
    mlir.register_lowering(only_on_p, _only_on_rule(_p), platform=_p)


# --------------------------------------------------------------------------
# A platform that cannot run what was asked for
# --------------------------------------------------------------------------

refuse_p = Primitive("fp8jax_refuse")


def refuse(message: str, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
    """A value of ``shape`` whose lowering fails with ``message`` (a ValueError).

    The branch of :func:`choose` for a platform that cannot run what was
    asked: tracing succeeds (the program may be lowered for another
    platform), lowering for this one fails with one line that says why.
    """
    return refuse_p.bind(message=message, shape=tuple(shape), dtype=jnp.dtype(dtype))


def _refuse_abstract(*, message, shape, dtype):
    return jax.core.ShapedArray(shape, dtype)


def _refuse_lowering(ctx, *, message, shape, dtype):
    raise ValueError(message)


refuse_p.def_abstract_eval(_refuse_abstract)
refuse_p.def_impl(lambda *, message, shape, dtype: _raise(message))
batching.primitive_batchers[refuse_p] = lambda args, dims, **kw: _raise(kw["message"])
mlir.register_lowering(refuse_p, _refuse_lowering)


def _raise(message: str):
    raise ValueError(message)
