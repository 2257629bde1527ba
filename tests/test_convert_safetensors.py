"""The safetensors reader accepts exactly the files the reference library accepts.

A property test builds valid files, mutates their headers and bytes, and
asks both ``fp8jax.toolkit.convert.SafetensorsFile`` and
``safetensors.deserialize`` (the reference, a dev dependency) to read them.
fp8jax is stricter in three documented ways: a duplicate key anywhere in the
header, a dtype given as a map (``{"F32": null}``) and the packed sub-byte
dtypes (F4, F6_*) are refused.  Hand-written cases pin each rule.
"""

from __future__ import annotations

import json
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fp8jax.toolkit import convert
from fp8jax.toolkit.convert import safetensors_io

try:  # the reference implementation, a dev dependency
    import safetensors
except ImportError:  # pragma: no cover - the dev extra installs it
    safetensors = None
needs_reference = pytest.mark.skipif(safetensors is None, reason="safetensors not installed")

# -- a JSON writer that can say what json.dumps cannot ------------------------------


@dataclass(frozen=True)
class Obj:
    """A JSON object as a list of pairs: keys may repeat."""

    pairs: tuple


@dataclass(frozen=True)
class Raw:
    """Text emitted as is (NaN, -0, 1e400, lone surrogate escapes)."""

    text: str


def dump(v) -> str:
    if isinstance(v, Obj):
        return "{" + ",".join(f"{json.dumps(k)}:{dump(x)}" for k, x in v.pairs) + "}"
    if isinstance(v, list):
        return "[" + ",".join(dump(x) for x in v) + "]"
    if isinstance(v, Raw):
        return v.text
    return json.dumps(v)


def has_duplicate_key(v) -> bool:
    if isinstance(v, Obj):
        keys = [k for k, _ in v.pairs]
        return len(keys) != len(set(keys)) or any(has_duplicate_key(x) for _, x in v.pairs)
    if isinstance(v, list):
        return any(has_duplicate_key(x) for x in v)
    return False


def file_bytes(header_text: str, data: bytes, n_delta: int = 0) -> bytes:
    raw = header_text.encode("utf-8", "surrogatepass")
    return struct.pack("<Q", max(len(raw) + n_delta, 0)) + raw + data


def reference_reads(blob: bytes):
    if safetensors is None:
        return "unknown"
    try:
        return {
            k: (v["dtype"], list(v["shape"]), bytes(v["data"]))
            for k, v in safetensors.deserialize(blob)
        }
    except Exception:  # the reference raises SafetensorError (and a few others)
        return None


def huge_dimension(header) -> bool:
    """A shape entry numpy cannot hold (fp8jax refuses it; the reference may not)."""
    found = False

    def walk(v):
        nonlocal found
        if isinstance(v, Obj):
            for k, x in v.pairs:
                if k == "shape" and isinstance(x, list):
                    found |= any(
                        isinstance(d, int) and not isinstance(d, bool) and d > np.iinfo(np.intp).max
                        for d in x
                    )
                walk(x)

    walk(header)
    return found


def fp8jax_reads(path: Path, blob: bytes):
    path.write_bytes(blob)
    try:
        with convert.SafetensorsFile(path) as f:
            return {
                n: (f.info(n).dtype, list(f.info(n).shape), f.get(n).tobytes()) for n in f.names()
            }
    except convert.SafetensorsError:
        return None


@pytest.fixture(scope="module")
def scratch():
    with tempfile.TemporaryDirectory() as d:
        yield Path(d) / "t.safetensors"


# -- the property test ---------------------------------------------------------------

DTYPES = sorted(safetensors_io.DTYPES)
NAMES = st.text(
    alphabet=st.sampled_from(["a", "b", ".", "_", "0", "é", "\u4e00", " ", "\\", '"']),
    min_size=0,
    max_size=4,
)
SHAPES = st.lists(st.integers(0, 4), max_size=3)


