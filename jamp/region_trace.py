"""Front end 2: a JAX trace that a ``with jamp.autocast():`` block pushes, so the ops bound inside
run under the policy wherever the block is: eagerly, or inside ``jax.jit``, ``grad``, ``vmap``,
``scan`` bodies, ``checkpoint`` and ``shard_map``.

:class:`RegionTrace` is the pattern of JAX's own ``JVPTrace`` and of quax: every primitive bound
while it is the current trace comes to :meth:`RegionTrace.process_primitive`, which hands it to
the same rules the rewriter uses (``interpreter.RULES`` and the policy's categories) as a one-
equation :class:`~jamp.interpreter.Step`, and the rule binds the result on the trace below (the
parent). Values are never boxed: the user's code sees the dtypes the policy chose, as torch's
does. Primitives that carry jaxprs (``jit``, ``scan``, ``cond``, ``while``, ``checkpoint``)
reach their rules with those jaxprs, which the rewriter rewrites; ``custom_jvp`` and
``custom_vjp`` calls are staged to their equation first and rewritten the same way (where the
trace below would run their body itself, eagerly, the body runs in the region op by op); a
``shard_map`` body is traced by the parent under a region of the same policy.

To JAX and to Flax NNX the region looks like the trace it runs in (``share_trace_identity``: NNX
refuses to update a Variable from another trace level); a jit-key context (``REGION_KEY``) still
makes a jitted function called in the region trace again under the policy.

``jax.grad`` (``vjp``, ``jvp``, ``linearize``, ``hessian``) called inside a region pushes its
differentiation trace above the region, so the user's operations would meet JAX's derivative
rules before the policy (which would mix its dtypes with theirs). While a region is pushed,
JAX's differentiation traces hand those operations to a second region of the same policy above
them first (``compat.differentiation_routed_above``, :func:`region_above`): the policy decides,
then JAX differentiates what it decided, exactly as ``jax.grad`` of a function with the region
inside. What JAX's ``ad`` module binds on a region (a derivative rule's primal and tangent ops,
a backward pass's transposes, also of a pullback made outside the region) runs as it is: it was
decided before differentiation, and torch's backward too runs in the forward's dtypes whatever
autocast says when it runs.

One thing a region cannot do is refused with an error that says what to do instead (see
docs/reference/dtypes.md, "Regions"): JAX traces a loop body with its initial carry's type before
the loop reaches the region, so a carry the region computed in 16 bits meets a body traced
without the policy.

What the rewriter learns from the whole jaxpr, the trace learns as the values go by (a
:class:`RegionEnv`): which values came from outside (parameters, a batch: a bias is one of them
broadcast), which a lower-table op produced. Two things differ because a region sees the
program one operation at a time, with ``jnp`` reacting to the dtypes the policy chose (listed in
docs/reference/dtypes.md, "Regions"):

- ``jnp`` promotes a 16-bit matmul output to float32 before adding a float32 bias or residual.
  The float32 program (what ``autocast_transform`` rewrites) has no such convert, so the region
  reads one as the program's own float32 view of the value: the ops using it see the 16-bit value
  as arriving and the float32 type as traced, and decide as the rewriter does (a bias add stays
  16-bit). The convert itself is bound and left for XLA to drop.
- ``jnp``'s reductions round their float32 result back to a 16-bit input's dtype; in a region the
  result stays float32, as the fp32 table (and torch) say.

Squares are float32 where a sum reads them (rules/powers.py). The rewriter looks ahead; a region
cannot, so it runs a square of a 16-bit value in that dtype and keeps what computed it
(:class:`LazySquare`): a sum that reads it later, through reshapes and converts, reads it
recomputed in float32 from its operand instead, as does a call that may sum it.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import re
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np

from . import _compat as compat
from .interpreter import (
    ACCUMULATED_THROUGH,
    ACCUMULATING,
    ANY_VALUE,
    CLIPPED,
    DTYPE_NAMING_REDUCTIONS,
    F32,
    HOST_VALUES,
    SCALED_FORMATS,
    WITH_FACTS,
    ConstSource,
    Decision,
    Env,
    FactValue,
    Hint,
    RecordingStep,
    Rewriter,
    Step,
    TransformDecisions,
    any_float,
    carries_programs,
    casts_through_view,
    constant_key,
    convert_may_end_a_contraction,
    convert_may_round_a_reduction,
    is_float,
    is_known_value,
    is_parameter_view,
    note_view,
    reduction_may_name_its_dtype,
    saturating_cast,
    track_derived,
    widest,
)
from .policy import Policy, RegionState, ScopeLog, user_site, warn_unmatched
from .region_stack import cast_inputs_dtype, region_depth
from .transform import SubJaxprCache

_tls = threading.local()
# A region looks like its parent trace to JAX and to Flax NNX (compat.share_trace_identity): this
# jit-cache-key context, set to the region's policy while a region is pushed, is what makes a
# jitted function called in a region trace and compile again (under the policy) rather than run
# the program it cached outside. Public API, made once at import (JAX asks for that).
REGION_KEY = jax.make_user_context(None)
# Rewritten sub-jaxprs per policy, kept across regions: an eager loop entering a region every
# step calls the same jitted function, which must not be rewritten (and compiled) every time.
_STORES: dict[Policy, weakref.WeakKeyDictionary] = {}
# Scope paths seen under each policy with rules, kept across regions for the same reason (a
# callee rewritten in an earlier region is not walked again): a rule is reported unmatched
# when no region of its policy has entered a scope it matches.
_SCOPES: dict[Policy, ScopeLog] = {}
# The region state under each tuple of scope names (a model's module paths), per policy.
_STATES: dict[Policy, dict] = {}
# Rewrites of inline jits (jnp's functions, below) per policy, kept across regions: callee jaxpr
# (weakly: JAX's own trace cache keeps jnp's) -> {(regions, operand avals, state, operand
# knowledge): CallRewrite, or None where the callee cannot be reused (op by op then)}.
_CALLS: dict[Policy, weakref.WeakKeyDictionary] = {}
# Decisions of ordinary operations per policy, kept across regions: (region depth, what of the
# state the rules read: _decision_scope) -> {decision key (see _decision_key): Decision}.
_DECISIONS: dict[Policy, dict] = {}
_DECISIONS_KEPT = 8192  # per state; a table past it starts again (new shapes every call)
_LOWERED = Hint(tags=frozenset({"lowered"}))  # (an operand the policy made 16-bit)


def active() -> bool:
    """Whether a region trace is pushed in this thread (a nested region only leaves a marker)."""
    return getattr(_tls, "depth", 0) > 0


class RegionEquation:
    """The one-equation view of a bind that a rule reads (``Step.eqn``)."""

    __slots__ = ("primitive", "params", "invars", "source_info", "_outvars", "program_avals")

    ctx = type("NoContext", (), {"manager": contextlib.nullcontext()})()  # already current
    is_current = True  # its source info and name stack are current: no context to re-enter

    def __init__(self, primitive: Any, params: dict, invars: list, source_info: Any):
        self.primitive, self.params, self.invars = primitive, params, invars
        self.source_info = source_info
        self._outvars: list | None = None
        # The operand types of the callee equation a walk binds (Step.program_aval), else None.
        self.program_avals: list | None = None

    @property
    def outvars(self) -> list:
        if self._outvars is None:
            avals = _program_view([v.aval for v in self.invars])
            self._outvars = [
                compat.Var(a) for a in compat.abstract_outputs(self.primitive, avals, self.params)
            ]
        return self._outvars

    def set_outputs(self, outs: Sequence[Any]) -> list:
        """Variables for the values the rule returned (their avals are what ran)."""
        if self._outvars is None or any(  # (an effect token has no dtype)
            getattr(v.aval, "dtype", None) != getattr(compat.aval_of(x), "dtype", None)
            for v, x in zip(self._outvars, outs)
        ):
            self._outvars = [compat.Var(compat.aval_of(x)) for x in outs]
        return self._outvars


def _program_view(avals: list) -> list:
    """Operand types as the float32 program has them: floating operands that arrive in
    different dtypes (a value the policy made 16-bit, moved by a shape op after jnp promoted it,
    beside a float32 bias) are typed in the widest of them, as jnp's promotion typed them."""
    is_floating = [is_float(getattr(a, "dtype", np.int32)) for a in avals]
    dtypes = {a.dtype for a, f in zip(avals, is_floating) if f}
    if len(dtypes) < 2:
        return avals
    wide = widest(*dtypes)
    return [a.update(dtype=wide, weak_type=False) if f else a for a, f in zip(avals, is_floating)]


ProgramTracer = compat.ProgramTracer


class _ValueRef(weakref.ref):
    """A weak reference to a value a region has seen, with its variable and ``id`` (one object
    per value, as few as the garbage collector can be given: a region sees every value). Made
    by ``weakref.ref``'s own constructor, its fields set after (``RegionEnv.remember``): a
    ``__new__``/``__init__`` of its own would be two Python calls per value a region sees."""

    __slots__ = ("key", "var")
    key: int
    var: Any


@dataclasses.dataclass
class LazySquare:
    """A square of a 16-bit value that a region ran in that dtype (rules/powers.py: float32 only
    where its result is summed, which a region learns later), and how to recompute it in
    float32: the square (``primitive`` with ``params`` on ``operand``, twice for ``x * x``), then
    the shape ops and converts (``chain``) that led from it to the value a sum reads."""

    operand: Any
    primitive: Any
    params: dict
    arity: int
    chain: tuple = ()
    summed: Any = None  # the recomputed value, made once

    def then(self, primitive: Any, params: dict) -> LazySquare:
        return LazySquare(
            self.operand,
            self.primitive,
            self.params,
            self.arity,
            (*self.chain, (primitive, params)),
        )


def _variable_for(value: Any, aval: Any = None) -> Any:
    """The variable a region knows ``value`` by: for a tracer of the program being built its
    own variable there (no copy of it per value for the collector to walk: with copies, a
    region open around a model kept 1.22x the objects of hand-written bf16 tracing alive), else
    a new one of ``aval`` (``value``'s type where not given)."""
    var = value.val if type(value) is ProgramTracer else None
    if type(var) is compat.Var:
        return var
    return compat.Var(compat.aval_of(value) if aval is None else aval)


