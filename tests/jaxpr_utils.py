"""Helpers for inspecting (rewritten) jaxprs in tests."""
from __future__ import annotations

import collections
from typing import Any, Callable, Iterator

import jax

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
        (e.primitive.name, tuple(str(v.aval.dtype) for v in e.invars),
         tuple(str(v.aval.dtype) for v in e.outvars))
        for e in iter_eqns(jaxpr) if keep(e.primitive.name))


def make_jaxpr(fn: Any, *args: Any) -> Any:
    return jax.make_jaxpr(fn)(*args)
