"""Call-like primitives: ``jit`` (``pjit``), ``closed_call``/``core_call``, ``checkpoint`` (remat).

The callee is rewritten under the region active at the call site; regions and rules written
inside the callee apply on top of it (its equations' name stacks are relative to the call).
"""
from __future__ import annotations

from typing import Any, Sequence

from .. import _compat as compat
from ..interpreter import Step, register


@register("jit", "pjit")
def jit_rule(step: Step) -> Sequence[Any]:
    """Keep the jit boundary (shardings, donation, name) and rewrite its body."""
    body = step.rewrite_sub(step.params["jaxpr"], step.avals(), step.known())
    return step.bind(step.args, jaxpr=body)


@register("closed_call", "core_call", "call")
def inline_call_rule(step: Step) -> Sequence[Any]:
    """Pure call wrappers carry no semantics of their own: evaluate the body inline."""
    jaxpr = step.params.get("call_jaxpr")
    return step.run_sub(jaxpr, step.args, step.known())


@register("checkpoint", "remat", "remat2")
def remat_rule(step: Step) -> Sequence[Any]:
    """Rewrite the rematerialized body; recomputation then runs under the same policy."""
    body = step.rewrite_sub(compat.as_closed(step.params["jaxpr"]), step.avals(), step.known())
    jaxpr, consts = compat.hoist_consts(body)
    return step.bind([*consts, *step.args], jaxpr=jaxpr)