class RegionEnv(Env):
    """The environment of one region: a variable per value that passed through it, the tags the
    rules read, and the casts already made. Entries go with their values (weak references), so an
    eager loop inside one region does not keep every step's arrays alive; a tracer of a program
    being built is known by its variable in that program instead (it lives as long as the
    program, which outlives the region: no reference or callback per value needed)."""

    def __init__(self) -> None:
        super().__init__(None)
        self._vars: dict[int, _ValueRef] = {}  # id(value) -> weak reference holding its Var
        self._traced: dict[Any, Any] = {}  # a program tracer's variable there -> its Var here
        # One callback for every reference, holding the region weakly: a bound method would tie
        # the region (and every tracer and equation of the program it saw) into a reference
        # cycle that only a full garbage collection frees once the program is built.
        self._on_death = _forgetting(weakref.ref(self))
        self.casts: CastsByVar = CastsByVar()
        self.promotions: CastsByVar = CastsByVar()
        self._cotangent = set()
        # Per variable, its tags as a decision key reads them (``_tag_bits``), found at its first
        # use as an operand: a value's tags are all set by the operation that made it.
        self.key_parts: dict[Any, int | None] = {}
        # Squares of 16-bit values run in their dtype, each with what recomputes it in float32
        # where a sum reads it (:class:`LazySquare`), also through reshapes and converts.
        self.lazy_squares: dict[Any, LazySquare] = {}
        self._deferred: Any = None  # the equation whose rule asked ``summed_result`` last

    def summed_result(self, step: Step) -> bool:
        """A region cannot look ahead: a square runs in the dtype it arrives in, as under the
        transform when its result is not summed, and ``process_primitive`` keeps what
        recomputes it in float32 for a sum that reads it later (``lazy_squares``). A square of
        jnp's float32 promotion of a 16-bit value (Flax's normalization statistics promote
        first) runs in float32 from the promotion: the program asked for float32, and that costs
        no cast."""
        if step.substituted:
            return True
        self._deferred = step.eqn
        return False

    def var_for(self, value: Any, aval: Any = None) -> tuple[Any, bool]:
        """(the variable standing for ``value``, whether it is new to this region); ``aval``:
        its type where the caller has it (eagerly, ``jax.typeof`` of an array builds one)."""
        var = self._seen(value)
        if var is not None:
            return var, False
        var = _variable_for(value, aval)
        self.remember(value, var)
        return var, True

    def _seen(self, value: Any) -> Any:
        """The variable of a value this region saw, else None."""
        if type(value) is ProgramTracer and type(value.val) is compat.Var:
            return self._traced.get(value.val)
        ref = self._vars.get(id(value))
        return ref.var if ref is not None and ref() is value else None

    def remember(self, value: Any, var: Any) -> None:
        if type(value) is ProgramTracer and type(value.val) is compat.Var:
            self._traced[value.val] = var
            return
        try:
            ref = _ValueRef(value, self._on_death)
        except TypeError:  # numpy values and Python scalars: a fresh variable each time
            return
        ref.key = key = id(value)
        ref.var = var
        self._vars[key] = ref

    def _forget(self, ref: _ValueRef) -> None:
        key, var = ref.key, ref.var
        if self._vars.get(key) is ref:
            del self._vars[key]
        for tags in (self.lower_outputs, self.expanded, self.input_view, self.scalar_like):
            tags.discard(var)
        self.lowered.discard(var)
        self.key_parts.pop(var, None)
        self.known.pop(var, None)
        self.upcast_of.pop(var, None)
        for facts in self.facts.values():
            facts.pop(var, None)
        self.casts.forget(var)
        if self.promotions:  # (mostly empty: no call per value then)
            self.promotions.forget(var)
        self.lazy_squares.pop(var, None)
        if self.views:
            self.views.pop(var, None)

    def knowledge_of(self, value: Any) -> tuple[int, ConstSource | None] | None | bool:
        """What this region knows about ``value``: its tags (bits, ``tag_bits``) and
        rewrite-time constant; None for a value it never saw; False where it knows what tags
        cannot say (jnp's float32 promotion of a 16-bit value: the rules read that value)."""
        var = self._seen(value)
        if var is None:
            return None
        if var in self.upcast_of:
            return False
        return self.tag_bits(var), self.known.get(var)


def _forgetting(env_ref: weakref.ref) -> Callable[[_ValueRef], None]:
    """The callback of a region's references: forget the value, while the region lives."""

    def forget(ref: _ValueRef) -> None:
        env = env_ref()
        if env is not None:
            env._forget(ref)

    return forget


@dataclasses.dataclass(frozen=True)
class CallRewrite:
    """An inline jit's jaxpr as a region decided it, and, per output, what the region knew about
    it ``(tag bits, rewrite-time constant)``, or None where the walk never saw it."""

    closed: Any
    outputs: tuple
    # What the trackers learned about the outputs, relative to the call's operands and outputs:
    # (tracker, output k, ("in" or "out", j)).
    facts: tuple = ()
    # Per output, the index of the operand the callee returns as it is, or None.
    forwarded: tuple = ()
    out_avals: tuple = ()  # the rewritten jaxpr's (what the call's outputs are)
    # The operands the rewrite only casts, each (operand, dtype): for one that is a view of a
    # parameter the call is given the parameter, which a variant of the rewrite casts and
    # reshapes (``ParameterView``; ``variants``, by the operands so given, made once).
    entry_casts: tuple = ()
    variants: dict = dataclasses.field(default_factory=dict, compare=False)
    # Eagerly, the rewritten jaxpr as a ``jax.jit`` function, made at the first eager call: its
    # C++ dispatch is how the callee itself runs eagerly (binding the call runs JAX's Python
    # dispatch, ~10x slower for a small op).
    eager: dict = dataclasses.field(default_factory=dict, compare=False)

    def run_eagerly(
        self, args: Sequence[Any], call: tuple[Any, dict] | None = None
    ) -> list[Any] | None:
        """The call on concrete ``args``; None where it failed under ``jax.debug_nans`` or
        ``debug_infs``: the caller then runs it op by op in the region, where the operation that
        made the value raises JAX's FloatingPointError naming it. (JAX's own re-run, op by op,
        of this jitted ``eval_jaxpr`` cannot: a nested jit's failure there raises JAX's
        internal error type.) ``call``: the jit equation ``(primitive, params)`` where it sets
        more than its program (a user's jit donating an operand or placing its outputs:
        ``compat.jit_sets_call``), bound again around the rewritten jaxpr, which keeps them."""
        if call is not None:
            primitive, params = call
            params = {**params, "jaxpr": self.closed}
            run = functools.partial(primitive.bind, *args, **params)
        else:
            jitted = self.eager.get("jit")
            if jitted is None:
                jaxpr, consts = compat.open_and_consts(self.closed)
                jitted = self.eager["jit"] = jax.jit(
                    functools.partial(compat.eval_jaxpr_flat, jaxpr, consts)
                )
            run = functools.partial(jitted, *args)
        try:
            # (on JAX's eval trace: under jax.disable_jit() the jit runs eval_jaxpr in Python,
            # which binds on the current trace, and inside a region's operation jax 0.12
            # leaves none current)
            with compat.eval_context():
                return run()
        except Exception:
            if any(compat.value_checks()):
                return None
            raise


def _raise_for_invalid_values(outs: Sequence[Any], name: str) -> None:
    """Under ``jax.debug_nans``/``debug_infs``, a call whose compiled run failed JAX's check and
    whose run op by op did not raise (JAX turns the check off inside the bodies of custom
    derivatives it evaluates from their jaxprs): FloatingPointError naming the call, as JAX
    names a jit whose outputs it checks."""
    nans, infs = compat.value_checks()
    values = [v for v in map(np.asarray, outs) if np.issubdtype(v.dtype, np.inexact)]
    for kind, enabled, found in (("nan", nans, np.isnan), ("inf", infs, np.isinf)):
        if enabled and any(found(value).any() for value in values):
            raise FloatingPointError(f"invalid value ({kind}) encountered in {name}")


def _output_knowledge(env: RegionEnv, value: Any) -> Any:
    """What a walk (``env``) knows about an output ``value`` (``knowledge_of``), with a constant
    it cast in the program (an operand keyed as ``ANY_VALUE``) as ``_OWN_VALUE``: the caller
    knows it as the value the call returns."""
    known = env.knowledge_of(value)
    if isinstance(known, tuple) and known[1] is not None and compat.is_tracer(known[1].base):
        return known[0], _OWN_VALUE
    return known


_OWN_VALUE = "the output's own value"


def _output_facts(env: Any, in_vars: list, outs: Sequence[Any]) -> tuple | None:
    """What the trackers of ``env`` (a walk's) know about the walk's outputs, in terms of its
    operands (``in_vars``) and other outputs; None where a fact points elsewhere (the callee's
    own intermediates): such a callee is walked op by op at every call, as before caching."""
    out_vars = []
    for value in outs:
        var, new = env.var_for(value)
        out_vars.append(None if new else var)
    found: list[tuple] = []
    for name, known in env.facts.items():
        for k, var in enumerate(out_vars):
            target = known.get(var) if var is not None else None
            if target is None:
                continue
            if isinstance(target, FactValue):
                found.append((name, k, ("is", target)))
                continue
            where = [("in", j) for j, v in enumerate(in_vars) if v is target]
            where += [("out", j) for j, v in enumerate(out_vars) if v is target]
            if not where:
                return None
            found.append((name, k, where[0]))
    return tuple(found)


def _widening_made(env: RegionEnv, var: Any, aval: Any, params: dict) -> Any:
    """The value a convert of ``var`` (of type ``aval``) to a wider floating dtype gives, where
    ``jnp`` promoted it so already in this region (``_promotion_of``); else None."""
    new = _widening_of_sixteen_bits(params) if _is_sixteen_bit(aval) else None
    if new is None:
        return None
    made = _promotion_of(env, var, new)
    # (a cast asked for is its own; asked last: it walks the traceback)
    return None if made is None or compat.current_an_asked_cast() else made


def _widening_of_sixteen_bits(params: dict) -> np.dtype | None:
    """The dtype a ``convert_element_type`` with ``params`` widens a 16-bit floating value to
    (a floating dtype of more than 16 bits, no weak type, no sharding: what jnp's promotions
    bind), else None."""
    if params["weak_type"] or params.get("sharding") is not None:
        return None
    new = np.dtype(params["new_dtype"])
    return new if is_float(new) and new.itemsize > 2 else None


def _promotion_of(env: RegionEnv, var: Any, dtype: np.dtype) -> Any:
    """``jnp``'s promotion of the 16-bit value of ``var`` to ``dtype`` made earlier in this
    region (``env.promotions``, recorded by ``_track_lowered`` and replays), else None.
    Widening is exact, so every promotion gives that value: reused, the value has one cast (as
    under autocast_transform), whose cotangents add up in the wider dtype. Only jnp's promotions
    (read by the rules as the 16-bit value, ``upcast_of``) stand in for one another, not a
    rule's cast (``env.casts``): that is a plain float32 value to the rules, which would decide
    a bias add of it differently."""
    cached = env.promotions.get((var, dtype)) if var is not None else None
    if cached is None:
        return None
    cached_aval = compat.aval_of(cached)
    return None if cached_aval.dtype != dtype or cached_aval.weak_type else cached


_PROMOTED_OPERANDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # (below)


def _promoted_operands(closed: Any) -> tuple | None:
    """A ``jnp`` callee's 16-bit operands whose every use is a convert to one wider floating
    dtype (``jnp.subtract``'s promotion of one side): ``((operand, dtype), ...)``, or None where
    there is none; found once per callee jaxpr."""
    try:
        return _PROMOTED_OPERANDS[closed]
    except KeyError:
        pass
    except TypeError:  # pragma: no cover - a jaxpr that cannot be weakly referenced
        return None
    jaxpr = compat.open_and_consts(closed)[0]
    widenings: dict[Any, Any] = {
        v: None for v in jaxpr.invars if _is_sixteen_bit(v.aval) and v not in jaxpr.outvars
    }
    for eqn in jaxpr.eqns:
        for v in eqn.invars:
            if not isinstance(v, compat.Var) or v not in widenings:
                continue
            new = (
                _widening_of_sixteen_bits(eqn.params)
                if eqn.primitive.name == "convert_element_type"
                else None
            )
            if new is None or widenings[v] not in (None, new):
                widenings[v] = False  # a use other than one widening
            elif widenings[v] is None:
                widenings[v] = new
    found = tuple(
        (i, widenings[v])
        for i, v in enumerate(jaxpr.invars)
        if widenings.get(v) not in (None, False)
    )
    result = found or None
    _PROMOTED_OPERANDS[closed] = result
    return result


def _squares_a_program_may_take(env: Any, invars: Sequence[Any], avals: Sequence[Any]) -> list:
    """Which operands of a call (a program JAX traced) that are 16-bit squares the region may
    hand it recomputed in float32: not one whose dtype another floating operand has, which the
    body, traced with both in that dtype, may pair it with in an operation taking one dtype
    (``jnp.logaddexp(x ** 2, 0.0)``: a ``lax.max`` of the square and the 0.0 jnp made 16-bit)."""
    squares = [v is not None and v in env.lazy_squares for v in invars]
    others = {np.dtype(a.dtype) for a, sq in zip(avals, squares) if not sq and is_float(a.dtype)}
    return [sq and np.dtype(a.dtype) not in others for a, sq in zip(avals, squares)]


