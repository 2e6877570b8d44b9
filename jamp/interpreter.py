"""The rewriting evaluator: walks a jaxpr and re-emits every equation under the caller's trace,
inserting casts where the policy says so (into a program being built, most equations are staged
directly rather than bound: ``Step.bind``, ``_compat.stage_like``).

Rules live in one registry, ``RULES`` (primitive name -> :class:`PrimitiveRules`), as in JAX's
own interpreters, and every front end reads it: the rewriter (``autocast_transform``), the region
trace (``jamp.autocast`` anywhere) and the instrumented evaluator of ``find_nonfinite`` and
``value_ranges`` (``probe.py``). A rewrite rule receives a :class:`Step` (the equation, its
operands as they arrive, the region state) and returns the equation's outputs; primitives
without one go through the policy's category (lower / fp32 / promote) or the default rule. A
primitive that carries programs also says how the instrumented evaluator walks into them
(:func:`register_walk`), next to its rewrite rule.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import math
import os
import warnings
from collections.abc import Callable, MutableMapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive

from . import _compat as compat
from . import reduce_dtype
from .policy import (
    Policy,
    RegionState,
    ScopeLog,
    is_line_rule,
    report_unmatched_rules,
    suggestions,
)
from .region_stack import apply_marker

Rule = Callable[["Step"], Sequence[Any]]
# (probe's context for the equation, its operands, the observer's state) -> (outputs, state)
Walk = Callable[[Any, Sequence[Any], Any], tuple[list[Any], Any]]


@dataclasses.dataclass
class PrimitiveRules:
    """What jamp does with one primitive, in every front end."""

    rewrite: Rule | None = None  # the rewriter's and the region trace's rule
    # How probe.py's instrumented evaluation enters the programs the primitive carries: ``walk``
    # evaluates the equation, ``bodies`` lists the open jaxprs it enters (in site-numbering
    # order), ``loop`` says whether they run once per iteration. ``walk=None`` with
    # ``opaque=True``: the evaluator runs the equation whole, as one site (register_opaque).
    walk: Walk | None = None
    bodies: Callable[[Any], list[Any]] | None = None
    loop: bool = False
    opaque: bool = False


RULES: dict[str, PrimitiveRules] = {}
F32 = np.dtype(np.float32)
F64 = np.dtype(np.float64)


class RewriteError(RuntimeError):
    """A primitive could not be rewritten; the message names it and the user's source line."""


class UnsupportedPrimitiveWarning(UserWarning):
    """A primitive carrying sub-jaxprs has no jamp rule and ran in its traced dtypes."""


def primitive_names(names: Sequence[Any], caller: str) -> list[str]:
    """The registry keys for ``names``: primitive names as jaxprs print them, or ``Primitive``
    objects. A name no primitive has (a typo, ``"dot"`` for ``"dot_general"``) raises instead of
    registering a rule nothing would ever look up; names the primitives have in other JAX
    versions (``"pjit"``) are accepted, so one rule module serves every supported version."""
    keys = []
    for name in names:
        if isinstance(name, Primitive):
            keys.append(name.name)
            continue
        if not isinstance(name, str):
            raise TypeError(
                f"{caller} takes primitive names (str) or Primitive objects, got "
                f"{type(name).__name__} {name!r}"
                + (f"; decorate with @{caller}('my_prim'), not @{caller}" if callable(name) else "")
            )
        known = compat.primitive_names() | compat.OTHER_VERSION_PRIMITIVE_NAMES
        if name not in known:
            close = suggestions(name, known)
            hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else "."
            raise ValueError(
                f"{caller}({name!r}): {name!r} is not a primitive of this JAX "
                f"({jax.__version__}){hint} Rules are keyed by primitive names as jaxprs print "
                "them (`jax.make_jaxpr(f)(x)`). A primitive of your own must be defined (its "
                "lowering registered) first, or pass the Primitive object itself."
            )
        keys.append(name)
    return keys


def register(*names: str | Primitive) -> Callable[[Rule], Rule]:
    """Register a rewrite rule for primitives by name: ``@register("scan")``."""
    keys = primitive_names(names, "jamp.interpreter.register")

    def wrap(rule: Rule) -> Rule:
        for name in keys:
            RULES.setdefault(name, PrimitiveRules()).rewrite = rule
        return rule

    return wrap


def register_walk(
    *names: str | Primitive, bodies: Callable[[Any], list[Any]], loop: bool = False
) -> Callable[[Walk], Walk]:
    """Register how the instrumented evaluator (``probe.py``) walks into the programs these
    primitives carry: ``@register_walk("scan", bodies=..., loop=True)``."""
    keys = primitive_names(names, "jamp.interpreter.register_walk")

    def wrap(walk: Walk) -> Walk:
        for name in keys:
            entry = RULES.setdefault(name, PrimitiveRules())
            entry.walk, entry.bodies, entry.loop = walk, bodies, loop
        return walk

    return wrap


def register_opaque(*names: str | Primitive) -> None:
    """Primitives whose programs the instrumented evaluator does not enter: each runs whole, as
    one site (a ``shard_map`` body needs its mesh; a linear solve's jaxprs are callbacks)."""
    for name in primitive_names(names, "jamp.interpreter.register_opaque"):
        RULES.setdefault(name, PrimitiveRules()).opaque = True


def rewrite_rule(name: str) -> Rule | None:
    entry = RULES.get(name)
    return entry.rewrite if entry is not None else None


def walk_rules(name: str) -> PrimitiveRules | None:
    """The registry entry of ``name`` if the instrumented evaluator walks into it."""
    entry = RULES.get(name)
    return entry if entry is not None and entry.walk is not None else None


def call_body(eqn: Any) -> Any:
    """The closed or open jaxpr of a call-like equation (``jaxpr`` or ``call_jaxpr``)."""
    return eqn.params[call_param(eqn)]


def call_param(eqn: Any) -> str:
    """The name of a call-like equation's body parameter: ``jaxpr`` or ``call_jaxpr``."""
    return "jaxpr" if "jaxpr" in eqn.params else "call_jaxpr"


def walk_call(ctx: Any, invals: Sequence[Any], state: Any) -> tuple[list[Any], Any]:
    """The instrumented walk of a call (jit, remat, a custom-derivative call): its body, inline
    (no derivative is taken while walking)."""
    return ctx.run(call_body(ctx.eqn), invals, state)


def call_bodies(eqn: Any) -> list[Any]:
    return [compat.open_and_consts(compat.as_closed(call_body(eqn)))[0]]


_IS_FLOAT: dict[Any, bool] = {}  # asked for every operand of every equation: by dtype, once


def any_float(avals: Sequence[Any]) -> bool:
    """Whether any of ``avals`` is of a floating dtype (``is_float``'s table read without its
    call: a region asks for every operation)."""
    known = _IS_FLOAT
    for aval in avals:  # (a loop, not any() of a generator)
        dtype = getattr(aval, "dtype", None)
        if dtype is not None:
            floating = known.get(dtype)
            if floating or (floating is None and is_float(dtype)):
                return True
    return False


def is_float(dtype: Any) -> bool:
    try:
        return _IS_FLOAT[dtype]
    except KeyError:
        floating = _IS_FLOAT[dtype] = bool(jnp.issubdtype(dtype, jnp.floating))
        return floating
    except TypeError:  # pragma: no cover - an unhashable dtype-like
        return bool(jnp.issubdtype(dtype, jnp.floating))


def cast_all(values: Sequence[Any], dtypes: Sequence[Any], recorder: Any = None) -> list[Any]:
    """Each value converted to the floating dtype beside it (non-floating targets: unchanged).

    ``recorder`` (a rule's ``step.rewriter.recorder``) counts the conversions for ``explain``:
    a loop carry cast back or a branch output cast is a cast jamp inserted, like an operand's."""
    out = []
    for v, d in zip(values, dtypes):
        if is_float(d) and compat.aval_of(v).dtype != d:
            v = compat.convert(v, d)
            if recorder is not None:
                recorder.cast(constant=False)
        out.append(v)
    return out


def widest(*dtypes: Any) -> np.dtype:
    """JAX's standard promotion of ``dtypes``, whatever ``jax.numpy_dtype_promotion`` the caller
    set: jamp's own casts are explicit, so the user's "strict" mode must not reject them."""
    return _widest(dtypes, bool(jax.config.read("jax_enable_x64")))


@functools.lru_cache(maxsize=256)
def _widest(dtypes: tuple, x64: bool) -> np.dtype:  # (the promotion context costs ~0.1 ms)
    # x64 in the key: with it off, JAX promotes float32 and float64 to float32.
    with jax.numpy_dtype_promotion("standard"):
        return np.dtype(jnp.result_type(*dtypes))


# Values a rewrite-time cast handles with numpy, on the host (everything else is a device array).
HOST_VALUES = (np.ndarray, np.generic, float, int, bool)


def is_known_value(value: Any) -> bool:
    """A value the rules may read at rewrite time: concrete, on the host or a device, not a
    tracer, nor a symbolic dimension (``jax.export``'s shapes: no value until the program runs)."""
    return isinstance(value, _KNOWN_TYPES) and not isinstance(value, compat.Tracer)


_KNOWN_TYPES = (*HOST_VALUES, jax.Array)


CLIPPED = "clipped"  # a cast cache key's last part: Step.clipped_cast


@functools.lru_cache(maxsize=64)
def _narrows_range(source: Any, target: Any) -> bool:
    """A floating cast to a format of a smaller exponent range (float32 to float16 or float8; not
    to bfloat16, which has float32's)."""
    return (
        is_float(source)
        and is_float(target)
        and jnp.finfo(target).maxexp < jnp.finfo(source).maxexp
    )


def saturating_cast(value: Any, dtype: np.dtype, bound: float | None = None) -> Any:
    """Cast a concrete value, clipping finite floats to the target's range (no overflow to inf).

    Runs at rewrite time: numpy for host values, eager JAX (never staged) for device arrays.
    A tracer (the operand of an eager region's rewrite shared by every value of a small
    constant: ``constant_key``) is cast in the program being traced, clipped
    unless ``bound``, a bound of its finite values' magnitude, fits the target's range.
    """
    dtype = np.dtype(dtype)
    on_host = isinstance(value, HOST_VALUES)
    xp = np if on_host else jnp
    if compat.is_tracer(value):  # (tracked after a rule, under any current trace: its own)
        context: Any = compat.set_current_trace(compat.trace_of(value))
    else:
        context = contextlib.nullcontext() if on_host else compat.eval_context()
    with context:
        src = xp.asarray(value)
        if is_float(dtype) and is_float(src.dtype):
            limit = float(jnp.finfo(dtype).max)
            if float(jnp.finfo(src.dtype).max) > limit and (bound is None or bound > limit):
                if on_host:
                    src = np.where(np.isfinite(src), np.clip(src, -limit, limit), src)
                else:  # (three primitives in a traced program, not jnp's two calls)
                    low, high = (jnp.asarray(v, src.dtype) for v in (-limit, limit))
                    src = lax.select(lax.is_finite(src), lax.clamp(low, src, high), src)
        return src.astype(dtype)


@dataclasses.dataclass(frozen=True)
class ConstSource:
    """A value known at rewrite time: a concrete base followed by shape-only primitives.

    Casting it casts the (small) base, saturating, and replays the shape ops, so
    ``jnp.where(mask, x, jnp.finfo(jnp.float32).min)`` under float16 masks with -65504, not -inf.
    """

    base: Any
    steps: tuple = ()
    # For a traced base (an eager region's rewrite shared by every value of a constant): a
    # bound of its finite values' magnitude, where one is known (saturating_cast).
    bound: float | None = None

    def cast(self, dtype: np.dtype) -> Any:
        value = saturating_cast(self.base, dtype, self.bound)
        for primitive, params in self.steps:
            value = primitive.bind(value, **params)
        return value


