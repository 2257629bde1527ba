"""``fp8jax data prepare SRC DST --vocab N``: text -> BPE tokenizer -> token shards.

1. Every file under ``SRC`` (sorted; text, JSONL, Parquet or ArrayRecord,
   :mod:`fp8jax.data.documents`) is read as a stream of documents.
2. A byte-level BPE tokenizer with ``vocab`` entries (the 256 byte symbols,
   the merges, and ``<|endoftext|>``; ``vocab`` at most ``MAX_VOCAB`` and at
   most what the text can give, checked before anything is allocated) is
   trained on them with Hugging Face ``tokenizers`` (nothing is downloaded),
   or ``tokenizer`` (a ``tokenizer.json``) is reused as is.  Pre-tokens are
   GPT-2's, cut into runs of at most ``MAX_WORD_BYTES`` bytes, so the time
   grows linearly with the text whatever its longest "word".
3. A second pass tokenizes the documents in batches, appends the
   end-of-document token to each, and writes them to ``train-NNNNN.bin`` /
   ``val-NNNNN.bin`` (``uint16`` when the vocabulary fits, else ``uint32``),
   starting a new shard at a document boundary once one holds
   ``shard_tokens``; a last shard under half that size is appended to the
   one before, so every shard of a split but a lone one holds at least
   ``shard_tokens / 2`` tokens.

Split: document ``k`` (counted over all files in order) goes to validation
when ``floor((k + 1) f) > floor(k f)`` for ``f = val_fraction``: exactly
``floor(n f)`` of ``n`` documents, spread evenly, the same every time.  A
plain text file is cut into pieces of about 64 KiB that count as documents
for the split (each ends with the end-of-document token, as every document does).

Output appears complete or not at all (:mod:`fp8jax.atomic_output`): ``DST`` holds
``tokens.json`` (:mod:`fp8jax.data.tokens`, with every shard's token count
and SHA-256), ``tokenizer.json`` and the shards only once everything is
written.  Both passes print a progress bar (bytes of the source files).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import numpy as np

from fp8jax.atomic_output import (
    TerminationSignals,
    make_partial_dir,
    publish,
    remove_stale_partials,
)
from fp8jax.data.documents import (
    JSONL_SUFFIXES,
    PIECE_BYTES,
    TOKENS_META,
    documents,
    files_under,
    is_plain_text,
    refuse_token_data,
)
from fp8jax.data.shards import DataError
from fp8jax.progress import Progress

EOT = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.json"
PARTIAL_MARKER = ".fp8jax-prepare.json"
# 256 byte symbols + the end-of-document token: the smallest byte-level BPE.
MIN_VOCAB = 257
#: The largest --vocab accepted: 4x the largest vocabularies in use (about 256k
#: entries); the tokenizer library allocates for the vocabulary asked for, so a
#: larger one fails in an allocation, not in a message.
MAX_VOCAB = 1 << 20
#: The longest pre-token (bytes) the tokenizer trains on and encodes: a longer run
#: of letters, digits, punctuation or spaces is cut into runs of this many bytes.
MAX_WORD_BYTES = 64
DEFAULT_SHARD_TOKENS = 1 << 27
# Documents per encode_batch call: large enough for the tokenizer's threads.
_ENCODE_BATCH = 512


class PrepareTerminated(BaseException):
    """SIGTERM or SIGHUP arrived while preparing (the partial output is removed)."""

    def __init__(self, signum: int):
        super().__init__(f"terminated by signal {signum}")
        self.signum = signum


@dataclass(frozen=True)
class PrepareReport:
    dst: Path
    vocab_size: int
    dtype: str
    documents: int
    train_tokens: int
    val_tokens: int
    shards: int
    seconds: float


def _documents(files: list[Path], field: str, progress: Progress) -> Iterator[str]:
    for path in files:
        size, done = path.stat().st_size, 0
        plain = is_plain_text(path)
        for text in documents(path, field):
            yield text
            if plain:  # pieces of a text file add up to its bytes; shards count when done
                n = len(text.encode("utf-8"))
                done += n
                progress.update(n, path.name)
        if size > done:
            progress.update(size - done, path.name)


def _counted(items: Iterator[str], count: list[int]) -> Iterator[str]:
    """``items``, counting them in ``count[0]``."""
    for item in items:
        count[0] += 1
        yield item


def _then(items: Iterator[str], done: Callable[[], object]) -> Iterator[str]:
    """``items``, then a call of ``done`` once they are exhausted."""
    yield from items
    done()


def pre_tokenizer():
    """GPT-2's byte-level pre-tokenization, then every piece cut into runs of at most
    ``MAX_WORD_BYTES`` bytes.

    BPE training time grows with the square of a word's length: one 256 KB
    "word" (a line of letters, a run of spaces) took 45 s where 64 KB took 3 s.
    With words bounded it grows linearly with the text.  Pieces of at most
    that length pass unchanged, so ordinary text is pre-tokenized as before.
    """
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.ByteLevel(add_prefix_space=False),
            # After the byte-level mapping one character is one byte; "(?m)" lets "."
            # match every character (Oniguruma's dot-all).
            pre_tokenizers.Split(Regex(f"(?m).{{1,{MAX_WORD_BYTES}}}"), behavior="isolated"),
        ]
    )


def train_tokenizer(texts: Iterator[str], vocab: int):
    """A byte-level BPE ``tokenizers.Tokenizer`` of at most ``vocab`` entries, EOT included."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    # Byte-level: every byte string has an encoding, so no unknown token exists.
    tok.pre_tokenizer = pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def load_tokenizer(path: str | Path):
    """A saved ``tokenizer.json`` that knows the end-of-document token (DataError if not)."""
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises its own Exception subclass
        raise DataError(f"tokenizer {path} is unreadable ({str(e)[:80]})") from None
    if tok.token_to_id(EOT) is None:
        raise DataError(f"tokenizer {path} has no {EOT!r} token to end documents with")
    return tok


