"""Small token directories and text shards written with numpy / json only (test helpers)."""

import json
from pathlib import Path

import numpy as np


def write_tokens(
    root: Path,
    splits: dict[str, list[np.ndarray]],
    vocab: int,
    dtype: str = "uint16",
    *,
    listed: bool = True,
) -> Path:
    """A token directory: one ``<split>-NNNNN.bin`` per array and a tokens.json.

    ``listed``: name the shards (with n_tokens) in tokens.json, else leave
    them to be found by name (``train*.bin`` / ``val*.bin``).
    """
    root.mkdir(parents=True, exist_ok=True)
    shards = []
    for split, arrays in splits.items():
        for i, a in enumerate(arrays):
            name = f"{split}-{i:05d}.bin"
            np.asarray(a, np.dtype(dtype).newbyteorder("<")).tofile(root / name)
            shards.append({"split": split, "path": name, "n_tokens": int(np.size(a))})
    meta = {"vocab_size": vocab, "dtype": dtype}
    if listed:
        meta["shards"] = shards
    (root / "tokens.json").write_text(json.dumps(meta))
    return root


def random_tokens(root: Path, vocab: int = 500, sizes=(3000, 2000), val=(1500,), seed=0):
    """A token directory of uniform random ids (train shards ``sizes``, validation ``val``)."""
    rng = np.random.default_rng(seed)
    return write_tokens(
        root,
        {
            "train": [rng.integers(0, vocab, n) for n in sizes],
            "val": [rng.integers(0, vocab, n) for n in val],
        },
        vocab,
    )