def constant_key(source: ConstSource, aval: Any = None) -> tuple | None:
    """A constant operand's value as part of a cache key: a small concrete value without shape
    ops (a Python or numpy scalar, a rank-0 array), else None (not keyed: walked op by op).

    With ``aval`` (the operand's type in an eager region), a key every value shares that the
    rules cast alike: the rules read a constant only to cast it, saturating (``ConstSource``),
    so the rewrite takes it as an operand (``ANY_VALUE``: ``region_trace``'s walks; a call
    given it, :meth:`Rewriter.rewrite_closed`) and casts it in the program, clipping where the
    key's bound of its magnitude does not fit the target's range. An eager loop passing a new
    learning rate or step count to ``x * c`` then compiles once, as plain JAX does. A device
    array's bound is not read (that would wait for it): it is clipped wherever a cast narrows
    it. Keyed by value: a host value that its own type cannot hold (a Python float over
    float32's range), or of another kind (complex)."""
    base = source.base
    if source.steps or compat.is_tracer(base) or getattr(base, "size", 1) > 16:
        return None  # (a large array's size read before numpy copies it to the host)
    dtype = getattr(base, "dtype", None)
    if dtype is not None and not isinstance(dtype, np.dtype):
        return None  # an extended dtype (a typed PRNG key, ``jax.random.key``): no numpy value
    if aval is not None and not isinstance(base, HOST_VALUES):
        return ANY_VALUE, dtype, base.shape, type(base), None
    value = np.asarray(base)
    if aval is not None and value.dtype.kind in "biu":  # (a cast clips floats only)
        return ANY_VALUE, value.dtype, value.shape, type(base), None
    if aval is not None and value.dtype.kind == "f":
        bound = _magnitude_bound(value, aval)
        if bound is not None:
            return ANY_VALUE, value.dtype, value.shape, type(base), bound
    return value.dtype, value.shape, value.tobytes(), type(base)


ANY_VALUE = "any value"  # (a key part: the rewrite takes the constant as an operand)


def _magnitude_bound(value: np.ndarray, aval: Any) -> float | None:
    """The least of the float dtypes' largest finite values (``_CAST_LIMITS``) that bounds the
    magnitude of ``value``'s finite elements: every value under one bound is clipped, or not,
    alike by a cast to any of those dtypes. None where ``aval``'s float dtype cannot hold it."""
    finite = value[np.isfinite(value)]
    largest = float(np.abs(finite.astype(np.float64)).max()) if finite.size else 0.0
    if is_float(aval.dtype) and largest > float(jnp.finfo(aval.dtype).max):
        return None
    return next((limit for limit in _CAST_LIMITS if largest <= limit), float("inf"))


# (float16's, bfloat16's, float32's, float64's: a target with a smaller range, float8, is
# clipped in the program whatever the bound)
_CAST_LIMITS = tuple(
    sorted(float(jnp.finfo(t).max) for t in ("float16", "bfloat16", "float32", "float64"))
)


@dataclasses.dataclass(frozen=True)
class Hint:
    """What a sub-jaxpr's input is known to be at its call site (see ``Env``)."""

    source: ConstSource | None = None
    tags: frozenset = frozenset()


OPERAND = "the operand"  # a Hint's constant that the rewrite takes as its operand (_shared)


def _shared(hint: Hint | None, aval: Any) -> Hint | None:
    """``hint``, with a small constant that every value of its kind shares a rewrite for
    (``constant_key``) replaced by ``OPERAND`` and the bound its key holds."""
    if hint is None or hint.source is None:
        return hint
    key = constant_key(hint.source, aval)
    if key is None or key[0] is not ANY_VALUE:
        return hint
    return Hint(ConstSource(OPERAND, bound=key[-1]), hint.tags)


def _hint_key(hint: Hint | None) -> Any:
    if hint is None:
        return None
    return hint.tags if hint.source is None else (hint.tags, OPERAND, hint.source.bound)


# What the rules know about a value beyond its type, as Env sets: the tags of a decision's key
# (a region's, a transform's: ``Decision``) and of a region's inline call, as bits (Env.tag_bits).
DECISION_TAGS = ("lower_outputs", "expanded", "input_view", "scalar_like", "lowered", "samples")
TAG_BITS = tuple(1 << k for k in range(len(DECISION_TAGS)))

# ("lowered" is set in a region only: a body JAX traced with a value the region made 16-bit holds
# jnp's float32 promotions of it, which the rules then read through, as at the call site.)
TAGS = (
    "scalar_like",
    "lower_outputs",
    "expanded",
    "input_view",
    "cotangent",
    "lowered",
    "samples",
)
INPUT = Hint(tags=frozenset({"input_view"}))  # a function input (a parameter, a batch)

# The cache key's last part for a callee's first rewrite at given types (Rewriter.rewrite_closed).
_FIRST_REWRITE = "first rewrite"

# Primitives that only move or replicate data; a constant stays a constant through them.
SHAPE_ONLY = frozenset({"broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose"})
# Parts and joins of parameters are parameters still: a fused bias split per head or gate (a qkv
# bias sliced), biases concatenated into one (Flax's OptimizedLSTMCell's four gates'), which a
# bias add then takes as a bias (``_adapts``).
PARAMETER_PIECES = frozenset({"slice", "split", "concatenate"})

# Sums: a value they accumulate is "accumulated" (rules/powers.py), also through the primitives
# in ACCUMULATED_THROUGH (reshapes, converts) on the way there.
ACCUMULATING = frozenset({"reduce_sum", "cumsum", "psum", "psum_invariant", "reduce_scatter"})
ACCUMULATED_THROUGH = SHAPE_ONLY | {"convert_element_type", "copy", "copy_p"}

# Primitives whose params encode their operand dtypes: they always run in the traced dtypes.
KEEP_TRACED_DTYPES = frozenset(
    {
        "bitcast_convert_type",
        "reduce_precision",
        "reduce",
        "reduce_window",
        "select_and_scatter",
        "rng_bit_generator",
        # jax 0.12's typed operations (jnp.ldexp, frexp, searchsorted, nonzero) store their
        # operands' types in their params: rebound on other dtypes they declare a type they do
        # not have (an ill-typed program, whose gradient fails).
        "call_hi_primitive",
        # Host and foreign calls declare their result types (traced from the float32 program);
        # the function behind them receives what it was written for.
        "pure_callback",
        "io_callback",
        "ffi_call",
    }
)


class ParameterView:
    """A parameter (a function input, or a piece of one) seen through shape-only ops: Flax's
    ``jnp.reshape(bias, (1, 1, -1))`` before its add. Cast to a narrower dtype, it is cast as
    written by hand (``bias.astype(bf16).reshape(...)``, Flax's ``promote_dtype`` first): the
    parameter, then the shape ops again. The same numbers; in the backward pass the cast's
    transpose then meets jnp's rounding of the summed cotangent with no reshape between them,
    which XLA folds (``xla_allow_excess_precision``) as it does for hand-written bfloat16: one
    convert pair less per bias, a bias gradient summed in float32 as hand-written code gets it,
    and the optimized program of a hand-written model of the same numerics."""

    __slots__ = ("base", "value", "dtype", "steps")

    def __init__(self, base: Any, value: Any, dtype: np.dtype, steps: tuple = ()) -> None:
        self.base = base  # the parameter's variable
        self.value = value  # its value
        self.dtype = dtype  # its dtype
        self.steps = steps  # ((primitive, params), ...)

    def then(self, primitive: Any, params: dict) -> ParameterView:
        return ParameterView(self.base, self.value, self.dtype, (*self.steps, (primitive, params)))


def casts_through_view(view: ParameterView, dtype: np.dtype) -> bool:
    """Whether a cast to ``dtype`` of a value seen as ``view`` goes through it: a narrowing
    float cast (a widening one is a float32 promotion jnp asked for, cast as it comes). Callers
    do so where the cast and shape ops are staged into the program being built (under a
    differentiating parent each would be a primitive of its own to differentiate)."""
    return dtype.itemsize < view.dtype.itemsize and is_float(dtype)


class Env:
    """Values of one jaxpr's variables, their rewrite-time constants and the cast cache."""

    def __init__(self, jaxpr: Any = None) -> None:
        self.jaxpr = jaxpr
        self._accumulated: set[Any] | None = None
        self.values: dict[Any, Any] = {}
        self.known: dict[Any, ConstSource] = {}
        self.casts: dict[tuple, Any] = {}  # (var, dtype) or (var, dtype, CLIPPED) -> value
        # Broadcasts/reshapes of rank-0 values: they promote like the scalar they came from.
        self.scalar_like: set[Any] = set()
        # Outputs of lower-table ops run in the compute dtype, broadcasts that expand a smaller
        # value, and inputs/constants seen through reshapes and broadcasts only (parameters): an
        # add of the first and a parameter that is the last two is a linear layer's bias add.
        self.lower_outputs: set[Any] = set()
        self.expanded: set[Any] = set()
        self.input_view: set[Any] = set()
        self._cotangent: set[Any] | None = None
        self.cotangent_inputs: set[Any] = set()  # sub-jaxpr inputs hinted as cotangents
        # Region mode only (``Rewriter.region``, see region_trace.py): values in a 16-bit dtype
        # because of the policy, and jnp's float32 promotions of them (-> the 16-bit value).
        self.lowered: set[Any] = set()
        self.upcast_of: dict[Any, Any] = {}
        # Samples: what jax.random's samplers returned, and what was computed from those and
        # constants alone (jax.nn.initializers' scaling): they stay in the dtype asked for.
        self.samples: set[Any] = set()
        # ... and those promotions by (16-bit value, dtype), which later ones reuse (region_trace)
        self.promotions: dict[tuple[Any, np.dtype], Any] = {}
        # What a registered tracker (``register_tracker``) learned about values, by tracker name:
        # rules/softmax.py records which values are the max of which operand.
        self.facts: dict[str, dict[Any, Any]] = {}
        # The tags a decision's key and replay read and set, in the order of TAG_BITS.
        self.tag_sets = tuple(getattr(self, tag) for tag in DECISION_TAGS)
        self._sets_of_bits: dict[int, tuple[set[Any], ...]] = {}  # (add_tags's, per bits)
        # autocast_transform: per variable, its part of a decision's key (``TransformDecisions``)
        self.decision_parts: dict[Any, tuple | None] = {}
        # Parameters seen through shape ops (a bias reshaped for its add): per view, the
        # parameter's variable and value and the shape ops (``ParameterView``). None: not kept
        # (an eager region, where a cast from the parameter costs one more dispatch).
        self.views: dict[Any, ParameterView] | None = {}

    def tag_bits(self, var: Any) -> int:
        """The tags of ``var`` as bits (``TAG_BITS``, in the order of ``tag_sets``)."""
        lower_outputs, expanded, input_view, scalar_like, lowered, samples = self.tag_sets
        return (
            (var in lower_outputs)
            | (var in expanded) << 1
            | (var in input_view) << 2
            | (var in scalar_like) << 3
            | (var in lowered) << 4
            | (var in samples) << 5
        )

    def set_output_facts(
        self, out_facts: tuple, invars: Sequence[Any], outvars: Sequence[Any]
    ) -> None:
        """What trackers learned of a replayed operation's outputs (``Decision.out_facts``), set
        again: output ``k``'s fact is operand ``j`` (``("in", j)``), operand ``j``'s own
        (``("of", j)``) or a value (``("is", fact)``: a ``FactValue``)."""
        for name, k, (how, j) in out_facts:
            known = self.facts.setdefault(name, {})
            known[outvars[k]] = invars[j] if how == "in" else j if how == "is" else known[invars[j]]

    def add_tags(self, var: Any, bits: int) -> None:
        if bits:
            sets = self._sets_of_bits.get(bits)
            if sets is None:
                sets = self._sets_of_bits[bits] = tuple(
                    tagged for bit, tagged in zip(TAG_BITS, self.tag_sets) if bits & bit
                )
            for tagged in sets:
                tagged.add(var)

    def has_fact(self, var: Any) -> bool:
        """Whether a tracker knows something of ``var`` (a softmax's max: rules/softmax.py)."""
        for facts in self.facts.values():  # (a loop, not any() of a generator: asked per operand)
            if var in facts:
                return True
        return False

    @property
    def cotangent(self) -> set[Any]:
        """Values the backward pass computed (outputs of transposed equations, sub-jaxpr inputs
        that receive one, and what is computed from those: inside a loop body of the backward
        pass the equations carry no transpose name of their own): float8 scales them to the
        gradient format (jamp/fp8.py), ``Policy.reduce_dtype`` widens the products they enter.
        Found on the first question, so other policies never pay for the walk."""
        if self._cotangent is None:
            found = set(self.cotangent_inputs)
            # Only a backward loop body (inputs hinted as cotangents) follows its cotangents
            # through untransposed equations. In a program that merely contains a backward pass
            # (a train step), a value computed from a gradient (``w - lr * g``) is a primal: the
            # matmul that reads it is a forward one (e4m3fn, not widened by reduce_dtype).
            follow = bool(self.cotangent_inputs)
            for eqn in self.jaxpr.eqns if self.jaxpr is not None else ():
                if "transpose" in compat.transform_names(eqn) or (
                    follow and any(isinstance(v, compat.Var) and v in found for v in eqn.invars)
                ):
                    found.update(eqn.outvars)
            found.update(_backward_seeds(self.jaxpr) if self.jaxpr is not None else ())
            self._cotangent = found
        return self._cotangent

    def accumulated(self, var: Any) -> bool:
        """Whether ``var`` is summed later in this jaxpr (computed once, on the first question)."""
        if self._accumulated is None:
            summed: set[Any] = set()
            for eqn in reversed(self.jaxpr.eqns if self.jaxpr is not None else ()):
                name = eqn.primitive.name
                if name in ACCUMULATING or (
                    name in ACCUMULATED_THROUGH and any(v in summed for v in eqn.outvars)
                ):
                    summed.update(v for v in eqn.invars if isinstance(v, compat.Var))
            self._accumulated = summed
        return var in self._accumulated

    def summed_result(self, step: Step) -> bool:
        """Whether the (first) result of ``step``'s equation is summed later (rules/powers.py: a
        square runs in float32 where it is)."""
        return self.accumulated(step.eqn.outvars[0])

    def read(self, atom: Any) -> Any:
        return atom.val if isinstance(atom, compat.Literal) else self.values[atom]

    def source(self, atom: Any) -> ConstSource | None:
        if isinstance(atom, compat.Literal):
            return ConstSource(atom.val)
        return self.known.get(atom)


