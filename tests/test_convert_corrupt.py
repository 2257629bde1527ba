"""One test per kind of corrupt input: a clear error, and no output that looks complete."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from test_convert_helpers import (
    E4M3,
    FP8_WEIGHTS,
    ref_deepseek_dequant,
    write_fp8_checkpoint,
    write_index,
)

from fp8jax.toolkit import convert

WEIGHT = FP8_WEIGHTS[1][0]  # model.layers.0.mlp.down_proj.weight, (130, 257)
SCALE = WEIGHT + "_scale_inv"


def _index(root: Path) -> dict:
    return json.loads((root / "model.safetensors.index.json").read_text())


def _rewrite(root: Path, name: str, new: np.ndarray | None) -> None:
    """Replace (or with None, drop) one tensor in its shard, keeping the index in step."""
    idx = _index(root)
    shard = idx["weight_map"][name]
    part = convert.load_file(root / shard)
    if new is None:
        del part[name]
        del idx["weight_map"][name]
        write_index(root, idx["weight_map"])
    else:
        part[name] = new
    convert.save_file(root / shard, part)


def _fails(tmp_path: Path, src: Path, match: str, direction: str = "fp8-to-bf16") -> None:
    dst = tmp_path / "out"
    with pytest.raises(convert.ConversionError, match=match):
        convert.convert_checkpoint(direction, src, dst, quiet=True)
    # No output at all: neither the destination nor a leftover temporary directory.
    assert not dst.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


@pytest.fixture
def src(tmp_path):
    root = tmp_path / "src"
    write_fp8_checkpoint(root)
    return root


def test_missing_scale_tensor(tmp_path, src):
    _rewrite(src, SCALE, None)
    _fails(tmp_path, src, r"missing scale tensor '.*down_proj\.weight_scale_inv'")


def test_wrong_scale_shape(tmp_path, src):
    _rewrite(src, SCALE, np.ones((1, 2), np.float32))  # (130, 257) needs (2, 3)
    _fails(tmp_path, src, r"is a \[1, 2\] grid over \[130, 257\] \(blocks of 256x256\), but")


def test_truncated_shard(tmp_path, src):
    shard = src / _index(src)["weight_map"][WEIGHT]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    _fails(tmp_path, src, r"truncated shard")


def test_unreadable_shard_garbage_header(tmp_path, src):
    shard = src / _index(src)["weight_map"][WEIGHT]
    data = bytearray(shard.read_bytes())
    data[8:40] = b"\x00garbage, not json at all!!\xff\xfe\x01"
    shard.write_bytes(bytes(data))
    _fails(tmp_path, src, r"unreadable shard .*header is not UTF-8")


def test_unreadable_shard_text_header(tmp_path, src):
    shard = src / _index(src)["weight_map"][WEIGHT]
    data = bytearray(shard.read_bytes())
    data[8:40] = b"garbage, not json at all!!! {}[]"
    shard.write_bytes(bytes(data))
    _fails(tmp_path, src, r"unreadable shard .*not valid JSON")


def test_unreadable_shard_not_safetensors(tmp_path, src):
    shard = src / _index(src)["weight_map"][WEIGHT]
    shard.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4)
    _fails(tmp_path, src, r"unreadable shard .*header length")


@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_non_finite_scale(tmp_path, src, bad):
    s = np.ones((2, 3), np.float32)
    s[1, 2] = bad
    _rewrite(src, SCALE, s)
    _fails(tmp_path, src, r"non-finite scale: '.*down_proj\.weight_scale_inv' holds 1")


def test_index_names_missing_file(tmp_path, src):
    idx = _index(src)
    idx["weight_map"][WEIGHT] = "model-00009-of-00003.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps(idx))
    _fails(tmp_path, src, r"names a missing file: model-00009-of-00003\.safetensors")


def test_failure_mid_run_leaves_nothing(tmp_path, src):
    """A NaN in a later shard's weight is found only while converting (bf16-to-fp8),
    after the first shard was written."""
    bf16 = tmp_path / "bf16"
    convert.fp8_to_bf16(src, bf16, quiet=True)
    shutil.rmtree(src)
    bf16.rename(src)
    name = FP8_WEIGHTS[3][0]
    part_shard = _index(src)["weight_map"][name]
    assert part_shard != sorted(set(_index(src)["weight_map"].values()))[0]
    x = np.array([[1.0, 2.0, np.nan, 4.0, 5.0]], dtype=ml_dtypes.bfloat16)
    _rewrite(src, name, x)
    _fails(tmp_path, src, r"non-finite values in '.*gate_proj\.weight'", direction="bf16-to-fp8")


def test_index_disagrees_with_shard(tmp_path, src):
    idx = _index(src)
    del idx["weight_map"][WEIGHT]
    (src / "model.safetensors.index.json").write_text(json.dumps(idx))
    _fails(tmp_path, src, r"which the index puts in None")


def test_header_offsets_inconsistent(tmp_path, src):
    shard = src / _index(src)["weight_map"][WEIGHT]
    data = shard.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header[WEIGHT]["shape"] = [131, 257]
    raw = json.dumps(header).encode()
    shard.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])
    _fails(tmp_path, src, r"needs .* bytes, data_offsets give")


# -- malformed headers: what the reference safetensors library refuses ------------


def _header(shard: Path) -> tuple[dict, bytes]:
    data = shard.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def _put_header(shard: Path, raw: bytes, body: bytes) -> None:
    shard.write_bytes(struct.pack("<Q", len(raw)) + raw + body)


def test_overlapping_offsets(tmp_path, src):
    """One scale pointed at another's bytes (same size): the reference refuses it, and so
    must we, or the converter would write the other tensor's data."""
    shard = src / _index(src)["weight_map"][SCALE]
    header, body = _header(shard)
    other = FP8_WEIGHTS[0][0] + "_scale_inv"  # (3, 2) float32: 24 bytes, like SCALE's (2, 3)
    assert _index(src)["weight_map"][other] == shard.name
    header[SCALE]["data_offsets"] = header[other]["data_offsets"]
    _put_header(shard, json.dumps(header).encode(), body)
    _fails(tmp_path, src, r"unreadable shard .*overlaps the previous tensor")


