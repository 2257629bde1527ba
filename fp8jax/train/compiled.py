"""The jitted step and evaluation functions a run uses, kept for the runs that follow.

A :class:`StepCache` maps everything a compiled step closes over (the config
fields a step computes with, the recipe, the model) to its jitted functions,
so a resumed run or another seed of the same config in the same process
reuses the compiled code.  ``train`` makes one per call unless given one;
a comparison hands one cache to all its runs.

What is *not* in the key, because a step does not depend on it: the seeds and
data (inputs), the logging, evaluation and checkpoint cadences, and
``steps``: the learning-rate schedule reads the run's length as an input of
the step, so a longer or shorter run is the same program (also for the
persistent compilation cache on disk).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable

import ml_collections

from fp8jax.models import ModelConfig
from fp8jax.recipes import Recipe
from fp8jax.train.run_log import to_jsonable

# Config fields that are inputs of a step or never reach it.
NOT_IN_STEP = (
    "seed",
    "data_seed",
    "data",
    "steps",
    "eval_every",
    "eval_batches",
    "eval_batch_size",
    "log_every",
    "checkpoint_every",
    "keep_checkpoints",
    "tensorboard",
    "final_window",
)


def step_key(config: ml_collections.ConfigDict, recipe: Recipe, mcfg: ModelConfig) -> str:
    """What a compiled step depends on, as a string (config fields minus ``NOT_IN_STEP``)."""
    cfg = {k: v for k, v in to_jsonable(config).items() if k not in NOT_IN_STEP}
    blob = {"config": cfg, "recipe": repr(recipe), "model": repr(mcfg)}
    return json.dumps(blob, sort_keys=True, default=str)


class StepCache:
    """Jitted functions (and what their trace recorded) by :func:`step_key`.

    The oldest entry goes once there are more than ``max_entries``.
    """

    def __init__(self, max_entries: int = 8):
        self.max_entries = int(max_entries)
        self._entries: OrderedDict[str, tuple] = OrderedDict()
        self._used: set[str] = set()

    def get(self, key: str, build: Callable[[], tuple]) -> tuple:
        """The entry stored under ``key``, built by ``build()`` the first time."""
        if key not in self._entries:
            if len(self._entries) >= self.max_entries:
                old, _ = self._entries.popitem(last=False)
                self._used.discard(old)
            self._entries[key] = build()
        return self._entries[key]

    def first_use(self, key: str) -> bool:
        """True the first time it is asked for ``key``: its step compiles on that run."""
        if key in self._used:
            return False
        self._used.add(key)
        return True

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)
