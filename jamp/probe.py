"""Instrumented evaluation of the program that actually runs, for ``find_nonfinite`` and
``value_ranges``.

The program is ``autocast_transform(fn, policy)`` (or its ``jax.value_and_grad``, so backward
equations are there too), traced once to a jaxpr. A :class:`Walker` evaluates that jaxpr equation
by equation and hands every leaf equation's outputs to an *observer*, which folds them into a
small state (a flag, maxima, counts). How it enters the programs a primitive carries comes from
the engine's one rule registry (``interpreter.RULES``; the walks sit beside the rewrite rules in
``rules/``): scan/while/cond bodies are rebuilt with ``lax`` and thread the state through their
carries; jit, remat and custom-derivative bodies are entered inline; ``shard_map`` and the other
primitives registered opaque run whole, as one site. Under
``jax.jit`` this is one compiled pass; under ``jax.disable_jit()`` the same walk runs op by op
(loops become Python loops), which is how a failure is drilled down to concrete operands.

Leaf equations are *sites*, numbered in program order (cond branches one after another); the
numbering depends only on the jaxpr, so every trace of a body gets the same numbers. The policy
decision of a site comes from the interpreter's own region logic (``Rewriter.state_for``) and
``Policy.category``, not from a copy of it.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import types
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _compat as compat
from .call_args import (
    CallSignature,
    check_traceable,
    split_leaves,
    static_key,
    unmarked,
)
from .interpreter import Rewriter, is_float, walk_rules
from .loss_scale import _diff_state_type
from .policy import Policy, RegionState

# XLA may otherwise keep a chain of 16-bit ops in float32 inside a fusion (CPUs do): the check
# must see every op round to its dtype, as the program says and as op-by-op execution does.
EXACT_ROUNDING: dict[str, str | bool] = {"xla_allow_excess_precision": False}
SIXTEEN_BIT = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class Site:
    """One leaf equation of the checked program, with where and why it ran as it did."""

    index: int
    eqn: Any
    jaxpr: Any  # the (open) jaxpr holding it, to follow its operands back
    state: RegionState
    loops: tuple[str, ...]  # primitives of the enclosing loops, outermost first
    backward: bool
    # the higher-order equations (jit, scan, ...) it sits in, outermost first: an equation of
    # jnp's own jitted helpers (`jnp.where`'s `_where`) has no user frame, its call has
    enclosing: tuple = ()
    # whether an operand may hold an infinity the program wrote itself (a -inf mask: a
    # non-finite literal or constant, or a value computed from one); see made_nonfinite
    deliberate_nonfinite: bool = False

    @property
    def primitive(self) -> str:
        return self.eqn.primitive.name

    @property
    def out_dtype(self) -> np.dtype | None:
        dtypes = [  # (not a PRNG key's: an extended dtype is no numpy one)
            np.dtype(v.aval.dtype)
            for v in self.eqn.outvars
            if hasattr(v.aval, "dtype")
            and not jax.dtypes.issubdtype(v.aval.dtype, jax.dtypes.extended)
        ]
        floating = [d for d in dtypes if is_float(d)]
        return (floating or dtypes or [None])[0]

    @property
    def floating(self) -> bool:
        return any(hasattr(v.aval, "dtype") and is_float(v.aval.dtype) for v in self.eqn.outvars)

    @property
    def sixteen_bit(self) -> bool:
        return self.out_dtype in SIXTEEN_BIT

    @functools.cached_property  # (read per site, and per pair of sites by forward_site)
    def traced_from(self) -> Any:
        """The equation whose source info says where this one came from: itself, or where it was
        traced inside JAX's own code, the nearest enclosing call traced from user code."""
        for eqn in (self.eqn, *reversed(self.enclosing)):
            if compat.user_frames(eqn):
                return eqn
        return self.eqn

    @property
    def frames(self) -> list[tuple[str, int, str]]:
        """``(file, line, function)`` of the user frames it was traced from, innermost first."""
        return compat.user_frames(self.traced_from)

    @property
    def source(self) -> str:
        return compat.source_line(self.traced_from)

    @property
    def caller(self) -> str | None:
        """The innermost frame in the user's own code (outside installed libraries and jamp),
        when ``source`` is in a library (a Flax or Haiku layer)."""
        frames = self.frames
        own = [f for f in frames if not _is_library(f[0])]
        if not frames or not own or own[0] == frames[0]:
            return None
        file, line, function = own[0]
        return f"{file}:{line} ({function})"

    @property
    def scope(self) -> str:
        return "/".join(self.state.path)


