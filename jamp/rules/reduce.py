"""``reduce`` and ``reduce_window`` with a computation of the user's (``lax.reduce(x, init, f,
dims)`` that JAX cannot turn into ``reduce_max`` and friends): the computation is traced at the
init values' dtypes, so the operands run in those.

Elsewhere a primitive whose params encode its operands' dtypes keeps its traced dtypes
(``keep_traced_rule``). In a region the traced dtype of a value the policy made 16-bit is that
16-bit dtype (the region sees the bind, not the program as written), while the init value and
the computation stay float32: JAX then refuses the mixed operands. The init values' traced
dtypes are the program's in both forms.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..interpreter import Step, is_float, register


@register("reduce", "reduce_window")
def reduce_rule(step: Step) -> Sequence[Any]:
    half = len(step.args) // 2  # operands, then one init value each
    targets = {}
    for i in range(half):
        dtype = step.traced_aval(half + i).dtype
        for j in (i, half + i):
            if is_float(dtype) and step.aval(j).dtype != dtype:
                targets[j] = dtype
    return step.bind(step.with_cast(targets))
