"""``jamp.autocast``: regions inside transformed functions, and the decorator.

A region is recorded as a ``jax.named_scope`` at trace time; the interpreter reads it back from
each equation's name stack, so regions survive helper functions and ``jax.jit``-ed callees. While
``autocast_transform`` traces the user's function it also keeps a thread-local stack of region
states, which answers the trace-time queries :func:`is_autocast_enabled` and
:func:`get_autocast_dtype`.
"""

from __future__ import annotations

import contextlib
import functools
import re
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .policy import RegionState


class AutocastWarning(UserWarning):
    """jamp was asked for something that has no effect where it was asked."""


_MARKER = re.compile(r"^jamp\.autocast\[(on|off)(?::(\w+))?\]$")
_tls = threading.local()


def _stack() -> list[tuple[bool, np.dtype]]:
    if not hasattr(_tls, "stack"):
        _tls.stack = []
    return _tls.stack


def marker(enabled: bool, dtype: np.dtype | None) -> str:
    return f"jamp.autocast[{'on' if enabled else 'off'}{':' + dtype.name if dtype is not None else ''}]"


def apply_marker(name: str, state: RegionState) -> RegionState | None:
    """The state inside a scope called ``name`` if it is a region marker, else None."""
    match = _MARKER.match(name)
    if match is None:
        return None
    dtype = np.dtype(match.group(2)) if match.group(2) else state.dtype
    return RegionState(
        enabled=match.group(1) == "on",
        dtype=dtype,
        path=state.path,
        matched=state.matched,
        decided_by="region",
    )


@contextlib.contextmanager
def tracing_under(enabled: bool, dtype: np.dtype) -> Iterator[None]:
    """Used by ``autocast_transform`` while it traces the user's function."""
    stack = _stack()
    stack.append((enabled, dtype))
    try:
        yield
    finally:
        stack.pop()


def inside_transform() -> bool:
    return bool(_stack())


def is_autocast_enabled() -> bool:
    """True while tracing inside an enabled region of an ``autocast_transform``-ed function.

    Example::

        def f(x):
            return x * 2 if jamp.is_autocast_enabled() else x
    """
    stack = _stack()
    return bool(stack) and stack[-1][0]


def get_autocast_dtype() -> np.dtype:
    """Compute dtype of the current region (the default ``bfloat16`` outside any transform)."""
    stack = _stack()
    return stack[-1][1] if stack else np.dtype(jnp.bfloat16)


_ARRAYS = (jax.Array, np.ndarray, np.generic)  # what a cast_inputs call passes as traced
_CAST_INPUTS = re.compile(r"^jamp_cast_inputs_(\w+)$")


def cast_inputs_dtype(jit_name: str) -> np.dtype | None:
    """The dtype a ``@jamp.autocast(cast_inputs=...)`` call casts to, from its jit's name."""
    match = _CAST_INPUTS.match(jit_name or "")
    return np.dtype(match.group(1)) if match else None


class autocast:  # noqa: N801 - named like torch.autocast on purpose
    """Autocast region (context manager) and decorator.

    Inside a function transformed by :func:`jamp.autocast_transform`::

        with jamp.autocast(enabled=False):     # ops see the dtypes their inputs have
            y = x @ w
        with jamp.autocast(dtype=jnp.float16):  # another compute dtype here
            z = x @ w

    As a decorator, ``@jamp.autocast(dtype=...)`` makes a region when the function is called inside
    a transformed function and applies ``autocast_transform`` itself when called anywhere else.
    ``@jamp.autocast(enabled=False, cast_inputs=jnp.float32)`` is torch's
    ``custom_fwd(cast_inputs=torch.float32)``: inside an enabled region the function runs with
    autocast off and its floating (non-float64) inputs cast to float32.
    """

    def __init__(self, dtype: Any = None, enabled: bool = True, cast_inputs: Any = None):
        if not isinstance(enabled, (bool, np.bool_)):
            raise TypeError(
                "jamp.autocast(enabled=...) must be a Python bool known at trace time, "
                f"got {type(enabled).__name__}; use lax.cond for data-dependent choices"
            )
        self.dtype = _region_dtype(dtype, "dtype")
        self.enabled = bool(enabled)
        self.cast_inputs = _region_dtype(cast_inputs, "cast_inputs")
        self._entered: list[contextlib.ExitStack] = []
        self._transformed: Callable | None = None

    def __enter__(self) -> autocast:
        if self.cast_inputs is not None:
            raise ValueError(
                "jamp.autocast(cast_inputs=...) applies to decorated functions only; "
                "cast explicitly with x.astype(...) inside a `with` block"
            )
        if not inside_transform():
            warnings.warn(
                "jamp.autocast() has no effect outside a function transformed by "
                "jamp.autocast_transform: JAX has no global autocast state. Transform the function "
                "(jamp.autocast_transform(fn)) or decorate it with @jamp.autocast().",
                AutocastWarning,
                stacklevel=2,
            )
        self._entered.append(self._open_region())
        return self

    def __exit__(self, *exc: Any) -> None:
        self._entered.pop().close()

    def __call__(self, fn: Callable) -> Callable:
        if not callable(fn):
            raise TypeError(f"jamp.autocast(...) decorates a callable, got {type(fn).__name__}")

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if inside_transform():
                if self.cast_inputs is None:
                    with self._open_region():
                        return fn(*args, **kwargs)
                return self._cast_inputs_call(fn, self.cast_inputs, args, kwargs)
            if not self.enabled:  # autocast is already off outside transforms
                return fn(*args, **kwargs)
            if self._transformed is None:
                from .transform import autocast_transform

                self._transformed = autocast_transform(fn, dtype=self.dtype)
            return self._transformed(*args, **kwargs)

        return wrapper

    def _cast_inputs_call(self, fn: Callable, dtype: np.dtype, args: tuple, kwargs: dict) -> Any:
        """Call ``fn`` as a jit the rewriter recognises by its name (see rules/calls.py): at trace
        time the inputs still have their traced dtypes, so the rewriter does the cast.

        Only array leaves cross the jit boundary; everything else (``self``, a Python bool or
        number, a string) is passed through as it came, like the static arguments of
        ``autocast_transform``.
        """
        flat, tree = jax.tree.flatten((args, kwargs))
        traced_at = [i for i, leaf in enumerate(flat) if isinstance(leaf, _ARRAYS)]

        def region(*traced: Any) -> Any:
            leaves = list(flat)
            for i, leaf in zip(traced_at, traced):
                leaves[i] = leaf
            call_args, call_kwargs = jax.tree.unflatten(tree, leaves)
            with self._open_region():
                return fn(*call_args, **call_kwargs)

        region.__name__ = f"jamp_cast_inputs_{dtype.name}"
        return jax.jit(region)(*(flat[i] for i in traced_at))

    def _open_region(self) -> contextlib.ExitStack:
        """Enter the named scope the interpreter reads, and the trace-time state."""
        exits = contextlib.ExitStack()
        exits.enter_context(jax.named_scope(marker(self.enabled, self.dtype)))
        if inside_transform():
            exits.enter_context(tracing_under(self.enabled, self.dtype or get_autocast_dtype()))
        return exits


def _region_dtype(value: Any, name: str) -> np.dtype | None:
    if value is None:
        return None
    dtype = np.dtype(value)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"jamp.autocast({name}=...) must be a floating dtype, got {dtype.name}")
    return dtype
