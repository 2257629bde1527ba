"""fp8jax parity: per-token logprob gap of one checkpoint under two recipes, against an
independent float64 computation; identical recipes give exactly 0; the table recomputes
from the saved per-window values; input mistakes are one line."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_train_restore import untrained_run

from fp8jax import registry
from fp8jax.models.transformer import MoETransformer
from fp8jax.toolkit import cli, parity
from fp8jax.train.state import split_model


def _reference(logits_ref, logits_cmp, tokens):
    """Per token in float64: dlogprob of the next token, argmax change, KL(p || q)."""
    p64 = np.asarray(logits_ref, np.float64)[:, :-1]
    q64 = np.asarray(logits_cmp, np.float64)[:, :-1]

    def log_softmax(x):
        top = x.max(-1, keepdims=True)
        return x - top - np.log(np.exp(x - top).sum(-1, keepdims=True))

    lp, lq = log_softmax(p64), log_softmax(q64)
    tgt = np.asarray(tokens)[:, 1:, None]
    d = np.take_along_axis(lq, tgt, -1)[..., 0] - np.take_along_axis(lp, tgt, -1)[..., 0]
    flip = p64.argmax(-1) != q64.argmax(-1)
    kl = (np.exp(lp) * (lp - lq)).sum(-1)
    return d, flip, kl


def _check_windows(pair, logits_ref, logits_cmp, tokens, atol=2e-5):
    d, flip, kl = _reference(logits_ref, logits_cmp, tokens)
    w = pair["windows"]
    np.testing.assert_allclose(w["abs_mean"], np.abs(d).mean(1), atol=atol, rtol=0)
    np.testing.assert_allclose(w["abs_max"], np.abs(d).max(1), atol=atol, rtol=0)
    np.testing.assert_allclose(w["signed_mean"], d.mean(1), atol=atol, rtol=0)
    np.testing.assert_allclose(w["kl_mean"], kl.mean(1), atol=atol, rtol=0)
    # float32 log-softmax may tie two logits float64 keeps apart: at most one token in all.
    n_tok = d.shape[1]
    assert np.abs(np.asarray(w["flip_frac"]) * n_tok - flip.sum(1)).sum() <= 1.0 + 1e-9
    assert 0 < np.abs(d).mean()  # a real gap: the check above is not on zeros


def test_token_metrics_against_float64():
    rng = np.random.default_rng(0)
    a = rng.normal(0, 1, (3, 9, 17)).astype(np.float32)
    b = (a + rng.normal(0, 0.5, a.shape)).astype(np.float32)
    tokens = rng.integers(0, 17, (3, 9))
    got = jax.device_get(parity.token_metrics(jnp.asarray(a), jnp.asarray(b), jnp.asarray(tokens)))
    d, flip, kl = _reference(a, b, tokens)
    np.testing.assert_allclose(got["dlogprob"], d, atol=2e-6)
    np.testing.assert_allclose(got["kl"], kl, atol=2e-6)
    np.testing.assert_array_equal(got["flip"], flip)
    assert flip.any() and not flip.all()
    same = jax.device_get(parity.token_metrics(jnp.asarray(a), jnp.asarray(a), jnp.asarray(tokens)))
    assert not np.any(same["dlogprob"]) and not np.any(same["kl"]) and not np.any(same["flip"])


def test_summary_is_the_t_interval_over_windows():
    w = {
        "abs_mean": [0.1, 0.3, 0.2],
        "abs_max": [0.5, 0.9, 0.4],
        "signed_mean": [0.0, 0.1, -0.1],
        "flip_frac": [0.0, 0.5, 0.25],
        "kl_mean": [1e-3, 2e-3, 3e-3],
    }
    row = parity.summarize(w)
    # mean 0.2, sd 0.1, t(0.975, 2) = 4.302653 -> half width 4.302653 * 0.1 / sqrt(3).
    assert row["abs_mean"]["mean"] == pytest.approx(0.2)
    assert row["abs_mean"]["half_width"] == pytest.approx(4.302653 * 0.1 / np.sqrt(3), rel=1e-6)
    assert row["abs_max"] == 0.9 and row["windows"] == 3


def _logits_of(run, state, name, tokens):
    """The logits of the checkpoint's weights under recipe ``name``, built here on its own."""
    model = MoETransformer(run.mcfg, registry.get(name), rngs=nnx.Rngs(1), telemetry=False)
    graphdef, _, fp8, _, _ = split_model(model)

    @jax.jit
    def fwd(params, fp8, bias, rest, t):
        return nnx.merge(graphdef, params, fp8, bias, rest)(t)[0]

    return np.concatenate(
        [np.asarray(fwd(state.params, fp8, state.bias, state.rest, t), np.float64) for t in tokens]
    )


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("parity") / "run"
    untrained_run(path, "bf16")
    return path