def _backward_seeds(jaxpr: Any) -> set[Any]:
    """The seeds of a backward pass (``jax.grad``'s 1.0): values computed here from constants
    alone (no input, no closed-over array reaches them) that only transposed equations read.
    Cotangents too, so that a transposed call given one directly (the whole loss in one
    ``shard_map``) follows it through its body, whose equations carry no transpose name. (A
    constant a forward equation also reads, such as ``jnp.eye``, is not one.)"""
    reached = set(jaxpr.invars) | set(jaxpr.constvars)
    made: set[Any] = set()  # computed here from constants alone
    read_forward: set[Any] = set()
    read_backward: set[Any] = set()
    for eqn in jaxpr.eqns:
        operands = [v for v in eqn.invars if isinstance(v, compat.Var)]
        if any(v in reached for v in operands):
            reached.update(eqn.outvars)
        else:
            made.update(eqn.outvars)
        transposed = "transpose" in compat.transform_names(eqn)
        (read_backward if transposed else read_forward).update(operands)
    return (made & read_backward) - read_forward - reached


class Step:
    """One equation being rewritten: what a rule sees."""

    def __init__(self, rewriter: Rewriter, env: Env, eqn: Any, state: RegionState):
        self.rewriter, self.env, self.eqn, self.state = rewriter, env, eqn, state
        self.args: list[Any] = [env.read(v) for v in eqn.invars]
        # In a region, an operand that is jnp's float32 promotion of a lowered value arrives as
        # that value, traced as float32, as it does under autocast_transform (region_trace.py).
        self.substituted = False
        if env.upcast_of:
            for i, atom in enumerate(eqn.invars):
                original = env.upcast_of.get(atom) if isinstance(atom, compat.Var) else None
                if original is not None:
                    env.casts.setdefault((atom, F32), self.args[i])
                    self.args[i], self.substituted = original, True
        self.bound_args: Sequence[Any] = self.args
        # The format a scaled lower-table op computed in (float8), for jamp.explain's FLOPs:
        # its bound operands are the dequantized values XLA folds into the float8 GEMM.
        self.flop_dtype: np.dtype | None = None
        # Why a scaled-format rule let a lower-table op run in the value dtype instead (shown
        # by jamp.explain), e.g. "min_float8_flops".
        self.scaled_skip: str | None = None
        # Why a rule ran the op in float32 where its table would not have (jamp.explain).
        self.why: str | None = None
        # Whether ``bind`` staged the equation directly (``compat.stage_like``) rather than bound it.
        self.staged = False
        # Operands the rule computed rather than cast, and how (``derive``).
        self.derived: dict[int, Callable[[Env, Sequence[Any], Sequence[Any]], Any]] = {}

    @property
    def policy(self) -> Policy:
        return self.rewriter.policy

    @property
    def params(self) -> dict[str, Any]:
        return self.eqn.params

    def traced_aval(self, i: int) -> Any:
        return self.eqn.invars[i].aval

    def program_aval(self, i: int) -> Any:
        """Operand ``i``'s type in the program as written: as traced, or, for an equation of a
        callee's jaxpr that a region walks, that jaxpr's (the policy may have changed the
        region's values upstream in the callee)."""
        avals = getattr(self.eqn, "program_avals", None)
        return avals[i] if avals is not None else self.eqn.invars[i].aval

    def aval(self, i: int) -> Any:
        """The aval operand ``i`` arrives with (literals keep their weak type)."""
        atom = self.eqn.invars[i]
        if isinstance(atom, compat.Literal) and self.args[i] is atom.val:
            return atom.aval
        return compat.aval_of(self.args[i])

    def avals(self) -> list[Any]:
        return [self.aval(i) for i in range(len(self.args))]

    def as_traced(self) -> None:
        """Where autocast is off (a disabled region, a rule of ``None``) the program runs as it
        was traced: an operand that arrives narrower than its traced dtype (a bfloat16
        activation traced as float32) is cast back to it. The program cannot say otherwise:
        ``x.astype(jnp.float32)`` of a value traced as float32 (Flax's LayerNorm statistics, a
        float32 head) left nothing in it, so without this its ops ran in bfloat16, less precise
        than with autocast on."""
        for i in self.floating():
            arrived, traced = self.aval(i).dtype, self.traced_aval(i).dtype
            if arrived != traced and arrived.itemsize < traced.itemsize:
                self.args[i] = self.cast(i, traced)

    def floating(self) -> list[int]:
        """Indices of operands that were traced with a floating dtype (float64 included)."""
        return [
            i
            for i, v in enumerate(self.eqn.invars)
            if hasattr(v.aval, "dtype") and is_float(v.aval.dtype)
        ]

    def has_tag(self, i: int, tag: str) -> bool:
        """Whether operand ``i`` is in one of the Env's derived sets (``scalar_like``, ...)."""
        atom = self.eqn.invars[i]
        return isinstance(atom, compat.Var) and atom in getattr(self.env, tag)

    def hints(self) -> list[Hint]:
        """For each operand, what a sub-jaxpr receiving it should know (constant, tags)."""
        return [
            Hint(self.env.source(v), frozenset(t for t in TAGS if self.has_tag(i, t)))
            for i, v in enumerate(self.eqn.invars)
        ]

    def cast(self, i: int, dtype: Any) -> Any:
        """Operand ``i`` in ``dtype``: converted once per program, constants cast at rewrite time."""
        dtype = np.dtype(dtype)
        if self.aval(i).dtype == dtype:
            return self.args[i]
        atom = self.eqn.invars[i]
        key = (atom, dtype) if isinstance(atom, compat.Var) else None
        if key is not None and key in self.env.casts:
            return self.env.casts[key]
        source = self.env.source(atom)
        out = None
        views = self.env.views
        view = (
            views.get(atom) if views and key is not None and self.rewriter.casts_views() else None
        )
        if view is not None and casts_through_view(view, dtype):
            out = self._cast_view(view, dtype)
        elif source is None and self.rewriter.staging is not None:
            out = compat.stage_convert(self.eqn, self.args[i], dtype, self.rewriter.staging)
        if out is None:
            with compat.equation_context(self.eqn):
                out = (
                    source.cast(dtype)
                    if source is not None
                    else compat.convert_now(self.args[i], dtype)
                )
        if key is not None:
            self.env.casts[key] = out
        if self.rewriter.recorder is not None:
            self.rewriter.recorder.cast(constant=source is not None)
        return out

    def _cast_view(self, view: ParameterView, dtype: np.dtype) -> Any:
        """A view of a parameter cast as its parameter (once, through the cast cache), then its
        shape ops applied again (``ParameterView``), staged where they can be."""
        staging, eqn, casts = self.rewriter.staging, self.eqn, self.env.casts
        linearizing = self.rewriter.linearizing
        key = (view.base, dtype)
        value = casts.get(key)
        if value is None:
            if staging is not None:
                value = compat.stage_convert(eqn, view.value, dtype, staging)
            if value is None:
                with compat.equation_context(eqn):
                    if linearizing is not None:
                        value = compat.convert_to_linearize(linearizing, view.value, dtype)
                    if value is None:
                        value = compat.convert_now(view.value, dtype)
            casts[key] = value
        for primitive, params in view.steps:
            out = None
            if staging is not None:
                out = compat.stage_shape_op(eqn, primitive, value, params, staging)
            if out is None:
                with compat.equation_context(eqn):
                    out = self._bind_now(primitive, [value], params)[0]
            value = out
        return value

    def with_cast(self, targets: dict[int, Any]) -> list[Any]:
        """All operands, those in ``targets`` cast to the given dtype."""
        return [self.cast(i, targets[i]) if i in targets else a for i, a in enumerate(self.args)]

    def with_adapting_cast(self, targets: dict[int, Any]) -> list[Any]:
        """``with_cast`` for operands made to agree (``equalize_targets``): one that adapts to a
        format of a smaller range (float32 to float16 or float8: an additive attention mask
        taken for a bias) has its finite values clipped to it, as constants do: ``-1e9`` where
        masked is -65504, not -inf, so a fully masked row is no NaN (torch would promote the
        add to float32). inf stays inf (a loss scale's overflow must still show)."""
        return [
            a
            if i not in targets
            else self.clipped_cast(i, targets[i])
            if _narrows_range(self.aval(i).dtype, targets[i])
            and self.env.source(self.eqn.invars[i]) is None
            else self.cast(i, targets[i])
            for i, a in enumerate(self.args)
        ]

    def derive(
        self,
        i: int,
        how: Callable[[Env, Sequence[Any], Sequence[Any]], Any],
        args: Sequence[Any],
    ) -> Any:
        """Operand ``i`` computed by ``how(env, invars, args)`` rather than cast, from what the
        operation's key fixes (its operands' types, tags and facts; ``args``: the operands after
        the rule's casts): a replay computes it again so, after its casts (``Decision.again``)."""
        value = how(self.env, self.eqn.invars, args)
        self.derived[i] = how
        return value

    def clipped_cast(self, i: int, dtype: Any) -> Any:
        """Operand ``i`` (a computed value or an input) in ``dtype``, finite values clipped to
        its range; once per program, as ``cast``."""
        dtype = np.dtype(dtype)
        atom = self.eqn.invars[i]
        key = (atom, dtype, CLIPPED) if isinstance(atom, compat.Var) else None
        if key is not None and key in self.env.casts:
            return self.env.casts[key]
        with compat.equation_context(self.eqn):
            out = saturating_cast(self.args[i], dtype)
        if key is not None:
            self.env.casts[key] = out
        if self.rewriter.recorder is not None:
            self.rewriter.recorder.cast(constant=False)
        return out

    def bind(self, args: Sequence[Any], **overrides: Any) -> list[Any]:
        self.bound_args = args  # what the primitive finally ran on (read by jamp.explain)
        if self.rewriter.staging is not None:
            staged = compat.stage_like(
                self.eqn,
                args,
                {**self.eqn.params, **overrides} if overrides else None,
                self.rewriter.staging,
            )
            if staged is not None:
                self.staged = True
                return staged
        params = compat.bind_params(self.eqn)
        params.update(overrides)
        # (asked only under jax.grad: a region's equations have no effects to ask)
        linearizable = self.rewriter.linearizing is not None and not self.eqn.effects
        with compat.equation_context(self.eqn):
            return self._bind_now(self.eqn.primitive, args, params, linearizable)

    def _bind_now(
        self, primitive: Any, args: Sequence[Any], params: dict, linearizable: bool = True
    ) -> list[Any]:
        """``primitive`` bound on ``args`` under the current context; under ``jax.grad`` (and
        ``linearizable``: no effects) as a jitted call, whose linearization JAX reuses
        (``compat.bind_to_linearize``)."""
        linearizing = self.rewriter.linearizing
        if linearizing is not None and linearizable:
            outs = compat.bind_to_linearize(linearizing, primitive, args, params)
            if outs is not None:
                return outs
        out = primitive.bind(*args, **params)
        return list(out) if primitive.multiple_results else [out]

    def rewrite_sub(
        self, closed: Any, avals: Sequence[Any], hints: Sequence[Hint | None] = ()
    ) -> Any:
        """Rewrite a sub-jaxpr under this equation's region, for the operand avals given."""
        return self.rewriter.rewrite_closed(closed, avals, self.state, hints)

    def run_sub(
        self, closed: Any, args: Sequence[Any], hints: Sequence[Hint | None] = ()
    ) -> list[Any]:
        """Evaluate a sub-jaxpr inline under this equation's region (for pure call wrappers)."""
        jaxpr, consts = compat.open_and_consts(closed)
        return self.rewriter.child(self.state).run(jaxpr, consts, args, hints)


