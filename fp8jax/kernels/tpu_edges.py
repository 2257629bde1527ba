"""Blocks that run past an array's edge, in the Pallas TPU (Mosaic) kernels.

A grid whose blocks do not divide an operand takes its last block partly
outside it: the pipeline copies in what lies inside, the rest of the VMEM
block holds whatever was there before (Pallas' interpret mode fills it with
NaN), and an output block's part outside is not written back.  So a
kernel may take an unaligned operand in place, with no pad around it in
HBM and no crop of its result, wherever that part cannot reach an element
inside:

* an output column (or row) computed from its own column of an input
  alone (a GEMM's B columns, a 128x1 tile's column) needs nothing;
* a reduction across the edge (a 1x128 tile's amax, a 128x128 block's, a
  GEMM's K run) needs the part outside set to zero first: a zero changes
  no amax, and a zero code adds nothing to a dot (both operands' codes are
  zeroed, since an FP8 code outside may be a NaN, and 0 x NaN is NaN).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

#: Zeroing starts at a multiple of the lane width, which is also a multiple of
#: every dtype's sublane tile (8 float32, 16 bfloat16, 32 FP8 rows), so the
#: store is an aligned slice along either axis.
_ALIGN = 128


def zero_past(ref: Any, axis: int, valid: int) -> None:
    """Set the elements of the VMEM block ``ref`` at index ``valid`` and after along
    ``axis`` (0 or 1; ``valid`` a static count) to zero."""
    size = ref.shape[axis]
    if valid >= size:
        return
    start = valid // _ALIGN * _ALIGN
    tail = (slice(None), slice(start, size)) if axis == 1 else (slice(start, size), slice(None))
    part = ref[tail]
    inside = lax.broadcasted_iota(jnp.int32, part.shape, axis) < valid - start
    ref[tail] = jnp.where(inside, part, jnp.zeros_like(part))


def at_last(grid_axis: int, fn: Callable[[], None]) -> None:
    """Run ``fn`` at the grid's last step along ``grid_axis`` only."""
    pl.when(pl.program_id(grid_axis) == pl.num_programs(grid_axis) - 1)(fn)


def valid_in_last(size: int, block: int) -> int | None:
    """Elements of an axis of ``size`` inside its last block of ``block``, or None where
    the blocks divide it (nothing to zero)."""
    if size % block == 0:
        return None
    return size - (size // block) * block


def zeroing(kernel: Callable, *edges: tuple[int | None, int, int | None], at: int = 0) -> Callable:
    """``kernel`` with its input block ``at`` (the first by default) zeroed, before it
    reads it, past each edge ``(grid_axis, axis, valid)``: from ``valid`` on along the
    block's ``axis`` at the grid's last step along ``grid_axis``, or at every step where
    ``grid_axis`` is None (one block spans the axis, as a row quantizer's whole rows
    do).  Edges whose ``valid`` is None (the blocks divide the axis) are left out;
    ``kernel`` itself where none is left."""
    edges = tuple(e for e in edges if e[2] is not None)
    if not edges:
        return kernel

    def run(*refs):
        for grid_axis, axis, valid in edges:
            zero = functools.partial(zero_past, refs[at], axis, valid)
            if grid_axis is None:
                zero()
            else:
                at_last(grid_axis, zero)
        kernel(*refs)

    return run
