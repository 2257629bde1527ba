r"""Small run on BPE tokens: configs/small.py's model and schedule, a real tokenizer.

The corpus is the same text as the default byte corpus (the standard library's
sources and docs), tokenized by a byte-level BPE of 8192 entries trained on it
here; the model's embedding and output head take their size from the data.

Make the token directory once (about 2 minutes on a 2-core CPU, no download):
  fp8jax data prepare "$(python -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')" \
    /tmp/fp8jax_data/stdlib_bpe8k --vocab 8192 --suffix .py --suffix .rst --suffix .txt
which prints
  wrote /tmp/fp8jax_data/stdlib_bpe8k: vocabulary 8192 (uint16), ... train + ... validation tokens ...
(on Python 3.11.7: 720 documents, 2,878,005 train + 118,119 validation tokens).

Command:
  python experiments/train.py --config=configs/small_bpe.py --workdir=/tmp/fp8jax_small_bpe
  (baseline: add --config.recipe=bf16; another token directory: --config.data.path=DIR)

What it prints: progress lines every 10 steps (step 1 at loss ~9.55 nats/token;
ln 8192 = 9.01), and a summary line.  About 0.3 steps/s on a loaded 2-core CPU.  Each metrics.jsonl row of a logged step holds
``data_wait_s``, the seconds the loop waited for input since the last logged
step.  The paired deepseek_v3 vs bf16 comparison on this config:
configs/compare/small_bpe.py.
"""

from pathlib import Path

from fp8jax.train.defaults import config_file

# Where `fp8jax data prepare` writes the token directory (the command above).
DATA = "/tmp/fp8jax_data/stdlib_bpe8k"


def get_config():
    # configs/small.py's model, schedule and evaluation, on tokens instead of bytes.
    c = config_file(Path(__file__).parent / "small.py")
    c.data.source = "tokens"  # a token directory with tokens.json (its own split and vocabulary)
    c.data.path = DATA
    return c
