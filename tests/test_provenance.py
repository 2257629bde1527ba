"""Run provenance: git state, machine record, the GEMM paths a trace resolved."""

import dataclasses
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax import host_cpu, path_record
from fp8jax.recipes import Accumulation
from fp8jax.train import provenance

DN = (((1,), (0,)), ((), ()))


def _git(cwd, *args):
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True)


def test_git_state_names_commit_and_every_modified_file(tmp_path):
    _git(tmp_path, "init", "-q")
    for name in ("a.py", "b.cfg"):
        (tmp_path / name).write_text("x = 1\n")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
    state = provenance.git_state(tmp_path)
    assert len(state["commit"]) == 40 and state["dirty"] == []
    # A modified config counts as much as modified code; untracked files do not.
    (tmp_path / "b.cfg").write_text("x = 2\n")
    (tmp_path / "scratch.txt").write_text("notes\n")
    assert provenance.git_state(tmp_path)["dirty"] == ["b.cfg"]
    assert provenance.git_state(tmp_path / "nonexistent") is None


def test_machine_record_names_cpu_backend_and_versions():
    m = provenance.machine()
    assert m["backend"] == jax.default_backend() and m["device_count"] == len(jax.devices())
    assert m["versions"]["jax"] == jax.__version__
    assert set(m["cpu"]) == {"model", "family_model_stepping", "isa", "cores"}
    line = provenance.machine_type(m)
    assert m["cpu"]["model"] in line and jax.__version__ in line


def _paths(recipe, grouped=False, jit=False):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((256, 256)), jnp.float32)
    if grouped:
        w = jnp.asarray(rng.standard_normal((2, 256, 128)), jnp.float32)
        sizes = jnp.asarray([100, 156], jnp.int32)

        def f(x, w):
            return fp8jax.grouped_dot(x, w, sizes, recipe=recipe).sum()
    else:
        w = jnp.asarray(rng.standard_normal((256, 128)), jnp.float32)

        def f(x, w):
            return fp8jax.dot_general(x, w, DN, recipe=recipe).sum()

    g = jax.grad(f, argnums=(0, 1))
    # A fresh function each call: an earlier trace would be reused and report nothing.
    return provenance.gemm_paths(jax.jit(g) if jit else g, x, w)


# What "auto" resolves to for FP8 on this CPU (fp8jax.gemm.AUTO).
_AUTO_FP8 = "xla dequant float32" if host_cpu.has_bf16_dot() is False else "chunked"


@pytest.mark.parametrize("jit", [False, True])
def test_gemm_paths_of_fwd_and_bwd(jit):
    kinds = {f"dense/{k}" for k in ("fprop", "dgrad", "wgrad")}
    paths = _paths(fp8jax.recipes.bf16(), jit=jit)
    assert paths == {k: "lax.dot_general bfloat16" for k in kinds}
    assert _paths(fp8jax.recipes.deepseek_v3(), jit=jit) == {k: _AUTO_FP8 for k in kinds}
    xla = dataclasses.replace(fp8jax.recipes.current_tensor(), impl="xla")
    assert _paths(xla, jit=jit) == {k: "xla dequant float32" for k in kinds}
    emu = fp8jax.recipes.deepseek_v3(accumulation=Accumulation())
    want = "emulate block 32, 13 bits, promote every 128, fma"
    assert _paths(emu, jit=jit) == {k: want for k in kinds}


def test_gemm_paths_of_the_expert_gemm():
    paths = _paths(fp8jax.recipes.deepseek_v3(), grouped=True)
    assert paths == {f"expert/{k}": _AUTO_FP8 for k in ("fprop", "dgrad", "wgrad")}


def test_nothing_is_kept_outside_a_recording():
    with path_record.recording() as outer:
        path_record.note("fprop", "a")
        with path_record.scope("expert"), path_record.recording() as inner:
            path_record.note("wgrad", "b")
    path_record.note("dgrad", "c")
    assert outer == {"dense/fprop": {"a"}, "expert/wgrad": {"b"}}
    assert inner == {"expert/wgrad": {"b"}}
    assert path_record.as_table({"k": {"b", "a"}}) == {"k": "a + b"}


def test_paths_text_and_code_checks():
    same = {"dense/fprop": "chunked", "expert/fprop": "chunked"}
    assert provenance.paths_text(same) == "chunked"
    mixed = {"dense/fprop": "chunked", "expert/fprop": "plain bfloat16"}
    assert provenance.paths_text(mixed) == "dense/fprop: chunked; expert/fprop: plain bfloat16"
    ok = {"a": {"git": {"commit": "c1", "dirty": []}}, "b": {"git": {"commit": "c1", "dirty": []}}}
    assert provenance.check_same_code(ok) == []
    bad = {
        "a": {"git": {"commit": "c1", "dirty": ["f.py"]}},
        "b": {"git": {"commit": "c2", "dirty": []}},
        "c": {},
    }
    problems = provenance.check_same_code(bad)
    assert any("modified tree (f.py)" in p for p in problems)
    assert any("record no commit" in p for p in problems)
    assert any("2 commits" in p for p in problems)
