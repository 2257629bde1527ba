"""What the provider did with every GEMM it saw: the coverage report and its warnings.

Each intercepted op is recorded once per pass, keyed by (module path, op id):
"forward" when no operand is being differentiated, "grad" when one is (inside
``jax.grad`` / ``value_and_grad`` / ``vjp``, eager or jitted).  A record says
which recipe ran, or why none did:

* ``no rule`` / ``rule: None``: no rule matched, or the matching rule keeps
  the op as the model wrote it (both intended);
* ``no parameter operand``: neither operand is a parameter of the calling
  module (the attention core; intended);
* ``ambiguous: ...``: several parameters could be the weight, none was taken;
* ``unsupported: ...``: an argument fp8jax's op does not take (``out_sharding``,
  ``group_offset``, ...);

and where the module path came from when the op ran inside a Linen
``module.apply`` at the root (a tied head; see ``path_note``).

:func:`warn_once` raises a :class:`CoverageWarning` the first time a GEMM
whose rule names a recipe runs unquantized for a reason other than "no
parameter operand" (and for that one too when a parameter of the operand's
size exists: a weight that could not be traced back), and the first time the
forward and the gradient pass of one GEMM disagree.
"""

from __future__ import annotations

import dataclasses
import warnings

PASSES = ("forward", "grad")


class CoverageWarning(UserWarning):
    """A GEMM a rule names runs unquantized, or its forward and backward differ."""


@dataclasses.dataclass(frozen=True)
class Seen:
    """One intercepted op in one pass.

    Attributes:
      path: module path the rules matched ("/"-joined).
      op: op id within the module (``dot_general0``, ``einsum1``, ...).
      shapes: the operands' shapes.
      recipe: name of the recipe that ran, or None (the op as written).
      why: how the weight was found (``kernel by traced``) when a recipe ran,
        otherwise why none ran (module docstring).
      path_note: "" or how ``path`` was found (a Linen apply at the root).
      named: True when the matching rule names a recipe.
    """

    path: str
    op: str
    shapes: tuple[tuple[int, ...], ...]
    recipe: str | None
    why: str
    path_note: str = ""
    named: bool = False


class Coverage:
    """Every op a provider saw, by pass; see the module docstring."""

    def __init__(self) -> None:
        self.seen: dict[tuple[str, str, str], Seen] = {}
        self._warned: set[tuple[str, str, str]] = set()

    def add(self, pass_: str, s: Seen, *, suspicious: bool = False) -> None:
        """Record ``s`` for ``pass_`` and warn (once) as the module docstring says."""
        self.seen[(pass_, s.path, s.op)] = s
        if s.named and s.recipe is None and (suspicious or s.why != "no parameter operand"):
            self._warn(
                "unquantized",
                s,
                f"{s.path or '<root>'}/{s.op} {_shapes(s.shapes)}: a rule names a recipe "
                f"but the {pass_} GEMM runs unquantized ({s.why})",
            )
        other = self.seen.get(("grad" if pass_ == "forward" else "forward", s.path, s.op))
        if other is not None and other.recipe != s.recipe:
            self._warn(
                "disagree",
                s,
                f"{s.path or '<root>'}/{s.op}: forward and grad differ "
                f"({_status(self.seen.get(('forward', s.path, s.op)))} vs "
                f"{_status(self.seen.get(('grad', s.path, s.op)))})",
            )

    def _warn(self, reason: str, s: Seen, message: str) -> None:
        if (reason, s.path, s.op) in self._warned:
            return
        self._warned.add((reason, s.path, s.op))
        warnings.warn(message, CoverageWarning, stacklevel=4)

    def rows(self) -> list[dict]:
        """One dict per (path, op): shapes, and per pass the recipe and the reason."""
        keys = sorted({(p, o) for _, p, o in self.seen})
        out = []
        for path, op in keys:
            by_pass = {ps: self.seen.get((ps, path, op)) for ps in PASSES}
            first = next(s for s in by_pass.values() if s is not None)
            row = {"path": path, "op": op, "shapes": first.shapes, "path_note": first.path_note}
            for ps, s in by_pass.items():
                row[ps] = None if s is None else {"recipe": s.recipe, "why": s.why}
            out.append(row)
        return out

    def quantized(self, pass_: str) -> list[tuple[str, str]]:
        """(path, op) of the GEMMs that ran a recipe in ``pass_``."""
        return sorted(
            (s.path, s.op) for (ps, _, _), s in self.seen.items() if ps == pass_ and s.recipe
        )

    def table(self) -> str:
        """The report as a fixed-width text table (one line per op)."""
        lines = [f"{'module path / op':40} {'operands':24} {'forward':32} grad"]
        for r in self.rows():
            name = f"{r['path'] or '<root>'}/{r['op']}"
            fw, gr = (_status(r[ps]) for ps in PASSES)
            note = f"  [{r['path_note']}]" if r["path_note"] else ""
            lines.append(f"{name:40} {_shapes(r['shapes']):24} {fw:32} {gr}{note}")
        return "\n".join(lines)


def _shapes(shapes) -> str:
    return " x ".join("(" + ",".join(map(str, s)) + ")" for s in shapes)


def _status(s) -> str:
    if s is None:
        return "-"
    recipe, why = (s.recipe, s.why) if isinstance(s, Seen) else (s["recipe"], s["why"])
    return f"{recipe} ({why})" if recipe else f"none: {why}"
