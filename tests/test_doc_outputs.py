"""scripts/doc_outputs.py: the checker of the docs' shell examples, and docs/toolkit.md itself."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("doc_outputs", ROOT / "scripts" / "doc_outputs.py")
doc_outputs = importlib.util.module_from_spec(_spec)
sys.modules["doc_outputs"] = doc_outputs
_spec.loader.exec_module(doc_outputs)


def test_numbers_may_move_by_their_last_digit_words_may_not():
    same = doc_outputs.same
    assert same("rel.err 2.471e-03  52.1", "rel.err 2.472e-03  52.0")
    assert not same("rel.err 2.471e-03  52.1", "rel.err 2.481e-03  52.1")
    assert not same("deepseek_v3: activation", "deepseek_v3: activation/gradient")
    assert not same("0 cards", "1 cards")
    # Times and rates are the machine's, not the software's.
    assert same("16.2% 0.1/0.7 MB 345.4 MB/s x", "16.2% 0.1/0.7 MB 9.0 MB/s x")
    assert same(
        "to d in 0.08 s (2.77 s since the command started)",
        "to d in 5.38 s (14.99 s since the command started)",
    )
    assert not same("16.2% 0.1/0.7 MB 345.4 MB/s x", "21.5% 0.1/0.7 MB 345.4 MB/s x")


def test_elided_outputs_match_in_order():
    m = doc_outputs.matches
    got = ["a", "b", "c", "d", "e"]
    assert m(["a", "...", "c", "...", "e"], got)
    assert m(["...", "d"], got[:4]) and m(["a", "..."], got)
    assert not m(["a", "...", "d", "...", "c"], got)
    assert not m(["a", "b"], got) and m(got, got)


def test_check_page_runs_examples_in_one_directory_and_rewrites(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "Text.\n\n```\n$ echo 'x = 1.5' > f.txt; cat f.txt\nx = 1.5\n$ false; echo \"status $?\"\n"
        "status 1\n$ python -c \"\nprint('two',\n  2)\n\"\ntwo 3\n```\n\n```python\n$ not run\n```\n"
    )
    problems = doc_outputs.check_page(page)
    assert problems[0].endswith(':8: $ python -c "') and "+two 2" in problems
    assert len([p for p in problems if p.startswith(str(page))]) == 1
    doc_outputs.check_page(page, write=True)
    assert "two 2\n```" in page.read_text() and "$ not run" in page.read_text()
    assert doc_outputs.check_page(page) == []


@pytest.mark.slow
def test_toolkit_page_outputs_are_what_their_commands_print():
    # Every command of docs/toolkit.md (minutes on 2 busy cores: behind -m slow;
    # `python scripts/doc_outputs.py docs/toolkit.md` runs the same check).
    problems = doc_outputs.check_page(ROOT / "docs" / "toolkit.md")
    assert problems == [], "\n".join(problems[:40])
