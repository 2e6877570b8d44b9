"""``custom_jvp_call`` / ``custom_vjp_call`` (and ``remat_opt``, the forward rule of a
``custom_vjp`` with ``optimize_remat=True``): user-defined derivatives under the policy.

The primal body is rewritten under the region active at the call. The derivative rules are
obtained from JAX itself, by differentiating the *original* call at its traced dtypes
(JAX's jvp / ``jax.vjp`` of the untouched primitive, which invokes the user's rule; the jvp keeps
the symbolic zero tangents the rule returns, as a rule after it must see them), and are
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

A rule that closes over a value of the traced function (a ``custom_vjp`` defined inside it over a
value it computed) holds a tracer of jamp's finished trace; the rewriter maps it to that value's
rewritten counterpart (``Rewriter.outer_value``). That works wherever JAX runs the rule while
jamp rewrites (``jax.grad`` of the transformed function, also under ``jax.jit``); as in plain JAX,
``jax.grad(jax.jit(f))`` of such a function is not supported.

The instrumented evaluator (probe.py) walks a custom-derivative call's primal body inline (it
takes no derivative; a ``jax.grad`` program's backward equations are already in it) and runs a
linear solve or a ``remat_opt`` whole, as one site.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero, zero_from_primal

from .. import _compat as compat
from ..interpreter import (
    F32,
    RewriteError,
    Step,
    call_bodies,
    cast_all,
    in_compute_dtype,
    keep_traced_rule,
    register,
    register_opaque,
    register_walk,
    walk_call,
)
from ..policy import RegionState
from ..region_stack import tracing_under


class RuleClosureError(RewriteError):
    """A custom derivative rule closing over a value the transformed function computed ran after
    jamp's rewrite of that function had finished, so the value could not be mapped."""


# The traces of the users' functions (``transform.trace_call``): a tracer of one of them that
# ``Rewriter.outer_value`` cannot map is a value of a finished trace.
_USER_TRACES: weakref.WeakSet[Any] = weakref.WeakSet()


def remember_user_trace(trace: Any) -> None:
    _USER_TRACES.add(trace)


def _rule_consts(rewriter: Any, consts: Sequence[Any], eqn: Any) -> list[Any]:
    """A rule's closed-over values, mapped to the values they have in the rewrite (see the module
    docstring); raises ``RuleClosureError`` where the rewrite has ended."""
    mapped = [rewriter.outer_value(c) for c in consts]
    if any(compat.trace_of(c) in _USER_TRACES for c in mapped):
        raise RuleClosureError(
            f"a custom derivative rule (of `{eqn.primitive.name}` at {compat.source_line(eqn)}) "
            "closes over a value the transformed function computed, and JAX ran it after jamp "
            "rewrote the function. jamp supports such rules where JAX runs them while it "
            "rewrites: jax.grad of the transformed function (also under jax.jit); as in plain "
            "JAX, jax.grad(jax.jit(f)) of such a function is not supported"
        )
    return mapped


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
    closed = step.rewriter.rewrite_closed(
        step.params["call_jaxpr"], step.avals(), state, step.hints()
    )
    dtypes = [a.dtype for a in closed.out_avals]  # (an extended dtype is no numpy dtype)
    narrowed = False
    if _returns_compute_dtype(step):
        size = compat.generic_size  # sizes may be symbolic (a polymorphic export's batch)
        largest = max(size(step.aval(i).size) for i in step.floating())
        narrow = [d == F32 and size(a.size) >= largest for d, a in zip(dtypes, closed.out_avals)]
        dtypes = [step.state.value_dtype if n else d for n, d in zip(narrow, dtypes)]
        narrowed = any(narrow)
    return closed, dtypes, state, dataclasses.replace(state, keep_compute_dtype=narrowed)


def _evaluate(closed: Any, args: Sequence[Any], dtypes: Sequence[Any]) -> list[Any]:
    jaxpr, consts = compat.open_and_consts(closed)
    return cast_all(compat.eval_jaxpr(jaxpr, consts, args), dtypes)


