"""fp8jax.layout: scale layouts and how scales follow the data, against numpy.

The reference is an index map built in numpy: the element at index i of the
data reads the scale at i with the scale axis divided by the tile ("tile"),
both last axes divided ("block"), the scale axis set to 0 ("row"), or the
single scale ("tensor").  Every operation must give scales whose expansion
is the reference expansion moved the way the data moved.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax.layout import Layout, pad_zeros
from fp8jax.recipes import QuantSpec

SHAPE = (3, 6, 10)  # partial tiles and blocks along both matrix axes
T = 4


def scale_shape(lay: Layout, shape) -> tuple[int, ...]:
    nd = len(shape)
    if lay.granularity == "tensor":
        return ()
    out = list(shape)
    if lay.granularity == "row":
        out[lay.axis] = 1
    elif lay.granularity == "tile":
        out[lay.axis] = -(-shape[lay.axis] // lay.tile)
    else:
        out[nd - 2] = -(-shape[-2] // lay.tile)
        out[nd - 1] = -(-shape[-1] // lay.tile)
    return tuple(out)


def ref_expand(scale: np.ndarray, lay: Layout, shape) -> np.ndarray:
    """Each element's scale, by index arithmetic (no repeat, no reshape)."""
    if lay.granularity == "tensor":
        return np.full(shape, scale)
    idx = list(np.indices(shape))
    if lay.granularity == "row":
        idx[lay.axis] = np.zeros_like(idx[lay.axis])
    elif lay.granularity == "tile":
        idx[lay.axis] = idx[lay.axis] // lay.tile
    else:
        idx[-2] = idx[-2] // lay.tile
        idx[-1] = idx[-1] // lay.tile
    return scale[tuple(idx)]


def layouts(nd: int = 3, tile: int = T):
    out = [Layout("tensor", 0, tile), Layout("block", nd - 1, tile)]
    for g in ("row", "tile"):
        out += [Layout(g, a, tile) for a in range(nd)]
    return out


def distinct_scales(lay: Layout, shape, seed: int = 0) -> np.ndarray:
    n = int(np.prod(scale_shape(lay, shape)))
    vals = np.random.default_rng(seed).permutation(n).astype(np.float32) + 1.0
    return vals.reshape(scale_shape(lay, shape))


def full(lay: Layout, scale, shape) -> np.ndarray:
    return np.broadcast_to(np.asarray(lay.expand(jnp.asarray(scale), shape)), shape)


@pytest.mark.parametrize("lay", layouts(), ids=str)
@pytest.mark.parametrize("jit", [False, True])
def test_expand_is_the_index_map(lay, jit):
    s = distinct_scales(lay, SHAPE)
    f = lambda s: lay.expand(s, SHAPE)
    got = (jax.jit(f) if jit else f)(jnp.asarray(s))
    np.testing.assert_array_equal(
        np.broadcast_to(np.asarray(got), SHAPE), ref_expand(s, lay, SHAPE)
    )


@pytest.mark.parametrize("lay", layouts(), ids=str)
def test_groups_reduce_and_map_by_the_index_map(lay):
    x = np.random.default_rng(1).uniform(0.5, 2.0, SHAPE).astype(np.float32)
    amax = np.asarray(lay.reduce_groups(jnp.asarray(x), jnp.max))
    assert amax.shape == scale_shape(lay, SHAPE)
    # Each group's max: the largest element that reads that scale entry.
    ids = ref_expand(np.arange(amax.size).reshape(amax.shape), lay, SHAPE)
    ref = np.array([x[ids == i].max() for i in range(amax.size)]).reshape(amax.shape)
    np.testing.assert_array_equal(amax, ref)
    s = distinct_scales(lay, SHAPE)
    # A product: correctly rounded on every backend (XLA may divide by a reciprocal).
    got = lay.map_groups(jnp.asarray(x), jnp.asarray(s), lambda a, b: a * b)
    np.testing.assert_array_equal(np.asarray(got), x * ref_expand(s, lay, SHAPE))


