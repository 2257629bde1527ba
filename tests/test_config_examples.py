"""The tiny config's docstring shows what its command prints today.

The command runs for one step (the first step's loss does not depend on the run's
length: it is the loss of the initial parameters on the first batch), and its first
lines are compared with the docstring's: the mesh and compile lines as text with the
compile time left out (a machine's speed), the first step's loss to 0.01 (CPUs of other
makes differ in the last bits, not in the second decimal at step 1).
"""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _docstring_lines(path: Path) -> list[str]:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return [line.strip() for line in doc.splitlines()]


def _first(lines: list[str], prefix: str) -> str:
    found = [line for line in lines if line.startswith(prefix)]
    assert found, f"no line starting with {prefix!r}"
    return found[0]


def _step_one_loss(line: str) -> float:
    m = re.match(r"step 1/\d+ \| loss (\d+\.\d+) \|", line)
    assert m, line
    return float(m.group(1))


def test_tiny_config_docstring_matches_the_first_lines_it_prints(tmp_path):
    doc = _docstring_lines(ROOT / "configs" / "tiny.py")
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", FP8JAX_CACHE_DIR="")
    # The command as a user types it: one CPU device, whatever other tests simulate.
    env.pop("XLA_FLAGS", None)
    p = subprocess.run(
        [
            sys.executable,
            str(ROOT / "experiments" / "train.py"),
            "--config=configs/tiny.py",
            f"--workdir={tmp_path / 'run'}",
            "--config.steps=1",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    out = [line.strip() for line in p.stdout.splitlines()]

    assert out[0] == _first(doc, "mesh ")
    assert out[1] == _first(doc, "compiling the training step")
    compiled = re.compile(r"compiled the training step in [\d.]+ s \(with step 1\)")
    assert compiled.fullmatch(_first(doc, "compiled the training step in"))
    assert compiled.fullmatch(out[2]), out[2]
    assert abs(_step_one_loss(out[3]) - _step_one_loss(_first(doc, "step 1/"))) <= 0.01, (
        out[3],
        _first(doc, "step 1/"),
    )
    # The run ends by naming its workdir and what it keeps there, as the docstring says.
    assert out[-1].startswith(f"outputs in {tmp_path / 'run'}: checkpoints/")
    assert _first(doc, "outputs in ")
