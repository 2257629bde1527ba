"""The paired recipe comparison on a model fp8jax did not define, quantized through the door.

For each seed, one model init and one batch order serve every label; each
label quantizes a clone of that model with ``qwix.quantize_model`` and its
rules (embedding, head and router in high precision; the rest in the
label's recipe), trains it with AdamW for ``steps`` steps on the corpus and
records the validation loss.  The table is the project's: per label the
paired relative gap of the final validation loss to bf16, per seed, with the
mean and 95% t-interval over seeds (:func:`fp8jax.lab.stats.mean_interval`,
:func:`~fp8jax.lab.stats.verdict`).

As every comparison here, it runs from one commit and a clean tree (or says
it did not) and records the machine and the path each label's GEMMs resolved
to (``bf16``: the standard ``lax.dot_general`` on bfloat16 operands).
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

from fp8jax import path_record
from fp8jax.data.corpus import load_corpus, train_batch, val_batches
from fp8jax.interop.examples.llama import Llama, LlamaConfig, next_token_loss
from fp8jax.interop.rules import Rule
from fp8jax.lab.stats import interval_text, mean_interval, verdict
from fp8jax.train import provenance
from fp8jax.train.defaults import ConfigError

HIGH_PRECISION = r".*(embed|head|router).*"


def rules_for(recipe: str) -> list[Rule]:
    """Embedding, head and router as the model wrote them; every other GEMM in ``recipe``."""
    return [Rule(module_path=HIGH_PRECISION, recipe=None), Rule(recipe=recipe)]


def train_one(config: ml_collections.ConfigDict, recipe: str, seed: int) -> tuple[float, dict]:
    """(final validation loss in nats per byte, GEMM paths) of the Llama-style model."""
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

    # The first call traces the step: the GEMM core reports its paths then.
    with path_record.recording() as paths:
        step(model, opt, jnp.asarray(train_batch(corpus, 0, config.batch_size, length, seed)))
    for s in range(1, config.steps):
        step(model, opt, jnp.asarray(train_batch(corpus, s, config.batch_size, length, seed)))
    val = val_batches(corpus, config.eval_batches, config.batch_size, length)
    evaluate = nnx.jit(next_token_loss)
    loss = float(np.mean([float(evaluate(model, jnp.asarray(b))) for b in val]))
    return loss, path_record.as_table(paths)


def run(config: ml_collections.ConfigDict, *, stream=None, allow_mixed_code: bool = False) -> dict:
    """Train every (label, seed); returns the results (see :func:`markdown`).

    ``{"labels": {label: {"val_loss": per seed, "gap": mean_interval of the
    paired gap, "verdict", "gemm_paths"}}, "provenance": {"git", "machine"}}``.
    A modified tree is refused (ConfigError) unless ``allow_mixed_code``.
    """
    stream = sys.stdout if stream is None else stream
    if "bf16" not in config.labels:
        raise ConfigError("labels: the paired baseline 'bf16' must be one of them")
    git = provenance.require_clean_tree(allow_mixed_code)
    losses: dict[str, list[float]] = {label: [] for label in config.labels}
    paths: dict[str, dict] = {}
    total, done = len(config.labels) * len(config.seeds), 0
    for seed in config.seeds:
        for label in config.labels:
            t0 = time.perf_counter()
            loss, p = train_one(config, label, int(seed))
            losses[label].append(loss)
            paths.setdefault(label, p)
            done += 1
            print(
                f"[{done}/{total}] {label} seed {seed}: val {loss:.4f} "
                f"({time.perf_counter() - t0:.0f} s)",
                file=stream,
                flush=True,
            )
    base = np.asarray(losses["bf16"])
    table = {}
    for label, v in losses.items():
        entry = {"val_loss": v, "gemm_paths": paths[label]}
        if label != "bf16":
            gap = mean_interval((np.asarray(v) - base) / base)
            entry |= {"gap": gap, "verdict": verdict(gap)}
        table[label] = entry
    return {
        "labels": table,
        "seeds": [int(s) for s in config.seeds],
        "provenance": {"git": git, "machine": provenance.machine()},
        "backend": jax.default_backend(),
    }


def markdown(results: dict, command: str | None = None) -> str:
    """results.md: commit, machine, and per label the GEMM path and the paired gap."""
    git = results["provenance"]["git"] or {}
    commit = git.get("commit", "?")[:10] + (" (modified tree)" if git.get("dirty") else "")
    lines = [
        "# deepseek_v3 vs bf16 on the Llama-style example model, through the Qwix provider",
        "",
        *([f"Command: `{command}`", ""] if command else []),
        f"Commit {commit}; machine: {provenance.machine_type(results['provenance']['machine'])}.",
        f"Seeds {results['seeds'][0]}-{results['seeds'][-1]} ({len(results['seeds'])}); the gap is "
        "(val - val_bf16) / val_bf16 on the same seed, its 95% t-interval over seeds; "
        '"within" = the whole interval inside +-0.25%.',
        "",
        "| run | GEMM path | mean val loss | val gap [95% CI] | within 0.25% |",
        "|---|---|---|---|---|",
    ]
    for label, r in results["labels"].items():
        gap = interval_text(r["gap"]) if "gap" in r else "(baseline)"
        lines.append(
            f"| {label} | {provenance.paths_text(r['gemm_paths'])} | "
            f"{np.mean(r['val_loss']):.4f} | {gap} | {r.get('verdict', '')} |"
        )
    return "\n".join(lines) + "\n"
