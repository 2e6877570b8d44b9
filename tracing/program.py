"""A traced program with pytree inputs and outputs: input checks, running, text forms, export.

``TracedFunction`` (``trace``) and ``FrozenFunction`` (``freeze``) are both a ``Program``: a
closed jaxpr over the flattened inputs, the input tree with each leaf's path and aval, and the
output tree. Calls are checked against the traced signature first, so a wrong input is reported
by its path instead of failing deep inside XLA or, worse, silently retracing.

``export(polymorphic_shapes=...)`` makes the program again at symbolic shapes (``retrace``:
``trace`` traces the function again, ``freeze`` freezes it again), since a jaxpr traced at one
batch size holds that size in its equations (a reshape's ``new_sizes``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

from jamp import _compat as compat

from .errors import TracingCheckError
from .export import export_program
from .shapes import shape_text, symbolic_specs
from .signature import Signature, keep_dict_order, refuse_keywords
from .signature import order_skeleton as order_skeleton  # where trace.py imports it from

_SYMBOLIC_HINT = (
    "Hint: a symbolic dimension has no value while the program is made: a Python `if`, "
    "`range` or `int()` on it, a reshape to a number computed from it, or a comparison JAX "
    "cannot decide for every size (pass constraints=['b >= 2'] if the function needs one) "
    "fails. Keep such dimensions fixed (None, or the number, in polymorphic_shapes)."
)


# What JAX says when a symbolic dimension is used as a number (``int(b)``, ``range(b)``).
_SYMBOLIC_WORDS = ("symbolic dimension", "_DimExpr", "shape polymorphism", "polymorphic shape")


def _is_shape_polymorphism_error(err: Exception) -> bool:
    """Whether ``err`` comes from a symbolic dimension (what the hint is about)."""
    if isinstance(err, jax.errors.InconclusiveDimensionOperation):
        return True
    text = str(err)
    return any(word.lower() in text.lower() for word in _SYMBOLIC_WORDS)


# (closed jaxpr, output tree) of the program made again at the given inputs: a tuple of input
# pytrees of ``jax.ShapeDtypeStruct`` with symbolic shapes.
Retrace = Callable[[tuple], tuple[Any, Any]]


class CannotRetrace(ValueError):
    """What a retrace needs is gone (a frozen function's variables were freed): raised as is."""


class ChangedSinceTraced(TracingCheckError):
    """State the function reads changed since it was traced, so a retrace would make another
    program: raised as is."""


def _evaluator(closed: Any) -> Callable[..., list[Any]]:
    """``closed`` as a function of the flattened inputs."""

    def flat_fn(*leaves: Any) -> list[Any]:
        jaxpr, consts = compat.open_and_consts(closed)
        return compat.eval_jaxpr(jaxpr, consts, leaves)

    return flat_fn


class Program:
    """A closed jaxpr with pytree inputs and outputs (``TracedFunction``, ``FrozenFunction``)."""

    # What to do about a call at another shape, and how the program is made again for a
    # polymorphic export ("tracing it again", "freezing it again"): set by each kind.
    reshape_remedy = "trace it again for new shapes"
    remade_by = "tracing it again"

    def __init__(
        self,
        closed: Any,
        signature: Signature,
        out_tree: Any,
        name: str,
        out_template: Any = None,
        retrace: Retrace | None = None,
    ) -> None:
        self._closed = closed
        self.signature = signature
        self.out_tree = out_tree
        self._out_template = out_template  # ``order_skeleton`` of the function's own outputs
        self._retrace = retrace
        self.__name__ = name
        # (jitted on the jaxpr alone: jitting a bound method would tie this object into a
        # reference cycle, keeping its constants in memory until a full garbage collection)
        self._compiled = jax.jit(_evaluator(closed))

    def flat_fn(self, *leaves: Any) -> list[Any]:
        """The program on the flattened inputs (what is compiled and exported)."""
        return _evaluator(self._closed)(*leaves)

    def __call__(self, *inputs: Any, **keywords: Any) -> Any:
        refuse_keywords(self.__name__, keywords)
        leaves = self.signature.flatten(inputs, self.__name__, self.reshape_remedy)
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

    def export(self, polymorphic_shapes: Any = None, *, constraints: Sequence[str] = ()) -> bytes:
        """Serialize with ``jax.export``; ``tracing.load(blob)`` gives back a callable.

        ``polymorphic_shapes`` (as ``jax.export.symbolic_args_specs``: one shape string for
        every input, or a pytree prefix of the inputs with a string or None at each leaf) makes
        dimensions symbolic: ``export(polymorphic_shapes="b, ...")`` serves any batch size.
        ``constraints`` are JAX's (``["b >= 2"]``, ``["b <= 1024"]``); a size that must be a
        multiple of something is written so (``"2*b, ..."``). The program is then made again at
        the symbolic shapes (the function traced, or frozen, again), so the function must work
        for every size it is exported for.

        Example::

            blob = traced.export(polymorphic_shapes="b, ...")
            served = tracing.load(blob)
            served(x[:3]), served(x)          # any batch size
        """
        if polymorphic_shapes is None:
            if constraints:
                raise TypeError(f"{self.__name__}.export: constraints need polymorphic_shapes")
            return export_program(
                self._closed,
                self.signature.specs(),
                self.out_tree,
                self.__name__,
                out_template=self._out_template,
            )
        label = f"{self.__name__}.export(polymorphic_shapes={polymorphic_shapes!r})"
        flat = symbolic_specs(
            self.signature.specs(), self.signature.paths, polymorphic_shapes, constraints, label
        )
        # in the caller's dict order: the function is traced again seeing its inputs as it did
        specs = keep_dict_order(
            self.signature.order, jax.tree.unflatten(self.signature.in_tree, flat)
        )
        if self._retrace is None:
            raise TypeError(f"{label}: this program cannot be made again at symbolic shapes")
        shapes = ", ".join(shape_text(s.shape) for s in flat)
        try:
            closed, out_tree = self._retrace(specs)
        except (CannotRetrace, ChangedSinceTraced):
            raise
        except Exception as err:
            every = (
                f"\npolymorphic_shapes={polymorphic_shapes!r} applies to every input; give one "
                "entry per input, None for those of fixed shape: (None, 'b, ...')"
                if isinstance(polymorphic_shapes, str) and len(flat) > 1
                else ""
            )
            context = f"{label}: {self.remade_by} at the symbolic shapes {shapes} failed"
            if not _is_shape_polymorphism_error(err):
                # Some other failure (a bug in the function, a freed array): all of its message,
                # and no hint about symbolic dimensions, which would mislead.
                raise ValueError(
                    f"{context}: {type(err).__name__}: {str(err).strip()}{every}"
                ) from err
            first = (str(err).strip().splitlines() or [""])[0]
            raise ValueError(
                f"{context}: {type(err).__name__}: {first}{every}\n{_SYMBOLIC_HINT}"
            ) from err
        return export_program(
            closed, specs, out_tree, self.__name__, tuple(constraints), self._out_template
        )

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.__name__} inputs={self.signature.in_tree}>"


def callable_name(fn: Callable) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
