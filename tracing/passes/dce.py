"""Dead-code elimination: drop equations and constants no output needs; keep every input.

JAX's own ``dce_jaxpr`` does the work (it has the rules for scan, while, cond and calls, and keeps
equations with effects); the program is then traced again so it is an ordinary closed jaxpr.
"""

from __future__ import annotations

from typing import Any

from jamp import _compat as compat


def dce(closed: Any) -> Any:
    """``closed`` without dead equations or unused constants, over the same inputs.

    Example::

        closed = jax.make_jaxpr(lambda x: (x * 2, x)[1])(x)
        dce(closed)          # { lambda ; a. let  in (a,) }
    """
    jaxpr, _ = compat.open_and_consts(closed)
    dced, consts = compat.dce_closed(closed)
    in_avals = [v.aval for v in jaxpr.invars]
    return compat.trace_to_closed(
        lambda *args: compat.eval_jaxpr(dced, [], [*consts, *args]), in_avals
    )
