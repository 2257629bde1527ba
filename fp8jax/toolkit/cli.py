"""The ``fp8jax`` console script.

    fp8jax --version
    fp8jax formats                      number formats (bits, range, eps, ...) and group formats
    fp8jax gpus [--sources | --formats] accelerator table, or native support per format
    fp8jax plan --model deepseek-r1 --gpu h800 [--weights auto|fp8|int8|int4|fp4|...]
    fp8jax plan --model deepseek-r1 --compare [--sort decode] [--json]
    fp8jax convert fp8-to-bf16 SRC DST  (or bf16-to-fp8)
    fp8jax quant-error FILE [--tensor NAME]
    fp8jax numerics                     floating-point losses and their remedies
    fp8jax data prepare SRC DST --vocab N   text -> BPE tokenizer -> token shards for training
    fp8jax data info DIR                check a token directory and print what it holds
    fp8jax runs plot DIR... [--out FILE] [--keys loss,val_loss]   several runs' curves
    fp8jax parity --workdir RUN --recipes bf16,deepseek_v3 [--file TEXT] [--out DIR]
                                        per-token logprob gap of one checkpoint under two recipes

Every subcommand prints plain text (``--json`` for machine-readable output
where it makes sense).  Errors go to stderr as one line: exit status 2 for a
usage mistake (unknown option, a number out of range, NaN or Inf), 1 for an
error while running.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from importlib import metadata


class UsageError(ValueError):
    """A mistake in the command line (exit status 2)."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: "fp8jax plan: error: ..." and exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _number(kind: type, lo: float, lo_open: bool, hi: float | None = None) -> Callable:
    """An argparse type: a finite ``kind`` in (lo, hi) / [lo, hi); one-line message otherwise."""
    rng = f"{'>' if lo_open else '>='} {lo:g}" + (f" and < {hi:g}" if hi is not None else "")

    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not {'an integer' if kind is int else 'a number'}"
            ) from None
        bad_lo = v <= lo if lo_open else v < lo
        # Integers are finite (and may be too large for a float to test).
        finite = kind is int or math.isfinite(v)
        if not finite or bad_lo or (hi is not None and v >= hi):
            what = "an integer" if kind is int else "a finite number"
            raise argparse.ArgumentTypeError(f"{text!r} must be {what} {rng}")
        return v

    parse.__name__ = kind.__name__
    return parse


_POSITIVE = _number(float, 0.0, True)
_POSITIVE_INT = _number(int, 0, True)
_NONNEG_INT = _number(int, 0, False)
_OVERHEAD = _number(float, 0.0, False, 10.0)


def _version() -> str:
    try:
        return metadata.version("fp8jax")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def _dump(obj) -> str:
    # inf/nan are not JSON: write them as strings.
    def fix(v):
        if isinstance(v, float) and not math.isfinite(v):
            return str(v)
        if isinstance(v, dict):
            return {k: fix(x) for k, x in v.items()}
        if isinstance(v, list | tuple):
            return [fix(x) for x in v]
        return v

    return json.dumps(fix(obj), indent=2)


def _cmd_formats(args) -> int:
    from fp8jax.toolkit import catalog

    if args.json:
        print(
            _dump(
                {
                    "formats": [r.asdict() for r in catalog.catalog()],
                    "group_formats": [g.asdict() for g in catalog.group_formats()],
                }
            )
        )
    else:
        print(catalog.format_table())
        print()
        print(catalog.group_table())
    return 0


def _cmd_gpus(args) -> int:
    from dataclasses import asdict

    from fp8jax.toolkit import hardware

    if args.sources and args.formats:
        raise UsageError("give --sources or --formats, not both")
    if args.json:
        print(_dump([asdict(a) | {"fp8_native": a.fp8_native} for a in hardware.accelerators()]))
    elif args.formats:
        print(hardware.format_matrix())
    else:
        print(hardware.format_table(sources=args.sources))
    return 0


