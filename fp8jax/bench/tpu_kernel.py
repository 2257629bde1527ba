"""libtpu's predictions for the Mosaic TPU block-scaled GEMM, compiled on a CPU machine.

Every number here is the TPU compiler's, for a topology described by libtpu
(``jax.experimental.topologies``), with no TPU attached: predictions, not
measurements.

* :func:`fwd_bwd` compiles forward + backward (or the forward alone) of one
  ``fp8jax.dot_general`` (``y = x w``, x (M, K), w (K, N), bfloat16 inputs)
  for a recipe and reports
  ``cost_analysis()``'s "optimal_seconds" and "bytes accessed", the GEMM
  paths taken and the count of Mosaic kernels (``tpu_custom_call``).
  libtpu returns a negative "optimal_seconds" where a program holds an
  instruction it cannot price; that is reported as None.
* :func:`kernels` compiles the three GEMM kernels alone (operands already
  quantized in their layouts): the GEMMs' share of the step.
* :func:`bundles` compiles one kernel in a child process with libtpu's
  dump flags and reads the compiler's static schedule length of the kernel
  ("total scheduled bundles", VLIW bundles of one core): the cost of the
  per-run promotion (``run`` 128 against 256 and against one run over all of
  K) as the compiler schedules it.

Command (prints one JSON object)::

    python -m fp8jax.bench.tpu_kernel --chip tpu7x --shape 4096,4096,4096
"""

from __future__ import annotations

import argparse
import functools
import glob
import json
import os
import re
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

import fp8jax
from fp8jax import path_record, registry
from fp8jax.kernels import tpu_block_gemm

TOPOLOGIES = {"v5e": "v5e:2x2", "v6e": "v6e:2x2", "tpu7x": "tpu7x:2x2x1"}
_DIMS = (((1,), (0,)), ((), ()))
_F8 = jnp.float8_e4m3fn


