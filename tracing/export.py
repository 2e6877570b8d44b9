"""Serialization of traced and frozen programs with ``jax.export``, and ``load``.

The blob is ``jax.export``'s own serialization (StableHLO plus the input/output pytree
structures), so it can also be read with ``jax.export.deserialize``. The pytree nodes that
``jax.export`` does not know natively are registered for serialization on export, under
``module.QualName``: namedtuples, and custom nodes whose auxiliary data is plain data (None,
bools, numbers, strings, and tuples, lists and string-keyed dicts of them), which covers Flax's
own nodes: ``LogicallyPartitioned``/``Partitioned`` boxes, ``nnx.State`` and ``nnx.Variable``s
(``Param``, ``BatchStat``, ...). ``load`` registers them the same way, looking the class up in the
modules the loading process has already imported (it never imports a module a blob names).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import jax

from .signature import Signature

_REGISTERED: set[type] = set()
_BUILTIN_NODES = (tuple, list, dict, type(None))


def export_program(pytree_fn: Callable, signature: Signature, out_tree: Any) -> bytes:
    """``jax.export`` of ``pytree_fn`` at the signature's avals, serialized to bytes."""
    specs = signature.specs()
    for tree in (signature.in_tree, out_tree):
        _register_nodes(tree)
    exported = jax.export.export(jax.jit(pytree_fn))(*specs)
    try:
        return bytes(exported.serialize())
    except (ValueError, TypeError) as err:  # a node (or its aux data) jax.export cannot write
        raise TypeError(
            f"export: the inputs or outputs hold a pytree node jax.export cannot serialize: {err}"
        ) from err


def serialized_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _register_nodes(treedef: Any) -> None:
    """Register every node type of ``treedef`` that jax.export cannot serialize natively."""
    node = treedef.node_data()
    if node is not None and node[0] not in _BUILTIN_NODES:
        _register(node[0])
    for child in treedef.children():
        _register_nodes(child)


def _is_namedtuple(cls: type) -> bool:
    return issubclass(cls, tuple) and hasattr(cls, "_fields")


def _register(cls: type) -> None:
    if cls in _REGISTERED:
        return
    try:
        if _is_namedtuple(cls):
            jax.export.register_namedtuple_serialization(cls, serialized_name=serialized_name(cls))
        else:
            jax.export.register_pytree_node_serialization(
                cls,
                serialized_name=serialized_name(cls),
                serialize_auxdata=lambda aux, cls=cls: _encode_aux(cls, aux),
                deserialize_auxdata=_decode_aux,
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


def _encode_aux(cls: type, aux: Any) -> bytes:
    return json.dumps(_to_json(aux, cls)).encode()


def _decode_aux(data: bytes) -> Any:
    return _from_json(json.loads(data.decode()))


def _imported_class(name: str) -> type | None:
    """The class called ``module.QualName`` in an already imported module, if any."""
    parts = name.split(".")
    for split in range(len(parts) - 1, 0, -1):
        module = sys.modules.get(".".join(parts[:split]))
        if module is None:
            continue
        obj: Any = module
        for attr in parts[split:]:
            obj = getattr(obj, attr, None)
        return obj if isinstance(obj, type) else None
    return None


_UNREGISTERED = re.compile(r"unregistered type `([^`]+)`")


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
    seen: set[str] = set()
    while True:
        try:
            exported = _deserialize(bytes(blob))
            break
        except ValueError as err:
            missing = _UNREGISTERED.search(str(err))
            name = missing.group(1) if missing else None
            cls = _imported_class(name) if name else None
            if cls is None or name is None or name in seen:
                hint = (
                    f" Import the module that defines {name} (and register it "
                    "for jax.export if tracing did not) before loading."
                    if name
                    else ""
                )
                message = str(err) if name else str(err).removeprefix("tracing.load: ")
                raise ValueError(f"tracing.load: {message}{hint}") from err
            seen.add(name)
            _register(cls)
    return LoadedFunction(exported)


def _deserialize(blob: bytes) -> Any:
    """``jax.export.deserialize`` with the StableHLO parsed now (a damaged module would otherwise
    fail at the first call); ValueError for unregistered nodes, and for bytes that are not an
    intact export, with MLIR's diagnostics in the message instead of on stderr."""
    with _captured_stderr() as diagnostics:
        try:
            exported = jax.export.deserialize(bytearray(blob))
            exported.mlir_module()
            return exported
        except ValueError as err:
            if _UNREGISTERED.search(str(err)):
                raise
            failure: Exception = err
        except Exception as err:  # flatbuffers' struct errors, XLA's JaxRuntimeError
            failure = err
        text = diagnostics.read()
    raise _not_an_export(failure, text) from failure


def _not_an_export(err: Exception, diagnostics: str) -> ValueError:
    first_line = str(err).splitlines()[0] if str(err) else ""
    details = "; ".join(line.strip() for line in diagnostics.splitlines() if line.strip())
    return ValueError(
        "these bytes are not an intact jax.export serialization (made by "
        "TracedFunction.export() or FrozenFunction.export()): "
        f"{type(err).__name__}: {first_line}" + (f" [{details}]" if details else "")
    )


class _Captured:
    def __init__(self, file: Any) -> None:
        self._file = file

    def read(self) -> str:
        self._file.seek(0)
        return self._file.read().decode(errors="replace")[:2000]


@contextlib.contextmanager
def _captured_stderr() -> Iterator[_Captured]:
    """Capture what C++ code (MLIR's diagnostics) writes to file descriptor 2 meanwhile."""
    with tempfile.TemporaryFile() as file:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(file.fileno(), 2)
        try:
            yield _Captured(file)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
