"""fp8jax's recipes in any Flax model, through Qwix's interception (``pip install fp8jax[qwix]``).

::

    rules = [Rule(module_path=r".*(embed|head|router).*", recipe=None),
             Rule(module_path=r".*", recipe="deepseek_v3")]
    model = qwix.quantize_model(model, QwixProvider(rules), *example_inputs)

``qwix.quantize_model`` makes the model's calls of ``jax.lax.dot_general``,
``jax.numpy.einsum`` (two operands), ``jax.lax.ragged_dot`` and
``jnp.matmul`` / ``@`` come here, with the path of the Flax module (NNX or
Linen) that made them (a Linen submodule applied at the root inside another
module, a tied head, gets its caller's path plus its name).  The first
:class:`~fp8jax.interop.rules.Rule` that matches the path and op name
decides (``@`` is a dot_general for the rules):

* recipe None, or no rule matches: the original op, bit for bit.
* a recipe: the op runs as :mod:`fp8jax.interop.ops` says, i.e. through
  ``fp8jax.dot_general`` / ``fp8jax.ragged_dot`` (Fprop, Dgrad and Wgrad as
  the recipe says, the same numbers as calling those functions).  Which
  operand is the weight is found among the calling module's parameters
  (:mod:`fp8jax.interop.weights`: followed back through casts and
  transposes under jit, grad and eagerly); a dot_general or einsum with no
  parameter operand (the attention core, softmax(QK^T)V) stays as the model
  wrote it, as DeepSeek-V3 keeps it in high precision.

Every decision is recorded in ``provider.coverage``
(:mod:`fp8jax.interop.coverage`: per op, forward and under grad, the recipe
or why none), which warns once when a GEMM a rule names runs unquantized.

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
import numpy as np
import qwix
from flax import linen, nnx
from qwix._src import aux_data
from qwix._src.utils import flax_util

from fp8jax.interop import ops
from fp8jax.interop.coverage import Coverage, Seen
from fp8jax.interop.einsum_dims import matmul_dims
from fp8jax.interop.rules import Rule
from fp8jax.interop.weights import find_weight, looks_like_a_weight
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
        self.coverage = Coverage()
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
            # ``@`` calls tensor_contractions.matmul, jnp.matmul is the same
            # function: both are routed here, with the caller's operands (the
            # dot_general inside matmul's own jit sees only its fresh tracers).
            "jax.numpy.matmul": self.matmul,
            "jax._src.numpy.tensor_contractions.matmul": self.matmul,
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

    # ------------------------------------------------------------------
    # Which rule, which weight: every decision goes to the coverage report
    # ------------------------------------------------------------------

    def _where(self, op_name: str) -> _Call:
        """The calling module, its path, the first matching rule and the op's id."""
        module = flax_util.get_current_module()
        path, note = _module_path(module)
        idx = next((i for i, r in enumerate(self.fp8_rules) if r.matches(path, op_name)), None)
        if idx is not None:
            # Qwix's own count, read by get_unused_rules().
            self._rule_matches[idx] += 1
        # Op ids as Qwix numbers them: per module and op name, from 0 in each call.
        key = module.scope if isinstance(module, linen.Module) else module
        count = aux_data.get(key, op_name + "_count", 0)
        aux_data.set(key, op_name + "_count", count + 1)
        rule = self.fp8_rules[idx] if idx is not None else None
        return _Call(module, path, note, rule, f"{op_name}{count}")

    def _decide(
        self, op_name: str, lhs, rhs, *, unsupported: str = "", weight_known: str = ""
    ) -> tuple[_Call, Recipe | None, str | None]:
        """(call, recipe to run or None, weight operand) for one op; recorded in ``coverage``."""
        call = self._where(op_name)
        named = call.rule.recipe if call.rule is not None else None
        weight, suspicious = None, False
        if named is None:
            why = "no rule" if call.rule is None else "rule: None"
        elif unsupported:
            why = f"unsupported: {unsupported}"
        elif weight_known:
            weight, why = "rhs", weight_known
        else:
            params = _params(call.module)
            found = find_weight(lhs, rhs, params)
            weight = found.operand
            why = f"{found.param} by {found.how}" if weight else found.how
            suspicious = weight is None and looks_like_a_weight(lhs, rhs, params) is not None
        recipe = named if weight is not None else None
        seen = Seen(
            path=call.path,
            op=call.op_id,
            shapes=tuple(tuple(np.shape(x)) for x in (lhs, rhs)),
            recipe=recipe.name if recipe is not None else None,
            why=why,
            path_note=call.note,
            named=named is not None,
        )
        self.coverage.add(_pass(lhs, rhs), seen, suspicious=suspicious)
        return call, recipe, weight

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
        call, recipe, weight = self._decide(
            "dot_general",
            lhs,
            rhs,
            unsupported="out_sharding" if out_sharding is not None else "",
        )
        if recipe is None:
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
            state=self._state(call.op_id, recipe),
            preferred_element_type=preferred_element_type,
        )
        self._record(call, stats)
        return y

    def matmul(self, a, b, *, precision=None, preferred_element_type=None, out_sharding=None):
        """``jnp.matmul`` / ``@``, seen with the caller's operands (a dot_general for the rules)."""
        dims = matmul_dims(np.shape(a), np.shape(b))
        if dims is None:
            self._decide("dot_general", a, b, unsupported="matmul with broadcast batch dimensions")
            return jnp.matmul(
                a,
                b,
                precision=precision,
                preferred_element_type=preferred_element_type,
                out_sharding=out_sharding,
            )
        # jnp.matmul promotes mixed dtypes first; equal dtypes keep the operands
        # themselves, so that a parameter is still recognized.
        dt = jnp.result_type(a, b)
        a, b = (x if getattr(x, "dtype", None) == dt else jnp.asarray(x, dt) for x in (a, b))
        dn, perm = dims
        y = self.dot_general(a, b, dn, precision, preferred_element_type, out_sharding=out_sharding)
        return y if perm is None else jnp.transpose(y, perm)

    def einsum(self, spec, *operands, **kwargs) -> jax.Array:
        unsupported = sorted(
            set(kwargs) - {"precision", "preferred_element_type", "_dot_general", "out_sharding"}
        )
        if kwargs.get("out_sharding") is not None:
            unsupported.append("out_sharding")
        two = len(operands) == 2 and isinstance(spec, str)
        if not two:
            # Not a GEMM fp8jax runs (one operand, three or more, or a path spec).
            return jax.numpy.einsum(spec, *operands, **kwargs)
        call, recipe, weight = self._decide("einsum", *operands, unsupported=", ".join(unsupported))
        if recipe is None:
            return jax.numpy.einsum(spec, *operands, **kwargs)
        y, stats = ops.einsum(
            spec,
            *operands,
            recipe,
            weight=weight,
            state=self._state(call.op_id, recipe),
            preferred_element_type=kwargs.get("preferred_element_type"),
        )
        self._record(call, stats)
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
        unsupported = [
            n
            for n, v in (
                ("group_offset", group_offset),
                ("out_sharding", kwargs.get("out_sharding")),
            )
            if v is not None
        ]
        # lax.ragged_dot's rhs is the (G, K, N) stack of the experts' weights.
        call, recipe, _ = self._decide(
            "ragged_dot",
            lhs,
            rhs,
            unsupported=", ".join(unsupported),
            weight_known="rhs: the experts' weights",
        )
        if recipe is None:
            return jax.lax.ragged_dot(
                lhs,
                rhs,
                group_sizes,
                precision=precision,
                preferred_element_type=preferred_element_type,
                group_offset=group_offset,
                **kwargs,
            )
        y, stats = ragged_dot_with_stats(
            lhs,
            rhs,
            group_sizes,
            recipe=recipe,
            state=self._state(call.op_id, recipe),
            preferred_element_type=preferred_element_type,
        )
        self._record(call, stats)
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

    def _record(self, call: _Call, stats) -> None:
        if not self.telemetry:
            return
        module = call.module
        name = f"{call.path}/{call.op_id}" if call.path else call.op_id
        if isinstance(module, linen.Module):
            module.sow("intermediates", TELEMETRY, {f"{name}/{k}": v for k, v in stats.items()})
        else:
            record(module, name, stats)


