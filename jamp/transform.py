"""``autocast_transform`` and ``autocast_jaxpr``: the call boundary of the rewrite.

A call of a transformed function goes: split the arguments into traced leaves and static values
(``call_args.py``), look the call up in a cache keyed like ``jax.jit``'s (argument structure, avals,
static values, JAX's trace context), trace the user's function once per key under the user's
debug info (so tracer errors name their function and parameters), then run the rewritten program:
bound into the enclosing program when one is being built (under ``jax.jit``), else compiled once
with ``jax.jit`` and the executable reused (eager calls, eager ``grad``/``vmap``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import inspect
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, MutableMapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from . import _compat as compat
from . import graph_nodes
from . import rules as _rules  # noqa: F401  (registers the higher-order rules)
from .call_args import (
    CallSignature,
    array_attributes,
    check_traceable,
    function_name,
    is_generator_like,
    short_repr,
    split_leaves,
    static_key,
    traced_captures,
)
from .interpreter import F64, INPUT, Rewriter, is_float
from .policy import Policy, RegionState
from .region_stack import as_rewritten, tracing_under
from .rules import custom_ad

# A Policy, a floating dtype (meaning Policy(dtype)) or None (meaning Policy()). Public
# signatures spell the union out, so the API pages show it rather than an alias name.
PolicyLike = Policy | DTypeLike | None


def _is_dtype_like(value: Any) -> bool:
    """``jnp.float16``, ``np.float16``, ``np.dtype("float16")`` or ``"float16"`` (not an array)."""
    if isinstance(value, np.dtype):
        return True
    if isinstance(value, str):  # only the name of a dtype ("bf16" is none)
        try:
            np.dtype(value)
        except TypeError:
            return False
        return True
    return isinstance(value, type) and (
        issubclass(value, np.generic) or isinstance(getattr(value, "dtype", None), np.dtype)
    )


def resolve_policy(
    policy: PolicyLike, dtype: DTypeLike | None = None, *, where: str = "autocast_transform"
) -> Policy:
    """The Policy a caller meant: ``None`` is ``Policy()``, a dtype is ``Policy(dtype)``.

    ``dtype=`` replaces the policy's ``compute_dtype`` and keeps the rest of the policy (as
    ``torch.autocast(dtype=...)`` picks the lower-precision dtype); giving the compute dtype twice
    (``autocast_transform(f, jnp.float16, dtype=jnp.bfloat16)``) is an error.
    """
    if policy is None:
        return Policy() if dtype is None else _as_compute(Policy(), dtype, "dtype", where)
    if isinstance(policy, Policy):
        return policy if dtype is None else _as_compute(policy, dtype, "dtype", where)
    if _is_dtype_like(policy):
        if dtype is not None:
            raise ValueError(
                f"{where}: the compute dtype was given twice, as the policy "
                f"({policy!r}) and as dtype={dtype!r}; pass one of them"
            )
        return _as_compute(Policy(), policy, "policy", where)
    raise TypeError(
        f"{where}: policy must be a jamp.Policy, a floating dtype such as jnp.bfloat16 "
        f"(meaning jamp.Policy(dtype)) or None; got {type(policy).__name__} "
        f"{short_repr(policy)}"
    )


def _as_compute(policy: Policy, dtype: Any, argument: str, where: str) -> Policy:
    """``policy`` with ``dtype`` as its compute dtype; a bad dtype is named as the caller's
    argument (``autocast_transform: dtype='bf16': ...``)."""
    try:
        return policy.replace(compute_dtype=dtype)
    except (TypeError, ValueError) as err:
        try:
            shown = repr(dtype) if isinstance(dtype, str) else f"jnp.{np.dtype(dtype).name}"
        except TypeError:
            shown = short_repr(dtype)
        raise type(err)(f"{where}: {argument}={shown}: {err}") from None


_PAUSE_LOCK = threading.Lock()
_rewrites_running = 0  # (in any thread)
_paused_here = False  # whether the first of them found the collector enabled and paused it


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """The cyclic garbage collector paused while a rewrite builds its program, and enabled again
    after the last rewrite running in any thread, if the first found it enabled (a caller's
    ``gc.disable()`` stays). Run during the rewrite, the collector scans the program being
    built, alive to the last equation, and moves it to its oldest generation, which then fills
    up faster than tracing alone fills it: a transformed function's trace ran 0.28 full
    collections against the function's trace's 0.17, and 0.20 paused (benchmarks/README.md,
    issue 33, thirty-fifth pass).
    Paused, the program is a young generation's when the collector next runs, as a traced
    program is, and mostly gone by then (lowered, or returned and dropped). (The switch is the
    process's: another thread's ``gc.disable()`` made while a rewrite runs is undone when the
    last rewrite ends.)"""
    global _rewrites_running, _paused_here
    with _PAUSE_LOCK:
        if _rewrites_running == 0:
            _paused_here = gc.isenabled()
            if _paused_here:
                gc.disable()
        _rewrites_running += 1
    try:
        yield
    finally:
        with _PAUSE_LOCK:
            _rewrites_running -= 1
            if _rewrites_running == 0 and _paused_here:
                _paused_here = False
                gc.enable()


def rewrite_and_eval(
    closed: Any,
    policy: Policy,
    args: Sequence[Any],
    recorder: Any = None,
    rewritten: MutableMapping | None = None,
    kept_dtypes: Sequence[bool] = (),
) -> list[Any]:
    """Evaluate ``closed`` on ``args`` under the current JAX trace, rewritten by ``policy``.

    ``recorder`` (see ``report.Recorder``) is told about every equation and inserted cast.
    ``rewritten`` is the cache of rewritten sub-jaxprs (default: one for this call only; see
    ``SubJaxprCache``). ``kept_dtypes`` marks the inputs ``cast_inputs`` leaves in their dtypes
    (running statistics, ``graph_nodes.running_statistics``); by default it casts every one.
    """
    jaxpr, consts = compat.open_and_consts(closed)
    if policy.cast_inputs:
        kept = list(kept_dtypes) + [False] * (len(args) - len(kept_dtypes))
        args = [
            compat.convert(x, policy.value_dtype) if is_castable(x) and not keep else x
            for x, keep in zip(args, kept)
        ]
    rewriter = Rewriter(
        policy,
        RegionState(enabled=True, dtype=policy.compute_dtype),
        rewritten=rewritten,
        recorder=recorder,
    )
    with collection_paused():
        outs = rewriter.run(jaxpr, consts, args, [INPUT] * len(args))
    if policy.output_dtype is not None:
        output_dtype = _available(policy.output_dtype)
        outs = [compat.convert(x, output_dtype) if is_castable(x) else x for x in outs]
    return outs


def _available(dtype: np.dtype) -> np.dtype:
    """``dtype`` as JAX has it now: float64 is float32 without ``jax_enable_x64``, with the
    warning ``x.astype(jnp.float64)`` gives (a float64 program would follow none of JAX's own)."""
    canonical = np.dtype(jax.dtypes.canonicalize_dtype(dtype))
    if canonical != dtype:
        warnings.warn(
            f"Policy.output_dtype={dtype.name} is not available without jax_enable_x64, and "
            f"outputs are cast to {canonical.name} instead (as x.astype(jnp.{dtype.name}) "
            "does); enable x64 (jax.config.update('jax_enable_x64', True)) for float64 outputs",
            UserWarning,
            stacklevel=2,
        )
    return canonical


def is_castable(value: Any) -> bool:
    """A floating value narrower than float64 (not an effect token, which has no dtype): what
    ``cast_inputs`` and ``output_dtype`` cast (and ``@jamp.autocast(cast_inputs=...)``)."""
    dtype = getattr(compat.aval_of(value), "dtype", None)
    return dtype is not None and is_float(dtype) and np.dtype(dtype) != F64


def autocast_jaxpr(closed_jaxpr: Any, policy: Policy | DTypeLike | None = None) -> Any:
    """Rewrite a closed jaxpr under ``policy``; returns a closed jaxpr with the same inputs.

    ``policy`` is a ``jamp.Policy``, a floating dtype (``Policy(dtype)``) or ``None``.

    Example::

        closed = jax.make_jaxpr(f)(x, w)
        mixed = jamp.autocast_jaxpr(closed)          # dot_general now runs in bfloat16
    """
    policy = resolve_policy(policy, where="autocast_jaxpr")
    if not compat.is_jaxpr_like(closed_jaxpr):
        raise TypeError(
            "autocast_jaxpr expects a closed jaxpr (jax.make_jaxpr(f)(...)), "
            f"got {type(closed_jaxpr).__name__}"
        )
    unbound = compat.unclosed_constvars(closed_jaxpr)
    if unbound:
        raise TypeError(
            f"autocast_jaxpr expects a closed jaxpr (jax.make_jaxpr(f)(...)), got an open "
            f"jaxpr with {unbound} constvar(s) and no values for them: pass the closed jaxpr "
            "itself (closed, not closed.jaxpr)"
        )
    closed_jaxpr = compat.as_closed(closed_jaxpr)
    in_avals = list(closed_jaxpr.in_avals)
    return compat.trace_to_closed(lambda *a: rewrite_and_eval(closed_jaxpr, policy, a), in_avals)


def autocast_transform(
    fn: Callable,
    policy: Policy | DTypeLike | None = None,
    *,
    dtype: DTypeLike | None = None,
    static_argnums: int | Iterable[int] = (),
    static_argnames: str | Iterable[str] = (),
) -> Callable:
    """torch.autocast for JAX: ``fn`` rewritten op by op under a precision policy.

    The returned function has ``fn``'s signature and composes with ``jax.jit``, ``jax.grad``,
    ``jax.vmap`` and sharding in any order; gradients come back in the primal dtypes. Called
    inside a ``jamp.autocast`` region or another transformed function, it keeps its own policy
    (the innermost wins, as with nested regions).

    Args:
      fn: the function to transform.
      policy: a ``jamp.Policy``; a floating dtype such as ``jnp.float16`` means
        ``jamp.Policy(jnp.float16)``; ``None`` means ``jamp.Policy()`` (bfloat16).
      dtype: replaces the policy's ``compute_dtype`` and keeps the rest of the policy.
      static_argnums: positions of the arguments passed to ``fn`` as the Python values they
        are (a loop count stays an ``int``), with ``jax.jit``'s meaning: negative numbers count
        from the end, the values must be hashable and each new value traces ``fn`` again. When
        ``fn`` is a ``jax.jit``-wrapped function, its own static arguments are static here too.
      static_argnames: the same arguments by parameter name. Numbers and names are inferred
        from each other through ``fn``'s signature, as ``jax.jit`` infers them.

    Array leaves of the arguments are traced. So are Python numbers passed as whole arguments
    in eager calls (as ``jax.jit`` does, so a changing learning rate does not recompile); under
    an enclosing transformation (``jax.jit``, ``jax.grad``, ``jax.vmap``...) a Python number is
    already a constant of that program and is passed to ``fn`` unchanged, so
    ``jax.jit(autocast_transform(g), static_argnums=1)(x, 3)`` sees ``3``. A Python number
    inside a pytree argument (an Equinox module's ``Dropout(p=0.0)``, a config field) is static,
    as ``equinox.filter_jit`` treats it, so library code can branch on it; a new value traces
    ``fn`` again. Bools, strings and other hashable leaves (``train=False``,
    ``mutable=["batch_stats"]``) are always static. An array JAX cannot trace (numpy strings or
    Python objects, a ``jax.Array`` of numpy's ``StringDType``) is refused, as ``jax.jit``
    refuses it, by the argument's name and pytree path.
    Output leaves that are not arrays (Python numbers, strings, functions, ``None``) are
    returned as they came, as ``equinox.filter_jit`` does. Flax NNX modules among the arguments are split
    and merged as ``nnx.jit`` does, and their final state (e.g. BatchNorm statistics) is
    written back.

    Eager calls (outside any JAX transformation) compile the rewritten program with
    ``jax.jit`` once per argument structure, shapes/dtypes, static values and JAX context
    (``jax.default_matmul_precision``, ``jax.enable_x64``, named axes...), and reuse the
    executable; under ``jax.disable_jit()`` they run op by op, and ``fn``'s Python runs on every
    call (as ``jax.jit``'s function does there). Their outputs are what
    ``jax.jit`` of the same function returns (jax Arrays, canonical dtypes).

    Errors raised while tracing ``fn`` name ``fn``, its file and line and the parameter (or
    pytree path) a value came from, as ``jax.jit``'s do, and their tracebacks show your frames,
    not jamp's or JAX's (``JAX_TRACEBACK_FILTERING=off`` shows every frame).

    Example::

        loss_fn = jamp.autocast_transform(loss_fn)                # bfloat16 matmuls
        # float32 grads for float32 params
        grads = jax.jit(jax.grad(loss_fn))(params, batch)
        f16 = jamp.autocast_transform(loss_fn, jnp.float16)       # same as dtype=jnp.float16
        unrolled = jamp.autocast_transform(g, static_argnames="n_steps")   # g(x, n_steps=3)
    """
    check_transformable(fn)
    policy = resolve_policy(policy, dtype)
    signature = CallSignature.of(fn, static_argnums, static_argnames)
    on_arrays = _transform_arrays(signature.call_unmarked, policy, source=fn, signature=signature)
    on_graph_state: dict[Any, Callable] = {}  # per argument structure with NNX modules

    @functools.wraps(fn)
    def transformed(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = signature.mark_static(args, kwargs)
        if not graph_nodes.has_graph_nodes((args, kwargs)):
            return on_arrays(*args, **kwargs)
        return graph_nodes.call_with_graph_nodes(
            signature.call_unmarked,
            lambda pure: _transform_arrays(pure, policy, source=fn),
            on_graph_state,
            args,
            kwargs,
        )

    # An error from fn shows fn's frames, not jamp's or JAX's, as under jax.jit.
    boundary = compat.api_boundary(transformed)
    boundary.policy = policy  # type: ignore[attr-defined]
    return boundary


def _holds_tracers(closed: Any) -> bool:
    """Whether a closed jaxpr's constants are tracers (values of a trace it cannot outlive)."""
    return any(compat.is_tracer(c) for c in compat.open_and_consts(closed)[1])


class SubJaxprCache(MutableMapping):
    """The ``Rewriter``'s cache of rewritten sub-jaxprs, for one call of a traced program, backed
    by a store kept across its calls.

    Under eager ``grad``/``vmap`` a program whose custom_jvp/custom_vjp rule closes over a value
    it computed is rewritten again on every call (see ``_transform_arrays``). JAX caches compiled
    ``jit``/``scan``/... equations on their jaxpr objects, so an inner ``jax.jit`` whose
    rewritten body were a new object on every call would compile on every call. Keys are
    ``(sub-jaxpr, avals, region state, tags)`` (``Rewriter.rewrite_closed``); the store holds the
    sub-jaxprs weakly, so rewrites of jaxprs traced afresh in one call (a custom rule's JVP) go
    with them. A rewrite whose constants hold
    tracers (values of this call's trace) is kept for this call only.

    ``per_call=False`` (a region's, which lives as long as its ``with`` block): only what the
    store cannot hold is kept here, so that a long region (a whole training loop) does not keep
    every callee it walked, and the arrays they close over, alive until it exits.
    """

    def __init__(
        self, store: weakref.WeakKeyDictionary[Any, dict] | None = None, per_call: bool = True
    ):
        self.store = weakref.WeakKeyDictionary() if store is None else store
        self.local: dict[Any, Any] = {}
        self.per_call = per_call

    def for_call(self) -> SubJaxprCache:
        """A fresh per-call view on the same store."""
        return SubJaxprCache(self.store)

    def _shared(self, key: Any) -> dict | None:
        try:
            return self.store.get(key[0])
        except TypeError:  # a jaxpr that cannot be weakly referenced
            return None

    def __getitem__(self, key: Any) -> Any:
        if key in self.local:
            return self.local[key]
        shared = self._shared(key)
        if shared is None or key[1:] not in shared:
            raise KeyError(key)
        return shared[key[1:]]

    def __setitem__(self, key: Any, value: Any) -> None:
        if not _holds_tracers(value):
            try:
                self.store.setdefault(key[0], {})[key[1:]] = value
            except TypeError:  # (a jaxpr that cannot be weakly referenced)
                pass
            else:
                if not self.per_call:
                    return
        self.local[key] = value

    def __delitem__(self, key: Any) -> None:
        self.local.pop(key, None)
        shared = self._shared(key)
        if shared is not None:
            shared.pop(key[1:], None)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.local)

    def __len__(self) -> int:
        return len(self.local)


@dataclasses.dataclass
class _Traced:
    """One traced call: its jaxpr over the traced leaves and how to rebuild the output pytree."""

    closed: Any
    out_tree: Any
    array_outs_at: tuple[int, ...]  # output leaf positions the jaxpr computes
    static_outs: tuple[tuple[int, Any], ...]  # the other output leaves, returned as they came
    cacheable: bool = True
    name: str = "autocast"
    program: Callable | None = None  # jax.jit of the rewrite, made on first use
    donated: tuple[int, ...] = ()  # the inputs ``program`` donates (``compiled``)
    undonated: Callable | None = None  # the same program donating none
    # Whether a custom_jvp/custom_vjp rule in the program closes over values of the user's
    # trace, which only the direct rewrite can map (Rewriter.outer_value): found out when the
    # compiled program's rule raised RuleClosureError under eager grad.
    rules_close_over_values: bool = False
    # Rewritten sub-jaxprs, kept across the calls that rewrite this program again (eager
    # grad/vmap of such a program): their inner jits then hit JAX's compile cache.
    sub_jaxprs: SubJaxprCache = dataclasses.field(default_factory=SubJaxprCache)
    # Per traced input: left in its dtype by cast_inputs (a Flax model's running statistics).
    kept_dtypes: tuple[bool, ...] = ()

    def outputs(self, array_outs: Sequence[Any]) -> Any:
        leaves: list[Any] = [None] * (len(self.array_outs_at) + len(self.static_outs))
        for i, value in zip(self.array_outs_at, array_outs):
            leaves[i] = value
        for i, value in self.static_outs:
            leaves[i] = value
        return jax.tree.unflatten(self.out_tree, leaves)

    def compiled(self, policy: Policy, flat: Sequence[Any]) -> Callable:
        """The rewritten program as one ``jax.jit`` function (traced and compiled once per
        trace context), for the arguments ``flat``."""
        if self.program is None:
            closed = self.closed
            kept = self.kept_dtypes

            def program(*flat: Any) -> list[Any]:
                return rewrite_and_eval(closed, policy, flat, kept_dtypes=kept)

            program.__name__ = program.__qualname__ = self.name
            # A jitted fn called eagerly donates and places its outputs, as it does unwrapped
            # (a jit nested in this one would lose both).
            donate, out_shardings = compat.eager_call_settings(closed)
            self.program = jax.jit(program, donate_argnums=donate, out_shardings=out_shardings)
            self.donated = donate
            self.undonated = (
                jax.jit(program, out_shardings=out_shardings) if donate else self.program
            )
        if self.donated and _shares_a_donated_buffer(flat, self.donated):
            assert self.undonated is not None  # (made with the program)
            return self.undonated  # (one array passed twice: the other reads it after)
        return self.program


def _shares_a_donated_buffer(flat: Sequence[Any], donated: tuple[int, ...]) -> bool:
    """Whether an input to donate is also passed elsewhere in ``flat`` (tied weights, an EMA
    sharing the parameters' arrays): donated, the other read would find it deleted."""
    ids = [id(x) for x in flat]
    return any(ids.count(ids[i]) > 1 for i in donated)


def _is_array_output(leaf: Any) -> bool:
    """Output leaves returned as JAX values (arrays, numpy scalars, effect tokens); everything
    else, Python numbers too, passes through as it came, as ``equinox.filter_jit`` returns it:
    a number the trace ends with is a constant of it, and an Equinox module's ``Dropout.p`` or
    ``inference`` flag must come back a Python value, which the next call takes as static."""
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic)) or compat.is_token(leaf)