class CastsByVar(dict):
    """The cast cache (``(var, dtype) -> value``), able to drop a variable's entries without a
    scan: a long eager loop in one region would otherwise pay for every cast made so far."""

    def __init__(self) -> None:
        super().__init__()
        self.by_var: dict[Any, list] = {}  # var -> its keys

    def __setitem__(self, key: tuple, value: Any) -> None:
        if key not in self:
            self.by_var.setdefault(key[0], []).append(key)
        super().__setitem__(key, value)

    def add_new(self, key: tuple, value: Any) -> None:
        """``self[key] = value`` for a key not in the cache (one hash less)."""
        self.by_var.setdefault(key[0], []).append(key)
        super().__setitem__(key, value)

    def setdefault(self, key: tuple, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return self[key]

    def forget(self, var: Any) -> None:
        for key in self.by_var.pop(var, ()):
            self.pop(key, None)


class RegionTrace(compat.Trace):
    """The trace of one ``jamp.autocast`` region: applies ``policy`` and binds on ``parent``."""

    def __init__(
        self,
        parent: Any,
        policy: Policy,
        region: int | None = None,
        base: RegionState | None = None,
    ):
        super().__init__()
        self.parent = parent
        self.policy = policy
        self.entry_depths = compat.routing_depths()
        self._plain_at_entry, self._backward_at_entry = self.entry_depths
        if region is None:
            # entered inside the policy's region: nested regions are the markers past these
            region = max(1, region_depth(compat.current_scope_names()))
        rewritten = SubJaxprCache(
            _STORES.setdefault(policy, weakref.WeakKeyDictionary()), per_call=False
        )
        scopes = _SCOPES.setdefault(policy, ScopeLog()) if policy.rules else None
        self.rewriter = Rewriter(
            policy,
            # base: the state at a call whose body this region walks (its scopes are relative)
            RegionState(True, policy.compute_dtype) if base is None else base,
            rewritten,
            scope_log=scopes,
            region=region,
            # (the scope log, when the policy has rules, is kept across regions as well)
            states=_shared_states(policy) if base is None else None,
        )
        # Whether binding on the parent runs operations now (fixed: a region's parent is too).
        self.eager = compat.is_eager(parent)
        self.rewriter.shares_constants = self.eager
        self.env = RegionEnv()
        if self.eager:  # (a view cast from its parameter is one more dispatch: ParameterView)
            self.env.views = None
        self._tables: dict[int, tuple[RegionState, dict]] = {}  # id(state) -> (state, decisions)
        self._last_table: tuple[Any, dict] = (None, {})  # the entry _decisions found last
        calls = _CALLS.get(policy)
        if calls is None:
            calls = _CALLS[policy] = weakref.WeakKeyDictionary()
        self._calls: weakref.WeakKeyDictionary = calls
        compat.share_trace_identity(self, parent)
        compat.lower_high_primitives_as(self, parent)

    # -- ordinary primitives ------------------------------------------------------------------

    def process_primitive(self, primitive: Any, args: Sequence[Any], params: dict) -> Any:
        kind = _KINDS.get(primitive)
        if kind is None:
            kind = _kind_of(primitive, params)
        if kind == _JIT_CALL:
            # A ``jax.jit(..., inline=True)`` call (jnp's functions), which tracing inlines. On
            # jax 0.12 ``inline`` is an enum whose every member is truthy (a plain ``jax.jit`` is
            # ``AUTO``): a user's jits are reused as jnp's are, keeping their parameters; a
            # ``cast_inputs`` function's is not, its rule casts.
            if params.get("inline") and not _casts_inputs(params.get("name", "")):
                return self._inline_call(primitive, args, params)
        elif kind == _CONVERT and compat.converts_to_itself(primitive, args, params):
            # JAX binds a convert of a value to its own type where the value is a concrete
            # tracer (``jnp.asarray`` of a value under eager ``jax.grad``: Flax's
            # ``promote_dtype`` calls it on every operand) and returns the value itself
            # elsewhere: here too, for a tracer of an array, which it leaves as it is.
            return args[0]
        state = self.rewriter.current_state()
        programs = kind == _JIT_CALL or kind == _WITH_PROGRAMS
        # (aval_of inlined for a tracer of the program: most operands are)
        avals: list[Any] = [a.aval if type(a) is ProgramTracer else compat.aval_of(a) for a in args]
        if not programs and not (state.enabled and any_float(avals)):
            # nothing for the policy to change: no floating operand, or autocast off
            return compat.bind_on(self.parent, primitive, args, params, avals)
        routing = compat.ROUTING  # (compat.decided_above, without its call)
        if routing.plain > self._plain_at_entry or routing.backward > self._backward_at_entry:
            # JAX's derivative rules bind what a region above them decided (a jax.grad called
            # in the region: differentiation_routed_above), and a backward pass the transposes
            # of ops decided in the forward pass: both run as they are, as torch's backward does.
            return compat.bind_on(self.parent, primitive, args, params, avals)
        if programs and self.eager:
            outs = self._eager_program(primitive, args, params)
            if outs is not None:
                if True in params.get("donated_invars", ()):  # (a user's jit, jax 0.10)
                    self._forget_donated(args, params["donated_invars"])
                return outs if primitive.multiple_results else outs[0]
        env = self.env
        program_vars = env._traced
        invars = []
        for value, aval in zip(args, avals):
            own = value.val if type(value) is ProgramTracer else None
            if type(own) is compat.Var:  # (RegionEnv.var_for inlined: most operands are)
                var = program_vars.get(own)
                if var is None:
                    var = program_vars[own] = own
                    self._adopt_input(var, value, aval)
            else:
                var, new = env.var_for(value, aval)
                if new:
                    self._adopt_input(var, value, aval)
            invars.append(var)
        if primitive.name == "convert_element_type" and env.promotions:
            widened = _widening_made(env, invars[0], avals[0], params)
            if widened is not None:
                return widened
            if (
                avals[0].dtype == params["new_dtype"]
                and not avals[0].weak_type
                and not params["weak_type"]
                and params.get("sharding") is None
                and invars[0] in env.upcast_of
            ):
                # (a promotion inside a call given the promoted value: _widened_operands)
                return args[0]
        if env.lazy_squares and (programs or primitive.name in ACCUMULATING):
            # a sum of a square (or a program that may sum it) reads it in float32
            which = _squares_a_program_may_take(env, invars, avals) if programs else None
            args, invars, avals = self._squares_summed(args, invars, avals, which)
        # Walking a callee's jaxpr, the equation bound here says its operands' types in the
        # program (a rule reads them: Step.program_aval), which the policy may have changed.
        walked = compat.walked_equation(primitive, len(args))
        program_avals = None if walked is None else [v.aval for v in walked.invars]
        decisions: dict | None = None
        key: tuple | None = None
        if not programs:
            last = self._last_table  # (_decisions' answer for the last state, without its call)
            decisions, key = (
                last[1] if last[0] is state else self._decisions(state),
                _decision_key(env, primitive, params, invars, avals, program_avals),
            )
            if key is not None and program_avals is not None:
                key = (*key, tuple(program_avals))
            try:
                decision = decisions.get(key) if key is not None else None
            except TypeError:  # a parameter that cannot be hashed: decided every time
                decision = key = None
            if decision is not None:
                return self._replay(decision, primitive, params, args, invars, avals)
        eqn = RegionEquation(primitive, params, invars, compat.region_source_info())
        eqn.program_avals = program_avals
        env.values = dict(zip(invars, args))
        step = RegionRecordingStep(self.rewriter, env, eqn, state)
        try:
            with compat.set_current_trace(self.parent):
                outs = list(self.rewriter.apply(step))
        finally:
            env.values = {}
            deferred, env._deferred = env._deferred is eqn, None
            if step.substituted:  # the seeded casts would keep the promoted values alive
                for var in invars:
                    if var in env.upcast_of:
                        env.casts.pop((var, F32), None)
        if programs and True in params.get("donated_invars", ()) and self.eager:
            self._forget_donated(args, params["donated_invars"])  # (a user's jit, jax 0.10)
        # What a call would have returned without the policy (its body's traced types).
        traced = [getattr(v.aval, "dtype", None) for v in eqn.outvars] if programs else []
        outvars = eqn.set_outputs(outs)
        for value, var in zip(outs, outvars):
            env.remember(value, var)
        lazy_square = None
        if deferred and _is_sixteen_bit(avals[0]) and _is_sixteen_bit(outvars[0].aval):
            # a square run as it arrived: kept, to be recomputed where a sum reads it
            lazy_square = LazySquare(args[0], primitive, params, len(args))
        elif env.lazy_squares and primitive.name in ACCUMULATED_THROUGH:
            lazy = env.lazy_squares.get(invars[0])
            if lazy is not None and len(outvars) == 1:  # (a reshape or convert on its way)
                env.lazy_squares[outvars[0]] = lazy.then(primitive, params)
        track_derived(step, outs)
        compute = state.value_dtype
        env.lowered.update(  # (an effect token has no dtype)
            v
            for v, t in zip(outvars, traced)
            if getattr(v.aval, "dtype", None) == compute and t != compute
        )
        if key is not None and decisions is not None:
            decision = step.decision(outs, outvars)
            if decision is not None:
                if len(decisions) > _DECISIONS_KEPT:
                    decisions.clear()
                decisions[key] = dataclasses.replace(decision, square=lazy_square is not None)
        if lazy_square is not None:  # (after the decision: its output's tags are all it holds)
            env.lazy_squares[outvars[0]] = lazy_square
        return outs if primitive.multiple_results else outs[0]

    # -- squares recomputed in float32 where a sum reads them -----------------------------------

    def _squares_summed(
        self, args: Sequence[Any], invars: list, avals: list, which: Sequence[bool] | None = None
    ) -> tuple[list, list, list]:
        """The operands, with each square the region ran in 16 bits (``lazy_squares``; only
        those flagged in ``which``, where given) replaced by its float32 recomputation."""
        env = self.env
        args, invars, avals = list(args), list(invars), list(avals)
        for i, var in enumerate(invars):
            lazy = env.lazy_squares.get(var)
            if lazy is None or (which is not None and not which[i]):
                continue
            if lazy.summed is None:
                with compat.set_current_trace(self.parent):
                    x = compat.convert_now(lazy.operand, F32)
                    value = lazy.primitive.bind(*[x] * lazy.arity, **lazy.params)
                    for primitive, params in lazy.chain:
                        if (
                            primitive.name == "convert_element_type"
                            and np.dtype(params["new_dtype"]) == compat.aval_of(value).dtype
                        ):
                            continue  # (a cast to float32 of what is float32 now)
                        value = primitive.bind(value, **params)
                lazy.summed = value
            args[i] = lazy.summed
            avals[i] = compat.aval_of(lazy.summed)
            invars[i], _ = env.var_for(lazy.summed, avals[i])  # (a computed value: no tags)
        return args, invars, avals

    def _call_squares_summed(self, jaxpr: Any, args: Sequence[Any], invars: list) -> Sequence[Any]:
        """``args`` of a call to ``jaxpr`` (a ``jnp`` function; ``invars``: their variables
        here), each 16-bit square that the callee sums, or returns (reshaped, converted) to a
        caller that may, recomputed in float32 first."""
        env = self.env
        lazy = [v is not None and v in env.lazy_squares for v in invars]
        if not any(lazy):
            return args
        which = [f and _reaches_a_sum(jaxpr, i) for i, f in enumerate(lazy)]
        if not any(which):
            return args
        avals = [compat.aval_of(a) for a in args]
        return self._squares_summed(args, invars, avals, which)[0]

    def _all_squares_summed(self, args: Sequence[Any]) -> Sequence[Any]:
        """``args`` with every 16-bit square recomputed in float32 (a custom derivative's or a
        ``shard_map``'s operands: what the body does with them is not looked at)."""
        env = self.env
        if not env.lazy_squares:
            return args
        invars = [env._seen(a) for a in args]
        if not any(v is not None and v in env.lazy_squares for v in invars):
            return args
        avals = [compat.aval_of(a) for a in args]
        which = _squares_a_program_may_take(env, invars, avals)
        if not any(which):
            return args
        return self._squares_summed(args, invars, avals, which)[0]

    # -- decisions made once per signature ------------------------------------------------------

    def _decisions(self, state: RegionState) -> dict:
        """The decisions made under ``state`` (what of it the rules read: _decision_scope) by
        any region of this policy at this depth: a model's blocks share them, and an eager
        loop, which enters a new region every step."""
        entry = self._tables.get(id(state))
        if entry is None:  # (the entry keeps ``state`` alive: its id is not reused meanwhile)
            table = _DECISIONS.setdefault(self.policy, {}).setdefault(
                (self.rewriter.region, _decision_scope(state)), {}
            )
            entry = self._tables[id(state)] = (state, table)
        self._last_table = entry
        return entry[1]

    def _replay(
        self,
        decision: Decision,
        primitive: Any,
        params: dict,
        args: Sequence[Any],
        invars: list,
        avals: list | None,
    ) -> Any:
        """Bind an operation as its rule decided it before for the same signature: the same
        casts (shared with every other operation through the cast cache), the same parameters,
        and the same tags on its outputs."""
        env = self.env
        canonical = True  # (a constant cast on the host is not: bind canonicalizes it)
        arriving = args
        if decision.read_through:  # the 16-bit values the promotions were made from (Step)
            args, avals = list(args), None
            for i in decision.read_through:
                args[i] = env.upcast_of[invars[i]]
        if decision.casts:
            args, avals = list(args), None
            parent = self.parent
            for i, dtype, clipped in decision.casts:
                if dtype == F32 and i in decision.read_through:
                    args[i] = arriving[i]  # (the promotion itself: Step's float32 cast)
                    continue
                key = (invars[i], dtype, CLIPPED) if clipped else (invars[i], dtype)
                cast = env.casts.get(key)
                if cast is None:
                    source = env.known.get(invars[i])  # a constant: cast from its value
                    if source is None and not clipped:
                        cast = compat.convert_on(parent, args[i], dtype)
                    else:
                        with compat.set_current_trace(parent):
                            cast = (
                                source.cast(dtype)
                                if source is not None
                                else saturating_cast(args[i], dtype)
                            )
                    env.casts.add_new(key, cast)
                if isinstance(cast, HOST_VALUES):
                    canonical = False
                args[i] = cast
        if decision.again:  # operands the rule computed from the others (Step.derive)
            args, avals = list(args), None
            with compat.set_current_trace(self.parent):
                for i, derive in decision.again:
                    args[i] = derive(env, invars, args)
        traced_params = params
        if decision.overrides:
            params = {**params, **decision.overrides}
        if canonical:
            outs = compat.bind_on(self.parent, primitive, args, params, avals, decision.evaluated)
        else:
            with compat.set_current_trace(self.parent):
                outs = primitive.bind(*args, **params)
        values = outs if primitive.multiple_results else (outs,)
        key_parts = env.key_parts
        traced = env._traced
        out_facts = decision.out_facts
        out_vars: list | None = [] if out_facts else None
        for value, aval, bits in zip(values, decision.out_avals, decision.out_tags):
            own = value.val if type(value) is ProgramTracer else None
            if type(own) is compat.Var:  # (_variable_for and remember, inlined: most outputs)
                var = traced[own] = own
            else:
                var = _variable_for(value, aval)
                env.remember(value, var)
            if bits:
                env.add_tags(var, bits)
            key_parts[var] = bits  # (what _tag_bits would find at its first use: tags only)
            if out_vars is not None:
                out_vars.append(var)
        if out_vars is not None:  # what the trackers learned of the outputs, set again
            env.set_output_facts(out_facts, invars, out_vars)
            for _, k, _ in out_facts:
                key_parts[out_vars[k]] = None  # (more than tags: _fact_part)
        if decision.promotes:
            env.upcast_of[var] = args[0]
            env.promotions.setdefault((invars[0], decision.out_avals[0].dtype), values[0])
            key_parts[var] = None  # (more than tags: _promotion_part)
        if decision.square:  # a 16-bit square, recomputed in float32 if a sum reads it
            env.lazy_squares[var] = LazySquare(arriving[0], primitive, traced_params, len(arriving))
            key_parts[var] = None  # (more than tags: what reads it is decided every time)
        if decision.view:  # a shape op of a parameter (ParameterView)
            note_view(env, invars[0], arriving[0], primitive, traced_params, var)
        return outs

    # -- jnp's functions: inline jits ----------------------------------------------------------

    def _inline_call(self, primitive: Any, args: Sequence[Any], params: dict) -> list[Any]:
        """jnp's functions are jits JAX inlines into the program being traced (autocast_transform
        sees their equations), so the region decides their equations one by one too, eagerly as
        well. That walk is made once per callee jaxpr, operand types (weak types included),
        region state and what the region knows about the operands, into a rewritten jaxpr
        (:class:`CallRewrite`), which later calls bind as one call: a jaxpr trace inlines it as
        it inlines the callee, eagerly it runs as one compiled call, as the callee does.

        A small constant operand (a weak or rank-0 concrete value, which the rules cast once,
        saturating, from its value) is keyed by its value; eagerly by what the rules read of it
        (``constant_key``), the rewrite casting it in the program. Walked op by op on every call
        instead, because the walk reads more than a key holds (docs/reference/dtypes.md,
        "Regions"): an operand or output that is jnp's float32 promotion of a value the policy
        made 16-bit (the rules use the 16-bit value itself, which is not an operand), a constant
        operand with shape ops applied or over 16 elements, and every call under a policy with
        ``'@file:line'`` rules (they match the caller's frames, which differ per call). A walk
        that raises is redone op by op on the values themselves, where the error belongs.

        Eagerly, a user's jit that donates operands or places its inputs or outputs (shardings,
        memory kinds: ``compat.jit_sets_call``) runs as itself around the rewrite, which keeps
        that (run op by op, it would not); a device array constant over 16 elements given to it
        is keyed by its type then, as a small one is.
        """
        routing = compat.ROUTING  # (as in process_primitive: as it is)
        if routing.plain > self._plain_at_entry or routing.backward > self._backward_at_entry:
            return compat.bind_on(self.parent, primitive, args, params)
        closed = params["jaxpr"]
        try:  # (a callee rewritten before is no sampler: those are never rewritten)
            entries = self._calls.get(closed)
        except TypeError:  # pragma: no cover - a jaxpr that cannot be weakly referenced
            entries = None
        if entries is None and compat.calls_a_sampler(primitive, params):
            # as traced, a sample (rules/calls.py)
            # (walking a user's jit on jax 0.12, an operand may be one the policy made 16-bit)
            args = self._agreeing(primitive, args)
            return self._sampled(args, compat.bind_on(self.parent, primitive, args, params))
        state = self.rewriter.current_state()
        eager = self.eager
        call = (primitive, params) if eager and compat.jit_sets_call(params) else None
        known = self._operand_knowledge(args) if call is None else self._call_knowledge(args, call)
        lazy = self.env.lazy_squares
        if lazy and (known is None or not lazy.keys().isdisjoint(known[3])):
            jaxpr = compat.open_and_consts(params["jaxpr"])[0]
            summed = self._call_squares_summed(jaxpr, args, self._operand_vars(args, known))
            if summed is not args:  # (the operands' knowledge again, with the float32 squares)
                args, known = summed, self._call_knowledge(summed, call)
        promotions = self.env.promotions
        widened = None
        if promotions:
            invars = known[3] if known is not None else self._operand_vars(args, known)
            if not promotions.by_var.keys().isdisjoint(invars):
                widened = self._widened_operands(params["jaxpr"], args, invars)
        rewrite = None
        if widened is not None:  # walked op by op: its promotions read the values given
            args = widened
        elif known is not None and not self.rewriter.line_rules:
            knowledge, sources, facts, in_vars, avals = known
            rewrite = self._call_rewrite(
                closed, state, knowledge, sources, facts, avals, entries=entries
            )
        outs = None
        if rewrite is not None:
            if eager:
                outs = rewrite.run_eagerly(args, call)  # (None: op by op under jax.debug_nans)
                if call is not None and outs is not None:
                    self._forget_donated(args, params["donated_invars"])
            elif rewrite.entry_casts and self.env.views:
                outs = self._call_with_views_cast(rewrite, args, params, in_vars, avals)
            else:
                outs = compat.bind_call_on(self.parent, args, params, rewrite.closed, avals)
        if outs is None:
            failed = None if rewrite is None else f"jit({params.get('name', '?')})"
            return self._walk(params["jaxpr"], args, failed)
        assert rewrite is not None  # (outs are its call's)
        return self._adopt_call_outputs(rewrite, outs, in_vars)

    def _call_with_views_cast(
        self, rewrite: CallRewrite, args: Sequence[Any], params: dict, in_vars: list, avals: list
    ) -> list[Any]:
        """The call of ``rewrite`` given, for each operand it only casts that is a view of a
        parameter, the parameter itself, which a variant of the rewrite casts and reshapes
        (``ParameterView``): the cast inside the call as before, which a differentiating
        parent takes as one call (bound outside, the cast and each shape op would be a
        primitive of their own to differentiate). As it is where no such operand is a view."""
        views = self.env.views
        assert views is not None  # (the caller asked)
        given = []
        for i, dtype in rewrite.entry_casts:
            view = views.get(in_vars[i])
            if view is not None and casts_through_view(view, dtype):
                given.append((i, dtype, view))
        if not given:
            return compat.bind_call_on(self.parent, args, params, rewrite.closed, avals)
        given_args, given_avals = list(args), list(avals)
        for i, _, view in given:
            given_args[i], given_avals[i] = view.value, compat.aval_of(view.value)
        try:  # (by the parameters' types too: shape ops alike may start from other shapes)
            which = tuple(
                (i, dtype, given_avals[i], tuple((p, tuple(kw.items())) for p, kw in view.steps))
                for i, dtype, view in given
            )
            closed = rewrite.variants.get(which)
        except TypeError:  # (a shape op's parameter that cannot be hashed: cast as it comes)
            return compat.bind_call_on(self.parent, args, params, rewrite.closed, avals)
        if closed is None:
            steps = {i: (dtype, view.steps) for i, dtype, view in given}
            closed = rewrite.variants[which] = compat.with_inputs_cast_from(
                rewrite.closed, steps, given_avals
            )
        return compat.bind_call_on(self.parent, given_args, params, closed, given_avals)

    def _sampled(self, args: Sequence[Any], outs: list[Any]) -> list[Any]:
        """The outputs of a ``jax.random`` sampler, known as samples (``Env.samples``) where its
        floating operands are samples and constants (not a draw around a model value ``h``,
        ``uniform(key, s, d, h, h + 1)``: interpreter.from_samples)."""
        env = self.env
        for value in args:
            if not is_float(getattr(compat.aval_of(value), "dtype", np.int32)):
                continue
            var = env._seen(value)  # (None: a value the region did not see, a constant or not)
            if not (
                is_known_value(value) if var is None else var in env.samples or var in env.known
            ):
                return outs  # (a model value drawn from: no sample)
        for value in outs:
            aval = compat.aval_of(value)
            if is_float(getattr(aval, "dtype", np.int32)):
                var = _variable_for(value, aval)
                env.remember(value, var)
                env.samples.add(var)
        return outs

    def _forget_donated(self, args: Sequence[Any], donated: Sequence[bool]) -> None:
        """After a user's jit donated operands: the values known from them (a view of a weak
        constant, ``w.reshape(...)`` made before the call) are no longer theirs to recompute
        from, as that array is deleted; they are the values the region holds."""
        gone = {id(a) for a, d in zip(args, donated) if d}
        if gone:
            known = self.env.known
            for var in [v for v, source in known.items() if id(source.base) in gone]:
                del known[var]

    def _eager_program(self, primitive: Any, args: Sequence[Any], params: dict) -> list[Any] | None:
        """Eagerly, a primitive carrying programs (``lax.scan``, ``while_loop``, ``cond``) is
        rewritten as a one-equation jaxpr, once per equation, operand types, region state and
        operand knowledge (as :meth:`_inline_call` does for a ``jnp`` function), and then runs as
        one compiled call. Rewritten at every call instead, its rule would rebuild the loop
        around a new body, which JAX compiles again at every call, where plain JAX compiles it
        once. None where the equation goes the way it always went (other primitives:
        ``_REBUILT_LOOPS``; ``'@file:line'`` rules; ``jax.disable_jit()``; operands the region
        knows more of than a key holds; a rule that binds the equation as it came)."""
        if primitive.name not in _REBUILT_LOOPS or self.rewriter.line_rules:
            return None
        if compat.jit_disabled():  # (nothing compiles: JAX's loop runs op by op, as the rules')
            return None
        anchor, params_key, others = _program_key(params)
        if anchor is None:
            return None
        known = self._operand_knowledge(args)
        if known is None:
            return None
        knowledge, sources, facts, in_vars, avals = known
        env = self.env
        if _any_in(in_vars, env.lazy_squares) or _any_in(in_vars, env.promotions.by_var):
            return None  # (recomputed or read through by the rules: the way it always went)
        try:
            rewrite = self._call_rewrite(
                anchor,
                self.rewriter.current_state(),
                knowledge,
                sources,
                facts,
                avals,
                equation=(primitive, params, params_key, others),
            )
        except TypeError:  # a parameter that cannot be hashed
            return None
        outs = None if rewrite is None else rewrite.run_eagerly(args)
        if outs is None:  # (or a failure under jax.debug_nans: the way it always went)
            return None
        assert rewrite is not None  # (outs are its call's)
        return self._adopt_call_outputs(rewrite, outs, in_vars)

    def _walk(self, closed: Any, args: Sequence[Any], failed: str | None) -> list[Any]:
        """A call's jaxpr ``closed`` run op by op in this region. ``failed``: the name of the
        call where its compiled run failed JAX's value checks (``CallRewrite.run_eagerly``),
        named by a FloatingPointError if the walk does not raise one itself."""
        jaxpr, consts = compat.open_and_consts(closed)
        with compat.set_current_trace(self):
            outs = compat.eval_jaxpr_retyped(jaxpr, consts, args)
        if failed is not None:
            _raise_for_invalid_values(outs, failed)
        return outs

    def _operand_vars(self, args: Sequence[Any], known: tuple | None) -> list:
        """The variables of a call's operands: those ``_operand_knowledge`` found, else looked up
        (None for a value this region never saw)."""
        return known[3] if known is not None else [self.env._seen(a) for a in args]

    def _widened_operands(self, closed: Any, args: Sequence[Any], invars: list) -> Any:
        """``args`` of a call to ``closed`` (a ``jnp`` function) with each 16-bit operand that
        the callee only ever promotes (``_promoted_operands``) replaced by the promotion the
        region made already (``_promotion_of``), else None. Flax's normalizations
        promote a 16-bit value for their statistics, then again inside ``jnp.subtract`` for
        ``x - mean``: given the first, the value has one float32 cast, as under
        autocast_transform, and its cotangents add up in float32 before one cast back."""
        env = self.env
        promoted = _promoted_operands(closed)
        if promoted is None:
            return None
        widened = None
        for i, dtype in promoted:
            cached = _promotion_of(env, invars[i], dtype)
            if cached is None:
                continue
            widened = list(args) if widened is None else widened
            widened[i] = cached
        return widened

    def _adopt_call_outputs(
        self, rewrite: CallRewrite, outs: list[Any], in_vars: list[Any]
    ) -> list[Any]:
        """What the walk of a call (``rewrite``) knew about its outputs, for the values ``outs``
        the call returned: a variable, tags and facts each, as op by op."""
        env = self.env
        traced = env._traced
        out_vars: list[Any] = []
        for value, aval, known_out, j in zip(
            outs, rewrite.out_avals, rewrite.outputs, rewrite.forwarded
        ):
            out_vars.append(None)
            if j is not None:  # the callee returns its operand j (jnp.asarray): the same value,
                out_vars[-1] = in_vars[j]  # and the same variable, as op by op (facts included)
                env.remember(value, in_vars[j])
                continue
            if known_out is None:  # not seen by the walk (a constant of the callee): as if new
                continue
            bits, source = known_out
            own = value.val if type(value) is ProgramTracer else None
            if type(own) is compat.Var:  # (_variable_for and remember, inlined: most outputs)
                var = out_vars[-1] = traced[own] = own
            else:
                var = out_vars[-1] = _variable_for(value, aval)
                env.remember(value, var)
            if bits:
                env.add_tags(var, bits)
            if source is _OWN_VALUE:  # (a constant the call cast in its program: ANY_VALUE)
                source = ConstSource(value) if is_known_value(value) else None
            if source is not None:
                env.known[var] = source
            else:
                env.key_parts[var] = bits  # (as in _replay)
        # What the trackers learned about the outputs (a softmax's max: rules/softmax.py),
        # pointing at the caller's own variables.
        for name, k, (side, j) in rewrite.facts:
            target = in_vars[j] if side == "in" else j if side == "is" else out_vars[j]
            if out_vars[k] is not None and target is not None:
                env.facts.setdefault(name, {})[out_vars[k]] = target
                env.key_parts[out_vars[k]] = None  # a fact: more than tags (_tag_bits)
        return outs

    def _call_knowledge(self, args: Sequence[Any], call: tuple | None) -> tuple | None:
        """``_operand_knowledge`` of a jit call's ``args``; for one run as itself (``call``, a
        user's jit that donates or places: :meth:`_inline_call`), with larger constants keyed
        too, where they alone would have it walked op by op (which drops what the jit sets)."""
        known = self._operand_knowledge(args)
        if known is None and call is not None:
            known = self._operand_knowledge(args, any_size=True)
        return known

    def _operand_knowledge(self, args: Sequence[Any], any_size: bool = False) -> tuple | None:
        """Per operand, the region's tags for it (bits), for a small constant the rules read (a
        weak or rank-0 concrete value, cast once, saturating) its value (eagerly its kind:
        ``constant_key``; with ``any_size``, a larger device array's too: ``_array_key``), and
        the first operand
        that is the same value (its own index if none is); those
        constants' sources; what the trackers know of one operand in terms of another
        (``(tracker, i, j)``: a softmax's max ``i`` of ``j``); and the operands' variables and
        types. None where the walk would read more than that (a fact about an operand that
        points outside the call)."""
        env, keys, sources, avals = self.env, [], [], []
        vars_: list[Any] = []
        parts = env.key_parts
        eager = self.eager  # (constants keyed by what the rules read: any value)
        more_than_tags = False
        traced = env._traced
        for i, value in enumerate(args):
            # (RegionEnv.var_for inlined for a tracer of the program: most operands are)
            own = value.val if type(value) is ProgramTracer else None
            if type(own) is compat.Var:
                aval = value.aval
                var = traced.get(own)
                if var is None:
                    var = traced[own] = own
                    self._adopt_input(var, value, aval)
            else:
                aval = compat.aval_of(value)
                var, new = env.var_for(value, aval)
                if new:
                    self._adopt_input(var, value, aval)
            bits = parts.get(var, _UNSEEN)
            if bits is _UNSEEN:
                bits = parts[var] = _tag_bits(env, var)
            source = constant = None
            if bits is None:  # a constant, a promotion or a fact (_tag_bits)
                more_than_tags = True
                if var in env.upcast_of:
                    return None
                source = env.known.get(var)
                if source is not None:
                    constant = constant_key(source, aval if eager else None)
                    if constant is None and any_size and eager:
                        constant = _array_key(value, aval)
                    if constant is None:
                        return None
                bits = env.tag_bits(var)
            # (the same value twice is one value to the walk too: jnp's ``x * x`` is a square)
            # (found in C: a Var compares by identity, and a call has few operands)
            keys.append((bits, constant, vars_.index(var) if var in vars_ else i))
            sources.append(source)
            vars_.append(var)
            avals.append(aval)
        if not more_than_tags:  # (no facts either)
            return tuple(keys), sources, (), vars_, avals
        facts: list[tuple] = []
        for name, known in env.facts.items():
            for i, var in enumerate(vars_):
                target = known.get(var)
                if target is None:
                    continue
                if isinstance(target, FactValue):  # (a value: keyed as it is)
                    facts.append((name, i, target))
                    continue
                if not any(target is other for other in vars_):
                    return None
                facts.append((name, i, next(j for j, o in enumerate(vars_) if o is target)))
        return tuple(keys), sources, tuple(sorted(facts)), vars_, avals

    def _call_rewrite(
        self,
        closed: Any,
        state: RegionState,
        knowledge: tuple,
        sources: list,
        facts: tuple,
        avals: list,
        equation: tuple | None = None,
        entries: collections.OrderedDict | None = None,
    ) -> CallRewrite | None:
        """The cached rewrite of an inline jit's jaxpr, made on the first call (None: the callee
        cannot be reused, or its jaxpr cannot be weakly referenced). With ``equation``
        (``(primitive, params, params_key, other programs)``, :meth:`_eager_program`),
        ``closed`` is the first program of that equation's parameters, which keys the store, and
        the jaxpr walked is the equation itself; its entry goes with any of its programs.
        ``entries``: the store's entries for ``closed``, where the caller looked them up."""
        key = (
            self.rewriter.region,
            tuple(avals),  # (an aval's equality includes its weak type)
            # The scope path (a Flax module's) decides only through the policy's rules: without
            # any, every block of a model reuses the rewrite its first block made.
            state if self.policy.rules else (state.enabled, state.dtype, state.keep_compute_dtype),
            knowledge,
            facts,
            None if equation is None else equation[2],
        )
        if entries is None:
            store = self._calls
            try:
                entries = store.get(closed)
                if entries is None:
                    entries = store[closed] = collections.OrderedDict()
            except TypeError:  # pragma: no cover - a jaxpr that cannot be weakly referenced
                return None
        found = entries.get(key, _ABSENT)  # (the key hashed once: it is a nested tuple)
        if found is not _ABSENT:
            if len(entries) > _CALLS_PER_CALLEE // 2:  # (the order matters near the bound only)
                entries.move_to_end(key)
            return found
        programs = [closed]
        if equation is not None:
            primitive, params, _, others = equation
            programs += others
            closed = _equation_jaxpr(primitive, params, avals)
        rewrite = self._walk_once(closed, list(avals), state, knowledge, sources, facts)
        if rewrite is not None and equation is not None and _mentions(rewrite.closed, programs):
            # (a rule that bound the equation as it came: kept, the store's value would hold
            # its programs alive; the equation is then bound as it is, which JAX caches itself)
            rewrite = None
        if rewrite is not None:
            # Calls knowing other things of their operands (a parameter, then the callee's own
            # output) mostly rewrite alike: one jaxpr object then, which JAX lowers as one
            # function, as plain JAX does for a jit called twice (Rewriter.rewrite_closed).
            for earlier in entries.values():
                if earlier is not None and compat.same_program(earlier.closed, rewrite.closed):
                    rewrite = dataclasses.replace(rewrite, closed=earlier.closed)
                    break
        consts = compat.open_and_consts(rewrite.closed)[1] if rewrite is not None else ()
        if not any(compat.is_tracer(c) for c in consts):
            entries[key] = rewrite  # (one closing over this trace's values: this call only)
            for program in programs[1:]:  # (the first keys the store: its entries go with it)
                weakref.finalize(program, _drop_entry, weakref.ref(entries), key)
            if len(entries) > _CALLS_PER_CALLEE:  # an eager loop passing a new scalar each step
                entries.popitem(last=False)
        return rewrite

    def _walk_once(
        self,
        closed: Any,
        avals: list,
        state: RegionState,
        knowledge: tuple,
        sources: list,
        facts: tuple,
    ) -> CallRewrite | None:
        """Walk the callee op by op under a region of this policy pushed on a jaxpr trace of its
        own, from the call's state and operand knowledge; the rewritten jaxpr and what the walk
        knew about each output."""
        jaxpr, consts = compat.open_and_consts(closed)
        found: dict[str, Any] = {}

        def walk(*operands: Any) -> list[Any]:
            operands = tuple(operands[same] for _, _, same in knowledge)
            sub = RegionTrace(
                compat.current_trace(), self.policy, region=self.rewriter.region, base=state
            )
            try:
                in_vars = []
                for value, (bits, constant, _), source in zip(operands, knowledge, sources):
                    var, _ = sub.env.var_for(value)
                    in_vars.append(var)
                    sub.env.add_tags(var, bits)
                    if source is not None and constant[0] is ANY_VALUE:  # cast in the program
                        sub.env.known[var] = ConstSource(value, bound=constant[-1])
                    elif source is not None:  # cast from the value (in the key), as op by op
                        sub.env.known[var] = source
                for name, i, j in facts:  # (in the key)
                    target = j if isinstance(j, FactValue) else in_vars[j]
                    sub.env.facts.setdefault(name, {})[in_vars[i]] = target
                with compat.set_current_trace(sub):
                    outs = compat.eval_jaxpr_retyped(jaxpr, consts, operands)
                # a square the callee returns leaves it in float32: the caller may sum it, and
                # the rewrite it keeps cannot say what recomputes it (jnp.square: torch's pow)
                outs = list(sub._all_squares_summed(outs))
                found["outputs"] = [_output_knowledge(sub.env, x) for x in outs]
                found["facts"] = _output_facts(sub.env, in_vars, outs)
            finally:
                sub.invalidate()
            return outs

        try:
            rewritten = compat.trace_to_closed(walk, avals)
        except Exception:  # the walk on the values themselves raises what it raises, in place
            return None
        # Left out once here rather than by XLA at every call: jnp's float32 promotions of a
        # 16-bit value that the rules read through (the 16-bit value is used instead).
        rewritten = compat.without_dead_converts(rewritten)
        if any(out is False for out in found["outputs"]) or found["facts"] is None:
            return None
        invars = list(jaxpr.invars)
        forwarded = tuple(
            next((j for j, v in enumerate(invars) if v is out), None) for out in jaxpr.outvars
        )
        return CallRewrite(
            rewritten,
            tuple(found["outputs"]),
            found["facts"],
            forwarded,
            tuple(compat.closed_out_avals(rewritten)),
            compat.inputs_only_cast(rewritten),
        )

    def _adopt_input(self, var: Any, value: Any, aval: Any) -> None:
        """A value the region did not compute: a parameter or a batch, or a constant."""
        env = self.env
        env.input_view.add(var)
        if is_known_value(value) and (getattr(aval, "weak_type", False) or not aval.shape):
            env.known[var] = ConstSource(value)  # cast once, saturating, as the rewriter does

    def stage_value(self, value: Any) -> Any:
        with compat.set_current_trace(self.parent):
            return self.parent.stage_value(value)

    # -- calls with functions (custom derivatives) ---------------------------------------------

    def process_custom_jvp_call(
        self, primitive: Any, fun: Any, jvp: Any, tracers: Sequence[Any], /, **params: Any
    ) -> Any:
        args = self._agreeing(primitive, self._all_squares_summed(tracers))
        return self._staged(primitive, (fun, jvp), args, params)

    def process_custom_vjp_call(
        self, primitive: Any, fun: Any, fwd: Any, bwd: Any, tracers: Sequence[Any], /, **params: Any
    ) -> Any:
        args = self._agreeing(primitive, self._all_squares_summed(tracers))
        return self._staged(primitive, (fun, fwd, bwd), args, params)

    def _agreeing(self, primitive: Any, args: Sequence[Any]) -> Sequence[Any]:
        """A custom-derivative call (or a ``jax.random`` sampler's jit) met walking a callee (a
        ``jnp`` function, a user's jit on jax 0.12) takes its operands in the dtypes the callee
        traced it with: its body and its derivative rules are programs JAX traced at those
        types (a square the region recomputed in float32 for a sum, beside the 16-bit value it
        was traced with, failed in the body's ``lax.max``, or in the JVP rule's ``lax.eq``
        under ``jax.grad``)."""
        walked = compat.walked_equation(primitive, len(args))
        if walked is None:
            return args
        args = list(args)
        with compat.set_current_trace(self.parent):
            for i, var in enumerate(walked.invars):
                dtype = getattr(var.aval, "dtype", None)
                if dtype is not None and is_float(dtype) and compat.aval_of(args[i]).dtype != dtype:
                    args[i] = compat.convert_now(args[i], dtype)
        return args

    def process_call(
        self, primitive: Any, fun: Any, tracers: Sequence[Any], params: dict, /
    ) -> Any:
        """``core.call_p`` (jax 0.10; JAX's own tests, old libraries): a call with no meaning
        of its own, so its body runs in the region, as a traced program's ``call`` is inlined."""
        with compat.set_current_trace(self):
            return fun.call_wrapped(*tracers)

    # -- shard_map: the body runs on the mesh ---------------------------------------------------

    def process_shard_map(
        self, primitive: Any, fun: Any, args: Sequence[Any], /, **params: Any
    ) -> Any:
        """The parent traces (or runs) the per-shard body with the mesh's axes bound, and a region
        of this policy pushed on the body's own trace applies it there."""
        state = self.rewriter.current_state()
        if state.enabled and not compat.decided_above(*self.entry_depths):
            policy = self.policy
            if state.dtype != policy.compute_dtype:  # a nested `dtype=` region at the call
                policy = policy.with_compute_dtype(state.dtype)
            fun = compat.wrap_traced_fun(fun, lambda: pushed(policy))
        args = self._all_squares_summed(args)
        with compat.set_current_trace(self.parent):
            return self.parent.process_shard_map(primitive, fun, args, **params)

    def _staged(self, primitive: Any, subfuns: tuple, args: Sequence[Any], params: dict) -> Any:
        """Stage the call to its jaxpr equation and rewrite that, as ``autocast_transform``
        rewrites the same equation in a traced program."""
        if compat.decided_above(*self.entry_depths):  # as in process_primitive
            with compat.set_current_trace(self.parent):
                return compat.bind_custom(primitive, subfuns, args, params)
        if compat.runs_custom_calls_inline(self.parent, args):
            # Where the parent would run the body itself (eagerly, under
            # jax.ensure_compile_time_eval) no rule of the call can apply: the body runs in the
            # region op by op, with concrete values where it had them (it may branch on them).
            if compat.is_eager(self.parent):
                outs = self._eager_body(primitive, subfuns, args, params)
                if outs is not None:
                    return outs
            with compat.set_current_trace(self):
                return subfuns[0].call_wrapped(*args)
        # The function or one of its rules may branch on a value (`if x > 0:`), which tracing
        # it on types alone (staging the call, or JAX tracing a rule of the rewritten call)
        # cannot give. Under an eager jax.jvp or jax.grad, where the values exist, the call is
        # then bound on the parent, as without jamp: its rules run on the values, their
        # operations in this region one by one. Inside jax.jit the error is raised, as it is
        # without jamp (binding on the parent there would trace the body outside the region).
        try:
            closed = self._staged_jaxpr(primitive, subfuns, args, params)
            jaxpr, consts = compat.open_and_consts(closed)
            state = self.rewriter.current_state()
            # (which operands the policy made 16-bit: custom_ad.py gives their cotangents
            # their dtype, as where the transform casts them)
            lowered = self.env.lowered
            hints = [
                _LOWERED if (var := self.env._seen(a)) is not None and var in lowered else None
                for a in args
            ]
            with compat.staged_once(subfuns), compat.set_current_trace(self.parent):
                return self.rewriter.child(state).run(jaxpr, consts, list(args), hints)
        except _NEEDS_VALUES:
            if compat.under_staging():
                raise
            for fun in subfuns:
                compat.empty_stores(fun)
            with compat.set_current_trace(self.parent):
                return compat.bind_custom(primitive, subfuns, args, params)

    def _eager_body(
        self, primitive: Any, subfuns: tuple, args: Sequence[Any], params: dict
    ) -> list[Any] | None:
        """Eagerly, the body of one of JAX's own ``custom_jvp`` functions (``jax.nn.relu``,
        ``softplus``...) runs as a ``jnp`` function does in a region (:meth:`_inline_call`):
        walked once per body, operand types, region state and operand knowledge, then one
        compiled call, rather than op by op through JAX's Python dispatch at every call. None
        where it runs op by op instead: a user's function (it may print, or branch on its
        operands' values, which eager code allows), a ``custom_vjp`` call, ``'@file:line'``
        rules, an operand the walk would read more of than a key holds."""
        fun = subfuns[0]
        if self.rewriter.line_rules or not _is_jax_function(getattr(fun, "f", None)):
            return None
        known = self._operand_knowledge(args)
        if known is None:
            return None
        knowledge, sources, facts, in_vars, avals = known
        body = self._body_jaxpr(primitive, subfuns, avals, params)
        if body is None:
            return None
        # (the body is traced: its output stores are filled, so it runs from its jaxpr now)
        rewrite = self._call_rewrite(
            body, self.rewriter.current_state(), knowledge, sources, facts, avals
        )
        outs = None if rewrite is None else rewrite.run_eagerly(args)
        if outs is None:  # (or a failure under jax.debug_nans: op by op)
            failed = None if rewrite is None else getattr(fun.f, "__name__", primitive.name)
            return self._walk(body, args, failed)
        assert rewrite is not None  # (outs are its call's)
        return self._adopt_call_outputs(rewrite, outs, in_vars)

    def _body_jaxpr(self, primitive: Any, subfuns: tuple, avals: list, params: dict) -> Any:
        """A ``custom_jvp`` call's body traced to a jaxpr, once per function, rule and operand
        types (:func:`_traced_once`); None for a call that cannot be keyed (a ``custom_vjp``'s)
        or a body that cannot be traced."""
        key = compat.custom_call_key(primitive, subfuns, avals, params)
        if key is None:
            return None
        fun = subfuns[0]
        try:
            return _traced_once(
                ("body", *key), fun, lambda: compat.trace_to_closed(fun.call_wrapped, avals)
            )
        except Exception:  # (raised again op by op on the values, where the error belongs)
            compat.empty_stores(fun)
            return None

    def _staged_jaxpr(
        self, primitive: Any, subfuns: tuple, args: Sequence[Any], params: dict
    ) -> Any:
        """The call staged to its one-equation jaxpr: traced once per function, rule and operand
        types, so that an eager ``jax.grad`` step calling ``jax.nn.relu`` in a region rewrites
        the same equation (cached: rules/custom_ad.py) rather than a new one at every call."""
        avals = [compat.aval_of(a) for a in args]
        return _traced_once(
            compat.custom_call_key(primitive, subfuns, avals, params),
            subfuns[0],
            lambda: compat.trace_to_closed(
                lambda *xs: compat.bind_custom(primitive, subfuns, xs, params), avals
            ),
        )


# What tracing a function on types alone raises where it reads a value (JAX's own classes).
_NEEDS_VALUES = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerIntegerConversionError,
)


