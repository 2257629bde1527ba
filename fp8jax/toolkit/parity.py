"""Logprob parity: one checkpoint's next-token distributions under two recipes on one text.

Reinforcement learning samples with one precision and trains with another;
the gap shows as per-token logprob error.  Here the same weights run under a
reference recipe (normally bf16) and under each other recipe, on the same
windows of text, and per predicted token t (position t predicts token t+1):

* ``dlogprob_t = log q(x_{t+1}) - log p(x_{t+1})``, the change of the
  logprob of the token that follows, ``p`` the reference's softmax and
  ``q`` the other recipe's (both in float32 from float32 logits);
* ``flip_t``: whether the most likely token changes
  (``argmax p != argmax q``, first index on ties, as ``jnp.argmax``);
* ``KL_t = KL(p || q) = sum_v p_v (log p_v - log q_v)`` over the vocabulary,
  in float32 (rounding can leave it a few ulps below zero).

Per text window (``seq_len`` consecutive tokens, ``seq_len - 1``
predictions, as evaluation cuts them) the saved values are the mean and max
of ``|dlogprob|``, the mean signed ``dlogprob``, the fraction of flips and
the mean KL, in float64 from the float32 per-token values.  The table is
computed from those per-window values only: each metric is the mean over
windows with a two-sided 95% Student-t interval over windows
(``mean +- t(0.975, n - 1) * sd / sqrt(n)``, :func:`mean_interval`); windows
hold equally many tokens, so a mean over windows is the mean over tokens.
Consecutive windows of one text are not independent draws; the interval
says how much the number moves from window to window, not more.  The max
is the max over windows' maxima.  A histogram of the per-token
``|dlogprob|`` (log-spaced bins, exact zeros counted apart) is saved too,
so the plot redraws from the JSON.

Two kinds of model: a run trained here (:func:`run_logits_fns`, restored
through :func:`fp8jax.train.restore.load_run`, the readers' integrity rule)
and any Flax NNX model quantized through :class:`fp8jax.interop.QwixProvider`
(:func:`qwix_logits_fns`).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax import path_record, recipes, registry
from fp8jax.lab.stats import mean_interval
from fp8jax.progress import Progress
from fp8jax.train.runtime import compile_wait

LogitsFn = Callable[[np.ndarray], jax.Array]

METRICS = ("abs_mean", "abs_max", "signed_mean", "flip_frac", "kl_mean")
# |dlogprob| histogram: log10 bin edges from 1e-9 to 1e2, 10 bins a decade.
HIST_EDGES = np.logspace(-9.0, 2.0, 111)


class ParityError(ValueError):
    """A mistake in the input or an unusable result (one line)."""


def check_recipes(names: Sequence[str]) -> list[str]:
    """The recipe names, each known, none compared twice (the reference first, and it may be
    compared with itself); ParityError in one line otherwise."""
    names = [str(n).strip() for n in names]
    if len(names) < 2 or any(not n for n in names):
        raise ParityError(
            f"--recipes needs a reference and at least one other, e.g. bf16,deepseek_v3; got "
            f"{','.join(names)!r}"
        )
    twice = sorted({n for n in names[1:] if names[1:].count(n) > 1})
    if twice:
        raise ParityError(f"--recipes names {', '.join(twice)} twice: compare each recipe once")
    for n in names:
        try:
            registry.get(n)
        except ValueError as e:
            raise ParityError(str(e)) from None
    return names


#: The command's flags for a batch and a cap on windows (named in its messages).
FLAGS = ("--batch-size", "--max-windows")


def check_arguments(
    names: Sequence[str],
    path: str | Path | None,
    batch_size: int,
    max_windows: int,
    out: str | Path | None = None,
    devices: int = 1,
) -> None:
    """Every argument of a parity measurement, before anything is restored or scored.

    Recipes (:func:`check_recipes`), the text file (a regular file within
    :data:`fp8jax.train.evaluation.MAX_TEXT_BYTES`), the batch (a multiple of
    ``devices``) and the cap on windows (0 or at least one batch), the output
    folder (:func:`check_out`).  ConfigError / ParityError in one line.
    """
    from fp8jax.train.defaults import ConfigError
    from fp8jax.train.evaluation import check_text_file, check_window_settings

    check_recipes(names)
    if path is not None:
        check_text_file(path, "--file")
    check_window_settings(batch_size, max_windows, FLAGS)
    if batch_size % devices:
        raise ConfigError(
            f"--batch-size {batch_size} must be a positive multiple of the {devices} devices"
        )
    if out is not None:
        check_out(out)


def check_out(out: str | Path) -> Path:
    """``out`` as a folder parity can write results into (existing or to be made); ParityError
    in one line otherwise."""
    import os

    p = Path(out)
    if p.exists() and not p.is_dir():
        raise ParityError(f"--out {str(out)!r} is not a folder: give a folder for results.json")
    # The nearest existing folder at or above it must take new files.
    probe = p
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        raise ParityError(f"--out {str(out)!r}: cannot write in {str(probe)!r}")
    for name in RESULT_FILES:
        if (p / name).is_dir():
            raise ParityError(f"--out {str(out)!r} holds a folder named {name}: give another")
    return p


# --- per-token metrics (float32, on the device) --------------------------------


@jax.jit
def token_metrics(
    logits_ref: jax.Array, logits_cmp: jax.Array, tokens: jax.Array
) -> dict[str, jax.Array]:
    """Per predicted token of ``tokens`` [B, T]: dlogprob, flip, kl, each [B, T - 1] (float32).

    Position t of the logits [B, T, V] predicts token t + 1; the last
    position predicts nothing here.  Log-softmax in float32 (the logits are
    cast once: bf16 or float32 logits give the same float32 values).
    """
    lp = jax.nn.log_softmax(logits_ref[:, :-1].astype(jnp.float32), axis=-1)
    lq = jax.nn.log_softmax(logits_cmp[:, :-1].astype(jnp.float32), axis=-1)
    tgt = tokens[:, 1:, None]
    dlogprob = (
        jnp.take_along_axis(lq, tgt, axis=-1)[..., 0]
        - jnp.take_along_axis(lp, tgt, axis=-1)[..., 0]
    )
    flip = jnp.argmax(lp, axis=-1) != jnp.argmax(lq, axis=-1)
    kl = jnp.sum(jnp.exp(lp) * (lp - lq), axis=-1)
    return {"dlogprob": dlogprob, "flip": flip, "kl": kl}


def window_values(per_token: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per window (row of the [B, T - 1] per-token arrays) the saved metrics, float64 [B]."""
    d = np.asarray(per_token["dlogprob"], np.float64)
    a = np.abs(d)
    return {
        "abs_mean": a.mean(axis=1),
        "abs_max": a.max(axis=1),
        "signed_mean": d.mean(axis=1),
        "flip_frac": np.asarray(per_token["flip"], np.float64).mean(axis=1),
        "kl_mean": np.asarray(per_token["kl"], np.float64).mean(axis=1),
    }