def test_a_run_trained_here_against_float64_and_saved_table(tiny_run, tmp_path):
    from fp8jax.train.restore import load_run

    names = ["bf16", "deepseek_v3", "bf16"]
    fns, batches, info = parity.from_workdir(tiny_run, names, batch_size=4, max_windows=8)
    assert batches.shape == (2, 4, 32) and info["trained_recipe"] == "bf16"
    res = parity.measure(fns, batches, names, source=info["source"], quiet=True)
    run, state, _ = load_run(tiny_run)
    tokens = batches.reshape(8, 32)
    ref = _logits_of(run, state, "bf16", batches)
    _check_windows(
        res["pairs"]["deepseek_v3"], ref, _logits_of(run, state, "deepseek_v3", batches), tokens
    )
    # The same recipe twice: exactly zero, every window.
    same = res["pairs"]["bf16"]
    assert all(v == 0.0 for vals in same["windows"].values() for v in vals)
    assert same["hist"]["zeros"] == 8 * 31
    saved = parity.save(res, tmp_path / "out")
    assert (tmp_path / "out" / "parity.png").stat().st_size > 0
    back = parity.load(tmp_path / "out")
    assert parity.table(back) == parity.table(saved)
    row = parity.summarize(back["pairs"]["deepseek_v3"]["windows"])
    d, flip, kl = _reference(ref, _logits_of(run, state, "deepseek_v3", batches), tokens)
    assert row["abs_mean"]["mean"] == pytest.approx(np.abs(d).mean(), abs=2e-5)
    assert row["kl_mean"]["mean"] == pytest.approx(kl.mean(), abs=2e-5)
    assert f"| deepseek_v3 | {row['abs_mean']['mean']:.4f} ±" in parity.table(back)


