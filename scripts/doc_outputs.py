"""Run the shell examples of a markdown page and check or rewrite their outputs.

    python scripts/doc_outputs.py docs/toolkit.md            # check: exit 1 and a diff if stale
    python scripts/doc_outputs.py docs/toolkit.md --write    # rewrite the outputs in place

An example is a fenced block without a language whose lines start with
``$ `` (a command, continued over lines while a quote is open) followed by
the output it printed (stdout and stderr together).  The commands of a page
run in order, in one scratch directory (files made by one example serve the
next), with ``fp8jax`` meaning this checkout's ``python -m
fp8jax.toolkit.cli``.  The scratch directory's path is printed as
``/tmp/doc``.

Checking compares words exactly and numbers to what they can honestly
differ by between runs and machines: the last printed digit or 0.1%,
whichever is larger (integers exactly).  Fields that measure time on the machine (seconds,
MB/s, the subnormal speed table) and the CPU's name are not compared.  A
line ``...`` in a page's output stands for any number of lines (an output
shown in part); ``--write`` leaves such outputs for a person to redo.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRATCH = "/tmp/doc"
_FENCE = re.compile(r"^```[ \t]*$")
_END = "@@fp8jax-doc-example-end@@"
ELISION = "..."
_NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")
# Measured times and rates, and the machine's name: never compared.
_VOLATILE = [
    re.compile(r"[\d.]+ MB/s"),
    re.compile(r"in [\d.]+ s \([\d.]+ s since the command started\)"),
    re.compile(r"(normal|subnormal)\s+[\d.]+ ms"),
    re.compile(r"ratio\s+[\d.]+x"),
    re.compile(r"\(measured now on this machine, .*\)"),
]


@dataclass
class Example:
    command: str
    output: list[str]
    line: int  # 0-based line of the command in the page


def parse(lines: list[str]) -> list[tuple[int, int, list[Example]]]:
    """(first line inside the fence, line of the closing fence, examples) of each shell block."""
    blocks = []
    i = 0
    while i < len(lines):
        if not _FENCE.match(lines[i]):
            i += 1
            continue
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        body = lines[i + 1 : j]
        if body and body[0].startswith("$ "):
            blocks.append((i + 1, j, _examples(body, i + 1)))
        i = j + 1
    return blocks


def _complete(command: str) -> bool:
    try:
        shlex.split(command)
    except ValueError:
        return False
    return True


def _examples(body: list[str], first: int) -> list[Example]:
    out: list[Example] = []
    k = 0
    while k < len(body):
        start = k
        command = body[k][2:]
        k += 1
        while not _complete(command) and k < len(body):
            command += "\n" + body[k]
            k += 1
        output = []
        while k < len(body) and not body[k].startswith("$ "):
            output.append(body[k])
            k += 1
        out.append(Example(command, output, first + start))
    return out


def run(examples: list[Example], scratch: Path) -> list[list[str]]:
    """Each example's output lines (stdout + stderr, trailing blank lines dropped)."""
    script = ['fp8jax() { python -m fp8jax.toolkit.cli "$@"; }']
    for ex in examples:
        # The status of the example survives the marker, for a following `echo $?`.
        script += [ex.command, f"__s=$?; printf '\\n{_END}\\n'; ( exit $__s )"]
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    env.pop("COLUMNS", None)
    res = subprocess.run(
        ["bash", "-c", "\n".join(script)],
        cwd=scratch,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=1800,
    )
    text = res.stdout.replace(str(scratch.resolve()), SCRATCH).replace(str(scratch), SCRATCH)
    parts = text.split(f"\n{_END}\n")[: len(examples)]
    outs = []
    for p in parts:
        lines = p.split("\n")
        while lines and not lines[-1].strip():
            lines.pop()
        outs.append(lines)
    return outs


def _unit(number: str) -> float:
    """One unit in the last printed digit of a number."""
    mant = re.split(r"[eE]", number)[0]
    exp = int(number[len(mant) + 1 :]) if len(mant) < len(number) else 0
    decimals = len(mant.split(".")[1]) if "." in mant else 0
    return 10.0 ** (exp - decimals)