def histogram(abs_d: np.ndarray) -> dict[str, Any]:
    """Counts of ``|dlogprob|`` in :data:`HIST_EDGES` bins; zeros, below and above apart."""
    a = np.asarray(abs_d, np.float64).ravel()
    counts, _ = np.histogram(a, HIST_EDGES)
    return {
        "edges": HIST_EDGES.tolist(),
        "counts": counts.tolist(),
        "zeros": int(np.sum(a == 0)),
        "below": int(np.sum((a > 0) & (a < HIST_EDGES[0]))),
        "above": int(np.sum(a > HIST_EDGES[-1])),
    }


def summarize(windows: Mapping[str, Sequence[float]], level: float = 0.95) -> dict[str, Any]:
    """The table row of one recipe pair, from its per-window values only.

    Each metric but the max: mean over windows and t-interval
    (:func:`mean_interval`, its ``per_seed`` field dropped: the values are
    saved beside it); ``abs_max``: the largest window maximum.
    """
    row: dict[str, Any] = {"windows": len(windows["abs_mean"])}
    for key in METRICS:
        if key == "abs_max":
            row[key] = float(np.max(np.asarray(windows[key], np.float64)))
            continue
        st = mean_interval(windows[key], level)
        st.pop("per_seed")
        row[key] = st
    return row


def _pm(st: Mapping[str, float], scale: float = 1.0, digits: int = 4) -> str:
    half = st["half_width"] * scale
    return f"{st['mean'] * scale:.{digits}f} ± {half:.{digits}f}"


