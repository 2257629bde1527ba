"""The paired recipe comparison on a model fp8jax did not define, quantized through the door.

For each seed, one model init and one batch order serve every label; each
label quantizes a clone of that model with ``qwix.quantize_model`` and its
rules (embedding, head and router in high precision; the rest in the
label's recipe), trains it with AdamW for ``steps`` steps on the corpus and
records the validation loss.  The table is the project's: per label the
paired relative gap of the final validation loss to bf16, per seed, with the
mean and 95% t-interval over seeds (:func:`fp8jax.train.compare.mean_interval`,
:func:`~fp8jax.train.compare.verdict`).
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

from fp8jax.data.corpus import load_corpus, train_batch, val_batches
from fp8jax.interop.examples.llama import Llama, LlamaConfig, next_token_loss
from fp8jax.interop.rules import Rule
from fp8jax.train.compare import mean_interval, verdict

HIGH_PRECISION = r".*(embed|head|router).*"


def rules_for(recipe: str) -> list[Rule]:
    """Embedding, head and router as the model wrote them; every other GEMM in ``recipe``."""
    return [Rule(module_path=HIGH_PRECISION, recipe=None), Rule(recipe=recipe)]


def train_one(config: ml_collections.ConfigDict, recipe: str, seed: int) -> float:
    """Final validation loss (nats per byte) of the Llama-style model under ``recipe``."""
    import qwix  # optional: fp8jax[qwix]

    from fp8jax.interop.qwix_provider import QwixProvider

    corpus = load_corpus(config.data.source, config.data.path or None, config.data.val_fraction)
    length = config.seq_len + 1
    model = Llama(LlamaConfig(**config.model), rngs=nnx.Rngs(seed))
    example = jnp.asarray(train_batch(corpus, 0, config.batch_size, length, seed))[:, :-1]
    model = qwix.quantize_model(model, QwixProvider(rules_for(recipe)), example)
    opt = nnx.Optimizer(model, optax.adamw(config.learning_rate), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, tokens):
        loss, grads = nnx.value_and_grad(next_token_loss)(model, tokens)
        opt.update(model, grads)
        return loss

    for s in range(config.steps):
        step(model, opt, jnp.asarray(train_batch(corpus, s, config.batch_size, length, seed)))
    val = val_batches(corpus, config.eval_batches, config.batch_size, length)
    evaluate = nnx.jit(next_token_loss)
    return float(np.mean([float(evaluate(model, jnp.asarray(b))) for b in val]))


def run(config: ml_collections.ConfigDict) -> dict:
    """{label: {"val_loss": per seed, "gap": mean_interval of the paired gap, "verdict"}}."""
    losses = {label: [train_one(config, label, s) for s in config.seeds] for label in config.labels}
    base = np.asarray(losses["bf16"])
    out = {}
    for label, v in losses.items():
        entry = {"val_loss": v}
        if label != "bf16":
            gap = mean_interval((np.asarray(v) - base) / base)
            entry |= {"gap": gap, "verdict": verdict(gap)}
        out[label] = entry
    return out
