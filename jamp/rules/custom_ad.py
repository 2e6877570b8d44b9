"""``custom_jvp_call`` / ``custom_vjp_call``: user-defined derivatives under the policy.

The primal body is rewritten under the region active at the call. The derivative rules are
obtained from JAX itself, by differentiating the *original* call at its traced dtypes
(``jax.jvp`` / ``jax.vjp`` of the untouched primitive, which invokes the user's rule), and are
then rewritten under the same region: torch's custom_fwd/custom_bwd guarantee that forward and
backward run under the autocast state recorded at forward time. Tangents and cotangents are cast
so their dtypes match the rewritten primal outputs and the primal inputs.

Under ``Policy(cast_inputs=True)`` a call whose floating operands all arrive in the compute dtype
(``jax.nn.softmax``, ``relu``, ``xlogy``, ...: library functions on bfloat16 activations) returns
its floating outputs in the compute dtype, as ``jnp`` functions and Flax's ``dtype=bfloat16``
layers do: the body still runs the fp32 table in float32, and its float32 results are cast once
at the end. Outputs with fewer elements than the largest operand (reductions: norms, losses,
statistics) stay float32. The derivative rules then run with ``RegionState.keep_compute_dtype``
(fp32-table ops on compute-dtype operands return the compute dtype), so what the backward pass
keeps of the call (its JVP residuals, or a custom_vjp residual that is an output) is the
compute-dtype output rather than a float32 copy.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import numpy as np

from .. import _compat as compat
from ..interpreter import F32, Step, in_compute_dtype, keep_traced_rule, register
from ..policy import RegionState
from .control_flow import _cast_to


def _original(step: Step) -> Callable[..., list[Any]]:
    """The equation's primitive, bound as traced (JAX supplies its JVP/VJP)."""
    params = compat.bind_params(step.eqn)
    primitive = step.eqn.primitive

    def call(*args: Any) -> list[Any]:
        return list(primitive.bind(*args, **params))
    return call


def _returns_compute_dtype(step: Step) -> bool:
    """Under ``cast_inputs``: the floating operands all arrive in the compute dtype."""
    return step.policy.cast_inputs and step.state.enabled and in_compute_dtype(step)


def _primal(step: Step) -> tuple[Any, list[Any], RegionState, RegionState]:
    """The rewritten body, the dtypes the call returns (see the module docstring), and the states
    of the body and of the derivative rules."""
    state = dataclasses.replace(step.state, keep_compute_dtype=False)
    closed = step.rewriter.rewrite_closed(step.params["call_jaxpr"], step.avals(), state,
                                          step.hints())
    dtypes = [np.dtype(a.dtype) for a in closed.out_avals]
    narrowed = False
    if _returns_compute_dtype(step):
        largest = max(step.aval(i).size for i in step.floating())
        narrow = [d == F32 and a.size >= largest for d, a in zip(dtypes, closed.out_avals)]
        dtypes = [step.state.dtype if n else d for n, d in zip(narrow, dtypes)]
        narrowed = any(narrow)
    return closed, dtypes, state, dataclasses.replace(state, keep_compute_dtype=narrowed)


def _evaluate(closed: Any, args: Sequence[Any], dtypes: Sequence[Any]) -> list[Any]:
    jaxpr, consts = compat.open_and_consts(closed)
    return _cast_to(compat.eval_jaxpr(jaxpr, consts, args), dtypes)


@register("custom_jvp_call")
def custom_jvp_rule(step: Step) -> Sequence[Any]:
    primal_closed, out_dtypes, _, rule_state = _primal(step)
    original = _original(step)
    traced = [v.aval for v in step.eqn.invars]
    tangent_avals = [compat.tangent_aval(a) for a in traced]
    rewriter = step.rewriter.child(rule_state)
    n_in = len(traced)

    @jax.custom_jvp
    def primal(*args: Any) -> list[Any]:
        return _evaluate(primal_closed, args, out_dtypes)

    @primal.defjvp
    def jvp(primals: Sequence[Any], tangents: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        rule = compat.trace_to_closed(
            lambda *flat: [x for part in jax.jvp(original, flat[:n_in], flat[n_in:]) for x in part],
            [*traced, *tangent_avals])
        jaxpr, consts = compat.open_and_consts(rule)
        outs = rewriter.run(jaxpr, consts, [*primals, *tangents])
        n_out = len(out_dtypes)
        return _cast_to(outs[:n_out], out_dtypes), _cast_to(outs[n_out:], out_dtypes)

    with compat.equation_context(step.eqn):
        return primal(*step.args)


@register("custom_vjp_call", "custom_vjp_call_jaxpr")
def custom_vjp_rule(step: Step) -> Sequence[Any]:
    primal_closed, out_dtypes, primal_state, _ = _primal(step)
    original = _original(step)
    traced = [v.aval for v in step.eqn.invars]
    in_dtypes = [a.dtype for a in step.avals()]
    rewriter = step.rewriter.child(primal_state)
    n_out = len(out_dtypes)
    pullback: dict[str, Any] = {}

    def forward_and_residuals(*args: Any) -> list[Any]:
        outs, vjp_fn = jax.vjp(original, *args)
        residuals, pullback["tree"] = jax.tree.flatten(vjp_fn)
        return [*outs, *residuals]

    @jax.custom_vjp
    def primal(*args: Any) -> list[Any]:
        return _evaluate(primal_closed, args, out_dtypes)

    def fwd(*args: Any) -> tuple[list[Any], list[Any]]:
        fwd_closed = compat.trace_to_closed(forward_and_residuals, traced)
        pullback["residual_avals"] = list(fwd_closed.out_avals[n_out:])
        jaxpr, consts = compat.open_and_consts(fwd_closed)
        outs = rewriter.run(jaxpr, consts, args)
        primal_outs = _cast_to(outs[:n_out], out_dtypes)
        # A residual that is an output (fwd returning ``y, (y,)``) is kept as the returned output.
        position = {v: j for j, v in enumerate(jaxpr.outvars[:n_out]) if isinstance(v, compat.Var)}
        residuals = [primal_outs[position[v]] if isinstance(v, compat.Var) and v in position else r
                     for v, r in zip(jaxpr.outvars[n_out:], outs[n_out:])]
        return primal_outs, residuals

    def bwd(residuals: list[Any], cotangents: list[Any]) -> tuple[Any, ...]:
        n_res = len(residuals)

        def backward(*flat: Any) -> Any:
            vjp_fn = jax.tree.unflatten(pullback["tree"], flat[:n_res])
            return vjp_fn(list(flat[n_res:]))

        ct_avals = [compat.tangent_aval(v.aval) for v in step.eqn.outvars]
        bwd_closed = compat.trace_to_closed(backward, [*pullback["residual_avals"], *ct_avals])
        jaxpr, consts = compat.open_and_consts(bwd_closed)
        cts = rewriter.run(jaxpr, consts, [*residuals, *cotangents])
        return tuple(_cast_to(cts, in_dtypes))

    primal.defvjp(fwd, bwd)
    with compat.equation_context(step.eqn):
        return primal(*step.args)


@register("custom_linear_solve")
def linear_solve_rule(step: Step) -> Sequence[Any]:
    """``jnp.linalg.solve`` and friends: linear algebra stays in its traced (float32) dtypes."""
    return keep_traced_rule(step)
