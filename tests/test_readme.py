"""The README's Python snippet runs as written and prints what the README shows."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
_NUMBER = re.compile(r"\d+\.\d+")


def _snippet_and_output(text: str) -> tuple[str, list[str]]:
    """The one ```python block and the plain ``` block that follows it (its output)."""
    (snippet,) = re.findall(r"^```python\n(.*?)^```$", text, flags=re.S | re.M)
    after = text[text.index(snippet) + len(snippet) + len("```") :]
    shown = re.search(r"^```\n(.*?)^```$", after, flags=re.S | re.M).group(1)
    return snippet, shown.splitlines()


def test_readme_python_snippet_runs_and_prints_what_it_says():
    snippet, shown = _snippet_and_output(README.read_text())
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(snippet, "README.md", "exec"), {"__name__": "readme"})
    printed = out.getvalue().splitlines()
    assert len(printed) == len(shown)
    for got, want in zip(printed, shown):
        # Same words; the errors' last printed digit may move with XLA's rounding.
        assert _NUMBER.sub("#", got) == _NUMBER.sub("#", want)
        for g, w in zip(_NUMBER.findall(got), _NUMBER.findall(want)):
            assert float(g) == pytest.approx(float(w), abs=2e-4), (got, want)