_JAMP_DIR = os.path.dirname(os.path.abspath(__file__))


def _is_library(file: str) -> bool:
    return (
        "site-packages" in file
        or "dist-packages" in file
        or os.path.abspath(file).startswith(_JAMP_DIR)
    )


# --- the program ------------------------------------------------------------------------------


@dataclasses.dataclass
class Program:
    """``fn`` under ``policy`` on one argument structure, traced to a closed jaxpr.

    Its first input is a float32 loss scale (1.0 for the plain call): under ``grad`` the loss is
    multiplied by it before differentiating, so a loss-scale remedy is checked without retracing.
    """

    policy: Policy
    closed: Any
    argnums: tuple[int, ...] | None
    n_sites: int
    depth: int
    compiled: dict = dataclasses.field(default_factory=dict)  # observer kind -> jitted check

    def run(self, observer: Observer, leaves: Sequence[Any], scale: float = 1.0) -> Any:
        """The observer's final state after one compiled pass (cached per observer kind)."""
        entry = self.compiled.get(observer.kind)
        if entry is None:
            walker = Walker(self.policy, observer, self.depth)
            jaxpr, consts = compat.open_and_consts(self.closed)

            def instrumented(scale_arg: Any, *flat: Any) -> Any:
                state = observer.init(self.n_sites, self.depth)
                return walker.run(jaxpr, consts, [scale_arg, *flat], state)[1]

            executable = (
                jax.jit(instrumented)
                .lower(np.float32(scale), *leaves)
                .compile(compiler_options=EXACT_ROUNDING)
            )
            entry = self.compiled[observer.kind] = (executable, walker)
        executable, _ = entry
        return executable(np.float32(scale), *leaves)

    def sites(self, observer_kind: str) -> dict[int, Site]:
        return self.compiled[observer_kind][1].sites

    def walk_eagerly(self, observer: Observer, leaves: Sequence[Any], scale: float = 1.0) -> Walker:
        """Op by op, loops as Python loops: the observer sees concrete values."""
        walker = Walker(self.policy, observer, self.depth)
        jaxpr, consts = compat.open_and_consts(self.closed)
        with jax.disable_jit():
            walker.run(jaxpr, consts, [np.float32(scale), *leaves], None)
        return walker


def normalize_argnums(grad: Any) -> tuple[int, ...] | None:
    if grad is False or grad is None:
        return None
    if grad is True:
        return (0,)
    if isinstance(grad, int):
        return (grad,)
    if isinstance(grad, (tuple, list)) and all(isinstance(i, int) for i in grad):
        return tuple(grad)
    hint = (
        " (an NNX module passed as it is differentiates its floating state; its RNG counters "
        "get no gradient: grad=True or its index)"
        if isinstance(grad, _diff_state_type())
        else ""
    )
    raise TypeError(
        f"grad must be False, True, an argument index or a tuple of them, got {grad!r}{hint}"
    )


# Checked programs per function, policy, grad, argument structure and avals, static leaves and
# JAX's trace context. A program holds the arrays its function closes over as constants, so the
# function is held weakly (_function_key) and its programs go when the caller drops it.
_PROGRAMS: dict[Any, Program] = {}
_MAX_PROGRAMS = 16


class _SameObject(weakref.ref):
    """A weak reference equal to another only while both reach the same object, as Python
    compares bound methods' ``__self__`` (an object equal by value is another method's owner)."""

    __slots__ = ("_id",)
    _id: int

    def __new__(cls, obj: Any, callback: Callable | None = None) -> _SameObject:
        self = super().__new__(cls, obj, callback)
        self._id = id(obj)
        return self

    def __hash__(self) -> int:
        return hash(self._id)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _SameObject):
            return NotImplemented
        target = self()
        return self is other or (target is not None and target is other())


def _forget_programs(dead: weakref.ref) -> None:
    """A function with cached programs (or a bound method's object or function) died."""
    for key in list(_PROGRAMS):  # (a copy: a collection may run another such callback meanwhile)
        if any(part is dead for part in key[0]):
            _PROGRAMS.pop(key, None)


