"""Checksums of a checkpoint's arrays: what a saved state should read back as.

:func:`record` takes, for every leaf of a state, its path (``params/...``,
``opt_state/1/mu/...``), dtype, shape and the SHA-256 of its bytes in C
order on the host (the values, not the files: the same state hashes the
same whatever the storage compressed or sharded).  The checkpointer stores
that record in the step's own metadata, written with the step and renamed
into place with it, so a step never exists without its record
(:mod:`fp8jax.train.checkpoint`).

:func:`first_mismatch` hashes a restored state and names the first array
whose dtype, shape or bytes differ from the record, in one line.  Bytes
damaged in a compressed array file can decompress into other finite values
(an XOR of 64 bytes in a zstd chunk does), which no finiteness check sees;
the checksum does.  A checksum proves the bytes are the ones saved, against
damage, not against someone who rewrites the record as well.

Why not the storage's own checksums: orbax (0.12) writes zarr2 arrays with no
checksum, or zarr3 arrays whose crc32c covers the shard index only, and has
no option to add the crc32c codec to the chunks.
"""

from __future__ import annotations

import hashlib
from typing import Any

import jax
import numpy as np

#: The key of the record in the step's custom metadata.
KEY = "fp8jax_checksums"
ALGORITHM = "sha256"


def host_array(leaf: Any) -> np.ndarray:
    """``leaf`` as one numpy array on this host (gathered when other processes hold parts)."""
    if isinstance(leaf, jax.Array) and not (leaf.is_fully_addressable or leaf.is_fully_replicated):
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
    return np.asarray(jax.device_get(leaf))


def leaves(tree: Any) -> list[tuple[str, np.ndarray]]:
    """(path, host array) of every leaf of ``tree``; paths join keys with "/"."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [
        (jax.tree_util.keystr(path, simple=True, separator="/"), host_array(leaf))
        for path, leaf in flat
    ]


def digest(a: np.ndarray) -> str:
    """SHA-256 (hex) of ``a``'s bytes in C order."""
    return hashlib.sha256(np.ascontiguousarray(a).reshape(-1).view(np.uint8)).hexdigest()


def record(tree: Any) -> dict[str, Any]:
    """``{"algorithm": "sha256", "arrays": {path: {"dtype", "shape", "sha256"}}}`` of ``tree``."""
    return {
        "algorithm": ALGORITHM,
        "arrays": {
            path: {"dtype": str(a.dtype), "shape": list(a.shape), ALGORITHM: digest(a)}
            for path, a in leaves(tree)
        },
    }


def record_problem(rec: Any) -> str | None:
    """Why ``rec`` is not a checksum record :func:`record` wrote, or None when it is one."""
    if not isinstance(rec, dict) or rec.get("algorithm") != ALGORITHM:
        return f"its checksum record is not a {ALGORITHM} record"
    arrays = rec.get("arrays")
    if not isinstance(arrays, dict) or not all(
        isinstance(v, dict) and isinstance(v.get(ALGORITHM), str) for v in arrays.values()
    ):
        return "its checksum record is damaged"
    return None


def first_mismatch(tree: Any, rec: dict[str, Any]) -> str | None:
    """One line naming the first array of ``tree`` unlike ``rec`` (or missing), else None.

    ``rec`` passed :func:`record_problem`.  Every recorded array must be in
    ``tree`` and every array of ``tree`` recorded, with its dtype, shape and
    bytes.
    """
    arrays = rec["arrays"]
    seen = set()
    for path, a in leaves(tree):
        seen.add(path)
        want = arrays.get(path)
        if want is None:
            return f"array {path} has no recorded checksum"
        if str(a.dtype) != want.get("dtype") or list(a.shape) != want.get("shape"):
            return (
                f"array {path} reads as {a.dtype}{list(a.shape)}, saved as "
                f"{want.get('dtype')}{want.get('shape')}"
            )
        if digest(a) != want[ALGORITHM]:
            return f"array {path} differs from the {ALGORITHM} recorded when it was saved"
    missing = sorted(set(arrays) - seen)
    if missing:
        return f"array {missing[0]} was saved but does not read back"
    return None
