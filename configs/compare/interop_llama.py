r"""deepseek_v3 vs bf16 on the Llama-style example model, quantized through the Qwix provider.

Command (needs pip install 'fp8jax[qwix]'):
  python experiments/compare_recipes.py --config=configs/compare/interop_llama.py --workdir=/tmp/fp8jax_cmp/interop_llama

What it prints: per label the final validation loss per seed and, for
deepseek_v3, the paired relative gap to bf16 with its mean and 95%
t-interval over seeds and the verdict on +-0.25%; results.json in the
workdir.  The model is fp8jax/interop/examples/llama.py (standard Flax NNX
layers), its embedding and head left in high precision by rules.
"""

import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    # Labels: recipe preset names; "bf16" is the paired baseline.
    c.labels = ["bf16", "deepseek_v3"]
    # Model-init / batch-order seeds; every label runs every seed.
    c.seeds = list(range(8))
    # Llama-style model size (LlamaConfig fields).
    c.model = dict(vocab=256, d_model=128, n_heads=4, d_ff=384, n_layers=2)
    c.steps = 150  # AdamW steps per run
    c.batch_size = 8  # sequences per step
    c.seq_len = 128  # bytes per sequence
    c.learning_rate = 3e-3  # AdamW learning rate, constant
    c.eval_batches = 8  # held-out batches for the final validation loss
    # The corpus: fp8jax.data.corpus.load_corpus's config (default: the stdlib text).
    c.data = ml_collections.ConfigDict(dict(source="stdlib", path="", val_fraction=0.05))
    return c
