"""``jamp.autocast``: torch's autocast region, as a context manager and a decorator.

Inside a function being traced by ``autocast_transform`` a region is recorded as a
``jax.named_scope``; the rewriter reads it back from each equation's name stack, so regions
survive helper functions and ``jax.jit``-ed callees. Anywhere else (eagerly, inside ``jax.jit``,
``grad``, ``vmap``...) the outermost enabled region pushes a :class:`~jamp.region_trace.RegionTrace`
that applies the policy to every operation bound inside it; regions nested in it leave markers
that it reads. A thread-local stack (``region_stack``) answers :func:`is_autocast_enabled` and
:func:`get_autocast_dtype`, eagerly and at trace time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from . import _compat as compat
from . import region_trace
from .call_args import as_static, function_name, short_repr
from .policy import COMPUTE_DTYPES, Policy
from .region_stack import (
    cast_inputs_name,
    entered,
    get_autocast_dtype,
    in_region_state,
    inside_transform,
    is_autocast_enabled,
    marker,
)
from .transform import autocast_transform, check_transformable, is_castable, resolve_policy


class AutocastWarning(UserWarning):
    """jamp was asked for something that has no effect where it was asked."""


_ARRAYS = (jax.Array, np.ndarray, np.generic)  # what a cast_inputs call passes as traced


@dataclasses.dataclass
class _OpenRegion:
    """A region entered with ``__enter__``: which ``autocast`` entered it, its contexts, and
    whether its ``__exit__`` came while regions entered after it were open (it closes after
    them)."""

    owner: autocast
    exits: contextlib.ExitStack
    exit_requested: bool = False


# The regions this thread entered with ``__enter__`` and has not exited, innermost last: their
# contexts (JAX's current trace, the name stack) can only be left in the reverse order. Per
# thread, not per ``autocast`` object: one object may be open in several threads at once.
_open = threading.local()


def _open_regions() -> list[_OpenRegion]:
    if not hasattr(_open, "stacks"):
        _open.stacks = []
    return _open.stacks


class autocast:  # noqa: N801 - named like torch.autocast on purpose
    """Autocast region (context manager) and decorator, with torch's region semantics.

    Anywhere, eagerly or inside ``jax.jit``/``grad``/``vmap``/``scan``, the operations bound in
    the block run under the policy::

        with jamp.autocast():                  # bfloat16, the default policy's tables
            y = x @ w                          # bfloat16
            z = jnp.exp(y)                     # float32
        with jamp.autocast(dtype=jnp.float16):  # another compute dtype
            ...
        with jamp.autocast(jamp.Policy(jnp.float16, rules=(("*head*", None),))):
            ...                                # a whole policy (outermost region only)

    Nested regions (``enabled=False`` inside, another ``dtype=`` inside) win inside, and leaving
    a block (also by an exception) restores the state before it. Entered and exited by hand,
    regions leave in the reverse order they entered, in the thread that entered them; exiting
    one twice raises ``RuntimeError``, and so does exiting one out of order, which then stays
    open until the regions entered after it have exited. Inside a function
    transformed by :func:`jamp.autocast_transform` a region changes that transform's state
    instead.

    As a decorator, ``@jamp.autocast(dtype=...)`` makes a region when the function is called
    inside a region or a transformed function and applies ``autocast_transform`` itself when
    called anywhere else (a Python ``int`` given as a whole argument is static there, a
    ``float`` traced). ``@jamp.autocast(enabled=False, cast_inputs=jnp.float32)`` is torch's
    ``custom_fwd(cast_inputs=torch.float32)``: inside an enabled region the function runs with
    autocast off and its floating (non-float64) inputs cast to float32.
    """

    def __init__(
        self,
        dtype: Policy | DTypeLike | None = None,
        enabled: bool = True,
        cast_inputs: DTypeLike | None = None,
    ):
        if not isinstance(enabled, (bool, np.bool_)):
            raise TypeError(
                "jamp.autocast(enabled=...) must be a Python bool known at trace time, "
                f"got {type(enabled).__name__}; use lax.cond for data-dependent choices"
            )
        self.policy = dtype if isinstance(dtype, Policy) else None
        if self.policy is not None:
            _check_region_policy(self.policy)
        self.dtype = self.policy.compute_dtype if self.policy else _region_dtype(dtype, "dtype")
        self.enabled = bool(enabled)
        self.cast_inputs = _region_dtype(cast_inputs, "cast_inputs")
        self._inherits_dtype = dtype is None  # (neither a dtype nor a policy given)

    def __enter__(self) -> autocast:
        if self.cast_inputs is not None:
            raise ValueError(
                "jamp.autocast(cast_inputs=...) applies to decorated functions only; "
                "cast explicitly with x.astype(...) inside a `with` block"
            )
        _open_regions().append(_OpenRegion(self, self._open_region()))
        return self

    def __exit__(self, *exc: Any) -> None:
        stacks = _open_regions()
        mine = [
            i for i, entry in enumerate(stacks) if entry.owner is self and not entry.exit_requested
        ]
        if not mine:
            raise RuntimeError(
                "jamp.autocast: __exit__ of a region that is not open here (exited twice, never "
                "entered, or entered in another thread)"
            )
        if mine[-1] != len(stacks) - 1:
            # Leaving it now would restore the state before it under the regions entered since.
            # Kept open, it closes when they have (an asyncio task or a generator holding a
            # region exits out of order and nothing would ever exit it again).
            stacks[mine[-1]].exit_requested = True
            raise RuntimeError(
                "jamp.autocast: a region exited while a region entered after it is still open "
                "(in this thread: another asyncio task's, or a suspended generator's?); it stays "
                "open until those exit, then closes. Exit regions in the reverse order of "
                "entering them, as `with` blocks do"
            )
        try:
            # The exception goes through the region's contexts (the region trace notes loop
            # errors).
            stacks.pop().exits.__exit__(*exc)
        finally:
            while stacks and stacks[-1].exit_requested:
                stacks.pop().exits.__exit__(None, None, None)

    def __call__(self, fn: Callable) -> Callable:
        if not callable(fn):
            raise TypeError(f"jamp.autocast(...) decorates a callable, got {type(fn).__name__}")
        # (in a region too: a generator's or coroutine's body would run after the region closed)
        check_transformable(fn, where="jamp.autocast(...)")
        # This function's transforms by policy (one autocast object may decorate several
        # functions: kept on the object, they were found by policy alone and ran the first).
        transforms: dict[Policy, Callable] = {}

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if inside_transform() or region_trace.active() or _bound_linen_method(args):
                if self.cast_inputs is None:
                    with self._open_region():
                        return fn(*args, **kwargs)
                return self._cast_inputs_call(fn, self.cast_inputs, args, kwargs)
            if not self.enabled:  # autocast is already off outside regions
                return fn(*args, **kwargs)
            policy = self._region_policy()
            if self._inherits_dtype and in_region_state():
                policy = _default_policy(get_autocast_dtype())  # (a disabled region's dtype=)
            transformed = transforms.get(policy)
            if transformed is None:
                transformed = transforms[policy] = autocast_transform(fn, policy)
            # A Python int given as a whole argument is static, as the function's own Python
            # would see it under torch's decorator (a shape, an axis, a loop count); a float
            # stays traced as autocast_transform traces it (a changing learning rate).
            args = tuple(_static_if_int(a) for a in args)
            kwargs = {k: _static_if_int(v) for k, v in kwargs.items()}
            return transformed(*args, **kwargs)

        return compat.api_boundary(wrapper)  # (fn's errors show fn's frames, as under jax.jit)

    def _cast_inputs_call(self, fn: Callable, dtype: np.dtype, args: tuple, kwargs: dict) -> Any:
        """Call ``fn`` as a jit the rewriter recognises by its name (see rules/calls.py): at trace
        time the inputs still have their traced dtypes, so the rewriter does the cast.

        Only array leaves cross the jit boundary; everything else (``self``, a Python bool or
        number, a string) is passed through as it came, like the static arguments of
        ``autocast_transform``. So do the outputs: only JAX arrays come out of the jit, and any
        other leaf (a string, a dtype, a Python number) comes back as the function returned it,
        as it does outside a region. (The jit is new each call, so the function's Python runs,
        and its other outputs are read, on every call. It is not cached: its inputs' other
        leaves may be mutable or unhashable, and what the enclosing regions decide is no part
        of a jit's cache key.)
        """
        flat, tree = jax.tree.flatten((args, kwargs))
        traced_at = [i for i, leaf in enumerate(flat) if isinstance(leaf, _ARRAYS)]
        returned: list[Any] = []  # the output leaves, the output tree, where its arrays are

        def region(*traced: Any) -> list[Any]:
            leaves = list(flat)
            for i, leaf in zip(traced_at, traced):
                # Cast here too, before the body's Python reads its inputs (as torch's custom_fwd
                # does): a value a region or the program made 16-bit arrives traced 16-bit, and
                # code reading its dtype (jnp.finfo(x.dtype), jnp.zeros_like(x)) must see dtype.
                leaves[i] = leaf.astype(dtype) if is_castable(leaf) else leaf
            call_args, call_kwargs = jax.tree.unflatten(tree, leaves)
            with self._open_region():
                out = fn(*call_args, **call_kwargs)
            out_leaves, out_tree = jax.tree.flatten(out)
            arrays_at = [i for i, leaf in enumerate(out_leaves) if isinstance(leaf, jax.Array)]
            returned[:] = [out_leaves, out_tree, arrays_at]
            return [out_leaves[i] for i in arrays_at]

        region.__name__ = cast_inputs_name(dtype)
        arrays = jax.jit(region)(*(flat[i] for i in traced_at))
        out_leaves, out_tree, arrays_at = returned
        out_leaves = list(out_leaves)
        for i, array in zip(arrays_at, arrays, strict=True):
            out_leaves[i] = array
        return jax.tree.unflatten(out_tree, out_leaves)

    def _open_region(self) -> contextlib.ExitStack:
        """Enter the named scope the rewriter and the region trace read, the state the queries
        answer, and (outermost enabled region outside a transform) the region trace."""
        outermost = not inside_transform() and not region_trace.active()
        policy = self.policy
        default = None if policy is None else Policy(policy.compute_dtype)
        if policy is not None and not outermost and policy != default:
            differ = [
                f.name
                for f in dataclasses.fields(Policy)
                if getattr(policy, f.name) != getattr(default, f.name)
            ]
            fields = ", ".join(differ)
            where = (
                # (the transform's policy is the one that applies here: explain's or
                # autocast_transform's, given by policy=)
                "in a function traced by jamp.explain or jamp.autocast_transform, whose policy "
                f"applies instead: give {policy!r} to them as policy=, and open the region "
                "with its compute dtype"
                if inside_transform()
                else "inside another region, whose policy applies instead: give it to the "
                "outermost region, and open this one with its compute dtype"
            )
            raise ValueError(
                f"jamp.autocast({policy!r}): a region's Policy applies in the outermost region "
                f"only, and this one is {where}: jamp.autocast(dtype=jnp."
                f"{policy.compute_dtype.name}) (what the Policy sets beyond that dtype: {fields})"
            )
        with contextlib.ExitStack() as exits:  # left as it was if entering raises
            exits.enter_context(jax.named_scope(marker(self.enabled, self.dtype)))
            if self.dtype is not None:
                dtype = self.dtype
            elif is_autocast_enabled() or not outermost or in_region_state():
                # (inside a disabled region too: its dtype= is the one autocast() then takes,
                # as torch's autocast(enabled=False, dtype=...) sets it)
                dtype = get_autocast_dtype()
            else:
                dtype = self._region_policy().compute_dtype
            exits.enter_context(entered(self.enabled, dtype))
            if self.enabled and outermost:
                exits.enter_context(region_trace.pushed(self._region_policy()))
            elif self.enabled:
                region_trace.entered_nested(dtype)
            return exits.pop_all()

    def _region_policy(self) -> Policy:
        """The policy of an outermost region: the one given, else the default tables in
        ``dtype`` (the default policy's bfloat16 without one)."""
        if self.policy is None:
            self.policy = _default_policy(self.dtype)
        return self.policy


def _static_if_int(value: Any) -> Any:
    return as_static(value) if isinstance(value, int) and not isinstance(value, bool) else value


def _check_region_policy(policy: Policy) -> None:
    """A region has no inputs and no outputs of its own: the policy fields that act on a
    function's are refused rather than ignored."""
    refused = {
        "cast_inputs": (policy.cast_inputs, "casts the inputs of a transformed function"),
        "output_dtype": (policy.output_dtype, "casts the outputs of a transformed function"),
    }
    for field, (value, what) in refused.items():
        if value:
            raise ValueError(
                f"jamp.autocast(policy): Policy({field}=...) {what}, and a region has none; use "
                f"jamp.autocast_transform(fn, policy), or cast explicitly with x.astype(...) in "
                "the block"
            )


def _region_dtype(value: Any, name: str) -> np.dtype | None:
    if value is None:
        return None
    if isinstance(value, type) and issubclass(value, Policy):
        raise TypeError(
            f"jamp.autocast({name}=jamp.Policy): the Policy class, not a policy; pass an instance, "
            "e.g. jamp.autocast(jamp.Policy(jnp.float16)), or a dtype"
        )
    if callable(value) and not isinstance(value, type) and name == "dtype":
        # (np.dtype reads any class, a dtype's scalar type included; a function it does not)
        raise TypeError(
            f"jamp.autocast(dtype=...) got the function {function_name(value)}: as a decorator "
            "it takes parentheses, @jamp.autocast() (or @jamp.autocast(dtype=jnp.float16))"
        )
    try:
        dtype = np.dtype(value)
    except TypeError:
        raise TypeError(
            f"jamp.autocast({name}={short_repr(value)}): not a dtype; pass a floating dtype "
            "such as jnp.bfloat16 or jnp.float16"
            + (" (or a jamp.Policy as the first argument)" if name == "dtype" else "")
        ) from None
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"jamp.autocast({name}=...) must be a floating dtype, got {dtype.name}")
    if name == "dtype" and dtype not in COMPUTE_DTYPES:
        # (refused here, not when entered: a disabled region's dtype is the one the regions
        # nested in it compute in)
        raise ValueError(
            f"jamp.autocast(dtype=jnp.{dtype.name}): a region computes in bfloat16, float16, "
            "float32 or float8_e4m3fn"
            + (
                "; float64 values are never cast, and run in float64 in any region"
                if dtype == np.float64
                else "; float8_e5m2 is the cotangents' format of a float8_e4m3fn region"
                if dtype == np.dtype(jnp.float8_e5m2)
                else ""
            )
        )
    return dtype


@functools.cache  # (a Policy is immutable: every `jamp.autocast()` of one dtype shares it)
def _default_policy(dtype: np.dtype | None) -> Policy:
    return resolve_policy(None, dtype, where="jamp.autocast")


def _bound_linen_method(args: tuple) -> bool:
    """A Flax linen module's method (``self`` first): its module holds its variables in a scope
    a transformed program could neither take as a static argument nor create parameters in
    (``model.init``), so the decorated method runs as a region wherever it is called."""
    linen = sys.modules.get("flax.linen")  # (no linen module exists unless flax.linen was imported)
    return linen is not None and bool(args) and isinstance(args[0], linen.Module)