@st.composite
def headers(draw):
    """(header value, data bytes, header-length delta, stricter-than-reference flag)."""
    names = draw(st.lists(NAMES, max_size=4, unique=True).filter(lambda n: "__metadata__" not in n))
    entries = []
    for name in names:
        entries.append([name, draw(st.sampled_from(DTYPES)), draw(SHAPES)])
    # Lay the tensors out in a random order, end to end.
    order = draw(st.permutations(range(len(entries))))
    off = 0
    offsets = [None] * len(entries)
    for i in order:
        n = (
            int(np.prod(entries[i][2], dtype=np.int64))
            * safetensors_io.DTYPES[entries[i][1]].itemsize
        )
        offsets[i] = [off, off + n]
        off += n
    data = bytes(draw(st.binary(min_size=off, max_size=off)))
    recs = [
        [name, [["dtype", dt], ["shape", list(shape)], ["data_offsets", offsets[i]]]]
        for i, (name, dt, shape) in enumerate(entries)
    ]
    meta = None
    n_delta = 0
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(
            st.sampled_from(
                [
                    "offset",
                    "alias",
                    "shape",
                    "dtype",
                    "drop",
                    "extra",
                    "dup",
                    "meta",
                    "data",
                    "nlen",
                    "offsets_form",
                ]
            )
        )
        if kind == "meta":
            meta = draw(
                st.one_of(
                    st.none(),
                    st.dictionaries(NAMES, st.text(max_size=3), max_size=2),
                    st.dictionaries(
                        NAMES, st.one_of(st.integers(), st.none()), min_size=1, max_size=2
                    ),
                    st.just([]),
                )
            )
            continue
        if kind == "data":
            if draw(st.booleans()):
                data += bytes(draw(st.integers(1, 9)))
            else:
                data = data[: max(len(data) - draw(st.integers(1, 9)), 0)]
            continue
        if kind == "nlen":
            n_delta = draw(st.sampled_from([-3, -1, 1, 2]))
            continue
        if not recs:
            continue
        rec = draw(st.sampled_from(recs))
        fields = dict((k, i) for i, (k, _) in enumerate(rec[1]))
        if kind == "offset" and "data_offsets" in fields:
            o = rec[1][fields["data_offsets"]][1]
            if isinstance(o, list) and len(o) == 2 and all(isinstance(x, int) for x in o):
                j = draw(st.integers(0, 1))
                o = list(o)
                o[j] = max(o[j] + draw(st.sampled_from([-8, -2, -1, 1, 2, 8])), 0)
                rec[1][fields["data_offsets"]][1] = o
        elif kind == "alias" and len(recs) > 1 and "data_offsets" in fields:
            other = draw(st.sampled_from(recs))
            of = dict(other[1])
            if "data_offsets" in of:
                rec[1][fields["data_offsets"]][1] = of["data_offsets"]
        elif kind == "shape" and "shape" in fields:
            bad = draw(
                st.sampled_from(
                    [
                        True,
                        False,
                        2.0,
                        -1,
                        2**64,
                        2**64 - 1,
                        "2",
                        None,
                        Raw("-0"),
                        Raw("1e400"),
                        Raw("1E0"),
                    ]
                )
            )
            shape = (
                list(rec[1][fields["shape"]][1])
                if isinstance(rec[1][fields["shape"]][1], list)
                else []
            )
            if shape and draw(st.booleans()):
                shape[draw(st.integers(0, len(shape) - 1))] = bad
            else:
                shape.append(bad)
            rec[1][fields["shape"]][1] = shape
        elif kind == "dtype" and "dtype" in fields:
            new = draw(
                st.sampled_from(["F8", "f32", "F4", "F6_E2M3", "C64", None, 3, *DTYPES, "MAP"])
            )
            if new == "MAP":
                new = Obj((("F32", None),))
            rec[1][fields["dtype"]][1] = new
        elif kind == "drop":
            rec[1].pop(draw(st.integers(0, len(rec[1]) - 1)))
        elif kind == "extra":
            depth = draw(st.sampled_from([0, 1, 3, 124, 125, 126, 127]))
            value = (
                Raw("[" * depth + "]" * depth)
                if depth
                else draw(
                    st.one_of(
                        st.integers(),
                        st.text(max_size=3),
                        st.just(Raw("NaN")),
                        st.just(Raw('"\\ud800"')),
                        st.just(Raw('"\\ud83d\\ude00"')),
                    )
                )
            )
            rec[1].append([draw(st.sampled_from(["x", "y", "\u00e9"])), value])
        elif kind == "dup":
            if draw(st.booleans()):
                recs.append([rec[0], [list(f) for f in rec[1]]])
            elif rec[1]:
                rec[1].append(list(draw(st.sampled_from(rec[1]))))
        elif kind == "offsets_form" and "data_offsets" in fields:
            o = rec[1][fields["data_offsets"]][1]
            if isinstance(o, list) and len(o) == 2:
                rec[1][fields["data_offsets"]][1] = draw(
                    st.sampled_from(
                        [
                            [o[0]],
                            [o[0], o[1], o[1]],
                            [float(o[0]), o[1]],
                            Obj((("0", o[0]), ("1", o[1]))),
                            [o[0], True],
                        ]
                    )
                )
    # Read from the final header: a later mutation may give a tensor another dtype.
    stricter = any(
        isinstance(v, Obj) or v in ("F4", "F6_E2M3")
        for _, fields in recs
        for k, v in fields
        if k == "dtype"
    )
    pairs = [(name, Obj(tuple((k, v) for k, v in fields))) for name, fields in recs]
    if meta is not None or draw(st.booleans()):
        m = Obj(tuple(meta.items())) if isinstance(meta, dict) else meta
        pairs.insert(draw(st.integers(0, len(pairs))), ("__metadata__", m))
    header = Obj(tuple(pairs))
    return header, data, n_delta, stricter


