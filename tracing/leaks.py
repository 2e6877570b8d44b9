"""Tracers that outlive their trace, found where the user's code can reach them.

``jax.checking_leaks()`` reports any object still holding the finished trace, including JAX's own
caches: ``jax.checkpoint(..., static_argnums=...)`` and diffrax keep the traced closure in a cache
across calls, which ``checking_leaks`` reports as a leak (and its reporter can fail with a bare
``IndexError``). Leaks that matter are the ones the user's program can read again: a tracer in a
global, a closure variable, a default argument, or an object attribute. After each trace this
module walks what the traced function can reach (its closure cells, the globals its code names,
defaults, bound ``self``, ``functools.partial`` arguments, and the containers and user-defined
objects inside them, with their classes' attributes and methods, ``__call__`` included) and
reports the first tracer found, with the path to it. Library code (installed packages and the
standard library) is not walked: its caches are its own business.
"""

from __future__ import annotations

import functools
import os
import sys
import sysconfig
import types
from collections.abc import Iterator
from typing import Any

from jamp import _compat as compat

MAX_OBJECTS = 20000  # a bound on the walk for very large reachable graphs
MAX_DEPTH = 12

_LIBRARY_DIRS = tuple(
    os.path.realpath(p) + os.sep
    for p in {
        sysconfig.get_paths()["stdlib"],
        sysconfig.get_paths()["purelib"],
        sysconfig.get_paths()["platlib"],
    }
)
_OWN_PACKAGES = ("jamp", "tracing")
_LEAVES = (str, bytes, bytearray, int, float, complex, bool, type(None), range, type(Ellipsis))


def _module_is_library(module_name: str | None) -> bool:
    if not module_name:
        return True
    root = module_name.split(".")[0]
    if root in _OWN_PACKAGES or root in sys.builtin_module_names:
        return True
    module = sys.modules.get(module_name) or sys.modules.get(root)
    if module is None:
        return False  # code exec'd under a name no import registered (a notebook cell, a page)
    path = getattr(module, "__file__", None)
    if path is None:
        return module_name != "__main__"
    return os.path.realpath(path).startswith(_LIBRARY_DIRS)


def _code_names(code: types.CodeType) -> set[str]:
    """Global and attribute names a code object (and the code nested in it) refers to."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def _children(obj: Any, where: str) -> Iterator[tuple[Any, str]]:
    """(object, path) pairs reachable in one step from ``obj``."""
    if isinstance(obj, functools.partial):
        yield obj.func, f"{where}.func"
        for i, arg in enumerate(obj.args):
            yield arg, f"{where}.args[{i}]"
        for key, value in obj.keywords.items():
            yield value, f"{where}.keywords[{key!r}]"
        return
    if isinstance(obj, types.MethodType):
        yield obj.__self__, f"{where}.__self__"
        yield obj.__func__, where
        return
    if isinstance(obj, types.FunctionType):
        for value, expr, context in _function_children(obj):
            yield value, _Root(expr, context)
        return
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield value, f"{where}[{key!r}]"
        return
    if isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield value, f"{where}[{i}]"
        return
    if isinstance(obj, (set, frozenset)):
        for value in obj:
            yield value, f"{where}{{...}}"
        return
    if isinstance(obj, (types.ModuleType, types.BuiltinFunctionType, types.CodeType)):
        return
    if isinstance(obj, type):
        if not _module_is_library(obj.__module__):
            for key, value in vars(obj).items():
                # (``__call__``: what a callable object runs, its globals and closure)
                if not key.startswith("__") or key == "__call__":
                    yield value, f"{obj.__qualname__}.{key}"
            for base in obj.__bases__:  # class attributes read through self, inherited
                yield base, base.__qualname__
        return
    wrapped = getattr(obj, "__wrapped__", None)  # jax.jit(f), functools.wraps
    if wrapped is not None and wrapped is not obj:
        yield wrapped, f"{where}.__wrapped__"
    if _module_is_library(type(obj).__module__) and not hasattr(obj, "__dataclass_fields__"):
        return
    for key, value in getattr(obj, "__dict__", {}).items():
        yield value, f"{where}.{key}"
    for slot in getattr(type(obj), "__slots__", ()):
        if isinstance(slot, str) and hasattr(obj, slot):
            yield getattr(obj, slot), f"{where}.{slot}"
    yield type(obj), type(obj).__qualname__  # its class attributes and methods (``__call__``)


def _function_children(fn: types.FunctionType) -> Iterator[tuple[Any, str, str]]:
    """(object, expression, what the expression is) for what a function's code can read."""
    if _module_is_library(fn.__module__):
        return
    name = fn.__qualname__
    for var, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        try:
            yield cell.cell_contents, f"{var}", f"closed over by {name}"
        except ValueError:  # an empty cell
            continue
    module = fn.__module__
    for key in sorted(_code_names(fn.__code__)):
        if key in fn.__globals__:
            value = fn.__globals__[key]
            yield value, key, f"a global of {module}"
            if isinstance(value, types.ModuleType) and not _module_is_library(value.__name__):
                for attr in sorted(_code_names(fn.__code__)):
                    if attr in vars(value):
                        yield vars(value)[attr], f"{value.__name__}.{attr}", "a global"
    for key, value in vars(fn).items():  # attributes set on the function (memoization)
        yield value, f"{fn.__name__}.{key}", f"an attribute of the function {name}"
    for i, default in enumerate(fn.__defaults__ or ()):
        yield default, f"defaults[{i}]", f"a default argument of {name}"
    for key, default in (fn.__kwdefaults__ or {}).items():
        yield default, key, f"the default of {name}(..., {key}=)"


def _safe_children(obj: Any, where: str) -> list[tuple[Any, str]]:
    """``_children``, or nothing for an object whose attributes cannot be read (a proxy whose
    ``__getattr__`` raises): the walk looks for leaks and must never fail a trace itself."""
    try:
        return list(_children(obj, where))
    except Exception:
        return []


class _Root(str):
    """An expression that starts a new path (a global, a closure variable), with its context."""

    context: str

    def __new__(cls, expr: str, context: str) -> _Root:
        root = super().__new__(cls, expr)
        root.context = context
        return root


def find_leaked_tracer(fn: Any, name: str) -> tuple[Any, str] | None:
    """(tracer, where) for the first tracer reachable from ``fn``, or None; ``where`` reads like
    "`CACHE['k'][0]` (a global of model)"."""
    seen: set[int] = set()
    frontier = [(fn, name, f"the traced function {name}")]
    for _ in range(MAX_DEPTH):
        next_frontier = []
        for obj, where, context in frontier:
            for child, path in _safe_children(obj, where):
                child_context = path.context if isinstance(path, _Root) else context
                if compat.is_tracer(child):
                    return child, f"`{path}` ({child_context})"
                if isinstance(child, _LEAVES) or id(child) in seen:
                    continue
                seen.add(id(child))
                if len(seen) > MAX_OBJECTS:
                    return None
                next_frontier.append((child, str(path), child_context))
        frontier = next_frontier
        if not frontier:
            break
    return None