def _traced_once(key: tuple | None, fun: Any, trace: Callable[[], Any]) -> Any:
    """``trace()``, a closed jaxpr of a trace that calls ``fun`` (a ``WrappedFun``), made once per
    ``key`` (``_STAGED``): later, the same jaxpr, with ``fun``'s output stores filled as tracing
    it again would fill them. Traced every time for a key that is None or cannot be hashed, and
    for a jaxpr closing over a tracer."""
    try:
        cached = _STAGED.get(key) if key is not None else None
    except TypeError:  # a parameter or a function's argument that cannot be hashed
        cached, key = None, None
    if cached is not None:
        closed, stored = cached
        compat.fill_stores(fun, stored)
        return closed
    closed = trace()
    consts = compat.open_and_consts(closed)[1]
    if key is not None and not any(compat.is_tracer(c) for c in consts):
        if len(_STAGED) > _STAGED_KEPT:
            _STAGED.clear()
        _STAGED[key] = (closed, compat.filled_stores(fun))
    return closed


def _is_jax_function(fn: Any) -> bool:
    """Whether ``fn`` is defined in JAX itself (``jax.nn``'s functions: pure, and the same for
    any operand values of one type)."""
    module = getattr(fn, "__module__", None) or ""
    return module == "jax" or module.startswith("jax.")


