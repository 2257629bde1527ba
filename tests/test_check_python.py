"""scripts/check_python.py: one line on a Python older than pyproject.toml's requires-python."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

from script_loader import load_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "check_python.py"


def _script():
    return load_script("check_python")


def test_the_minimum_is_pyprojects():
    spec = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    major, minor = _script().required()
    assert spec == f">={major}.{minor}"


def test_an_older_python_gets_one_line_naming_the_need_and_the_fix():
    check = _script()
    line = check.problem((3, 11, 7, "final", 0), "/usr/bin/python3", (3, 12))
    assert "\n" not in line
    assert line.startswith("fp8jax needs Python >= 3.12")
    assert "/usr/bin/python3 is 3.11.7" in line and "python3.12 -m venv .venv" in line
    assert check.problem((3, 12, 1, "final", 0), "py", (3, 12)) is None
    assert check.problem((4, 0, 0, "final", 0), "py", (3, 12)) is None


def test_it_exits_2_below_the_minimum_and_0_silently_at_it(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")
    # The same script against a pyproject that asks for more than this Python is.
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "check_python.py").write_text(SCRIPT.read_text())
    need = f"{sys.version_info.major}.{sys.version_info.minor + 1}"
    (tmp_path / "pyproject.toml").write_text(f'[project]\nrequires-python = ">={need}"\n')
    proc = subprocess.run(
        [sys.executable, str(tmp_path / "scripts" / "check_python.py")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and f"fp8jax needs Python >= {need}" in proc.stderr


def test_the_readmes_first_command_checks_the_python_before_pip():
    (block,) = re.findall(r"^```bash\n(.*?)^```$", (ROOT / "README.md").read_text(), re.S | re.M)[
        :1
    ]
    first = next(line for line in block.splitlines() if line and not line.startswith("#"))
    assert first.startswith("python scripts/check_python.py && python -m pip install -e ")


def test_the_script_parses_as_python_3_6():
    # It has to speak on the interpreter it refuses: no syntax newer than 3.6.
    import ast

    ast.parse(SCRIPT.read_text(), feature_version=(3, 6))
    probe = "if (n := 1):\n    pass\n"
    try:
        ast.parse(probe, feature_version=(3, 6))
    except SyntaxError:
        pass
    else:
        raise AssertionError("feature_version does not reject 3.8 syntax here")