def _function_key(fn: Callable) -> tuple | None:
    """``fn``'s part of a program's cache key, held weakly and equal as Python compares ``fn``; a
    bound method, a new object at every attribute access, by its object and its function. None
    where it cannot be weakly referenced: such a function's programs are not cached."""
    try:
        if isinstance(fn, types.MethodType):
            return (
                _SameObject(fn.__self__, _forget_programs),
                weakref.ref(fn.__func__, _forget_programs),
            )
        return (weakref.ref(fn, _forget_programs),)
    except TypeError:
        return None


def trace_program(
    fn: Callable, policy: Policy, grad: Any, args: tuple, kwargs: dict, caller: str
) -> tuple[Program, list[Any]]:
    """The checked program for this call (cached on fn, policy, grad, the argument avals and
    JAX's trace context), and the call's array leaves to run it on."""
    from .transform import autocast_transform

    if not callable(fn):
        raise TypeError(f"{caller} expects a callable, got {type(fn).__name__}")
    argnums = normalize_argnums(grad)
    # A jax.jit-wrapped fn's static arguments stay Python values (single static leaves here).
    signature = CallSignature.of(fn, label=caller)
    flat, in_tree = jax.tree.flatten(signature.mark_static(args, kwargs))
    # A token argument stays a static leaf: the checked program runs with array inputs only.
    traced_at, static = split_leaves(
        flat, in_tree, None, numbers_are_static=False, tokens_are_static=True
    )
    leaves = [flat[i] for i in traced_at]
    check_traceable(flat, in_tree, traced_at, signature, signature.where)
    avals = tuple(compat.aval_of(x) for x in leaves)
    _check_inputs_finite(flat, in_tree, traced_at, caller)
    if argnums is not None and max(argnums) >= len(args):
        raise ValueError(
            f"{caller}: grad={grad!r} names argument {max(argnums)} but "
            f"{getattr(fn, '__name__', 'fn')} was given {len(args)} positional ones"
        )
    function = _function_key(fn)
    try:
        # (JAX's trace context too: x64, matmul precision, a region's state change the program)
        context = compat.trace_context()
        key = (function, policy, argnums, in_tree, avals, static_key(static), context)
        hash(key)
    except TypeError:
        key = None
    if function is None:
        key = None
    program = _PROGRAMS.get(key) if key is not None else None
    if program is not None:
        return program, leaves
    mixed = autocast_transform(fn, policy)

    def call(scale: Any, *traced_leaves: Any) -> Any:
        full = list(flat)
        for i, leaf in zip(traced_at, traced_leaves):
            full[i] = leaf
        call_args, call_kwargs = unmarked(*jax.tree.unflatten(in_tree, full))
        if argnums is None:
            return mixed(*call_args, **call_kwargs)

        def scaled(*a: Any) -> Any:
            loss = mixed(*a, **call_kwargs)
            if not (hasattr(loss, "shape") and loss.shape == ()):  # (a (loss, aux) pair, say)
                shown = (
                    f"{loss.dtype}{list(loss.shape)} array"
                    if hasattr(loss, "shape")
                    else type(loss).__name__
                    + (f" of {len(loss)}" if isinstance(loss, (tuple, list)) else "")
                )
                name = getattr(fn, "__name__", "fn")
                hint = (
                    f". For a (loss, aux) pair pass lambda *args: {name}(*args)[0]"
                    if isinstance(loss, (tuple, list))
                    else ""
                )
                raise TypeError(
                    f"{caller}: grad={grad!r} differentiates {name}'s output, which must be a "
                    f"scalar loss; it returned a {shown}{hint}"
                )
            return loss * scale

        # (integer leaves, an NNX module's RNG counters, get float0 gradients, as under tune)
        return jax.value_and_grad(scaled, argnums, allow_int=True)(*call_args)

    closed = jax.make_jaxpr(call)(jax.ShapeDtypeStruct((), np.float32), *avals)
    n_sites, depth = count_sites(compat.open_and_consts(closed)[0])
    program = Program(policy, closed, argnums, n_sites, depth)
    if key is not None:
        if len(_PROGRAMS) >= _MAX_PROGRAMS:
            _PROGRAMS.pop(list(_PROGRAMS)[0], None)
        _PROGRAMS[key] = program
    return program, leaves