@dataclasses.dataclass(frozen=True)
class Decision:
    """What a rule did with one operation, replayable for the same key: the operands it cast
    (index, dtype), the parameters it changed, and its outputs' types as traced and tags."""

    casts: tuple  # (operand, dtype, clipped: Step.clipped_cast)
    overrides: dict
    out_avals: tuple
    out_tags: tuple
    # The operands the rule read as the 16-bit values they are jnp's promotions of (``Step``),
    # and whether output 0 is such a promotion of operand 0 (a convert: ``_track_lowered``).
    read_through: tuple = ()
    promotes: bool = False
    # Whether output 0 is a 16-bit square kept to be recomputed in float32 (``LazySquare``).
    square: bool = False
    # Whether output 0 is a shape op of a parameter (``ParameterView``), set again by a replay.
    view: bool = False
    # Operands a rule computed from the others rather than cast (``Step.derive``), made again by
    # a replay after the casts: (operand, derive(env, invars, args) -> its value).
    again: tuple = ()
    # autocast_transform's: per output, its part of the keys of the equations reading it
    # (``TransformDecisions.operand_part``), None for a dropped one.
    out_parts: tuple = ()
    # What trackers learned of the outputs (``TransformDecisions.output_facts``), set again by a
    # replay: (tracker, output, ("in", j): operand j, or ("of", j): what they knew of it).
    out_facts: tuple = ()
    # (output, tags) of the outputs with tags, which a replay sets: from ``out_tags``
    tagged: tuple = dataclasses.field(init=False, repr=False, compare=False)
    # The abstract evaluation of the operation as a replay stages it (``compat.bind_on``'s
    # ``evaluated``), made at the first replay: the key fixes its operand types and parameters.
    evaluated: list = dataclasses.field(default_factory=list, repr=False, compare=False)

    def __post_init__(self) -> None:
        # (a field, not a cached property: writing an instance's __dict__ makes every attribute
        # read of it slower, and a replay reads several)
        tagged = tuple((i, bits) for i, bits in enumerate(self.out_tags) if bits)
        object.__setattr__(self, "tagged", tagged)


