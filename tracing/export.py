"""Serialization of traced and frozen programs with ``jax.export``, and ``load``.

The blob is ``jax.export``'s own serialization (StableHLO plus the input/output pytree
structures), so it can also be read with ``jax.export.deserialize``. The pytree nodes it does not
know natively, and dicts whose keys are not all strings (``nnx.List`` layers in an
``nnx.State``), are stored as ``serialization.py`` describes; so is an output dict whose keys
the function returned in another order than the sorted one, so that ``load`` gives it back in
the function's order (``_in_callers_order``). An export made with
``polymorphic_shapes`` has symbolic dimensions (``b``); its loaded function takes any size for
them, and a call that does not fit is reported by input and dimension.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any

import jax

from jamp import _compat as compat

from . import serialization
from .shapes import is_symbolic, shape_text
from .signature import Signature, refuse_keywords

_WHERE = " where "  # jax.export does not store constraints: the function's name says them
_AND = "; "  # between constraints: cannot be part of one (``max(a, b) >= 2`` holds ", ")


def export_program(
    closed: Any,
    specs: Any,
    out_tree: Any,
    name: str,
    constraints: Sequence[str] = (),
    out_template: Any = None,
) -> bytes:
    """``jax.export`` of the closed jaxpr at ``specs`` (a tuple of input pytrees of
    ``ShapeDtypeStruct``, symbolic or not), with pytree outputs ``out_tree``, as bytes.

    The exported function is named ``name`` (what ``tracing.load`` calls it), followed by the
    symbolic shapes' ``constraints`` (``freeze(CNN) where b >= 2``), which ``jax.export``
    checks but does not serialize, so that a loaded function can name the one a call breaks.
    ``out_template`` (``program.order_skeleton`` of the function's outputs) gives the order of
    its output dicts' keys, which the export keeps (``_in_callers_order``)."""
    label = f"{name}.export()"
    in_tree = serialization.storable(jax.tree.structure(specs), "inputs", label)
    ordered_out, leaf_order = _in_callers_order(out_tree, out_template)
    stored_out = serialization.storable(ordered_out, "outputs", label)
    jaxpr, consts = compat.open_and_consts(closed)

    def run(*inputs: Any) -> Any:
        flat = compat.eval_jaxpr(jaxpr, consts, jax.tree.leaves(inputs))
        return jax.tree.unflatten(stored_out, [flat[i] for i in leaf_order])

    run.__name__ = run.__qualname__ = name + (
        _WHERE + _AND.join(constraints) if constraints else ""
    )
    exported = jax.export.export(jax.jit(run))(*jax.tree.unflatten(in_tree, jax.tree.leaves(specs)))
    try:
        return bytes(exported.serialize())
    except (ValueError, TypeError) as err:  # a node (or its aux data) jax.export cannot write
        raise TypeError(
            f"export: the inputs or outputs hold a pytree node jax.export cannot serialize: {err}"
        ) from err


def _in_callers_order(out_tree: Any, template: Any) -> tuple[Any, list[int]]:
    """(the output tree to store, the program's output leaf at each of its leaves).

    ``jax.export`` writes a dict's keys in the pytree's sorted order, so a dict whose keys the
    function returned in another order is stored as a ``KeyedDict`` with the keys in the
    function's order (its leaves in that order too), which ``load`` gives back as that dict."""
    numbered = jax.tree.unflatten(out_tree, range(out_tree.num_leaves))
    ordered = _ordered(template, numbered)
    return jax.tree.structure(ordered), jax.tree.leaves(ordered)


def _ordered(template: Any, tree: Any) -> Any:
    if type(template) is dict and type(tree) is dict:
        values = [_ordered(template[key], tree[key]) for key in template]
        if list(template) == list(tree) or not all(
            type(key) in serialization.KEY_TYPES for key in template
        ):  # in pytree order already; or keys that ``storable`` refuses, naming the dict
            return dict(zip(template, values))
        return serialization.KeyedDict(list(template), values)
    if isinstance(template, (list, tuple)) and type(template) is type(tree):
        children = [_ordered(t, x) for t, x in zip(template, tree)]
        return type(tree)(*children) if hasattr(tree, "_fields") else type(tree)(children)
    return tree


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
_ARG = re.compile(r"\bargs\[(\d+)\]")  # how JAX names a leaf of the flattened call


_FIXED_SHAPES = (
    "this export takes the shapes it was made at only: export with polymorphic_shapes= "
    "(e.g. .export(polymorphic_shapes='b, ...')) for sizes that vary"
)


class LoadedFunction:
    """A deserialized program: call it with the pytree inputs it was exported for (any size for
    the symbolic dimensions of an export made with ``polymorphic_shapes``)."""

    def __init__(self, exported: Any) -> None:
        self.exported = exported
        plain_in = serialization.restored(exported.in_tree)
        args_tree = jax.tree.unflatten(plain_in, list(exported.in_avals))[0]
        leaves, in_tree = jax.tree.flatten(args_tree)
        self.signature = Signature.from_avals(in_tree, leaves)
        # Called on the flattened inputs (checked against the signature first): on jax 0.12 the
        # shape solving of a symbolic export rebuilds the inputs' pytree, and Flax's Variable
        # (an nnx.State input) cannot be rebuilt there (a bare AssertionError).
        flat_args: tuple[tuple[int, ...], dict] = (tuple(range(len(leaves))), {})
        self._flat = dataclasses.replace(exported, in_tree=jax.tree.structure(flat_args))
        self._out_tree = serialization.restored(exported.out_tree)
        self._symbolic = any(is_symbolic(a.shape) for a in leaves)
        _, where, constraints = exported.fun_name.rpartition(_WHERE)
        self._constraints = constraints.split(_AND) if where and self._symbolic else []
        self.__name__ = f"tracing.load({exported.fun_name})"

    def __call__(self, *inputs: Any, **keywords: Any) -> Any:
        refuse_keywords(self.__name__, keywords)
        # Clear errors before jax.export's own: structure, dtypes, fixed and single-symbol
        # sizes, constraints on them.
        leaves = self.signature.flatten(inputs, self.__name__, _FIXED_SHAPES, self._constraints)
        try:
            outputs = self._flat.call(*leaves)
        except ValueError as err:
            if not self._symbolic or "shape" not in str(err).lower():
                raise
            # jax.export checks compound dimensions (2*b) and constraints (b >= 2) itself
            accepted = ", ".join(
                f"{where} {shape_text(a.shape)}"
                for where, a in zip(self.signature.paths, self.signature.avals)
                if is_symbolic(a.shape)
            )
            # JAX's args[3] is the fourth leaf: its path, as inputs[1]['w']
            jax_says = _ARG.sub(lambda m: self.signature.paths[int(m.group(1))], str(err))
            if "Error refining shapes" in jax_says:
                # (the shapes passed jax.export's checks; its refinement of the program failed)
                raise ValueError(
                    f"{self.__name__}: the export takes {accepted}, and jax.export could not "
                    "specialise its program to these shapes (a limit of JAX's shape "
                    "refinement, which some programs, e.g. collectives, meet; export at fixed "
                    f"shapes instead): {jax_says}"
                ) from None
            raise ValueError(
                f"{self.__name__}: the input shapes do not fit the export, which takes "
                f"{accepted}: {jax_says}"
            ) from None
        return jax.tree.unflatten(self._out_tree, jax.tree.leaves(outputs))

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
            serialization.register(cls)
    return LoadedFunction(exported)


def _deserialize(blob: bytes) -> Any:
    """``jax.export.deserialize`` with the StableHLO parsed now (a damaged module would otherwise
    fail at the first call); ValueError for unregistered nodes, and for bytes that are not an
    intact export, with MLIR's diagnostics in the message instead of on stderr."""
    exported = None
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
    if exported is not None and _NEWER_STABLEHLO.search(f"{failure} {text}"):
        raise _from_a_newer_jax(failure) from failure
    raise _not_an_export(failure, text) from failure


# An intact export whose program uses a versioned StableHLO operation this JAX does not know
# ('vhlo.custom_call_v2'): one made by a newer JAX (jax.export promises that newer JAX loads older
# exports, not the reverse). MLIR's wording; damaged bytes fail otherwise.
_NEWER_STABLEHLO = re.compile(r"unregistered operation 'vhlo\.\w+_v\d+'")


def _from_a_newer_jax(err: Exception) -> ValueError:
    first_line = str(err).splitlines()[0] if str(err) else ""
    return ValueError(
        f"these bytes are a jax.export serialization whose program this jax ({jax.__version__}) "
        "cannot read: it was most likely exported by a newer jax (a newer jax loads older "
        "exports, not the reverse). Load it with that jax or a newer one, or export it with the "
        f"oldest jax that must load it. JAX says: {type(err).__name__}: {first_line}"
    )


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
