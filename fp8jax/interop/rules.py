"""Which recipe a GEMM of someone else's model runs with: rules by module path.

A :class:`Rule` matches the path of the module that calls an op (Flax's
path, joined with "/", e.g. ``layers/0/attn/q_proj``) with a regular
expression (``re.fullmatch``) and, optionally, the op's name; the first
matching rule wins.  Its recipe is a preset name, a
:class:`~fp8jax.recipes.Recipe`, or None: "leave this op as the model wrote
it" (the original ``lax`` / ``jnp`` call, bit for bit).  An op no rule
matches is also left as it is.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from fp8jax import registry
from fp8jax.recipes import Recipe

OPS = ("dot_general", "einsum", "ragged_dot")


def resolve_recipe(recipe: str | Recipe | None) -> Recipe | None:
    """A preset name, a Recipe or None -> Recipe or None (unknown names: ValueError)."""
    if recipe is None or isinstance(recipe, Recipe):
        return recipe
    if isinstance(recipe, str):
        return registry.get(recipe)
    raise TypeError(f"recipe must be a preset name, a Recipe or None, got {type(recipe).__name__}")


@dataclasses.dataclass(frozen=True)
class Rule:
    """One rule: ops of modules whose path fully matches ``module_path`` run ``recipe``.

    Args:
      module_path: regular expression, matched with ``re.fullmatch`` against
        the module path ("/"-joined; the root module's path is "").
      recipe: preset name (``fp8jax.recipes.PRESETS``), Recipe, or None for
        "leave in the model's own precision".  Stored resolved (a Recipe or
        None).
      op_names: the ops the rule applies to, a subset of
        ("dot_general", "einsum", "ragged_dot"); empty means all three.
    """

    module_path: str = ".*"
    recipe: str | Recipe | None = None
    op_names: Sequence[str] = ()

    def __post_init__(self) -> None:
        try:
            re.compile(self.module_path)
        except re.error as e:
            raise ValueError(
                f"Rule: module_path {self.module_path!r} is not a regex: {e}"
            ) from None
        names = (self.op_names,) if isinstance(self.op_names, str) else tuple(self.op_names)
        unknown = [n for n in names if n not in OPS]
        if unknown:
            raise ValueError(f"Rule: unknown op_names {unknown}; ops: {OPS}")
        # Frozen dataclass: normalized fields are set once, here.
        object.__setattr__(self, "op_names", names)
        object.__setattr__(self, "recipe", resolve_recipe(self.recipe))

    def matches(self, module_path: str, op_name: str) -> bool:
        return re.fullmatch(self.module_path, module_path) is not None and (
            not self.op_names or op_name in self.op_names
        )


def first_match(rules: Sequence[Rule], module_path: str, op_name: str) -> Rule | None:
    """The first rule matching (module_path, op_name), or None."""
    return next((r for r in rules if r.matches(module_path, op_name)), None)