class RecordingStep(Step):
    """A :class:`Step` that records its casts and binds, so that a rule that cast some operands
    and bound the operation once can be replayed (:class:`Decision`) without running the rule
    again: by ``autocast_transform``'s rewrite (:meth:`traced_decision`) and a region's
    (``region_trace.RegionRecordingStep``)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.arrived = tuple(self.args)  # (before ``as_traced`` casts any)
        # id(cast value) -> {operand: (dtype, clipped)}
        self.casts_made: dict[int, dict[int, tuple[np.dtype, bool]]] = {}
        self.binds: list[tuple[list, dict, list]] = []

    def cast(self, i: int, dtype: Any) -> Any:
        out = super().cast(i, dtype)
        self.casts_made.setdefault(id(out), {})[i] = (np.dtype(dtype), False)
        return out

    def clipped_cast(self, i: int, dtype: Any) -> Any:
        out = super().clipped_cast(i, dtype)
        self.casts_made.setdefault(id(out), {})[i] = (np.dtype(dtype), True)
        return out

    def bind(self, args: Sequence[Any], **overrides: Any) -> list[Any]:
        outs = super().bind(args, **overrides)
        self.binds.append((list(args), overrides, outs))
        return outs

    def bound_once(
        self, returned: Sequence[Any], operands: Sequence[Any]
    ) -> tuple[list, dict, list, tuple] | None:
        """What the rule did, where a decision can say it: ``(args, overrides, outputs, casts)``
        of its one bind, which returned ``returned``, each of ``args`` either the operand in
        ``operands``, a cast of it (``casts``: (operand, dtype, clipped)) or derived from the
        others (``Step.derive``: ``self.derived``); else None."""
        if len(self.binds) != 1:
            return None
        args, overrides, outs = self.binds[0]
        if len(outs) != len(returned) or any(a is not b for a, b in zip(outs, returned)):
            return None
        casts = []
        for j, arg in enumerate(args):
            if arg is operands[j] or j in self.derived:
                continue
            made = self.casts_made.get(id(arg), {}).get(j)
            if made is None:
                return None
            casts.append((j, *made))
        return args, overrides, outs, tuple(casts)

    def traced_decision(
        self, returned: Sequence[Any], decisions: TransformDecisions
    ) -> Decision | None:
        """The decision of a traced equation (its rule has run, and ``track_derived``), or None
        where it cannot be replayed: the rule bound more or other than the equation on its
        operands, some cast (float8's scaling, reduce_dtype's custom_vjp), or an output is more
        than its tags and facts say (a constant, a tracker's fact of a value the equation does
        not read)."""
        bound = self.bound_once(returned, self.arrived)
        if bound is None:
            return None
        args, overrides, outs, casts = bound
        env = self.env
        tags: list[int] = []
        parts: list[tuple | None] = []
        for var in self.eqn.outvars:
            if isinstance(var, compat.DropVar):
                tags.append(0)
                parts.append(None)
                continue
            part = decisions.operand_part(env, var)
            if part is None:
                return None
            tags.append(part[2])
            parts.append(part)
        out_facts: tuple = ()
        if any(part is not None and len(part) > 3 for part in parts):  # (WITH_FACTS)
            facts = decisions.output_facts(env, self.eqn)
            if facts is None:
                return None
            out_facts = facts
        # (the output types, where it was staged directly: a replay stages it so again)
        out_avals = tuple(compat.aval_of(x) for x in outs) if self.staged else ()
        return Decision(
            casts,
            overrides,
            out_avals,
            tuple(tags),
            view=is_parameter_view(env, self.eqn),
            out_parts=tuple(parts),
            out_facts=out_facts,
            again=tuple(self.derived.items()),
        )


class Rewriter:
    """Evaluates jaxprs under one policy, starting from one region state."""

    def __init__(
        self,
        policy: Policy,
        state: RegionState,
        rewritten: MutableMapping[Any, Any] | None = None,
        recorder: Any = None,
        scope_log: ScopeLog | None = None,
        active: list[Env] | None = None,
        region: int = 0,
        states: dict[tuple[str, ...], RegionState] | None = None,
    ):
        self.policy = policy
        # Rewriting for a jamp.autocast region (region_trace.py) rather than a transform: how
        # many regions enclose the one carrying the policy, itself included (0: a transform).
        self.region = region
        self.base = state
        self.recorder = recorder  # report.Recorder for jamp.explain, else None
        # Scope paths entered anywhere in this program, for the rules that matched none of them;
        # the rewriter that creates the log (the top-level one) reports those when it finishes.
        self._owns_scope_log = scope_log is None
        self.scope_log = ScopeLog() if scope_log is None else scope_log
        # The state under each tuple of scope names, from ``state``; a region passes one kept
        # across its policy's regions (the states are the same; entering a scope costs a glob
        # match per rule).
        self._states: dict[tuple[str, ...], RegionState] = {} if states is None else states
        # '@file:line' rules need each equation's frames: looked up only when the policy has one.
        self.line_rules = any(is_line_rule(glob) for glob, _ in policy.rules)
        # Sub-jaxprs already rewritten in this program, shared with child rewriters: jnp's
        # jitted helpers (`_where`, ...) recur with the same avals many times in a model.
        # (Not while recording: a report counts every occurrence.)
        self._rewritten = {} if rewritten is None else rewritten
        # Environments of the jaxprs being evaluated (outermost first), shared with children.
        self._active: list[Env] = [] if active is None else active
        # What rules decided at a source site (scope path and line), which the equations JAX
        # derives from it (its transposes in a ``jax.grad`` program) share; shared with children.
        self.site_decisions: dict[tuple, Any] = {}
        # How many times the program rewritten here runs per call (a scan body: its length),
        # for the reports' FLOP and byte counts (jamp.explain, jamp.tune).
        self.repeats = 1
        # current_state's last answer, by JAX's source-info context it was asked under (an
        # immutable object, the same while no scope is entered or left: consecutive operations
        # of a region mostly share it).
        self._last_state: tuple[Any, RegionState | None] = (None, None)
        # state_for's answers by name stack (the stack kept: its id is not reused meanwhile)
        self._stack_states: dict[int, tuple[Any, RegionState]] = {}
        # The program ``run`` binds into, where equations traced in its context are staged
        # directly (``compat.staging_target``, ``compat.stage_like``); None where each is bound
        # (eagerly, under vmap) and outside ``run``.
        self.staging: compat.StagingTarget | None = None
        # The linearize trace (jax.grad of a function calling autocast_transform) ``run`` binds
        # into, where its operations are bound as jitted calls (``compat.bind_to_linearize``);
        # None elsewhere and for a region (whose routing hands it the operations of jax.grad).
        self.linearizing: Any = None
        # An eager region's own rewriter: a call's small constant operands key its rewrite by
        # what the rules read of them, not their values (constant_key, rewrite_closed).
        self.shares_constants = False
        # autocast_transform's decisions per signature (``TransformDecisions``), shared with children:
        # a model's blocks repeat their equations, which are then decided once. None where each
        # equation is decided (a region's walks, which replay their own; a report, which counts
        # every one; reduce_dtype, whose rules read the program's backward pass).
        self._decisions: TransformDecisions | None = (
            TransformDecisions.of(policy)
            if region == 0 and recorder is None and policy.reduce_dtype is None
            else None
        )
        if states is None and self._decisions is not None and not policy.rules:
            # (a model's scopes recur in every program traced under the policy; without module
            # rules, entering one logs nothing that a report reads)
            self._states = self._decisions.states_under(state)

    def child(self, state: RegionState, repeats: int = 1) -> Rewriter:
        """A rewriter for a sub-jaxpr entered under ``state``, sharing cache and recorder; the
        sub-jaxpr runs ``repeats`` times each time this one's program runs."""
        sub = Rewriter(
            self.policy,
            state,
            self._rewritten,
            self.recorder,
            self.scope_log,
            self._active,
            self.region,
        )
        sub.site_decisions = self.site_decisions
        sub._decisions = self._decisions
        sub.repeats = self.repeats * repeats
        return sub

    def outer_value(self, value: Any) -> Any:
        """``value``, or, for a tracer of the user's finished trace (closed over by a custom
        derivative rule), the value its variable has in a jaxpr being rewritten."""
        var = compat.traced_var(value)
        if var is not None:
            for env in reversed(self._active):
                if var in env.values:
                    return env.values[var]
        return value

    def state_for(self, eqn: Any) -> RegionState:
        stack = compat.name_stack_of(eqn)
        known = self._stack_states.get(id(stack))  # (equations traced in one scope share it)
        if known is None or known[0] is not stack:
            if len(self._stack_states) > 4096:  # (a region's, open over many programs)
                self._stack_states.clear()
            known = self._stack_states[id(stack)] = (
                stack,
                self.state_for_scopes(compat.scope_names(eqn)),
            )
        state = known[1]
        return self._at_lines(state, eqn.source_info) if self.line_rules else state

    def current_state(self) -> RegionState:
        """The state of an operation bound now (the region front end, region_trace.py)."""
        context = compat.SOURCE_INFO_NOW.context
        last, state = self._last_state
        if context is not last or state is None:
            state = self.state_for_scopes(compat.scope_names_in(context.name_stack))
            self._last_state = (context, state)
        return self._at_lines(state, compat.current_source_info()) if self.line_rules else state

    def _at_lines(self, state: RegionState, source_info: Any) -> RegionState:
        frames = compat.frame_lines(source_info)
        self.scope_log.add_lines(frames)
        return state.at_lines(frames, self.policy.rules, in_region=self.region)

    def state_for_scopes(self, scopes: tuple[str, ...]) -> RegionState:
        """The state under the named scopes ``scopes`` (region markers, module paths)."""
        state = self._states.get(scopes)
        if state is None:
            # from the enclosing scope's state (a model's modules share their parents' paths)
            state = self.state_for_scopes(scopes[:-1]) if scopes else self.base
            if scopes:
                state = apply_marker(scopes[-1], state) or state.enter_scope(
                    scopes[-1], self.policy.rules
                )
                self.scope_log.add(state.path)
            self._states[scopes] = state
        return state

    def rewrite_closed(
        self,
        closed: Any,
        avals: Sequence[Any],
        state: RegionState,
        hints: Sequence[Hint | None] = (),
    ) -> Any:
        key = None
        if self.shares_constants:
            hints = [_shared(h, avals[i]) for i, h in enumerate(hints)]
        if self.recorder is None and not any(
            h is not None and h.source is not None and h.source.base is not OPERAND for h in hints
        ):
            key = (closed, tuple(avals), state, tuple(_hint_key(h) for h in hints))
            if key in self._rewritten:
                return self._rewritten[key]
        jaxpr, consts = compat.open_and_consts(closed)
        sub = self.child(state)
        out = compat.trace_to_closed(lambda *args: sub.run(jaxpr, consts, args, hints), list(avals))
        if self.recorder is None:
            # Calls with other tags (a callee called on a parameter, then on its own output),
            # known constants or scopes mostly rewrite alike: the same object then, as JAX
            # lowers each jaxpr object once (plain JAX emits one function for a jit called
            # twice, and so does jamp). Compared with the callee's first rewrite at these types.
            first = (closed, tuple(avals), _FIRST_REWRITE)
            earlier = self._rewritten.get(first)
            if earlier is None:
                self._rewritten[first] = out
            elif earlier is not out and compat.same_program(earlier, out):
                out = earlier
        if key is not None:
            self._rewritten[key] = out
        return out

    def run(
        self,
        jaxpr: Any,
        consts: Sequence[Any],
        args: Sequence[Any],
        hints: Sequence[Hint | None] = (),
    ) -> list[Any]:
        env = Env(jaxpr)
        for var, value in zip(jaxpr.constvars, consts):
            value = self.outer_value(value)
            env.values[var] = value
            env.input_view.add(var)
            if is_known_value(value):
                env.known[var] = ConstSource(value)
        for i, (var, value) in enumerate(zip(jaxpr.invars, args)):
            env.values[var] = value
            hint = hints[i] if i < len(hints) else None
            if hint is not None:
                source = hint.source
                if source is not None and (source.base is OPERAND or compat.is_tracer(source.base)):
                    # (a constant the rewrite takes as an operand: cast in the program from it)
                    source = ConstSource(value, bound=source.bound)
                if source is not None:
                    env.known[var] = source
                for tag in hint.tags:
                    (env.cotangent_inputs if tag == "cotangent" else getattr(env, tag)).add(var)
        self._active.append(env)
        outer, self.staging = self.staging, compat.staging_target()
        outer_linearizing = self.linearizing
        self.linearizing = None if self.region else compat.linearizing_trace()
        try:
            decisions = self._decisions
            # (consecutive equations mostly share their name stack, and so their state)
            last_stack: Any = None
            state, state_part = self.base, None
            per_line = self.line_rules
            for eqn in jaxpr.eqns:
                stack = compat.name_stack_of(eqn)
                if stack is not last_stack or per_line:
                    state = self.state_for(eqn)
                    last_stack = stack
                    state_part = None if decisions is None else decisions.state_part(state)
                key = None
                if state_part is not None:
                    assert decisions is not None  # (only a table makes state parts)
                    key = decisions.key(env, eqn, state_part)
                if key is not None:
                    assert decisions is not None
                    try:
                        decision = decisions.table.get(key)
                    except TypeError:  # a parameter that cannot be hashed: decided every time
                        decision = key = None
                    if decision is not None:
                        outs = self._replay(env, eqn, state, decision, decisions)
                        # (a dropped output's entries are never read)
                        env.values.update(zip(eqn.outvars, outs))
                        env.decision_parts.update(zip(eqn.outvars, decision.out_parts))
                        continue
                recording = None if key is None else RecordingStep(self, env, eqn, state)
                step = Step(self, env, eqn, state) if recording is None else recording
                if not state.enabled:
                    step.as_traced()
                outs = self.apply(step)
                for var, value in zip(eqn.outvars, outs):
                    if not isinstance(var, compat.DropVar):
                        env.values[var] = value
                track_derived(step, outs)
                if recording is not None and decisions is not None and key is not None:
                    decision = recording.traced_decision(outs, decisions)
                    if decision is not None:
                        decisions.table[key] = decision
        finally:
            self._active.pop()
            self.staging = outer
            self.linearizing = outer_linearizing
        if self._owns_scope_log and self.policy.rules:
            report_unmatched_rules(self, jaxpr)
        return [env.read(v) for v in jaxpr.outvars]

    def _replay(
        self,
        env: Env,
        eqn: Any,
        state: RegionState,
        decision: Decision,
        decisions: TransformDecisions,
    ) -> Sequence[Any]:
        """Bind ``eqn`` as its rule decided an equation of the same signature before: the same
        casts (shared through the cast cache), the same parameters, the same tags on its
        outputs (``track_derived``'s, which found no more than tags)."""
        values, casts = env.values, env.casts
        args = [atom.val if type(atom) is _LITERAL else values[atom] for atom in eqn.invars]
        step = None
        cast_key: tuple
        for i, dtype, clipped in decision.casts:
            atom = eqn.invars[i]
            literal = isinstance(atom, compat.Literal)
            if literal:  # (cast on the host from its value: the same for every equal literal)
                cast_key = (constant_key(ConstSource(atom.val)), dtype, clipped)
                cast = decisions.constant_casts.get(cast_key)
            else:
                cast_key = (atom, dtype, CLIPPED) if clipped else (atom, dtype)
                cast = casts.get(cast_key)
                # (a view of a parameter: cast through the parameter, as Step.cast casts it)
                view = env.views.get(atom) if cast is None and env.views else None
                if (
                    view is not None
                    and casts_through_view(view, dtype)
                    and not clipped
                    and self.casts_views()
                ):
                    step = step or Step(self, env, eqn, state)
                    cast = casts[cast_key] = step._cast_view(view, dtype)
                if cast is None and not clipped and self.staging is not None:
                    # (an operand of a replayed equation is no constant: staged as Step.cast does)
                    cast = compat.stage_convert(eqn, args[i], dtype, self.staging)
                    if cast is not None:
                        casts[cast_key] = cast
            if cast is None:  # (the first cast of this value)
                step = step or Step(self, env, eqn, state)
                cast = step.clipped_cast(i, dtype) if clipped else step.cast(i, dtype)
                if literal and isinstance(cast, HOST_VALUES):
                    decisions.constant_casts[cast_key] = cast
            args[i] = cast
        if decision.again:
            with compat.equation_context(eqn):
                for i, derive in decision.again:
                    args[i] = derive(env, eqn.invars, args)
        outs = None
        if decision.out_avals and self.staging is not None:
            params = eqn.params
            if decision.overrides:
                params = {**params, **decision.overrides}
            outs = compat.stage_decided(eqn, args, params, decision.out_avals, self.staging)
        if outs is None:
            outs = (step or Step(self, env, eqn, state)).bind(args, **decision.overrides)
        for i, bits in decision.tagged:
            env.add_tags(eqn.outvars[i], bits)
        if decision.out_facts:
            env.set_output_facts(decision.out_facts, eqn.invars, eqn.outvars)
        if decision.view:
            note_view(env, eqn.invars[0], args[0], eqn.primitive, eqn.params, eqn.outvars[0])
        return outs

    def casts_views(self) -> bool:
        """Whether a cast of a view of a parameter goes through the parameter (``Step._cast_view``):
        in ``autocast_transform``'s rewrite staged into the program being built, or bound into
        JAX's linearize trace, where each cast and shape op is a jitted call whose linearization
        JAX reuses (``compat.bind_to_linearize``; bound as a bare primitive, each was one more
        operation to linearize: issue 33, fortieth pass). A region casts views inside the
        ``jnp`` calls that read them (``region_trace.CallRewrite``), and a view an operation of
        its own reads as it comes (staging the shape ops again would evaluate their types at
        every replay)."""
        return (self.staging is not None or self.linearizing is not None) and not self.region

    def apply(self, step: Step) -> Sequence[Any]:
        name = step.eqn.primitive.name
        rule = rewrite_rule(name) or CATEGORY_RULES.get(self.policy.category(name)) or default_rule
        try:
            outs = rule(step)
            if self.recorder is not None:
                self.recorder.equation(step, outs)
            return outs
        except (RewriteError, compat.JaxprTypeError):
            raise
        except Exception as err:
            dtypes = ", ".join(
                str(a.str_short()) if hasattr(a, "str_short") else str(a) for a in step.avals()
            )
            where = (
                f"primitive `{name}` (operands {dtypes}) traced at {compat.source_line(step.eqn)}"
            )
            if not _raised_in_jamp(err):
                # The user's code or JAX raised it (a custom rule, a shape check): it keeps its
                # type, so the caller's `except NotImplementedError:` still fires.
                note = "(raised while jamp rewrote "
                if hasattr(err, "add_note") and not any(  # add_note: Python 3.11+
                    n.startswith(note) for n in getattr(err, "__notes__", ())
                ):
                    err.add_note(f"{note}{where})")  # the innermost equation's note only
                raise
            raise RewriteError(
                f"jamp could not rewrite {where}: {type(err).__name__}: {err}"
            ) from err


_JAMP_DIR = os.path.dirname(os.path.abspath(__file__))


def _raised_in_jamp(err: BaseException) -> bool:
    """Whether the innermost frame of ``err``'s traceback is jamp's own code (a jamp bug)."""
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(
        _JAMP_DIR + os.sep
    )


