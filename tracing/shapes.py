"""Symbolic shapes: ``export(polymorphic_shapes=...)``'s argument read leaf by leaf, and a call's
shapes checked against an export that has symbolic dimensions.

``polymorphic_shapes`` follows ``jax.export.symbolic_args_specs``: one shape string for every
input, or a pytree prefix of the inputs with a string (``"b, 28, 28, 1"``, ``"b, ..."``) or None
(fixed shape) at each leaf; ``constraints`` are JAX's (``"b >= 2"``). It is read here leaf by
leaf with ``jax.export.symbolic_shape``, so that every error names the input (its pytree path)
and a string whose rank differs from the input's is refused instead of exported.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import jax

from jamp import _compat as compat

_STATIC = object()  # a None of polymorphic_shapes: the leaf keeps its shape
_SYMBOL = re.compile(r"[A-Za-z_]\w*")
_CONSTRAINT = re.compile(r"(.+?)(>=|<=|==)(.+)")
POLYMORPHIC_FORM = (
    'polymorphic_shapes is one shape string for every input ("b, ...") or a pytree prefix of '
    'the inputs with a shape string or None at each leaf (("b, 28, 28, 1", None))'
)


def shape_text(shape: Sequence[Any]) -> str:
    """``(b, 28, 28, 1)``: a shape as the user writes it."""
    return "(" + ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def is_symbolic(shape: Sequence[Any]) -> bool:
    return any(jax.export.is_symbolic_dim(d) for d in shape)


def symbolic_specs(
    inputs: Any, paths: Sequence[str], polymorphic_shapes: Any, constraints: Any, label: str
) -> list[jax.ShapeDtypeStruct]:
    """One ``ShapeDtypeStruct`` per leaf of ``inputs`` (a pytree of ``ShapeDtypeStruct`` whose
    leaves are named ``paths``), with the symbolic shapes ``polymorphic_shapes`` gives them.

    Raises TypeError for a malformed argument and ValueError for a shape string that does not
    fit its input, each naming the input by its path.
    """
    if isinstance(constraints, str) or not isinstance(constraints, Sequence):
        raise TypeError(
            f"{label}: constraints is a list of strings, e.g. constraints=['b >= 2'], "
            f"got {type(constraints).__name__}"
        )
    try:
        scope = jax.export.SymbolicScope(tuple(constraints))
    except ValueError as err:
        raise ValueError(f"{label}: constraints={list(constraints)!r}: {err}") from None
    leaves = jax.tree.leaves(inputs)
    specs = []
    for where, leaf, spec in zip(paths, leaves, _per_leaf(inputs, polymorphic_shapes, label)):
        specs.append(_symbolic_leaf(where, leaf, spec, scope, label))
    return specs


def _per_leaf(inputs: Any, polymorphic_shapes: Any, label: str) -> list[Any]:
    """The shape string (or ``_STATIC``) for each leaf of ``inputs``, in leaf order."""
    if type(polymorphic_shapes) is list and len(polymorphic_shapes) == len(inputs):
        polymorphic_shapes = tuple(polymorphic_shapes)  # a list of per-argument strings
    if polymorphic_shapes is None or isinstance(polymorphic_shapes, str):
        # only None is "no polymorphism": "" is a (malformed) shape string, named as such
        spec = _STATIC if polymorphic_shapes is None else polymorphic_shapes
        return [spec] * len(jax.tree.leaves(inputs))

    def spread(spec: Any, subtree: Any) -> list[Any]:
        return [_STATIC if spec is None else spec] * len(jax.tree.leaves(subtree))

    try:
        nested = jax.tree.map(
            spread, polymorphic_shapes, inputs, is_leaf=lambda x: x is None or isinstance(x, str)
        )
    except (ValueError, TypeError) as err:
        first = " ".join(line.strip() for line in str(err).strip().splitlines()[:2])
        raise TypeError(
            f"{label}: {POLYMORPHIC_FORM}; it does not match the inputs "
            f"{jax.tree.structure(inputs)}: {first}"
        ) from None
    return jax.tree.leaves(nested, is_leaf=lambda x: x is _STATIC)


def _symbolic_leaf(
    where: str, leaf: Any, spec: Any, scope: Any, label: str
) -> jax.ShapeDtypeStruct:
    if spec is _STATIC:
        return leaf
    if not isinstance(spec, str):
        raise TypeError(
            f"{label}: polymorphic_shapes gives {where} a {type(spec).__name__} ({spec!r:.40}); "
            f"{POLYMORPHIC_FORM}"
        )
    given = f"polymorphic_shapes gives {where} (shape {shape_text(leaf.shape)}) the shape {spec!r}"
    shape: Sequence[Any]
    try:
        shape = jax.export.symbolic_shape(spec, scope=scope, like=leaf.shape)
    except ValueError as err:
        raise ValueError(f"{label}: {given}: {err}") from None
    except IndexError:  # JAX reads ``like`` past its end for a string of more dimensions
        shape = (None,) * (len(leaf.shape) + 1)
    if len(shape) != len(leaf.shape):
        more = "more" if len(shape) > len(leaf.shape) else "fewer"
        raise ValueError(
            f"{label}: {given}, which has {more} dimensions than the input's "
            f"{len(leaf.shape)} (use '...' for the trailing dimensions: 'b, ...')"
        )
    return jax.ShapeDtypeStruct(tuple(shape), leaf.dtype, weak_type=leaf.weak_type)


class SymbolBindings:
    """The sizes a call gives the symbolic dimensions of an export, bound leaf by leaf.

    Dimensions that are a single symbol (``b``) are checked here, so that a size that disagrees
    is reported by input and dimension; compound ones (``2*b``) and the export's constraints are
    left to ``jax.export``'s own check when the export is called.
    """

    def __init__(self) -> None:
        self._bound: dict[str, tuple[int, str, int]] = {}  # symbol -> (size, where, axis)

    def mismatch(self, where: str, got: Sequence[int], expected: Sequence[Any]) -> str | None:
        """Why shape ``got`` of ``where`` does not fit ``expected``, or None if it does."""
        takes = f"the export takes {where} with shape {shape_text(expected)}"
        if len(got) != len(expected):
            return f"{where} has shape {shape_text(got)}, of {len(got)} dimension(s), but {takes}"
        for axis, (size, dim) in enumerate(zip(got, expected)):
            if not jax.export.is_symbolic_dim(dim):
                if size != dim:
                    return (
                        f"{where} has shape {shape_text(got)}, but {takes}: dimension {axis} "
                        f"must be {dim} (only its symbolic dimensions vary)"
                    )
                continue
            name = str(dim)
            if not _SYMBOL.fullmatch(name):
                continue
            if size < 1:
                return (
                    f"{where} has shape {shape_text(got)}, but {takes}: dimension {axis} is "
                    f"the symbolic {name}, which is at least 1"
                )
            first = self._bound.setdefault(name, (size, where, axis))
            if first[0] != size:
                return (
                    f"{where} has shape {shape_text(got)}, but {takes}: dimension {axis} is "
                    f"{name}, which {first[1]} dimension {first[2]} sets to {first[0]}"
                )
        return None

    def broken_constraint(self, constraints: Sequence[str]) -> str | None:
        """The first of the export's ``constraints`` the bound sizes break, described; None if
        they keep them all (or a constraint involves a symbol no single dimension gave)."""
        env = {name: size for name, (size, _, _) in self._bound.items()}
        for constraint in constraints:
            parts = _CONSTRAINT.fullmatch(constraint.strip())
            if parts is None:
                continue
            lhs, op, rhs = parts.groups()
            try:
                sides = jax.export.symbolic_shape(f"{lhs}, {rhs}")
            except ValueError:
                continue
            a, b = (compat.evaluate_dim(side, env) for side in sides)
            if a is None or b is None or {">=": a >= b, "<=": a <= b, "==": a == b}[op]:
                continue
            symbols = sorted(
                {
                    str(v)
                    for side in sides
                    if jax.export.is_symbolic_dim(side)
                    for v in side.get_vars()
                }
            )
            given = ", ".join(
                f"{s} = {self._bound[s][0]} (from {self._bound[s][1]} dimension {self._bound[s][2]})"
                for s in symbols
            )
            return f"{given} breaks the export's constraint {constraint!r}"
        return None
