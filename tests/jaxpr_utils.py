"""Helpers for inspecting (rewritten) jaxprs in tests."""

from __future__ import annotations

import collections
import contextlib
from typing import Any, Callable, Iterator

import jax

import jamp
from jamp import _compat as compat


def sub_jaxprs(value: Any) -> Iterator[Any]:
    if compat.is_jaxpr_like(value):
        yield compat.open_and_consts(value)[0]
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from sub_jaxprs(v)


def iter_eqns(jaxpr: Any) -> Iterator[Any]:
    """Every equation of a (closed) jaxpr, recursing into sub-jaxprs in params."""
    jaxpr = compat.open_and_consts(jaxpr)[0]
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in sub_jaxprs(value):
                yield from iter_eqns(sub)


def eqns_named(jaxpr: Any, name: str) -> list[Any]:
    return [e for e in iter_eqns(jaxpr) if e.primitive.name == name]


def operand_dtypes(jaxpr: Any, name: str) -> list[tuple[str, ...]]:
    """Operand dtype names of every ``name`` equation, e.g. [('bfloat16', 'bfloat16')]."""
    return [tuple(v.aval.dtype.name for v in e.invars) for e in eqns_named(jaxpr, name)]


def dtype_signatures(jaxpr: Any, keep: Callable[[str], bool]) -> collections.Counter:
    """(primitive, operand dtypes, result dtypes) of every equation whose primitive name ``keep``
    accepts, sub-jaxprs included, counted: what a policy decided, comparable across programs."""
    return collections.Counter(
        (
            e.primitive.name,
            tuple(str(v.aval.dtype) for v in e.invars),
            tuple(str(v.aval.dtype) for v in e.outvars),
        )
        for e in iter_eqns(jaxpr)
        if keep(e.primitive.name)
    )


def make_jaxpr(fn: Any, *args: Any) -> Any:
    return jax.make_jaxpr(fn)(*args)


def program_record(closed: Any) -> tuple[str, list[tuple[Any, ...]]]:
    """A program's text and, for every equation (sub-jaxprs included), what the text leaves out:
    its name stack, source line and equation context (mesh, XLA metadata, compute type)."""
    return str(closed), [
        (e.primitive.name, str(e.source_info.name_stack), compat.source_line(e), e.ctx)
        for e in iter_eqns(closed)
    ]


def in_region(fn: Callable, **region: Any) -> Callable:
    """``fn`` with a ``with jamp.autocast(**region):`` block around its body."""

    def wrapped(*args: Any) -> Any:
        with jamp.autocast(**region):
            return fn(*args)

    return wrapped


def fresh(fn: Callable) -> Callable:
    """``fn`` as a new function object: ``jax.make_jaxpr`` and ``jax.jit`` share a trace cache
    keyed by the function, so tracing the same object again would not trace (nor decide)."""
    return lambda *args: fn(*args)


@contextlib.contextmanager
def fresh_region_caches() -> Iterator[None]:
    """Regions and transforms with none of the decisions and ``jnp`` rewrites kept by earlier
    ones (they are kept per policy for the process): a program traced under a changed jamp
    (``bound_only``) then decides and walks everything itself rather than reusing what another
    condition made."""
    from jamp import interpreter, region_trace

    saved = region_trace._CALLS, region_trace._DECISIONS, interpreter._TRANSFORM_DECISIONS
    region_trace._CALLS, region_trace._DECISIONS, interpreter._TRANSFORM_DECISIONS = {}, {}, {}
    try:
        yield
    finally:
        region_trace._CALLS, region_trace._DECISIONS, interpreter._TRANSFORM_DECISIONS = saved


@contextlib.contextmanager
def decided_every_time() -> Iterator[None]:
    """``autocast_transform`` with every equation decided by its rule, none replayed
    (``interpreter.TransformDecisions``): the reference a replayed rewrite must equal."""
    from jamp import interpreter

    key = interpreter.TransformDecisions.key
    interpreter.TransformDecisions.key = lambda *args: None
    try:
        with fresh_region_caches():
            yield
    finally:
        interpreter.TransformDecisions.key = key


@contextlib.contextmanager
def bound_only() -> Iterator[None]:
    """jamp with every equation bound, none staged directly (``compat.stage_like``,
    ``stage_decided`` and ``stage_convert`` for the transform's rewrite, ``compat.bind_on`` for
    a region's operations (``_stage_again`` for those it replays), ``_stage_cast`` for its
    casts, ``_inline_now`` for its calls of jnp functions): the reference a directly staged
    program must equal."""
    names = (
        "_stage",
        "_stage_now",
        "_stage_again",
        "_stage_cast",
        "_inline_now",
        "stage_decided",
        "stage_convert",
    )
    saved = [getattr(compat, name) for name in names]
    for name in names:
        setattr(compat, name, lambda *args, **kwargs: None)
    try:
        yield
    finally:
        for name, function in zip(names, saved):
            setattr(compat, name, function)


_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def count_compiles() -> Iterator[list[int]]:
    """Counts XLA compilations in the block (jax.monitoring's backend-compile event)."""
    count = [0]

    def listener(event: str, duration_secs: float, **kwargs: Any) -> None:
        if event == _COMPILE_EVENT:
            count[0] += 1

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield count
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