def _leaf_path(tree: Any, leaves: list[Any], i: int) -> str:
    """``['logits']``: where leaf ``i`` of a flattened pytree sits (its leaves are kept whole,
    as flattening found them: JAX warns when it flattens a generator again)."""
    leaf_ids = {id(x) for x in leaves}
    paths = jax.tree_util.tree_flatten_with_path(
        jax.tree.unflatten(tree, leaves), is_leaf=lambda x: id(x) in leaf_ids
    )[0]
    return jax.tree_util.keystr(paths[i][0])


def _refuse_traced_attributes(out_leaves: list[Any], out_tree: Any, source: Callable) -> None:
    """An output that passes through (not an array, not a pytree) must not carry a value of the
    trace: it would come back holding a tracer. ``jax.jit`` refuses such an output too. Read are
    an object's attributes, and what a returned function (closure cells, default arguments) or
    generator (local variables) captured; outer traces' values may pass through."""
    trace = compat.current_trace()
    of_this_trace = lambda x: compat.is_tracer(x) and compat.trace_of(x) is trace
    for i, leaf in enumerate(out_leaves):
        if _is_array_output(leaf):
            continue
        traced = [
            name
            for name in array_attributes(leaf)
            if compat.is_tracer(getattr(leaf, name))  # (concrete arrays came from outside)
        ]
        captured = [] if traced else traced_captures(leaf, of_this_trace)
        if not traced and not captured:
            continue
        where = "output" + _leaf_path(out_tree, out_leaves, i)
        kind = type(leaf).__name__
        if captured:
            if isinstance(leaf, functools.partial):
                kind, leaf = "functools.partial", leaf.func
            raise TypeError(
                f"autocast_transform({function_name(source)}): its {where} is a {kind} "
                f"({function_name(leaf)}) that captured values computed from the arguments "
                f"({', '.join(captured)}), so it would come back holding tracers and fail where "
                f"it is used (jax.jit refuses a {kind} output too). Return the arrays it needs "
                f"(they come back as arrays) and make the {kind} from them outside"
            )
        attributes = ", ".join(f".{a}" for a in traced)
        raise TypeError(
            f"autocast_transform({function_name(source)}): its {where} is a {kind} holding "
            f"values computed from the arguments ({attributes}) but it is not a pytree, so "
            f"it would come back holding tracers. Register {kind} as a pytree "
            "(jax.tree_util.register_dataclass, register_pytree_node_class, "
            "flax.struct.dataclass) or return its arrays"
        )


