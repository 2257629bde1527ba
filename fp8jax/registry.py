"""Recipe names: the presets of :mod:`fp8jax.recipes` and the variants of :mod:`fp8jax.variants`.

The one registry configs, comparisons, benchmarks and interop rules resolve a
recipe name in.  It sits above both modules it lists (the variants are built
from the presets), so the imports run one way: recipes <- variants <- registry.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable

from fp8jax.recipes import PRESETS, Recipe
from fp8jax.variants import VARIANTS

RECIPES: dict[str, Callable[[], Recipe]] = {**PRESETS, **VARIANTS}


def get(name: str) -> Recipe:
    """The recipe named ``name``: a preset (``PRESETS``) or a study variant (``VARIANTS``).

    An unknown name raises ValueError with the closest known name and the list.
    """
    try:
        return RECIPES[name]()
    except KeyError:
        close = difflib.get_close_matches(name, list(RECIPES), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(
            f"unknown recipe {name!r}; {hint}known: {', '.join(sorted(RECIPES))}"
        ) from None