def _check_inputs_finite(flat: list[Any], in_tree: Any, traced_at: list[int], caller: str) -> None:
    """A non-finite argument would be blamed on the first equation reading it: name it instead."""
    floating = [i for i in traced_at if is_float(compat.aval_of(flat[i]).dtype)]
    if not floating:
        return
    finite = np.asarray(_all_finite_each(*[flat[i] for i in floating]))
    bad = [i for i, ok in zip(floating, finite) if not ok]
    if bad:
        paths = jax.tree_util.tree_flatten_with_path(jax.tree.unflatten(in_tree, flat))[0]
        names = ", ".join(_argument_name(paths[i][0]) for i in bad)
        raise ValueError(
            f"{caller}: argument {names} already holds inf or NaN before the function runs"
        )


@jax.jit
def _all_finite_each(*leaves: Any) -> Any:
    return jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])


def _argument_name(path: tuple) -> str:
    """``args[0]['params']['w']`` for a leaf of ``(args, kwargs)``."""
    where, *rest = path
    head = "args" if getattr(where, "idx", None) == 0 else "kwargs"
    return head + jax.tree_util.keystr(tuple(rest))


# --- higher-order equations: how to count and walk their bodies ---------------------------------


def _per_jaxpr(compute: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``compute(jaxpr)``, remembered while the jaxpr lives: a jaxpr holds its function's
    constants (from jax 0.12 on), which a cache keyed on it strongly would keep alive."""
    results: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()

    @functools.wraps(compute)
    def cached(jaxpr: Any) -> Any:
        try:
            return results[jaxpr]
        except KeyError:
            pass
        except TypeError:  # (a jaxpr that cannot be weakly referenced)
            return compute(jaxpr)
        result = results[jaxpr] = compute(jaxpr)
        return result

    return cached


@_per_jaxpr
def _count_cached(jaxpr: Any) -> tuple[int, int]:
    sites, depth = 0, 0
    for eqn in jaxpr.eqns:
        kind = walk_rules(eqn.primitive.name)
        if kind is None:
            sites += 1
            continue
        for body in kind.bodies(eqn):  # type: ignore[misc]  # set with every walk
            n, d = _count_cached(body)
            sites += n
            depth = max(depth, d + int(kind.loop))
    return sites, depth


def count_sites(jaxpr: Any) -> tuple[int, int]:
    """(number of leaf equations, deepest loop nesting) of a jaxpr, bodies included."""
    return _count_cached(jaxpr)


class Walker:
    """Evaluates a jaxpr under the current trace, feeding each site's outputs to an observer."""

    def __init__(self, policy: Policy, observer: Observer, depth: int):
        self.policy, self.observer, self.depth = policy, observer, depth
        self.sites: dict[int, Site] = {}
        self._primal: dict[int, Any] = {}  # id(traceback) -> first non-cast equation traced there

    def is_derivative(self, eqn: Any) -> bool:
        """Backward (transposed) equations, and the JVP rule's own computations (``0.5 / sqrt(x)``
        for ``sqrt``): under ``jvp`` every equation a primitive's rule adds after the primitive
        itself shares its traceback."""
        transforms = compat.transform_names(eqn)
        if "transpose" in transforms:
            return True
        if "jvp" not in transforms or eqn.primitive.name == "convert_element_type":
            return False
        primal = self._primal.setdefault(id(compat.traceback_of(eqn)), eqn)
        return primal is not eqn and primal.primitive is not eqn.primitive

    def run(
        self,
        jaxpr: Any,
        consts: Sequence[Any],
        args: Sequence[Any],
        state: Any,
        base: int = 0,
        iters: tuple = (),
        loops: tuple = (),
        backward: bool = False,
        regions: Rewriter | None = None,
        enclosing: tuple = (),
        deliberate_args: bool = False,
    ) -> tuple[list[Any], Any]:
        regions = regions or Rewriter(self.policy, RegionState(True, self.policy.compute_dtype))
        env: dict[Any, Any] = {}
        read = lambda a: a.val if isinstance(a, compat.Literal) else env[a]
        env.update(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, args))
        # Variables that may hold an infinity the program wrote itself (made_nonfinite): its
        # non-finite constants and what is computed from them; all of a body's arguments where
        # its call passes one in or the body writes one (a loop carries it round).
        deliberate = {v for v, c in zip(jaxpr.constvars, consts) if _nonfinite_value(c)}
        if deliberate_args:
            deliberate.update(jaxpr.invars)
        passes_on = lambda eqn, a: (
            _writes_literal(eqn, a) if isinstance(a, compat.Literal) else a in deliberate
        )
        index = base
        # Measures of the sites since the last fold: folded in one batch (one reduction over a
        # stack, not a chain of hundreds of scalar updates, which compiles much faster).
        pending: list[tuple[Site, Any]] = []

        def fold(state: Any) -> Any:
            if pending:
                state = self.observer.fold(
                    state, [s for s, _ in pending], [m for _, m in pending], self.pad(iters)
                )
                pending.clear()
            return state

        for eqn in jaxpr.eqns:
            invals = [read(v) for v in eqn.invars]
            kind = walk_rules(eqn.primitive.name)
            is_backward = backward or self.is_derivative(eqn)
            fed = any(passes_on(eqn, v) for v in eqn.invars)
            if kind is not None:
                fed = fed or _writes_nonfinite(eqn)
                state = fold(state)  # earlier sites first: the body's fold comes after them
                ctx = Context(
                    self,
                    eqn,
                    index,
                    iters,
                    loops,
                    is_backward,
                    regions.child(regions.state_for(eqn)),
                    enclosing,
                    fed,
                )
                outs, state = kind.walk(ctx, invals, state)  # type: ignore[misc]
                index += sum(count_sites(b)[0] for b in kind.bodies(eqn))  # type: ignore[misc]
            else:
                outs = bind(eqn, invals)
                site = Site(
                    index, eqn, jaxpr, regions.state_for(eqn), loops, is_backward, enclosing, fed
                )
                self.sites[index] = site
                if site.floating:
                    measure = self.observer.measure(site, invals, outs, self.pad(iters))
                    if measure is not None:
                        pending.append((site, measure))
                index += 1
            for var, value in zip(eqn.outvars, outs):
                if not isinstance(var, compat.DropVar):
                    env[var] = value
                    if fed and hasattr(var.aval, "dtype") and is_float(var.aval.dtype):
                        deliberate.add(var)  # (not a comparison's booleans)
        return [read(v) for v in jaxpr.outvars], fold(state)

    def pad(self, iters: tuple) -> tuple:
        return tuple(iters) + (0,) * (self.depth - len(iters))


