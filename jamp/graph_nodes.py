"""Flax NNX modules as arguments: split into state, run, write the state back (as ``nnx.jit``).

``autocast_transform(loss_fn)(model, batch)`` with an ``nnx.Module`` works like ``nnx.jit``:
the modules among the arguments are split into a static graph definition and a state of arrays,
the transformed program runs on that state, and the state it ends with (BatchNorm statistics,
RNG counters) is written back into the caller's modules with ``nnx.update``.

Only the state the function actually assigned is written back, in the dtype the caller's variable
had: under ``Policy(cast_inputs=True)`` the program sees its parameters in the compute dtype, and
writing that view back would round the caller's float32 weights to bfloat16.

``running_statistics`` tells ``cast_inputs`` which arguments are a Flax model's running
statistics (NNX ``BatchStat`` variables, linen's ``batch_stats`` collection), which it leaves in
their dtype.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from . import _compat as compat


def _graph_node_types() -> tuple[type, ...]:
    if "flax" not in sys.modules:
        return ()  # no NNX object can exist unless flax was imported
    return _nnx_graph_node_types()


@functools.cache
def _nnx_graph_node_types() -> tuple[type, ...]:
    from flax import nnx

    return tuple(
        t
        for t in (
            getattr(nnx, "Module", None),
            getattr(nnx, "Object", None),
            getattr(nnx, "Pytree", None),
            getattr(nnx, "Variable", None),
        )
        if isinstance(t, type)
    )


def _batch_stat_types() -> tuple[type, ...]:
    if "flax" not in sys.modules:
        return ()
    from flax import nnx

    batch_stat = getattr(nnx, "BatchStat", None)
    return (batch_stat,) if isinstance(batch_stat, type) else ()


def running_statistics(tree: Any, n_leaves: int) -> list[bool] | None:
    """Per leaf of ``tree`` (``n_leaves`` as JAX flattens it for tracing): whether it is a Flax
    model's running statistics, an NNX ``BatchStat`` or a leaf of linen's ``batch_stats``
    collection, which ``Policy(cast_inputs=True)`` leaves in their dtype as Flax's ``dtype=``
    layers keep them: read in bfloat16, a moving average loses its updates and its weights no
    longer sum to one. ``None`` where there are none (or the leaves do not line up: reference
    views, which tracing splits)."""
    stat_types = _batch_stat_types()

    def is_statistic_node(x: Any) -> bool:
        return bool(stat_types) and isinstance(x, stat_types)

    marks: list[bool] = []
    for path, node in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_statistic_node)[0]:
        statistic = is_statistic_node(node) or any(
            getattr(key, "key", None) == "batch_stats" for key in path
        )
        marks.extend([statistic] * len(jax.tree.leaves(node)))
    return marks if any(marks) and len(marks) == n_leaves else None


# Tree structures known to hold no NNX object, so the check on every call of a transformed
# function flattens in C++ and looks the structure up instead of calling an ``is_leaf`` per node
# (0.6 ms for a 200-leaf linen model). Bounded, and only negative answers, which hold no module.
_STRUCTURES_WITHOUT_GRAPH_NODES: set[Any] = set()
_MAX_STRUCTURES = 256


def has_graph_nodes(tree: Any) -> bool:
    """Whether ``tree`` holds NNX modules, objects or variables."""
    types = _graph_node_types()
    if not types:
        return False
    leaves, structure = jax.tree.flatten(tree)
    if _leaves_hold_graph_node(leaves, types):  # (an object that is no pytree)
        return True
    try:
        if structure in _STRUCTURES_WITHOUT_GRAPH_NODES:
            return False
    except (TypeError, ValueError):  # (a node's static data cannot be hashed or compared)
        return _holds_graph_node(tree, types)
    if _holds_graph_node(tree, types):
        return True
    if len(_STRUCTURES_WITHOUT_GRAPH_NODES) >= _MAX_STRUCTURES:
        _STRUCTURES_WITHOUT_GRAPH_NODES.clear()
    _STRUCTURES_WITHOUT_GRAPH_NODES.add(structure)
    return False


def _leaves_hold_graph_node(leaves: list[Any], types: tuple[type, ...]) -> bool:
    # ``isinstance(x, nnx.Variable)`` runs Python (flax's metaclass also takes some tracers
    # for variables), a microsecond a leaf: arrays and tracers of plain arrays, never NNX
    # objects, are told apart by type first.
    if set(map(type, leaves)) <= _NEVER_GRAPH_NODES:
        return False
    return any(
        isinstance(leaf, types)
        for leaf in leaves
        if type(leaf) not in _NEVER_GRAPH_NODES
        and not (isinstance(leaf, compat.Tracer) and type(leaf.aval) is compat.ShapedArray)
    )


_NEVER_GRAPH_NODES = frozenset(
    {compat.ArrayImpl, np.ndarray, int, float, bool, complex, type(None)}
)


def _holds_graph_node(tree: Any, types: tuple[type, ...]) -> bool:
    # NNX objects are pytrees (their variables are the leaves): stop at them to see them.
    return any(
        isinstance(leaf, types)
        for leaf in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, types))
    )


def _pure(fn: Callable, treedef: Any, node_at: tuple[int, ...]) -> Callable:
    """``fn`` over (graphdef, state, other leaves): returns (output, what became of the state).

    The second output is a list with one entry per state leaf: the new value where the function
    assigned one, None where the leaf is still the value it was given (so it is not written back).
    If the function changed the state's structure (created or removed variables), it is a tuple:
    the whole new state, and that list for the leaves it was given (None also where removed).
    """
    from flax import nnx

    def run(graphdef: Any, state: Any, others: list[Any]) -> tuple[Any, Any]:
        # Read the leaves first: merged modules may share the state's Variables, and the
        # function's assignments then show in ``state`` too.
        given, given_def = jax.tree.flatten(state)
        given_paths = _leaf_paths(state)
        nodes = nnx.merge(graphdef, state)
        leaves = list(others)
        for i, node in zip(node_at, nodes):
            leaves[i] = node
        args, kwargs = jax.tree.unflatten(treedef, leaves)
        out = fn(*args, **kwargs)
        new_state = nnx.split(nodes)[1]
        final, final_def = jax.tree.flatten(new_state)
        if final_def != given_def:  # type: ignore[operator]  # jaxlib has no PyTreeDef stub
            now = dict(zip(_leaf_paths(new_state), final))
            assigned = [
                None if now.get(path, old) is old else now[path]
                for path, old in zip(given_paths, given)
            ]
            return out, (new_state, assigned)
        return out, [None if new is old else new for new, old in zip(final, given)]

    return run


def _leaf_paths(state: Any) -> list[tuple]:
    """The key paths of ``state``'s leaves, in ``jax.tree.flatten``'s order."""
    return [path for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]]


def _as_caller_had(new: Any, old: Any) -> Any:
    """A written-back leaf in the dtype of the caller's leaf it replaces."""
    dtype = getattr(old, "dtype", None)
    if dtype is None or getattr(new, "dtype", dtype) == dtype:
        return new
    return jax.numpy.asarray(new).astype(dtype) if np.dtype(dtype).kind in "fc" else new