def trace_call(
    fn: Callable,
    policy: Policy,
    args: tuple,
    kwargs: dict,
    *,
    source: Callable | None = None,
    signature: CallSignature | None = None,
) -> tuple[Any, list[Any], Callable[[], _Traced], Callable[[], None]]:
    """Split a call's arguments into traced leaves and static ones and make the cache key.

    Returns ``(key, flat traced leaves, tracer, refuse_untraceable)`` where ``tracer()`` traces
    ``fn`` at the traced leaves' avals (inside an enabled autocast state, for
    ``is_autocast_enabled``) to a ``_Traced``, and ``refuse_untraceable()`` raises a TypeError
    naming an argument no JAX program takes (``call_args.check_traceable``), if there is one.
    ``source`` is the user's function that errors should name (``fn`` by default);
    ``signature`` (the user's, with static arguments marked) names the arguments, else ``fn``'s
    own parameters do.
    """
    source = fn if source is None else source
    flat, in_tree = compat.flatten_arguments((args, kwargs))
    traced_at, static = split_leaves(
        flat, in_tree, signature, numbers_are_static=compat.under_transformation()
    )
    traced_flat = [flat[i] for i in traced_at]

    def refuse_untraceable() -> None:
        where = (
            signature.where
            if signature is not None
            else f"autocast_transform({function_name(source)})"
        )
        check_traceable(flat, in_tree, traced_at, signature, where)

    try:
        avals = tuple(compat.aval_of(x) for x in traced_flat)
    except TypeError:  # (an array JAX has no type for: named, not on the calls that pass)
        refuse_untraceable()
        raise
    key = (in_tree, avals, static_key(static), compat.trace_context())

    def tracer() -> _Traced:
        outs_store: dict[str, Any] = {}

        def flat_fn(*traced_leaves: Any) -> list[Any]:
            custom_ad.remember_user_trace(compat.current_trace())
            leaves: list[Any] = [None] * len(flat)
            for i, leaf in zip(traced_at, traced_leaves):
                leaves[i] = leaf
            for i, leaf in static:
                leaves[i] = leaf
            call_args, call_kwargs = jax.tree.unflatten(in_tree, leaves)
            out_leaves, outs_store["tree"] = jax.tree.flatten(
                fn(*call_args, **call_kwargs), is_leaf=is_generator_like
            )
            _refuse_traced_attributes(out_leaves, outs_store["tree"], source)
            outs_store["arrays_at"] = tuple(
                i for i, x in enumerate(out_leaves) if _is_array_output(x)
            )
            outs_store["static"] = tuple(
                (i, x) for i, x in enumerate(out_leaves) if not _is_array_output(x)
            )
            return [out_leaves[i] for i in outs_store["arrays_at"]]

        debug = _debug_info(
            source, signature.fn if signature is not None else fn, flat, in_tree, traced_at
        )
        statistics = (  # (per argument structure, the cache key's: found when tracing)
            graph_nodes.running_statistics((args, kwargs), len(flat))
            if policy.cast_inputs
            else None
        )
        kept_dtypes = tuple(statistics[i] for i in traced_at) if statistics else ()
        # cast_inputs: softmax as one call, which then returns the compute dtype and keeps only
        # its compute-dtype output for the backward pass (rules/custom_ad.py).
        softmax = compat.softmax_as_custom_jvp() if policy.cast_inputs else contextlib.nullcontext()
        with tracing_under(True, policy.compute_dtype), softmax:
            closed = compat.trace_user_function(flat_fn, avals, debug)
        # A function closing over an outer trace's values captures tracers: never cache those.
        cacheable = not _holds_tracers(closed)
        return _Traced(
            closed,
            outs_store["tree"],
            outs_store["arrays_at"],
            outs_store["static"],
            cacheable=cacheable,
            name=getattr(source, "__name__", "autocast"),
            kept_dtypes=kept_dtypes,
        )

    return key, traced_flat, tracer, refuse_untraceable