def table(results: Mapping[str, Any]) -> str:
    """Markdown table recomputed from ``results["pairs"][*]["windows"]`` (see :func:`measure`)."""
    ref = results["reference"]
    lines = [
        f"| recipe vs {ref} | mean abs dlogprob | max abs dlogprob | mean dlogprob | "
        "argmax flips (%) | KL(ref ‖ recipe) (nats) | windows |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, pair in results["pairs"].items():
        row = summarize(pair["windows"], results.get("level", 0.95))
        lines.append(
            f"| {name} | {_pm(row['abs_mean'])} | {row['abs_max']:.4f} | "
            f"{_pm(row['signed_mean'])} | {_pm(row['flip_frac'], 100.0, 2)} | "
            f"{_pm(row['kl_mean'], 1.0, 5)} | {row['windows']} |"
        )
    return "\n".join(lines)


# --- the two kinds of model -----------------------------------------------------


def run_logits_fns(run: Any, state: Any, names: Sequence[str]) -> dict[str, LogitsFn]:
    """tokens [B, T] -> float32 logits [B, T, V] of a restored run's weights under each recipe.

    The run's parameters, router bias and other variables are the
    checkpoint's; only the recipe changes (a model of the run's config is
    built with it for its graph).  A recipe with delayed-scaling state gets
    the checkpoint's state when it is the run's own recipe; otherwise it is
    refused: a fresh amax history is not what such a recipe runs with.
    """
    from flax import nnx

    from fp8jax.models.transformer import MoETransformer
    from fp8jax.parallel.training import in_mesh
    from fp8jax.train.state import split_model

    fns: dict[str, LogitsFn] = {}
    for name in dict.fromkeys(names):
        recipe = registry.get(name)
        model = MoETransformer(run.mcfg, recipe, rngs=nnx.Rngs(0), telemetry=False)
        graphdef, params, fp8, _, _ = split_model(model)
        del model
        own = recipe.name == run.recipe.name
        if recipes.needs_state(recipe) and not own:
            raise ParityError(
                f"recipe {name!r} keeps delayed-scaling state that a checkpoint trained with "
                f"{run.recipe.name!r} does not hold; compare recipes with online scales"
            )
        if jax.tree.structure(params) != jax.tree.structure(state.params):
            raise ParityError(f"recipe {name!r} builds parameters unlike the checkpoint's")
        fp8 = state.fp8 if own else fp8

        @jax.jit
        def forward(params, fp8, bias, rest, tokens, graphdef=graphdef):
            model = nnx.merge(graphdef, params, fp8, bias, rest)
            logits, _ = model(tokens)
            return logits.astype(jnp.float32)

        run_fn = in_mesh(run.mesh, forward)
        fns[name] = lambda tokens, f=run_fn, fp8=fp8: f(
            state.params, fp8, state.bias, state.rest, jnp.asarray(tokens, jnp.int32)
        )
    return fns


def qwix_logits_fns(
    model: Any, names: Sequence[str], example: np.ndarray, rules_for: Callable | None = None
) -> dict[str, LogitsFn]:
    """tokens -> float32 logits of an NNX ``model`` quantized through the Qwix provider, per recipe.

    Each recipe quantizes a clone of ``model`` with ``qwix.quantize_model``
    and ``rules_for(recipe)`` (default: the interop comparison's rules,
    embedding, head and router as written, every other GEMM in the recipe);
    ``example`` is a token batch [B, T] for Qwix's trace.
    """
    import qwix  # optional: fp8jax[qwix]
    from flax import nnx

    from fp8jax.interop.qwix_provider import QwixProvider

    if rules_for is None:
        from fp8jax.lab.qwix_comparison import rules_for
    fns: dict[str, LogitsFn] = {}
    for name in dict.fromkeys(names):
        q = qwix.quantize_model(
            nnx.clone(model), QwixProvider(rules_for(name), telemetry=False), example
        )
        forward = nnx.jit(lambda m, t: m(t).astype(jnp.float32))
        fns[name] = lambda tokens, m=q, f=forward: f(m, jnp.asarray(tokens, jnp.int32))
    return fns


# --- the measurement ------------------------------------------------------------


def measure(
    logits_fns: Mapping[str, LogitsFn],
    batches: np.ndarray,
    names: Sequence[str],
    *,
    source: str = "",
    quiet: bool = False,
    stream=None,
    say: Callable[[str], None] = lambda line: None,
) -> dict[str, Any]:
    """Every recipe after the first against the first on ``batches`` [N, B, T].

    ``say`` gets a line naming what is compiled before the first batch (the
    model under each recipe and the metrics) and one with the seconds it
    took after it.

    Returns ``{"reference", "source", "seq_len", "level", "gemm_paths":
    {recipe: {...}}, "pairs": {recipe: {"windows": {metric: [per window]},
    "hist": ...}}}``.  ParityError when a recipe gives a non-finite logprob.
    Progress (one line per tenth of the windows in a log) goes to ``stream``
    (stderr).
    """
    names = check_recipes(names)
    ref, others = names[0], names[1:]
    n_b, bsz, seq = batches.shape
    if seq < 2:
        raise ParityError(f"windows of {seq} token(s) predict nothing: give seq_len >= 2")
    wins: dict[str, dict[str, list[float]]] = {o: {k: [] for k in METRICS} for o in others}
    abs_all: dict[str, list[np.ndarray]] = {o: [] for o in others}
    paths: dict[str, dict[str, str]] = {}
    bar = Progress(
        n_b * bsz, f"parity {','.join(names)}", stream=stream, quiet=quiet, unit="windows"
    )

    def logits(name: str, i: int) -> jax.Array:
        # The first call traces: the GEMM core reports the paths it resolved then.
        with path_record.recording() as seen:
            out = logits_fns[name](batches[i])
        if name not in paths:
            paths[name] = path_record.as_table(seen)
        return out

    say(compile_wait(f"the model under {len(names)} recipes and the metrics"))
    t0 = time.perf_counter()
    for i in range(n_b):
        if i == 1:
            say(f"compiled and scored the first batch in {time.perf_counter() - t0:.1f} s")
        tokens = jnp.asarray(batches[i], jnp.int32)
        lref = logits(ref, i)
        for o in others:
            per = jax.device_get(token_metrics(lref, logits(o, i), tokens))
            bad = ~np.isfinite(per["dlogprob"]) | ~np.isfinite(per["kl"])
            if bad.any():
                w = i * bsz + int(np.argwhere(bad)[0][0])
                raise ParityError(
                    f"{o} against {ref}: non-finite logprobs in window {w} of {source or 'the text'}"
                    " (the checkpoint or the recipe does not give a usable model there)"
                )
            for k, v in window_values(per).items():
                wins[o][k].extend(v.tolist())
            abs_all[o].append(np.abs(per["dlogprob"]))
        bar.update(bsz, f"(batch {i + 1}/{n_b})")
    return {
        "reference": ref,
        "recipes": list(names),
        "source": source,
        "seq_len": int(seq),
        "level": 0.95,
        "gemm_paths": paths,
        "pairs": {
            o: {"windows": wins[o], "hist": histogram(np.concatenate(abs_all[o]))} for o in others
        },
    }


def plot(results: Mapping[str, Any], out: Any) -> Any:
    """CDF of per-token |dlogprob| per recipe against the reference, from the saved histograms,
    as a PNG written to ``out`` (a path or a binary file); returns ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.0, 4.2))
    for name, pair in results["pairs"].items():
        h = pair["hist"]
        counts = np.asarray(h["counts"], np.float64)
        total = counts.sum() + h["zeros"] + h["below"] + h["above"]
        # Tokens at or below each upper bin edge (zeros and tiny values included).
        cdf = (h["zeros"] + h["below"] + np.cumsum(counts)) / max(total, 1.0)
        row = summarize(pair["windows"], results.get("level", 0.95))
        ax.step(
            np.asarray(h["edges"][1:]),
            cdf,
            where="post",
            label=f"{name} (mean {row['abs_mean']['mean']:.3g}, {h['zeros'] / total:.0%} exact)",
        )
    ax.set_xscale("log")
    ax.set_xlim(1e-7, 1e1)
    ax.set_ylim(0.0, 1.0)
    ax.set_xlabel(f"|logprob(recipe) - logprob({results['reference']})| of the next token (nats)")
    ax.set_ylabel("fraction of tokens at or below")
    ax.set_title(f"Per-token logprob parity against {results['reference']}")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=110, format="png")
    plt.close(fig)
    return out


def rounded(v: Any, digits: int = 7) -> Any:
    """``v`` with every float to ``digits`` significant digits (non-finite ones as strings)."""
    if isinstance(v, float):
        return float(f"{v:.{digits}g}") if math.isfinite(v) else str(v)
    if isinstance(v, Mapping):
        return {k: rounded(x, digits) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [rounded(x, digits) for x in v]
    return v


RESULT_FILES = ("results.json", "parity.png")


def save(results: Mapping[str, Any], out_dir: str | Path) -> dict[str, Any]:
    """Write results.json and parity.png to ``out_dir``; returns the results as saved.

    Per-window values keep 7 significant digits (the table shows at most 5):
    what the table and the plot are then drawn from is what the file holds.
    Both files are written under temporary names first and renamed into
    place once both are complete: a failure (a plot that cannot be drawn, a
    full disk) leaves the folder as it was.
    """
    import os

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    saved = rounded(results)
    tmp = {name: out_dir / f".{name}.partial-{os.getpid()}" for name in RESULT_FILES}
    try:
        tmp["results.json"].write_text(json.dumps(saved, separators=(",", ":")) + "\n")
        with open(tmp["parity.png"], "wb") as f:
            plot(saved, f)
        for name in RESULT_FILES:
            os.replace(tmp[name], out_dir / name)
    finally:
        for t in tmp.values():
            t.unlink(missing_ok=True)
    return saved


def load(path: str | Path) -> dict[str, Any]:
    """A saved results.json (a file or the folder holding it)."""
    p = Path(path)
    if p.is_dir():
        p = p / "results.json"
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise ParityError(f"{p}: not a parity results.json ({type(e).__name__})") from None


# --- the two sources a command scores ---------------------------------------------


def from_workdir(
    workdir: str | Path,
    names: Sequence[str],
    *,
    path: str | Path | None = None,
    step: int | None = None,
    batch_size: int = 8,
    max_windows: int = 0,
    say: Callable[[str], None] = print,
) -> tuple[dict[str, LogitsFn], np.ndarray, dict[str, Any]]:
    """(logits functions, windows [N, B, T], what was read) of a run trained here.

    Restored as evaluation restores it (:func:`fp8jax.train.restore.load_run`:
    the newest usable checkpoint, or ``step``); the text is ``path`` or the
    run's validation split, cut into windows of the run's ``seq_len``
    (:func:`fp8jax.train.evaluation.windows`).  ConfigError / CheckpointError
    (one line) for a missing run, an unusable checkpoint or an empty text.
    """
    from fp8jax.train.defaults import ConfigError
    from fp8jax.train.evaluation import text_stream, windows
    from fp8jax.train.restore import load_run

    # Every argument before the restore: a mistake costs no restore.
    check_arguments(names, path, batch_size, max_windows, devices=jax.device_count())
    if not Path(workdir).is_dir():
        raise ConfigError(
            f"--workdir {str(workdir)!r} is not a directory: give the workdir of a run "
            "trained with experiments/train.py"
        )
    run, state, step = load_run(workdir, step, say=say)
    if batch_size < 1 or batch_size % run.mesh.size:
        raise ConfigError(
            f"--batch-size {batch_size} must be a positive multiple of the {run.mesh.size} devices"
        )
    stream, source = text_stream(run, path)
    batches = windows(stream, run.seq_len, batch_size, max_windows, FLAGS)
    info = {
        "origin": "run",
        "workdir": str(workdir),
        "step": int(step),
        "trained_recipe": run.recipe.name,
        "model": str(run.config.model),
        "source": source,
    }
    return run_logits_fns(run, state, names), batches, info


def from_qwix_example(
    names: Sequence[str],
    *,
    path: str | Path | None = None,
    seed: int = 0,
    seq_len: int = 128,
    batch_size: int = 8,
    max_windows: int = 0,
) -> tuple[dict[str, LogitsFn], np.ndarray, dict[str, Any]]:
    """The Llama-style example of ``fp8jax.interop.examples`` (freshly initialized from
    ``seed``) quantized through the Qwix provider; text: ``path`` or the stdlib corpus'
    validation split."""
    from flax import nnx

    from fp8jax.data.corpus import load_corpus
    from fp8jax.interop.examples.llama import Llama, LlamaConfig
    from fp8jax.train.defaults import ConfigError
    from fp8jax.train.evaluation import read_text, windows

    check_arguments(names, path, batch_size, max_windows)
    if path is None:
        stream, source = load_corpus("stdlib").val, "the validation split of 'stdlib'"
    else:
        stream, source = read_text(path), str(path)
    if stream.size == 0:
        raise ConfigError(f"{source} is empty: give a text with at least one window of bytes")
    batches = windows(stream, seq_len, batch_size, max_windows, FLAGS)
    model = Llama(LlamaConfig(), rngs=nnx.Rngs(seed))
    fns = qwix_logits_fns(model, names, batches[0])
    info = {"origin": "qwix", "model": "interop.examples.llama", "seed": seed, "source": source}
    return fns, batches, info
