"""Serialization of traced and frozen programs with ``jax.export``, and ``load``.

The blob is ``jax.export``'s own serialization (StableHLO plus the input/output pytree
structures), so it can also be read with ``jax.export.deserialize``. Namedtuples in the inputs or
outputs are registered for serialization under ``module.QualName`` on export; a process that loads
the blob must have imported (and so registered, by exporting or with
``jax.export.register_namedtuple_serialization``) the same classes.
"""
from __future__ import annotations

from typing import Any, Callable

import jax

from .program import Signature

_REGISTERED: set[type] = set()


def export_program(pytree_fn: Callable, signature: Signature, out_tree: Any) -> bytes:
    """``jax.export`` of ``pytree_fn`` at the signature's avals, serialized to bytes."""
    specs = signature.specs()
    for tree in (signature.in_tree, out_tree):
        _register_namedtuples(jax.tree.unflatten(tree, [None] * tree.num_leaves))
    exported = jax.export.export(jax.jit(pytree_fn))(*specs)
    try:
        return bytes(exported.serialize())
    except ValueError as err:  # an unregistered custom pytree node, named by jax.export
        raise TypeError(f"export: the inputs or outputs hold a pytree node jax.export cannot "
                        f"serialize: {err}") from err


def _register_namedtuples(tree: Any) -> None:
    """Register every namedtuple class in ``tree`` (built from None leaves) for serialization."""
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        cls = type(tree)
        if cls not in _REGISTERED:
            try:
                jax.export.register_namedtuple_serialization(
                    cls, serialized_name=f"{cls.__module__}.{cls.__qualname__}")
            except ValueError:  # registered before, by the user or an earlier export
                pass
            _REGISTERED.add(cls)
    children = tree.values() if isinstance(tree, dict) else \
        tree if isinstance(tree, (list, tuple)) else ()
    for child in children:
        _register_namedtuples(child)


class LoadedFunction:
    """A deserialized program: call it with the pytree inputs it was exported for."""

    def __init__(self, exported: Any) -> None:
        self.exported = exported
        args_tree = jax.tree.unflatten(exported.in_tree, list(exported.in_avals))[0]
        leaves, in_tree = jax.tree.flatten(args_tree)
        self.signature = Signature.from_avals(in_tree, leaves)
        self.__name__ = f"tracing.load({exported.fun_name})"

    def __call__(self, *inputs: Any) -> Any:
        self.signature.flatten(inputs, self.__name__)  # clear errors before jax.export's own
        return self.exported.call(*inputs)

    @property
    def hlo(self) -> str:
        """StableHLO text of the loaded program."""
        return str(self.exported.mlir_module())


def load(blob: bytes | bytearray) -> LoadedFunction:
    """A callable for bytes from ``TracedFunction.export()`` or ``FrozenFunction.export()``.

    Example::

        blob = tracing.trace(f, (x,)).export()
        g = tracing.load(blob)
        g(x)          # same pytree outputs as f(x)
    """
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise TypeError(f"tracing.load expects the bytes of an export, got {type(blob).__name__}")
    try:
        exported = jax.export.deserialize(bytearray(blob))
    except Exception as err:
        raise ValueError("tracing.load: these bytes are not a jax.export serialization "
                         f"({type(err).__name__}: {err})") from err
    return LoadedFunction(exported)
