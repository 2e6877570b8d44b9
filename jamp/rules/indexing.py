"""Scatters: rebuilt with the public ``lax`` functions so their combiner matches the new dtype.

A scatter's ``update_jaxpr`` param is the combiner traced at the original dtype; binding it with
operands of another dtype would lower a mismatched reduction, so the equalized operands go through
``lax.scatter_add`` and friends, which trace a fresh one. A scatter-add (or -sub) into a 16-bit
buffer accumulates in float32 and rounds once into the buffer's dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from jax import lax

from .. import _compat as compat
from ..interpreter import F32, Step, equalize_targets, is_float, keep_traced_rule, register

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
    if not step.floating():
        return keep_traced_rule(step)  # integers, booleans, typed PRNG keys: nothing to cast
    # The buffer is the result's storage: a broadcast scalar (jnp.zeros(...).at[i].add(u)),
    # which elsewhere adapts, keeps its dtype as JAX's ``.at`` does, and narrower updates are
    # widened to it (torch's scatter_add promotes): duplicates accumulate in the buffer's dtype,
    # or in float32 where that is a 16-bit one (below).
    targets = equalize_targets(step, fixed=(0,))
    dtype = np.dtype(targets.get(0, step.aval(0).dtype))
    # A sum over repeated indices (jax.ops.segment_sum, a gather's gradient) in a 16-bit buffer
    # rounds after every addition: 4096 messages into one node summed to 256 in bfloat16 where
    # float32 gives 2039. It accumulates in float32 and rounds once, as a matmul does.
    accumulate = (
        name in _ACCUMULATING
        and step.state.enabled  # (a disabled region runs it as traced)
        and step.policy.category(name) == "promote"  # (a policy that moved it elsewhere)
        and not params["unique_indices"]
        and _narrow(dtype)
    )
    if accumulate:
        targets = {0: F32, 2: F32}
    operand, indices, updates = step.with_cast(targets)
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
        if accumulate:
            out = compat.convert(out, dtype)
    return [out]


_ACCUMULATING = frozenset({"scatter-add", "scatter-sub"})


def _narrow(dtype: np.dtype) -> bool:
    return is_float(dtype) and dtype.itemsize < 4