def test_trailing_bytes(tmp_path, src):
    shard = src / _index(src)["weight_map"][WEIGHT]
    shard.write_bytes(shard.read_bytes() + bytes(16))
    _fails(tmp_path, src, r"unreadable shard .*16 trailing data bytes belong to no tensor")


def test_duplicate_json_key(tmp_path, src):
    shard = src / _index(src)["weight_map"][WEIGHT]
    header, body = _header(shard)
    entry = json.dumps(header[WEIGHT])
    raw = json.dumps(header).encode()[:-1] + f', "{WEIGHT}": {entry}}}'.encode()
    _put_header(shard, raw, body)
    _fails(tmp_path, src, r"unreadable shard .*duplicate key")


def test_bool_in_shape(tmp_path, src):
    name = FP8_WEIGHTS[3][0]  # (1, 5): [true, 5] has the right size if true counted as 1
    shard = src / _index(src)["weight_map"][name]
    header, body = _header(shard)
    header[name]["shape"] = [True, 5]
    _put_header(shard, json.dumps(header).encode(), body)
    _fails(tmp_path, src, r"unreadable shard .*bad shape \[True, 5\]")


def test_deeply_nested_header(tmp_path, src):
    shard = src / _index(src)["weight_map"][WEIGHT]
    header, body = _header(shard)
    raw = json.dumps(header).encode()[:-1] + b', "x": {"y": ' + b"[" * 5000 + b"]" * 5000 + b"}}"
    _put_header(shard, raw, body)
    _fails(tmp_path, src, r"unreadable shard .*JSON nested 500[0-9] levels deep \(at most 127")


def test_deeply_nested_index(tmp_path, src):
    idx = (src / "model.safetensors.index.json").read_text()
    (src / "model.safetensors.index.json").write_text(
        idx[:-1] + ', "extra": ' + "[" * 100_000 + "]" * 100_000 + "}"
    )
    _fails(tmp_path, src, r"unreadable index .*JSON nested 100001 levels deep")


# -- scales and codes ---------------------------------------------------------------


@pytest.mark.parametrize("bad", [0.0, -0.0, -0.5])
def test_non_positive_scale(tmp_path, src, bad):
    s = np.ones((2, 3), np.float32)
    s[0, 1] = bad
    _rewrite(src, SCALE, s)
    _fails(tmp_path, src, r"non-positive scale: '.*down_proj\.weight_scale_inv' holds 1 value")


