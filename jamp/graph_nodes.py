"""Flax NNX modules as arguments: split into state, run, write the state back (as ``nnx.jit``).

``autocast_transform(loss_fn)(model, batch)`` with an ``nnx.Module`` works like ``nnx.jit``:
the modules among the arguments are split into a static graph definition and a state of arrays,
the transformed program runs on that state, and the state it ends with (BatchNorm statistics,
RNG counters) is written back into the caller's modules with ``nnx.update``.
"""
from __future__ import annotations

import sys
from typing import Any, Callable

import jax


def _graph_node_types() -> tuple[type, ...]:
    if "flax" not in sys.modules:
        return ()  # no NNX object can exist unless flax was imported
    from flax import nnx
    return tuple(t for t in (getattr(nnx, "Module", None), getattr(nnx, "Object", None),
                             getattr(nnx, "Pytree", None), getattr(nnx, "Variable", None))
                 if isinstance(t, type))


def has_graph_nodes(tree: Any) -> bool:
    """Whether ``tree`` holds NNX modules, objects or variables."""
    types = _graph_node_types()
    return bool(types) and any(
        isinstance(leaf, types)
        for leaf in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, types)))


def _pure(fn: Callable, treedef: Any, node_at: tuple[int, ...]) -> Callable:
    """``fn`` over (graphdef, state, other leaves): returns (output, the modules' final state)."""
    from flax import nnx

    def run(graphdef: Any, state: Any, others: list[Any]) -> tuple[Any, Any]:
        nodes = nnx.merge(graphdef, state)
        leaves = list(others)
        for i, node in zip(node_at, nodes):
            leaves[i] = node
        args, kwargs = jax.tree.unflatten(treedef, leaves)
        out = fn(*args, **kwargs)
        return out, nnx.split(nodes)[1]
    return run


def call_with_graph_nodes(fn: Callable, transform_arrays: Callable[[Callable], Callable],
                          cache: dict[Any, Callable], args: tuple, kwargs: dict) -> Any:
    """Run ``fn`` through ``transform_arrays`` with its NNX modules split out, then update them."""
    from flax import nnx
    types = _graph_node_types()
    leaves, treedef = jax.tree.flatten((args, kwargs), is_leaf=lambda x: isinstance(x, types))
    node_at = tuple(i for i, leaf in enumerate(leaves) if isinstance(leaf, types))
    key = (treedef, node_at)
    if key not in cache:
        cache[key] = transform_arrays(_pure(fn, treedef, node_at))
    nodes = [leaves[i] for i in node_at]
    graphdef, state = nnx.split(nodes)
    others = [None if i in node_at else leaf for i, leaf in enumerate(leaves)]
    out, new_state = cache[key](graphdef, state, others)
    nnx.update(nodes, new_state)
    return out