class FactValue:
    """A tracker's fact that is a value of its own rather than a variable (rules/softmax.py's
    ``MaxRecipe``): hashable and holding no variable, so that a decision's key holds it as it is
    (``("is", fact)``) and a replay sets it again unchanged."""

    __slots__ = ()


Tracker = Callable[["Step", Sequence[Any]], None]
# Called with every equation and its outputs, in both front ends (the rewriter and the region):
# a rule that must know where its operands came from records it here (rules/softmax.py).
TRACKERS: list[Tracker] = []


def is_parameter_view(env: Env, eqn: Any) -> bool:
    """Whether ``eqn`` is a shape op of a floating parameter (an input, a piece of one) or of a
    view of one (``ParameterView``): what its key says (the operand's tags and type)."""
    if eqn.primitive.name not in SHAPE_ONLY:
        return False
    var_in = eqn.invars[0]
    return (
        isinstance(var_in, compat.Var)
        and var_in in env.input_view
        and var_in not in env.known
        and is_float(getattr(var_in.aval, "dtype", np.int32))
    )


def note_view(
    env: Env, var_in: Any, value: Any, primitive: Any, params: dict, out_var: Any
) -> None:
    """Remember ``out_var``, ``primitive`` (``params``: its bind parameters) of ``value``
    (``var_in``), as a view of a parameter (``is_parameter_view``), where views are kept."""
    views = env.views
    if views is None:
        return
    view = views.get(var_in)
    if view is None:
        view = ParameterView(var_in, value, np.dtype(var_in.aval.dtype))
    views[out_var] = view.then(primitive, params)


def register_tracker(tracker: Tracker) -> Tracker:
    """Register ``tracker(step, outs)``, run after every equation (see ``Env.facts``)."""
    TRACKERS.append(tracker)
    return tracker


def track_derived(step: Step, outs: Sequence[Any]) -> None:
    """Remember what later promotions need to know about this equation's outputs."""
    name, env = step.eqn.primitive.name, step.env
    for tracker in TRACKERS:
        tracker(step, outs)
    if (
        compat.calls_a_sampler(step.eqn.primitive, step.params)
        and from_samples(step, none_needed=True)
    ) or (
        env.samples and from_samples(step) and step.policy.category(name) != "lower"
    ):  # (a matmul of samples is the model's)
        outvars = step.eqn.outvars
        env.samples.update(v for v in outvars if is_float(getattr(v.aval, "dtype", np.int32)))
    if step.rewriter.region:
        _track_lowered(step, outs)
    if step.policy.category(name) == "lower" and step.state.enabled:
        env.lower_outputs.update(step.eqn.outvars)
    if name in PARAMETER_PIECES and all(
        atom in env.input_view or env.source(atom) is not None  # (a parameter, or a constant)
        for atom in step.eqn.invars
    ):
        env.input_view.update(step.eqn.outvars)
    if len(step.args) != 1 or len(outs) != 1:
        return
    atom, out_var = step.eqn.invars[0], step.eqn.outvars[0]
    var_in = atom if isinstance(atom, compat.Var) else None
    # A convert to the dtype a value already has only drops its weak type (jnp.full does this).
    same_value = name == "convert_element_type" and step.params["new_dtype"] == atom.aval.dtype
    if name == "convert_element_type" and var_in in env.input_view and _widens(atom.aval, step):
        # a 16-bit parameter promoted (Flax's promote_dtype of a bfloat16 bias, jnp's of Haiku's
        # broadcast one: a bfloat16 checkpoint run by float32 code) is the parameter still, as
        # broadcast as before: a bias add takes it as a bias
        for tag in (env.input_view, env.expanded, env.scalar_like):
            if var_in in tag:
                tag.add(out_var)
    if name in SHAPE_ONLY or same_value:
        if not atom.aval.shape or var_in in env.scalar_like:
            env.scalar_like.add(out_var)
        for tag in (env.lower_outputs, env.input_view, env.expanded):
            if var_in in tag:
                tag.add(out_var)
        if _adds_broadcast_dims(name, atom.aval, out_var.aval):
            env.expanded.add(out_var)
    source = env.source(atom)
    if source is None:
        if env.views is not None and is_parameter_view(env, step.eqn):
            eqn = step.eqn  # (a shape op binds with its equation's parameters)
            note_view(env, var_in, step.args[0], eqn.primitive, eqn.params, out_var)
        return
    if same_value:
        env.known[out_var] = source
    elif name in SHAPE_ONLY:
        env.known[out_var] = dataclasses.replace(
            source,
            steps=source.steps + ((step.eqn.primitive, compat.bind_params(step.eqn)),),
        )
    elif name == "convert_element_type" and not source.steps:
        converted = saturating_cast(source.base, step.params["new_dtype"], source.bound)
        env.known[out_var] = dataclasses.replace(source, base=converted)


def _widens(aval: Any, step: Step) -> bool:
    """Whether a convert (``step``) of a value of type ``aval`` widens one float to another."""
    new = np.dtype(step.params["new_dtype"])
    return is_float(aval.dtype) and is_float(new) and new.itemsize > aval.dtype.itemsize


SIXTEEN_BIT = frozenset({np.dtype(jnp.bfloat16), np.dtype(jnp.float16)})


def _track_lowered(step: Step, outs: Sequence[Any]) -> None:
    """Region mode: which outputs are 16-bit because of the policy (a lower-table op's, one
    computed from such a value, a call's whose traced type was wider), and which converts are
    jnp's float32 promotions of such a value (the float32 program has none: region_trace.py)."""
    env, eqn = step.env, step.eqn
    compute = step.state.value_dtype
    atom = eqn.invars[0] if eqn.invars else None
    if eqn.primitive.name == "convert_element_type" and _is_lowered(env, atom):
        new = np.dtype(eqn.params["new_dtype"])
        # (a cast the code asked for, x.astype(jnp.float32), is kept: torch's .float() sticks)
        if (
            is_float(new)
            and new.itemsize > compute.itemsize
            and not compat.traced_as_an_asked_cast(eqn)
        ):
            env.upcast_of[eqn.outvars[0]] = step.args[0]
            env.promotions.setdefault((atom, new), outs[0])  # (region_trace._promotion_of)
            if atom in env.lower_outputs:  # a matmul's output still, for the bias-add rule
                env.lower_outputs.add(eqn.outvars[0])
        return
    from_lowered = step.substituted or any(_is_lowered(env, v) for v in eqn.invars)
    is_lower = step.state.enabled and step.policy.category(eqn.primitive.name) == "lower"
    for var, value in zip(eqn.outvars, outs):
        # (getattr: an async collective's future has no dtype, and is never a 16-bit value)
        if (
            isinstance(var, compat.DropVar)
            or getattr(compat.aval_of(value), "dtype", None) != compute
        ):
            continue
        if from_lowered or is_lower or np.dtype(var.aval.dtype) != compute:
            env.lowered.add(var)


def _is_lowered(env: Env, atom: Any) -> bool:
    return isinstance(atom, compat.Var) and atom in env.lowered


def _adds_broadcast_dims(name: str, before: Any, after: Any) -> bool:
    """Whether a shape-only op spreads a value over new dimensions (a bias reshaped to
    ``(1, features)`` and broadcast over a batch), whatever the sizes of those dimensions: a
    batch of one must not change what counts as a bias."""
    if name == "broadcast_in_dim":  # sizes may be symbolic (a polymorphic export's batch)
        return compat.generic_size(before.size) < compat.generic_size(after.size) or (
            before.ndim < after.ndim
        )
    if name in ("reshape", "expand_dims") and before.ndim < after.ndim:
        # only unit dimensions added: (4,) -> (1, 4), not (4,) -> (2, 2)
        return [d for d in after.shape if d != 1] == [d for d in before.shape if d != 1]
    return False


# --- category rules --------------------------------------------------------------------------


def lower_rule(step: Step) -> Sequence[Any]:
    """Matmul/conv: floating operands and output in the compute dtype.

    Where autocast is off (a region, a rule) or a float64 or complex operand is involved (the
    product is computed in that type: narrowing its other operands would only round them), the
    op runs in the dtypes its operands arrive in, made to agree, and returns the wider of that
    and its traced output type:
    a ``@jamp.autocast(cast_inputs=jnp.float32)`` function given bfloat16 returns float32, and a
    value traced as float32 keeps returning float32 (``x.astype(jnp.float32)`` of a float32 value
    leaves nothing in the program, so the traced type is all that records it).
    """
    floating = step.floating()
    avals = step.avals()
    if not step.state.enabled or not floating or any(_computes_wide(a) for a in avals):
        args = step.with_cast(equalize_targets(step))
        arrived = [compat.aval_of(args[i]).dtype for i in floating]
        traced = step.params.get("preferred_element_type")
        if not arrived or traced is None:
            return step.bind(args)
        return step.bind(args, **_output_type(step, widest(traced, *arrived)))
    accepted = algorithm_operand_dtypes(step.params.get("precision"))
    if accepted is not None and step.state.value_dtype not in accepted:
        # An explicit dot algorithm (``precision=lax.DotAlgorithmPreset.F32_F32_F32``) names
        # the operand types it computes in, and XLA converts other operands to them: cast to
        # the policy's dtype, they would be rounded and then computed in the algorithm's types
        # anyway. The program's choice is kept: operands in a type it accepts, output as traced.
        args = step.with_cast({i: accepted[0] for i in floating if avals[i].dtype not in accepted})
        return step.bind(args)
    scaled = SCALED_FORMATS.get(step.state.dtype)
    outs = scaled(step) if scaled is not None else None
    if outs is not None:
        return outs
    dtype = step.state.value_dtype
    args = step.with_cast({i: dtype for i in floating})
    return bind_lower(step, args, **_output_type(step, step.policy.accumulate_for(dtype)))


def _computes_wide(aval: Any) -> bool:
    """A float64 or complex operand: a matmul or convolution with one computes in its type."""
    dtype = getattr(aval, "dtype", None)
    return dtype is not None and (dtype == F64 or getattr(dtype, "kind", None) == "c")


def algorithm_operand_dtypes(precision: Any) -> tuple[np.dtype, ...] | None:
    """The operand dtypes an explicit dot algorithm computes in (a ``lax.DotAlgorithmPreset``
    such as ``F32_F32_F32``, or a ``lax.DotAlgorithm``), None where ``precision`` names none
    (``Precision.HIGHEST``, ``DEFAULT``, the float8 presets: any operand type)."""
    if isinstance(precision, jax.lax.DotAlgorithm):
        return (np.dtype(precision.lhs_precision_type),)
    types = getattr(precision, "supported_lhs_types", None)  # (a DotAlgorithmPreset)
    return tuple(np.dtype(t) for t in types) if types else None


def bind_lower(step: Step, args: Sequence[Any], **overrides: Any) -> list[Any]:
    """Bind a lower-table op on its cast operands. Under ``Policy.reduce_dtype`` its backward
    products accumulate in that dtype (reduce_dtype.py); a product that *is* a backward one (an
    operand is a cotangent of an ``autocast_transform(jax.grad(f))`` program) outputs it."""
    reduce = reduce_dtype_for(step)
    if reduce is None:
        return step.bind(args, **overrides)
    if any(step.has_tag(i, "cotangent") for i in range(len(args))):
        return step.bind(args, **{**overrides, "preferred_element_type": reduce})
    step.bound_args = args
    params = compat.bind_params(step.eqn)
    params.update(overrides)
    with compat.equation_context(step.eqn):
        return [reduce_dtype.bind(step.eqn.primitive, params, step.args, args, reduce)]