def call_with_graph_nodes(
    fn: Callable,
    transform_arrays: Callable[[Callable], Callable],
    cache: dict[Any, Callable],
    args: tuple,
    kwargs: dict,
) -> Any:
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
    out, changed = cache[key](graphdef, state, others)
    given, given_def = jax.tree.flatten(state)
    if isinstance(changed, list):  # only the assigned leaves, in the caller's dtypes
        if all(new is None for new in changed):
            # Nothing to write back: updating anyway would set the caller's Variables, which
            # NNX refuses when they belong to an outer trace (an nnx.State under jax.grad).
            return out
        final = [
            old if new is None else _as_caller_had(new, old) for new, old in zip(changed, given)
        ]
        nnx.update(nodes, jax.tree.unflatten(given_def, final))
    else:
        # Variables created or removed: the new state, where each variable the caller had is
        # written back as above (not assigned: the caller's own value, not the program's view
        # of it; assigned: in the caller's dtype), and a created one as the function made it.
        new_state, assigned = changed
        caller_had = {
            path: (old, new) for path, old, new in zip(_leaf_paths(state), given, assigned)
        }

        def as_caller_had(path: tuple, leaf: Any) -> Any:
            if path not in caller_had:
                return leaf
            old, new = caller_had[path]
            return old if new is None else _as_caller_had(new, old)

        nnx.update(nodes, jax.tree_util.tree_map_with_path(as_caller_had, new_state))
    return out