def _decision_scope(state: RegionState) -> Any:
    """What of a region state the rules read: enabled, dtype and ``keep_compute_dtype`` (a
    model's blocks differ in their scope path only, which the state has applied already); the
    whole state for a scaled format (float8 shares decisions per source site and path)."""
    if state.dtype in SCALED_FORMATS:
        return state
    return (state.enabled, state.dtype, state.keep_compute_dtype)


def _array_key(value: Any, aval: Any) -> tuple | None:
    """An eager call's constant operand that ``constant_key`` does not key (over 16 elements,
    ``jnp.full(shape, 0.1)``, weak-typed; shape ops applied, ``jnp.ones(shape)`` in the region)
    where it is a device array: keyed as any value of its type, which the rewrite takes as an
    operand and casts in the program, clipping where a cast narrows it, as the rules cast it
    from its value (``ConstSource``: the shape ops commute with the cast); else None (a host
    value, keyed by its bytes: op by op)."""
    if isinstance(value, HOST_VALUES) or compat.is_tracer(value):
        return None
    dtype = getattr(value, "dtype", None)
    if not isinstance(dtype, np.dtype):  # (an extended dtype: a typed PRNG key)
        return None
    return ANY_VALUE, dtype, aval.shape, type(value), None


def _tag_bits(env: RegionEnv, var: Any) -> int | None:
    """The tags of ``var`` as bits (``TAG_BITS``); None where the region knows more about it
    than tags say (a constant the rules cast from its value, jnp's float32 promotion of a
    lowered value, a tracker's fact, a 16-bit square a sum would recompute: ``LazySquare``): an
    operation reading such a value is decided every time unless another part keys it
    (``_constant_part``, ``_promotion_part``, ``_fact_part``)."""
    if var in env.known or var in env.upcast_of or env.has_fact(var) or var in env.lazy_squares:
        return None
    return env.tag_bits(var)


