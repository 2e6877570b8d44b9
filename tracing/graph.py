"""A canonical, shape-abstracted form of a jaxpr, and readable diffs between two of them.

Two traces of a shape-generic function for different batch sizes differ only in concrete sizes.
The canonical form keeps what must not change between them (primitives, wiring, dtypes, ranks,
weak types and non-size parameters) and abstracts sizes, wherever they are: avals print as
``f32[?,?]``, in variables and in parameters alike (any parameter value that is an aval or a
``jax.ShapeDtypeStruct``, such as ``pure_callback``'s ``result_avals``), and the integer
parameters that hold sizes (``SHAPE_PARAMS``) print as ``?`` in their structure. A size counts
elements along a dimension (a shape, a slice bound, a padding, a window extent, a loop length,
``top_k``'s ``k``); axis numbers, strides, dilations, group counts, dtypes and flags are not
sizes and are compared as they are. ``canonicalize(closed, sizes=True)`` keeps every size, for
comparing two traces at the same avals, where a size that differs was read from state.

Literal values are left out of the lines and collected apart (``Graph.literals``), because some
are sizes too (``jnp.mean`` divides by the element count); ``trace`` compares them only between
traces made at the same avals.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jamp import _compat as compat

# Integer parameters that hold concrete sizes, per primitive (JAX 0.10 and 0.12, audited over
# every primitive either defines; tests/test_graph_params.py has one test per family).
SHAPE_PARAMS: dict[str, frozenset[str]] = {
    # shapes of new arrays
    "broadcast_in_dim": frozenset({"shape"}),
    "broadcast_to": frozenset({"shape"}),  # Pallas refs
    "reshape": frozenset({"new_sizes"}),
    "iota": frozenset({"shape"}),
    "empty": frozenset({"shape"}),
    "tile": frozenset({"reps"}),  # ``jnp.tile(x, (x.shape[0], 1))`` repeats by a size
    "random_bits": frozenset({"shape"}),
    "random_split": frozenset({"shape"}),
    "iota_2x32_shape": frozenset({"shape"}),
    "rng_bit_generator": frozenset({"shape"}),
    "rng_uniform": frozenset({"shape"}),
    # extents of slices, paddings and windows
    "slice": frozenset({"start_indices", "limit_indices"}),
    "dynamic_slice": frozenset({"slice_sizes"}),
    "gather": frozenset({"slice_sizes"}),
    "pad": frozenset({"padding_config"}),
    "split": frozenset({"sizes"}),
    # SAME padding depends on the spatial size; a window may span a whole dimension
    "conv_general_dilated": frozenset({"padding"}),
    "reduce_window": frozenset({"padding", "window_dimensions"}),
    "reduce_window_sum": frozenset({"padding", "window_dimensions"}),
    "reduce_window_max": frozenset({"padding", "window_dimensions"}),
    "reduce_window_min": frozenset({"padding", "window_dimensions"}),
    "select_and_scatter_add": frozenset({"padding", "window_dimensions"}),
    "select_and_scatter": frozenset({"padding", "window_dimensions"}),
    "select_and_gather_add": frozenset({"padding", "window_dimensions"}),
    # Ref indexers (``ref[:n]``): slice starts and sizes and the ref's shape, in a PyTreeDef
    "get": frozenset({"tree"}),
    "swap": frozenset({"tree"}),
    "addupdate": frozenset({"tree"}),
    # counts that are sizes of the data
    "scan": frozenset({"length"}),
    "fft": frozenset({"fft_lengths"}),
    "top_k": frozenset({"k"}),  # often derived from a size (``k = n // 2``); see below
    "approx_top_k": frozenset({"k", "reduction_input_size_override"}),
    "lu_pivots_to_permutation": frozenset({"permutation_size"}),
    # cuDNN RNN (GPU only): feature sizes
    "rnn_fwd": frozenset({"input_size", "hidden_size"}),
    "rnn_bwd": frozenset({"input_size", "hidden_size"}),
    # Equinox's vmapped primitives (its checkpointed loops, diffrax): the vmap axis size
    "vprim": frozenset({"__axis_size"}),
}
# ``k`` and other sizes are abstracted only between traces at different avals: between traces at
# the same avals ``trace`` compares the exact form, so a ``k`` read from state is still caught.


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
    sizes: bool = False  # True: concrete sizes kept (the exact form)


def aval_text(aval: Any, *, sizes: bool = False) -> str:
    dtype = getattr(aval, "dtype", None)
    shape = getattr(aval, "shape", ())
    dims = ",".join(str(d) if sizes else "?" for d in shape)
    weak = "~" if getattr(aval, "weak_type", False) else ""
    return f"{weak}{getattr(dtype, 'name', dtype)}[{dims}]"


def canonicalize(closed: Any, *, sizes: bool = False) -> Graph:
    """The canonical form of a closed jaxpr (recursing into every sub-jaxpr); ``sizes=True``
    keeps concrete sizes."""
    jaxpr, consts = compat.open_and_consts(closed)
    builder = _Builder(sizes)
    builder.add_jaxpr(jaxpr, depth=0)
    const_sources = [builder.first_use.get(id(v), "<unused>") for v in jaxpr.constvars]
    return Graph(builder.lines, builder.literals, list(zip(consts, const_sources)), sizes)


class _Builder:
    def __init__(self, sizes: bool) -> None:
        self.sizes = sizes
        self.lines: list[Line] = []
        self.literals: list[tuple[Any, str, str]] = []
        self.first_use: dict[int, str] = {}

    def add_jaxpr(self, jaxpr: Any, depth: int) -> None:
        names: dict[int, str] = {}
        pad = "  " * depth

        def aval(var: Any) -> str:
            return aval_text(var.aval, sizes=self.sizes)

        def define(var: Any, prefix: str) -> str:
            names[id(var)] = f"{prefix}{len(names)}"
            return f"{names[id(var)]}:{aval(var)}"

        def read(var: Any, source: str) -> str:
            """An operand's text, recording a literal's value or a variable's first use."""
            if isinstance(var, compat.Literal):
                self.literals.append((var.val, aval_text(var.aval), source))
                return f"lit:{aval(var)}"
            self.first_use.setdefault(id(var), source)
            return names.get(id(var), "?")

        header = " ".join(define(v, "c") for v in jaxpr.constvars)
        header += " ; " + " ".join(define(v, "a") for v in jaxpr.invars)
        self.lines.append(Line(f"{pad}lambda {header}", "<inputs>"))
        for eqn in jaxpr.eqns:
            source = compat.source_line(eqn)
            ins = [read(var, source) for var in eqn.invars]
            params = _Params(self.sizes)
            text = params.text(eqn.primitive.name, eqn.params)
            outs = " ".join(define(v, "v") for v in eqn.outvars)
            self.lines.append(
                Line(f"{pad}{outs} = {eqn.primitive.name}[{text}] {' '.join(ins)}", source)
            )
            for sub in params.subs:
                self.add_jaxpr(compat.open_and_consts(sub)[0], depth + 1)
        # A value returned as it is (a counter, an np.random array) is used nowhere else: its
        # output names it, as the output check does (``Output nr 2``).
        returned = [
            read(var, f"output nr {number} (returned as it is)" if depth == 0 else "<outputs>")
            for number, var in enumerate(jaxpr.outvars, start=1)
        ]
        self.lines.append(Line(f"{pad}return {' '.join(returned)}", "<outputs>"))