def bind(eqn: Any, invals: Sequence[Any]) -> list[Any]:
    with compat.equation_context(eqn):
        out = eqn.primitive.bind(*invals, **compat.bind_params(eqn))
    return list(out) if eqn.primitive.multiple_results else [out]


@dataclasses.dataclass
class Context:
    """A higher-order equation being walked."""

    walker: Walker
    eqn: Any
    base: int
    iters: tuple
    loops: tuple
    backward: bool
    regions: Rewriter
    enclosing: tuple  # the higher-order equations around this one, outermost first
    deliberate_args: bool  # its bodies' arguments may hold an infinity the program wrote

    def run(
        self, closed: Any, args: Sequence[Any], state: Any, offset: int = 0, iteration: Any = None
    ) -> tuple[list[Any], Any]:
        jaxpr, consts = compat.open_and_consts(compat.as_closed(closed))
        looped = iteration is not None
        return self.walker.run(
            jaxpr,
            consts,
            args,
            state,
            self.base + offset,
            self.iters + ((iteration,) if looped else ()),
            self.loops + ((self.eqn.primitive.name,) if looped else ()),
            self.backward,
            self.regions,
            (*self.enclosing, self.eqn),
            self.deliberate_args,
        )

    def bind(self, invals: Sequence[Any]) -> list[Any]:
        """The equation itself, uninstrumented."""
        return bind(self.eqn, invals)

    @staticmethod
    def sites_in(jaxpr: Any) -> int:
        return count_sites(jaxpr)[0]

    @staticmethod
    def zero() -> Any:
        """An iteration counter's start: concrete under ``disable_jit`` (Python loops index with
        it), an int32 scalar under jit. (jax.config's options are typed as attributes from jax
        0.12 on, dynamic before.)"""
        return 0 if jax.config.jax_disable_jit else jnp.int32(0)  # type: ignore[attr-defined, unused-ignore]


# --- observers ----------------------------------------------------------------------------------


class Observer:
    """Measures each site's outputs and folds batches of measures into a state; ``kind`` names
    the compiled check it belongs to."""

    kind = "observer"

    def init(self, n_sites: int, depth: int) -> Any:
        return None

    def measure(self, site: Site, invals: Sequence[Any], outs: Sequence[Any], iters: tuple) -> Any:
        """A (traced) summary of the site's outputs, or None to skip the site."""
        return None

    def fold(self, state: Any, sites: list[Site], measures: list[Any], iters: tuple) -> Any:
        """The state after the measures of ``sites`` (in program order, same loop iteration)."""
        return state


