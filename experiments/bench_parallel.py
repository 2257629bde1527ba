"""A train step on 8 simulated CPU devices, deepseek_v3 vs bf16: collective bytes, memory, time.

    python experiments/bench_parallel.py                      # mesh (1, 4, 2), seq 256
    python experiments/bench_parallel.py --mesh=2,2,2 --seq=512 --layers=4

Prints, side by side with the ratio to bf16: the all-to-all bytes of the
expert dispatch and of the combine, the all-gather bytes of the FSDP weight
gathers, the other collectives, XLA's compiled memory per device and the
step time (logic in ``fp8jax.bench.parallel``).  Without an XLA_FLAGS
setting it asks XLA for 8 host devices.
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # JAX reads the device count once, when its backend starts.
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

from absl import app, flags  # noqa: E402

from fp8jax.bench.parallel import ParallelBench, bench_model, compare, table  # noqa: E402

_MESH = flags.DEFINE_list("mesh", ["1", "4", "2"], "data,fsdp,expert sizes")
_BATCH = flags.DEFINE_integer("batch", 8, "global batch (sequences)")
_SEQ = flags.DEFINE_integer("seq", 256, "sequence length")
_LAYERS = flags.DEFINE_integer("layers", 2, "transformer blocks (the first is dense)")
_DMODEL = flags.DEFINE_integer("d_model", 256, "model width")
_EXPERTS = flags.DEFINE_integer("experts", 8, "routed experts")
_ITERS = flags.DEFINE_integer("iters", 3, "timed steps")


def main(argv):
    del argv
    model = bench_model(_DMODEL.value, _LAYERS.value, _EXPERTS.value)
    bench = ParallelBench(
        model=model,
        batch=_BATCH.value,
        seq=_SEQ.value,
        mesh=tuple(int(s) for s in _MESH.value),
        iters=_ITERS.value,
    )
    print(
        f"model {model}, batch {bench.batch} x {bench.seq}, mesh (data, fsdp, expert) {bench.mesh}"
    )
    print(table(compare(bench)))


if __name__ == "__main__":
    app.run(main)
