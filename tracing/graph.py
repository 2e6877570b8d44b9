"""A canonical, shape-abstracted form of a jaxpr, and readable diffs between two of them.

Two traces of a shape-generic function for different batch sizes differ only in concrete sizes.
The canonical form keeps what must not change between them (primitives, wiring, dtypes, ranks,
weak types and non-shape parameters) and abstracts sizes: avals print as ``f32[?,?]`` and the
parameters that hold sizes (``SHAPE_PARAMS``) as tuples of ``?``. Literal values are left out of
the lines and collected apart (``Graph.literals``), because some are sizes too (``jnp.mean`` divides
by the element count); ``trace`` compares them only between traces made at the same avals.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

import jax
import numpy as np

from jamp import _compat as compat

# Parameters that hold concrete sizes, per primitive: abstracted to their length.
SHAPE_PARAMS: dict[str, frozenset[str]] = {
    "broadcast_in_dim": frozenset({"shape"}),
    "reshape": frozenset({"new_sizes"}),
    "iota": frozenset({"shape"}),
    "full": frozenset({"shape"}),
    "slice": frozenset({"start_indices", "limit_indices"}),
    "dynamic_slice": frozenset({"slice_sizes"}),
    "gather": frozenset({"slice_sizes"}),
    "pad": frozenset({"padding_config"}),
    "split": frozenset({"sizes"}),
    "scan": frozenset({"length"}),
    "random_bits": frozenset({"shape"}),
    "rng_bit_generator": frozenset({"shape"}),
    "rng_uniform": frozenset({"shape"}),
    "conv_general_dilated": frozenset({"lhs_shape", "rhs_shape"}),
}


@dataclasses.dataclass
class Line:
    text: str
    source: str


@dataclasses.dataclass
class Graph:
    """The canonical lines of a jaxpr, its literals and its captured constants."""

    lines: list[Line]
    literals: list[tuple[Any, str, str]]  # (value, dtype, source line) in equation order
    consts: list[tuple[Any, str]]  # (value, source line of its first use)


def aval_text(aval: Any, *, sizes: bool = False) -> str:
    dtype = getattr(aval, "dtype", None)
    shape = getattr(aval, "shape", ())
    dims = ",".join(str(d) if sizes else "?" for d in shape)
    weak = "~" if getattr(aval, "weak_type", False) else ""
    return f"{weak}{getattr(dtype, 'name', dtype)}[{dims}]"


def canonicalize(closed: Any) -> Graph:
    """The canonical form of a closed jaxpr (recursing into every sub-jaxpr)."""
    jaxpr, consts = compat.open_and_consts(closed)
    builder = _Builder()
    builder.add_jaxpr(jaxpr, depth=0)
    const_sources = [builder.first_use.get(id(v), "<unused>") for v in jaxpr.constvars]
    return Graph(builder.lines, builder.literals, list(zip(consts, const_sources)))


class _Builder:
    def __init__(self) -> None:
        self.lines: list[Line] = []
        self.literals: list[tuple[Any, str, str]] = []
        self.first_use: dict[int, str] = {}

    def add_jaxpr(self, jaxpr: Any, depth: int) -> None:
        names: dict[int, str] = {}
        pad = "  " * depth

        def define(var: Any, prefix: str) -> str:
            names[id(var)] = f"{prefix}{len(names)}"
            return f"{names[id(var)]}:{aval_text(var.aval)}"

        header = " ".join(define(v, "c") for v in jaxpr.constvars)
        header += " ; " + " ".join(define(v, "a") for v in jaxpr.invars)
        self.lines.append(Line(f"{pad}lambda {header}", "<inputs>"))
        for eqn in jaxpr.eqns:
            source = compat.source_line(eqn)
            ins = []
            for var in eqn.invars:
                if isinstance(var, compat.Literal):
                    self.literals.append((var.val, aval_text(var.aval), source))
                    ins.append(f"lit:{aval_text(var.aval)}")
                else:
                    self.first_use.setdefault(id(var), source)
                    ins.append(names.get(id(var), "?"))
            params, subs = _params_text(eqn.primitive.name, eqn.params)
            outs = " ".join(define(v, "v") for v in eqn.outvars)
            self.lines.append(
                Line(f"{pad}{outs} = {eqn.primitive.name}[{params}] {' '.join(ins)}", source)
            )
            for sub in subs:
                self.add_jaxpr(compat.open_and_consts(sub)[0], depth + 1)
        outs = " ".join(
            f"lit:{aval_text(v.aval)}" if isinstance(v, compat.Literal) else names.get(id(v), "?")
            for v in jaxpr.outvars
        )
        self.lines.append(Line(f"{pad}return {outs}", "<outputs>"))


def _params_text(primitive: str, params: dict[str, Any]) -> tuple[str, list[Any]]:
    """Canonical text of an equation's parameters, and the sub-jaxprs among them."""
    subs: list[Any] = []
    shape_params = SHAPE_PARAMS.get(primitive, frozenset())
    parts = []
    for key in sorted(params):
        value = params[key]
        if key in shape_params:
            text = _sizes_abstracted(value)
        else:
            text = _value_text(value, subs)
        parts.append(f"{key}={text}")
    return " ".join(parts), subs