# Primitives that cannot turn finite operands into inf/NaN (they move, pick or compare values):
# never the equation where a non-finite value appears, so not measured.
FINITE_PRESERVING = frozenset(
    {
        "reshape",
        "broadcast_in_dim",
        "squeeze",
        "expand_dims",
        "transpose",
        "slice",
        "dynamic_slice",
        "gather",
        "concatenate",
        "pad",
        "select_n",
        "copy",
        "copy_p",
        "rev",
        "neg",
        "abs",
        "sign",
        "floor",
        "ceil",
        "round",
        "max",
        "min",
        "clamp",
        "reduce_max",
        "reduce_min",
        "argmax",
        "argmin",
        "sort",
        "stop_gradient",
        "dynamic_update_slice",
        "scatter",
        "cummax",
        "cummin",
        "optimization_barrier",
        "sharding_constraint",
        "tanh",
        "logistic",
        "sin",
        "cos",
        "is_finite",
        "real",
        "imag",
        "conj",
    }
)


def floating_outputs(outs: Sequence[Any]) -> list[Any]:
    return [o for o in outs if hasattr(o, "dtype") and is_float(o.dtype)]


# Each output element is computed from the operand elements at its position only: an inf/NaN is
# new where those were finite, even when the same array passes on a -inf mask elsewhere.
ELEMENTWISE = frozenset(
    {
        "add",
        "add_any",
        "sub",
        "mul",
        "div",
        "rem",
        "pow",
        "integer_pow",
        "square",
        "sqrt",
        "rsqrt",
        "cbrt",
        "exp",
        "exp2",
        "log",
        "log1p",
        "expm1",
        "tan",
        "atan2",
        "asin",
        "acos",
        "sinh",
        "cosh",
        "asinh",
        "acosh",
        "atanh",
        "erf_inv",
        "lgamma",
        "digamma",
        "convert_element_type",
        "reduce_precision",
        "nextafter",
    }
)


def made_nonfinite(
    site: Site, invals: Sequence[Any], outs: Sequence[Any], *, nan: bool = True
) -> Any:
    """Whether the site made an inf (or, with ``nan``, a NaN) of values that had none, as a
    traced boolean.

    An infinity the program writes on purpose (a ``-inf`` mask: a literal or a constant) and
    what it passes on (broadcast, convert, select, ``x - max``) is not made there: an overflow
    is where a value first went out of range. Where no operand can hold such an infinity
    (``Site.deliberate_nonfinite``: most programs) any inf/NaN in the outputs is new, as no
    earlier equation made one; else elementwise primitives are judged element by element and the
    others by sign over whole arrays (a +inf of operands holding only -inf is new)."""
    results = floating_outputs(outs)
    if not site.deliberate_nonfinite:
        flags = [jnp.any(~jnp.isfinite(o) if nan else jnp.isinf(o)) for o in results]
        return functools.reduce(jnp.logical_or, flags)
    operands = [
        jnp.asarray(value, var.aval.dtype)  # (a literal is a Python number: its traced dtype)
        for var, value in zip(site.eqn.invars, invals)
        if hasattr(var.aval, "dtype") and is_float(var.aval.dtype)
    ]
    if (
        site.primitive in ELEMENTWISE
        and len(results) == 1
        and all(o.shape in ((), results[0].shape) for o in operands)
    ):
        out = results[0]
        finite_in, nan_in = jnp.asarray(True), jnp.asarray(False)
        for operand in operands:
            finite_in = finite_in & jnp.isfinite(operand)
            nan_in = nan_in | jnp.isnan(operand)
        made = jnp.isinf(out) & finite_in
        return jnp.any((made | (jnp.isnan(out) & ~nan_in)) if nan else made)
    # (+inf, -inf, NaN) anywhere in the outputs, not in any operand: one reduction an array
    kinds = (jnp.isposinf, jnp.isneginf, jnp.isnan) if nan else (jnp.isposinf, jnp.isneginf)
    held = lambda arrays: functools.reduce(
        jnp.logical_or,
        [jnp.any(jnp.stack([k(a).ravel() for k in kinds]), axis=1) for a in arrays],
        jnp.zeros(len(kinds), bool),
    )
    return jnp.any(held(results) & ~held(operands))


