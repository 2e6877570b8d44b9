"""Call-like primitives: ``jit`` (``pjit``), ``closed_call``/``core_call`` (``eval_jaxpr`` on jax
0.12), ``checkpoint`` (remat), ``custom_vmap_call``, ``composite`` (``lax.composite``),
``xla_metadata_call``, ``compute_on``, ``fused_call`` and ``run_state``.

The callee is rewritten under the region active at the call site; regions and rules written
inside the callee apply on top of it (its equations' name stacks are relative to the call).
The instrumented evaluator (probe.py) walks into their bodies inline; ``custom_vmap_call`` (its
vmap rule is the user's code) and ``run_state`` (its body works on references) run whole there.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

from .. import _compat as compat
from ..interpreter import (
    F64,
    Hint,
    Step,
    UnsupportedPrimitiveWarning,
    call_bodies,
    call_body,
    call_param,
    is_float,
    keep_traced_rule,
    register,
    register_opaque,
    register_walk,
    traced_dtype_operands,
    walk_call,
)
from ..region_stack import cast_inputs_dtype


@register("jit", "pjit")
def jit_rule(step: Step) -> Sequence[Any]:
    """Keep the jit boundary (shardings, donation, name) and rewrite its body.

    A ``@jamp.autocast(cast_inputs=dtype)`` function arrives as a jit named after the dtype: inside
    an enabled region its floating (non-float64) inputs are cast first (torch's custom_fwd).
    ``jax.random``'s samplers run as traced: a sample comes in the dtype it was asked for, as
    torch's factory functions give it under autocast (``jax.random.normal(key, shape,
    jnp.bfloat16)``, a Flax layer's ``param_dtype`` initialized under the policy).
    """
    if compat.calls_a_sampler(step.eqn.primitive, step.params):
        return keep_traced_rule(step)
    args = step.args
    hints: list[Hint | None] = list(step.hints())
    dtype = cast_inputs_dtype(step.params.get("name", ""))
    if dtype is not None and step.state.enabled:
        targets = {i: dtype for i in step.floating() if step.aval(i).dtype != F64}
        args = step.with_cast(targets)
        hints = [None if i in targets else k for i, k in enumerate(hints)]
    body = step.rewrite_sub(step.params["jaxpr"], [compat.aval_of(a) for a in args], hints)
    return step.bind(args, jaxpr=body)


@register(*compat.INLINE_CALL_PRIMITIVES)
def inline_call_rule(step: Step) -> Sequence[Any]:
    """Pure call wrappers carry no semantics of their own: evaluate the body inline."""
    return step.run_sub(call_body(step.eqn), step.args, step.hints())


@register("checkpoint", "remat", "remat2")
def remat_rule(step: Step) -> Sequence[Any]:
    """Rewrite the rematerialized body; recomputation then runs under the same policy."""
    body = step.rewrite_sub(compat.as_closed(step.params["jaxpr"]), step.avals(), step.hints())
    jaxpr, consts = compat.hoist_consts(body)
    return step.bind([*consts, *step.args], jaxpr=jaxpr)


@register("composite", *compat.ANNOTATED_CALL_PRIMITIVES)
def composite_rule(step: Step) -> Sequence[Any]:
    """A call whose other parameters say what its body is or how XLA runs it: ``lax.composite``
    (a named operation and its decomposition), ``xla_metadata_call`` (scheduling metadata,
    whether it may be inlined), ``compute_on`` (the core or host it runs on). The body is
    rewritten as a jit's body is, every other parameter kept: a compiler that knows a
    composite's name sees the dtypes the policy chose."""
    body = step.rewrite_sub(call_body(step.eqn), step.avals(), step.hints())
    return step.bind(step.args, **{call_param(step.eqn): body})  # (jax 0.12: call_jaxpr)


@register(*compat.FUSED_CALL_PRIMITIVES)
def fused_rule(step: Step) -> Sequence[Any]:
    """``jax.experimental.fused``: a body XLA must fuse, traced at inputs that may live in any
    memory space (its own input types, not its operands'). It is rewritten at those types with
    the operands' dtypes; the output memory spaces (``out_spaces``) are kept."""
    body = call_body(step.eqn)
    traced_in = [v.aval for v in compat.open_and_consts(compat.as_closed(body))[0].invars]
    avals = [
        t.update(dtype=a.dtype) if hasattr(t, "dtype") else t
        for t, a in zip(traced_in, step.avals())
    ]
    return step.bind(
        step.args, **{call_param(step.eqn): step.rewrite_sub(body, avals, step.hints())}
    )


@register("run_state")
def run_state_rule(step: Step) -> Sequence[Any]:
    """``run_state`` (stateful code discharged by JAX, Pallas-style: a body over references to its
    operands). Every reference keeps its traced type, so the operands arrive cast back to theirs
    and values stored are cast to the reference's dtype, as a ``jax.new_ref`` store is; the
    operations on values read from the references follow the policy."""
    args = traced_dtype_operands(step)
    body = step.params["jaxpr"]
    rewritten = step.rewrite_sub(compat.as_closed(body), [v.aval for v in body.invars])
    jaxpr, consts = compat.open_and_consts(rewritten)
    if consts:  # (a body cannot close over values; none of jamp's rules makes one here today)
        warnings.warn(
            f"jamp could not rewrite `run_state` (traced at {compat.source_line(step.eqn)}): "
            "its rewritten body holds constants, which run_state cannot take; it runs "
            "unchanged in its traced dtypes.",
            UnsupportedPrimitiveWarning,
            stacklevel=2,
        )
        return keep_traced_rule(step)
    return step.bind(args, jaxpr=jaxpr)


@register("custom_vmap_call")
def custom_vmap_rule(step: Step) -> Sequence[Any]:
    """``jax.custom_batching.custom_vmap``: the function is rewritten, but its vmap rule is the
    user's own code and runs in the traced dtypes, so the call takes and returns those (under
    ``vmap`` JAX replaces the call with the rule, and their output types must agree)."""
    args = step.with_cast({i: step.traced_aval(i).dtype for i in step.floating()})
    avals = [compat.aval_of(a) for a in args]
    body = step.rewrite_sub(step.params["call"], avals, step.hints())
    jaxpr, consts = compat.open_and_consts(body)
    out_dtypes = [v.aval.dtype for v in step.eqn.outvars]

    def traced_dtypes_out(*operands: Any) -> list[Any]:
        outs = compat.eval_jaxpr(jaxpr, consts, operands)
        return [
            compat.convert(x, d) if is_float(d) and compat.aval_of(x).dtype != d else x
            for x, d in zip(outs, out_dtypes)
        ]

    return step.bind(args, call=compat.trace_to_closed(traced_dtypes_out, avals))


register_walk(
    "jit",
    "pjit",
    "checkpoint",
    "remat",
    "remat2",
    "composite",
    *compat.ANNOTATED_CALL_PRIMITIVES,
    *compat.FUSED_CALL_PRIMITIVES,
    *compat.INLINE_CALL_PRIMITIVES,
    bodies=call_bodies,
)(walk_call)
register_opaque("custom_vmap_call")
register_opaque("run_state")  # (its body works on references: the evaluator runs it whole)