@pytest.mark.parametrize("lay", layouts(), ids=str)
def test_swap_moves_scales_with_the_data(lay):
    s = distinct_scales(lay, SHAPE)
    lay2, s2 = lay.swap(jnp.asarray(s), 1, 2)
    swapped = (SHAPE[0], SHAPE[2], SHAPE[1])
    np.testing.assert_array_equal(
        full(lay2, s2, swapped), np.swapaxes(ref_expand(s, lay, SHAPE), 1, 2)
    )
    # Twice: the layout and scales it started from.
    lay3, s3 = lay2.swap(s2, 2, 1)
    assert lay3 == lay
    np.testing.assert_array_equal(np.asarray(s3), s)


def test_blocks_swap_only_their_two_axes():
    with pytest.raises(ValueError, match="last two axes"):
        Layout("block", 2, T).swap(jnp.ones((1, 2, 3)), 0, 1)


@pytest.mark.parametrize("lay", layouts(), ids=str)
@pytest.mark.parametrize("jit", [False, True])
def test_take_and_batch_axis(lay, jit):
    s = distinct_scales(lay, SHAPE)
    index = np.array([2, 0, 2])
    f = lambda s: lay.take(s, jnp.asarray(index))
    st = (jax.jit(f) if jit else f)(jnp.asarray(s))
    np.testing.assert_array_equal(full(lay, st, SHAPE), ref_expand(s, lay, SHAPE)[index])
    # A batch axis on a 2-d slice, then swapping its matrix axes: one composition.
    if lay.granularity != "tensor" and lay.axis == 0:
        return  # its scale axis is the batch axis the 2-d slice drops
    lay2 = Layout(lay.granularity, max(lay.axis - 1, 0), lay.tile)
    s2 = distinct_scales(lay2, SHAPE[1:])
    lb, sb = lay2.batched(jnp.asarray(s2))
    assert lb.axis == lay2.axis + 1
    np.testing.assert_array_equal(
        full(lb, sb, (1,) + SHAPE[1:]), ref_expand(s2, lay2, SHAPE[1:])[None]
    )
    lbs, sbs = lb.swap(sb, 1, 2)
    np.testing.assert_array_equal(
        full(lbs, sbs, (1, SHAPE[2], SHAPE[1])),
        np.swapaxes(ref_expand(s2, lay2, SHAPE[1:])[None], 1, 2),
    )


@pytest.mark.parametrize("lay", layouts(nd=2), ids=str)
def test_split_rows_keeps_row_local_scales(lay):
    shape = (8, 10)

    def split(a):  # (8, .) rows -> (2, 4, .) tiles of rows
        return a.reshape((2, 4) + a.shape[1:])

    s = distinct_scales(lay, shape)
    if not (lay.granularity == "tensor" or lay.runs_along(1)):
        with pytest.raises(ValueError, match="cannot tile rows"):
            lay.split_rows(jnp.asarray(s), split)
        return
    lay2, s2 = lay.split_rows(jnp.asarray(s), split)
    assert lay2.axis == lay.axis + 1
    np.testing.assert_array_equal(
        full(lay2, s2, (2, 4, 10)), ref_expand(s, lay, shape).reshape(2, 4, 10)
    )