def _is_sixteen_bit(aval: Any) -> bool:
    dtype = getattr(aval, "dtype", None)
    return dtype is not None and is_float(dtype) and np.dtype(dtype).itemsize < 4


def _reaches_a_sum(jaxpr: Any, i: int) -> bool:
    """Whether ``jaxpr``'s operand ``i`` reaches, through reshapes and converts only, a sum, a
    primitive carrying a program (which may sum it), or an output (the caller may sum that)."""
    reached = {jaxpr.invars[i]}
    for eqn in jaxpr.eqns:
        if not any(isinstance(v, compat.Var) and v in reached for v in eqn.invars):
            continue
        name = eqn.primitive.name
        if name in ACCUMULATING or carries_programs(eqn.primitive, eqn.params):
            return True
        if name in ACCUMULATED_THROUGH:
            reached.update(eqn.outvars)
    return any(isinstance(v, compat.Var) and v in reached for v in jaxpr.outvars)


# What process_primitive does first with an operation, by its primitive (found once per
# primitive, ``_kind_of``): a jit call (jnp's functions: _inline_call), a convert (which may be
# to the value's own type), another primitive carrying programs (scan, cond...), any other.
_JIT_CALL, _CONVERT, _WITH_PROGRAMS, _OTHER = range(4)
_KINDS: dict[Any, int] = {}


