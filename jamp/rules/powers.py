"""``square``, ``integer_pow`` and ``x * x``: float32 where the result is summed.

torch's autocast runs ``pow`` in float32. Squares matter where they are accumulated: a one-pass
variance ``E[x^2] - E[x]^2`` (Haiku's ``BatchNorm``, ``jnp.mean(x**2) - jnp.mean(x)**2``) sums
squares; rounded to bfloat16 first, ``E[x^2]`` can come out below ``E[x]^2`` (computed in float32)
and ``rsqrt(var + eps)`` is NaN. So ``square`` and ``integer_pow`` are in the fp32 table, but
apply it only where their result is summed (``Env.summed_result``: a ``reduce_sum``, ``cumsum``
or ``psum`` reached through reshapes and converts; a region, which cannot look ahead, recomputes
a square in float32 where a sum reads it: region_trace.LazySquare); elsewhere they run in the
dtype their operand arrives in, so the tanh-approximate ``gelu(x @ w)`` (``x**3``, an
``integer_pow``) stays bfloat16.
A ``mul`` of a value by itself is a square spelled ``x * x`` and is treated the same.
Removing the names from ``Policy.fp32`` makes them ordinary ops again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .. import _compat as compat
from ..interpreter import CATEGORY_RULES, Step, default_rule, fp32_rule, register


def _summed(step: Step) -> bool:
    return step.env.summed_result(step)


@register("square", "integer_pow")
def power_rule(step: Step) -> Sequence[Any]:
    category = step.policy.category(step.eqn.primitive.name)
    if category == "fp32" and not _summed(step):
        step.why = "inputs arrived in float32"  # (jamp.explain: not the fp32 table, unsummed)
        return default_rule(step)
    return CATEGORY_RULES.get(category, default_rule)(step)


@register("mul")
def mul_rule(step: Step) -> Sequence[Any]:
    """``x * x`` follows ``square``'s entry in the policy; any other product its own."""
    a, b = step.eqn.invars
    if (
        isinstance(a, compat.Var)
        and a is b
        and step.policy.category("square") == "fp32"
        and _summed(step)
    ):
        return fp32_rule(step)
    return CATEGORY_RULES.get(step.policy.category("mul"), default_rule)(step)