class _ShardWriter:
    """Writes one split's shards, rolling over at document boundaries."""

    def __init__(self, root: Path, split: str, dtype: np.dtype, shard_tokens: int):
        self.root, self.split, self.dtype, self.shard_tokens = root, split, dtype, shard_tokens
        self.shards: list[dict] = []
        self._f = None

    def _open(self) -> None:
        name = f"{self.split}-{len(self.shards):05d}.bin"
        self._f = open(self.root / name, "wb")
        self.shards.append({"split": self.split, "path": name, "n_tokens": 0})

    def write(self, ids: list[int]) -> None:
        if self._f is None or self.shards[-1]["n_tokens"] >= self.shard_tokens:
            self.close()
            self._open()
        self._f.write(np.asarray(ids, self.dtype).tobytes())
        self.shards[-1]["n_tokens"] += len(ids)

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None

    def finish(self) -> list[dict]:
        """Close, fold a short last shard into the one before, and record sizes and hashes."""
        self.close()
        if len(self.shards) > 1 and self.shards[-1]["n_tokens"] < self.shard_tokens // 2:
            last, prev = self.shards.pop(), self.shards[-1]
            with (
                open(self.root / prev["path"], "ab") as dst,
                open(self.root / last["path"], "rb") as src,
            ):
                shutil.copyfileobj(src, dst)
            os.unlink(self.root / last["path"])
            prev["n_tokens"] += last["n_tokens"]
        for s in self.shards:
            s["dtype"] = self.dtype.name
            s["sha256"] = _sha256(self.root / s["path"])
        return self.shards


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while blob := f.read(1 << 24):
            h.update(blob)
    return h.hexdigest()


def _is_val(k: int, frac: float) -> bool:
    return math.floor((k + 1) * frac) > math.floor(k * frac)