def check_transformable(fn: Any, where: str = "autocast_transform") -> None:
    """A clear error, as ``jax.jit``'s, for what cannot be transformed: a generator or async
    function (its body runs when the caller iterates or awaits what the call returned, after the
    trace it would leak its values out of) and a ``staticmethod`` or ``classmethod`` object (in
    a class body, the transformed function would be a plain method). ``where`` is the public
    entry point the user called (``@jamp.autocast()``'s own check names the decorator)."""
    name = getattr(fn, "__qualname__", type(fn).__name__)
    if isinstance(fn, (staticmethod, classmethod)):
        decorator = "jamp.autocast_transform(...)" if where == "autocast_transform" else where
        raise TypeError(
            f"{where}: {type(fn).__name__} arguments are not supported ({name}); "
            f"apply @{type(fn).__name__} outside: @{type(fn).__name__} above @{decorator}"
        )
    if not callable(fn):
        raise TypeError(f"{where} expects a callable, got {type(fn).__name__}")
    if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
        raise TypeError(f"{where} expects a function, got a generator function: {name}")
    if inspect.iscoroutinefunction(fn):
        raise TypeError(
            f"{where} expects a function, got an async function: {name}. Its body would run "
            "when the coroutine is awaited, after the trace, and the values it computed from "
            "the arguments would escape it (jax.jit refuses it too): transform a plain "
            "function and call it from the async one"
        )