def _mask(line: str) -> str:
    for pat in _VOLATILE:
        line = pat.sub("~", line)
    return line


def same(want: str, got: str) -> bool:
    """Same words; each number within its last printed digit or 0.1% (volatile fields masked)."""
    want, got = _mask(want), _mask(got)
    if _NUMBER.sub("#", want) != _NUMBER.sub("#", got):
        return False
    for w, g in zip(_NUMBER.findall(want), _NUMBER.findall(got)):
        if not re.search(r"[.eE]", w + g):
            if w != g:  # counts, sizes, exit codes: exact
                return False
            continue
        tol = max(_unit(w), _unit(g), 1e-3 * abs(float(w)))
        if abs(float(w) - float(g)) > tol * (1 + 1e-9):
            return False
    return True


def matches(want: list[str], got: list[str]) -> bool:
    """Whether ``got`` is the output ``want`` shows (``...`` lines: any lines in between)."""
    if ELISION not in want:
        return len(want) == len(got) and all(same(w, g) for w, g in zip(want, got))
    parts: list[list[str]] = [[]]
    for line in want:
        if line == ELISION:
            parts.append([])
        else:
            parts[-1].append(line)
    head, *middle, tail = parts
    if len(head) + len(tail) > len(got):
        return False
    if not matches(head, got[: len(head)]) or not matches(tail, got[len(got) - len(tail) :]):
        return False
    pos, end = len(head), len(got) - len(tail)
    for part in middle:
        while pos + len(part) <= end and not matches(part, got[pos : pos + len(part)]):
            pos += 1
        if pos + len(part) > end:
            return False
        pos += len(part)
    return True


def _strip(lines: list[str]) -> list[str]:
    lines = list(lines)
    while lines and not lines[-1].strip():
        lines.pop()
    return lines


def check_page(path: Path, write: bool = False) -> list[str]:
    """Differences (unified-diff lines) between the page's outputs and a fresh run; rewrites if asked."""
    lines = path.read_text(encoding="utf-8").split("\n")
    blocks = parse(lines)
    examples = [ex for _, _, exs in blocks for ex in exs]
    with tempfile.TemporaryDirectory() as d:
        outs = run(examples, Path(d))
    problems: list[str] = []
    new_lines = list(lines)
    it = iter(outs)
    # Rebuild from the last block up, so that earlier line numbers stay valid.
    rebuilt = []
    for start, end, exs in blocks:
        body = []
        for ex in exs:
            got = next(it)
            want = _strip(ex.output)
            fresh = got
            if not matches(want, got):
                problems += [f"{path}:{ex.line + 1}: $ {ex.command.splitlines()[0]}"]
                problems += list(difflib.unified_diff(want, got, "page", "now", lineterm="", n=1))
                if ELISION in want:
                    problems.append(f"{path}:{ex.line + 1}: shown in part: redo it by hand")
                    fresh = want
            else:
                fresh = want  # unchanged within what may vary: keep the page's text
            body += [f"$ {ex.command}", *fresh]
            if ex.output and not ex.output[-1].strip():
                body.append("")  # keep the page's blank line between examples
        rebuilt.append((start, end, body))
    for start, end, body in reversed(rebuilt):
        new_lines[start:end] = body
    if write and problems:
        path.write_text("\n".join(new_lines), encoding="utf-8")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pages", nargs="+", type=Path)
    ap.add_argument("--write", action="store_true", help="rewrite stale outputs in place")
    args = ap.parse_args(argv)
    stale = 0
    for page in args.pages:
        problems = check_page(page, write=args.write)
        if problems:
            stale += 1
            print("\n".join(problems))
            print(f"{page}: {'rewritten' if args.write else 'stale outputs'}")
        else:
            print(f"{page}: every output matches its command")
    return 1 if stale and not args.write else 0


if __name__ == "__main__":
    sys.exit(main())
