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

The max itself runs in the dtype its operand arrives in: a max rounds nothing, so it is the
same number in float32. Why a pattern on the operations and not on the callee's name: the
composites reach jamp in different forms (``log_softmax`` as a ``jit`` named after it,
``softmax`` and ``logsumexp`` inlined into the caller's program, a ``custom_jvp`` in some JAX
versions and flags, user code writing ``x - x.max()`` by hand), while the arithmetic that
overflows is the same in all of them; a callee name would miss the inlined ones. The pattern is
learned backwards, from operations already seen (``interpreter.register_tracker``), so the region
form (which cannot look ahead) decides as ``autocast_transform`` does.

Removing ``exp`` from ``Policy.fp32`` turns this off too (the shift exists only for the exp).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import _compat as compat
from ..interpreter import (
    CATEGORY_RULES,
    F32,
    F64,
    SHAPE_ONLY,
    Step,
    default_rule,
    is_float,
    register,
    register_tracker,
)

FACT = "max_of"  # Env.facts[FACT]: a value -> the variable it is the max of
# Operations a row's max goes through, in jnp and jax.nn, before it is subtracted.
_THROUGH = SHAPE_ONLY | {"max", "select_n", "stop_gradient", "convert_element_type", "copy"}


def _max_of(step: Step) -> dict[Any, Any]:
    return step.env.facts.setdefault(FACT, {})


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
            return step.bind(step.with_cast(targets))
    return CATEGORY_RULES.get(step.policy.category("sub"), default_rule)(step)