def test_oversized_scale(tmp_path, src):
    _rewrite(src, SCALE, np.ones((3, 4), np.float32))  # (130, 257) needs (2, 3)
    _fails(tmp_path, src, r"is a \[3, 4\] grid over \[130, 257\] \(no power-of-two block\)")


def test_nan_code_is_named(tmp_path, src):
    w = convert.load_file(src / _index(src)["weight_map"][WEIGHT])[WEIGHT].copy()
    w.view(np.uint8)[3, 4] = 0xFF  # E4M3FN NaN (-NaN)
    w.view(np.uint8)[129, 0] = 0x7F  # +NaN
    _rewrite(src, WEIGHT, w)
    dst = tmp_path / "out"
    with pytest.raises(convert.ConversionError) as e:
        convert.fp8_to_bf16(src, dst, quiet=True)
    msg = str(e.value)
    assert re.search(r"down_proj\.weight' .* holds 2 NaN value\(s\)", msg), msg
    assert "overflows" not in msg and not dst.exists()


def test_bf16_overflow_is_named(tmp_path, src):
    s = np.ones((2, 3), np.float32)
    s[1, 1] = 3e38  # 448 * 3e38 is past BF16's range
    _rewrite(src, SCALE, s)
    _fails(tmp_path, src, r"dequantized '.*down_proj\.weight' overflows BF16")


# -- directories, signals, leftovers ------------------------------------------------


def test_shard_missing_from_index_is_converted_with_a_warning(tmp_path, src):
    rng = np.random.default_rng(4)
    w = rng.integers(0, 0x7E, (3, 130), dtype=np.uint8).view(E4M3)
    s = np.array([[0.5, 0.25]], np.float32)
    convert.save_file(src / "extra.safetensors", {"x.weight": w, "x.weight_scale_inv": s})
    dst = tmp_path / "out"
    seen = []
    rep = convert.fp8_to_bf16(src, dst, quiet=True, warn=seen.append)
    assert len(seen) == 1 and "extra.safetensors is not listed in" in seen[0]
    assert rep.warnings == tuple(seen) and rep.shards == 4
    out = convert.load_file(dst / "extra.safetensors")
    assert list(out) == ["x.weight"]
    np.testing.assert_array_equal(out["x.weight"].astype(np.float64), ref_deepseek_dequant(w, s))
    assert "x.weight" not in _index(dst)["weight_map"]


def test_sigterm_removes_partial_output(tmp_path, src):
    class KillOnWrite:
        def write(self, s):
            os.kill(os.getpid(), signal.SIGTERM)

        def flush(self):
            pass

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(convert.ConversionTerminated) as e:
        convert.fp8_to_bf16(src, tmp_path / "out", progress_stream=KillOnWrite())
    assert e.value.signum == signal.SIGTERM
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    assert signal.getsignal(signal.SIGTERM) is before  # handler restored


def _fake_partial(parent: Path, name: str, pid: int | None) -> Path:
    d = parent / name
    (d / "sub").mkdir(parents=True)
    (d / "sub" / "big.safetensors").write_bytes(bytes(1000))
    if pid is not None:
        marker = {"pid": pid, "host": socket.gethostname()}
        (d / ".fp8jax-convert.json").write_text(json.dumps(marker))
    return d


def test_stale_partials_of_dead_processes_are_removed(tmp_path, src):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    stale = _fake_partial(tmp_path, ".old.partial-1234-abcd", int(dead.stdout))
    live = _fake_partial(tmp_path, ".other.partial-99-beef", os.getppid())
    foreign = _fake_partial(tmp_path, ".mine.partial-xyz", None)  # no marker: not ours
    seen = []
    convert.fp8_to_bf16(src, tmp_path / "out", quiet=True, warn=seen.append)
    assert not stale.exists() and live.exists() and foreign.exists()
    assert len(seen) == 1 and "partial output of an earlier conversion" in seen[0]


def test_output_inside_input_refused(tmp_path, src):
    for dst in (src / "out", src / "a" / "b", src):
        with pytest.raises(convert.ConversionError, match="inside the source"):
            convert.fp8_to_bf16(src, dst, quiet=True)
    assert not (src / "out").exists() and not any(p.name.startswith(".") for p in src.iterdir())


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_output_directory_honours_umask(tmp_path, src, umask):
    old = os.umask(umask)
    try:
        convert.fp8_to_bf16(src, tmp_path / "out", quiet=True)
    finally:
        os.umask(old)
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o777 & ~umask
    shard = next((tmp_path / "out").glob("*.safetensors"))
    assert shard.stat().st_mode & 0o777 == 0o666 & ~umask


