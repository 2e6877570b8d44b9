"""Softmax-family composites (``jax.nn.softmax``, ``log_softmax``, ``logsumexp`` and the optax
losses built on them) from float32 inputs, as torch's autocast runs ``softmax``,
``log_softmax`` and ``cross_entropy``.

They all compute ``exp(x - max(x))``: ``exp`` and the sum are in the fp32 table, but the
subtraction before the ``exp`` is a promote-table op that would run in the dtype the logits
arrive in, and with float16 logits of +-40,000 ``x - max(x)`` overflows to -inf (the loss then
comes out inf or NaN). So a ``sub`` whose second operand is the max of its first (``reduce_max``
of the same value, seen through ``max`` with a constant, ``select_n`` with a constant,
``stop_gradient``, converts and broadcasts, as jnp and ``jax.nn`` write it) takes both operands in
float32, whether or not an ``exp`` follows (a region cannot look ahead, and the two forms must
agree; with float16 the shift overflows whatever comes next); the ``exp``, the sum and the
``log`` that follow are fp32-table ops already, and the composite returns float32 (torch's
``softmax`` under autocast does too).

The max runs in the dtype its operand arrives in (a max rounds nothing, so it is the same
number in float32); where the shift takes it in float32, it is computed again there from the
float32 operand, through the same steps (``MaxRecipe``), rather than converted: the program then
has the shape of a softmax written in float32 (convert, max, subtract), and the 16-bit max is
left unused (XLA drops it). With the 16-bit max converted, XLA's CPU compiler took 1-2% longer
on a transformer's train step (benchmarks/README.md, issue 33's thirty-ninth pass).

Why a pattern on the operations and not on the callee's name: the composites reach jamp in
different forms (``log_softmax`` as a ``jit`` named after it, ``softmax`` and ``logsumexp``
inlined into the caller's program, a ``custom_jvp`` in some JAX versions and flags, user code
writing ``x - x.max()`` by hand), while the arithmetic that overflows is the same in all of
them; a callee name would miss the inlined ones. The pattern is
learned backwards, from operations already seen (``interpreter.register_tracker``), so the region
form (which cannot look ahead) decides as ``autocast_transform`` does.

Removing ``exp`` from ``Policy.fp32`` turns this off too (the shift exists only for the exp).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import _compat as compat
from ..interpreter import (
    CATEGORY_RULES,
    F32,
    F64,
    SHAPE_ONLY,
    FactValue,
    Step,
    default_rule,
    is_float,
    register,
    register_tracker,
)

FACT = "max_of"  # Env.facts[FACT]: a value -> the variable it is the max of
# Operations a row's max goes through, in jnp and jax.nn, before it is subtracted.
_THROUGH = SHAPE_ONLY | {"max", "select_n", "stop_gradient", "convert_element_type", "copy"}


RECIPE = "max_recipe"  # Env.facts[RECIPE]: a max -> how to compute it again (MaxRecipe)
# The steps a recipe can take again in float32: they change no value of a max (a max with a
# scalar constant: jnp's ``initial=-inf``). A convert or a select_n ends the recipe: the shift
# converts such a max instead.
_RECOMPUTED_THROUGH = SHAPE_ONLY | {"max", "stop_gradient", "copy"}


@dataclasses.dataclass(frozen=True)
class MaxRecipe(FactValue):
    """How a max was computed from the value it is the max of (``FACT``): ``reduce_max``, then
    steps that change no value of it, each ``(primitive, params, operand index of the max,
    other operands: scalar constants)``. A value, not a variable: a decision's key holds it and
    a replay sets it again (``FactValue``)."""

    steps: tuple

    def then(self, eqn: Any, index: int, constants: tuple) -> MaxRecipe:
        """This recipe, then ``eqn`` with the max as operand ``index``, ``constants`` the rest."""
        params = tuple(compat.bind_params(eqn).items())
        return MaxRecipe((*self.steps, (eqn.primitive, params, index, constants)))

    def computed_from(self, operand: Any) -> Any:
        """The max of ``operand`` (float32) by the same steps, bound where the caller is."""
        value = operand
        dtype = compat.aval_of(operand).dtype
        for primitive, params, index, constants in self.steps:
            args = [np.asarray(c, dtype) for c in constants]
            args.insert(index, value)
            value = primitive.bind(*args, **dict(params))
        return value


def _max_of(step: Step) -> dict[Any, Any]:
    return step.env.facts.setdefault(FACT, {})


def _scalar_constant(step: Step, atom: Any) -> float | None:
    source = step.env.source(atom)
    if source is None or source.steps or np.ndim(source.base) != 0:
        return None
    try:
        return float(source.base)
    except TypeError:  # (a traced base: an eager region's constant)
        return None


def _recipe_step(step: Step, found: Any) -> MaxRecipe | None:
    """The recipe of this equation's output, from its operand's that is a max of ``found``."""
    eqn = step.eqn
    if eqn.primitive.name not in _RECOMPUTED_THROUGH:
        return None
    recipes = step.env.facts.get(RECIPE)
    if not recipes:
        return None
    facts = step.env.facts[FACT]
    index, recipe, constants = None, None, []
    for i, atom in enumerate(eqn.invars):
        if index is None and isinstance(atom, compat.Var) and facts.get(atom) is found:
            index, recipe = i, recipes.get(atom)
            continue
        constant = _scalar_constant(step, atom)
        if constant is None:
            return None
        constants.append(constant)
    if recipe is None:
        return None
    return recipe.then(eqn, index, tuple(constants))


@register_tracker
def track_max(step: Step, outs: Sequence[Any]) -> None:
    """Record which outputs are the max (over some axes) of which variable."""
    eqn, name = step.eqn, step.eqn.primitive.name
    if name != "reduce_max" and name not in _THROUGH:
        return
    if len(eqn.outvars) != 1 or not is_float(eqn.outvars[0].aval.dtype):
        return
    facts = step.env.facts.get(FACT)
    if name == "reduce_max":
        operand = eqn.invars[0]
        if isinstance(operand, compat.Var):
            _max_of(step)[eqn.outvars[0]] = operand
            step.env.facts.setdefault(RECIPE, {})[eqn.outvars[0]] = MaxRecipe(()).then(eqn, 0, ())
        return
    if not facts:
        return
    # Exactly one operand is a max; every other floating one is a constant (-inf, 0.0).
    found = None
    for i in step.floating():
        atom = eqn.invars[i]
        of = facts.get(atom) if isinstance(atom, compat.Var) else None
        if of is not None and found in (None, of):
            found = of
        elif step.env.source(atom) is None:
            return
    if found is not None:
        facts[eqn.outvars[0]] = found
        then = _recipe_step(step, found)
        if then is not None:
            step.env.facts[RECIPE][eqn.outvars[0]] = then


def _is_shift(step: Step) -> bool:
    """``x - max(x)``: the second operand is the max of the first."""
    facts = step.env.facts.get(FACT)
    if not facts:
        return False
    x, m = step.eqn.invars
    return isinstance(m, compat.Var) and isinstance(x, compat.Var) and facts.get(m) is x


@register("sub")
def sub_rule(step: Step) -> Sequence[Any]:
    """A softmax's shift ``x - max(x)`` in float32; any other ``sub`` by its table."""
    if step.state.enabled and "exp" in step.policy.fp32 and _is_shift(step):
        avals = step.avals()
        floating = step.floating()
        if not any(avals[i].dtype == F64 for i in floating):
            targets = {i: F32 for i in floating if np.dtype(avals[i].dtype) != F32}
            step.why = "softmax shift (x - max(x) before exp)"
            args = step.with_cast({i: F32 for i in targets if i != 1})
            if 1 in targets:
                args[1] = _max_in_float32(step, args)
            return step.bind(args)
    return CATEGORY_RULES.get(step.policy.category("sub"), default_rule)(step)


def _max_in_float32(step: Step, args: Sequence[Any]) -> Any:
    """The shift's max in float32: computed again from its float32 first operand (``args[0]``)
    where the region knows how (``MaxRecipe``), else its 16-bit value converted. Either is the
    same number."""
    recipes = step.env.facts.get(RECIPE)
    if not recipes or step.eqn.invars[1] not in recipes or compat.aval_of(args[0]).dtype != F32:
        return step.cast(1, F32)
    with compat.equation_context(step.eqn):
        return step.derive(1, _max_again, args)


def _max_again(env: Any, invars: Sequence[Any], args: Sequence[Any]) -> Any:
    """The shift's max computed from its float32 first operand (``args[0]``) by the recipe of
    its second (in the operation's key: ``facts_part``), as the rule and a replay make it."""
    return env.facts[RECIPE][invars[1]].computed_from(args[0])
