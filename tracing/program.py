"""A traced program with pytree inputs and outputs: input checks, running, text forms, export.

``TracedFunction`` (``trace``) and ``FrozenFunction`` (``freeze``) are both a ``Program``: a
closed jaxpr over the flattened inputs, the input tree with each leaf's path and aval, and the
output tree. Calls are checked against the traced signature first, so a wrong input is reported
by its path instead of failing deep inside XLA or, worse, silently retracing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from jamp import _compat as compat

from .export import export_program
from .signature import Signature


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
