"""A traced program with pytree inputs and outputs: input checks, running, text forms, export.

``TracedFunction`` (``trace``) and ``FrozenFunction`` (``freeze``) are both a ``Program``: a
closed jaxpr over the flattened inputs, the input tree with each leaf's path and aval, and the
output tree. Calls are checked against the traced signature first, so a wrong input is reported
by its path instead of failing deep inside XLA or, worse, silently retracing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jamp import _compat as compat


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


@dataclasses.dataclass(frozen=True)
class Signature:
    """The input tree of a program, with each leaf's path and aval."""

    in_tree: Any
    paths: tuple[str, ...]
    avals: tuple[Any, ...]

    @classmethod
    def of(cls, inputs: tuple) -> Signature:
        with_paths, in_tree = jax.tree_util.tree_flatten_with_path(inputs)
        paths = tuple(input_path(p) for p, _ in with_paths)
        avals = tuple(leaf_aval(leaf, where) for where, (_, leaf) in zip(paths, with_paths))
        return cls(in_tree, paths, avals)

    @classmethod
    def from_avals(cls, in_tree: Any, avals: Sequence[Any]) -> Signature:
        tree = jax.tree.unflatten(in_tree, list(range(len(avals))))
        paths = tuple(input_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0])
        return cls(in_tree, paths, tuple(avals))

    def specs(self) -> Any:
        """The inputs as a pytree of ``jax.ShapeDtypeStruct``."""
        return jax.tree.unflatten(
            self.in_tree,
            [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in self.avals],
        )

    def flatten(self, inputs: tuple, name: str) -> list[Any]:
        """The leaves of ``inputs`` after checking them against the signature.

        Raises TypeError for another tree structure or dtype, ValueError for another shape, each
        naming the first mismatching leaf by its path.
        """
        with_paths, tree = jax.tree_util.tree_flatten_with_path(inputs)
        if tree != self.in_tree:
            raise TypeError(f"{name}: {self.structure_mismatch(with_paths, tree)}")
        leaves = []
        for where, aval, (_, leaf) in zip(self.paths, self.avals, with_paths):
            got = leaf_aval(leaf, where)
            if got.dtype != aval.dtype:
                raise TypeError(
                    f"{name}: {where} has dtype {got.dtype}, but the function was "
                    f"traced for {aval.dtype} (shape {aval.shape})"
                )
            if got.shape != aval.shape:
                raise ValueError(
                    f"{name}: {where} has shape {got.shape}, but the function was "
                    f"traced for shape {aval.shape}; trace it again for new shapes"
                )
            leaves.append(leaf)
        return leaves

    def structure_mismatch(self, with_paths: list, tree: Any) -> str:
        got_paths = [input_path(p) for p, _ in with_paths]
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


class Program:
    """A closed jaxpr with pytree inputs and outputs (``TracedFunction``, ``FrozenFunction``)."""

    def __init__(
        self, closed: Any, signature: Signature, out_tree: Any, name: str, out_template: Any = None
    ) -> None:
        self._closed = closed
        self.signature = signature
        self.out_tree = out_tree
        self._out_template = out_template  # ``order_skeleton`` of the function's own outputs
        self.__name__ = name
        self._compiled = jax.jit(self.flat_fn)

    def flat_fn(self, *leaves: Any) -> list[Any]:
        """The program on the flattened inputs (what is compiled and exported)."""
        jaxpr, consts = compat.open_and_consts(self._closed)
        return compat.eval_jaxpr(jaxpr, consts, leaves)

    def pytree_fn(self, *inputs: Any) -> Any:
        return jax.tree.unflatten(self.out_tree, self.flat_fn(*jax.tree.leaves(inputs)))

    def __call__(self, *inputs: Any) -> Any:
        leaves = self.signature.flatten(inputs, self.__name__)
        outputs = jax.tree.unflatten(self.out_tree, self._compiled(*leaves))
        return (
            outputs if self._out_template is None else keep_dict_order(self._out_template, outputs)
        )

    @property
    def jaxpr(self) -> Any:
        """The closed jaxpr over the flattened inputs."""
        return self._closed

    @property
    def graph(self) -> str:
        """Readable text of the jaxpr (casts inserted by autocast show as convert_element_type)."""
        return str(self._closed)

    @property
    def hlo(self) -> str:
        """StableHLO text of the program, as it is handed to XLA."""
        return self._compiled.lower(*jax.tree.leaves(self.signature.specs())).as_text()

    def export(self) -> bytes:
        """Serialize with ``jax.export``; ``tracing.load(blob)`` gives back a callable."""
        from .export import export_program

        return export_program(self.pytree_fn, self.signature, self.out_tree)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.__name__} inputs={self.signature.in_tree}>"


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


def callable_name(fn: Callable) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
