"""Train-step time, tokens/s and compiled peak memory of the MoE model: FP8 vs bf16.

    python experiments/bench_model.py                      # small config, batch 8 x 128
    python experiments/bench_model.py --config=tiny --steps=5

Prints, per row, the train-step time (median of --steps timed steps after one
warm-up, the rows' steps interleaved), tokens/s and the step's peak memory from
XLA's compiled memory analysis, with their ratios to the bf16 row.  A row is
``recipe[:dequant_dtype][@notel]`` (@notel: FP8 telemetry off for that row).
Logic: fp8jax.bench.moe_step.
"""

from __future__ import annotations

import jax
from absl import app, flags

from fp8jax.bench import moe_step

_CONFIG = flags.DEFINE_enum("config", "small", list(moe_step.PRESETS), "model size preset")
_ATTN = flags.DEFINE_enum("attention", "mha", ["mha", "mla"], "attention type")
_BATCH = flags.DEFINE_integer("batch", 8, "sequences per step")
_SEQ = flags.DEFINE_integer("seq", None, "sequence length (default: the config's max_seq_len)")
_STEPS = flags.DEFINE_integer("steps", 5, "timed steps")
_ROWS = flags.DEFINE_list(
    "recipes",
    ["bf16", "deepseek_v3", "deepseek_v3:bfloat16", "deepseek_v3@notel"],
    "rows: recipe[:dequant_dtype][@notel]",
)


def main(argv):
    del argv
    for spec in _ROWS.value:
        try:
            moe_step.parse_spec(spec)
        except (KeyError, ValueError) as e:
            raise app.UsageError(f"--recipes: {e}") from None
    records, note = moe_step.bench_train_steps(
        _ROWS.value,
        preset=_CONFIG.value,
        attention=_ATTN.value,
        batch=_BATCH.value,
        seq=_SEQ.value,
        warmup=1,
        iters=_STEPS.value,
        log=lambda line: None,
    )
    print(f"{note}; backend {jax.default_backend()}")
    print(moe_step.step_table(records))


if __name__ == "__main__":
    app.run(main)
