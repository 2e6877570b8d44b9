"""Pytree structures as ``jax.export`` can write them, and back.

``jax.export`` serializes tuples, lists, None, dicts with string keys, and the node types
registered with it. On export, tracing registers the others under ``module.QualName``:
namedtuples, and custom nodes whose auxiliary data is plain data (None, bools, numbers, strings,
and tuples, lists and string-keyed dicts of them), which covers Flax's own nodes:
``LogicallyPartitioned``/``Partitioned`` boxes, ``nnx.State`` and ``nnx.Variable``s (``Param``,
``BatchStat``, ...). ``load`` registers them the same way, looking the class up in the modules
the loading process has already imported (it never imports a module a blob names).

A builtin dict whose keys are not all strings (an ``nnx.List`` of layers gives an ``nnx.State``
holding ``{0: ..., 1: ...}``) is stored as a :class:`KeyedDict` node, its keys (str, int, float,
bool or None) in the auxiliary data with their types, and restored to the dict on load. Other
keys (a tuple, an object) would not come back as they were: export refuses them. An output dict
the function returned in another order than the sorted one is stored the same way, its keys in
that order (``export.py``), so it comes back in it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import jax

_REGISTERED: set[type] = set()
_BUILTIN_NODES = (tuple, list, dict, type(None))
KEY_TYPES = (str, int, float, bool, type(None))  # dict keys an export stores exactly


def serialized_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


class KeyedDict:
    """A builtin dict whose keys are not all strings, or an output dict out of sorted order, as
    an export stores it (``jax.export`` writes dicts with sorted string keys only): the keys, in
    the dict's pytree order (for an output dict, the function's), and the values.
    ``tracing.load`` gives the dict back; ``jax.export.deserialize`` shows this node."""

    __slots__ = ("keys", "values")

    def __init__(self, keys: Sequence[Any], values: Sequence[Any]) -> None:
        self.keys = tuple(keys)
        self.values = list(values)

    def __repr__(self) -> str:
        return f"KeyedDict({dict(zip(self.keys, self.values))!r})"


jax.tree_util.register_pytree_with_keys(
    KeyedDict,
    lambda d: ([(jax.tree_util.DictKey(k), v) for k, v in zip(d.keys, d.values)], d.keys),
    lambda keys, values: KeyedDict(keys, list(values)),
    flatten_func=lambda d: (d.values, d.keys),
)


def storable(treedef: Any, where: str, label: str = "export") -> Any:
    """``treedef`` with its non-string-keyed dicts as ``KeyedDict``s, every node type registered
    for serialization. Raises TypeError naming the dict (``inputs[0]['layers']``) for a key
    that cannot round-trip."""
    converted = _map_dicts(treedef, _keyed, where, label)
    _register_nodes(converted)
    return converted


def restored(treedef: Any) -> Any:
    """``treedef`` with its ``KeyedDict``s back as the dicts they stand for."""
    return _map_dicts(treedef, _unkeyed, "", "load")


def _keyed(kind: type, aux: Any) -> tuple[type, Any] | None:
    if kind is dict and not all(type(k) is str for k in aux):
        if not all(type(k) in KEY_TYPES for k in aux):
            raise _UnstorableKey(next(k for k in aux if type(k) not in KEY_TYPES))
        return KeyedDict, tuple(aux)
    return None


def _unkeyed(kind: type, aux: Any) -> tuple[type, Any] | None:
    return (dict, list(aux)) if kind is KeyedDict else None


class _UnstorableKey(Exception):
    def __init__(self, key: Any) -> None:
        self.key = key


def _map_dicts(treedef: Any, convert: Any, where: str, label: str) -> Any:
    try:
        return _rebuild(treedef, convert)
    except _UnstorableKey as err:
        tree = jax.tree.unflatten(treedef, range(treedef.num_leaves))
        path = _path_to_key(tree, err.key)
        at = f"the dict at {where}{jax.tree_util.keystr(path)}" if path is not None else "a dict"
        raise TypeError(
            f"{label}: {at} has the key {err.key!r} (a {type(err.key).__name__}), which an "
            "export cannot store so that it comes back as it was: dict keys must be str, int, "
            "float, bool or None. Use such keys, or a pytree node of your own registered with "
            "jax.export.register_pytree_node_serialization"
        ) from None


def _rebuild(treedef: Any, convert: Any) -> Any:
    node = treedef.node_data()
    if node is None:  # a leaf
        return treedef
    children = [_rebuild(child, convert) for child in treedef.children()]
    node = convert(*node) or node
    return jax.tree_util.PyTreeDef.from_node_data_and_children(
        jax.tree_util.default_registry, node, children
    )


def _path_to_key(tree: Any, key: Any, path: tuple = ()) -> tuple | None:
    """The key path of the first builtin dict in ``tree`` holding ``key``."""
    if type(tree) is dict and any(k is key for k in tree):  # the treedef's own key object
        return path
    try:
        children, _ = jax.tree_util.flatten_one_level_with_keys(tree)
    except ValueError:  # a leaf
        return None
    for entry, child in children:
        found = _path_to_key(child, key, (*path, entry))
        if found is not None:
            return found
    return None


def _register_nodes(treedef: Any) -> None:
    """Register every node type of ``treedef`` that jax.export cannot serialize natively."""
    node = treedef.node_data()
    if node is not None and node[0] not in _BUILTIN_NODES:
        register(node[0])
    for child in treedef.children():
        _register_nodes(child)


def _is_namedtuple(cls: type) -> bool:
    return issubclass(cls, tuple) and hasattr(cls, "_fields")


def register(cls: type) -> None:
    """Register ``cls`` with ``jax.export``'s serialization (once; a user's own registration of
    it, under any name, is kept)."""
    if cls in _REGISTERED:
        return
    try:
        if _is_namedtuple(cls):
            jax.export.register_namedtuple_serialization(cls, serialized_name=serialized_name(cls))
        else:
            jax.export.register_pytree_node_serialization(
                cls,
                serialized_name=serialized_name(cls),
                serialize_auxdata=lambda aux, cls=cls: encode_aux(cls, aux),
                deserialize_auxdata=decode_aux,
            )
    except ValueError:  # registered before (by the user, or under another name): theirs is used
        pass
    _REGISTERED.add(cls)


# Auxiliary data as JSON, with tuples and lists told apart: plain data only, so loading a blob
# never runs code (no pickle).
def _to_json(value: Any, cls: type) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        return {"tuple" if isinstance(value, tuple) else "list": [_to_json(v, cls) for v in value]}
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"dict": {k: _to_json(v, cls) for k, v in value.items()}}
    raise TypeError(
        f"the pytree node {serialized_name(cls)} has auxiliary data holding a "
        f"{type(value).__name__} ({value!r:.80}), which tracing can only serialize when it is "
        "plain data (None, bool, numbers, strings, tuples, lists, dicts with string keys); "
        "register the node yourself with jax.export.register_pytree_node_serialization"
    )


def _from_json(value: Any) -> Any:
    if isinstance(value, dict):
        ((kind, content),) = value.items()
        if kind == "dict":
            return {k: _from_json(v) for k, v in content.items()}
        items = [_from_json(v) for v in content]
        return tuple(items) if kind == "tuple" else items
    return value


def encode_aux(cls: type, aux: Any) -> bytes:
    return json.dumps(_to_json(aux, cls)).encode()


def decode_aux(data: bytes) -> Any:
    return _from_json(json.loads(data.decode()))


register(KeyedDict)  # known before any blob is loaded, so ``jax.export.deserialize`` reads it too
