"""fp8jax's recipes in any Flax model, through Qwix's interception (``pip install fp8jax[qwix]``).

::

    rules = [Rule(module_path=r".*(embed|head|router).*", recipe=None),
             Rule(module_path=r".*", recipe="deepseek_v3")]
    model = qwix.quantize_model(model, QwixProvider(rules), *example_inputs)

``qwix.quantize_model`` makes the model's calls of ``jax.lax.dot_general``,
``jax.numpy.einsum`` (two operands) and ``jax.lax.ragged_dot`` come here,
with the path of the Flax module (NNX or Linen) that made them.  The first
:class:`~fp8jax.interop.rules.Rule` that matches the path and op name
decides:

* recipe None, or no rule matches: the original op, bit for bit.
* a recipe: the op runs as :mod:`fp8jax.interop.ops` says, i.e. through
  ``fp8jax.dot_general`` / ``fp8jax.ragged_dot`` (Fprop, Dgrad and Wgrad as
  the recipe says, the same numbers as calling those functions).  Which
  operand is the weight is found from the calling module's parameters
  (Qwix's ``find_param``); a dot_general or einsum with no parameter operand
  (the attention core, softmax(QK^T)V) stays as the model wrote it, as
  DeepSeek-V3 keeps it in high precision.

Delayed-scaling recipes keep one :class:`~fp8jax.nn.FP8State` per op in the
calling module, in the variable collection ``"fp8_state"`` (NNX attribute /
Linen collection ``<op>_fp8_state``).  Its gradient is the updated state
("overwrite with gradient"): a train step differentiates with respect to it
and assigns the gradient, e.g. in NNX

    grads = nnx.grad(loss_fn, argnums=nnx.DiffState(0, nnx.Any(nnx.Param, FP8State)))(model, x)
    nnx.update(model, grads.filter(FP8State))      # the one line; optimize grads.filter(nnx.Param)

and in Linen ``variables["fp8_state"] = grads["fp8_state"]`` with ``grads``
taken with respect to ``{"params", "fp8_state"}``.  Online recipes
(deepseek_v3, current_tensor, rowwise, ...) have no state.

Telemetry: each routed op sows its forward operands' amax / saturated /
flushed fractions (:mod:`fp8jax.telemetry`) under ``"<module path>/<op
id>/x"`` and ``".../w"``: NNX ``nnx.Intermediate`` read with
:func:`fp8jax.nn.recording.capture` (outside it nothing is sown, so a jitted
train step keeps one module structure); Linen collection ``"intermediates"``
(``apply(..., mutable=["intermediates"])``), key ``fp8_telemetry``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import qwix
from flax import linen, nnx
from qwix._src.utils import flax_util

from fp8jax.interop import ops
from fp8jax.interop.rules import Rule
from fp8jax.nn.recording import TELEMETRY, record
from fp8jax.nn.variables import FP8State
from fp8jax.ragged_dot import ragged_dot_with_stats
from fp8jax.recipes import Recipe, needs_state
from fp8jax.scaling import init_delayed_gemm_state

STATE_COLLECTION = "fp8_state"
nnx.register_variable_name(STATE_COLLECTION, FP8State, overwrite=True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _QwixRule(qwix.QuantizationRule):
    """Qwix's rule (module path and op names, matched by Qwix) carrying fp8jax's rule."""

    fp8_rule: Rule | None = None


class QwixProvider(qwix.QuantizationProvider):
    """A Qwix provider that runs the matched GEMMs through fp8jax recipes (module docstring).

    Args:
      rules: :class:`~fp8jax.interop.Rule` list, first match wins.
      telemetry: sow each routed op's operand statistics (free under jit
        when unused).
    """

    def __init__(self, rules: Sequence[Rule], *, telemetry: bool = True):
        rules = tuple(rules)
        for r in rules:
            if not isinstance(r, Rule):
                raise TypeError(f"QwixProvider takes fp8jax.interop.Rule objects, got {r!r}")
        self.fp8_rules = rules
        self.telemetry = telemetry
        super().__init__(
            [_QwixRule(module_path=r.module_path, op_names=r.op_names, fp8_rule=r) for r in rules]
        )

    # ------------------------------------------------------------------
    # Interception
    # ------------------------------------------------------------------

    def get_intercept_map(self):
        return super().get_intercept_map() | {
            "jax.lax.dot_general": self.dot_general,
            "jax.numpy.einsum": self.einsum,
            "jax.lax.ragged_dot": self.ragged_dot,
        }

    def process_model_inputs(self, model, model_args, model_kwargs):
        # jnp.matmul (and so ``@``) is itself jitted: a trace cached outside
        # interception would run a quantized model's matmuls unquantized, and
        # one cached inside would run a plain model's in FP8.  Dropping the
        # cache on entering and on leaving keeps each side's own traces.
        jnp.matmul.clear_cache()
        return super().process_model_inputs(model, model_args, model_kwargs)

    def process_model_output(self, method_name, model_output):
        jnp.matmul.clear_cache()
        return super().process_model_output(method_name, model_output)

    def _recipe(self, op_name: str) -> tuple[Recipe | None, str]:
        rule, op_id = self._get_current_rule_and_op_id(op_name)
        recipe = rule.fp8_rule.recipe if rule is not None else None
        return recipe, op_id

    def dot_general(
        self,
        lhs,
        rhs,
        dimension_numbers,
        precision=None,
        preferred_element_type=None,
        *,
        out_sharding=None,
    ) -> jax.Array:
        recipe, op_id = self._recipe("dot_general")
        weight = _weight_operand(lhs, rhs) if recipe is not None else None
        if weight is None or out_sharding is not None:
            return jax.lax.dot_general(
                lhs,
                rhs,
                dimension_numbers,
                precision=precision,
                preferred_element_type=preferred_element_type,
                out_sharding=out_sharding,
            )
        y, stats = ops.dot_general(
            lhs,
            rhs,
            dimension_numbers,
            recipe,
            weight=weight,
            state=self._state(op_id, recipe),
            preferred_element_type=preferred_element_type,
        )
        self._record(op_id, stats)
        return y

    def einsum(self, spec, *operands, **kwargs) -> jax.Array:
        recipe, op_id = self._recipe("einsum")
        weight = None
        if recipe is not None and len(operands) == 2 and isinstance(spec, str):
            weight = _weight_operand(*operands)
        unsupported = set(kwargs) - {
            "precision",
            "preferred_element_type",
            "_dot_general",
            "out_sharding",
        }
        if weight is None or unsupported or kwargs.get("out_sharding") is not None:
            return jax.numpy.einsum(spec, *operands, **kwargs)
        y, stats = ops.einsum(
            spec,
            *operands,
            recipe,
            weight=weight,
            state=self._state(op_id, recipe),
            preferred_element_type=kwargs.get("preferred_element_type"),
        )
        self._record(op_id, stats)
        return y

    def ragged_dot(
        self,
        lhs,
        rhs,
        group_sizes,
        precision=None,
        preferred_element_type=None,
        group_offset=None,
        **kwargs,
    ) -> jax.Array:
        recipe, op_id = self._recipe("ragged_dot")
        if recipe is None or group_offset is not None or kwargs.get("out_sharding") is not None:
            return jax.lax.ragged_dot(
                lhs,
                rhs,
                group_sizes,
                precision=precision,
                preferred_element_type=preferred_element_type,
                group_offset=group_offset,
                **kwargs,
            )
        # lax.ragged_dot's rhs is the (G, K, N) stack of the experts' weights.
        y, stats = ragged_dot_with_stats(
            lhs,
            rhs,
            group_sizes,
            recipe=recipe,
            state=self._state(op_id, recipe),
            preferred_element_type=preferred_element_type,
        )
        self._record(op_id, stats)
        return y

    # ------------------------------------------------------------------
    # State and telemetry, held by the calling module
    # ------------------------------------------------------------------

    def _state(self, op_id: str, recipe: Recipe):
        if not needs_state(recipe):
            return None
        var = flax_util.get_or_create_variable(
            STATE_COLLECTION, f"{op_id}_fp8_state", lambda: init_delayed_gemm_state(recipe)
        )
        return var.get_value() if isinstance(var, nnx.Variable) else var.value

    def _record(self, op_id: str, stats) -> None:
        if not self.telemetry:
            return
        module = flax_util.get_current_module()
        path = "/".join(map(str, flax_util.get_current_module_path()))
        name = f"{path}/{op_id}" if path else op_id
        if isinstance(module, linen.Module):
            module.sow("intermediates", TELEMETRY, {f"{name}/{k}": v for k, v in stats.items()})
        else:
            record(module, name, stats)


def _weight_operand(lhs: Any, rhs: Any) -> str | None:
    """ "rhs" / "lhs": which operand is a parameter of the calling module; None: neither."""
    try:
        if flax_util.find_param(rhs) is not None:
            return "rhs"
        if flax_util.find_param(lhs) is not None:
            return "lhs"
    except ValueError:
        # Qwix's shape heuristic found several candidate parameters.
        return None
    return None