def _kind_of(primitive: Any, params: dict) -> int:
    if primitive.name in ("jit", "pjit"):
        kind = _JIT_CALL
    elif primitive.name == "convert_element_type":
        kind = _CONVERT
    else:
        kind = _WITH_PROGRAMS if carries_programs(primitive, params) else _OTHER
    _KINDS[primitive] = kind
    return kind


def _any_in(variables: list, table: dict) -> bool:
    for var in variables:  # (a loop, not any() of a generator: asked per jnp call)
        if var in table:
            return True
    return False


@functools.lru_cache(maxsize=4096)  # (a region asks at every jnp call: the same few names)
def _casts_inputs(name: str) -> bool:
    """Whether a jit named ``name`` is a ``@jamp.autocast(cast_inputs=...)`` function's (named
    after its dtype), which ``rules/calls.py``'s jit rule casts the inputs of."""
    return cast_inputs_dtype(name) is not None


def _decision_key(
    env: RegionEnv,
    primitive: Any,
    params: dict,
    invars: list,
    avals: list,
    program_avals: list | None = None,
) -> tuple | None:
    """Everything a rule reads of one operation: the primitive, its parameters, per operand its
    type as traced (the variable's) and as it arrives and its tags, and which operands are the
    same value, and what else the rule reads (``_READS_MORE``; ``program_avals``: the operands'
    types in a callee's jaxpr the region walks, else None), and what the trackers know of the
    operands, in terms of the operands (``TransformDecisions.facts_part``, where any knows
    something). None where an operand carries more than tags and facts (``_tag_bits``)."""
    key: list[Any] = [primitive, tuple(params.items())]
    reads_more = _READS_MORE.get(primitive.name)
    if reads_more is not None:
        key.append(reads_more(params, avals, program_avals))
    parts = env.key_parts
    with_facts = False
    for var, aval in zip(invars, avals):
        bits = parts.get(var, _UNSEEN)
        if bits is _UNSEEN:
            bits = parts[var] = _tag_bits(env, var)
        if bits is None:
            bits = _constant_part(env, var)
            if bits is None:
                bits = _promotion_part(env, var)
                if bits is None:
                    bits = _fact_part(env, var)
                    if bits is None:
                        return None
                    with_facts = True
        key += (var.aval, aval, bits)
    if len(invars) > 1 and len(set(map(id, invars))) < len(invars):
        # the same value twice (``x * x`` is a square to rules/powers.py): which operands are
        key.append(tuple(next(j for j, u in enumerate(invars) if u is v) for v in invars))
    if with_facts:  # (a softmax's shift: its max, stop_gradient of it, what it is the max of)
        key.append(TransformDecisions.facts_part(env, invars))
    return tuple(key)


_UNSEEN = object()


def _convert_reads_more(params: dict, avals: list, program_avals: list | None) -> tuple | None:
    """What ``convert_rule`` reads besides the operation: for a floating value converted to
    another floating dtype, whether it was traced inside jnp's contractions (there the convert
    ending one is left out), for a float32 value converted to 16 bits, inside jnp's reductions
    (there it is left out, and the result stays float32), and for a 16-bit value widened,
    inside a promotion (``_track_lowered``); nothing (None) for any other convert."""
    if not convert_may_end_a_contraction(params, avals):
        return None
    origin = compat.current_convert_origin()
    reduction = convert_may_round_a_reduction(params, avals) and origin.in_jnp_reduction
    # a 16-bit value widened: jnp's promotion (read as the 16-bit value) or a cast asked for
    widening = _is_sixteen_bit(avals[0]) and _widening_of_sixteen_bits(params) is not None
    promotion = widening and not origin.asked_cast
    return (reduction, origin.in_jnp_contraction, promotion)


def _reduction_reads_more(params: dict, avals: list, program_avals: list | None) -> bool | None:
    """What ``fp32_rule`` reads of a reduction besides the operation: for a 16-bit operand in
    the program, whether jnp traced it, which it does only where ``dtype=`` names that dtype
    (``interpreter.reduces_in_the_dtype_asked``); nothing (None) otherwise."""
    program = avals if program_avals is None else program_avals
    if not reduction_may_name_its_dtype(program[0]):
        return None
    return compat.current_convert_origin().in_jnp_reduction


# What a rule reads of an operation besides its primitive, parameters and operands, by primitive:
# (parameters, arriving types, types in a walked callee's jaxpr or None) -> a part of the
# decision's key, read where the operation is bound.
_READS_MORE: dict[str, Callable[[dict, list, list | None], Any]] = {
    "convert_element_type": _convert_reads_more,
    **dict.fromkeys(DTYPE_NAMING_REDUCTIONS, _reduction_reads_more),
}


class RegionRecordingStep(RecordingStep):
    """A region's :class:`RecordingStep`, whose decision also says which operands the rule read
    as the 16-bit values jnp promoted (``Step``) and whether the output is such a promotion."""

    def decision(self, returned: Sequence[Any], outvars: Sequence[Any]) -> Decision | None:
        """The replayable decision, or None: the rule bound more or other than the operation
        on its operands, some cast (float8's scaling, reduce_dtype's custom_vjp), or the outputs
        carry more than tags."""
        bound = self.bound_once(returned, self.args)  # (promotions read through: Step)
        if bound is None:
            return None
        args, overrides, _, casts = bound
        env: RegionEnv = self.env  # type: ignore[assignment]
        promotes = len(outvars) == 1 and env.upcast_of.get(outvars[0]) is args[0]
        tags = []
        with_facts = False
        for var in outvars:
            if promotes:  # (its tags, and the promotion recorded as such: Decision.promotes)
                bits = env.tag_bits(var) if _promotion_part(env, var) is not None else None
            else:
                bits = _tag_bits(env, var)
                if bits is None and _fact_part(env, var) is not None:
                    bits, with_facts = env.tag_bits(var), True
            if bits is None:
                return None
            tags.append(bits)
        out_facts: tuple = ()
        if with_facts:  # what the trackers learned of them, in terms of the operands
            learned = TransformDecisions.output_facts(env, self.eqn)
            if learned is None:
                return None
            out_facts = learned
        read_through: tuple[int, ...] = ()
        if self.substituted:
            upcast = env.upcast_of
            read_through = tuple(i for i, v in enumerate(self.eqn.invars) if v in upcast)
        return Decision(
            casts,
            overrides,
            tuple(v.aval for v in outvars),
            tuple(tags),
            read_through,
            promotes,
            view=is_parameter_view(env, self.eqn),
            out_facts=out_facts,
            again=tuple(self.derived.items()),
        )


# Custom-derivative calls staged to their equation (_staged_jaxpr): key -> (closed jaxpr, what
# the staging filled the function's output stores with).
_STAGED: dict[tuple, tuple[Any, Any]] = {}
_STAGED_KEPT = 1024


def _shared_states(policy: Policy) -> dict:
    states = _STATES.setdefault(policy, {})
    if len(states) > _STATES_KEPT:  # a program naming a new scope every step: start again
        states.clear()
    return states


_STATES_KEPT = 4096
_CALLS_PER_CALLEE = 64  # rewrites kept per inline jit (least recently used dropped)
_ABSENT = ("absent",)  # (a stored rewrite may be None)


# The primitives carrying programs that JAX compiles when bound eagerly and whose rules rebuild
# them around new bodies (control_flow.py), which would compile again at every call: an eager
# region runs them as one rewritten call (_eager_program). The others go as they always went: a
# jax.jit call binds its rewritten body, cached (Rewriter.rewrite_closed), which JAX compiles
# once; a checkpoint's body JAX evaluates op by op eagerly (its impl), as the region does.
_REBUILT_LOOPS = frozenset({"scan", "while", "cond"})
_ANCHOR = object()  # (the anchor's place in a key: the store holds the anchor weakly)


def _program_key(params: dict) -> tuple[Any, tuple | None, list]:
    """The first program among an equation's parameters (the ``scan``'s body, a ``cond``'s
    first branch), which keys a region's store of rewrites weakly; the parameters as a key
    that holds no program (the anchor left out, the others by weak reference: a key holding
    one would keep it, and what it closes over, alive); and those other programs. ``(None,
    None, [])`` for none."""
    anchor = None
    others: list[Any] = []

    def part(value: Any) -> Any:
        nonlocal anchor
        if isinstance(value, tuple):
            return tuple(part(v) for v in value)
        if not compat.is_jaxpr_like(value):
            return value
        if anchor is None:
            anchor = value
            return _ANCHOR
        others.append(value)
        return weakref.ref(value)

    key = tuple((name, part(value)) for name, value in params.items())
    return (anchor, key, others) if anchor is not None else (None, None, [])


def _drop_entry(entries_ref: weakref.ref, key: tuple) -> None:
    """Drop ``key`` from a store's entries for one program, if they are still alive (the
    finalizer of another program of the same equation: it must not keep them alive)."""
    entries = entries_ref()
    if entries is not None:
        entries.pop(key, None)


def _equation_jaxpr(primitive: Any, params: dict, avals: list) -> Any:
    """One equation, ``primitive`` bound with ``params`` on operands of types ``avals``, as a
    closed jaxpr."""

    def bound(*xs: Any) -> list[Any]:
        out = primitive.bind(*xs, **params)
        return list(out) if primitive.multiple_results else [out]

    return compat.trace_to_closed(bound, avals)