def _model_from_args(args):
    from fp8jax.toolkit import planner

    custom = [args.params, args.active, args.layers, args.kv_per_layer]
    if args.model and any(v is not None for v in custom):
        raise UsageError(
            "give either --model or --params/--active/--layers/--kv-per-layer, not both"
        )
    if args.model:
        try:
            return planner.get_model(args.model)
        except ValueError as e:
            raise UsageError(str(e)) from None
    if args.params is None:
        raise UsageError(f"give --model (one of {sorted(planner.MODELS)}) or --params")
    if args.active is not None and args.active > args.params:
        raise UsageError(f"--active {args.active:g} exceeds --params {args.params:g}")
    try:
        return planner.ModelSpec(
            name=args.name,
            total_params=args.params,
            active_params=args.active if args.active is not None else args.params,
            n_layers=args.layers if args.layers is not None else 1,
            kv_elems_per_layer=args.kv_per_layer if args.kv_per_layer is not None else 0,
            kv_kind=f"{args.kv_per_layer or 0} elements per token per layer",
        )
    except ValueError as e:
        raise UsageError(str(e)) from None


def _cmd_plan(args) -> int:
    from fp8jax.toolkit import hardware, planner

    model = _model_from_args(args)
    budget = dict(
        kv_dtype=args.kv_cache,
        context=args.context,
        batch=args.batch,
        overhead=args.overhead,
        node_size=args.node_size,
        memory_gb=args.memory_gb,
        bandwidth_gbs=args.bandwidth,
    )
    if args.compare:
        if args.gpu:
            raise UsageError("give --gpu or --compare, not both")
        try:
            rows = planner.compare(
                model, hardware.accelerators(), weights=args.weights, sort=args.sort, **budget
            )
        except ValueError as e:
            raise UsageError(str(e)) from None
        if args.json:
            print(
                _dump({"model": model.name, "sort": args.sort, "rows": [r.asdict() for r in rows]})
            )
        else:
            print(planner.format_compare(rows, model))
        return 0
    if args.sort != "table":
        raise UsageError("--sort applies to --compare")
    if not args.gpu:
        raise UsageError("give --gpu KEY (see fp8jax gpus) or --compare")
    try:
        accel = hardware.get(args.gpu)
    except ValueError as e:
        raise UsageError(str(e)) from None
    try:
        p = planner.plan(model, accel, weights=args.weights, **budget)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.json:
        d = {
            k: getattr(p, k)
            for k in p.__dataclass_fields__
            if k not in ("model", "accel", "weights", "notes")
        }
        d.update(
            model=model.name, accelerator=p.accel.key, weights=p.weights.name, notes=list(p.notes)
        )
        print(_dump(d))
    else:
        print(p.format())
    return 0


def _size(b: float) -> str:
    return f"{b / 1e9:.2f} GB" if b >= 1e9 else f"{b / 1e6:.2f} MB"