def test_already_bf16_checkpoint_is_reported(tmp_path, src):
    bf16 = tmp_path / "bf16"
    convert.fp8_to_bf16(src, bf16, quiet=True)
    shutil.rmtree(src)
    bf16.rename(src)
    _fails(tmp_path, src, r"no FP8 tensor in .*BF16 x 8.*already is a high-precision checkpoint")


def test_bad_keep_pattern(tmp_path, src):
    bf16 = tmp_path / "bf16"
    convert.fp8_to_bf16(src, bf16, quiet=True)
    shutil.rmtree(src)
    bf16.rename(src)
    dst = tmp_path / "out"
    with pytest.raises(convert.ConversionError, match=r"keep pattern '\[' is not a regular"):
        convert.bf16_to_fp8(src, dst, keep=["["], quiet=True)
    assert not dst.exists()


# -- hostile sources: links, special files, absurd shapes, files changing mid-run ------


class _Hung(BaseException):
    """Raised by the watchdog: the conversion blocked or looped (a BaseException, so that
    the converter's own error handling cannot turn it into a ConversionError)."""


@contextlib.contextmanager
def _watchdog(seconds: int = 60):
    """Turn a hang (a FIFO's open, a 2^40-iteration loop) into a test failure."""

    def hung(signum, frame):
        raise _Hung(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _fails_fast(tmp_path: Path, src: Path, match: str, keep: tuple[str, ...] = ()) -> None:
    made = sorted(p.name for p in tmp_path.iterdir())
    with _watchdog():
        with pytest.raises(convert.ConversionError, match=match) as e:
            convert.convert_checkpoint("fp8-to-bf16", src, tmp_path / "out", quiet=True)
    assert "\n" not in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == made  # nothing written


def test_directory_symlink_loop_is_refused(tmp_path, src):
    (src / "extra").mkdir()
    (src / "extra" / "notes.txt").write_text("x")
    (src / "extra" / "up").symlink_to("..", target_is_directory=True)
    _fails_fast(tmp_path, src, r"extra/up is a symlink to .*reaches another way .*loop")


def test_mutual_directory_symlinks_are_refused(tmp_path, src):
    (src / "a").mkdir()
    (src / "b").mkdir()
    (src / "a" / "to_b").symlink_to("../b", target_is_directory=True)
    (src / "b" / "to_a").symlink_to("../a", target_is_directory=True)
    _fails_fast(tmp_path, src, r"symlink to .*reaches another way")


def test_self_symlink_is_refused(tmp_path, src):
    (src / "itself").symlink_to("itself")
    _fails_fast(tmp_path, src, r"itself is a symlink that loops or leads nowhere")


def test_directory_symlink_leaving_the_source_is_refused(tmp_path, src):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "big.bin").write_bytes(bytes(1000))
    (src / "data").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    _fails_fast(tmp_path, src, r"data is a symlink to the directory .*outside the source")


def test_file_symlinks_are_copied_as_files(tmp_path, src):
    # A Hugging Face cache snapshot: every file is a link into a blob directory.
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    for p in sorted(src.iterdir()):
        p.rename(blobs / p.name)
        p.symlink_to(blobs / p.name)
    (blobs / "tok.json").write_text('{"a": 1}')
    (src / "sub").mkdir()
    (src / "sub" / "tokenizer.json").symlink_to(blobs / "tok.json")
    (src / "same").symlink_to("sub", target_is_directory=True)
    with pytest.raises(convert.ConversionError, match="reaches another way"):
        convert.fp8_to_bf16(src, tmp_path / "out", quiet=True)
    (src / "same").unlink()
    convert.fp8_to_bf16(src, tmp_path / "out", quiet=True)
    out = tmp_path / "out" / "sub" / "tokenizer.json"
    assert not out.is_symlink() and out.read_text() == '{"a": 1}'
    assert not (tmp_path / "out" / "config.json").is_symlink()


@pytest.mark.parametrize(
    "name", ["model-00004-of-00003.safetensors", "config.json", "extra/pipe.bin"]
)
def test_fifo_is_refused_without_blocking(tmp_path, src, name):
    (src / "extra").mkdir()
    if name == "config.json":
        (src / name).unlink()
    os.mkfifo(src / name)
    _fails_fast(tmp_path, src, r"is a FIFO, not a regular file")