class _Params:
    """Canonical text of one equation's parameters; collects the sub-jaxprs among them."""

    def __init__(self, sizes: bool) -> None:
        self.sizes = sizes
        self.subs: list[Any] = []

    def text(self, primitive: str, params: dict[str, Any]) -> str:
        size_params = frozenset() if self.sizes else SHAPE_PARAMS.get(primitive, frozenset())
        parts = []
        for key in sorted(params):
            value = params[key]
            text = _sizes_abstracted(value) if key in size_params else self.value(value)
            parts.append(f"{key}={text}")
        return " ".join(parts)

    def value(self, value: Any) -> str:
        for matches, render in _VALUE_RULES:
            if matches(value):
                return render(self, value)
        text = repr(value)
        return f"<{type(value).__name__}>" if " at 0x" in text else text

    def sub_jaxpr(self, value: Any) -> str:
        self.subs.append(value)
        return f"<jaxpr {len(self.subs) - 1}>"

    def aval(self, value: Any) -> str:
        return aval_text(value, sizes=self.sizes)

    def sequence(self, value: Any) -> str:
        return "(" + ",".join(self.value(v) for v in value) + ")"


def _function_text(_: _Params, value: Any) -> str:
    # thunks and rules (custom_jvp/vjp, callbacks) differ in identity between traces, not meaning
    return f"<fn {getattr(value, '__name__', type(value).__name__)}>"


# How a parameter value prints, by kind (first match wins): avals anywhere in a parameter (a
# callback's ``result_avals``, an ``ffi_call``'s, Equinox's) print as avals, sizes abstracted.
_VALUE_RULES: tuple[tuple[Callable[[Any], bool], Callable[[_Params, Any], str]], ...] = (
    (compat.is_jaxpr_like, _Params.sub_jaxpr),
    (lambda v: isinstance(v, (compat.AbstractValue, jax.ShapeDtypeStruct)), _Params.aval),
    (lambda v: isinstance(v, (tuple, list)), _Params.sequence),
    (lambda v: callable(v) and not isinstance(v, type), _function_text),
)

_INTEGER = re.compile(r"(?<![\w.])-?\d+(?![\w.])")  # whole numbers, not the 32 of float32


def _sizes_abstracted(value: Any) -> str:
    """A size parameter with every integer as ``?``, its structure (hence its rank) kept."""
    if isinstance(value, (tuple, list)):
        return "(" + ",".join(_sizes_abstracted(v) for v in value) + ")"
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return "?"
    return _INTEGER.sub("?", repr(value))  # a Ref indexer's PyTreeDef


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
        f"Diff{'' if a.sizes else ' (sizes abstracted as ?)'}:\n" + "\n".join(diff)
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
    """A NumPy array of ``x``; PRNG keys as their key data. An array split over several hosts
    (``jax.distributed``) is gathered whole on each: every process makes the same calls in the
    same order, as the collective needs, because each traces and checks the same program."""
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def shape_dtype(x: Any) -> str:
    return aval_text(compat.aval_of(x), sizes=True)