def _seconds_since_start() -> float | None:
    """Wall seconds since this process started (Linux /proc; None elsewhere)."""
    import os

    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            # Field 22, start time in clock ticks after boot; fields after the
            # ")" that closes the command name start at field 3.
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        return max(uptime - start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return None


def _cmd_convert(args) -> int:
    from fp8jax.toolkit import convert

    def fail(msg: str, code: int = 2) -> int:
        # One line, argparse style: a user's mistake (bad input, bad path) is no traceback.
        print(f"fp8jax convert: error: {' '.join(str(msg).split())}", file=sys.stderr)
        return code

    try:
        if args.direction == "example":
            root = convert.make_example_checkpoint(args.dst, seed=args.seed)
            files = sorted(p.name for p in root.iterdir())
            size = sum(p.stat().st_size for p in root.iterdir())
            print(f"wrote {root}: {len(files)} files ({', '.join(files)}), {_size(size)}")
            return 0
        keep = getattr(args, "keep", [])
        convert.compile_keep(keep)
        rep = convert.convert_checkpoint(
            args.direction,
            args.src,
            args.dst,
            keep=keep,
            quiet=args.quiet,
            rounding=getattr(args, "rounding", "deepseek"),
            scale_fmt=args.scale_fmt,
            amax_floor=getattr(args, "amax_floor", None),
        )
    except convert.ConversionTerminated as e:
        print(f"fp8jax convert: {e}; partial output removed", file=sys.stderr)
        return 128 + e.signum
    except (convert.ConversionError, ValueError, OSError) as e:
        return fail(e)
    rounding = f", {rep.rounding} rounding" if rep.rounding else ""
    if rep.layout_name:
        print(f"read {rep.layout_name}")
    elif rep.scale_fmt == "ue8m0":
        rounding = ", power-of-two (ue8m0) scales"
    if rep.amax_floor:
        rounding += f", amax floored at {rep.amax_floor:g}"
    # The conversion's own time, and the whole command's (Python and JAX start-up included).
    total = _seconds_since_start()
    whole = f" ({total:.2f} s since the command started)" if total is not None else ""
    print(
        f"converted {rep.converted} of {rep.tensors_in} tensors in {rep.shards} shard(s){rounding}: "
        f"{_size(rep.bytes_in)} -> {_size(rep.bytes_out)}, {rep.tensors_out} tensors, "
        f"written to {rep.dst} in {rep.seconds:.2f} s{whole}"
    )
    return 0


def _cmd_quant_error(args) -> int:
    def fail(msg: str) -> int:
        print(f"fp8jax quant-error: error: {' '.join(str(msg).split())}", file=sys.stderr)
        return 2

    if args.tokens < 1:
        return fail(f"--tokens must be >= 1, got {args.tokens}")
    from fp8jax.toolkit import quant_error as qe

    try:
        x64, desc = qe.load_tensor(args.path, args.tensor)
        qe.check_axis(args.axis, x64.ndim)
        if not args.no_gemm and x64.ndim == 2:
            qe.check_gemm_fits(x64.shape, args.tokens)
    except (ValueError, OSError) as e:
        return fail(e)
    rows = qe.quant_error_report(x64, axis=args.axis, gemm=not args.no_gemm, tokens=args.tokens)
    if args.json:
        print(_dump({"tensor": desc, "rows": qe.rows_as_dicts(rows)}))
    else:
        print(qe.format_report(rows, f"tensor {desc}, contraction axis {args.axis}"), end="")
    return 0


def _cmd_numerics(args) -> int:
    from fp8jax import numerics

    print(numerics.format_demos(), end="")
    return 0


def _cmd_data(args) -> int:
    from fp8jax.data import DataError, load_tokens
    from fp8jax.data import prepare as prep

    def fail(msg: str) -> int:
        print(f"fp8jax data {args.action}: error: {' '.join(str(msg).split())}", file=sys.stderr)
        return 2

    try:
        if args.action == "info":
            print(_dump(load_tokens(args.dir).summary()))
            return 0
        rep = prep.prepare(
            args.src,
            args.dst,
            vocab=args.vocab,
            tokenizer=args.tokenizer,
            val_fraction=args.val_fraction,
            field=args.field,
            suffixes=tuple(args.suffix) or None,
            shard_tokens=args.shard_tokens,
            quiet=args.quiet,
        )
    except prep.PrepareTerminated as e:
        print(f"fp8jax data prepare: {e}; partial output removed", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:
        print("fp8jax data prepare: interrupted; partial output removed", file=sys.stderr)
        return 130
    except (DataError, OSError) as e:
        return fail(e)
    print(
        f"wrote {rep.dst}: vocabulary {rep.vocab_size} ({rep.dtype}), {rep.documents} documents, "
        f"{rep.train_tokens:,} train + {rep.val_tokens:,} validation tokens in {rep.shards} "
        f"shard(s), {rep.seconds:.1f} s; train on it with --config.data.source=tokens "
        f"--config.data.path={rep.dst}"
    )
    return 0


def _cmd_runs(args) -> int:
    from fp8jax.lab.plot_runs import plot_runs
    from fp8jax.train.defaults import ConfigError

    keys = tuple(k for k in args.keys.split(",") if k)
    if not keys:
        raise UsageError("--keys names no metric")

    def note(line: str) -> None:
        print(f"fp8jax runs plot: {line}", file=sys.stderr)

    try:
        out = plot_runs(args.dirs, args.out, keys, say=note)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    print(f"wrote {out}: {', '.join(keys)} of {len(args.dirs)} path(s)")
    return 0


def _cmd_parity(args) -> int:
    import os

    from fp8jax.toolkit import parity
    from fp8jax.train import provenance
    from fp8jax.train.checkpoint import CheckpointError
    from fp8jax.train.defaults import ConfigError

    def fail(msg: str, code: int = 2) -> int:
        print(f"fp8jax parity: error: {' '.join(str(msg).split())}", file=sys.stderr)
        return code

    def say(line: str) -> None:
        print(f"fp8jax parity: {line}", file=sys.stderr, flush=True)

    if (args.workdir is None) == (args.example is None):
        return fail("give --workdir RUN (a run trained here) or --example llama, one of them")
    names = args.recipes.split(",")
    # Recorded before anything runs: the code that ran is the code at the start.
    prov = {"git": provenance.git_state(), "machine": provenance.machine()}
    try:
        parity.check_recipes(names)
        if args.workdir is not None:
            say(f"restoring {args.workdir} ...")
            fns, batches, info = parity.from_workdir(
                args.workdir,
                names,
                path=args.file,
                step=args.step,
                batch_size=args.batch_size,
                max_windows=args.max_windows,
                say=say,
            )
        else:
            if args.step is not None:
                return fail("--step applies to --workdir")
            say("quantizing the example through the Qwix provider ...")
            fns, batches, info = parity.from_qwix_example(
                names,
                path=args.file,
                seed=args.seed,
                seq_len=args.seq_len,
                batch_size=args.batch_size,
                max_windows=args.max_windows,
            )
        n = batches.shape[0] * batches.shape[1]
        say(f"{n} windows of {batches.shape[2]} from {info['source']}; compiling and scoring ...")
        results = parity.measure(fns, batches, names, source=info["source"], quiet=args.quiet)
    except (parity.ParityError, ConfigError) as e:
        return fail(e)
    except CheckpointError as e:
        return fail(e, 1)
    results["model"] = info
    results["command"] = "fp8jax " + " ".join(args.argv)
    results["provenance"] = prov
    if args.out:
        results = parity.save(results, args.out)
        say(f"wrote {os.path.join(args.out, 'results.json')} and parity.png")
    if args.json:
        print(_dump(results))
    else:
        print(parity.table(results))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(
        prog="fp8jax",
        description="Precision and hardware toolkit: formats, accelerators, deployment plans, "
        "FP8 <-> BF16 checkpoint conversion, quantization error.",
    )
    ap.add_argument("--version", action="version", version=f"fp8jax {_version()}")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    p = sub.add_parser("formats", help="number formats: bits, range, precision")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_formats)

    p = sub.add_parser("gpus", help="accelerator table (dense TFLOP/s, memory, bandwidth)")
    p.add_argument("--sources", action="store_true", help="print each row's source and note")
    p.add_argument(
        "--formats", action="store_true", help="native support per format (FP64 ... FP4, INT8/4)"
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_gpus)

    from fp8jax.toolkit.planner import KV_BYTES, SORT_KEYS, WEIGHT_FORMATS

    p = sub.add_parser("plan", help="memory, cards, nodes and decode bound of a deployment")
    p.add_argument(
        "--model",
        help="named config: deepseek-v3, deepseek-r1, deepseek-v4-{flash,pro}, deepseek-v4.1-flash, llama-3.1-{8b,70b,405b}",
    )
    p.add_argument("--params", type=_POSITIVE, help="custom model: total parameters (e.g. 70e9)")
    p.add_argument("--active", type=_POSITIVE, help="custom model: active parameters per token")
    p.add_argument("--layers", type=_POSITIVE_INT, help="custom model: layers")
    p.add_argument(
        "--kv-per-layer", type=_NONNEG_INT, help="custom model: KV elements per token per layer"
    )
    p.add_argument("--name", default="custom model")
    p.add_argument("--gpu", help="accelerator key or name (fp8jax gpus)")
    p.add_argument(
        "--compare", action="store_true", help="plan on every card of the table, side by side"
    )
    p.add_argument(
        "--sort",
        default="table",
        choices=sorted(SORT_KEYS),
        help="--compare order: table (default), name, cards, nodes, memory, decode, batch",
    )
    p.add_argument(
        "--weights",
        default="auto",
        choices=["auto", *WEIGHT_FORMATS],
        help="auto (FP8 if native, else BF16), " + ", ".join(WEIGHT_FORMATS),
    )
    p.add_argument(
        "--kv-cache", default="bf16", choices=sorted(KV_BYTES), help="KV cache precision"
    )
    p.add_argument(
        "--context", type=_POSITIVE_INT, default=32768, help="tokens per sequence (default 32768)"
    )
    p.add_argument(
        "--batch", type=_POSITIVE_INT, default=32, help="concurrent sequences (default 32)"
    )
    p.add_argument(
        "--overhead", type=_OVERHEAD, default=0.10, help="fraction of weights + KV (default 0.10)"
    )
    p.add_argument("--node-size", type=_POSITIVE_INT, default=8, help="cards per node (default 8)")
    p.add_argument("--memory-gb", type=_POSITIVE, help="override the card's memory, GB")
    p.add_argument("--bandwidth", type=_POSITIVE, help="override the card's bandwidth, GB/s")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_plan)

    p = sub.add_parser(
        "convert",
        help="convert a checkpoint between FP8 / FP4 (DeepSeek-V3, V3.1, V4 layouts) and BF16",
    )
    conv = p.add_subparsers(dest="direction", required=True, metavar="DIRECTION")
    for direction, help_ in (
        (
            "fp8-to-bf16",
            "dequantize FP8 / packed FP4 weights (with their _scale_inv or .scale) to BF16",
        ),
        ("bf16-to-fp8", "quantize 2-D weights to E4M3 with 128x128 block scales"),
    ):
        q = conv.add_parser(direction, help=help_)
        q.add_argument("src", help="source checkpoint directory")
        q.add_argument("dst", help="new output directory (must not exist, or be empty)")
        if direction == "fp8-to-bf16":
            q.add_argument(
                "--rounding",
                choices=["deepseek", "exact"],
                default="deepseek",
                help="deepseek (default): float32 product rounded to BF16, bit for bit what "
                "DeepSeek's fp8_cast_bf16.py writes; exact: the exact product rounded once",
            )
            q.add_argument(
                "--scale-fmt",
                choices=["auto", "float32", "ue8m0"],
                default="auto",
                help="auto (default): as config.json's quantization_config.scale_fmt says "
                "(ue8m0: float scales must be powers of two); float32: read float scales as "
                "they are; ue8m0: require powers of two",
            )
        else:
            q.add_argument(
                "--keep",
                action="append",
                default=[],
                metavar="REGEX",
                help="also keep tensors whose name matches REGEX in high precision (repeatable)",
            )
            q.add_argument(
                "--scale-fmt",
                choices=["float32", "ue8m0"],
                default="float32",
                help="float32 (default): amax / 448 per block; ue8m0: rounded up to a power of "
                "two (DeepSeek-V3.1's format), still stored as float32",
            )
            q.add_argument(
                "--amax-floor",
                type=float,
                default=None,
                metavar="X",
                help="floor each block's amax at X before the scale is taken (default: 1e-4, "
                "DeepSeek's inference act_quant since 2025-08 and DeepGEMM, with ue8m0 scales; "
                "0, no floor, with float32 scales)",
            )
        q.add_argument("--quiet", action="store_true", help="no progress bar")
    q = conv.add_parser("example", help="write a small FP8 checkpoint in DeepSeek-V3's layout")
    q.add_argument("dst", help="new output directory")
    q.add_argument("--seed", type=int, default=0, help="random seed of the weights (default 0)")
    p.set_defaults(func=_cmd_convert)

    p = sub.add_parser("quant-error", help="quantization error of a tensor under each recipe")
    p.add_argument("path", help=".npy file, or .safetensors file (with --tensor)")
    p.add_argument("--tensor", help="tensor name in a .safetensors file")
    p.add_argument("--axis", type=int, default=-1, help="contraction axis (default -1)")
    p.add_argument(
        "--tokens",
        type=int,
        default=128,
        help="rows of the Gaussian activation for the GEMM (>= 1)",
    )
    p.add_argument("--no-gemm", action="store_true", help="skip the dot_general section")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_quant_error)

    p = sub.add_parser("numerics", help="classic floating-point losses and their remedies")
    p.set_defaults(func=_cmd_numerics)

    p = sub.add_parser("data", help="make and check token directories for training")
    acts = p.add_subparsers(dest="action", required=True, metavar="ACTION", parser_class=_Parser)
    q = acts.add_parser(
        "prepare", help="train a BPE tokenizer on text (or reuse one) and write token shards"
    )
    q.add_argument("src", help="a text file or a folder (text, .jsonl, .parquet, .array_record)")
    q.add_argument("dst", help="new output directory (must not exist, or be empty)")
    how = q.add_mutually_exclusive_group(required=True)
    how.add_argument(
        "--vocab",
        type=_number(int, 256, True),
        help="train a byte-level BPE of N entries (257 to 1,048,576)",
    )
    how.add_argument("--tokenizer", metavar="PATH", help="reuse this tokenizer.json")
    q.add_argument(
        "--val-fraction",
        type=_number(float, 0.0, True, 1.0),
        default=0.05,
        help="fraction of documents held out for validation (default 0.05)",
    )
    q.add_argument("--field", default="text", help="text field of JSONL / Parquet / ArrayRecord")
    q.add_argument(
        "--suffix",
        action="append",
        default=[],
        help="read only files whose names end so, e.g. --suffix .py --suffix .rst (repeatable)",
    )
    q.add_argument(
        "--shard-tokens",
        type=_POSITIVE_INT,
        default=1 << 27,
        help="tokens per shard before a new one starts (default 2^27)",
    )
    q.add_argument("--quiet", action="store_true", help="no progress bar")
    q = acts.add_parser("info", help="check a token directory (ids, sizes, dtypes) and summarize")
    q.add_argument("dir", help="token directory (with tokens.json)")
    p.set_defaults(func=_cmd_data)

    p = sub.add_parser("runs", help="training runs: plot several runs' curves together")
    runs = p.add_subparsers(dest="action", required=True, metavar="ACTION", parser_class=_Parser)
    q = runs.add_parser("plot", help="one panel per metric, one line (colour + style) per run")
    q.add_argument("dirs", nargs="+", metavar="DIR", help="run directories or folders of runs")
    q.add_argument("--out", default="runs.png", help="PNG to write (default runs.png)")
    q.add_argument(
        "--keys",
        default="loss,val_loss",
        help="metrics.jsonl keys, one panel each (comma-separated)",
    )
    q.set_defaults(func=_cmd_runs)

    p = sub.add_parser(
        "parity", help="per-token logprob gap of one checkpoint under a reference and other recipes"
    )
    p.add_argument("--workdir", help="a run trained here (experiments/train.py)")
    p.add_argument(
        "--example",
        choices=["llama"],
        help="instead of a run: the interop Llama example, quantized through the Qwix provider",
    )
    p.add_argument(
        "--recipes",
        required=True,
        help="reference first, then the recipes compared with it: bf16,deepseek_v3[,...]",
    )
    p.add_argument("--file", help="text to score (default: the run's validation split)")
    p.add_argument("--step", type=_NONNEG_INT, help="checkpoint step (default: newest usable)")
    p.add_argument("--batch-size", type=_POSITIVE_INT, default=8, help="windows per batch")
    p.add_argument("--max-windows", type=_NONNEG_INT, default=0, help="at most N (0: all)")
    p.add_argument("--seq-len", type=_number(int, 1, True), default=128, help="--example: window")
    p.add_argument("--seed", type=int, default=0, help="--example: initialization seed")
    p.add_argument("--out", help="folder for results.json (per-window values) and parity.png")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_parity)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (0 ok, 1 error, 2 usage)."""
    from fp8jax.toolkit.convert import ConversionError

    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return args.func(args)
    except UsageError as e:
        print(
            f"fp8jax {args.command}: error: {e} (see fp8jax {args.command} --help)", file=sys.stderr
        )
        return 2
    except BrokenPipeError:
        # Output piped into `head` and closed early: not an error of ours.
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (ConversionError, ValueError, OSError) as e:
        print(f"fp8jax {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"fp8jax {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