def reduce_dtype_for(step: Step) -> np.dtype | None:
    """``Policy.reduce_dtype`` where it widens this op's backward products: a convolution or a
    dot_general without batch dimensions (the products whose contracting dimension is the
    batch: a weight's gradient), every operand floating (an integer operand has no cotangent)
    and narrower than it. Batched products (attention's ``q @ k``, per example and head) keep
    the compute dtype: their cotangents are not summed across a data-parallel mesh, and XLA's
    CPU runtime cannot run some batched bfloat16 x bfloat16 = float32 dots ("Unsupported
    element type for DotThunk")."""
    reduce = step.policy.reduce_dtype
    name = step.eqn.primitive.name
    if reduce is None or name not in ("dot_general", "conv_general_dilated"):
        return None
    if name == "dot_general" and any(step.params["dimension_numbers"][1]):
        return None
    if len(step.floating()) != len(step.args) or step.state.value_dtype.itemsize >= reduce.itemsize:
        return None
    return reduce


# Compute dtypes whose lower-table ops run on scaled operands (jamp/fp8.py registers float8):
# dtype -> rule returning the outputs, or None where the op does not qualify (it then runs in the
# state's value dtype).
SCALED_FORMATS: dict[np.dtype, Callable[[Step], Sequence[Any] | None]] = {}


def matmul_flops(eqn: Any) -> int:
    """FLOPs (2 per multiply-add) of a dot_general, ragged dot or convolution equation, from its
    traced shapes; a symbolic size (a polymorphic export's batch) counts at its generic value,
    so that comparing FLOPs with a threshold is never inconclusive."""
    lhs, rhs = (v.aval for v in eqn.invars[:2])
    size = compat.generic_size
    out = size(eqn.outvars[0].aval.size)
    if eqn.primitive.name == "conv_general_dilated":
        out_features_dim = eqn.params["dimension_numbers"].rhs_spec[0]
        return 2 * out * size(rhs.size) // max(size(rhs.shape[out_features_dim]), 1)
    numbers = eqn.params.get("dimension_numbers") or eqn.params["ragged_dot_dimension_numbers"]
    contracting = getattr(numbers, "dot_dimension_numbers", numbers)[0][0]
    return 2 * out * math.prod(size(lhs.shape[d]) for d in contracting)


def _output_type(step: Step, dtype: Any) -> dict[str, Any]:
    """The ``preferred_element_type`` override making a lower-table op return ``dtype``.

    One the program set explicitly (different from its traced operands' type: an int8 matmul
    accumulating in int32, a bf16 dot asking for float32) is kept.
    """
    traced = step.params.get("preferred_element_type")
    if traced is None:
        return {}
    natural = widest(*(step.program_aval(i).dtype for i in step.floating()))
    explicit = np.dtype(traced) != natural
    return {"preferred_element_type": traced if explicit else np.dtype(dtype)}


# Reductions that jnp runs in a 16-bit dtype only where ``dtype=`` names it (``jnp.sum``,
# ``prod``, ``mean``: it converts a 16-bit input up to float32 first otherwise): torch's ``sum``
# and ``prod`` keep a dtype given to them under autocast (its fp32_append_dtype ops), so do
# these. (jnp's ``cumsum`` and ``cumprod`` run a 16-bit input in its dtype with no ``dtype=``:
# there the program does not say whether one was named, and the fp32 table decides.)
DTYPE_NAMING_REDUCTIONS = frozenset({"reduce_sum", "reduce_prod"})


def reduction_may_name_its_dtype(program_aval: Any) -> bool:
    """Whether ``reduces_in_the_dtype_asked`` reads where a reduction was traced (not only its
    operand and parameters): its operand is 16-bit in the program. A region keys such a
    reduction's decision by where it was traced as well (region_trace._READS_MORE)."""
    return getattr(program_aval, "dtype", None) in SIXTEEN_BIT


def reduces_in_the_dtype_asked(step: Step) -> bool:
    """``jnp.sum(x, dtype=jnp.bfloat16)`` (``prod``, ``mean``, ``nansum``...): a reduction
    that ``jnp`` traced on a 16-bit operand, which it does only where ``dtype=`` names the
    16-bit dtype. A ``lax.reduce_sum`` of a 16-bit value traced elsewhere (your code, a
    transpose of a broadcast) names nothing: it runs in float32 as the fp32 table says."""
    return (
        step.eqn.primitive.name in DTYPE_NAMING_REDUCTIONS
        and reduction_may_name_its_dtype(step.program_aval(0))
        and compat.traced_in_jnp_reduction(step.eqn)
    )


def fp32_rule(step: Step) -> Sequence[Any]:
    """Numerically sensitive op: floating operands in float32 (float64 stays float64).

    In a state with ``keep_compute_dtype`` (derivative rules of a custom-derivative call that
    returns the compute dtype) an op whose operands all arrive in the compute dtype still computes
    in float32 but returns the compute dtype.
    """
    state = step.state
    if not state.enabled:
        return default_rule(step)
    avals = step.avals()
    targets = {i: F32 for i in step.floating() if avals[i].dtype not in (F32, F64)}
    if any(avals[i].dtype == F64 for i in step.floating()):
        return equalize_rule(step)
    if from_samples(step):  # (an initializer's erf_inv of a uniform sample: jax 0.12's normal)
        return default_rule(step)
    if reduces_in_the_dtype_asked(step):  # (its operand may arrive without jnp's cast to it)
        asked = step.program_aval(0).dtype
        return step.bind(step.with_cast({0: asked} if avals[0].dtype != asked else {}))
    outs = step.bind(step.with_cast(targets))
    if state.keep_compute_dtype and in_compute_dtype(step):
        with compat.equation_context(step.eqn):
            outs = [
                compat.convert(x, state.value_dtype) if compat.aval_of(x).dtype == F32 else x
                for x in outs
            ]
    return outs


def from_samples(step: Step, none_needed: bool = False) -> bool:
    """Whether the floating operands are samples (``Env.samples``) and constants, one at least
    a sample (none needed: a sampler's operands): a sampler's arithmetic, which runs in the
    dtype the sample was asked in. A model value among them (``uniform(key, s, d, h, h + 1)``)
    is not."""
    env, sample = step.env, none_needed
    if not (env.samples or none_needed):
        return False
    for i in step.floating():
        atom = step.eqn.invars[i]
        if isinstance(atom, compat.Var) and atom in env.samples:
            sample = True
        elif not (isinstance(atom, compat.Literal) or env.source(atom) is not None):
            return False
    return sample


def is_scalar_like(step: Step, i: int) -> bool:
    """Operand ``i`` is a weakly typed, rank-0 or broadcast scalar (it adapts in promotions)."""
    aval = step.aval(i)
    return getattr(aval, "weak_type", False) or aval.ndim == 0 or step.has_tag(i, "scalar_like")


def in_compute_dtype(step: Step) -> bool:
    """Whether the floating operands arrive in the (narrower than float32) compute dtype.

    Scalar-like operands do not count; at least one other floating operand must exist.
    """
    dtype = step.state.value_dtype
    operands = [step.aval(i) for i in step.floating() if not is_scalar_like(step, i)]
    return dtype != F32 and bool(operands) and all(a.dtype == dtype for a in operands)


# torch's linear/addmm/conv include the bias; JAX adds it with a separate `add`.
BIAS_EPILOGUE = frozenset({"add"})


def _adapts(step: Step, i: int, aval: Any, members: Sequence[int]) -> bool:
    """Whether operand ``i`` takes the dtype of the others rather than widening them."""
    if aval.dtype == F64:
        return False
    if is_scalar_like(step, i):
        return True
    # A bias is a parameter (an input or constant, maybe reshaped) broadcast over the batch:
    # fewer elements than the output, or spread over new (batch) dimensions, even ones of size 1.
    # A full-size operand (a residual) or a computed one (a reduction) promotes; so does a bias
    # under vmap, where no batch dimension is visible.
    bias_like = step.has_tag(i, "input_view") and (
        compat.generic_size(aval.size) < compat.generic_size(step.eqn.outvars[0].aval.size)
        or step.has_tag(i, "expanded")
    )
    return (
        step.eqn.primitive.name in BIAS_EPILOGUE
        and step.state.enabled  # (disabled: no casts, so the bias add promotes as JAX's)
        and bias_like
        and any(step.has_tag(j, "lower_outputs") for j in members if j != i)
    )


def equalize_targets(step: Step, fixed: Sequence[int] = ()) -> dict[int, np.dtype]:
    """Operands traced with one floating dtype must agree again: cast them to the widest of them.

    Operands that adapt (weakly typed, rank-0 and broadcast scalars, like zero-dim tensors in
    PyTorch's promotion; a bias added to a matmul/conv output, which torch's linear and conv
    include) take the dtype of the others, unless every operand of the group adapts; the
    operands in ``fixed`` never adapt (a scatter's buffer). float64 is never narrowed.
    """
    floating = step.floating()
    if len(floating) < 2:
        return {}  # (most operations: nothing to agree with)
    groups: dict[Any, list[int]] = {}
    for i in floating:
        # A region binds each operation as it comes: the operands JAX's own rules (a JVP, a
        # transpose) combine must agree whatever the policy made of them, so they form one group.
        key = "region" if step.rewriter.region else np.dtype(step.traced_aval(i).dtype)
        groups.setdefault(key, []).append(i)
    targets: dict[int, np.dtype] = {}
    for members in groups.values():
        if len(members) < 2:
            continue
        avals = {i: step.aval(i) for i in members}
        if len({a.dtype for a in avals.values()}) == 1:
            continue
        strong = [
            a.dtype for i, a in avals.items() if i in fixed or not _adapts(step, i, a, members)
        ]
        target = widest(*(strong or [a.dtype for a in avals.values()]))
        targets.update({i: np.dtype(target) for i in members if avals[i].dtype != target})
    return targets


def equalize_rule(step: Step) -> Sequence[Any]:
    """Promote: mixed floating operands run in the widest; scalars and weak constants adapt."""
    return step.bind(step.with_adapting_cast(equalize_targets(step)))


def traced_dtype_operands(step: Step) -> list[Any]:
    """The operands with every floating one cast back to the dtype it was traced with."""
    avals = step.avals()
    targets = {
        i: step.traced_aval(i).dtype
        for i in step.floating()
        if avals[i].dtype != step.traced_aval(i).dtype
    }
    return step.with_cast(targets)


def keep_traced_rule(step: Step) -> Sequence[Any]:
    """Run in the traced dtypes: floating operands are cast back to what was traced."""
    return step.bind(traced_dtype_operands(step))


_warned: set[str] = set()


def default_rule(step: Step) -> Sequence[Any]:
    """Everything else runs in the dtypes its inputs arrive in (made to agree where they must)."""
    name = step.eqn.primitive.name
    if name in KEEP_TRACED_DTYPES:
        return keep_traced_rule(step)
    if carries_programs(step.eqn.primitive, step.params):
        if name not in _warned:
            _warned.add(name)
            warnings.warn(
                f"jamp has no rule for the higher-order primitive `{name}` (traced at "
                f"{compat.source_line(step.eqn)}): it runs unchanged in its traced dtypes. "
                "Register one with jamp.interpreter.register.",
                UnsupportedPrimitiveWarning,
                stacklevel=2,
            )
        return keep_traced_rule(step)
    return equalize_rule(step)


_CARRIES_PROGRAMS: dict[Any, bool] = {}


def carries_programs(primitive: Any, params: dict[str, Any]) -> bool:
    """Whether the primitive's equations carry jaxprs: looked at once per primitive (a region
    asks for every bind, the default rule for every equation it takes)."""
    known = _CARRIES_PROGRAMS.get(primitive)
    if known is None:
        known = _CARRIES_PROGRAMS[primitive] = has_subprograms(params)
    return known


def has_subprograms(params: dict[str, Any]) -> bool:
    return any(_holds_program(v) for v in params.values())


def _holds_program(value: Any) -> bool:
    # (not a closure inside has_subprograms: a recursive one is a reference cycle per call)
    if isinstance(value, (tuple, list)):
        return any(_holds_program(v) for v in value)
    return compat.is_jaxpr_like(value)