# max(-inf, x) is x, min(+inf, x) is x (jnp.max's `initial`, in every softmax): no infinity
# passes on from such a literal.
_IDENTITY = {"max": -np.inf, "min": np.inf}


def _writes_literal(eqn: Any, literal: Any) -> bool:
    """Whether a literal operand writes an inf or NaN into the equation's output."""
    identity = _IDENTITY.get(eqn.primitive.name)
    if identity is not None and bool(np.all(np.asarray(literal.val) == identity)):
        return False
    return _nonfinite_value(literal.val)


def _nonfinite_value(value: Any) -> bool:
    """Whether a literal's or a constant's value holds an inf or NaN."""
    try:
        array = np.asarray(value)
    except Exception:  # (not concrete: it may hold anything)
        return True
    return is_float(array.dtype) and not bool(np.isfinite(array).all())


def _writes_nonfinite(eqn: Any) -> bool:
    """Whether a higher-order equation's bodies hold a non-finite literal or constant."""
    for sub in compat.sub_jaxprs(eqn.params):
        body, consts = compat.open_and_consts(sub)
        if any(_nonfinite_value(c) for c in consts) or _body_writes_nonfinite(body):
            return True
    return False


@_per_jaxpr
def _body_writes_nonfinite(jaxpr: Any) -> bool:
    return any(
        any(isinstance(v, compat.Literal) and _writes_literal(eqn, v) for v in eqn.invars)
        or _writes_nonfinite(eqn)
        for eqn in jaxpr.eqns
    )


# --- what a site's dtype was decided by ---------------------------------------------------------

_TABLE_TEXT: dict[str | None, Callable[[RegionState, str], str]] = {
    "lower": lambda s, d: f"lower table: runs in the compute dtype {s.dtype.name}",
    "fp32": lambda s, d: "fp32 table: computes in float32",
    "promote": lambda s, d: f"promote table: its operands arrived in {d}, it runs in the widest",
    None: lambda s, d: f"in no table: runs in the dtype its operands arrive in ({d})",
}
# rules/powers.py: these go to float32 only where their result is summed (a one-pass variance)
_FLOAT32_WHERE_SUMMED = ("square", "integer_pow")


def _table_text(category: str | None, state: RegionState, name: str, dtype: str) -> str:
    """The table's text, where what ran (``dtype``, the site's output) is what the table says."""
    if category in ("lower", "fp32") and dtype == "float64":
        return f"{category} table, but float64 is never narrowed: runs in float64"
    if category == "fp32" and dtype != "float32":
        if name in _FLOAT32_WHERE_SUMMED:
            return (
                f"fp32 table, which casts `{name}` to float32 only where its result is summed; "
                f"this one's is not: runs in the dtype its operand arrives in ({dtype})"
            )
        return f"fp32 table, but its operands were not cast: runs in {dtype}"
    return _TABLE_TEXT[category](state, dtype)


def decision(policy: Policy, site: Site) -> str:
    """Why a site ran in its dtype, in the policy's terms (table, region, rule, inputs); read
    against the dtype it ran in, which the rules may keep (float64, an unsummed power)."""
    state, name = site.state, site.primitive
    dtype = getattr(site.out_dtype, "name", str(site.out_dtype))
    if name == "convert_element_type":
        text = (
            f"a cast to {dtype}: jamp inserts one where the next op's table asks for "
            "another dtype (or your code casts here)"
        )
    elif not state.enabled:
        text = (
            f"autocast is off here ({state.decided_by}): runs in the dtype its operands "
            f"arrive in ({dtype})"
        )
    else:
        text = _table_text(policy.category(name), state, name, dtype)
    if state.decided_by != "policy" and state.enabled:
        text += f"; compute dtype {state.dtype.name} set by {state.decided_by}"
    return text


def forward_site(site: Site, sites: dict[int, Site]) -> Site | None:
    """For a backward site, the forward equation it was derived from (same traced source)."""
    traceback = compat.traceback_of(site.eqn)
    candidates = [
        s
        for s in sites.values()
        if not s.backward and s.index < site.index and compat.traceback_of(s.eqn) is traceback
    ]
    if not candidates:
        candidates = [
            s
            for s in sites.values()
            if not s.backward and s.index < site.index and s.source == site.source
        ]
    not_casts = [s for s in candidates if s.primitive != "convert_element_type"]
    found = not_casts or candidates
    return found[-1] if found else None
