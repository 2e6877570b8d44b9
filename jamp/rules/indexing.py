"""Scatters: rebuilt with the public ``lax`` functions so their combiner matches the new dtype.

A scatter's ``update_jaxpr`` param is the combiner traced at the original dtype; binding it with
operands of another dtype would lower a mismatched reduction, so the equalized operands go through
``lax.scatter_add`` and friends, which trace a fresh one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jax import lax

from .. import _compat as compat
from ..interpreter import Step, equalize_targets, keep_traced_rule, register

_PUBLIC = {
    "scatter": lax.scatter,
    "scatter-add": lax.scatter_add,
    "scatter-sub": lax.scatter_sub,
    "scatter-mul": lax.scatter_mul,
    "scatter-min": lax.scatter_min,
    "scatter-max": lax.scatter_max,
}


@register(*_PUBLIC)
def scatter_rule(step: Step) -> Sequence[Any]:
    name, params = step.eqn.primitive.name, step.params
    if name == "scatter" and params.get("update_jaxpr") is not None:
        return keep_traced_rule(step)  # x.at[i].apply(f): the combiner is user code
    # The buffer is the result's storage: a broadcast scalar (jnp.zeros(...).at[i].add(u)),
    # which elsewhere adapts, keeps its dtype as JAX's ``.at`` does, and narrower updates are
    # widened to it (torch's scatter_add promotes): duplicates accumulate in the buffer's dtype.
    operand, indices, updates = step.with_cast(equalize_targets(step, fixed=(0,)))
    with compat.equation_context(step.eqn):
        out = _PUBLIC[name](
            operand,
            indices,
            updates,
            params["dimension_numbers"],
            indices_are_sorted=params["indices_are_sorted"],
            unique_indices=params["unique_indices"],
            mode=params["mode"],
        )
    return [out]