def _check_paths(src: Path, dst: Path) -> None:
    if not src.exists():
        raise DataError(f"source {src} does not exist")
    refuse_token_data(src)
    if dst == src or dst.is_relative_to(src):
        raise DataError(f"destination {dst} is inside the source {src}; choose one outside it")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise DataError(f"destination {dst} exists and is not an empty directory")
    if not dst.parent.is_dir():
        raise DataError(f"parent of the destination, {dst.parent}, does not exist")


def _no_text(src: Path, files: list[Path]) -> str:
    return (
        f"{src} holds no text: its {len(files)} file(s) give no document (empty files?); "
        "give a file or folder with text"
    )


def check_split(n_docs: int, val_fraction: float, src: Path, files: list[Path]) -> None:
    """DataError unless ``n_docs`` documents give both splits at ``val_fraction``.

    Validation gets floor(n_docs * val_fraction) documents (see the module
    docstring) and training the rest, so the least that works is the
    smallest n with n * val_fraction >= 1.
    """
    if not n_docs:
        raise DataError(_no_text(src, files))
    if math.floor(n_docs * val_fraction) >= 1:
        return
    need = math.ceil(1 / val_fraction)
    while math.floor(need * val_fraction) < 1:
        need += 1
    given = (
        f"{src} gives {n_docs} document(s) (a plain text file gives one per "
        f"{PIECE_BYTES // 1024} KiB of its lines)"
    )
    if n_docs == 1:
        raise DataError(
            f"{given}: one document cannot be split into training and validation; give more text"
        )
    raise DataError(
        f"{given}, and --val-fraction {val_fraction} holds one back for validation only from "
        f"{need} documents on: give more text, or --val-fraction {1 / n_docs:.3g} or more"
    )


def check_vocab_against_corpus(vocab: int, files: list[Path], total: int, src: Path) -> None:
    """DataError when the text under ``src`` cannot give ``vocab`` entries.

    Each merge joins two adjacent symbols of some word, so a text of B bytes
    gives at most B merges.  The bound is exact for plain text and JSONL (the
    text is no longer than the file); Parquet and ArrayRecord files may be
    compressed, so only their count of files is checked there.
    """
    if all(is_plain_text(f) or f.name.lower().endswith(JSONL_SUFFIXES) for f in files):
        if vocab - MIN_VOCAB > total:
            raise DataError(
                f"--vocab {vocab} needs {vocab - MIN_VOCAB:,} merges, more than the {total:,} "
                f"bytes of text under {src} can give (at most one per byte): use --vocab "
                f"{MIN_VOCAB + total} or less, or give more text"
            )


