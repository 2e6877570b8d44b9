"""Control flow: ``scan``, ``while`` and ``cond``/``switch``.

Bodies are rewritten under the region active at the loop or branch, and the loops are rebuilt with
the public ``lax`` functions, so version-specific params (``ft_in``/``ft_out``, ``linear``,
``_split_transpose``) never need translating. Loop carries keep their traced dtypes (a rewritten
carry-out is cast back at the end of the body); branch outputs whose dtypes diverge across
branches are cast to the traced dtypes.

Each primitive also registers its instrumented walk (``register_walk``), which ``probe.py`` runs
for ``find_nonfinite``/``value_ranges``: the body is walked equation by equation and the
observer's state is threaded through the loop carry (or the branches), with the iteration count.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from jax import lax

from .. import _compat as compat
from ..interpreter import Hint, Step, cast_all, register, register_walk


def _carry_in(step: Step, first: int, count: int) -> list[Any]:
    """The initial carry, cast to the traced carry dtypes where it arrives otherwise."""
    return [
        step.cast(i, step.traced_aval(i).dtype) if i in set(step.floating()) else step.args[i]
        for i in range(first, first + count)
    ]


@register("scan")
def scan_rule(step: Step) -> Sequence[Any]:
    params = step.params
    n_consts, n_carry = compat.scan_counts(params, len(step.args))
    consts = step.args[:n_consts]
    # Consts keep all they are known to be; slices of xs stay parameters if xs were (scanned layers)
    # and 16-bit by the policy if xs were (in a region).
    # A cotangent carried or scanned over stays one: the loop is part of the backward pass.
    all_hints = step.hints()
    xs_hints = [
        Hint(tags=h.tags & {"input_view", "cotangent", "lowered"})
        for h in all_hints[n_consts + n_carry :]
    ]
    carry_hints = [Hint(tags=h.tags & {"cotangent"}) for h in all_hints[n_consts:][:n_carry]]
    hints = [*all_hints[:n_consts], *carry_hints, *xs_hints]
    init = _carry_in(step, n_consts, n_carry)
    xs = step.args[n_consts + n_carry :]
    carry_dtypes = [step.traced_aval(i).dtype for i in range(n_consts, n_consts + n_carry)]
    jaxpr, body_consts = compat.open_and_consts(params["jaxpr"])
    rewriter = step.rewriter.child(step.state, repeats=params["length"])

    def body(carry: list[Any], x: list[Any]) -> tuple[list[Any], list[Any]]:
        outs = rewriter.run(jaxpr, body_consts, [*consts, *carry, *x], hints)
        return cast_all(outs[:n_carry], carry_dtypes, rewriter.recorder), outs[n_carry:]

    with compat.equation_context(step.eqn):
        carry, ys = lax.scan(
            body,
            init,
            xs,
            length=params["length"],
            reverse=params["reverse"],
            unroll=params["unroll"],
        )
    return [*carry, *ys]


@register("while")
def while_rule(step: Step) -> Sequence[Any]:
    params = step.params
    n_cond, n_body = params["cond_nconsts"], params["body_nconsts"]
    cond_consts = step.args[:n_cond]
    body_consts = step.args[n_cond : n_cond + n_body]
    hints = step.hints()
    first = n_cond + n_body
    init = _carry_in(step, first, len(step.args) - first)
    carry_dtypes = [step.traced_aval(i).dtype for i in range(first, len(step.args))]
    cond_jaxpr, cond_inner = compat.open_and_consts(params["cond_jaxpr"])
    body_jaxpr, body_inner = compat.open_and_consts(params["body_jaxpr"])
    trips = trip_count(step.eqn)
    if trips is None and step.rewriter.recorder is not None:
        step.rewriter.recorder.loop_of_unknown_length()
    rewriter = step.rewriter.child(step.state, repeats=1 if trips is None else trips)

    def cond_fun(carry: list[Any]) -> Any:
        return rewriter.run(cond_jaxpr, cond_inner, [*cond_consts, *carry], hints[:n_cond])[0]

    def body_fun(carry: list[Any]) -> list[Any]:
        outs = rewriter.run(body_jaxpr, body_inner, [*body_consts, *carry], hints[n_cond:first])
        return cast_all(outs, carry_dtypes, rewriter.recorder)

    with compat.equation_context(step.eqn):
        if compat.open_and_consts(params["cond_jaxpr"])[0].outvars[0].aval.shape:
            return _batched_while(step, cond_fun, body_fun, init)
        carry = lax.while_loop(cond_fun, body_fun, init)
        return list(carry)


# A counter's comparison with its bound, as ``counter OP bound`` holding while the loop runs.
_CONTINUES = {
    "lt": lambda i, bound: i < bound,
    "le": lambda i, bound: i <= bound,
    "gt": lambda i, bound: i > bound,
    "ge": lambda i, bound: i >= bound,
    "ne": lambda i, bound: i != bound,
}


def trip_count(eqn: Any) -> int | None:
    """How many times a ``while`` runs its body, where the program says it exactly: a
    ``lax.while_loop(lambda c: c[0] < 10, ...)`` (an integer carry that starts at a literal,
    steps by a literal and is compared with a literal); None where it depends on values
    (``fori_loop`` with a traced bound, a convergence test). ``explain``/``tune`` count a body's
    matmul FLOPs once per iteration, as for ``scan``."""
    params = eqn.params
    cond, _ = compat.open_and_consts(params["cond_jaxpr"])
    body, _ = compat.open_and_consts(params["body_jaxpr"])
    n_cond, n_body = params["cond_nconsts"], params["body_nconsts"]
    init = eqn.invars[n_cond + n_body :]
    if len(cond.eqns) != 1 or cond.eqns[0].primitive.name not in _CONTINUES:
        return None
    test = cond.eqns[0]
    lhs, rhs = test.invars
    carries = cond.invars[n_cond:]
    if not (isinstance(lhs, compat.Var) and lhs in carries and isinstance(rhs, compat.Literal)):
        return None
    counter_dtype = getattr(lhs.aval, "dtype", None)
    if counter_dtype is None or not np.issubdtype(counter_dtype, np.integer):
        return None
    k = carries.index(lhs)
    start, bound = init[k], rhs.val
    stepped = body.outvars[k]
    adds = [e for e in body.eqns if stepped in e.outvars and e.primitive.name == "add"]
    if not isinstance(start, compat.Literal) or len(adds) != 1:
        return None
    operands = adds[0].invars
    counter = body.invars[n_body + k]
    literals = [a.val for a in operands if isinstance(a, compat.Literal)]
    if counter not in operands or len(literals) != 1 or not literals[0]:
        return None
    return _iterations(test.primitive.name, int(start.val), int(bound), int(literals[0]))


def _iterations(comparison: str, start: int, bound: int, step: int) -> int | None:
    """How often ``i OP bound`` holds for ``i = start, start + step, ...``; None: forever."""
    if not _CONTINUES[comparison](start, bound):
        return 0
    if comparison == "ne":
        count, left = divmod(bound - start, step)
        return count if left == 0 and count > 0 else None
    if (comparison in ("lt", "le")) != (step > 0):
        return None  # stepping away from the bound
    gap, stride = abs(bound - start), abs(step)
    return -(-gap // stride) if comparison in ("lt", "gt") else gap // stride + 1


def _batched_while(step: Step, cond_fun: Any, body_fun: Any, init: Sequence[Any]) -> list[Any]:
    """A ``while`` whose predicate is an array (what ``vmap`` makes of a batched predicate: the
    loop runs while any element holds and only those elements step): ``lax.while_loop`` accepts
    scalar predicates only, so the primitive is bound again with the rewritten bodies."""
    avals = [compat.aval_of(x) for x in init]
    cond, cond_consts = compat.hoist_consts(
        compat.trace_to_closed(lambda *carry: [cond_fun(list(carry))], avals)
    )
    body, body_consts = compat.hoist_consts(
        compat.trace_to_closed(lambda *carry: body_fun(list(carry)), avals)
    )
    return step.bind(
        [*cond_consts, *body_consts, *init],
        cond_jaxpr=compat.as_closed(cond),
        body_jaxpr=compat.as_closed(body),
        cond_nconsts=len(cond_consts),
        body_nconsts=len(body_consts),
    )


@register("cond")
def cond_rule(step: Step) -> Sequence[Any]:
    index, operands = step.args[0], step.args[1:]
    avals, hints = step.avals()[1:], step.hints()[1:]
    branches = [step.rewrite_sub(b, avals, hints) for b in step.params["branches"]]
    traced_out = [v.aval.dtype for v in step.eqn.outvars]
    # Where rewritten branches disagree on an output's dtype, all of them return the traced dtype.
    targets = [
        dtypes.pop()
        if len(dtypes := {b.out_avals[i].dtype for b in branches}) == 1
        else traced_out[i]
        for i in range(len(traced_out))
    ]

    def as_function(branch: Any) -> Any:
        jaxpr, consts = compat.open_and_consts(branch)
        return lambda *ops: cast_all(
            compat.eval_jaxpr(jaxpr, consts, ops), targets, step.rewriter.recorder
        )

    functions = [as_function(b) for b in branches]
    platforms = step.params.get("branches_platforms")
    with compat.equation_context(step.eqn):
        if platforms is not None:  # lax.platform_dependent: lower only the target's branch
            return list(_platform_dependent(operands, functions, platforms))
        return list(lax.switch(index, functions, *operands))


def _platform_dependent(
    operands: Sequence[Any], functions: Sequence[Any], platforms: Sequence[Any]
) -> Any:
    """Rebuild ``lax.platform_dependent`` from its ``branches_platforms`` (``None``: default).

    Its index comes from ``platform_index``, which it binds again itself.
    """
    per_platform, default = {}, None
    for names, function in zip(platforms, functions):
        if names is None:
            default = function
        else:
            per_platform.update({name: function for name in names})
    return lax.platform_dependent(*operands, default=default, **per_platform)


# --- instrumented walks (probe.py): the observer's state rides along in the carry ----------------


def _open(closed: Any) -> Any:
    return compat.open_and_consts(compat.as_closed(closed))[0]


@register_walk("scan", bodies=lambda eqn: [_open(eqn.params["jaxpr"])], loop=True)
def walk_scan(ctx: Any, invals: Sequence[Any], state: Any) -> tuple[list[Any], Any]:
    params = ctx.eqn.params
    if params["length"] == 0:  # no iteration runs (and disable_jit refuses empty scans)
        return ctx.bind(invals), state
    n_consts, n_carry = compat.scan_counts(params, len(invals))
    consts, init = invals[:n_consts], invals[n_consts : n_consts + n_carry]
    xs = invals[n_consts + n_carry :]

    def body(carry: Any, x: Any) -> Any:
        values, st, it = carry
        outs, st = ctx.run(params["jaxpr"], [*consts, *values, *x], st, iteration=it)
        return (outs[:n_carry], st, it + 1), outs[n_carry:]

    with compat.equation_context(ctx.eqn):
        (carry, state, _), ys = lax.scan(
            body,
            (list(init), state, ctx.zero()),
            list(xs),
            length=params["length"],
            reverse=params["reverse"],
            unroll=params["unroll"],
        )
    return [*carry, *ys], state


@register_walk("while", bodies=lambda eqn: [_open(eqn.params["body_jaxpr"])], loop=True)
def walk_while(ctx: Any, invals: Sequence[Any], state: Any) -> tuple[list[Any], Any]:
    """The loop body is walked; the (scalar) condition is evaluated as is."""
    params = ctx.eqn.params
    n_cond, n_body = params["cond_nconsts"], params["body_nconsts"]
    cond_consts, body_consts = invals[:n_cond], invals[n_cond : n_cond + n_body]
    init = list(invals[n_cond + n_body :])
    cond_jaxpr, cond_inner = compat.open_and_consts(params["cond_jaxpr"])

    def cond_fun(carry: Any) -> Any:
        return compat.eval_jaxpr(cond_jaxpr, cond_inner, [*cond_consts, *carry[0]])[0]

    def body_fun(carry: Any) -> Any:
        values, st, it = carry
        outs, st = ctx.run(params["body_jaxpr"], [*body_consts, *values], st, iteration=it)
        return outs, st, it + 1

    with compat.equation_context(ctx.eqn):
        values, state, _ = lax.while_loop(cond_fun, body_fun, (init, state, ctx.zero()))
    return list(values), state


def _branches(eqn: Any) -> list[Any]:
    return [_open(b) for b in eqn.params["branches"]]


@register_walk("cond", bodies=_branches)
def walk_cond(ctx: Any, invals: Sequence[Any], state: Any) -> tuple[list[Any], Any]:
    index, operands = invals[0], list(invals[1:])
    offsets = [0]
    for body in _branches(ctx.eqn):  # the sites of branch k are numbered after those before it
        offsets.append(offsets[-1] + ctx.sites_in(body))

    def branch(k: int, closed: Any) -> Any:
        return lambda ops, st: tuple(ctx.run(closed, ops, st, offset=offsets[k]))

    fns = [branch(k, b) for k, b in enumerate(ctx.eqn.params["branches"])]
    with compat.equation_context(ctx.eqn):
        outs, state = lax.switch(index, fns, operands, state)
    return list(outs), state