@register("convert_element_type")
def convert_rule(step: Step) -> Sequence[Any]:
    """A convert runs as the program says, except in a region, where two of jnp's are left
    out: the rounding of a reduction's float32 result back to a 16-bit input's dtype (the result
    stays float32, as the fp32 table and torch say and as ``autocast_transform`` gives it), and
    the convert that ends jnp's contractions (``tensordot``, ``dot``, ``matmul``), which gives a
    matmul's product the dtype its operands would: the product keeps the dtype the policy gave
    it, as ``x @ w`` and ``autocast_transform`` give it (in the program as traced that convert
    converts nothing)."""
    if step.rewriter.region and (
        _rounds_reduction_result(step) or _converts_a_contraction_result(step)
    ):
        return [step.args[0]]
    if step.rewriter.region and step.state.enabled:
        saturated = _saturated_weak_constant(step)
        if saturated is not None:
            return [saturated]
    return default_rule(step)


def _saturated_weak_constant(step: Step) -> Any:
    """In a region, jnp's conversion of a Python number to a 16-bit operand's dtype (``-1e9`` in
    ``jnp.where(mask, logits, -1e9)``, ``h + 7e4``): saturated, as ``autocast_transform`` casts
    the constant of its float32 program, not an infinity (a fully masked row's NaN). None
    elsewhere."""
    atom = step.eqn.invars[0]
    new = np.dtype(step.params["new_dtype"])
    if not (atom.aval.weak_type and new in SIXTEEN_BIT and is_float(atom.aval.dtype)):
        return None
    source = step.env.source(atom)
    if source is None or source.steps:
        return None
    return jnp.asarray(saturating_cast(source.base, new, source.bound))


def _converts_a_contraction_result(step: Step) -> bool:
    return (
        step.state.enabled
        and step.has_tag(0, "lower_outputs")
        and convert_may_end_a_contraction(step.params, step.avals())
        and compat.traced_in_jnp_contraction(step.eqn)
    )


def _rounds_reduction_result(step: Step) -> bool:
    return (
        step.state.enabled
        and step.policy.category("reduce_sum") == "fp32"  # (a policy without: jnp's rounding)
        and convert_may_round_a_reduction(step.params, step.avals())
        and compat.traced_in_jnp_reduction(step.eqn)
    )


def convert_may_end_a_contraction(params: dict[str, Any], avals: Sequence[Any]) -> bool:
    """Whether ``convert_rule`` reads where a convert was traced to tell jnp's contraction
    convert: a floating value converted to another floating dtype."""
    new = np.dtype(params["new_dtype"])
    return is_float(avals[0].dtype) and is_float(new) and new != avals[0].dtype


def convert_may_round_a_reduction(params: dict[str, Any], avals: Sequence[Any]) -> bool:
    """Whether ``convert_rule`` reads where a convert was traced (not only its operand and
    parameters): a float32 value converted to a 16-bit dtype. A region keys such a convert's
    decision by where it was traced as well (region_trace._READS_MORE)."""
    return np.dtype(params["new_dtype"]) in SIXTEEN_BIT and avals[0].dtype == F32


CATEGORY_RULES: dict[str | None, Rule] = {
    "lower": lower_rule,
    "fp32": fp32_rule,
    "promote": equalize_rule,
}


# --- autocast_transform's decisions, made once per signature ---------------------------------

_TRANSFORM_DECISIONS: dict[Policy, TransformDecisions] = {}
_UNSEEN: tuple = ("unseen",)  # (a variable without a part yet: a sentinel of the parts' type)
# The last item of an operand's part of a key where a tracker knows something of it
# (``TransformDecisions.operand_part``).
WITH_FACTS = "with facts"


def _summed_square(env: Env, eqn: Any) -> bool:
    """rules/powers.py: whether a square is summed later (looked ahead in the program)."""
    if eqn.primitive.name == "mul" and eqn.invars[0] is not eqn.invars[1]:
        return False
    return env.accumulated(eqn.outvars[0])


def _reduction_names_its_dtype(env: Env, eqn: Any) -> bool:
    """``fp32_rule``: whether a reduction of a 16-bit operand was traced in jnp's, which names
    its dtype (``reduces_in_the_dtype_asked``)."""
    return reduction_may_name_its_dtype(eqn.invars[0].aval) and compat.traced_in_jnp_reduction(eqn)


# What a rule reads of a traced equation besides its primitive, parameters, operands and state,
# by primitive: (env, equation) -> a part of the decision's key (``TransformDecisions.key``).
TRACED_READS_MORE: dict[str, Callable[[Env, Any], Any]] = {
    "square": _summed_square,
    "integer_pow": _summed_square,
    "mul": _summed_square,
    **dict.fromkeys(DTYPE_NAMING_REDUCTIONS, _reduction_names_its_dtype),
}


_LITERAL = compat.Literal  # (an equation's literal operand: exactly this type, never a subclass)


class TransformDecisions:
    """autocast_transform's decisions per signature under one policy, kept across programs: a
    model's blocks repeat their equations, which are then decided once and replayed, and so
    does the next function traced under the policy."""

    _KEPT = 8192  # signatures; a table past it starts again (new shapes every trace)

    def __init__(self) -> None:
        self.table: dict[tuple, Decision] = {}
        # Literals cast at rewrite time, by value, dtype and clipping (host values: shared).
        self.constant_casts: dict[tuple, Any] = {}
        # Operand types as small ints: a key compares them without JAX's Python ``__eq__``.
        # (Numbered by a counter, whose ``next`` no other thread can interleave: two types
        # never share a number.)
        self._types: dict[Any, int] = {}
        self._numbers = itertools.count()
        # The state under each tuple of scope names, per state they are entered from
        # (``Rewriter.state_for_scopes``), for policies without module rules.
        self._states: dict[RegionState, dict[tuple[str, ...], RegionState]] = {}

    @classmethod
    def of(cls, policy: Policy) -> TransformDecisions:
        decisions = _TRANSFORM_DECISIONS.get(policy)
        if decisions is None or decisions._full():
            decisions = _TRANSFORM_DECISIONS[policy] = cls()
        return decisions

    def _full(self) -> bool:
        return max(len(self.table), len(self._types), len(self._states)) > self._KEPT

    def states_under(self, base: RegionState) -> dict[tuple[str, ...], RegionState]:
        """The states under scope names entered from ``base``, kept across programs."""
        states = self._states.get(base)
        if states is None or len(states) > self._KEPT:
            states = self._states[base] = {}
        return states

    def type_id(self, aval: Any) -> int:
        found = self._types.get(aval)
        if found is None:
            found = self._types.setdefault(aval, next(self._numbers))
        return found

    def operand_part(self, env: Env, var: Any) -> tuple | None:
        """``var``'s part of a key: its type as traced and as it arrives, its tags, and
        ``WITH_FACTS`` where a tracker knows something of it (what, relative to the operands
        of the equation reading it, is keyed per equation: ``facts_part``); None where the
        rewrite knows it as a constant. Found once per variable (its tags and facts are set by
        the equation that made it), and copied from the decision of a replayed equation that
        made it."""
        parts = env.decision_parts
        if var in parts:
            return parts[var]
        part: tuple | None = None
        if var not in env.known:
            type_id = self.type_id
            part = (type_id(var.aval), type_id(compat.aval_of(env.values[var])), env.tag_bits(var))
            if env.has_fact(var):
                part += (WITH_FACTS,)
        parts[var] = part
        return part

    @staticmethod
    def facts_part(env: Env, invars: Sequence[Any]) -> tuple:
        """What the trackers know of an equation's operands, in terms of its operands (the
        fact of operand ``i`` is operand ``j``: ``("in", j)``), or of the first operand whose
        fact is the same value (``("as", j)``), or a fact that is a value (``("is", fact)``):
        all a rule can compare of them."""
        found: list[tuple] = []
        for name, known in env.facts.items():
            targets: list[Any] = []
            for i, atom in enumerate(invars):
                target = known.get(atom) if isinstance(atom, compat.Var) else None
                targets.append(target)
                if target is None:
                    continue
                if isinstance(target, FactValue):
                    found.append((name, i, ("is", target)))
                    continue
                where = next((("in", j) for j, v in enumerate(invars) if v is target), None)
                if where is None:
                    where = ("as", next(j for j, t in enumerate(targets) if t is target))
                found.append((name, i, where))
        return tuple(found)

    @staticmethod
    def output_facts(env: Env, eqn: Any) -> tuple | None:
        """What the trackers learned of an equation's outputs, in terms of its operands: the
        operand ``j`` (``("in", j)``), what they knew of it (``("of", j)``) or a value
        (``("is", fact)``); None where a fact is of another variable."""
        found: list[tuple] = []
        invars = eqn.invars
        for name, known in env.facts.items():
            for k, var in enumerate(eqn.outvars):
                target = known.get(var)
                if target is None:
                    continue
                if isinstance(target, FactValue):
                    found.append((name, k, ("is", target)))
                    continue
                where = next((("in", j) for j, v in enumerate(invars) if v is target), None)
                if where is None:
                    where = next(
                        (
                            ("of", j)
                            for j, v in enumerate(invars)
                            if isinstance(v, compat.Var) and known.get(v) is target
                        ),
                        None,
                    )
                if where is None:
                    return None
                found.append((name, k, where))
        return tuple(found)

    def literal_part(self, literal: Any) -> tuple | None:
        """A literal operand's part of a key: its type and value (``constant_key``'s), None
        where its value is not keyed."""
        value = literal.val
        if compat.is_rank0_array(value):
            # (a traced scalar, jax.literals' TypedNdArray: keyed by its bytes, no copy made)
            return self.type_id(literal.aval), type(value), value.tobytes()
        constant = constant_key(ConstSource(value))
        return None if constant is None else (self.type_id(literal.aval), constant)

    @staticmethod
    def state_part(state: RegionState) -> tuple | None:
        """What of the state the rules read, as part of a key; None under a scaled format
        (float8 shares decisions per source site: decided every time)."""
        if state.dtype in SCALED_FORMATS:
            return None
        return state.enabled, state.dtype, state.keep_compute_dtype

    def key(self, env: Env, eqn: Any, state_part: tuple) -> tuple | None:
        """Everything a rule reads of one traced equation: the primitive, its parameters, what
        of the state the rules read (``state_part``), per operand its part (``operand_part``; a
        literal: its type and value, which a rule casts), which operands are the same value,
        what trackers know of them (``facts_part``) and what else the rule reads
        (``TRACED_READS_MORE``). None where it is decided every time: an equation carrying
        programs or with effects, an operand the rewrite knows as a constant."""
        primitive, params = eqn.primitive, eqn.params
        carries = _CARRIES_PROGRAMS.get(primitive)  # (carries_programs, asked per equation)
        if carries is None:
            carries = carries_programs(primitive, params)
        if carries or eqn.effects:
            return None
        key: list[Any] = [primitive, state_part, tuple(params.items())]
        reads_more = TRACED_READS_MORE.get(primitive.name)
        if reads_more is not None:
            key.append(reads_more(env, eqn))
        invars, parts = eqn.invars, env.decision_parts
        with_facts = False
        for atom in invars:
            if type(atom) is _LITERAL:
                constant = self.literal_part(atom)
                if constant is None:
                    return None
                key.append(constant)
                continue
            found = parts.get(atom, _UNSEEN)
            part = self.operand_part(env, atom) if found is _UNSEEN else found
            if part is None:
                return None
            key.append(part)
            if len(part) > 3:  # (WITH_FACTS)
                with_facts = True
        if len(invars) > 1 and (
            invars[0] is invars[1] if len(invars) == 2 else len(set(map(id, invars))) < len(invars)
        ):
            # the same value twice (``x * x`` is a square to rules/powers.py): which operands are
            key.append(tuple(next(j for j, u in enumerate(invars) if u is v) for v in invars))
        if with_facts:
            key.append(self.facts_part(env, invars))
        return tuple(key)
