"""``autocast_transform`` and ``autocast_jaxpr``: trace, rewrite, evaluate, with a rewrite cache."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable, Optional, Sequence

import jax
import numpy as np

from . import _compat as compat
from . import rules as _rules  # noqa: F401  (registers the higher-order rules)
from . import graph_nodes
from .interpreter import F64, INPUT, Rewriter, is_float
from .policy import Policy, RegionState
from .regions import tracing_under


def resolve_policy(policy: Optional[Policy], dtype: Any = None) -> Policy:
    if policy is None:
        policy = Policy()
    elif not isinstance(policy, Policy):
        raise TypeError(f"policy must be a jamp.Policy, got {type(policy).__name__}")
    return policy if dtype is None else policy.replace(compute_dtype=dtype)


def rewrite_and_eval(closed: Any, policy: Policy, args: Sequence[Any],
                     recorder: Any = None) -> list[Any]:
    """Evaluate ``closed`` on ``args`` under the current JAX trace, rewritten by ``policy``.

    ``recorder`` (see ``report.Recorder``) is told about every equation and inserted cast.
    """
    jaxpr, consts = compat.open_and_consts(closed)
    if policy.cast_inputs:
        args = [compat.convert(x, policy.compute_dtype)
                if _is_castable(compat.aval_of(x).dtype) else x for x in args]
    rewriter = Rewriter(policy, RegionState(enabled=True, dtype=policy.compute_dtype),
                        recorder=recorder)
    outs = rewriter.run(jaxpr, consts, args, [INPUT] * len(args))
    if policy.output_dtype is not None:
        outs = [compat.convert(x, policy.output_dtype)
                if _is_castable(compat.aval_of(x).dtype) else x for x in outs]
    return outs


def _is_castable(dtype: Any) -> bool:
    return is_float(dtype) and np.dtype(dtype) != F64


def autocast_jaxpr(closed_jaxpr: Any, policy: Optional[Policy] = None) -> Any:
    """Rewrite a closed jaxpr under ``policy``; returns a closed jaxpr with the same inputs.

    Example::

        closed = jax.make_jaxpr(f)(x, w)
        mixed = jamp.autocast_jaxpr(closed)          # dot_general now runs in bfloat16
    """
    policy = resolve_policy(policy)
    if not compat.is_jaxpr_like(closed_jaxpr):
        raise TypeError("autocast_jaxpr expects a closed jaxpr (jax.make_jaxpr(f)(...)), "
                        f"got {type(closed_jaxpr).__name__}")
    in_avals = list(closed_jaxpr.in_avals)
    return compat.trace_to_closed(lambda *a: rewrite_and_eval(closed_jaxpr, policy, a), in_avals)


@dataclasses.dataclass
class _Traced:
    closed: Any
    out_tree: Any
    cacheable: bool = True
    rewritten: Any = None  # the rewritten closed jaxpr, built on the first eager call


def _is_traced_leaf(x: Any) -> bool:
    """Arrays and Python numbers are traced; bools, strings and other objects are static."""
    return type(x) is not bool and isinstance(x, (jax.Array, np.ndarray, np.generic, int, float,
                                                  complex))


def _split_static(flat: Sequence[Any], in_tree: Any) -> tuple[list[int], tuple[Any, ...]]:
    """Indices of traced leaves, and the static leaves as ``(index, value)`` pairs (hashable)."""
    traced, static = [], []
    for i, leaf in enumerate(flat):
        if _is_traced_leaf(leaf):
            traced.append(i)
        else:
            static.append((i, leaf))
    try:
        hash(tuple(static))
    except TypeError:
        paths = jax.tree_util.tree_flatten_with_path(jax.tree.unflatten(in_tree, flat))[0]
        for i, leaf in static:
            try:
                hash(leaf)
            except TypeError as err:
                raise TypeError(
                    f"autocast_transform: argument {jax.tree_util.keystr(paths[i][0])} is a "
                    f"{type(leaf).__name__}, neither an array nor a hashable static value; bind it "
                    "with functools.partial before transforming") from err
    return traced, tuple(static)


def autocast_transform(fn: Callable, policy: Optional[Policy] = None, *,
                       dtype: Any = None) -> Callable:
    """torch.autocast for JAX: ``fn`` rewritten op by op under a precision policy.

    The returned function has ``fn``'s signature and composes with ``jax.jit``, ``jax.grad``,
    ``jax.vmap`` and sharding in any order; gradients come back in the primal dtypes. Array and
    number arguments are traced; bools, strings and other hashable leaves (``train=False``,
    ``mutable=["batch_stats"]``) are static, like ``jax.jit``'s static arguments. Flax NNX modules
    among the arguments are split and merged as ``nnx.jit`` does, and their final state (e.g.
    BatchNorm statistics) is written back.

    Example::

        loss_fn = jamp.autocast_transform(loss_fn)                # bfloat16 matmuls
        grads = jax.jit(jax.grad(loss_fn))(params, batch)         # float32 grads for float32 params
        f16 = jamp.autocast_transform(loss_fn, dtype=jnp.float16)
    """
    if not callable(fn):
        raise TypeError(f"autocast_transform expects a callable, got {type(fn).__name__}")
    policy = resolve_policy(policy, dtype)
    on_arrays = _transform_arrays(fn, policy)
    on_graph_state: dict[Any, Callable] = {}  # per argument structure with NNX modules

    @functools.wraps(fn)
    def transformed(*args: Any, **kwargs: Any) -> Any:
        if not graph_nodes.has_graph_nodes((args, kwargs)):
            return on_arrays(*args, **kwargs)
        return graph_nodes.call_with_graph_nodes(
            fn, lambda pure: _transform_arrays(pure, policy), on_graph_state, args, kwargs)

    transformed.policy = policy  # type: ignore[attr-defined]
    return transformed


def trace_call(fn: Callable, policy: Policy, args: tuple, kwargs: dict) -> tuple[Any, ...]:
    """Split a call's arguments into traced leaves and static ones and make the cache key.

    Returns ``(key, flat traced leaves, tracer)`` where ``tracer()`` gives ``(closed jaxpr,
    output tree, cacheable)`` for the traced leaves' avals, with ``fn`` traced inside an enabled
    autocast state (for ``is_autocast_enabled``).
    """
    flat, in_tree = jax.tree.flatten((args, kwargs))
    traced_at, static = _split_static(flat, in_tree)
    flat = [flat[i] for i in traced_at]
    avals = tuple(compat.aval_of(x) for x in flat)

    def flat_fn(*traced_leaves: Any) -> Any:
        leaves = [None] * (len(traced_leaves) + len(static))
        for i, leaf in zip(traced_at, traced_leaves):
            leaves[i] = leaf
        for i, leaf in static:
            leaves[i] = leaf
        call_args, call_kwargs = jax.tree.unflatten(in_tree, leaves)
        return fn(*call_args, **call_kwargs)

    def tracer() -> _Traced:
        # cast_inputs: softmax as one call, which then returns the compute dtype and keeps only
        # its compute-dtype output for the backward pass (rules/custom_ad.py).
        softmax = compat.softmax_as_custom_jvp() if policy.cast_inputs else contextlib.nullcontext()
        with tracing_under(True, policy.compute_dtype), softmax:
            closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*avals)
        # A function closing over an outer trace's values captures tracers: never cache those.
        cacheable = not any(compat.is_tracer(c) for c in compat.open_and_consts(closed)[1])
        return _Traced(closed, jax.tree.structure(out_shape), cacheable=cacheable)

    return (in_tree, avals, static), flat, tracer


def _transform_arrays(fn: Callable, policy: Policy) -> Callable:
    """The transform for arguments that are pytrees of arrays and static leaves."""
    cache: dict[Any, _Traced] = {}

    @functools.wraps(fn)
    def transformed(*args: Any, **kwargs: Any) -> Any:
        key, flat, tracer = trace_call(fn, policy, args, kwargs)
        traced = cache.get(key)
        if traced is None:
            traced = tracer()
            if traced.cacheable:
                cache[key] = traced
        if not traced.cacheable or any(compat.is_tracer(x) for x in flat):
            outs = rewrite_and_eval(traced.closed, policy, flat)
        else:  # eager: rewrite once, then evaluate the rewritten program
            if traced.rewritten is None:
                traced.rewritten = autocast_jaxpr(traced.closed, policy)
            jaxpr, consts = compat.open_and_consts(traced.rewritten)
            outs = compat.eval_jaxpr(jaxpr, consts, flat)
        return jax.tree.unflatten(traced.out_tree, outs)

    return transformed
