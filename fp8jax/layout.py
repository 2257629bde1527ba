"""Scale layouts: where a quantized operand's scales sit, and how they move.

A :class:`Layout` is the static half of a :class:`fp8jax.quant.QTensor`: its
granularity, the axis its scale runs lie along and the tile / block edge.

* ``"tensor"``: one scale, shape ();
* ``"row"``: one scale per slice along ``axis`` (the scale has the data's
  shape with ``axis`` of size 1);
* ``"tile"``: one scale per 1 x ``tile`` run along ``axis`` (the scale has
  the data's shape with ``axis`` of size ceil(n / tile));
* ``"block"``: one scale per ``tile`` x ``tile`` square over the last two
  axes (scale shape (..., ceil(R / tile), ceil(C / tile))).

The operations here are the only places that know these four cases: the
scale group view of an array (:meth:`Layout.reduce_groups`,
:meth:`Layout.map_groups`), the scale broadcast back to the data
(:meth:`Layout.expand`), and how scales follow the data when the data moves:
two axes swapped (:meth:`Layout.swap`), batch elements gathered
(:meth:`Layout.take`), a leading batch axis added (:meth:`Layout.batched`),
the leading axis split into rows of tiles (:meth:`Layout.split_rows`), and
the scales read as runs along a contraction axis (:meth:`Layout.k_runs`).
Each moves or repeats scales exactly (no arithmetic on their values).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import jax
import jax.numpy as jnp

GRANULARITIES = ("tensor", "row", "tile", "block")


def pad_zeros(x: jax.Array, widths: Sequence[tuple[int, int]]) -> jax.Array:
    """``x`` zero padded by ``widths``, one (before, after) pair per axis (jnp.pad's).

    One ``lax.pad``: ``jnp.pad`` is a jit of its own, a call in the program
    that XLA inlines and runs its passes over once per use, and a quantizing
    train step pads at every operand.
    """
    widths = [(int(lo), int(hi)) for lo, hi in widths]
    if all(w == (0, 0) for w in widths):
        return x
    return jax.lax.pad(x, jnp.zeros((), x.dtype), [(lo, hi, 0) for lo, hi in widths])


def pad_axis(x: jax.Array, axis: int, multiple: int) -> jax.Array:
    """``x`` zero padded at the end of ``axis`` to a multiple of ``multiple``."""
    n = x.shape[axis]
    pad = (-n) % multiple
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return pad_zeros(x, widths)


def split_axis(x: jax.Array, axis: int, tile: int) -> jax.Array:
    """(..., n, ...) -> (..., ceil(n/tile), tile, ...), zero padded; (..., 1, n, ...)
    where one tile covers the axis (n <= tile).

    The short axis is not padded: its one group holds the same elements
    either way (the zeros of a pad change no amax), and a pad would be one
    more pass over x, a kernel of its own on XLA CPU.
    """
    if 0 < x.shape[axis] <= tile:
        return jnp.expand_dims(x, axis)
    xp = pad_axis(x, axis, tile)
    shape = xp.shape[:axis] + (xp.shape[axis] // tile, tile) + xp.shape[axis + 1 :]
    return xp.reshape(shape)


def repeat_crop(s: jax.Array, axis: int, times: int, size: int) -> jax.Array:
    """Each entry of ``s`` repeated ``times`` along ``axis``, cropped to ``size`` there."""
    return jax.lax.slice_in_dim(jnp.repeat(s, times, axis=axis), 0, size, axis=axis)


@dataclass(frozen=True)
class Layout:
    """Granularity, scale axis and tile edge of a scale layout (module docstring).

    Immutable and hashable: it is static pytree metadata of a QTensor.
    ``axis`` matters for "row" and "tile" only (the others keep whatever
    they were given).
    """

    granularity: str = "tensor"
    axis: int = 0
    tile: int = 128

    def __post_init__(self) -> None:
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"unknown granularity {self.granularity!r}")

    @classmethod
    def of(cls, spec: Any, axis: int = 0) -> Layout:
        """The layout a QuantSpec (granularity, tile) gives along ``axis``."""
        return cls(spec.granularity, axis, spec.tile)

    # -- what the scales are ---------------------------------------------

    @property
    def per_tensor(self) -> bool:
        """One scale for the whole tensor."""
        return self.granularity == "tensor"

    @property
    def per_row(self) -> bool:
        """One scale per slice along ``axis``."""
        return self.granularity == "row"

    @property
    def tiled(self) -> bool:
        """One scale per 1 x tile run along ``axis``."""
        return self.granularity == "tile"

    @property
    def blocked(self) -> bool:
        """One scale per tile x tile square over the last two axes."""
        return self.granularity == "block"

    @property
    def along_axis(self) -> bool:
        """The scales are runs along ``axis`` (rows or 1 x tile runs): which axis
        a GEMM contracts decides them (per-tensor scales and blocks serve W and W^T alike)."""
        return self.granularity in ("row", "tile")

    def runs_along(self, axis: int) -> bool:
        """Each scale covers a run along ``axis`` alone (a row or 1 x tile runs there)."""
        return self.along_axis and self.axis == axis

    def matches(self, other: Layout) -> bool:
        """The same scale groups: granularity and tile equal, and the axis where it counts."""
        same = (self.granularity, self.tile) == (other.granularity, other.tile)
        return same and (not self.along_axis or self.axis == other.axis)

    def __str__(self) -> str:
        if self.per_tensor:
            return "per-tensor"
        if self.blocked:
            return f"{self.tile}x{self.tile} blocks"
        run = "rows" if self.per_row else f"1x{self.tile} tiles"
        return f"{run} along axis {self.axis}"

    # -- the scale groups of an array --------------------------------------

    def reduce_groups(self, x: jax.Array, red: Callable[..., jax.Array]) -> jax.Array:
        """``red`` over each scale group of ``x`` (zero padded): the scale's shape.

        ``red(x, axis=..., keepdims=...)`` is a reduction such as ``jnp.max``;
        ``axis`` here must be normalized (0 <= axis < x.ndim).
        """
        if self.per_tensor:
            return red(x)
        if self.per_row:
            return red(x, axis=self.axis, keepdims=True)
        if self.tiled:
            return red(split_axis(x, self.axis, self.tile), axis=self.axis + 1)
        if x.ndim < 2:
            raise ValueError("block granularity needs at least 2 dimensions")
        xb = split_axis(split_axis(x, x.ndim - 1, self.tile), x.ndim - 2, self.tile)
        # xb: (..., R/t, t, C/t, t)
        return red(xb, axis=(-3, -1))

    def map_groups(
        self, x: jax.Array, scale: jax.Array, f: Callable[[jax.Array, jax.Array], jax.Array]
    ) -> jax.Array:
        """Elementwise ``f(x, s)`` with each element's group scale ``s``: x's shape.

        The scales broadcast over their groups (no copy of them to the data's
        size); ``axis`` must be normalized.
        """
        if self.per_tensor or self.per_row:
            return f(x, scale)
        t = self.tile
        if self.tiled:
            ax = self.axis
            y = f(split_axis(x, ax, t), jnp.expand_dims(scale, ax + 1))
            # Explicit sizes (the tile axis is shorter than t where one tile
            # covers x's axis): a -1 cannot be inferred for zero-size arrays.
            y = y.reshape(y.shape[:ax] + (y.shape[ax] * y.shape[ax + 1],) + y.shape[ax + 2 :])
            return jax.lax.slice_in_dim(y, 0, x.shape[ax], axis=ax)
        nd = x.ndim
        xb = split_axis(split_axis(x, nd - 1, t), nd - 2, t)
        y = f(xb, scale[..., :, None, :, None])
        y = y.reshape(y.shape[:-4] + (y.shape[-4] * y.shape[-3], y.shape[-2] * y.shape[-1]))
        return y[..., : x.shape[-2], : x.shape[-1]]

    def expand(self, scale: jax.Array, shape: tuple[int, ...]) -> jax.Array:
        """The scales broadcast back to ``shape`` (tiles repeated, edges cropped).

        "tensor" and "row" scales come back as they are (they broadcast).
        """
        if self.per_tensor or self.per_row:
            return scale
        if self.tiled:
            return repeat_crop(scale, self.axis, self.tile, shape[self.axis])
        s = jnp.repeat(jnp.repeat(scale, self.tile, axis=-2), self.tile, axis=-1)
        return s[..., : shape[-2], : shape[-1]]

    # -- how scales follow the data ----------------------------------------

    def swap(self, scale: jax.Array, i: int, j: int) -> tuple[Layout, jax.Array]:
        """Axes ``i`` and ``j`` (non-negative) of the data swapped: (layout, scales).

        Blocks cover the last two axes, so a blocked operand swaps those only.
        """
        if self.per_tensor:
            return self, scale
        if self.blocked and sorted((i, j)) != [scale.ndim - 2, scale.ndim - 1]:
            raise ValueError(f"{self} move with the last two axes only, not axes {i}, {j}")
        axis = {i: j, j: i}.get(self.axis, self.axis) if not self.blocked else self.axis
        return replace(self, axis=axis), jnp.swapaxes(scale, i, j)

    def take(self, scale: jax.Array, index: jax.Array) -> jax.Array:
        """The scales of batch elements ``index`` (an index array into the leading axis)."""
        return scale if self.per_tensor else scale[index]

    def batched(self, scale: jax.Array) -> tuple[Layout, jax.Array]:
        """A leading batch axis of size 1 added to the data: (layout, scales)."""
        return replace(self, axis=self.axis + 1), scale if self.per_tensor else scale[None]

    def split_rows(
        self, scale: jax.Array, split: Callable[[jax.Array], jax.Array]
    ) -> tuple[Layout, jax.Array]:
        """The leading (row) axis of 2-d data split by ``split`` into (tiles, rows): (layout, scales).

        ``split(scale)`` moves the scales of row-local layouts (one per
        tensor, or runs along axis 1) with their rows; other layouts have
        scales shared across rows and are refused.
        """
        if self.per_tensor:
            moved = scale
        elif self.runs_along(1):
            moved = split(scale)
        else:
            raise ValueError(
                f"cannot tile rows of a {self.granularity!r} operand along axis {self.axis}"
            )
        return replace(self, axis=self.axis + 1), moved

    def k_runs(
        self, scale: jax.Array, shape: tuple[int, int, int], k_axis: int
    ) -> tuple[jax.Array, int]:
        """(scales, run length g) of 3-d data of ``shape`` contracted along ``k_axis`` (1 or 2).

        The scales come out with ``k_axis`` of size ceil(K / g) and the other
        axes at full size: each scale covers g consecutive elements along K.
        """
        other = 3 - k_axis
        k = shape[k_axis]
        if self.per_tensor:
            full = list(shape)
            full[k_axis] = 1
            return jnp.broadcast_to(scale, tuple(full)), k
        if self.runs_along(k_axis):
            return scale, k if self.per_row else self.tile
        if self.blocked:
            return repeat_crop(scale, other, self.tile, shape[other]), self.tile
        raise ValueError(
            f"scales of granularity {self.granularity!r} along axis {self.axis} vary within K"
        )