@needs_reference
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=headers(), pad=st.sampled_from(["", " ", "  \t\n", "x", "\x00"]))
def test_reader_accepts_exactly_what_the_reference_accepts(scratch, case, pad):
    header, data, n_delta, stricter = case
    blob = file_bytes(dump(header) + pad, data, n_delta)
    ref = reference_reads(blob)
    ours = fp8jax_reads(scratch, blob)
    if stricter or has_duplicate_key(header) or huge_dimension(header):
        assert ours is None
    else:
        assert (ours is None) == (ref is None), (blob[:300], ref, ours)
    if ours is not None:
        assert ours == ref


# -- one case per rule ---------------------------------------------------------------

E = '"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}'


def _case(text: str, data: bytes = bytes(8)) -> bytes:
    return file_bytes(text, data)


REFUSED = {
    "overlap": (
        _case("{" + E + ',"b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'),
        "overlaps",
    ),
    "gap": (_case('{"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}'), "leaves a gap"),
    "reversed": (
        _case('{"a":{"dtype":"U8","shape":[0],"data_offsets":[8,0]}}'),
        "ends before it begins",
    ),
    "trailing": (_case("{" + E + "}", bytes(9)), "1 trailing data bytes"),
    "truncated": (_case("{" + E + "}", bytes(7)), "truncated shard"),
    "duplicate key": (
        # The reference keeps the last "a" ([8, 16]) and so refuses the file for its gap.
        _case("{" + E + ',"a":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}}', bytes(16)),
        "duplicate key 'a'",
    ),
    "bool shape": (
        _case('{"a":{"dtype":"F32","shape":[true,2],"data_offsets":[0,8]}}'),
        "bad shape",
    ),
    "float shape": (_case('{"a":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}}'), "bad shape"),
    "-0 shape": (_case('{"a":{"dtype":"U8","shape":[-0],"data_offsets":[0,0]}}', b""), "bad shape"),
    "bool offsets": (
        _case('{"a":{"dtype":"U8","shape":[1],"data_offsets":[false,true]}}', b"\0"),
        "bad data_offsets",
    ),
    "size mismatch": (
        _case('{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}'),
        "needs 12 bytes",
    ),
    "overflow": (
        _case('{"a":{"dtype":"U8","shape":[4294967296,4294967296,0],"data_offsets":[0,0]}}', b""),
        "overflows",
    ),
    "unknown dtype": (
        _case('{"a":{"dtype":"f32","shape":[2],"data_offsets":[0,8]}}'),
        "unsupported dtype",
    ),
    "metadata int": (
        _case('{"__metadata__":{"k":1},' + E + "}"),
        "__metadata__ is not an object of strings",
    ),
    "NaN literal": (_case('{"__metadata__":{"k":NaN},' + E + "}"), "NaN is not JSON"),
    "number out of range": (
        _case('{"a":{"dtype":"F32","x":1e400,"shape":[2],"data_offsets":[0,8]}}'),
        "out of range",
    ),
    "lone surrogate": (
        _case('{"\\ud800":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'),
        "lone surrogate",
    ),
    "nested 128": (
        _case(
            '{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":'
            + "[" * 126
            + "]" * 126
            + "}}"
        ),
        "nested 128 levels",
    ),
    "trailing text": (_case("{" + E + "}x"), "not valid JSON"),
    "not an object": (_case("[]", b""), "not a JSON object"),
    "header too long": (struct.pack("<Q", 100_000_001) + b"{}", "header length"),
    "short file": (b"\x02\x00\x00", "shorter than the 8-byte header length"),
    "BOM": (_case("\ufeff{" + E + "}"), "not valid JSON"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refused_like_the_reference(scratch, case):
    blob, match = REFUSED[case]
    assert reference_reads(blob) in (None, "unknown")
    scratch.write_bytes(blob)
    with pytest.raises(convert.SafetensorsError, match=match) as e:
        convert.SafetensorsFile(scratch)
    assert "\n" not in str(e.value)


ACCEPTED = {
    "extra fields": '{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":{"y":[1,-0,1e5]}}}',
    "nested 127": '{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":'
    + "[" * 125
    + "]" * 125
    + "}}",
    "whitespace": ' \t\n{"a" : {"dtype":"F32","shape":[2],"data_offsets":[0,8]}}\r\n ',
    "metadata null": '{"__metadata__":null,' + E + "}",
    "escaped names": '{"\\u0061":{"dtype":"F\\u00332","shape":[2],"data_offsets":[0,8]}}',
    "surrogate pair": '{"\\ud83d\\ude00":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
    "zero-size tensors share an offset": (
        '{"z":{"dtype":"F32","shape":[0,3],"data_offsets":[0,0]},"y":{"dtype":"U8","shape":[0],"data_offsets":[0,0]},'
        + E
        + "}"
    ),
    "data in another order": '{"b":{"dtype":"U8","shape":[8],"data_offsets":[8,16]},' + E + "}",
}


@pytest.mark.parametrize("case", sorted(ACCEPTED))
def test_accepted_like_the_reference(scratch, case):
    text = ACCEPTED[case]
    data = bytes(range(16)) if '"b"' in text else bytes(range(8))
    blob = _case(text, data)
    ref = reference_reads(blob)
    ours = fp8jax_reads(scratch, blob)
    assert ours is not None and ref in (ours, "unknown")


@needs_reference
def test_stricter_than_the_reference_where_documented(scratch):
    same_twice = _case("{" + E + "," + E + "}")
    dtype_map = _case('{"a":{"dtype":{"F32":null},"shape":[2],"data_offsets":[0,8]}}')
    packed = _case('{"a":{"dtype":"F4","shape":[4],"data_offsets":[0,2]}}', bytes(2))
    for blob in (same_twice, dtype_map, packed):
        assert reference_reads(blob) is not None
        assert fp8jax_reads(scratch, blob) is None


def test_loads_json_never_recurses_too_deep():
    deep = "[" * 200_000 + "]" * 200_000
    with pytest.raises(ValueError, match="nested 200000 levels"):
        convert.loads_json(deep)
    with pytest.raises(ValueError, match="nested 200000 levels"):
        convert.loads_json(deep, strict=False)
    assert convert.loads_json('{"a": "[[[[", "b": [1]}') == {"a": "[[[[", "b": [1]}