@pytest.mark.parametrize("lay", layouts(), ids=str)
@pytest.mark.parametrize("k_axis", [1, 2])
def test_k_runs_cover_runs_of_g_along_k(lay, k_axis):
    s = distinct_scales(lay, SHAPE)
    if lay.granularity in ("row", "tile") and lay.axis != k_axis:
        with pytest.raises(ValueError, match="vary within K"):
            lay.k_runs(jnp.asarray(s), SHAPE, k_axis)
        return
    runs, g = lay.k_runs(jnp.asarray(s), SHAPE, k_axis)
    runs = np.asarray(runs)
    other = 3 - k_axis
    assert runs.shape[other] == SHAPE[other] and runs.shape[0] == SHAPE[0]
    assert runs.shape[k_axis] == -(-SHAPE[k_axis] // g)
    want_g = {"tensor": SHAPE[k_axis], "row": SHAPE[k_axis]}.get(lay.granularity, T)
    assert g == want_g
    rebuilt = np.repeat(runs, g, axis=k_axis).take(np.arange(SHAPE[k_axis]), axis=k_axis)
    np.testing.assert_array_equal(rebuilt, ref_expand(s, lay, SHAPE))


def test_what_the_layout_answers():
    assert Layout().per_tensor and not Layout().along_axis
    assert Layout("row", 1).per_row and Layout("row", 1).runs_along(1)
    assert Layout("tile", 2, 128).tiled and not Layout("tile", 2).runs_along(1)
    assert Layout("block", 0, 128).blocked and not Layout("block", 2).runs_along(2)
    # The same scale groups: the axis counts for runs only.
    assert Layout("block", 0, 128).matches(Layout("block", 2, 128))
    assert not Layout("tile", 1, 128).matches(Layout("tile", 2, 128))
    assert not Layout("tile", 1, 128).matches(Layout("tile", 1, 64))
    assert Layout.of(QuantSpec("e4m3", "tile", 64), 1) == Layout("tile", 1, 64)
    with pytest.raises(ValueError, match="unknown granularity"):
        Layout("column")
    # Static and hashable: a usable jit cache key.
    assert hash(Layout("tile", 1, 128)) == hash(Layout("tile", 1, 128))


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("gran,axis", [("tensor", 2), ("row", 1), ("tile", 2), ("block", 2)])
def test_qtensor_moves_keep_its_values(gran, axis, jit):
    x = np.random.default_rng(2).standard_normal(SHAPE).astype(np.float32)
    q = fp8jax.quantize(jnp.asarray(x), fp8jax.E4M3, gran, axis=axis, tile=T)
    assert q.layout == Layout(gran, axis, T)
    values = np.asarray(fp8jax.dequantize(q))
    wrap = jax.jit if jit else (lambda f: f)
    sw = wrap(lambda q: q.swapaxes(1, 2))(q)
    np.testing.assert_array_equal(np.asarray(fp8jax.dequantize(sw)), np.swapaxes(values, 1, 2))
    index = jnp.asarray([1, 1, 0])
    tk = wrap(lambda q: q.take(index))(q)
    np.testing.assert_array_equal(np.asarray(fp8jax.dequantize(tk)), values[[1, 1, 0]])
    if gran == "block" or axis > 0:
        q2 = fp8jax.quantize(jnp.asarray(x[0]), fp8jax.E4M3, gran, axis=axis - 1, tile=T)
        b = wrap(lambda q: q.batched((1,) + SHAPE[1:]))(q2)
        np.testing.assert_array_equal(
            np.asarray(fp8jax.dequantize(b)), np.asarray(fp8jax.dequantize(q2))[None]
        )
    # The layout is static pytree metadata: it survives flattening.
    leaves, tree = jax.tree_util.tree_flatten(q)
    assert jax.tree_util.tree_unflatten(tree, leaves).layout == q.layout
    assert all(isinstance(leaf, jax.Array) for leaf in leaves)


@pytest.mark.parametrize("use_jit", [False, True])
def test_pad_zeros_is_numpy_pad_as_one_primitive(use_jit):
    widths = ((0, 1), (2, 0), (0, 3))

    def pad(a):
        return pad_zeros(a, widths)

    fn = jax.jit(pad) if use_jit else pad
    for dt in (np.float32, jnp.bfloat16, np.uint8):
        x = (np.arange(30).reshape(2, 3, 5) + 1).astype(dt)
        got, want = np.asarray(fn(jnp.asarray(x))), np.pad(x, widths)
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
    # One pad, no jit of jnp.pad (a call of its own in the program).
    jaxpr = jax.make_jaxpr(pad)(jnp.ones((2, 3, 5)))
    assert [e.primitive.name for e in jaxpr.eqns] == ["pad"]
    x = jnp.ones((2, 2))
    assert pad_zeros(x, ((0, 0), (0, 0))) is x
