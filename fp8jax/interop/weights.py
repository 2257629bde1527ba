"""Which operand of an intercepted GEMM is a parameter of the calling module.

The provider quantizes a GEMM only when one operand is the calling module's
parameter (that operand gets the weight scaling).  A model rarely hands the
parameter itself to the op: it casts it, reshapes it or transposes it first
(GPT-2's ``lax.dot_general(x, kernel.transpose())``).  :func:`find_weight`
follows an operand back through one-operand operations to a parameter, in
every trace a model runs under:

* under ``jit`` each traced value records the operation that made it
  (``tracer.parent``);
* under ``grad`` / ``value_and_grad`` / ``vjp`` a value is a (primal,
  tangent) pair whose tangent is traced, so the tangent leads back to the
  parameter's tangent, also eagerly and inside a jitted train step;
* eagerly, without a trace, a concrete operand is compared by value with the
  parameters of the same shape, or of the transposed shape.

When none of these links the operand to a parameter, a parameter of exactly
the operand's shape is taken if it is the only one; several such parameters
are reported as ambiguous and none is taken.  The answer says how the
parameter was found or why none was, for the coverage report.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

# How far back through one-operand operations to look (a cast, a reshape and a
# transpose are three steps; a longer chain is not a parameter read).
MAX_STEPS = 32


@dataclasses.dataclass(frozen=True)
class Lookup:
    """Where the weight of one GEMM was found.

    Attributes:
      operand: "lhs" / "rhs": the operand that is a parameter; None: neither.
      param: the parameter's name in the calling module, or None.
      how: "traced" (followed back through operations), "value" (equal to a
        parameter, eagerly), "shape" (the only parameter of that shape); or,
        with no parameter, "no parameter operand" or "ambiguous: ...".
    """

    operand: str | None
    param: str | None
    how: str


def _links(v: Any) -> list[Any]:
    """The values ``v`` was made from by one operation, within and across traces."""
    out = [getattr(v, a) for a in ("primal", "tangent") if hasattr(v, a)]
    parent = getattr(v, "parent", None)
    if parent is not None and len(getattr(parent, "in_tracers", ())) == 1:
        out.append(parent.in_tracers[0])
    get_const = getattr(v, "get_const", None)
    if callable(get_const):
        const = get_const()
        if const is not None:
            out.append(const)
    # Symbolic zeros and other non-array tangents lead nowhere.
    return [u for u in out if isinstance(u, jax.Array)]


def _ancestry(x: Any) -> list[Any]:
    """``x`` and every value it came from through one-operand operations."""
    seen: dict[int, Any] = {}
    todo = [x]
    while todo and len(seen) < MAX_STEPS:
        v = todo.pop()
        if id(v) in seen:
            continue
        seen[id(v)] = v
        todo.extend(_links(v))
    return list(seen.values())


def _identities(param: Any) -> set[int]:
    """The ids a parameter has in the current traces (itself, its primal and tangent)."""
    ids, todo = set(), [param]
    while todo:
        v = todo.pop()
        if id(v) in ids:
            continue
        ids.add(id(v))
        todo.extend(getattr(v, a) for a in ("primal", "tangent") if hasattr(v, a))
    return ids


def _traced(x: Any, params: dict[str, Any]) -> list[str]:
    ids = {n: _identities(p) for n, p in params.items()}
    names = []
    for v in _ancestry(x):
        names += [n for n, s in ids.items() if id(v) in s and n not in names]
    return names


def _concrete(v: Any) -> bool:
    return isinstance(v, jax.Array) and not isinstance(v, jax.core.Tracer)


def _by_value(x: Any, params: dict[str, Any]) -> list[str]:
    """Eagerly: parameters equal to ``x`` as they are or transposed (any dtype)."""
    if not _concrete(x):
        return []
    xs = np.asarray(x)
    found = []
    for n, p in params.items():
        if not _concrete(p) or p.size != xs.size or p.ndim != xs.ndim:
            continue
        for view in (p, p.T):
            if view.shape == xs.shape and np.array_equal(
                np.asarray(view).astype(xs.dtype), xs, equal_nan=True
            ):
                found.append(n)
                break
    return found


def find_weight(lhs: Any, rhs: Any, params: dict[str, Any]) -> Lookup:
    """Which of (lhs, rhs) is one of ``params`` (name -> array); rhs is asked first.

    Each operand is first followed back through traces (exact), then compared
    by value when concrete, then matched by shape; an operand two parameters
    claim is ambiguous and is not taken as a weight.
    """
    ambiguous = []
    for how, match in (("traced", _traced), ("value", _by_value)):
        for side, x in (("rhs", rhs), ("lhs", lhs)):
            names = match(x, params)
            if len(names) == 1:
                return Lookup(side, names[0], how)
            if names:
                ambiguous.append((side, names))
    for side, x in (("rhs", rhs), ("lhs", lhs)):
        names = [n for n, p in params.items() if getattr(p, "shape", None) == np.shape(x)]
        if len(names) == 1 and not ambiguous:
            return Lookup(side, names[0], "shape")
        if len(names) > 1:
            ambiguous.append((side, names))
    if ambiguous:
        side, names = ambiguous[0]
        return Lookup(
            None,
            None,
            f"ambiguous: {side} {tuple(np.shape(lhs if side == 'lhs' else rhs))} "
            f"could be any of {', '.join(sorted(names))}",
        )
    return Lookup(None, None, "no parameter operand")


def looks_like_a_weight(lhs: Any, rhs: Any, params: dict[str, Any]) -> str | None:
    """A parameter with an operand's number of elements (a weight not traced back), or None."""
    sizes = {math.prod(np.shape(x)) for x in (lhs, rhs)}
    for n, p in params.items():
        if math.prod(np.shape(p)) in sizes:
            return n
    return None
