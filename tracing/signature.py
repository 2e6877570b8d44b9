"""The input signature of a traced program: each leaf's path (``inputs[0]['x']``) and aval, the
order of its dicts' keys as the caller gave them (pytrees sort them), and the checks that name a
wrong input by its path. Shared by ``program`` (calls) and ``export`` (loaded functions), below
both. An export's signature may have symbolic dimensions (``shapes.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jamp import _compat as compat

from .shapes import SymbolBindings, is_symbolic, shape_text


def input_path(path: Sequence[Any]) -> str:
    """``inputs[0]['x']``: how errors name a leaf of the positional inputs tuple."""
    return "inputs" + jax.tree_util.keystr(tuple(path))


def leaf_aval(leaf: Any, where: str) -> Any:
    """The aval an input leaf is traced at; a clear TypeError for leaves that are not arrays."""
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return compat.ShapedArray(leaf.shape, leaf.dtype, weak_type=leaf.weak_type)
    if isinstance(leaf, (jax.Array, np.ndarray, np.generic, bool, int, float, complex)):
        return compat.aval_of(leaf)
    raise TypeError(
        f"{where} is a {type(leaf).__name__}, not an array: traced functions take arrays (and "
        "pytrees of arrays) only; bind other arguments with functools.partial before tracing"
    )


def weak_type_mismatch(where: str, got: Any, want: Any) -> str | None:
    """Why an input weakly typed where the program's is not (or the reverse) is refused: JAX
    promotes a Python number and a typed array of the same dtype differently (a bfloat16 array
    times a Python float stays bfloat16, times ``jnp.float32(3)`` becomes float32), so the program
    would not return what the function does."""
    if bool(got.weak_type) == bool(want.weak_type):
        return None
    dtype = getattr(want.dtype, "name", want.dtype)
    typed = f"jnp.{dtype}(...)" if dtype != "bool" else "jnp.bool_(...)"
    number, array = f"a Python number (weakly typed {dtype})", f"a typed {dtype} array"
    given, traced = (number, array) if got.weak_type else (array, number)
    if got.weak_type:
        here, example = f"a typed scalar such as {typed}", "a Python number"
    else:
        here, example = "a Python number", typed
    return (
        f"{where} is {given} where the function was traced with {traced}: JAX promotes the two "
        "differently (a bfloat16 array times a Python float stays bfloat16, times a float32 "
        f"scalar becomes float32). Make them agree: pass {here} here, or trace with {example} "
        "at this position of example_inputs"
    )


def refuse_keywords(name: str, keywords: dict[str, Any]) -> None:
    """A traced, frozen or loaded program takes its inputs by position, as they were traced (its
    function's keyword arguments were fixed then): name the keywords a call passed."""
    if keywords:
        given = ", ".join(f"{k}=" for k in keywords)
        raise TypeError(
            f"{name}: got keyword argument(s) {given} but the program takes its inputs by "
            "position, as it was traced (inputs=(...)); pass them positionally in that order, "
            "or fix a keyword with functools.partial before tracing"
        )


@dataclasses.dataclass(frozen=True)
class Signature:
    """The input tree of a program, with each leaf's path and aval."""

    in_tree: Any
    paths: tuple[str, ...]
    avals: tuple[Any, ...]
    aliases: tuple[tuple[str, str], ...] = ()  # (path prefix, the name errors give it instead)
    # ``order_skeleton`` of the inputs (their dicts in the caller's order: ``in_tree`` sorts them)
    order: Any = dataclasses.field(default=None, compare=False)
    # whether ``avals`` tell Python numbers (weakly typed) from arrays: an export's do not
    weak_types: bool = dataclasses.field(default=True, compare=False)

    @classmethod
    def of(cls, inputs: tuple) -> Signature:
        with_paths, in_tree = jax.tree_util.tree_flatten_with_path(inputs)
        paths = tuple(input_path(p) for p, _ in with_paths)
        avals = tuple(leaf_aval(leaf, where) for where, (_, leaf) in zip(paths, with_paths))
        return cls(in_tree, paths, avals, order=order_skeleton(inputs))

    @classmethod
    def from_avals(cls, in_tree: Any, avals: Sequence[Any]) -> Signature:
        tree = jax.tree.unflatten(in_tree, list(range(len(avals))))
        paths = tuple(input_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0])
        return cls(in_tree, paths, tuple(avals), weak_types=False)  # (jax.export drops them)

    def with_last_input_named(self, name: str) -> Signature:
        """This signature with the last positional input named ``name`` in errors (a frozen
        function's ``rngs``, passed by keyword): ``rngs['dropout']``, not ``inputs[1]['dropout']``."""
        prefix = f"inputs[{len(self.in_tree.children()) - 1}]"
        aliases = self.aliases + ((prefix, name),)
        return dataclasses.replace(
            self, paths=tuple(_aliased(p, aliases) for p in self.paths), aliases=aliases
        )

    def specs(self) -> Any:
        """The inputs as a pytree of ``jax.ShapeDtypeStruct``."""
        return jax.tree.unflatten(
            self.in_tree,
            [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in self.avals],
        )

    def flatten(
        self,
        inputs: tuple,
        name: str,
        remedy: str = "trace it again for new shapes",
        constraints: Sequence[str] = (),
    ) -> list[Any]:
        """The leaves of ``inputs`` after checking them against the signature.

        Raises TypeError for another tree structure or dtype, ValueError for another shape, each
        naming the first mismatching leaf by its path; ``remedy`` says what to do about a shape.
        Symbolic dimensions (an export's ``b``) take any size, the same wherever they occur, that
        keeps ``constraints`` (``"b >= 2"``).
        """
        with_paths, tree = jax.tree_util.tree_flatten_with_path(inputs)
        if tree != self.in_tree:
            raise TypeError(f"{name}: {self.structure_mismatch(with_paths, tree)}")
        symbols = SymbolBindings()
        leaves = []
        for where, aval, (_, leaf) in zip(self.paths, self.avals, with_paths):
            got = leaf_aval(leaf, where)
            if got.dtype != aval.dtype:
                raise TypeError(
                    f"{name}: {where} has dtype {got.dtype}, but the function was "
                    f"traced for {aval.dtype} (shape {shape_text(aval.shape)})"
                )
            weak = self.weak_types and weak_type_mismatch(where, got, aval)
            if weak:
                raise TypeError(f"{name}: {weak}")
            if is_symbolic(aval.shape):
                problem = symbols.mismatch(where, got.shape, aval.shape)
                if problem:
                    raise ValueError(f"{name}: {problem}")
            elif got.shape != aval.shape:
                raise ValueError(
                    f"{name}: {where} has shape {got.shape}, but the function was "
                    f"traced for shape {aval.shape}; {remedy}"
                )
            leaves.append(leaf)
        broken = symbols.broken_constraint(constraints)
        if broken:
            raise ValueError(f"{name}: {broken}")
        return leaves

    def structure_mismatch(self, with_paths: list, tree: Any) -> str:
        got_paths = [_aliased(input_path(p), self.aliases) for p, _ in with_paths]
        for expected, got in zip(self.paths, got_paths):
            if expected != got:
                return (
                    f"the inputs differ in structure from the traced ones at {got}: expected "
                    f"a leaf at {expected}. Traced with {self.in_tree}, called with {tree}"
                )
        if len(got_paths) != len(self.paths):
            where = (
                f"missing {self.paths[len(got_paths)]}"
                if len(got_paths) < len(self.paths)
                else f"unexpected {got_paths[len(self.paths)]}"
            )
            return (
                f"the inputs differ in structure from the traced ones: {where}. Traced with "
                f"{self.in_tree}, called with {tree}"
            )
        return (
            f"the inputs differ in container types from the traced ones. Traced with "
            f"{self.in_tree}, called with {tree}"
        )


def order_skeleton(tree: Any) -> Any:
    """The dicts, lists and tuples of ``tree`` in their own order, leaves as None."""
    if type(tree) is dict:
        return {key: order_skeleton(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        children = [order_skeleton(x) for x in tree]
        return type(tree)(*children) if hasattr(tree, "_fields") else type(tree)(children)
    return None


def keep_dict_order(template: Any, tree: Any) -> Any:
    """``tree`` with its dicts' keys in ``template``'s order (pytrees sort dict keys)."""
    if type(template) is dict and isinstance(tree, dict):
        return {key: keep_dict_order(template[key], tree[key]) for key in template}
    if isinstance(template, (list, tuple)) and type(template) is type(tree):
        children = [keep_dict_order(t, x) for t, x in zip(template, tree)]
        return type(tree)(*children) if hasattr(tree, "_fields") else type(tree)(children)
    return tree


def _aliased(path: str, aliases: Sequence[tuple[str, str]]) -> str:
    for prefix, name in aliases:
        if path == prefix or path.startswith((prefix + "[", prefix + ".")):
            return name + path[len(prefix) :]
    return path