def _debug_info(
    source: Callable, named_fn: Callable, flat: list[Any], in_tree: Any, traced_at: list[int]
) -> Any:
    """JAX's debug info naming ``source`` and, after ``named_fn``'s parameters, the traced leaves."""
    traced = set(traced_at)
    # Static leaves become None (an empty pytree), so JAX's names line up with the traced leaves.
    only_traced = jax.tree.unflatten(
        in_tree, [x if i in traced else None for i, x in enumerate(flat)]
    )
    traced_args, traced_kwargs = only_traced
    structure = (in_tree, tuple(traced_at))  # (all the leaves' names depend on, with named_fn)
    debug = compat.debug_info(
        "autocast_transform", named_fn, traced_args, traced_kwargs, structure=structure
    )
    if named_fn is not source:
        debug = compat.debug_info_named_for(debug, source)
    return debug


class _TraceCache(dict):
    """A transformed function's traced programs, per call key. Pickled empty: cloudpickle
    pickles the function's closure by value (Ray, multiprocessing), and a traced program holds
    JAX tracebacks, which cannot be pickled; as with ``jax.jit``, whose caches are not pickled
    either, the function unpickled traces again on its first call."""

    def __reduce__(self) -> tuple[type, tuple]:
        return (type(self), ())


def _transform_arrays(
    fn: Callable, policy: Policy, *, source: Callable, signature: CallSignature | None = None
) -> Callable:
    """The transform for arguments that are pytrees of arrays and static leaves."""
    cache: dict[Any, _Traced] = _TraceCache()

    @functools.wraps(fn)
    def transformed(*args: Any, **kwargs: Any) -> Any:
        key, flat, tracer, refuse_untraceable = trace_call(
            fn, policy, args, kwargs, source=source, signature=signature
        )
        # Under jax.disable_jit() the function's Python runs on every call, as jax.jit's does
        # there (prints, counters, breakpoints): traced anew, not taken from the cache.
        debugging = compat.jit_disabled()
        traced = None if debugging else cache.get(key)
        if traced is None:
            traced = tracer()
            if traced.cacheable and not debugging:
                cache[key] = traced
        eager = not compat.under_transformation()
        if (
            not traced.cacheable
            or compat.under_staging()
            or (traced.rules_close_over_values and not eager)
        ):
            # Inside a program being built (jit, make_jaxpr, a scan body) the rewrite is bound
            # into it directly; a closure over an outer trace's values can only be re-bound.
            with as_rewritten():
                return _bound_directly(traced, policy, flat)
        # Eagerly, and under eager grad/vmap: one compiled program, whose jit caches (also those
        # of its JVP and batching) make later calls skip tracing, rewriting and compiling.
        try:
            with as_rewritten():
                outs = traced.compiled(policy, flat)(*flat)
        except custom_ad.RuleClosureError:
            if eager:
                raise
            # A custom rule closing over a value the function computed runs, under eager
            # grad, while JAX differentiates the compiled program, after the rewrite: like
            # grad(jit(f)), where it fails. Bound directly, the rule runs during the rewrite
            # (as in plain eager JAX), which maps the value.
            traced.rules_close_over_values = True
            with as_rewritten():
                return _bound_directly(traced, policy, flat)
        except TypeError:
            # A string jax.Array traces (so does under jax.jit, which refuses it only here, as
            # it runs the program, without naming it); named as the user passed it.
            refuse_untraceable()
            raise
        if eager:
            # jax.disable_jit() runs the program op by op, and an input returned unchanged comes
            # back as the caller's object (numpy float64); return what jax.jit returns.
            outs = [
                x if isinstance(x, jax.Array) or compat.is_token(x) else jnp.asarray(x)
                for x in outs
            ]
        return traced.outputs(outs)

    return transformed


def _bound_directly(traced: _Traced, policy: Policy, flat: Sequence[Any]) -> Any:
    """The rewrite bound under the caller's traces, equation by equation."""
    return traced.outputs(
        rewrite_and_eval(
            traced.closed,
            policy,
            flat,
            rewritten=traced.sub_jaxprs.for_call(),
            kept_dtypes=traced.kept_dtypes,
        )
    )