def test_index_linked_to_a_device_is_refused(tmp_path, src):
    if not Path("/dev/zero").exists():
        pytest.skip("no /dev/zero")
    index = src / "model.safetensors.index.json"
    index.unlink()
    index.symlink_to("/dev/zero")
    _fails_fast(tmp_path, src, r"index .* is a character device, not a regular file")


def test_shard_linked_to_a_device_is_refused(tmp_path, src):
    if not Path("/dev/zero").exists():
        pytest.skip("no /dev/zero")
    shard = src / _index(src)["weight_map"][WEIGHT]
    shard.unlink()
    shard.symlink_to("/dev/zero")
    _fails_fast(tmp_path, src, r"is a character device, not a regular file")


def test_absurd_empty_shape_is_refused_before_looping(tmp_path, src):
    # Shape [2^62, 0]: zero bytes, so the header is consistent, but no BF16
    # array of that shape can exist, and its rows alone would make 2^40 chunks.
    name = "model.layers.0.mlp.empty.weight"
    convert.save_file(
        src / "extra.safetensors",
        {name: np.zeros((2**62, 0), E4M3), name + "_scale_inv": np.zeros((2**55, 0), np.float32)},
    )
    idx = _index(src)
    idx["weight_map"].update({name: "extra.safetensors", name + "_scale_inv": "extra.safetensors"})
    write_index(src, idx["weight_map"])
    _fails_fast(tmp_path, src, r"has shape \[4611686018427387904, 0\]: as BF16 it is beyond")


def test_header_shape_numpy_cannot_hold_is_unreadable(tmp_path):
    p = tmp_path / "x.safetensors"
    hdr = json.dumps({"a": {"dtype": "F32", "shape": [2**62, 0], "data_offsets": [0, 0]}}).encode()
    p.write_bytes(struct.pack("<Q", len(hdr)) + hdr)
    with pytest.raises(convert.SafetensorsError, match="beyond what an array can hold"):
        convert.SafetensorsFile(p)


def _cut_when_progress_starts(victim: Path, how: str):
    """A progress stream that changes ``victim`` when the conversion reports its first chunk."""

    class Cut:
        done = False

        def write(self, s):
            if not self.done:
                self.done = True
                if how == "truncate":
                    os.truncate(victim, victim.stat().st_size // 2)
                else:  # same size, other bytes
                    with open(victim, "r+b") as f:
                        f.seek(-64, os.SEEK_END)
                        f.write(bytes(64))

        def flush(self):
            pass

    return Cut()


def test_shard_changed_in_place_during_the_run_is_one_line(tmp_path, src):
    victim = src / "model-00003-of-00003.safetensors"
    # An old timestamp, so that the in-place write below changes it on any filesystem.
    os.utime(victim, (1e9, 1e9))
    with pytest.raises(convert.ConversionError, match=r"changed while being read") as e:
        convert.fp8_to_bf16(
            src, tmp_path / "out", progress_stream=_cut_when_progress_starts(victim, "overwrite")
        )
    assert "\n" not in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_shard_truncated_during_the_run_is_one_line_not_sigbus(tmp_path, src):
    # In a child process: a memory-mapped reader dies of SIGBUS here, which
    # would take the test runner with it.
    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "import test_convert_corrupt as t\n"
        "from fp8jax.toolkit import convert\n"
        "src, dst = Path(sys.argv[1]), Path(sys.argv[2])\n"
        "cut = t._cut_when_progress_starts(src / 'model-00003-of-00003.safetensors', 'truncate')\n"
        "try:\n"
        "    convert.fp8_to_bf16(src, dst, progress_stream=cut)\n"
        "except convert.ConversionError as e:\n"
        "    sys.exit(f'error: {e}')\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), *sys.path]))
    r = subprocess.run(
        [sys.executable, "-c", script, str(src), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    assert re.fullmatch(r"error: shard .*changed while being read.*\n", r.stderr), r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_cli_hostile_source_is_one_line_exit_2(tmp_path, src, capsys):
    from fp8jax.toolkit import cli

    (src / "config.json").unlink()
    os.mkfifo(src / "config.json")
    with _watchdog():
        rc = cli.main(["convert", "fp8-to-bf16", str(src), str(tmp_path / "out"), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2
    assert re.fullmatch(r"fp8jax convert: error: .*config\.json is a FIFO.*\n", err), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