def _mentions(closed: Any, programs: Sequence[Any]) -> bool:
    """Whether an equation of ``closed`` carries one of ``programs`` (or its open jaxpr) as it
    is."""
    targets = [*programs, *(getattr(p, "jaxpr", p) for p in programs)]
    for eqn in compat.open_and_consts(closed)[0].eqns:
        for value in eqn.params.values():
            for item in value if isinstance(value, tuple) else (value,):
                if any(item is t for t in targets):
                    return True
    return False


def _constant_part(env: RegionEnv, var: Any) -> tuple | None:
    """A small host constant operand's part of a decision key, its tags and its value (the rules
    cast it from its value: a replay does too); None for a device array (keying it by value would
    wait for it and copy it to the host at every operation: an eager loop's scalar arrays) and
    for what else makes ``_tag_bits`` None."""
    source = env.known.get(var)
    if source is None or var in env.upcast_of or env.has_fact(var):
        return None
    if not isinstance(source.base, HOST_VALUES):
        return None
    constant = constant_key(source)
    return None if constant is None else (env.tag_bits(var), constant)


def _fact_part(env: RegionEnv, var: Any) -> tuple | None:
    """The key part of an operand a tracker knows something of (a softmax's max) and nothing
    more than tags besides: its tags and ``WITH_FACTS`` (what the facts are, relative to the
    operation's operands, the key holds once: ``TransformDecisions.facts_part``); else None."""
    if var in env.known or var in env.upcast_of or var in env.lazy_squares or not env.has_fact(var):
        return None
    return env.tag_bits(var), WITH_FACTS


def _promotion_part(env: RegionEnv, var: Any) -> tuple | None:
    """The key part of an operand that is jnp's float32 promotion of a value the policy made
    16-bit (``Env.upcast_of``), which a rule reads as that value (``Step``): its tags and the
    type of the value read; None where the region knows more of it (a constant, a fact)."""
    source = env.upcast_of.get(var)
    if source is None or var in env.known or env.has_fact(var):
        return None
    return env.tag_bits(var), "read as", compat.aval_of(source)


def region_above(differentiating: Any) -> RegionTrace | None:
    """The region that decides the user's operations before ``differentiating`` (a JVP or
    linearize trace of a ``jax.grad`` called inside a region) differentiates them: one per such
    trace, made at its first operation, with the policy of the region it was started in (found
    below it, past any ``vmap``), binding on it. None where no region is below it."""
    if not getattr(_tls, "depth", 0):  # (active(), inlined: asked for every such operation)
        return None
    upper = differentiating.__dict__.get("_jamp_region_above")
    if upper is None:
        below = compat.trace_parent(differentiating)
        for _ in range(64):  # a stack of traces is short; a cycle would be a bug
            if below is None or isinstance(below, RegionTrace):
                break
            below = compat.trace_parent(below)
        upper = (
            _RegionAbove(differentiating, below.policy, region=below.rewriter.region)
            if isinstance(below, RegionTrace)
            else False
        )
        differentiating._jamp_region_above = upper
    return upper or None


class _RegionAbove(RegionTrace):
    """The region above a differentiating trace (``region_above``). That trace keeps it (one per
    trace, on the trace itself), so it holds the trace it binds on weakly: a strong reference
    back would make the pair a reference cycle, keeping the differentiated program (its tracers
    and residuals) in memory until a full garbage collection. It is only reached through that
    trace, so the trace is alive whenever it runs."""

    @property
    def parent(self) -> Any:
        return self._parent_ref()

    @parent.setter
    def parent(self, trace: Any) -> None:
        self._parent_ref = weakref.ref(trace)


# JAX traces a loop body (with the types its initial carry has) before the loop reaches the
# region; a carry the region made 16-bit then meets a body traced without the policy.
LOOP_CARRY_NOTE = (
    "(inside a jamp.autocast region: the loop's initial carry is {dtype} because the region "
    "computed it, while JAX traced the loop body without the policy. Cast the initial carry to "
    "its float32 type before the loop (x.astype(jnp.float32)), enter the region inside the loop "
    "body, or use jamp.autocast_transform(fn), which rewrites the whole program; see "
    "docs/reference/dtypes.md, 'Regions')"
)


# The same for a cond's branches: JAX traces them with the operand's types before the cond reaches
# the region, so one branch may promote a 16-bit operand (a matmul with a float32 weight) where
# another keeps it.
BRANCH_NOTE = (
    "(inside a jamp.autocast region: an operand of the cond is {dtype} because the region "
    "computed it, while JAX traced the branches without the policy, so they returned different "
    "types. Cast the operand to its float32 type before the cond (x.astype(jnp.float32)), enter "
    "the region inside the branches, or use jamp.autocast_transform(fn), which rewrites the whole "
    "program; see docs/reference/dtypes.md, 'Regions')"
)
# And for code JAX traces itself before the region sees it (a jax.jit function's body) or that
# the region leaves alone (autocast off), where a lax operation takes operands of one dtype only.
SAME_DTYPES_NOTE = (
    "(inside a jamp.autocast region: an operand is {dtype} because the region computed it, "
    "and this lax operation requires operands of one dtype. JAX traced it without the policy: "
    "in the body of a jax.jit function called in the region, a loop body or a cond branch, or "
    "under jamp.autocast(enabled=False). Cast the value to its float32 type before passing it "
    "(x.astype(jnp.float32)), enter the region inside that function, or use "
    "jamp.autocast_transform(fn), which rewrites the whole program; see "
    "docs/reference/dtypes.md, 'Regions')"
)
# And for jnp under jax.numpy_dtype_promotion("strict"), which checks dtypes before anything
# reaches the region: it cannot tell a 16-bit value the region made from one the user made.
STRICT_PROMOTION_NOTE = (
    "(inside a jamp.autocast region: a value is {dtype} because the region computed it (a "
    "matmul's output, say), and jnp's strict dtype promotion (jax.numpy_dtype_promotion"
    "('strict')) refuses to mix it with a float32 one; the region runs your jnp code on the "
    "values it computed. Cast explicitly (x.astype(jnp.float32)), or use "
    "jamp.autocast_transform(fn), which traces the float32 program and keeps strict promotion "
    "for your own code; see docs/reference/dtypes.md, 'Regions')"
)


# And for jnp functions that take float32 only (the FFT of real input; on jax 0.12 svd, qr,
# eigh and what is built on them): jnp or JAX checks the dtype before the region sees anything.
FLOAT32_ONLY_NOTE = (
    "(inside a jamp.autocast region: the value is {dtype} because the region computed it (a "
    "matmul's output, say), and this function takes float32: jnp checks its input, or JAX "
    "traces it, before the region sees the operation, so the region cannot run it in float32 as "
    "jamp.autocast_transform(fn) does. Pass x.astype(jnp.float32), which is float32 in a region, "
    "or use jamp.autocast_transform(fn); see docs/reference/dtypes.md, 'Regions')"
)


def is_strict_promotion_error(err: BaseException) -> bool:
    """``jax.numpy_dtype_promotion("strict")`` refused to promote (public API: no _compat)."""
    return isinstance(err, jax.dtypes.TypePromotionError)


# JAX's refusals that a 16-bit value the region made can cause, and what to tell the user.
_REFUSAL_NOTES = (
    (compat.is_loop_carry_type_error, LOOP_CARRY_NOTE),
    (compat.is_branch_type_error, BRANCH_NOTE),
    (compat.is_same_dtypes_error, SAME_DTYPES_NOTE),
    (is_strict_promotion_error, STRICT_PROMOTION_NOTE),
    (compat.is_float32_only_refusal, FLOAT32_ONLY_NOTE),
)


# One object per distinct policy: every `jamp.autocast()` makes a new, equal Policy, and JAX compares
# the jit-cache context (REGION_KEY's value) of every cached trace it looks up with ``==`` unless
# it is the same object (a dataclass comparison of every field, ~1000 a trace of a small model);
# the policy-keyed tables here find it by identity too.
_CANONICAL: dict[Policy, _JitKey] = {}
_CANONICAL_KEPT = 256


class _JitKey(int):
    """REGION_KEY's value for one policy. JAX hashes its jit-cache context at every cache lookup
    while tracing (~4 an operation in a region: jnp's inline jits, abstract evaluation), and a
    Policy hashes its ten fields every time (4,100 times a trace of the 12-block benchmark
    model); this hashes once, as the int it is (the policy's hash), in C: a Python ``__hash__``
    is a Python call at each of those lookups. Equal where the policies are, as the policy
    itself would be (a trace JAX cached is found again after ``_CANONICAL`` starts over), and
    to nothing else (not to the int it holds)."""

    policy: Policy

    def __new__(cls, policy: Policy) -> _JitKey:
        key = super().__new__(cls, hash(policy))
        key.policy = policy
        return key

    __hash__ = int.__hash__  # (the C slot: no Python call per lookup)

    def __eq__(self, other: object) -> bool:
        return type(other) is _JitKey and (
            self.policy is other.policy or self.policy == other.policy
        )

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __repr__(self) -> str:  # (how JAX's cache-miss explanations show the context)
        return repr(self.policy)

    __str__ = __repr__

    def __reduce__(self) -> tuple:  # (a copy made from the policy, hashing as this one does)
        return _JitKey, (self.policy,)


def _jit_key(policy: Policy) -> _JitKey:
    """The jit-cache context of the first policy equal to ``policy`` that a region used."""
    found = _CANONICAL.get(policy)
    if found is None:
        if len(_CANONICAL) > _CANONICAL_KEPT:  # (a new policy every step: equal ones compare)
            _CANONICAL.clear()
        found = _CANONICAL[policy] = _JitKey(policy)
    return found


def _canonical(policy: Policy) -> Policy:
    """The first policy equal to ``policy`` that a region used."""
    return _jit_key(policy).policy


@contextlib.contextmanager
def pushed(policy: Policy) -> Iterator[None]:
    """Make a region trace the current trace for the block (one per thread: regions nested in
    it, in any transformation below it, leave markers that it reads)."""
    jit_key = _jit_key(policy)
    policy = jit_key.policy
    trace = RegionTrace(compat.current_trace(), policy)
    _tls.depth = getattr(_tls, "depth", 0) + 1
    outer_dtypes = getattr(_tls, "region_dtypes", None)
    _tls.region_dtypes = dtypes = {policy.compute_dtype}
    try:
        with (
            REGION_KEY(jit_key),
            compat.differentiation_routed_above(region_above),
            compat.set_current_trace(trace),
        ):
            yield
        if policy.rules:  # as autocast_transform warns once it has seen the whole program
            log = trace.rewriter.scope_log
            # (once per region's line, as once per transformed function)
            where = f"a jamp.autocast region{user_site()}"
            warn_unmatched(log.unmatched(policy.rules), where, log.paths)
    except (TypeError, ValueError) as err:  # (jax.dtypes.TypePromotionError is a ValueError)
        # The dtype as a word, of this region or one nested in it (a float16 region says nothing
        # of a bfloat16 value the user made).
        # (by name or short name: Equinox's loop error shows types as ``bf16[3,4]``)
        named = [
            d.name
            for d in sorted(dtypes, key=lambda d: d.name)
            if re.search(rf"\b({d.name}|{_short_name(d)})\b", str(err))
        ]
        for refused, note in _REFUSAL_NOTES:
            if refused(err) and named and hasattr(err, "add_note"):
                err.add_note(note.format(dtype=named[0]))  # (add_note: Python 3.11+)
        raise
    finally:
        _tls.depth -= 1
        _tls.region_dtypes = outer_dtypes
        trace.invalidate()


def _short_name(dtype: np.dtype) -> str:
    """``dtype``'s name as JAX writes it in a type (``bf16`` in ``bf16[3,4]``)."""
    return dtype.name.replace("float", "f")


def entered_nested(dtype: np.dtype) -> None:
    """A region with ``dtype`` was entered inside the pushed one (for the notes on its errors)."""
    dtypes = getattr(_tls, "region_dtypes", None)
    if dtypes is not None:
        dtypes.add(np.dtype(dtype))
