"""What a region leaves behind, below every front end: the name-stack markers the rewriter reads
back, the thread-local stack of region states that answers :func:`jamp.is_autocast_enabled`, and
the name of a ``cast_inputs`` call.

This module imports nothing of jamp's but the policy, so the interpreter, the rules and the front
ends (``transform``, ``regions``) can all use it without import circles.
"""

from __future__ import annotations

import contextlib
import functools
import re
import threading
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from .policy import RegionState

# The region state the queries answer, as part of JAX's jit cache key while it is pushed: a
# jitted function whose Python reads ``is_autocast_enabled()`` (or the dtype) at trace time is
# traced again under another state, as torch re-runs Python under autocast, instead of JAX
# answering with the program it traced under another state (inside ``autocast_transform`` and
# outside it, in a disabled region and in an enabled one). Public API, made once at import.
STATE_KEY = jax.make_user_context(None)
_MARKER = re.compile(r"^jamp\.autocast\[(on|off)(?::(\w+))?\]$")
_CAST_INPUTS = re.compile(r"^jamp_cast_inputs_(\w+)$")
_tls = threading.local()


def marker(enabled: bool, dtype: np.dtype | None) -> str:
    """The ``jax.named_scope`` name a region enters."""
    suffix = ":" + dtype.name if dtype is not None else ""
    return f"jamp.autocast[{'on' if enabled else 'off'}{suffix}]"


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
        regions=state.regions + 1,
    )


def region_depth(names: tuple[str, ...]) -> int:
    """How many region markers the scope names ``names`` hold."""
    return sum(1 for name in names if _MARKER.match(name))


def cast_inputs_name(dtype: np.dtype) -> str:
    """The jit name of a ``@jamp.autocast(cast_inputs=dtype)`` call (``rules/calls.py``)."""
    return f"jamp_cast_inputs_{dtype.name}"


@functools.lru_cache(maxsize=1024)  # (asked of every jit a region inlines: a few names)
def cast_inputs_dtype(jit_name: str) -> np.dtype | None:
    """The dtype a ``@jamp.autocast(cast_inputs=...)`` call casts to, from its jit's name."""
    match = _CAST_INPUTS.match(jit_name or "")
    return np.dtype(match.group(1)) if match else None


def _stack() -> list[tuple[bool, np.dtype]]:
    if not hasattr(_tls, "stack"):
        _tls.stack = []
    return _tls.stack


@contextlib.contextmanager
def entered(enabled: bool, dtype: np.dtype) -> Iterator[None]:
    """Push a region state for the trace-time queries (per thread, as torch's autocast state)."""
    stack = _stack()
    stack.append((enabled, dtype))
    try:
        with STATE_KEY((bool(enabled), np.dtype(dtype))):
            yield
    finally:
        stack.pop()


@contextlib.contextmanager
def as_rewritten() -> Iterator[None]:
    """Around binding a program ``autocast_transform`` rewrote, inside a region or another
    transformed function: a disabled scope there, so that its operations run as its own policy
    decided them (the innermost policy wins, as a nested region's does) instead of being
    decided again by the enclosing one. Elsewhere nothing."""
    if not _stack():
        yield
        return
    with jax.named_scope(marker(False, None)), entered(False, get_autocast_dtype()):
        yield


def transform_depth() -> int:
    """How many ``autocast_transform`` traces are running in this thread."""
    return getattr(_tls, "transforms", 0)


@contextlib.contextmanager
def tracing_under(enabled: bool, dtype: np.dtype) -> Iterator[None]:
    """Used by ``autocast_transform`` while it traces the user's function: regions inside only
    leave markers, which its rewriter reads."""
    _tls.transforms = transform_depth() + 1
    try:
        with entered(enabled, dtype):
            yield
    finally:
        _tls.transforms -= 1


def inside_transform() -> bool:
    return transform_depth() > 0


def is_autocast_enabled() -> bool:
    """True inside an enabled ``jamp.autocast`` region (eagerly, or while tracing), or while
    tracing an ``autocast_transform``-ed function outside a disabled region.

    Example::

        with jamp.autocast():
            assert jamp.is_autocast_enabled()
    """
    stack = _stack()
    return bool(stack) and stack[-1][0]


def in_region_state() -> bool:
    """Whether a region (enabled or not) or a transformed function's trace set the state."""
    return bool(_stack())


def get_autocast_dtype() -> np.dtype:
    """Compute dtype of the current region (the default ``bfloat16`` outside any region)."""
    stack = _stack()
    return stack[-1][1] if stack else np.dtype(jnp.bfloat16)