# The traced JVP of an original custom_jvp call, per equation (its primal jaxpr, weakly) and
# JVP function, for the inputs JAX passes tangents for: it depends on nothing else. With it, which
# of its output tangents are symbolic zeros (those the rule leaves out).
_JVP_RULES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@register("custom_jvp_call")
def custom_jvp_rule(step: Step) -> Sequence[Any]:
    primal_closed, out_dtypes, _, rule_state = _primal(step)
    original = _original(step)
    traced = [v.aval for v in step.eqn.invars]
    tangent_avals = [compat.tangent_aval(a) for a in traced]
    rewriter = step.rewriter.child(rule_state)
    eqn = step.eqn  # the rules below must not hold `step` (its operands are tracers)
    n_in = len(traced)
    call_jaxpr, jvp_fun = step.params["call_jaxpr"], step.params.get("jvp_jaxpr_fun")

    @jax.custom_jvp
    def primal(*args: Any) -> list[Any]:
        return _evaluate(primal_closed, args, out_dtypes)

    def jvp(primals: Sequence[Any], tangents: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        # Differentiate the original only where JAX passes a tangent: a user's rule with
        # ``symbolic_zeros=True`` (``equinox.filter_custom_jvp``) then sees the same symbolic
        # zeros as without jamp, and its output tangents depend on the same inputs.
        at = [i for i, t in enumerate(tangents) if not isinstance(t, SymbolicZero)]

        def primals_and_tangents(*flat: Any) -> list[Any]:
            def of_perturbed(*diff: Any) -> list[Any]:
                full = list(flat[:n_in])
                for i, x in zip(at, diff):
                    full[i] = x
                return original(*full)

            # The output tangents the user's rule (or JAX) left symbolic zeros are handed on as
            # symbolic zeros, as JAX would: a rule after this one may be written for them.
            outs, out_tangents = compat.jvp_keeping_zeros(
                of_perturbed, [flat[i] for i in at], list(flat[n_in:])
            )
            zeros.append(tuple(t is None for t in out_tangents))
            return [*outs, *(t for t in out_tangents if t is not None)]

        rules = _JVP_RULES.get(call_jaxpr)
        if rules is None:
            rules = _JVP_RULES[call_jaxpr] = {}
        key: tuple | None = (jvp_fun, tuple(at), rule_state.enabled, rule_state.dtype)
        try:
            cached = rules.get(key)
        except TypeError:  # a rule function that cannot be hashed: traced every time
            cached = key = None
        if cached is None:  # (the same equation again: an eager step, a model's repeated block)
            zeros: list[tuple[bool, ...]] = []
            with _answering(rule_state):
                rule = compat.trace_to_closed(
                    primals_and_tangents, [*traced, *(tangent_avals[i] for i in at)]
                )
            cached = (rule, zeros[0])
            consts = compat.open_and_consts(rule)[1]
            if key is not None and not any(compat.is_tracer(c) for c in consts):
                rules[key] = cached
        rule, zero_outs = cached
        jaxpr, consts = compat.open_and_consts(rule)
        outs = rewriter.run(
            jaxpr, _rule_consts(rewriter, consts, eqn), [*primals, *(tangents[i] for i in at)]
        )
        n_out = len(out_dtypes)
        out_primals = cast_all(outs[:n_out], out_dtypes)
        given = iter(cast_all(outs[n_out:], [d for d, z in zip(out_dtypes, zero_outs) if not z]))
        out_tangents = [
            zero_from_primal(p, symbolic_zeros=True) if z else next(given)
            for p, z in zip(out_primals, zero_outs)
        ]
        return out_primals, out_tangents

    primal.defjvp(jvp, symbolic_zeros=True)
    with compat.equation_context(step.eqn):
        return primal(*step.args)


@dataclasses.dataclass(frozen=True)
class _Backward:
    """What ``bwd`` needs that is no array, carried in the residuals as a static pytree node:
    which inputs the forward pass differentiated, and the traced backward program."""

    perturbed: tuple[bool, ...]
    closed: Any  # an open jaxpr: hashed and compared by identity
    logs_tree: Any  # the user's backward-pass logs (``defvjp_with_logs``), the last outputs
    log_dtypes: tuple[Any, ...]  # ... cast back to the dtypes the user's bwd traced them in
    # Traces the backward program in bwd, for the cotangents that are symbolic zeros there (see
    # ``custom_vjp_rule``): always where ``closed`` is None, else for a user's rule with
    # ``symbolic_zeros=True`` that is handed a symbolic zero.
    retrace: Callable[[tuple[bool, ...]], tuple[Any, list[Any], Any, tuple]] | None = None


jax.tree_util.register_static(_Backward)


def _operand_index(ref: Any, operands: Sequence[Any]) -> int:
    """Which of a custom_vjp call's operands the mutable array reference ``ref`` its fwd keeps
    as a residual is."""
    for i, operand in enumerate(operands):
        if operand is ref:
            return i
    raise ValueError(
        "a custom_vjp's fwd keeps a mutable array reference for its bwd that is not one of the "
        "function's arguments (one it created): jamp can hand on only a reference the call was "
        "given; pass it in as an argument"
    )


def _wider(traced: Any, rewritten: Any) -> Any:
    """``rewritten`` where it is a wider float than ``traced``, else ``traced``."""
    floats = all(jnp.issubdtype(d, jnp.floating) for d in (traced, rewritten))
    wider = floats and np.dtype(rewritten).itemsize > np.dtype(traced).itemsize
    return rewritten if wider else traced


def _known_zeros(jaxpr: Any, n_outs: int) -> tuple[bool, ...]:
    """Which of ``jaxpr``'s first ``n_outs`` outputs are zeros by construction: a literal zero,
    or a literal zero broadcast (what JAX instantiates a symbolic zero cotangent as, e.g. a
    user's bwd returning None). Read from the program, not from what an output depends on: a
    user's bwd need not be linear in the cotangent (it may return a constant)."""
    made_by = {v: e for e in jaxpr.eqns for v in e.outvars}

    def is_zero_literal(atom: Any) -> bool:
        return isinstance(atom, compat.Literal) and not np.any(np.asarray(atom.val))

    def is_zero(v: Any) -> bool:
        if isinstance(v, compat.Literal):  # (a literal is no equation's output, nor hashable)
            return is_zero_literal(v)
        eqn = made_by.get(v)
        return (
            eqn is not None
            and eqn.primitive.name == "broadcast_in_dim"
            and is_zero_literal(eqn.invars[0])
        )

    return tuple(is_zero(v) for v in jaxpr.outvars[:n_outs])


def _instantiate(ct: Any) -> Any:
    """A cotangent as an array (``symbolic_zeros`` hands the backward pass symbolic zeros)."""
    if not isinstance(ct, SymbolicZero):
        return ct
    aval: Any = ct.aval  # a ShapedArray (typed as the AbstractValue base)
    if aval.dtype == jax.dtypes.float0:
        return np.zeros(aval.shape, jax.dtypes.float0)
    return jnp.zeros(aval.shape, aval.dtype)


def _answering(state: RegionState) -> Any:
    """While JAX traces a user's derivative rule (fwd, bwd, a jvp rule): the region state of
    the call it belongs to, as ``jamp.is_autocast_enabled``/``get_autocast_dtype`` answer it
    there (they answered the defaults: the rules are traced after the function was)."""
    return tracing_under(state.enabled, state.dtype)


@register("custom_vjp_call", "custom_vjp_call_jaxpr")
def custom_vjp_rule(step: Step) -> Sequence[Any]:
    """The user's fwd/bwd run under the forward call's region, for the inputs JAX differentiates.

    jamp's own ``custom_vjp`` uses ``symbolic_zeros``, so its forward rule learns which inputs
    are perturbed and differentiates the original call with respect to those only: a user's fwd
    with ``symbolic_zeros=True`` (``equinox.filter_custom_vjp``) sees the same ``perturbed`` flags
    as without jamp, and closed-over values (the call's leading consts) are not differentiated.
    The backward program is traced in the forward rule; its constants (values the user's bwd
    closes over) travel as residuals.
    """
    primal_closed, out_dtypes, primal_state, _ = _primal(step)
    original = _original(step)
    traced = [v.aval for v in step.eqn.invars]
    in_dtypes = [a.dtype for a in step.avals()]
    # In a region an operand the policy made 16-bit arrives traced in that dtype (region_trace
    # tags it "lowered"): jamp cast it all the same
    policy_made = [step.has_tag(i, "lowered") for i in range(len(step.eqn.invars))]
    ct_avals = [compat.cotangent_aval(v.aval) for v in step.eqn.outvars]
    rewriter = step.rewriter.child(primal_state)
    eqn = step.eqn  # the rules below must not hold `step` (its operands are tracers)
    n_out = len(out_dtypes)
    symbolic_zeros = bool(eqn.params.get("symbolic_zeros", False))

    @jax.custom_vjp
    def primal(*args: Any) -> list[Any]:
        return _evaluate(primal_closed, args, out_dtypes)

    def fwd(*primals: Any) -> tuple[list[Any], tuple[Any, list[Any]]]:
        args = [p.value for p in primals]
        perturbed = tuple(bool(p.perturbed) for p in primals)
        at = [i for i, p in enumerate(perturbed) if p]
        pullback: dict[str, Any] = {}

        def forward_and_residuals(*flat: Any) -> list[Any]:
            def of_perturbed(*diff: Any) -> list[Any]:
                full = list(flat)
                for i, x in zip(at, diff):
                    full[i] = x
                return original(*full)

            outs, vjp_fn = jax.vjp(of_perturbed, *(flat[i] for i in at))
            residuals, pullback["tree"] = jax.tree.flatten(vjp_fn)
            # A mutable array reference the user's fwd keeps for its bwd (``jax.new_ref``: a
            # bwd that stashes gradients, an fp8 amax history) cannot be a traced program's
            # output: it is the call's own operand, handed on as that operand.
            pullback["refs"] = {
                k: _operand_index(r, flat) for k, r in enumerate(residuals) if compat.is_ref(r)
            }
            return [*outs, *(r for k, r in enumerate(residuals) if k not in pullback["refs"])]

        with _answering(primal_state):
            fwd_closed = compat.trace_to_closed(forward_and_residuals, traced)
        jaxpr, consts = compat.open_and_consts(fwd_closed)
        outs = rewriter.run(jaxpr, _rule_consts(rewriter, consts, eqn), args)
        primal_outs = cast_all(outs[:n_out], out_dtypes)
        # A residual that is an output (fwd returning ``y, (y,)``) is kept as the returned output.
        position = {v: j for j, v in enumerate(jaxpr.outvars[:n_out]) if isinstance(v, compat.Var)}
        residuals = [
            primal_outs[position[v]] if isinstance(v, compat.Var) and v in position else r
            for v, r in zip(jaxpr.outvars[n_out:], outs[n_out:])
        ]
        res_avals = list(fwd_closed.out_avals[n_out:])
        for k, i in sorted(pullback["refs"].items()):
            residuals.insert(k, args[i])
            res_avals.insert(k, traced[i])
        n_res = len(residuals)

        def trace_backward(zero_cts: tuple[bool, ...]) -> tuple[Any, list[Any], Any, tuple]:
            """The original call's pullback, traced for cotangents of which those flagged in
            ``zero_cts`` are symbolic zeros: (jaxpr, its consts, logs tree, log dtypes)."""
            info: dict[str, Any] = {}

            def backward(*flat: Any) -> Any:
                vjp_fn = jax.tree.unflatten(pullback["tree"], flat[:n_res])
                given = iter(flat[n_res:])
                cts_in = [
                    compat.zero_cotangent(a) if z else next(given)
                    for a, z in zip(ct_avals, zero_cts)
                ]
                cts, logs = compat.pullback_with_logs(vjp_fn, cts_in)
                # The user's backward-pass logs (defvjp_with_logs) follow the cotangents.
                log_leaves, info["logs"] = jax.tree.flatten(logs)
                return [*jax.tree.leaves(cts), *log_leaves]

            given_avals = [a for a, z in zip(ct_avals, zero_cts) if not z]
            with _answering(primal_state):
                closed = compat.trace_to_closed(backward, [*res_avals, *given_avals])
            n_logs = info["logs"].num_leaves
            log_dtypes = tuple(a.dtype for a in closed.out_avals[len(closed.out_avals) - n_logs :])
            jaxpr, consts = compat.open_and_consts(closed)
            return jaxpr, consts, info["logs"], log_dtypes

        try:
            bwd_jaxpr, bwd_consts, logs_tree, log_dtypes = trace_backward((False,) * n_out)
        except Exception:
            # Traced in bwd instead, for the cotangents JAX passes there, and an error raised
            # there, as JAX runs a user's bwd only in the backward pass (a pullback never called
            # never fails): a bwd with symbolic_zeros=True may refuse an array where it expects
            # a symbolic zero (it asserts on the type); under vmap (jax >= 0.12) the original's
            # bwd refuses a nonzero cotangent for an output shared across the batch, where JAX
            # itself passes a symbolic zero, known only in bwd (its consts are then mapped
            # late: see _rule_consts).
            saved = _Backward(perturbed, None, None, (), retrace=trace_backward)
            return primal_outs, (saved, residuals)
        # Values the user's bwd closes over are known now, in the forward pass: pass them on.
        bwd_consts = _rule_consts(rewriter, bwd_consts, eqn)
        # A user's bwd with symbolic_zeros=True is handed the symbolic zeros JAX passes, traced
        # again in bwd for them (the program above takes every cotangent as an array).
        retrace = trace_backward if symbolic_zeros else None
        saved = _Backward(perturbed, bwd_jaxpr, logs_tree, log_dtypes, retrace=retrace)
        return primal_outs, (saved, [*residuals, *bwd_consts])

    def bwd(saved: tuple[Any, list[Any]], cotangents: Sequence[Any]) -> tuple[Any, ...]:
        backward, values = saved
        zero_cts = tuple(isinstance(c, SymbolicZero) for c in cotangents)
        traced_here = None
        if backward.retrace is not None and (backward.closed is None or any(zero_cts)):
            try:
                jaxpr, consts, logs_tree, log_dtypes = backward.retrace(zero_cts)
                traced_here = (jaxpr, _rule_consts(rewriter, consts, eqn), logs_tree, log_dtypes)
            except RuleClosureError:
                if backward.closed is None:
                    raise
                # its rule closes over a value the rewrite computed: the program traced in the
                # forward pass, with the zeros as arrays
        if traced_here is not None:
            jaxpr, consts, logs_tree, log_dtypes = traced_here
            n_bwd_consts = 0 if backward.closed is None else len(backward.closed.constvars)
            residuals = values[: len(values) - n_bwd_consts]
            backward = _Backward(backward.perturbed, jaxpr, logs_tree, log_dtypes)
            given = [c for c in cotangents if not isinstance(c, SymbolicZero)]
        else:
            n_consts = len(backward.closed.constvars)
            residuals, consts = values[: len(values) - n_consts], values[len(values) - n_consts :]
            given = [_instantiate(c) for c in cotangents]
        outs = rewriter.run(backward.closed, consts, [*residuals, *given])
        n_cts = len(outs) - len(backward.log_dtypes)
        # Where jamp left an input's dtype alone, its cotangent keeps the dtype the user's bwd
        # gives it (JAX lets a bwd return float32 for a bfloat16 input: "excess precision"),
        # also where a wider cotangent reached the bwd than its output's dtype; where jamp cast
        # the input, the cotangent takes the input's dtype (a wider one would reach the
        # transpose of what made the input, a checkpoint's, which JAX cannot run on it).
        kept = [
            (d, d == t.dtype and not made)
            for d, t, made, p in zip(in_dtypes, traced, policy_made, backward.perturbed)
            if p
        ]
        ct_dtypes = [
            _wider(v.aval.dtype, compat.aval_of(out).dtype) if same else d
            for (d, same), v, out in zip(kept, backward.closed.outvars, outs)
        ]
        # A zero the pullback instantiated (a user's bwd returning None) is returned as None,
        # for JAX to make the zero of the input's cotangent type: JAX's instantiation drops a
        # sharding type (a reduced input's cotangent is unreduced), which JAX then refuses.
        zeros = _known_zeros(backward.closed, n_cts)
        cts = iter(
            None if zero else ct for ct, zero in zip(cast_all(outs[:n_cts], ct_dtypes), zeros)
        )
        logs = jax.tree.unflatten(backward.logs_tree, cast_all(outs[n_cts:], backward.log_dtypes))
        return tuple(next(cts) if p else None for p in backward.perturbed), logs or None

    compat.defvjp_with_logs(primal, fwd, bwd, symbolic_zeros=True)
    with compat.equation_context(step.eqn):
        return primal(*step.args)


@register("custom_linear_solve")
def linear_solve_rule(step: Step) -> Sequence[Any]:
    """``jnp.linalg.solve`` and friends: linear algebra stays in its traced (float32) dtypes."""
    return keep_traced_rule(step)


@register(*compat.OPTIMIZED_REMAT_PRIMITIVES)
def optimized_remat_rule(step: Step) -> Sequence[Any]:
    """The forward rule of a ``custom_vjp(..., optimize_remat=True)`` (in the jaxpr of a
    ``jax.grad`` of it): ``fwd`` is rewritten under the call's region, and so is the primal
    function that JAX runs instead where the residuals turn out unused; its outputs take the
    rewritten ``fwd``'s dtypes, since either may replace the other."""
    n_consts, n_res = step.params["num_consts"], step.params["num_res"]
    avals, hints = step.avals(), step.hints()
    fwd = step.rewrite_sub(compat.as_closed(step.params["fwd_jaxpr"]), avals, hints)
    fwd_jaxpr, fwd_consts = compat.hoist_consts(fwd)
    out_dtypes = [a.dtype for a in fwd.out_avals[n_res:]]
    # Rewritten now, while values the function closes over can still be mapped (see
    # Rewriter.outer_value); JAX's own thunk is memoized, so this is its one trace.
    fun_jaxpr, fun_consts = compat.open_and_consts(
        compat.close_jaxpr(*step.params["fun_jaxpr_thunk"]())
    )
    rewriter = step.rewriter.child(step.state)
    fun = compat.trace_to_closed(
        lambda *args: cast_all(
            rewriter.run(fun_jaxpr, fun_consts, args, hints[n_consts:]), out_dtypes
        ),
        avals[n_consts:],
    )
    rewritten_fun = compat.open_and_consts(fun)
    return step.bind(
        [*fwd_consts, *step.args],
        num_consts=n_consts + len(fwd_consts),
        fwd_jaxpr=compat.as_closed(fwd_jaxpr),
        fun_jaxpr_thunk=lambda: rewritten_fun,
    )


register_walk("custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr", bodies=call_bodies)(
    walk_call
)
register_opaque("custom_linear_solve", *compat.OPTIMIZED_REMAT_PRIMITIVES)