@functools.cache
def _sharding(chip: str):
    from jax.experimental import topologies

    device = topologies.get_topology_desc(TOPOLOGIES[chip], "tpu").devices[0]
    mesh = jax.sharding.Mesh(np.array([device]), ("x",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def _spec(chip: str, shape, dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype, sharding=_sharding(chip))


def _costs(compiled) -> dict:
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, list) else ca
    seconds = float(ca.get("optimal_seconds", -1.0))
    text = compiled.as_text()
    return {
        # Negative: libtpu could not price some instruction of the program.
        "optimal_seconds": seconds if seconds > 0 else None,
        "bytes_accessed": float(ca.get("bytes accessed", 0.0)),
        "mosaic_kernels": text.count('custom_call_target="tpu_custom_call"'),
        "while_loops": len(re.findall(r"\bwhile\(", text)),
    }


def fwd_bwd(chip: str, recipe: str, m: int, k: int, n: int, backward: bool = True) -> dict:
    """Forward (+ backward) of ``fp8jax.dot_general`` with ``recipe``, compiled for ``chip``."""
    r = registry.get(recipe)

    def step(x, w, dy):
        y, vjp = jax.vjp(lambda x, w: fp8jax.dot_general(x, w, _DIMS, recipe=r), x, w)
        return (y, vjp(dy)) if backward else y

    args = [_spec(chip, s, jnp.bfloat16) for s in ((m, k), (k, n), (m, n))]
    with path_record.recording("tpu") as paths:
        traced = jax.jit(step).trace(*args)
    out = _costs(traced.lower(lowering_platforms=("tpu",)).compile())
    out["paths"] = path_record.as_table(paths)
    return out


def _kernel_args(chip: str, kind: str, m: int, k: int, n: int, run: int = 128):
    """Quantized operands of one layer GEMM (x (M, K), w (K, N), dy (M, N)) for ``kind``."""
    kc, nc, mc = -(-k // run), -(-n // run), -(-m // run)
    f32 = jnp.float32
    if kind == "fprop":  # x tiles along K, w blocks: (M, K) x (K, N)
        shapes = [((m, k), _F8), ((kc, m), f32), ((k, n), _F8), ((kc, n), f32)]
    elif kind == "dgrad":  # dy tiles along N, w as stored (K, N) = the "nt" operand
        shapes = [((m, n), _F8), ((nc, m), f32), ((k, n), _F8), ((nc, k), f32)]
    else:  # x and dy in tiles along the tokens M
        shapes = [((m, k), _F8), ((mc, k), f32), ((m, n), _F8), ((mc, n), f32)]
    return [_spec(chip, s, d) for s, d in shapes]


_ORIENT = {"fprop": "nn", "dgrad": "nt", "wgrad": "tn"}


def _kernel_fn(kind: str, run: int):
    return functools.partial(
        tpu_block_gemm._dense,
        orient=_ORIENT[kind],
        out_dtype=jnp.dtype(jnp.bfloat16),
        block_m=tpu_block_gemm.DENSE_BLOCK_M,
        block_n=tpu_block_gemm.DENSE_BLOCK_N,
        runs=tpu_block_gemm.RUNS_PER_STEP,
        interpret=False,
        run=run,
    )


def kernels(chip: str, m: int, k: int, n: int) -> dict:
    """The three GEMM kernels alone, bfloat16 out: summed predictions, and per kind."""
    out = {}
    for kind in ("fprop", "dgrad", "wgrad"):
        fn = jax.jit(_kernel_fn(kind, 128))
        out[kind] = _costs(
            fn.trace(*_kernel_args(chip, kind, m, k, n))
            .lower(lowering_platforms=("tpu",))
            .compile()
        )
    seconds = [v["optimal_seconds"] for v in out.values()]
    out["optimal_seconds"] = None if None in seconds else sum(seconds)
    out["bytes_accessed"] = sum(v["bytes_accessed"] for v in out.values() if isinstance(v, dict))
    return out


def bundles(chip: str, run: int, m: int = 512, k: int = 2048, n: int = 512) -> dict:
    """Static schedule of the fprop kernel's body with scale runs of ``run``.

    "bundles": the compiler's VLIW bundles of the kernel (one grid step's
    body, straight-line code); "k_per_step": the K that body covers (``j``
    runs); "bundles_per_k128": bundles per 128 of K, comparable across
    ``run`` (the fewer, the cheaper the promotion).  Compiled in a child
    process: libtpu reads its dump flags when it loads.
    """
    kc = -(-k // run)
    j = kc if kc <= tpu_block_gemm.RUNS_PER_STEP else tpu_block_gemm.RUNS_PER_STEP
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
        env["LIBTPU_INIT_ARGS"] = (
            env.get("LIBTPU_INIT_ARGS", "") + f" --xla_jf_dump_to={tmp} --xla_jf_dump_llo_text=true"
        )
        code = (
            "import jax; from fp8jax.bench import tpu_kernel as t;"
            f"f = jax.jit(t._kernel_fn('fprop', {run}));"
            f"f.trace(*t._kernel_args({chip!r}, 'fprop', {m}, {k}, {n}, {run}))"
            ".lower(lowering_platforms=('tpu',)).compile()"
        )
        subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True)
        for path in glob.glob(os.path.join(tmp, "*fp8_block_scaled_matmul_nn*final_bundles.txt")):
            with open(path) as f:
                found = re.search(r"total scheduled bundles:\s*(\d+)", f.read())
            if found:
                count = int(found.group(1))
                return {
                    "bundles": count,
                    "k_per_step": j * run,
                    "bundles_per_k128": count * 128 / (j * run),
                }
    raise RuntimeError(f"libtpu wrote no schedule analysis of the kernel for {chip}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chip", choices=sorted(TOPOLOGIES), default="tpu7x")
    p.add_argument("--shape", default="4096,4096,4096", help="M,K,N of y = x w")
    p.add_argument("--bundles", action="store_true", help="also the promotion's schedule cost")
    args = p.parse_args(argv)
    try:
        m, k, n = (int(v) for v in args.shape.split(","))
    except ValueError:
        print(f"--shape must be three integers M,K,N, got {args.shape!r}", file=sys.stderr)
        return 2
    result = {
        "chip": args.chip,
        "shape": [m, k, n],
        "bf16": fwd_bwd(args.chip, "bf16", m, k, n),
        "deepseek_v3": fwd_bwd(args.chip, "deepseek_v3", m, k, n),
        "deepseek_v3_forward": fwd_bwd(args.chip, "deepseek_v3", m, k, n, backward=False),
        "kernels": kernels(args.chip, m, k, n),
    }
    if args.bundles:
        # A 512 x 512 output block, K 2048: runs of 128, of 256, one run.
        result["bundles"] = {str(r): bundles(args.chip, r) for r in (128, 256, 2048)}
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