@dataclasses.dataclass(frozen=True)
class _Call:
    """One intercepted op: its module, path (and how found), matching rule and op id."""

    module: Any
    path: str
    note: str
    rule: Rule | None
    op_id: str


def _module_path(module) -> tuple[str, str]:
    """The calling module's path for the rules, and a note when it is not Flax's own.

    A Linen ``submodule.apply(variables, x)`` inside another module's call (a
    tied head: ``lm_head.apply({"params": {"kernel": embedding.T}}, h)``)
    runs the submodule as a new root, path ``()``.  Its path is then taken as
    the calling module's path plus the submodule's name, as if it had been
    called directly.
    """
    path = tuple(map(str, flax_util.get_current_module_path()))
    if not isinstance(module, linen.Module):
        return "/".join(path), ""
    stack = [m for m in linen.module._context.module_stack if m is not None and m.scope is not None]
    full: list[tuple[str, ...]] = []
    prefix: tuple[str, ...] = ()
    note = ""
    for j, m in enumerate(stack):
        if m.path == ():
            if j > 0 and m.name is not None:
                prefix = (*full[j - 1], str(m.name))
                caller = "/".join(full[j - 1]) or "<root>"
                note = f"{type(m).__name__}.apply at the root inside {caller}: path from its name"
            else:
                prefix, note = (), ""
        full.append((*prefix, *map(str, m.path)))
    return ("/".join(full[-1]) if full else "/".join(path)), note


def _params(module) -> dict[str, Any]:
    """The calling module's own parameters (not its submodules'), unboxed."""
    if isinstance(module, linen.Module):
        items = module.variables.get("params", {}).items()
    else:
        items = ((n, v) for n, v in vars(module).items() if isinstance(v, nnx.Param))
    out = {}
    for n, v in items:
        v = flax_util.unbox(v)
        if isinstance(v, jax.Array):
            out[n] = v
    return out


def _pass(*operands) -> str:
    """ "grad" when an operand is being differentiated (a primal / tangent pair), else "forward"."""
    differentiated = any(hasattr(x, "primal") and hasattr(x, "tangent") for x in operands)
    return "grad" if differentiated else "forward"
