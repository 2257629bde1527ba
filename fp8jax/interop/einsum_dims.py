"""A two-operand einsum as one ``dot_general``: dimension numbers and output permutation.

Extends :func:`fp8jax.nn.einsum.parse_einsum` (explicit "lhs,rhs->out" specs
of letters) to what ``jnp.einsum`` also accepts for two operands: an
ellipsis (``"...d,df->...f"``, broadcast dimensions of equal size) and the
implicit output (no "->": the letters that occur once, in alphabetical
order).  Specs that sum an index within one operand, or repeat an index in
one operand, have no single-dot_general form and raise ValueError.
"""

from __future__ import annotations

import string

from fp8jax.nn.einsum import parse_einsum


def explicit_spec(spec: str, lhs_ndim: int, rhs_ndim: int) -> str:
    """``spec`` with its ellipses replaced by letters and its output made explicit."""
    spec = spec.replace(" ", "")
    if "->" in spec:
        ins, out = spec.split("->", 1)
    else:
        ins, out = spec, None
    operands = ins.split(",")
    if len(operands) != 2:
        raise ValueError(f"einsum spec {spec!r}: two operands expected")
    free = [c for c in string.ascii_letters if c not in spec]
    filled = []
    ell = ""
    for term, ndim in zip(operands, (lhs_ndim, rhs_ndim)):
        if "..." in term:
            n = ndim - (len(term) - 3)
            if n < 0:
                raise ValueError(
                    f"einsum spec {spec!r}: {term!r} has more indices than {ndim} dims"
                )
            # Broadcast dims align from the right, as in numpy.
            ell_here = "".join(free[len(free) - n :]) if n else ""
            ell = ell_here if len(ell_here) > len(ell) else ell
            term = term.replace("...", ell_here)
        filled.append(term)
    if out is None:
        letters = "".join(filled)
        out = ell + "".join(
            sorted(c for c in set(letters) if letters.count(c) == 1 and c not in ell)
        )
    else:
        out = out.replace("...", ell)
    return f"{filled[0]},{filled[1]}->{out}"


def einsum_dims(spec: str, lhs_ndim: int, rhs_ndim: int) -> tuple[tuple, tuple[int, ...]]:
    """(dot_general dimension numbers, permutation of its output to the spec's output)."""
    return parse_einsum(explicit_spec(spec, lhs_ndim, rhs_ndim))


def swapped(spec: str) -> str:
    """The explicit spec with its two operands exchanged (the output is unchanged)."""
    ins, out = spec.split("->")
    lhs, rhs = ins.split(",")
    return f"{rhs},{lhs}->{out}"


def matmul_dims(
    a_shape: tuple[int, ...], b_shape: tuple[int, ...]
) -> tuple[tuple, tuple[int, ...] | None] | None:
    """``jnp.matmul(a, b)`` as one dot_general: (dimension numbers, output permutation or None).

    None when it has no single-dot_general form: a scalar operand, or batch
    dimensions that differ between the operands (numpy broadcasts them).
    """
    na, nb = len(a_shape), len(b_shape)
    if na == 0 or nb == 0:
        return None
    if nb <= 2:
        # (..., K) @ (K[, N]): contract a's last axis with b's first.
        return (((na - 1,), (0,)), ((), ())), None
    dn = (((na - 1,), (nb - 2,)), ((), ()))
    if na == 1:
        return dn, None
    if na == 2:
        # (M, K) @ (*batch, K, N) gives (M, *batch, N); matmul puts M after the batch.
        n_batch = nb - 2
        return dn, (*range(1, n_batch + 1), 0, n_batch + 1)
    if tuple(a_shape[:-2]) != tuple(b_shape[:-2]):
        return None
    batch = tuple(range(na - 2))
    return (((na - 1,), (nb - 2,)), (batch, batch)), None