def _sizes_abstracted(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return "(" + ",".join(_sizes_abstracted(v) for v in value) + ")"
    return "?" if isinstance(value, (int, np.integer)) else repr(value)


def _value_text(value: Any, subs: list[Any]) -> str:
    if compat.is_jaxpr_like(value):
        subs.append(value)
        return f"<jaxpr {len(subs) - 1}>"
    if isinstance(value, (tuple, list)):
        return "(" + ",".join(_value_text(v, subs) for v in value) + ")"
    if callable(value) and not isinstance(value, type):
        # thunks and rules (custom_jvp/vjp) differ in identity between traces, not in meaning
        return f"<fn {getattr(value, '__name__', type(value).__name__)}>"
    text = repr(value)
    return f"<{type(value).__name__}>" if " at 0x" in text else text


def first_difference(a: Graph, b: Graph) -> int | None:
    for i, (x, y) in enumerate(zip(a.lines, b.lines)):
        if x.text != y.text:
            return i
    return None if len(a.lines) == len(b.lines) else min(len(a.lines), len(b.lines))


def describe_difference(
    a: Graph, b: Graph, a_name: str, b_name: str, context_lines: int = 40
) -> str:
    """Readable report: the first differing equation with its source lines, then a diff."""
    i = first_difference(a, b)
    if i is None:
        return ""

    def at(g: Graph) -> str:
        if i >= len(g.lines):
            return "(ends here)"
        return f"{g.lines[i].text.strip()}\n      at {g.lines[i].source}"

    diff = list(
        difflib.unified_diff(
            [ln.text for ln in a.lines],
            [ln.text for ln in b.lines],
            a_name,
            b_name,
            lineterm="",
            n=2,
        )
    )
    if len(diff) > context_lines:
        diff = diff[:context_lines] + [f"... ({len(diff) - context_lines} more diff lines)"]
    return (
        f"First difference at line {i} of the canonical graphs:\n"
        f"  {a_name}: {at(a)}\n  {b_name}: {at(b)}\n"
        "Diff (sizes abstracted as ?):\n" + "\n".join(diff)
    )


def values_equal(a: Any, b: Any) -> bool:
    """Exact equality of two captured values (NaNs equal), for the constants check."""
    a, b = plain_array(a), plain_array(b)
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))
    )


def plain_array(x: Any) -> np.ndarray:
    """A NumPy array of ``x``; PRNG keys as their key data."""
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x)


def shape_dtype(x: Any) -> str:
    return aval_text(compat.aval_of(x), sizes=True)