def test_a_model_quantized_through_qwix(monkeypatch):
    pytest.importorskip("qwix")
    import qwix

    from fp8jax.interop.examples.llama import Llama, LlamaConfig
    from fp8jax.interop.qwix_provider import QwixProvider
    from fp8jax.lab.qwix_comparison import rules_for

    cfg = LlamaConfig(d_model=32, n_heads=2, d_ff=64, n_layers=1)
    model = Llama(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    batches = rng.integers(0, 256, (1, 2, 16)).astype(np.int32)
    names = ["bf16", "deepseek_v3"]
    res = parity.measure(
        parity.qwix_logits_fns(model, names, batches[0]), batches, names, quiet=True
    )

    def logits(name):
        q = qwix.quantize_model(nnx.clone(model), QwixProvider(rules_for(name)), batches[0])
        return np.asarray(q(jnp.asarray(batches[0])), np.float64)

    _check_windows(res["pairs"]["deepseek_v3"], logits("bf16"), logits("deepseek_v3"), batches[0])
    same = parity.measure(
        parity.qwix_logits_fns(model, ["deepseek_v3"], batches[0]),
        batches,
        ["deepseek_v3", "deepseek_v3"],
        quiet=True,
    )
    assert all(v == 0.0 for vals in same["pairs"]["deepseek_v3"]["windows"].values() for v in vals)


def test_non_finite_logprobs_are_one_line():
    batches = np.zeros((1, 2, 4), np.int32)
    fns = {
        "bf16": lambda t: jnp.zeros((2, 4, 8), jnp.float32),
        "deepseek_v3": lambda t: jnp.full((2, 4, 8), jnp.nan, jnp.float32),
    }
    with pytest.raises(parity.ParityError, match="non-finite logprobs in window 0"):
        parity.measure(fns, batches, ["bf16", "deepseek_v3"], quiet=True)


def _error(capsys, argv, match, code=2):
    assert cli.main(argv) == code
    err = capsys.readouterr().err.splitlines()
    # Progress lines may come first; the error is one line, the last, and no traceback.
    assert [line for line in err if "parity: error:" in line] == err[-1:], err
    assert err[-1].startswith("fp8jax parity: error:") and match in err[-1], err
    assert not any("Traceback" in line for line in err), err


def test_cli_errors(tmp_path, capsys, tiny_run):
    _error(
        capsys,
        ["parity", "--workdir", str(tmp_path / "nope"), "--recipes", "bf16,deepseek_v3"],
        "is not a directory",
    )
    _error(
        capsys,
        ["parity", "--workdir", str(tiny_run), "--recipes", "bf16,deepseek_v9"],
        "unknown recipe 'deepseek_v9'",
    )
    _error(
        capsys,
        ["parity", "--workdir", str(tiny_run), "--recipes", "bf16"],
        "needs a reference and at least one other",
    )
    _error(capsys, ["parity", "--recipes", "bf16,deepseek_v3"], "give --workdir RUN")
    _error(
        capsys,
        ["parity", "--workdir", str(tiny_run), "--example", "llama", "--recipes", "bf16,mxfp8"],
        "one of them",
    )
    _error(
        capsys,
        ["parity", "--example", "llama", "--recipes", "bf16,mxfp8", "--step", "3"],
        "--step applies to --workdir",
    )
    _error(
        capsys,
        ["parity", "--workdir", str(tiny_run), "--recipes", "bf16,mxfp8,mxfp8"],
        "names mxfp8 twice",
    )
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    _error(
        capsys,
        [
            "parity",
            "--workdir",
            str(tiny_run),
            "--recipes",
            "bf16,deepseek_v3",
            "--file",
            str(empty),
        ],
        "is empty",
    )
    _error(
        capsys,
        ["parity", "--workdir", str(tiny_run), "--recipes", "bf16,hybrid_delayed"],
        "keeps delayed-scaling state",
    )
    # argparse's own refusals are one line too.
    with pytest.raises(SystemExit) as e:
        cli.main(
            ["parity", "--workdir", str(tiny_run), "--recipes", "bf16,mxfp8", "--max-windows", "-1"]
        )
    assert e.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_committed_table_recomputes_from_its_per_window_values():
    from pathlib import Path

    folder = Path(__file__).resolve().parents[1] / "experiments" / "results" / "parity"
    results = parity.load(folder)
    table = parity.table(results)
    assert table in (folder / "README.md").read_text()
    # Every pair scored the same windows; the JSON holds one value per window and metric.
    for pair in results["pairs"].values():
        assert {len(v) for v in pair["windows"].values()} == {512}
    assert results["provenance"]["git"]["dirty"] == []


@pytest.mark.slow
def test_cli_on_the_qwix_example_writes_its_results(tmp_path, capsys):
    pytest.importorskip("qwix")
    text = tmp_path / "t.txt"
    text.write_bytes(bytes(range(32, 127)) * 3)  # 285 bytes: 8 windows of 32, 2 batches of 4
    argv = ["parity", "--example", "llama", "--recipes", "bf16,deepseek_v3", "--file", str(text)]
    argv += ["--seq-len", "32", "--batch-size", "4", "--out", str(tmp_path / "out"), "--quiet"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    saved = parity.load(tmp_path / "out")
    assert saved["model"]["origin"] == "qwix" and saved["source"] == str(text)
    assert parity.table(saved) in out and "| deepseek_v3 |" in out
    assert len(saved["pairs"]["deepseek_v3"]["windows"]["kl_mean"]) == 8


def test_every_argument_is_checked_before_restoring(tmp_path, capsys, tiny_run):
    huge = tmp_path / "huge.txt"
    with open(huge, "wb") as f:
        f.truncate(65 << 20)  # sparse: 65 MiB on paper, nothing on disk
    (tmp_path / "afile").write_text("x")
    base = ["parity", "--workdir", str(tiny_run), "--recipes", "bf16,deepseek_v3"]
    cases = [
        (["--file", str(huge)], "holds 68,157,440 bytes, more than the 67,108,864 (64 MiB)"),
        (["--file", str(tmp_path)], "is not a file"),
        (["--max-windows", "4"], "--max-windows 4 is less than one batch of 8 windows"),
        (["--out", str(tmp_path / "afile")], "is not a folder"),
    ]
    for extra, match in cases:
        assert cli.main(base + extra) == 2, extra
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and match in err[0], err
        assert err[0].startswith("fp8jax parity: error:")
    # Nothing was created where the output would have gone.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "huge.txt"]


def test_results_are_written_whole_or_not_at_all(tmp_path, monkeypatch):
    results = {
        "reference": "bf16",
        "pairs": {
            "x": {
                "windows": {k: [0.1, 0.2] for k in parity.METRICS},
                "hist": parity.histogram(np.array([0.1, 0.2])),
            }
        },
    }
    parity.save(results, tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert sorted(before) == ["parity.png", "results.json"]

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(parity, "plot", broken)
    with pytest.raises(OSError):
        parity.save({**results, "reference": "other"}, tmp_path)
    # The earlier results stand, complete; no partial file is left beside them.
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_a_checkpoint_damaged_into_finite_values_is_refused_before_scoring(tmp_path, capsys):
    from test_train_checkpoint import _xor_into_finite_values

    from fp8jax.train.checkpoint import Checkpointer
    from fp8jax.train.loop import setup
    from fp8jax.train.restore import run_config

    untrained_run(tmp_path, "bf16", steps=(0, 6))
    ck = Checkpointer(tmp_path)
    _xor_into_finite_values(ck, setup(run_config(tmp_path), tmp_path).state, 6)
    ck.close()
    capsys.readouterr()
    argv = ["parity", "--workdir", str(tmp_path), "--recipes", "bf16,deepseek_v3", "--step", "6"]
    _error(capsys, argv, "checkpoint step 6 in ", code=1)
    assert cli.main(argv) == 1
    err = capsys.readouterr().err.splitlines()[-1]
    assert "is unusable: array " in err and "differs from the sha256 recorded" in err


def test_measure_says_what_it_compiles_and_how_long_it_took():
    import re

    batches = np.zeros((2, 2, 4), np.int32)
    fns = {n: (lambda t: jnp.zeros((2, 4, 8), jnp.float32)) for n in ("bf16", "deepseek_v3")}
    said = []
    parity.measure(fns, batches, ["bf16", "deepseek_v3"], quiet=True, say=said.append)
    assert len(said) == 2, said
    assert said[0].startswith("compiling the model under 2 recipes and the metrics (first call")
    assert re.fullmatch(r"compiled and scored the first batch in \d+\.\d s", said[1]), said
