"""Every private or version-dependent JAX API jamp touches, in one place.

Supported: jax 0.10.x (Python 3.11 here) and jax 0.12.x (Python 3.12). Differences handled here:
``ClosedJaxpr`` merged into ``Jaxpr`` in 0.12, scan's operand counts moved into ``ft_in`` in 0.11,
``get_bind_params`` returned ``(subfuns, params)`` before 0.9.2, and 0.12 binds pure calls as
``eval_jaxpr``; ``jax.nn.softmax`` traces as a
custom-JVP call only under the ``jax_softmax_custom_jvp`` flag. (The rules register both ``jit``
and ``pjit``, the primitive's name before 0.10.) ``partial_eval.trace_to_jaxpr_dynamic`` and
``linear_util.DebugInfo``, used to trace rewritten sub-jaxprs, are the same in 0.10 and 0.12.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import operator
import os
import re
import threading
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, TypeVar

import jax
import numpy as np
from jax._src import api as _api
from jax._src import array as _array
from jax._src import core as _core
from jax._src import dtypes as _dtypes
from jax._src import linear_util as _lu
from jax._src import pjit as _pjit
from jax._src import sharding_impls as _sharding_impls
from jax._src import source_info_util as _siu
from jax._src import traceback_util as _traceback_util
from jax._src.interpreters import ad as _ad_module
from jax._src.interpreters import partial_eval as _pe
from jax._src.lax import lax as _lax_internal

Literal = _core.Literal
Var = _core.Var
# The trace of a program being built (``make_jaxpr``/``jit``) and its tracers (a tracer's
# ``val`` is its Var there).
ProgramTrace = _pe.DynamicJaxprTrace
ProgramTracer = _pe.DynamicJaxprTracer
_ArrayImpl = _array.ArrayImpl
ArrayImpl = _ArrayImpl  # the class of a concrete jax.Array (what eager code computes)
_NamedSharding = _sharding_impls.NamedSharding
DropVar = _core.DropVar
Primitive = _core.Primitive
ShapedArray = _core.ShapedArray
AbstractValue = _core.AbstractValue  # avals in equation params (callback result_avals)
Tracer = _core.Tracer
JaxprTypeError = _core.JaxprTypeError
# jax < 0.12 has a separate ClosedJaxpr; from 0.12 a Jaxpr carries its consts itself.
_ClosedJaxpr = getattr(_core, "ClosedJaxpr", None)
_JAXPR_TYPES = tuple(t for t in (_core.Jaxpr, _ClosedJaxpr) if t is not None)


def close_jaxpr(jaxpr: Any, consts: Sequence[Any]) -> Any:
    """A closed jaxpr from an open one with constvars and their values: jax < 0.12 wraps it in a
    ``ClosedJaxpr``; from 0.12 the consts are attached to the ``Jaxpr`` itself."""
    if _ClosedJaxpr is not None:
        return _ClosedJaxpr(jaxpr, list(consts))
    return jaxpr.with_consts(list(consts))


def unclosed_constvars(jaxpr: Any) -> int:
    """How many constvars an open jaxpr of jax < 0.12 (``closed.jaxpr``) leaves without values
    (from 0.12 a ``Jaxpr`` holds its consts itself: 0)."""
    if _ClosedJaxpr is None or isinstance(jaxpr, _ClosedJaxpr):
        return 0
    return len(jaxpr.constvars)


# Pure call wrappers (a body and nothing else). jax 0.12 folds ``closed_call``/``call`` into one
# ``eval_jaxpr`` primitive (what ``checkpoint`` of a ``vmap`` of a ``scan`` binds under ``grad``;
# body in ``call_jaxpr``). jax 0.10 has an ``eval_jaxpr`` primitive of its own (body in ``jaxpr``)
# that JAX binds (scan's impl, shard_map) and a jaxpr trace stages as ``closed_call``: a jaxpr
# never holds it, but a region sees it bound.
_eval_jaxpr_p: Any
try:
    from jax._src.lax.eval_jaxpr import eval_jaxpr_p as _eval_jaxpr_p
except ImportError:  # pragma: no cover - neither version lacks it today
    _eval_jaxpr_p = getattr(_core, "eval_jaxpr_p", None)
INLINE_CALL_PRIMITIVES: tuple[str, ...] = tuple(
    dict.fromkeys(
        ("closed_call", "core_call", "call")
        + ((_eval_jaxpr_p.name,) if _eval_jaxpr_p is not None else ())
    )
)


def bind_eval_jaxpr(closed: Any, *args: Any) -> list[Any]:
    """Bind the ``eval_jaxpr`` primitive on ``closed`` as JAX does (the tests' way to reach it)."""
    assert _eval_jaxpr_p is not None
    body = "call_jaxpr" if _eval_jaxpr_p is getattr(_core, "eval_jaxpr_p", None) else "jaxpr"
    return _eval_jaxpr_p.bind(*args, **{body: closed})


def is_jaxpr_like(value: Any) -> bool:
    """True for an open or closed jaxpr (any JAX version)."""
    return isinstance(value, _JAXPR_TYPES)


def _has_jaxpr_param(params: dict) -> bool:
    """Whether a parameter is a jaxpr (such an equation is bound, never staged directly)."""
    for value in params.values():  # (a loop, not any() of a generator: asked per operation)
        if isinstance(value, _JAXPR_TYPES):
            return True
    return False


def open_and_consts(closed: Any) -> tuple[Any, list[Any]]:
    """(jaxpr with .constvars/.invars/.eqns/.outvars, consts binding its constvars)."""
    if _ClosedJaxpr is not None and isinstance(closed, _ClosedJaxpr):
        return closed.jaxpr, list(closed.consts)
    return closed, list(getattr(closed, "consts", ()))


def flatten_arguments(tree: Any) -> tuple[list[Any], Any]:
    """A call's arguments flattened as ``jax.jit`` flattens them: with JAX's tracing registry,
    which also splits a reference view (``ref.at[...]``, a leaf in user code) into the
    reference and how it is viewed."""
    from jax._src import tree_util

    return tree_util.tracing_registry.flatten(tree)


def same_program(a: Any, b: Any) -> bool:
    """Whether two closed jaxprs compute the same thing the same way: the same equations (the same
    primitives, equal parameters, sub-programs the same objects), wired alike, on equal constants
    and the same types. Conservative: a parameter or constant that cannot be compared makes them
    differ. (Source lines and name stacks are not compared: a callee's are relative to its call.)"""
    (ja, ca), (jb, cb) = open_and_consts(a), open_and_consts(b)
    if (
        len(ja.eqns) != len(jb.eqns)
        or len(ca) != len(cb)
        or len(ja.invars) != len(jb.invars)
        or len(ja.outvars) != len(jb.outvars)
    ):
        return False
    names: dict[Any, Any] = {}  # a's variables -> b's
    for x, y in zip([*ja.constvars, *ja.invars], [*jb.constvars, *jb.invars]):
        if x.aval != y.aval:
            return False
        names[x] = y

    def same_atom(x: Any, y: Any) -> bool:
        if type(x) is _core.Literal or type(y) is _core.Literal:
            return (
                type(x) is type(y)
                and x.aval == y.aval
                and type(x.val) is type(y.val)
                and bool(np.array_equal(x.val, y.val))
            )
        return names.get(x) is y

    try:
        if not all(map(_same_constant, ca, cb)):
            return False
        for ea, eb in zip(ja.eqns, jb.eqns):
            if (
                ea.primitive is not eb.primitive
                or len(ea.invars) != len(eb.invars)
                or len(ea.outvars) != len(eb.outvars)
                or not all(same_atom(x, y) for x, y in zip(ea.invars, eb.invars))
                or ea.params.keys() != eb.params.keys()
                or not all(_same_param(ea.params[k], eb.params[k]) for k in ea.params)
                or ea.effects != eb.effects
                or ea.ctx != eb.ctx
            ):
                return False
            for x, y in zip(ea.outvars, eb.outvars):
                if x.aval != y.aval:
                    return False
                names[x] = y
        return all(same_atom(x, y) for x, y in zip(ja.outvars, jb.outvars))
    except Exception:  # (a parameter whose == raises or is ambiguous, a key array's values)
        return False


def _same_constant(x: Any, y: Any) -> bool:
    """The same object, or concrete arrays of one type and equal values (a constant the rewrite
    cast again: a closed-over weight in bfloat16)."""
    if x is y:
        return True
    if isinstance(x, _core.Tracer) or isinstance(y, _core.Tracer):
        return False
    aval_x, aval_y = getattr(x, "aval", None), getattr(y, "aval", None)
    if aval_x is None or aval_x != aval_y:
        return False
    return bool(np.array_equal(np.asarray(x), np.asarray(y)))


def _same_param(x: Any, y: Any) -> bool:
    if x is y:
        return True
    if is_jaxpr_like(x) or is_jaxpr_like(y):  # sub-programs: the same object (lowered once)
        return False
    if isinstance(x, (tuple, list)) and isinstance(y, (tuple, list)):
        return type(x) is type(y) and len(x) == len(y) and all(map(_same_param, x, y))
    return type(x) is type(y) and bool(x == y)


def closed_out_avals(closed: Any) -> list[Any]:
    """The output types of a closed jaxpr."""
    return [v.aval for v in open_and_consts(closed)[0].outvars]


def check_closed_jaxpr(closed: Any) -> None:
    """Run JAX's own type checker; raises ``JaxprTypeError``."""
    jaxpr, _ = open_and_consts(closed)
    _core.check_jaxpr(jaxpr)


def aval_of(x: Any) -> ShapedArray:
    # A tracer's type is its ``aval`` (what ``jax.typeof`` returns for one, after a walk of the
    # tracer class's MRO): a region asks for every operand of every operation. So is an array's
    # on one device (``typeof`` updates it from a ``NamedSharding`` only, at ~2 µs a call).
    if isinstance(x, _core.Tracer):
        return x.aval  # type: ignore[return-value]  # (an array's tracer: a ShapedArray)
    if type(x) is _ArrayImpl and not isinstance(x.sharding, _NamedSharding):
        return x.aval
    return _core.typeof(x)


def name_stack_of(eqn: Any) -> Any:
    """An equation's name stack (immutable: equations traced in one scope share it)."""
    return eqn.source_info.name_stack


def scope_names(eqn: Any) -> tuple[str, ...]:
    """Names of the ``jax.named_scope``/Flax module scopes an equation was traced under (not
    the scope ``jnp.einsum`` opens itself, named by its subscripts: JAX's, not the user's)."""
    return tuple(
        s.name
        for s in eqn.source_info.name_stack.stack
        if isinstance(s, _siu.Scope) and not _is_einsum_scope(s.name)
    )


# jnp.einsum names the scope of its products by its subscripts (``jax.named_call(name=spec)``):
# letters, '...' and spaces around ',' (two operands or more) and '->'.
_EINSUM_SUBSCRIPTS = re.compile(r"[A-Za-z. ]*(,[A-Za-z. ]*)*(->[A-Za-z. ]*)?")


def _is_einsum_scope(name: str) -> bool:
    # (the regex only for names with a comma or an arrow: asked for every equation rewritten)
    return ("," in name or "->" in name) and _EINSUM_SUBSCRIPTS.fullmatch(name) is not None


def source_line(eqn: Any) -> str:
    """The user's source line an equation came from, e.g. ``model.py:12 (loss)``."""
    try:
        return _siu.summarize(eqn.source_info) or "<JAX-internal code>"
    except Exception:  # pragma: no cover - best effort for error messages only
        return "<unknown source>"


def user_frames(eqn: Any) -> list[tuple[str, int, str]]:
    """``(file, line, function)`` of the frames outside JAX an equation was traced from,
    innermost first."""
    return [
        (f.file_name, f.start_line, f.function_name)
        for f in _siu.user_frames(eqn.source_info.traceback)
    ]


def frame_lines(source_info: Any) -> tuple[tuple[str, int], ...]:
    """``(file, line)`` of the frames outside JAX and jamp an operation was traced from,
    innermost first (what ``'@file:line'`` policy rules match)."""
    traceback = source_info.traceback
    if traceback is None:
        return ()
    return tuple((f.file_name, f.start_line) for f in _siu.user_frames(traceback))


def current_source_info() -> Any:
    """The source info of an operation bound now, with the live Python stack as its traceback:
    inside a ``jnp`` function's inline jit the context holds the traceback its body was first
    traced with, which may not name the line running now."""
    return _siu.current().replace(traceback=_siu.Traceback.get_traceback())


def transform_names(eqn: Any) -> frozenset[str]:
    """The transformations an equation was traced under (``"jvp"``, ``"transpose"``, ...)."""
    return frozenset(
        s.name for s in eqn.source_info.name_stack.stack if isinstance(s, _siu.Transform)
    )


def traceback_of(eqn: Any) -> Any:
    """The traceback object an equation was traced under; JAX and jamp pass it on unchanged to the
    equations derived from it (casts, JVPs, transposes), so identity links them."""
    return eqn.source_info.traceback


def equation_context(eqn: Any) -> contextlib.AbstractContextManager[Any]:
    """Re-bind under the equation's source info and name stack, as ``jax.core.eval_jaxpr`` does;
    nothing for an operation a region re-binds as it is bound (``is_current``: its source info
    and name stack are the current ones already, and this runs for every operation)."""
    if getattr(eqn, "is_current", False):
        return _ALREADY_CURRENT
    return _equation_context(eqn)


_ALREADY_CURRENT = contextlib.nullcontext()


class _equation_context:  # noqa: N801 - used as a function
    """``with user_context(traceback, name_stack=...), eqn.ctx.manager:`` as ``eval_jaxpr``
    enters them; a class rather than a generator: it runs for every equation rewritten."""

    __slots__ = ("eqn", "user", "manager")

    def __init__(self, eqn: Any) -> None:
        self.eqn = eqn

    def __enter__(self) -> None:
        info = self.eqn.source_info
        name_stack = _siu.current_name_stack() + info.name_stack
        self.user = _siu.user_context(info.traceback, name_stack=name_stack)
        self.user.__enter__()
        try:
            self.manager = self.eqn.ctx.manager
            self.manager.__enter__()
        except BaseException:
            self.user.__exit__(None, None, None)
            raise

    def __exit__(self, *exc: Any) -> Any:
        try:
            self.manager.__exit__(*exc)
        finally:
            result = self.user.__exit__(*exc)
        return result


# --- Staging a rewritten equation directly (the transform's hot path) -------------------------
# Re-binding an equation into a program being built (``jax.make_jaxpr``, ``jax.jit``) costs a
# full ``bind``: canonicalize every operand, find the trace, convert operands, look up the
# abstract evaluation, try constant folding and forwarding, under the equation's source and
# context managers. For most equations none of that can change anything: a primitive without a
# staging, forwarding or folding rule of its own, on tracers of that trace, in the context it was
# traced in. Those are staged here as ``DynamicJaxprTrace.default_process_primitive`` stages them
# (the same types, source info, context and equation), with the traced equation's output types
# when the operand types and parameters are the same. Everything else returns None: bound.

_PLAIN_PRIMITIVE = (
    _core.Primitive.bind,
    _core.Primitive.bind_with_trace,
    _core.Primitive.is_high,
    _core.Primitive.get_bind_params,
)
_HIGH_ORDER_NAMES = ("custom_lin", "call_hi_primitive_linearized", "call_hi_primitive")


def _always(params: dict, avals: list) -> bool:
    return True


def _broadcast_changes_shape(params: dict, avals: list) -> bool:
    return tuple(params["shape"]) != avals[0].shape  # (else its forwarding rule passes x on)


# Primitives with a staging or forwarding rule that stages them as the default does (checked on
# jax 0.10 and 0.12; tests/test_staging.py compares every program staged with one bound), and
# when: (params, operand avals) -> bool.
_STAGED_AS_DEFAULT: dict[Any, Callable[[dict, list], bool]] = {
    _lax_internal.reshape_p: _always,
    _lax_internal.broadcast_in_dim_p: _broadcast_changes_shape,
}
_stageable: dict[Any, Callable[[dict, list], bool] | None] = {}
_name_stacks: dict[tuple[int, int], tuple[Any, Any, Any]] = {}


def _staging_condition(primitive: Any) -> Callable[[dict, list], bool] | None:
    """When ``primitive`` may be staged directly (None: never); decided once per primitive."""
    if primitive in _stageable:
        return _stageable[primitive]
    cls = type(primitive)
    plain = (
        (cls.bind, cls.bind_with_trace, cls.is_high, cls.get_bind_params) == _PLAIN_PRIMITIVE
        and not getattr(primitive, "ref_allocating", False)
        and primitive.name not in _HIGH_ORDER_NAMES
    )
    condition = _STAGED_AS_DEFAULT.get(primitive)
    if condition is None and not (
        primitive in _pe.custom_staging_rules
        or primitive in _pe.forwarding_rules
        or primitive in _pe.const_fold_rules
    ):
        condition = _always
    _stageable[primitive] = condition = condition if plain else None
    return condition


class StagingTarget(NamedTuple):
    """The program being built where a rewrite runs (``staging_target``)."""

    trace: Any  # its DynamicJaxprTrace
    ctx: Any  # the equation context (``JaxprEqnContext``) an operation bound there gets
    name_stack: Any  # the current name stack, None where empty (an equation keeps its own)


def staging_target() -> StagingTarget | None:
    """Where a rewrite starting now may stage equations directly (``stage_like``): the program
    being built (the current trace), with the context and name stack an operation bound now
    gets; None where operations are bound (eagerly, under vmap). Found once per program
    rewritten: a rule that enters another trace rewrites what it binds there with its own."""
    trace = _core.trace_ctx.trace
    if type(trace) is not _pe.DynamicJaxprTrace:
        return None
    current = _siu.current_name_stack()
    return StagingTarget(
        trace, _core.current_jaxpr_eqn_context(), current if current.stack else None
    )


def _staged_source_info(info: Any, target: StagingTarget) -> Any:
    """``info`` under the target's name stack, as ``equation_context`` makes it current."""
    current = target.name_stack
    if current is None:  # (at the program's top, as under jit: the equation's own stack)
        return info
    key = (id(current), id(info.name_stack))
    hit = _name_stacks.get(key)
    if hit is None or hit[0] is not current or hit[1] is not info.name_stack:
        if len(_name_stacks) > 4096:
            _name_stacks.clear()
        hit = _name_stacks[key] = (current, info.name_stack, current + info.name_stack)
    return _siu.SourceInfo(info.traceback, hit[2])


def _stage(
    eqn: Any,
    primitive: Any,
    args: Sequence[Any],
    params: dict,
    same_types: bool,
    target: StagingTarget,
    condition: Callable[[dict, list], bool],
) -> list[Any] | None:
    """Stage ``primitive`` on ``args`` under ``eqn``'s source info and context, or None."""
    trace = _program_staged_into(eqn, target)
    if trace is None or eqn.effects or _has_jaxpr_param(params):
        return None
    source_info = _staged_source_info(eqn.source_info, target)
    tracers = _staged_operands(trace, args, eqn.invars, source_info)
    if tracers is None:
        return None
    avals = [t.aval for t in tracers]
    if not condition(params, avals):
        return None
    if same_types and all(a == v.aval for a, v in zip(avals, eqn.invars)):
        out_avals = [v.aval for v in eqn.outvars]
    else:
        out_avals = None
    return _add_equation(
        trace, tracers, primitive, params, source_info, eqn.ctx, out_avals, eqn.effects
    )


def _program_staged_into(eqn: Any, target: StagingTarget) -> Any:
    """The program being built (the target's trace, current) that ``eqn`` may be staged into
    directly: traced in the context of the caller's program, with a source to put under the
    caller's name stack; None otherwise (bound)."""
    trace = target.trace
    if (
        eqn.ctx is not target.ctx
        or eqn.source_info.traceback is None
        or _core.trace_ctx.trace is not trace
    ):
        return None
    return trace


# Host constants, which a bind canonicalizes and makes constants of the program (Primitive.bind:
# ``canonicalize_value``, then ``to_jaxpr_tracer``) and nothing else: a device array's sharding
# may name a mesh that bind casts it to, so it is bound.
_HOST_CONSTANTS = frozenset({np.ndarray, float, int, bool, complex})


def _staged_operands(
    trace: Any, args: Sequence[Any], invars: Sequence[Any], source_info: Any
) -> list[Any] | None:
    """``args`` as tracers of ``trace``, program constants made of host constants (an
    equation's literal, a constant cast at rewrite time) as bind makes them; None where only a
    bind can take them: a tracer of another trace, another value, or no tracer at all (bind may
    fold the operation: eager_constant_folding)."""
    tracers, any_tracer = [], False
    for arg, atom in zip(args, invars):
        if type(arg) is _pe.DynamicJaxprTracer:
            if arg._trace is not trace:
                return None
            any_tracer = True
        elif type(atom) is _core.Literal and arg is atom.val and is_rank0_array(arg):
            # (a literal of any program, the same one: what ``to_jaxpr_tracer`` makes of it)
            arg = _pe.DynamicJaxprTracer(trace, atom.aval, atom, source_info)
        elif (type(atom) is _core.Literal and arg is atom.val) or (
            type(arg) in _HOST_CONSTANTS or isinstance(arg, np.generic)
        ):
            arg = trace.to_jaxpr_tracer(_dtypes.canonicalize_value(arg), source_info)
        else:
            return None
        tracers.append(arg)
    return tracers if any_tracer else None


def is_rank0_array(value: Any) -> bool:
    """Whether ``value`` is a rank-0 host array (a traced literal's value, jax.literals'
    ``TypedNdArray``): ``core.is_literalable`` in any program, a device array only outside
    differentiation."""
    return isinstance(value, np.ndarray) and not value.shape


def _add_equation(
    trace: Any,
    tracers: list[Any],
    primitive: Any,
    params: dict,
    source_info: Any,
    ctx: Any,
    out_avals: list[Any] | None = None,
    effects: Any = _core.no_effects,
    evaluated: list | None = None,
) -> list[Any] | None:
    """Add ``primitive`` on ``tracers`` to ``trace``'s program as its default staging does, with
    ``out_avals`` or its (cached) abstract evaluation; None for one with effects (bound).
    ``effects``: the (empty) effects its abstract evaluation gives, as ``jax_enable_checks``
    compares them by type too (``free_ref``'s are ``{}``). ``evaluated``: a list that holds that
    evaluation ``(out_avals, effects)`` once made, for an operation staged again at the same
    types and parameters (a region's replayed decision: its key holds them), where JAX's cache
    of it would hash every operand type and parameter again."""
    if out_avals is None:
        if evaluated:
            out_avals, effects = evaluated[0]
        else:
            out, effects = _pe._cached_abstract_eval(
                primitive, *[t.aval for t in tracers], **params
            )
            out_avals = list(out) if primitive.multiple_results else [out]
            if evaluated is not None:
                evaluated.append((out_avals, effects))
        if effects:
            return None
    staged, outs = trace.make_eqn(tracers, out_avals, primitive, params, effects, source_info, ctx)
    trace.frame.add_eqn(staged)
    return outs


def stage_like(eqn: Any, args: Sequence[Any], params: dict | None, target: StagingTarget) -> Any:
    """Stage ``eqn``'s primitive on ``args`` (with ``params``, or the equation's own when None)
    into the program being built, as binding it under ``equation_context(eqn)`` would: a list
    of outputs, or None where only a bind can (then the caller binds). ``target``:
    ``staging_target()`` where the caller's program is built (an equation traced in another
    context, under a mesh or XLA metadata, is bound)."""
    primitive = eqn.primitive
    condition = _staging_condition(primitive)
    if condition is None:
        return None
    if params is None:
        return _stage(eqn, primitive, args, eqn.params, True, target, condition)
    return _stage(eqn, primitive, args, params, False, target, condition)


def stage_decided(
    eqn: Any, args: Sequence[Any], params: dict, out_avals: Sequence[Any], target: StagingTarget
) -> list[Any] | None:
    """``stage_like`` for an equation staged before at the same signature (primitive, parameters,
    operand types: ``interpreter.TransformDecisions.key``), with the output types it had: what
    depends on the signature alone (the staging condition, a jaxpr parameter, the abstract
    evaluation) is not asked again, what depends on the values is (their trace, the context,
    the constants)."""
    # (``_program_staged_into`` and ``_staged_source_info`` inlined: asked per replayed equation)
    trace, source_info = target.trace, eqn.source_info
    if (
        eqn.ctx is not target.ctx
        or source_info.traceback is None
        or _core.trace_ctx.trace is not trace
    ):
        return None
    if target.name_stack is not None:
        source_info = _staged_source_info(source_info, target)
    tracers = _staged_operands(trace, args, eqn.invars, source_info)
    if tracers is None:
        return None
    staged, outs = trace.make_eqn(
        tracers, list(out_avals), eqn.primitive, params, eqn.effects, source_info, eqn.ctx
    )
    trace.frame.add_eqn(staged)
    return outs


def stage_convert(eqn: Any, x: Any, dtype: np.dtype, target: StagingTarget) -> Any:
    """``convert(x, dtype)`` staged under ``eqn``'s source info as ``stage_like`` stages, where
    staging may add it directly (``_direct_cast_params``); None where only a bind can."""
    trace = _program_staged_into(eqn, target)
    if trace is None or type(x) is not _pe.DynamicJaxprTracer or x._trace is not trace:
        return None
    params = _direct_cast_params(x, dtype)
    if params is None:
        return None
    primitive = _lax_internal.convert_element_type_p
    out, effects = _pe._cached_abstract_eval(primitive, x.aval, **params)
    staged, outs = trace.make_eqn(
        [x],
        [out],
        primitive,
        params,
        effects,
        _staged_source_info(eqn.source_info, target),
        eqn.ctx,
    )
    trace.frame.add_eqn(staged)
    return outs[0]


def _direct_cast_params(x: Any, dtype: np.dtype) -> dict | None:
    """The parameters of ``convert(x, dtype)`` where staging may add it directly: ``x`` a
    tracer of a program being built and not a known constant (no folding rule applies), of
    another floating dtype than ``dtype`` (no forwarding; what ``convert`` does before it binds
    is then nothing: no extended dtype, no complex part dropped); else None."""
    if (
        type(x) is not _pe.DynamicJaxprTracer
        or not _float_to_float(x, dtype)
        or x.get_const() is not None
    ):
        return None
    return _float_cast_params(dtype)


def _float_cast_params(dtype: np.dtype) -> dict:
    """What ``convert`` binds ``convert_element_type`` with for a cast between floating dtypes:
    a strong type, the operand's sharding."""
    return {"new_dtype": dtype, "weak_type": False, "sharding": None}


def stage_shape_op(eqn: Any, primitive: Any, x: Any, params: dict, target: StagingTarget) -> Any:
    """``primitive`` (a shape-only op, ``params`` its parameters) on ``x`` staged under
    ``eqn``'s source info as ``stage_convert`` stages a cast; None where only a bind can."""
    trace = _program_staged_into(eqn, target)
    if trace is None or type(x) is not _pe.DynamicJaxprTracer or x._trace is not trace:
        return None
    source_info = _staged_source_info(eqn.source_info, target)
    outs = _add_equation(trace, [x], primitive, params, source_info, eqn.ctx)
    return None if outs is None else outs[0]


def convert_now(x: Any, dtype: Any) -> Any:
    """``convert(x, dtype)`` bound now (a region's cast, under the current source info and
    context), staged directly into the current trace where ``stage_convert`` would stage it,
    eagerly bound directly for an array of another floating dtype, else converted."""
    trace: Any = _core.trace_ctx.trace
    dtype = np.dtype(dtype)
    if type(trace) is _pe.DynamicJaxprTrace:
        staged = _cast_staged(trace, x, dtype)
        if staged is not None:
            return staged
    elif type(trace) is _core.EvalTrace and type(x) is _ArrayImpl and _float_to_float(x, dtype):
        # (what ``convert`` binds for it, after ~20 calls of checks that then do nothing)
        return _lax_internal.convert_element_type_p.bind_with_trace(
            trace,
            (x,),
            (x.aval,),
            _float_cast_params(dtype),
        )
    return convert(x, dtype)


def convert_on(trace: Any, x: Any, dtype: np.dtype) -> Any:
    """``convert_now(x, dtype)`` with ``trace`` current (a region's parent): staged directly
    into a program being built without entering the trace context, where it can be."""
    if type(trace) is _pe.DynamicJaxprTrace:
        staged = _cast_staged(trace, x, dtype)
        if staged is not None:
            return staged
    with _core.set_current_trace(trace):
        return convert_now(x, dtype)


def _cast_staged(trace: Any, x: Any, dtype: np.dtype) -> Any:
    """``convert(x, dtype)`` staged directly into ``trace`` (a program being built) where
    ``_direct_cast_params`` allows, else None."""
    params = _direct_cast_params(x, dtype)
    if params is None:
        return None
    outs = _stage_cast(trace, x, params)
    return None if outs is None else outs[0]


def _stage_cast(trace: Any, x: Any, params: dict) -> list[Any] | None:
    """A cast of ``x`` with ``params`` (``_direct_cast_params``) staged into ``trace`` (None
    where ``x`` is another trace's tracer), its abstract evaluation kept per operand type and
    dtype (a region casts every operation's operands: JAX's cache of it would hash the type and
    parameters again each time)."""
    if x._trace is not trace:
        return None
    key = (x.aval, params["new_dtype"])
    evaluated = _CAST_EVALUATIONS.get(key)
    if evaluated is None:
        if len(_CAST_EVALUATIONS) > _CAST_EVALUATIONS_KEPT:
            _CAST_EVALUATIONS.clear()
        evaluated = _CAST_EVALUATIONS[key] = []
    # (what else _stage_now checks is known of a cast: no jaxpr parameter, always staged)
    return _add_equation(trace, [x], _convert_p, params, _siu.current(), None, evaluated=evaluated)


_CAST_EVALUATIONS: dict[tuple[Any, np.dtype], list] = {}
_CAST_EVALUATIONS_KEPT = 4096


def _float_to_float(x: Any, dtype: np.dtype) -> bool:
    """Whether ``x`` is of another floating dtype than ``dtype``, itself floating."""
    source = x.dtype
    if source == dtype:
        return False
    known = _FLOAT_PAIRS.get((source, dtype))
    if known is None:  # (JAX's issubdtype is Python: asked once per pair of dtypes)
        known = _FLOAT_PAIRS[source, dtype] = bool(
            _dtypes.issubdtype(source, np.floating) and _dtypes.issubdtype(dtype, np.floating)
        )
    return known


_FLOAT_PAIRS: dict[tuple[Any, Any], bool] = {}


def bind_params(eqn: Any) -> dict[str, Any]:
    params = eqn.primitive.get_bind_params(eqn.params)
    if isinstance(params, tuple):  # jax < 0.9.2 returned (subfuns, params)
        subfuns, params = params
        if subfuns:
            raise NotImplementedError(
                f"{eqn.primitive} binds with subfunctions on this JAX version"
            )
    return dict(params)


def linearizing_trace() -> Any:
    """The current trace where it is JAX's linearize trace (``jax.grad``, ``vjp`` or ``linearize``
    of a function calling a transformed one, inside ``jax.jit`` or not), else None."""
    trace = _core.trace_ctx.trace
    return trace if type(trace) is _ad_module.LinearizeTrace else None


def bind_to_linearize(
    trace: Any, primitive: Any, args: Sequence[Any], params: dict
) -> list[Any] | None:
    """``primitive`` on ``args`` bound into JAX's linearize trace ``trace`` (current) as a call
    of a one-operation ``jax.jit`` function, kept per primitive and parameters; None where a
    plain bind is left to do it (the caller binds): a primitive JAX linearizes by a rule of
    its own, one carrying programs, an operand that is not a tracer, none of ``trace``.

    JAX linearizes a primitive without a linearization rule of its own by tracing its JVP
    rule into a program, partially evaluating and pruning it, for every operation it takes
    (``fallback_linearize_rule``), where a jit call's rule linearizes the call's program once
    and reuses that for every call of the same program object: ``jnp``'s functions are jitted,
    and so hand-written code reaches that rule for most of its operations. A rewrite binding
    a model's operations one by one took the fallback for each, so ``jax.grad`` of a function
    calling ``autocast_transform`` traced at 1.24-1.37x the hand-written bfloat16 model's
    (benchmarks/README.md, issue 33, forty-first pass). The call is inlined where its primal
    and tangent parts are staged (``_one_operation_jit``), under the current source info and
    name stack, as JAX inlines ``jnp``'s: the program is the one the operations bound one by
    one give (on jax 0.12, operations under ``set_xla_metadata`` may have their backward
    pass's cotangent sums listed in another order: the same sums)."""
    if primitive in _ad_module.primitive_linearizations or _has_jaxpr_param(params):
        return None
    own = False
    for a in args:
        if not isinstance(a, _core.Tracer):
            return None  # (a literal: jit would make it an operand of another weak type)
        if type(a) is _ad_module.LinearizeTracer and a._trace is trace:
            own = True
    if not own:
        return None
    try:
        call = _one_operation_jit(primitive, tuple(params.items()))
    except TypeError:  # (a parameter that cannot be hashed)
        return None
    out = call(*args)
    return list(out) if primitive.multiple_results else [out]


def convert_to_linearize(trace: Any, x: Any, dtype: Any) -> Any:
    """``convert(x, dtype)`` of a tracer of another floating dtype, bound into the linearize
    trace ``trace`` as ``bind_to_linearize`` binds (the same parameters ``convert`` binds);
    None where it is not (the caller converts)."""
    dtype = np.dtype(dtype)
    if not isinstance(x, _core.Tracer) or not _float_to_float(x, dtype):
        return None
    outs = bind_to_linearize(
        trace, _lax_internal.convert_element_type_p, [x], _float_cast_params(dtype)
    )
    return None if outs is None else outs[0]


@functools.lru_cache(maxsize=4096)
def _one_operation_jit(primitive: Any, params: tuple) -> Callable[..., Any]:
    # (kept: JAX caches the call's program, and so its linearization, per function object;
    # inlined as it is traced, as jnp's are: jax 0.12's inline=True keeps the call until lowering)
    inline = _INLINE_EARLY if _INLINE_EARLY is not None else True
    return jax.jit(functools.partial(primitive.bind, **dict(params)), inline=inline)


def convert(x: Any, dtype: Any, weak_type: bool = False) -> Any:
    """``convert_element_type`` that can keep a value weakly typed (public lax cannot)."""
    return _lax_internal._convert_element_type(x, np.dtype(dtype), weak_type=weak_type)


def softmax_as_custom_jvp() -> Any:
    """Context in which ``jax.nn.softmax`` traces as its custom-JVP call (JAX's
    ``jax_softmax_custom_jvp``, off by default in 0.10-0.12); a no-op once the flag is gone."""
    flag = getattr(jax, "softmax_custom_jvp", None)
    return flag(True) if flag is not None else contextlib.nullcontext()


def trace_to_closed(fn: Any, in_avals: list[ShapedArray]) -> Any:
    """Trace ``fn`` (flat arguments; outputs flattened) at abstract values, keeping weak types,
    to a closed jaxpr.

    This is what ``jax.make_jaxpr`` does minus its jit front end (argument names, signature
    inspection, pytree handling), which costs ~0.3 ms a call: jamp traces every rewritten
    sub-jaxpr (each ``checkpoint``, ``scan`` and ``cond`` body) this way. Values ``fn`` closes
    over from an outer trace become constants, as with ``make_jaxpr``.
    """
    debug = _lu.DebugInfo("jamp", getattr(fn, "__name__", "<jamp>"), None, None)
    flat_fn = lambda *args: jax.tree.leaves(fn(*args))  # outputs may be a pytree (a vjp's)
    jaxpr, _, consts = _pe.trace_to_jaxpr_dynamic(
        _lu.wrap_init(flat_fn, debug_info=debug), list(in_avals)
    )
    return close_jaxpr(jaxpr, consts)


def is_tracer(x: Any) -> bool:
    return isinstance(x, _core.Tracer)


def traced_var(x: Any) -> Any:
    """The jaxpr variable a tracer of ``make_jaxpr``'s trace stands for, else None.

    A custom_jvp/custom_vjp rule that closes over a value of the traced function holds such a
    tracer after tracing ended; the rewriter maps it back to the variable's rewritten value.
    """
    if isinstance(x, _pe.DynamicJaxprTracer):
        var = getattr(x, "val", None)
        return var if isinstance(var, Var) else None
    return None


def eval_jaxpr_flat(jaxpr: Any, consts: Sequence[Any], *args: Any) -> list[Any]:
    """``eval_jaxpr`` with the operands as arguments (a function to ``jax.jit``)."""
    return eval_jaxpr(jaxpr, consts, args)


def value_checks() -> tuple[bool, bool]:
    """Whether ``jax.debug_nans`` and ``jax.debug_infs`` are on (where they apply now)."""
    return bool(_config.debug_nans.value), bool(_config.debug_infs.value)


def converts_to_itself(primitive: Any, args: Sequence[Any], params: dict) -> bool:
    """Whether binding ``primitive`` on ``args`` is a ``convert_element_type`` of a tracer of
    a ``jax.Array`` (an eager ``jax.grad``'s) to its own dtype and weak type, with no sharding:
    a bind JAX's ``_convert_element_type`` makes only for a concrete tracer, where the value it
    holds may be a Python or numpy number, which the convert makes an array (``jax.jvp`` of
    ``jnp.asarray`` returns arrays: JAX's ``test_jvp_asarray_returns_array``); of an array it
    changes nothing."""
    if primitive is not _lax_internal.convert_element_type_p or params.get("sharding") is not None:
        return False
    x = args[0]
    if not isinstance(x, _core.Tracer):
        return False
    aval = x.aval
    if getattr(aval, "dtype", None) != params["new_dtype"] or bool(
        getattr(aval, "weak_type", False)
    ) != bool(params["weak_type"]):
        return False  # (a real convert: decided before asking for the value it holds)
    return type(_core.to_concrete_value(x)) is _ArrayImpl


def eval_context() -> Any:
    """A context binding on JAX's eval trace (operations run now) whatever trace is current,
    none included: inside a trace's ``process_primitive`` jax 0.12 leaves none current, where
    ``jax.ensure_compile_time_eval`` (a constant-folding switch) binds on nothing."""
    return _core.eval_context()


def is_eager(trace: Any) -> bool:
    """Whether binding on ``trace`` runs operations now (JAX's eval trace)."""
    return isinstance(trace, _core.EvalTrace)


def eval_jaxpr(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    """Evaluate an open jaxpr with its consts under the current trace."""
    return list(_core.eval_jaxpr(jaxpr, list(consts), *args))


def eval_jaxpr_retyped(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    """``eval_jaxpr`` under a trace that may change the values' dtypes (a region evaluating a
    ``jnp`` function's inline jit): ``core.eval_jaxpr`` asserts under ``jax_enable_checks`` that
    every value has the type its equation was traced with, which a policy changes by design.
    Otherwise the same loop (source info, name stack and equation context per bind). Each bind
    can read the equation it comes from (``walked_equation``)."""
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, Literal) else env[v]

    env.update(zip([*jaxpr.constvars, *jaxpr.invars], [*consts, *args]))
    prior = getattr(_walking, "eqn", None)
    try:
        for eqn in jaxpr.eqns:
            name_stack = _siu.current_name_stack() + eqn.source_info.name_stack
            with (
                _siu.user_context(eqn.source_info.traceback, name_stack=name_stack),
                eqn.ctx.manager,
            ):
                _walking.eqn = eqn
                ans = eqn.primitive.bind(*map(read, eqn.invars), **bind_params(eqn))
            env.update(zip(eqn.outvars, ans if eqn.primitive.multiple_results else [ans]))
    finally:
        _walking.eqn = prior
    return [read(v) for v in jaxpr.outvars]


_walking = threading.local()  # .eqn: the equation eval_jaxpr_retyped binds now


def walked_equation(primitive: Any, n_operands: int) -> Any:
    """The equation ``eval_jaxpr_retyped`` binds now, where this bind (``primitive`` on
    ``n_operands``) is that equation's, else None; taken once, so the binds a rule makes for it
    read none. A region walking a callee's jaxpr reads the program's operand types from it."""
    eqn = getattr(_walking, "eqn", None)
    if eqn is None or eqn.primitive is not primitive or len(eqn.invars) != n_operands:
        return None
    _walking.eqn = None
    return eqn


def as_closed(jaxpr: Any) -> Any:
    """A closed jaxpr for an open one without constvars (e.g. ``checkpoint``'s ``jaxpr`` param)."""
    if _ClosedJaxpr is None or isinstance(jaxpr, _ClosedJaxpr):
        return jaxpr
    return _ClosedJaxpr(jaxpr, ())


def hoist_consts(closed: Any) -> tuple[Any, list[Any]]:
    """(open jaxpr whose leading invars are the consts, consts): for primitives taking open jaxprs."""
    jaxpr, consts = open_and_consts(closed)
    return _pe.convert_constvars_jaxpr(jaxpr), consts


def tangent_aval(aval: ShapedArray) -> ShapedArray:
    """The aval of a tangent/cotangent for a primal aval (float0 for integers)."""
    import jax.extend.core as jex_core

    return aval.update(dtype=jex_core.primal_dtype_to_tangent_dtype(aval.dtype), weak_type=False)


def cotangent_aval(aval: ShapedArray) -> ShapedArray:
    """The aval of a cotangent for a primal aval: a tangent's, with the sharding JAX gives a
    cotangent (a reduced axis becomes unreduced and back: ``jax.P(reduced=...)``)."""
    return aval.to_ct_aval().update(weak_type=False)


def scan_counts(params: dict[str, Any], n_args: int) -> tuple[int, int]:
    """(num_consts, num_carry) of a scan equation; jax >= 0.11 groups operands in ``ft_in``."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].update(list(range(n_args))).unpack()
    return len(list(consts)), len(list(carry))


def shard_map(
    fn: Any, *, mesh: Any, in_specs: Any, out_specs: Any, axis_names: Any, check_vma: bool
) -> Any:
    """The public ``jax.shard_map`` (``jax.experimental.shard_map`` before it moved)."""
    public: Any = getattr(jax, "shard_map", None)
    kwargs = {} if not axis_names else {"axis_names": set(axis_names)}
    if public is None:  # pragma: no cover - older jax
        from jax.experimental.shard_map import shard_map as public
    return public(
        fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma, **kwargs
    )


def dce_closed(closed: Any) -> tuple[Any, list[Any]]:
    """Dead-code elimination keeping every input: ``(open jaxpr over [*kept, *inputs], kept)``.

    Uses JAX's own ``dce_jaxpr`` (it knows the rules of scan, while, cond, jit and effects).
    """
    jaxpr, consts = open_and_consts(closed)
    as_inputs = _pe.convert_constvars_jaxpr(jaxpr)
    keep_inputs = [False] * len(consts) + [True] * len(jaxpr.invars)
    dced, used = _pe.dce_jaxpr(as_inputs, [True] * len(jaxpr.outvars), instantiate=keep_inputs)
    return dced, [c for c, u in zip(consts, used[: len(consts)]) if u]


# What a region's rewrite of a jnp function may leave unused: jnp's float32 promotions that its
# rules read through, and 16-bit squares a sum read recomputed in float32 (region_trace.py).
_LEFT_BY_REGIONS = frozenset({"convert_element_type", "square", "integer_pow", "mul"})


def without_dead_converts(closed: Any) -> Any:
    """``closed`` less the converts and squares whose result nothing uses (``closed`` itself
    where there are none). Written here rather than JAX's ``dce_jaxpr``, which would drop the
    program's own dead code as well: a region's rewrite of a ``jnp`` function leaves out only
    what its rules left unused, so its program keeps what ``autocast_transform``'s does."""
    jaxpr, consts = open_and_consts(closed)
    used = {v for v in jaxpr.outvars if isinstance(v, Var)}
    kept = []
    for eqn in reversed(jaxpr.eqns):
        if eqn.primitive.name in _LEFT_BY_REGIONS and not any(v in used for v in eqn.outvars):
            continue
        kept.append(eqn)
        used.update(v for v in eqn.invars if isinstance(v, Var))
    if len(kept) == len(jaxpr.eqns):
        return closed
    pruned = jaxpr.replace(eqns=kept[::-1])
    return pruned if _ClosedJaxpr is None else _ClosedJaxpr(pruned, list(consts))


def inputs_only_cast(closed: Any) -> tuple:
    """``(i, dtype)`` for each input of ``closed`` that it only converts (one equation reads it:
    a plain float-to-float convert, which is no output), in input order."""
    jaxpr = open_and_consts(closed)[0]
    inputs = {v: i for i, v in enumerate(jaxpr.invars)}
    reads: dict[int, list] = {}
    for eqn in jaxpr.eqns:
        for v in eqn.invars:
            if isinstance(v, Var) and v in inputs:
                reads.setdefault(inputs[v], []).append(eqn)
    outputs = {inputs[v] for v in jaxpr.outvars if isinstance(v, Var) and v in inputs}
    found = []
    for i, eqns in sorted(reads.items()):
        if len(eqns) != 1 or i in outputs or eqns[0].primitive is not _convert_p:
            continue
        params = eqns[0].params
        if params["sharding"] is None and not params["weak_type"]:
            found.append((i, np.dtype(params["new_dtype"])))
    return tuple(found)


def with_inputs_cast_from(closed: Any, given: dict, avals: list) -> Any:
    """``closed`` taking, for each input ``i`` in ``given`` (one it only converts:
    ``inputs_only_cast``), a value of type ``avals[i]`` that it converts to ``given[i][0]`` and
    then applies the shape ops ``given[i][1]`` (``(primitive, params)``) to, in place of its own
    convert (a parameter, for the view of it the caller had: ``interpreter.ParameterView``).
    ``avals``: the new program's input types."""
    jaxpr, consts = open_and_consts(closed)
    converted = {jaxpr.invars[i] for i in given}

    def converts_an_input(e: Any) -> bool:  # (each such input's one use: inputs_only_cast)
        return (
            e.primitive is _convert_p and isinstance(e.invars[0], Var) and e.invars[0] in converted
        )

    # those converts left out, each result an input of the program instead
    result_of = {e.invars[0]: e.outvars[0] for e in jaxpr.eqns if converts_an_input(e)}
    inner = jaxpr.replace(
        invars=[result_of.get(v, v) for v in jaxpr.invars],
        eqns=[e for e in jaxpr.eqns if not converts_an_input(e)],
    )

    def variant(*operands: Any) -> list[Any]:
        args = list(operands)
        for i, (dtype, steps) in given.items():
            value = convert(args[i], dtype)
            for primitive, params in steps:
                value = primitive.bind(value, **params)
            args[i] = value
        return eval_jaxpr(inner, consts, args)

    return trace_to_closed(variant, list(avals))


def sub_jaxprs(params: dict[str, Any]) -> Iterator[Any]:
    """Every jaxpr among an equation's parameters (also inside tuples, e.g. cond's branches)."""
    for value in params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if is_jaxpr_like(item):
                yield item


# --- primitive names and function labels (Policy validation, unmatched-rule warnings) ----------


def _primitive_tables() -> list[Any]:
    """JAX's registries keyed by Primitive: every primitive that can be lowered or differentiated
    is a key of one of them (jit's and remat's too; their names change across versions)."""
    from jax._src.interpreters import ad as _ad
    from jax._src.interpreters import mlir as _mlir

    return [
        _mlir._lowerings,
        *_mlir._platform_specific_lowerings.values(),
        _ad.primitive_jvps,
        _ad.primitive_transposes,
        _pe.partial_eval_jaxpr_custom_rules,
        _pe.custom_partial_eval_rules,
    ]


_primitive_names_cache: tuple[int, frozenset[str]] = (-1, frozenset())


def primitive_names() -> frozenset[str]:
    """Names (``str(eqn.primitive)``) of the primitives the running JAX has registered.

    Recomputed when a registry grows (a module defining primitives imported later, a user's own
    primitive registering its lowering)."""
    global _primitive_names_cache
    tables = _primitive_tables()
    size = sum(len(t) for t in tables)
    if size != _primitive_names_cache[0]:
        names = frozenset(getattr(p, "name", str(p)) for t in tables for p in list(t))
        _primitive_names_cache = (size, names)
    return _primitive_names_cache[1]


# Names JAX's primitives have in other versions than the running one (``pjit`` became ``jit``,
# ``checkpoint``/``remat`` became ``remat2``, ``custom_vjp_call_jaxpr`` became
# ``custom_vjp_call``, 0.12 folded ``call``/``closed_call`` into ``eval_jaxpr``): a rule module may
# register them beside today's names, so one module serves every supported version.
OTHER_VERSION_PRIMITIVE_NAMES: frozenset[str] = frozenset(
    {"pjit", "checkpoint", "remat", "custom_vjp_call_jaxpr", "core_call", "call", "closed_call"}
)


def jit_static_args(fn: Any) -> tuple[tuple[int, ...], tuple[str, ...]] | None:
    """``(static_argnums, static_argnames)`` of a ``jax.jit``-wrapped function (both already
    inferred from each other by ``jax.jit``), or None for anything else. ``_jit_info`` is the
    private record of jit's arguments, the same in jax 0.10 and 0.12."""
    info = getattr(fn, "_jit_info", None)
    if info is None or not hasattr(info, "static_argnums"):
        return None
    return tuple(info.static_argnums), tuple(info.static_argnames)


def function_label(closed: Any) -> str:
    """``"loss_fn at model.py:12"`` for a traced jaxpr (from its debug info), or ``""``."""
    jaxpr, _ = open_and_consts(closed)
    info = getattr(jaxpr, "debug_info", None)
    return getattr(info, "func_src_info", None) or getattr(info, "func_name", None) or ""


# --- tracing (issue 13): helpers for the tracing package -------------------------------------


def under_transformation() -> bool:
    """True while JAX is tracing (inside ``jax.jit``, ``grad``, ``vmap``, ...): the current
    trace is not the eager one. Same private ``trace_ctx`` in jax 0.10 and 0.12."""
    return not isinstance(_core.trace_ctx.trace, _core.EvalTrace)


# --- The call boundary of autocast_transform (transform.py): what jax.jit's front end does. ---
from jax._src import api_util as _api_util  # noqa: E402
from jax._src import config as _config  # noqa: E402


def debug_info(
    traced_for: str, fn: Any, args: Sequence[Any], kwargs: dict, structure: Any = None
) -> Any:
    """JAX's debug info for tracing ``fn(*args, **kwargs)``: the function's name, file and line,
    and the names (``x``, ``batch['x']``) of the leaves of ``args``/``kwargs``, so tracer errors
    read as they do under ``jax.jit``. Same in jax 0.10 and 0.12.

    ``structure``, if given, is hashable and determines the arguments' pytree structure (the
    caller's cache key: tree definition and which leaves are static). The leaves' names depend
    only on it and ``fn``'s signature, so they are made once per pair: JAX makes them with a
    ``keystr`` and a regular expression per leaf, 0.5 ms for a 200-leaf model on every trace.
    """
    args, kwargs = tuple(args), dict(kwargs)
    if structure is None or hasattr(fn, "__fun_debug_info__"):
        return _api_util.debug_info(traced_for, fn, args, kwargs)
    signature = _api_util.fun_signature(fn)
    key = (signature, structure)
    try:
        names = _ARG_NAMES.get(key)
    except (TypeError, ValueError):  # (a default value that cannot be hashed or compared)
        return _api_util.debug_info(traced_for, fn, args, kwargs, signature=signature)
    if names is None:
        names = _api_util._non_static_arg_names(signature, args, kwargs, (), ())
        if len(_ARG_NAMES) >= 512:
            _ARG_NAMES.clear()
        _ARG_NAMES[key] = names
    return _core.DebugInfo(
        traced_for, _api_util.fun_sourceinfo(fn), names, _core.initial_result_paths
    )


_ARG_NAMES: dict[Any, tuple[str, ...]] = {}  # (signature, structure): debug_info's leaf names


def debug_info_named_for(debug: Any, fn: Any) -> Any:
    """``debug`` attributed to ``fn`` (its name, file and line) instead of the traced wrapper."""
    return debug._replace(func_src_info=_api_util.fun_sourceinfo(fn))


def trace_user_function(flat_fn: Any, in_avals: Sequence[ShapedArray], debug: Any) -> Any:
    """Trace ``fn`` (flat arguments and outputs) at ``in_avals`` to a closed jaxpr, as
    ``jax.make_jaxpr`` does, with ``debug`` (from ``debug_info``) naming the user's function.

    Under ``jax_softmax_custom_jvp`` (``softmax_as_custom_jvp``) JAX's own ``_softmax`` names
    only ``x`` in its debug info but binds ``x`` and the defaulted ``initial`` (and ``where``),
    so ``jax_enable_checks``' self-check of that debug info fails on a vmapped or masked
    softmax, in plain JAX too (0.10.2, 0.12.0.1). That trace then runs with the checks off and
    its jaxpr is type-checked afterwards, which is what the checks would have verified of it.
    """
    checks = _config.enable_checks.value
    softmax_flag = getattr(_config, "softmax_custom_jvp", None)
    skip_debug_info_check = checks and softmax_flag is not None and softmax_flag.value
    with jax.enable_checks(False) if skip_debug_info_check else contextlib.nullcontext():
        jaxpr, _, consts = _pe.trace_to_jaxpr_dynamic(
            _lu.wrap_init(flat_fn, debug_info=debug), list(in_avals)
        )
    if skip_debug_info_check:
        _core.check_jaxpr(jaxpr)
    return close_jaxpr(jaxpr, consts)


def trace_context() -> Any:
    """What ``jax.jit`` keys its caches on besides the arguments: every config state that affects
    tracing (``default_matmul_precision``, ``enable_x64``, ``numpy_rank_promotion``,
    ``numpy_dtype_promotion``...) and, last, the axis environment (named axes of enclosing
    ``vmap``/``shard_map`` with their sizes). Hashable; the same function in jax 0.10 and 0.12."""
    return _config.trace_context()


def jit_disabled() -> bool:
    """Whether ``jax.disable_jit()`` is in effect (its thread-local value included)."""
    return bool(_config.disable_jit.value)


def under_staging() -> bool:
    """Whether an enclosing transformation is building a jaxpr (``jax.jit``, ``make_jaxpr``, a
    ``scan`` body...), possibly below ``grad``/``vmap`` traces; false for eager ``grad``/``vmap``."""
    stack = _core.unsafe_get_trace_stack(_core.trace_ctx.trace)
    return any(isinstance(trace, _pe.DynamicJaxprTrace) for trace in stack)


# --- Effect tokens at the call boundary (issue 11 item 12): ``lax.create_token()`` values are
# valid ``jax.jit`` arguments and outputs, but neither arrays nor floating values. ---


# numpy's variable-width string dtype, which a jax.Array may hold (jax >= 0.10 with numpy >= 2)
# but no JAX program takes: ``core.valid_jaxtype`` refuses it.
_STRING_DTYPE_TYPE = type(getattr(_dtypes, "string_dtype", None))


def is_string_dtype(dtype: Any) -> bool:
    """Whether ``dtype`` is numpy's StringDType (a type check: its instances are not singletons)."""
    return dtype is not None and type(dtype) is _STRING_DTYPE_TYPE


def is_token(x: Any) -> bool:
    """A token (``jax.lax.create_token()``) or a tracer of one (same types in jax 0.10 and 0.12)."""
    if isinstance(x, _core.Token):
        return True
    return isinstance(x, _core.Tracer) and isinstance(getattr(x, "aval", None), _core.AbstractToken)


# --- Backward-pass logs of custom_vjp (jax >= 0.12: ``defvjp_with_logs``, ``VJP.with_logs``). ---
# jamp re-creates every custom_vjp call as its own custom_vjp; where JAX has logs, that one is
# defined with logs and passes the user's on, so ``f_vjp.with_logs(ct)`` still sees them.
BACKWARD_LOGS = hasattr(jax.custom_vjp, "defvjp_with_logs")


def pullback_with_logs(vjp_fn: Any, cotangents: Any) -> tuple[Any, Any]:
    """``(input cotangents, logs)`` of a ``jax.vjp`` pullback; logs are ``{}`` without support."""
    if BACKWARD_LOGS:
        return vjp_fn.with_logs(cotangents)
    return vjp_fn(cotangents), {}


def defvjp_with_logs(custom: Any, fwd: Any, bwd: Any, *, symbolic_zeros: bool) -> None:
    """``custom.defvjp`` for a ``bwd`` returning ``(cotangents, logs or None)``."""
    if BACKWARD_LOGS:
        custom.defvjp_with_logs(fwd, bwd, symbolic_zeros=symbolic_zeros)
    else:
        custom.defvjp(fwd, lambda *a: bwd(*a)[0], symbolic_zeros=symbolic_zeros)


# --- A stable trace context from the first call (issue 11 item 12, eager-grad recompiles). ---
# Importing ``jax.extend.core`` (``tangent_aval`` uses it) defines config states on jax 0.12, which
# lengthens ``trace_context()``: imported lazily, the first call of a transformed function under
# ``grad`` would be keyed differently from the second one, which then traced and compiled again.
import jax.extend.core as _jax_extend_core  # noqa: E402,F401

# --- ``custom_vjp(optimize_remat=True)``: its fwd binds ``remat_opt`` (fwd jaxpr + a thunk
# tracing the primal function, used when DCE finds the residuals unused). Both versions. ---
from jax._src import custom_derivatives as _custom_derivatives  # noqa: E402

_remat_opt_p = getattr(_custom_derivatives, "remat_opt_p", None)
OPTIMIZED_REMAT_PRIMITIVES: tuple[str, ...] = (
    (_remat_opt_p.name,) if _remat_opt_p is not None else ()
)


def _imported_call_primitives(*defined_in: tuple[str, str]) -> tuple[str, ...]:
    """Call primitives defined in modules ``import jax`` does not load (``xla_metadata_call``,
    ``compute_on``, ``fused_call``): their public modules imported (~1 ms each) so their names
    can key rules; a JAX without one leaves its name out."""
    found = []
    for module, name in defined_in:
        try:
            importlib.import_module(module)
        except ImportError:  # pragma: no cover - both versions have them today
            continue
        found.append(name)
    return tuple(found)


# Calls that tell XLA how to run their body (scheduling metadata, the core or host it runs on).
ANNOTATED_CALL_PRIMITIVES: tuple[str, ...] = _imported_call_primitives(
    ("jax.experimental.scheduling_groups", "xla_metadata_call"),
    ("jax.experimental.compute_on", "compute_on"),
)
# ``jax.experimental.fused``: a body XLA must fuse, traced at inputs in any memory space.
FUSED_CALL_PRIMITIVES: tuple[str, ...] = _imported_call_primitives(
    ("jax.experimental.fused", "fused_call")
)


# --- Which trace a tracer belongs to (custom rules closing over the user's traced values). ---


def current_trace() -> Any:
    """The trace JAX is running now (while tracing the user's function: that jaxpr's trace)."""
    return _core.trace_ctx.trace


def trace_of(x: Any) -> Any:
    """The trace ``x`` is a tracer of, else None."""
    return getattr(x, "_trace", None) if isinstance(x, _core.Tracer) else None


# --- custom derivatives: symbolic zeros as JAX hands them, mutable array references. ---


def zero_cotangent(aval: Any) -> Any:
    """A symbolic zero cotangent of type ``aval``, as a ``jax.vjp`` pullback accepts it (both
    versions skip ``ad.Zero`` leaves)."""
    from jax._src.interpreters import ad

    return ad.Zero(aval)


def is_ref(value: Any) -> bool:
    """Whether ``value`` (an array or a tracer) is a mutable array reference (``jax.new_ref``)."""
    from jax._src.state.types import AbstractRef

    return isinstance(jax.typeof(value), AbstractRef)


def jvp_keeping_zeros(
    fun: Callable[..., Sequence[Any]], primals: Sequence[Any], tangents: Sequence[Any]
) -> tuple[list[Any], list[Any | None]]:
    """``jax.jvp`` of ``fun`` (flat lists in, a flat list out) with the output tangents JAX
    knows to be symbolic zeros given as None: ``jax.jvp`` instantiates them as arrays, and a
    ``custom_jvp`` rule with ``symbolic_zeros=True`` must be handed them as JAX hands them
    (``ad.jvp(..., instantiate=False)``, on ``FlatTree``s in both versions)."""
    from jax._src import tree_util
    from jax._src.interpreters import ad

    flatten: Callable[[Any], Any]
    try:  # jax >= 0.11 (by name: mypy checks against 0.10, which has no such module)
        flatten = importlib.import_module("jax._src.flattree").flatten
    except ModuleNotFoundError:  # jax 0.10
        flatten = tree_util.FlatTree.flatten

    outs, out_tangents = ad.jvp(
        lambda *xs: list(fun(*xs)),
        flatten(list(primals)),
        flatten(list(tangents)),
        instantiate=False,
    )
    return list(outs), [None if isinstance(t, ad.Zero) else t for t in out_tangents]


# --- The region trace (regions.py, region_trace.py): a JAX ``Trace`` that jamp pushes for a
# ``with jamp.autocast():`` block, the pattern of JAX's own ``JVPTrace`` and of quax. The trace
# protocol (``process_primitive``, ``process_custom_jvp_call``/``_vjp_call``, ``bind_with_trace``
# with ``subfuns`` in the params, the current trace in ``trace_ctx``) is the same in 0.10 and 0.12.

Trace = _core.Trace
set_current_trace = _core.set_current_trace


def bind_on(
    trace: Any,
    primitive: Any,
    args: Sequence[Any],
    params: dict[str, Any],
    avals: Sequence[Any] | None = None,
    evaluated: list | None = None,
) -> Any:
    """Bind ``primitive`` on ``trace`` (a region's parent) from a trace's ``process_primitive``:
    what ``primitive.bind`` under ``set_current_trace(trace)`` does, for operands that ``bind``
    has canonicalized already (``avals``: their types), without entering the trace context and
    canonicalizing again (``Primitive.bind`` then calls ``bind_with_trace``, as here), and
    into a program being built staged directly where it can be (``_stage_now``). A primitive
    with a ``bind`` of its own is bound through it. ``evaluated``: where the abstract
    evaluation of this operation at these types is kept (``_add_equation``)."""
    if evaluated and type(trace) is _pe.DynamicJaxprTrace:
        staged = _stage_again(trace, primitive, args, params, evaluated)
        if staged is not None:
            return staged if primitive.multiple_results else staged[0]
    if type(trace) is _pe.DynamicJaxprTrace and primitive is _convert_p:
        # (a convert has a bind of its own, which adds nothing to one staged as a cast is)
        if params["sharding"] is None and not params["weak_type"]:
            staged = _cast_staged(trace, args[0], np.dtype(params["new_dtype"]))
            if staged is not None:
                return staged
    if type(primitive).bind is not _PLAIN_BIND:
        with _core.set_current_trace(trace):
            return primitive.bind(*args, **params)
    if avals is None:
        avals = [_core.typeof(a) for a in args]
    if type(trace) is _pe.DynamicJaxprTrace:
        if primitive is _jit_p:
            staged = _inline_now(trace, args, params, params["jaxpr"])
        else:
            staged = _stage_now(trace, primitive, args, avals, params, evaluated=evaluated)
        if staged is not None:
            return staged if primitive.multiple_results else staged[0]
    return primitive.bind_with_trace(trace, args, avals, params)


def jit_sets_call(params: dict) -> bool:
    """Whether a jit equation's ``params`` set what its call does beyond running its program
    (a user's ``jax.jit``): a donated operand, shardings (memory kinds included), layouts,
    ``keep_unused`` or compiler options. jnp's functions set none: a few counts in C for them
    (a region asks at every eager call of one; a sharding left unspecified other than by JAX's
    one ``UNSPECIFIED`` answers yes, which only costs that call JAX's Python dispatch)."""
    ins, outs = params["in_shardings"], params["out_shardings"]
    return (
        True in params["donated_invars"]
        or ins.count(_UNSPECIFIED) != len(ins)
        or outs.count(_UNSPECIFIED) != len(outs)
        or params["in_layouts"].count(None) != len(ins)
        or params["out_layouts"].count(None) != len(outs)
        or bool(params["keep_unused"])
        or bool(params["compiler_options_kvs"])
    )


def eager_call_settings(closed: Any) -> tuple[tuple[int, ...], list[Any] | None]:
    """What calling ``closed``'s function eagerly does that one ``jax.jit`` around its whole
    program would not (JAX keeps a nested jit's donation and output memory kinds only at the top
    level): ``(donate_argnums, out_shardings)`` for that outer jit. An input is donated where a
    top-level jit call donates it and nothing else reads it (nor returns it); ``out_shardings``
    (``None`` where none is set) gives each output that a top-level jit call returns the sharding
    that call gives it, or is ``None`` where no output has one."""
    jaxpr = closed.jaxpr
    reads: dict[Any, int] = {}
    donated_by_jit: set[Any] = set()
    made_by_jit: dict[Any, Any] = {}
    for eqn in jaxpr.eqns:
        is_jit = eqn.primitive is _jit_p
        donated = eqn.params.get("donated_invars", ()) if is_jit else ()
        for i, var in enumerate(eqn.invars):
            if isinstance(var, _core.Var):
                reads[var] = reads.get(var, 0) + 1
                if i < len(donated) and donated[i]:
                    donated_by_jit.add(var)
        if is_jit:
            for var, sharding in zip(eqn.outvars, eqn.params["out_shardings"]):
                if not isinstance(sharding, _UnspecifiedValue):
                    made_by_jit[var] = sharding
    returned = {v for v in jaxpr.outvars if isinstance(v, _core.Var)}
    donate = tuple(
        i
        for i, var in enumerate(jaxpr.invars)
        if var in donated_by_jit and reads[var] == 1 and var not in returned
    )
    outs = [made_by_jit.get(v) if isinstance(v, _core.Var) else None for v in jaxpr.outvars]
    return donate, (outs if any(s is not None for s in outs) else None)


def _all_unspecified(shardings: tuple) -> bool:
    return all(isinstance(s, _UnspecifiedValue) for s in shardings)


def bind_call_on(
    trace: Any, args: Sequence[Any], params: dict, closed: Any, avals: Sequence[Any]
) -> list[Any]:
    """``bind_on`` of a jit call with ``params`` but the program ``closed`` (a region's rewrite
    of the callee): inlined into a program being built where JAX would inline it."""
    if type(trace) is _pe.DynamicJaxprTrace:
        staged = _inline_now(trace, args, params, closed)
        if staged is not None:
            return staged
    return bind_on(trace, _jit_p, args, {**params, "jaxpr": closed}, avals)


def _inline_now(trace: Any, args: Sequence[Any], params: dict, closed: Any) -> list[Any] | None:
    """A jit call with ``params`` and the program ``closed`` bound now (a region's rewrite of a
    jnp function) inlined into ``trace`` as JAX's ``process_primitive`` and the jit's staging
    rule inline it (constant operands made constants of the program,
    ``pe.inline_jaxpr_into_trace`` under the current source info), without the bind's
    dispatch; None where only a bind can (the rule would not inline, no operand is a tracer of
    ``trace`` (JAX may fold it), one is a tracer of another trace)."""
    own = constants = False
    for a in args:
        if type(a) is _pe.DynamicJaxprTracer and a._trace is trace:
            own = True
        elif isinstance(a, _core.Tracer):
            return None
        else:
            constants = True
    if not own:
        return None
    # Whether JAX's staging rule of a jit (``pjit_staging_rule``, jax 0.10 and 0.12) inlines
    # the call: inline (0.12: early, by JAX), no shardings, layouts or compiler options.
    inline = params["inline"]
    in_shardings, out_shardings = params["in_shardings"], params["out_shardings"]
    if not (
        (inline is _INLINE_EARLY if _INLINE_EARLY is not None else bool(inline))
        and not params["compiler_options_kvs"]
        # (JAX's one UNSPECIFIED counted in C first)
        and (
            in_shardings.count(_UNSPECIFIED) == len(in_shardings) or _all_unspecified(in_shardings)
        )
        and (
            out_shardings.count(_UNSPECIFIED) == len(out_shardings)
            or _all_unspecified(out_shardings)
        )
        and params["in_layouts"].count(None) == len(params["in_layouts"])
        and params["out_layouts"].count(None) == len(params["out_layouts"])
    ):
        return None
    # (what process_primitive asks the jit, ``jit_p.is_high``, on 0.10 and 0.12 alike)
    trace.frame.is_high |= closed.jaxpr.is_high
    source_info = _siu.current()
    # (the list comprehensions only where a value needs them: a region inlines every jnp call)
    tracers = (
        [
            a if type(a) is _pe.DynamicJaxprTracer else trace.to_jaxpr_tracer(a, source_info)
            for a in args
        ]
        if constants
        else args
    )
    outs = _pe.inline_jaxpr_into_trace(trace, source_info, closed.jaxpr, closed.consts, *tracers)
    for x in outs:
        if type(x) is not _pe.DynamicJaxprTracer or x._trace is not trace:
            return [
                x
                if type(x) is _pe.DynamicJaxprTracer and x._trace is trace
                else trace.to_jaxpr_tracer(x, source_info)
                for x in outs
            ]
    return outs


def _stage_again(
    trace: Any, primitive: Any, args: Sequence[Any], params: dict, evaluated: list
) -> list[Any] | None:
    """``_stage_now`` of an operation staged before at the same types and parameters (a
    region's replayed decision, whose ``evaluated`` holds the abstract evaluation made then,
    which only ``_stage_now`` makes): what it checked of the primitive and its parameters held
    then; only the operands are checked again (tracers of ``trace``, or a bind stages them)."""
    for a in args:  # (a loop, not any() of a generator: a region asks for every operation)
        if type(a) is not _pe.DynamicJaxprTracer or a._trace is not trace:
            return None
    return _add_equation(
        trace, list(args), primitive, params, _siu.current(), None, evaluated=evaluated
    )


def _stage_now(
    trace: Any,
    primitive: Any,
    args: Sequence[Any],
    avals: Sequence[Any],
    params: dict,
    condition: Callable[[dict, list], bool] | None = None,
    evaluated: list | None = None,
) -> list[Any] | None:
    """An operation bound now (a region's) staged into ``trace`` as ``stage_like`` stages a
    rewritten equation, under the current source info and context; None where only a bind can.
    ``condition``: when ``primitive`` may be staged (default: ``_staging_condition``);
    ``evaluated``: as in ``_add_equation``."""
    condition = condition or _staging_condition(primitive)
    if condition is None or not args:  # (no operand: bind may fold it, eager_constant_folding)
        return None
    # (a loop, not any() of a generator: a region asks for every operation)
    for a in args:
        if type(a) is not _pe.DynamicJaxprTracer or a._trace is not trace:
            return None
    if _has_jaxpr_param(params) or not condition(params, list(avals)):
        return None
    return _add_equation(
        trace, list(args), primitive, params, _siu.current(), None, evaluated=evaluated
    )


_PLAIN_BIND = _core.Primitive.bind
_convert_p = _lax_internal.convert_element_type_p
_jit_p = _pjit.jit_p
# jax 0.12's ``Inline.JAX_EARLY`` (the calls its staging rule inlines); None before (a bool).
_INLINE_EARLY = getattr(getattr(_api, "Inline", None), "JAX_EARLY", None)
_UnspecifiedValue = _sharding_impls.UnspecifiedValue
_UNSPECIFIED = _sharding_impls.UNSPECIFIED


# --- A differentiation started inside a region (``jax.grad`` called in ``with jamp.autocast():``)
# JAX's ``jvp``/``linearize`` push their trace above the current one (the region), so the
# user's operations meet JAX's derivative rules before the region could decide their dtypes.
# While a region is pushed, the methods by which ``ad``'s two differentiation traces take an
# operation first hand the user's operations to a region above them (``above(trace)``, the region
# trace's choice): the policy decides, then JAX differentiates what it decided, as under
# ``jax.grad`` of a function with a region inside. The methods are JAX's own again when the last
# region in any thread exits (JAX's classes themselves stay: other code may patch them too), and
# in a thread without a region they do what JAX's do. JAX's backward pass is marked the same
# while a region is pushed, so a region lets a pullback's operations through as their forward
# decided them, also a custom_vjp bwd (user code) of a pullback made outside the region.

_DIFFERENTIATION_TRACES = ("JVPTrace", "LinearizeTrace")
# The replaced methods and the positional parameters the replacement relies on (it passes the
# primitive on to the region's method of the same name, which takes what follows it).
_ROUTED_SIGNATURES: dict[str, tuple[str, ...]] = {
    "process_primitive": ("self", "primitive", "tracers", "params"),
    "process_custom_jvp_call": ("self", "primitive", "fun", "jvp", "tracers"),
    "process_custom_vjp_call": ("self", "primitive", "fun", "fwd", "bwd", "tracers"),
}
_ROUTED_METHODS = tuple(_ROUTED_SIGNATURES)
_BACKWARD_PASS = "backward_pass3"
_BACKWARD_PASS_SIGNATURE = ("jaxpr", "transform_stack", "consts", "primals_in", "cotangents_in")


class JaxCompatibilityError(RuntimeError):
    """The installed JAX lacks (or changed) a private attribute that a jamp feature replaces."""


def _positional(fn: Any) -> tuple[str, ...] | None:
    import inspect

    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in parameters if p.kind in kinds)


def _calls_backward_pass(module: Any) -> bool:
    """Whether a function of ``module`` looks ``ad.backward_pass3`` up when it runs (the name
    the marking replaces; ``jax.vjp``'s pullback does, in ``jax._src.api``)."""
    return any(
        isinstance(f, types.FunctionType) and _BACKWARD_PASS in f.__code__.co_names
        for f in vars(module).values()
    )


def routing_problems() -> list[str]:
    """What the installed JAX lacks of what ``differentiation_routed_above`` replaces: each
    problem names the attribute and what was expected (empty: all there, as in 0.10-0.12)."""
    from jax._src import api
    from jax._src.interpreters import ad

    where = "jax._src.interpreters.ad"
    problems = []
    for name in _DIFFERENTIATION_TRACES:
        cls = getattr(ad, name, None)
        if not isinstance(cls, type):
            problems.append(f"{where}.{name} (a class) is missing")
            continue
        for method, expected in _ROUTED_SIGNATURES.items():
            fn = cls.__dict__.get(method)
            if fn is None:
                problems.append(f"{where}.{name}.{method} is missing (not defined on the class)")
            elif _positional(fn) != expected:
                problems.append(
                    f"{where}.{name}.{method} takes ({', '.join(_positional(fn) or ('?',))}), "
                    f"expected ({', '.join(expected)})"
                )
    backward = getattr(ad, _BACKWARD_PASS, None)
    if not callable(backward):
        problems.append(f"{where}.{_BACKWARD_PASS} is missing")
    elif _positional(backward) != _BACKWARD_PASS_SIGNATURE:
        problems.append(
            f"{where}.{_BACKWARD_PASS} takes ({', '.join(_positional(backward) or ('?',))}), "
            f"expected ({', '.join(_BACKWARD_PASS_SIGNATURE)})"
        )
    elif not _calls_backward_pass(api):
        problems.append(
            f"jax._src.api no longer calls {where}.{_BACKWARD_PASS} (jax.vjp's pullback)"
        )
    return problems


_routing_checked: tuple | None = None  # the attributes that passed the last check


def check_differentiation_routing() -> None:
    """Raise :class:`JaxCompatibilityError` naming the JAX version and every missing or changed
    attribute if the installed JAX cannot be routed; a no-op after a check of the same
    attributes passed (regions call it on entry)."""
    global _routing_checked
    from jax._src.interpreters import ad

    current = (
        *(
            getattr(getattr(ad, name, None), "__dict__", {}).get(method)
            for name in _DIFFERENTIATION_TRACES
            for method in _ROUTED_METHODS
        ),
        getattr(ad, _BACKWARD_PASS, None),
    )
    if current == _routing_checked:
        return
    problems = routing_problems()
    if problems:
        raise JaxCompatibilityError(
            f"jamp.autocast regions cannot run on jax {jax.__version__}: while a region is open, "
            "jamp routes jax.grad/vjp/jvp/linearize called inside it through JAX's private "
            "differentiation traces, and this JAX differs from the versions jamp supports "
            "(0.10-0.12): " + "; ".join(problems) + ". jamp.autocast_transform(fn) does not "
            "need them; or install a supported JAX (docs/development.md, 'Replaced JAX "
            "methods')."
        )
    _routing_checked = current


_routing_lock = threading.Lock()
_routing_users = 0
_originals: dict[tuple[Any, str], Any] = {}  # (owner, name) -> JAX's own attribute


class _RoutingDepths(threading.local):
    """This thread's depths: ``plain``, differentiating what was decided; ``backward``, backward
    passes. Zero as class attributes: a thread-local's missing attribute is an AttributeError
    raised and caught, for every operation a region binds (decided_above)."""

    plain = 0
    backward = 0


_routing = _RoutingDepths()
# (read by a region's per-operation path directly, as decided_above reads it, without its call)
ROUTING = _routing


def _depth(name: str) -> int:
    return getattr(_routing, name)


@contextlib.contextmanager
def _deeper(name: str) -> Iterator[None]:
    setattr(_routing, name, _depth(name) + 1)
    try:
        yield
    finally:
        setattr(_routing, name, _depth(name) - 1)


def _routed(plain: Callable[..., Any], above: Callable[[Any], Any]) -> Callable[..., Any]:
    """``plain`` (a JAX method) handing operations to ``above`` first; made once per pair (an
    eager loop enters a region, and routes again, every step)."""
    key = (plain, above)
    routed = _routed_made.get(key)
    if routed is None:
        routed = _routed_made[key] = _make_routed(plain, above)
    return routed


_routed_made: dict[tuple[Any, Any], Callable[..., Any]] = {}


def _make_routed(plain: Callable[..., Any], above: Callable[[Any], Any]) -> Callable[..., Any]:
    def process(self: Any, primitive: Any, *rest: Any, **params: Any) -> Any:
        # What the region above binds on this trace, and what JAX binds while it differentiates
        # that (on a differentiation trace below: a nested grad's), is differentiated as it is.
        # (every operation JAX differentiates while a region is open comes here: _depth and
        # _deeper("plain") inlined, a context manager's four Python calls an operation)
        routing = _routing
        binding = self.__dict__.get("_jamp_region_binding", False)
        upper = None if binding or routing.plain else above(self)
        if upper is None:
            routing.plain += 1
            try:
                return plain(self, primitive, *rest, **params)
            finally:
                routing.plain -= 1
        self._jamp_region_binding = True
        try:
            return getattr(upper, plain.__name__)(primitive, *rest, **params)
        finally:
            self._jamp_region_binding = False

    return functools.wraps(plain)(process)


def decided_above(plain_at_entry: int, backward_at_entry: int) -> bool:
    """Whether an operation bound now on a region was decided before it got there: bound while
    JAX differentiates what a region above decided, or by a backward pass (of operations decided
    when their forward ran), begun after the region (entered at these depths) was."""
    routing = _routing  # (asked for every operation: _depth inlined)
    return routing.plain > plain_at_entry or routing.backward > backward_at_entry


def routing_depths() -> tuple[int, int]:
    """This thread's depths of routed differentiation and backward passes, for decided_above."""
    return _depth("plain"), _depth("backward")


@functools.cache  # (once per JAX function: a region marks it again at every entry)
def _marked(backward_pass: Callable[..., Any]) -> Callable[..., Any]:
    def marked(*args: Any, **kwargs: Any) -> Any:
        with _deeper("backward"):
            return backward_pass(*args, **kwargs)

    return functools.wraps(backward_pass)(marked)


@contextlib.contextmanager
def differentiation_routed_above(above: Callable[[Any], Any]) -> Iterator[None]:
    """While active, JAX's differentiation traces hand the user's operations to ``above(trace)``
    (a trace whose parent is that trace, or None for JAX's own processing) first, and what they
    and JAX's backward passes bind is counted (``decided_above``)."""
    global _routing_users
    from jax._src.interpreters import ad

    with _routing_lock:
        if _routing_users == 0:  # (what is there now is JAX's, or another library's: keep it)
            check_differentiation_routing()  # before anything is replaced: fail loudly
            _originals.clear()
            for cls in (getattr(ad, name) for name in _DIFFERENTIATION_TRACES):
                for method in _ROUTED_METHODS:
                    plain = _originals[cls, method] = cls.__dict__[method]
                    setattr(cls, method, _routed(plain, above))
            plain = _originals[ad, _BACKWARD_PASS] = getattr(ad, _BACKWARD_PASS)
            setattr(ad, _BACKWARD_PASS, _marked(plain))
        _routing_users += 1
    try:
        yield
    finally:
        with _routing_lock:
            _routing_users -= 1
            if _routing_users == 0:
                for (owner, name), original in _originals.items():
                    setattr(owner, name, original)


def trace_parent(trace: Any) -> Any:
    """The trace that ``trace``, one of JAX's transforming traces (differentiation, ``vmap``,
    partial evaluation), binds its results on; None for any other trace (a jit's staging trace
    also names the trace it was started from ``parent_trace``, but binds nothing there)."""
    from jax._src.interpreters import ad, batching

    if isinstance(trace, (ad.JVPTrace, ad.LinearizeTrace, batching.BatchTrace, _pe.JaxprTrace)):
        return getattr(trace, "parent_trace", None)
    return None


def wrap_traced_fun(fun: Any, around: Callable[[], Any]) -> Any:
    """The function a ``process_shard_map`` receives (a plain callable on jax 0.10, a
    ``lu.WrappedFun`` elsewhere), calling ``fun`` inside the context manager ``around()``."""
    wrapped = isinstance(fun, _lu.WrappedFun)
    target = fun.call_wrapped if wrapped else fun

    def call(*args: Any, **kwargs: Any) -> Any:
        with around():
            return target(*args, **kwargs)

    return _lu.wrap_init(call, debug_info=fun.debug_info) if wrapped else call


def is_loop_carry_type_error(error: BaseException) -> bool:
    """Whether ``error`` is JAX's refusal of a loop whose body returns a carry of another type
    than it received (``lax.scan``/``while_loop``/``fori_loop``; the wording is JAX's), or
    Equinox's (``eqx.internal.while_loop``, which diffrax and optimistix loop with)."""
    text = str(error)
    if isinstance(error, ValueError):
        return "`body_fun` must have the same input and output structure" in text
    return isinstance(error, TypeError) and (
        "carry input and carry output must have" in text or "must have identical types" in text
    )


def is_branch_type_error(error: BaseException) -> bool:
    """Whether ``error`` is JAX's refusal of a ``lax.cond``/``switch`` whose branches return
    different types (the wording is JAX's, the same in 0.10 and 0.12)."""
    return isinstance(error, TypeError) and "branches must have equal output types" in str(error)


def is_same_dtypes_error(error: BaseException) -> bool:
    """Whether ``error`` is lax's refusal of operands of different dtypes where an operation
    requires one (``lax.add``, ``lax.conv_general_dilated``...; the wording is JAX's)."""
    return isinstance(error, TypeError) and "requires arguments to have the same dtypes" in str(
        error
    )


def is_float32_only_refusal(error: BaseException) -> bool:
    """Whether ``error`` is JAX's refusal of a 16-bit input by a function that takes float32:
    ``jnp.fft.rfft``'s check in Python, and on jax 0.12 the dtype check of ``svd``, ``qr`` and
    ``eigh`` as JAX traces ``jnp.linalg``'s functions, and ``jax.scipy.linalg.expm``'s (the
    wording is JAX's)."""
    text = str(error)
    return (
        (isinstance(error, ValueError) and "input must be float32 or float64" in text)
        or (isinstance(error, TypeError) and "does not accept dtype" in text)
        or (isinstance(error, TypeError) and bool(_DTYPE_NOT_SUPPORTED.search(text)))
    )


_DTYPE_NOT_SUPPORTED = re.compile(r"dtype=(bfloat16|float16) is not supported")


def is_traced_static_argument_error(error: BaseException) -> bool:
    """Whether ``error`` is ``jax.jit``'s refusal of a static argument it was given a tracer for
    (a jitted function with ``static_argnums`` traced at abstract inputs; JAX's wording)."""
    text = str(error)
    return isinstance(error, ValueError) and all(
        words in text for words in ("Non-hashable static arguments", "Tracer")
    )


def share_trace_identity(trace: Any, parent: Any) -> None:
    """Make ``trace`` answer to ``parent``'s identity where JAX and libraries ask which trace is
    current: ``get_opaque_trace_state`` (Flax NNX's check that a Variable is updated at the trace
    level it was made at) and the ``trace_state`` part of the jit cache key both read the trace's
    ``_weakref``. (The jit key still tells a region apart: see region_trace.REGION_KEY.)"""
    trace._weakref = parent._weakref


def lower_high_primitives_as(trace: Any, parent: Any) -> None:
    """Make ``trace`` take JAX's "high" primitives (``custom_vjp`` under ``jax_custom_vjp3``,
    ``hijax`` types) as ``parent`` takes them: a base ``Trace`` asks ``bind`` to expand them to
    their low-level body first (``requires_low``), which would drop a ``custom_vjp``'s rule
    under a jit, ``grad`` or ``vmap`` (whose traces take them whole); eagerly both expand."""
    trace.requires_low = getattr(parent, "requires_low", True)


_NO_NAMES = _siu.NameStack()
_JNP_REDUCTIONS = os.path.join("jax", "_src", "numpy", "reductions.py")
_JNP_CONTRACTIONS = os.path.join("jax", "_src", "numpy", "tensor_contractions.py")


# JAX's thread-local source-info context: its ``context`` is the source info operations are
# traced under now (name stack included; immutable, replaced as scopes are entered and left, the
# same on jax 0.10 and 0.12). ``Rewriter.current_state``, asked at every operation of a region,
# compares it by identity: ``current_name_stack()``'s call would cost more than the comparison.
SOURCE_INFO_NOW = _siu._source_info_context


def current_scope_names() -> tuple[str, ...]:
    """Names of the ``jax.named_scope``/Flax module scopes being traced under now."""
    return scope_names_in(SOURCE_INFO_NOW.context.name_stack)


def scope_names_in(stack: Any) -> tuple[str, ...]:
    """Names of the ``jax.named_scope``/Flax module scopes in the name stack ``stack``."""
    return tuple(
        s.name
        for s in stack.stack
        if isinstance(s, _siu.Scope)
        # (the test of _is_einsum_scope's first, without its call: most names have neither)
        and not (("," in s.name or "->" in s.name) and _is_einsum_scope(s.name))
    )


def register_library_frames(module_file: str) -> None:
    """The frames of the package holding ``module_file`` are library frames, as JAX's own are: in
    the source lines JAX reports (an operation a region re-binds is reported at the user's line,
    not at the region trace) and in the tracebacks of errors raised under ``api_boundary``
    (``jax.jit``'s, or a transformed function's), which then start at the user's call."""
    path = os.path.dirname(os.path.abspath(module_file)) + os.sep
    _siu.register_exclusion(path)
    _traceback_util.register_exclusion(path)


_Function = TypeVar("_Function", bound=Callable[..., Any])


def api_boundary(fn: _Function) -> _Function:
    """``fn`` as a boundary for JAX's traceback filtering (``JAX_TRACEBACK_FILTERING``), as
    ``jax.jit``'s functions are: an error from the user's code below it shows the user's frames,
    not jamp's and JAX's. Typed as ``fn``: the public functions it wraps keep their signatures
    for type checkers and IDEs."""
    boundary = _traceback_util.api_boundary(fn)
    if hasattr(fn, "__wrapped__"):  # (the user's function, as functools.wraps set it on fn)
        boundary.__wrapped__ = fn.__wrapped__  # type: ignore[attr-defined]
    return boundary


register_library_frames(__file__)


def region_source_info() -> Any:
    """The source info of an operation bound now, with an empty name stack: re-binding it under
    ``equation_context`` must not repeat the scopes that are current anyway."""
    return _siu.current().replace(name_stack=_NO_NAMES)


# Where jax.random's samplers live (jax/_src/random/core.py on jax 0.10 and 0.12; random.py
# before): every sampler is a jit of a function defined there.
_SAMPLER_SOURCE = os.sep + os.path.join("jax", "_src", "random")


def calls_a_sampler(primitive: Any, params: dict[str, Any]) -> bool:
    """Whether a jit call's callee is one of ``jax.random``'s samplers (``normal``,
    ``truncated_normal``, ``uniform``, ``orthogonal``..., which ``jax.nn.initializers`` and
    Flax's initializers call), by the file its jaxpr was traced from."""
    if primitive.name not in ("jit", "pjit"):
        return False
    closed = params.get("jaxpr")
    info = getattr(getattr(closed, "jaxpr", closed), "debug_info", None)
    source = getattr(info, "func_src_info", None)
    return isinstance(source, str) and _SAMPLER_SOURCE in source


def abstract_outputs(primitive: Any, avals: Sequence[Any], params: dict[str, Any]) -> list[Any]:
    """The output avals ``primitive`` gives for operand avals ``avals``."""
    out, _ = primitive.abstract_eval(*avals, **params)
    return list(out) if primitive.multiple_results else [out]


def runs_custom_calls_inline(trace: Any, args: Sequence[Any]) -> bool:
    """Whether ``trace`` calls a ``custom_jvp``/``custom_vjp`` function's body itself with
    ``args`` instead of staging or differentiating the call: the eval trace (eager code), a
    lowering jaxpr trace, and a jaxpr trace under ``jax.ensure_compile_time_eval`` with no
    traced operand (``EvalTrace``/``DynamicJaxprTrace.process_custom_*_call``, the same in 0.10
    and 0.12)."""
    from jax._src import config

    if isinstance(trace, _core.EvalTrace):
        return True
    return isinstance(trace, _pe.DynamicJaxprTrace) and (
        trace.requires_low
        or (
            config.eager_constant_folding.value
            and not any(isinstance(x, _core.Tracer) for x in args)
        )
    )


def bind_custom(primitive: Any, subfuns: tuple, args: Sequence[Any], params: dict) -> Any:
    """Bind a ``custom_jvp_call``/``custom_vjp_call`` (given its functions) on the current trace."""
    avals = [aval_of(a) for a in args]
    return primitive.bind_with_trace(
        _core.trace_ctx.trace, list(args), avals, {**params, "subfuns": subfuns}
    )


def custom_call_key(
    primitive: Any, subfuns: tuple, avals: Sequence[Any], params: dict[str, Any]
) -> tuple | None:
    """What a ``custom_jvp_call``'s staged equation depends on: the primal function (a
    ``WrappedFun``: compared by function, transformations and their arguments), the rule's own
    function, the operand types and the parameters; None for other calls (a ``custom_vjp``'s
    ``out_trees`` is a new function at every call)."""
    if primitive.name != "custom_jvp_call" or len(subfuns) != 2:
        return None
    fun, jvp = subfuns
    return (primitive, fun, jvp.f, tuple(avals), tuple(params.items()))


def filled_stores(fun: Any) -> list[tuple[int, Any]]:
    """What tracing ``fun`` (a ``WrappedFun``) filled its output stores with: (index, value)."""
    return [(i, st.val) for i, st in enumerate(fun.stores) if _filled(st)]


def fill_stores(fun: Any, values: list[tuple[int, Any]]) -> None:
    """Fill ``fun``'s output stores as tracing an equal function for the same operand types
    did (``filled_stores``), as JAX's own trace caches do (``lu.cache``)."""
    for i, value in values:
        fun.stores[i].store(value)


def empty_stores(fun: Any) -> None:
    """Empty ``fun``'s filled output stores (a trace of it that failed after it returned), so
    that it can be called again."""
    for st in fun.stores:
        if _filled(st):
            st.reset()


@contextlib.contextmanager
def staged_once(subfuns: Sequence[Any]) -> Iterator[None]:
    """For a custom-derivative call a region stages to its equation: JAX reads each function's
    output-structure store once after the bind (``lu.merge_linear_aux``), expecting exactly one
    of ``fun``'s and ``jvp``'s filled. Staging fills ``fun``'s; a JVP of the rewritten call fills
    the rule's. Emptied after staging, ``fun``'s values are put back if nothing else filled one."""
    saved = [[(st, st.val) for st in f.stores if _filled(st)] for f in subfuns[:1]]
    for pairs in saved:
        for st, _ in pairs:
            st.reset()
    try:
        yield
    finally:
        if not any(_filled(st) for f in subfuns for st in f.stores):
            for pairs in saved:
                for st, val in pairs:
                    st.store(val)


def _filled(store: Any) -> bool:
    inner = getattr(store, "_store", store)  # an EqualStore wraps a Store
    return store is not None and inner._val is not _lu._EMPTY_STORE_VALUE


def traced_in_jnp_reduction(eqn: Any) -> bool:
    """Whether ``eqn`` was traced inside ``jnp``'s reductions module (``sum``, ``mean``,
    ``var``...), which converts a 16-bit input up, reduces, and converts the result back."""
    return bool(_frame_flags(eqn.source_info) & _IN_REDUCTIONS)


def traced_in_jnp_contraction(eqn: Any) -> bool:
    """Whether ``eqn`` was traced inside ``jnp``'s contractions module (``dot``, ``matmul``,
    ``tensordot``...), which ends by converting the product to the dtype its operands give it
    (nothing to convert in the program as traced, whose product already has that dtype)."""
    return bool(_frame_flags(eqn.source_info) & _IN_CONTRACTIONS)


# Where a convert is a cast the code asked for (torch's ``.float()``), told from a library's
# promotion of a value to what an operation's other operands or computation need: frames in
# a cast's entry points (module path's tail, function names), and none in promoting code
# (module path's tail, function name prefix, "" for every function). A ``jnp`` function that
# is an inline jit leaves, in the equations it inlines, the frames of its call site: the
# ufunc's or the function's own, never a cast's entry point.
_ASKED_CASTS = (
    (os.path.join("jax", "_src", "numpy", "lax_numpy.py"), frozenset({"astype"})),
    (os.path.join("jax", "_src", "numpy", "array_methods.py"), frozenset({"_astype"})),
    (
        os.path.join("jax", "_src", "numpy", "array_constructors.py"),
        frozenset({"asarray", "array"}),
    ),
    (os.path.join("jax", "_src", "lax", "lax.py"), frozenset({"convert_element_type"})),
)
_PROMOTING_CODE = (
    (os.path.join("jax", "_src", "numpy", "util.py"), ""),  # promote_dtypes, _where...
    (os.path.join("jax", "_src", "numpy", "ufuncs.py"), ""),
    (os.path.join("jax", "_src", "numpy", "ufunc_api.py"), ""),
    (_JNP_REDUCTIONS, ""),  # a reduction's float32 accumulation
    (_JNP_CONTRACTIONS, ""),
    (os.path.join("flax", "linen", "dtypes.py"), "promote_dtype"),  # Flax's layers
    (os.path.join("flax", "nnx", "nn", "dtypes.py"), "promote_dtype"),
    # Flax's normalizations widen a 16-bit input for their statistics, then read it again
    # through jnp's promotions (x - mean): one promotion, so its cotangents add up in float32
    (os.path.join("flax", "linen", "normalization.py"), "_compute_stats"),
    (os.path.join("flax", "nnx", "nn", "normalization.py"), "_compute_stats"),
)


def traced_as_an_asked_cast(eqn: Any) -> bool:
    """Whether ``eqn`` (a convert) is a cast the code asked for (``x.astype(...)``,
    ``jnp.asarray(x, dtype)``, ``lax.convert_element_type``) rather than a library's type
    promotion (jnp's binary operations, reductions and contractions; Flax's ``promote_dtype``)."""
    return _asked_cast(eqn.source_info)


def current_an_asked_cast() -> bool:
    """``traced_as_an_asked_cast`` of what an operation bound now is traced at."""
    return _asked_cast(_siu.current())


class ConvertOrigin(NamedTuple):
    """Where a convert bound now is traced: inside ``jnp``'s reductions, inside its
    contractions, and whether it is a cast the code asked for (one walk of the traceback)."""

    in_jnp_reduction: bool
    in_jnp_contraction: bool
    asked_cast: bool


def current_convert_origin() -> ConvertOrigin:
    """``traced_in_jnp_reduction``, ``traced_in_jnp_contraction`` and
    ``traced_as_an_asked_cast`` of what an operation bound now is traced at."""
    flags = _frame_flags(_siu.current())
    return ConvertOrigin(
        bool(flags & _IN_REDUCTIONS),
        bool(flags & _IN_CONTRACTIONS),
        flags & (_ASKING | _PROMOTING) == _ASKING,
    )


def _asked_cast(source_info: Any) -> bool:
    # A cast's entry point and no promoting code anywhere in the traceback (no frames to tell
    # by: a promotion, as before they were told).
    return _frame_flags(source_info) & (_ASKING | _PROMOTING) == _ASKING


# What a frame of each source file can say of an operation traced under it (_frame_flags).
_IN_REDUCTIONS, _IN_CONTRACTIONS, _PROMOTING, _ASKING = 1, 2, 4, 8


@functools.lru_cache(maxsize=4096)  # (by file name: the same few files every time)
def _file_flags(file: str) -> tuple[int, tuple[tuple[str, int], ...], frozenset]:
    """For frames of ``file``: the flags every function there gives, the (function name prefix,
    flag) pairs some give, and the function names that are a cast's entry point."""
    flags = _IN_REDUCTIONS if file.endswith(_JNP_REDUCTIONS) else 0
    flags |= _IN_CONTRACTIONS if file.endswith(_JNP_CONTRACTIONS) else 0
    prefixes = tuple((p, _PROMOTING) for m, p in _PROMOTING_CODE if p and file.endswith(m))
    if any(not p and file.endswith(m) for m, p in _PROMOTING_CODE):
        flags |= _PROMOTING
    asking = frozenset().union(*(names for m, names in _ASKED_CASTS if file.endswith(m)))
    return flags, prefixes, asking


# The last traceback walked and what it said: one operation's bind asks several questions of
# the same traceback (a convert: a reduction's? a contraction's? a cast asked for?). One tuple,
# read and replaced whole: another thread's entry is another traceback's.
_last_walk: tuple[Any, int] = (None, 0)


def _frame_flags(source_info: Any) -> int:
    """What the frames of ``source_info``'s traceback say (``_IN_REDUCTIONS``...), or-ed."""
    global _last_walk
    traceback = source_info.traceback
    walked, flags = _last_walk
    if traceback is not None and traceback is walked:
        return flags
    codes = _frame_codes(source_info)
    known = _CODE_FLAGS
    try:  # (each frame's flags found in C: a model's tracebacks are tens of frames deep)
        flags = functools.reduce(
            operator.or_, map(operator.itemgetter(0), map(known.__getitem__, map(id, codes))), 0
        )
    except KeyError:  # a code object not met before
        if len(known) > _CODE_FLAGS_KEPT:
            known.clear()
        flags = 0
        for code in codes:
            flags |= known.setdefault(id(code), (_code_flags(code), code))[0]
    _last_walk = (traceback, flags)
    return flags


# id(code object) -> (what its frames say, the code object: kept alive, so its id is not reused)
_CODE_FLAGS: dict[int, tuple[int, Any]] = {}
_CODE_FLAGS_KEPT = 1 << 14


def _code_flags(code: Any) -> int:
    """What a frame running ``code`` says (``_frame_flags``)."""
    flags, prefixes, asking = _file_flags(code.co_filename)
    name = code.co_name
    for prefix, flag in prefixes:
        if name.startswith(prefix):
            flags |= flag
    if name in asking:
        flags |= _ASKING
    return flags


def _frame_codes(source_info: Any) -> Sequence[Any]:
    """The code objects of ``source_info``'s traceback, innermost first (none without one).
    The code objects alone: ``frames`` computes every frame's line number too (~4x the time)."""
    traceback = source_info.traceback
    return () if traceback is None else traceback.raw_frames()[0]


# A value of every symbolic dimension (``jax.export.symbolic_shape``, a polymorphic export's
# batch ``b``) large enough that a decision by size takes the branch it takes for a batch > 1.
_GENERIC_DIM = 2**16


def generic_size(size: Any) -> int:
    """``size`` (a dimension, or a product of them) as an int; a symbolic one (``10*b``) at
    every symbol's generic value, so comparisons of sizes cannot be inconclusive."""
    if not jax.export.is_symbolic_dim(size):
        return int(size)
    # int64 values: the expression's constants are int32 numpy scalars, and NumPy 2 keeps a
    # Python int times one of them in int32, which overflows from 2**31 (``b*s`` at 2**16 each
    # did: RuntimeWarning or OverflowError). A size past int64 is "huge" for any comparison.
    env: dict[str, Any] = {name: np.int64(_GENERIC_DIM) for name in size.get_vars()}
    with np.errstate(over="raise"):
        try:
            return int(size._evaluate(env))
        except (FloatingPointError, OverflowError):
            return _HUGE_SIZE


_HUGE_SIZE = 2**63 - 1


def evaluate_dim(size: Any, env: dict[str, int]) -> int | None:
    """A dimension's value with its symbols given by ``env`` (``2*b`` with b = 3: 6); None when
    a symbol is not in ``env``."""
    if not jax.export.is_symbolic_dim(size):
        return int(size)
    if not set(size.get_vars()) <= env.keys():
        return None
    return int(size._evaluate(dict[str, Any](env)))


# --- The program after XLA's SPMD partitioner (jamp.explain(compiled=True)'s collectives) -------
# The collectives of a sharded program are decided by the SPMD partitioner; backends may change
# them afterwards (the CPU backend widens bfloat16/float8 collectives to float32/float16, as it
# emulates those types), so the final HLO (``Compiled.as_text()``) does not show what the program
# asks to move. Neither JAX version exposes the partitioned module, so jamp asks XLA to dump it
# for one compile: ``xla_dump_to`` and ``xla_dump_hlo_pass_re`` are XLA debug options, which
# ``Lowered.compile(compiler_options=...)`` passes through for that compile only (the same on
# jax 0.10 and 0.12; the pass is named ``spmd-partitioning`` in both; its dump file ends in
# ``after_spmd-partitioning.before_<next pass>.txt``).
SPMD_PASS = "spmd-partitioning"


@contextlib.contextmanager
def _persistent_cache_off() -> Iterator[None]:
    """Compile without JAX's persistent compilation cache: a program found there is loaded, not
    compiled, so XLA runs no pass and dumps nothing. The dump options are left out of the cache
    key, so only turning the cache off helps. JAX decides once per process whether the cache is
    in use; ``reset_cache`` (public, ``jax.experimental.compilation_cache``) makes it decide again
    here and again after, and only forgets the open cache: its entries stay on disk."""
    from jax.experimental.compilation_cache import compilation_cache

    config: Any = jax.config  # (its options are attributes mypy does not know)
    if not (config.jax_enable_compilation_cache and config.jax_compilation_cache_dir):
        yield
        return
    compilation_cache.reset_cache()
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", True)
        compilation_cache.reset_cache()


def compile_partitioned(lowered: Any) -> tuple[Any, str | None]:
    """Compile ``lowered``; also return the HLO text right after SPMD partitioning, or None where
    the pass did not run (a program compiled for one device)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="jamp_spmd_") as folder, _persistent_cache_off():
        options = {"xla_dump_to": folder, "xla_dump_hlo_pass_re": SPMD_PASS}
        compiled = lowered.compile(compiler_options=options)
        names = sorted(n for n in os.listdir(folder) if f"after_{SPMD_PASS}" in n)
        if not names:
            return compiled, None
        with open(os.path.join(folder, names[-1])) as file:
            return compiled, file.read()