def prepare(
    src: str | Path,
    dst: str | Path,
    vocab: int | None = None,
    tokenizer: str | Path | None = None,
    *,
    val_fraction: float = 0.05,
    field: str = "text",
    suffixes: tuple[str, ...] | None = None,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    progress_stream: TextIO | None = None,
    quiet: bool = False,
    warn: Callable[[str], None] | None = None,
) -> PrepareReport:
    """Tokenize ``src`` into a new token directory ``dst`` (see the module docstring).

    Exactly one of ``vocab`` (train a tokenizer) and ``tokenizer`` (reuse
    one) is given; ``suffixes`` keeps only the files whose names end so.
    Raises DataError (leaving no ``dst``) on bad input, PrepareTerminated on
    SIGTERM / SIGHUP, KeyboardInterrupt on Ctrl-C; the partial output is
    removed in every case.
    """
    if (vocab is None) == (tokenizer is None):
        raise DataError("give either --vocab N (train a tokenizer) or --tokenizer PATH")
    if vocab is not None and vocab < MIN_VOCAB:
        raise DataError(f"--vocab {vocab} is below {MIN_VOCAB} (256 bytes + end-of-document)")
    if vocab is not None and vocab > MAX_VOCAB:
        raise DataError(f"--vocab {vocab} is above the largest accepted, {MAX_VOCAB:,}")
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"--val-fraction must be in (0, 1), got {val_fraction}")
    if shard_tokens < 1:
        raise DataError(f"--shard-tokens must be >= 1, got {shard_tokens}")
    t0 = time.monotonic()
    warn = warn or (lambda msg: print(f"warning: {msg}", file=sys.stderr))
    src_p, dst_p = Path(src).expanduser().resolve(), Path(dst).expanduser().resolve()
    _check_paths(src_p, dst_p)
    files = [f for f in files_under(src_p, suffixes) if f.is_file()]
    if not files:
        only = f" ending in {', '.join(suffixes)}" if suffixes else ""
        raise DataError(f"no files{only} under {src_p}; give a text file or a folder of text")
    total = sum(f.stat().st_size for f in files)
    if not total:
        raise DataError(_no_text(src_p, files))
    if vocab is not None:
        check_vocab_against_corpus(int(vocab), files, total, src_p)
    tok = load_tokenizer(tokenizer) if tokenizer is not None else None
    tmp: Path | None = None
    try:
        with TerminationSignals(PrepareTerminated):
            remove_stale_partials(dst_p.parent, PARTIAL_MARKER, "data preparation", warn)
            tmp = make_partial_dir(dst_p, PARTIAL_MARKER, {"src": str(src_p), "dst": str(dst_p)})
            if tok is None:
                bar = Progress(total, "train BPE", progress_stream, quiet=quiet)
                read = [0]

                def text_read() -> None:
                    # Refused before the merges and the second pass, not after them.
                    check_split(read[0], val_fraction, src_p, files)
                    # The merges are computed once the text is read: a silent while otherwise.
                    if not quiet:
                        print(
                            f"train BPE: {read[0]:,} documents read; computing "
                            f"{int(vocab) - MIN_VOCAB:,} merges ...",
                            file=progress_stream or sys.stderr,
                            flush=True,
                        )

                texts = _then(_counted(_documents(files, field, bar), read), text_read)
                tok = train_tokenizer(texts, int(vocab))
            tok.save(str(tmp / TOKENIZER_FILE))
            n_vocab = tok.get_vocab_size()
            eot = tok.token_to_id(EOT)
            dtype = np.dtype("<u2" if n_vocab <= 1 << 16 else "<u4")
            writers = {s: _ShardWriter(tmp, s, dtype, shard_tokens) for s in ("train", "val")}
            bar = Progress(total, "tokenize", progress_stream, quiet=quiet)
            n_docs = 0
            batch: list[str] = []

            def flush() -> None:
                nonlocal n_docs
                for enc in tok.encode_batch(batch):
                    split = "val" if _is_val(n_docs, val_fraction) else "train"
                    writers[split].write([*enc.ids, eot])
                    n_docs += 1
                batch.clear()

            for text in _documents(files, field, bar):
                batch.append(text)
                if len(batch) >= _ENCODE_BATCH:
                    flush()
            flush()
            shards = [s for w in writers.values() for s in w.finish()]
            counts = {
                s: sum(x["n_tokens"] for x in shards if x["split"] == s) for s in ("train", "val")
            }
            check_split(n_docs, val_fraction, src_p, files)
            meta = {
                "format": "fp8jax-tokens",
                "version": 1,
                "vocab_size": n_vocab,
                "dtype": dtype.name,
                "eot_id": eot,
                "tokenizer": TOKENIZER_FILE,
                "source": {"path": str(src_p), "files": len(files), "bytes": total},
                "documents": n_docs,
                "val_fraction": val_fraction,
                "shards": shards,
            }
            (tmp / TOKENS_META).write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
            publish(tmp, dst_p, PARTIAL_MARKER)
            tmp = None
    except OSError as e:
        raise DataError(f"I/O error while preparing {dst_p}: {e}") from None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return PrepareReport(
        dst_p,
        n_vocab,
        dtype.name,
        n_docs,
        counts["train"],
        counts["val"],
        len(shards),
        time.monotonic() - t0,
    )
