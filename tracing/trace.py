"""``trace`` and ``check_trace``: a traced program plus checks that it did not bake in state.

In JAX, reading a traced value as a Python value already raises, so the dangerous traces are the
ones that succeed: a Python counter or ``np.random`` read at trace time becomes a constant, a
PRNG key closed over draws the same numbers on every call, a loop over ``x.shape[0]`` unrolls to
a program for one size. The checks trace the function again, for the example inputs and for
every ``check_inputs`` entry, and compare.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import re
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np

from jamp import _compat as compat

from . import graph as graphs
from . import leaks, randomness
from . import tolerance as tolerances
from .errors import TracerWarning, TracingCheckError, caller_stacklevel
from .inputs import (
    as_inputs,
    check_binds,
    reject_number_lists,
    reject_tracers,
    validate_check_inputs,
    with_drawn_values,
)
from .program import ChangedSinceTraced, Program, callable_name, keep_dict_order, order_skeleton
from .signature import Signature


@dataclasses.dataclass
class Trace:
    """One trace of the function: its closed jaxpr, signature and output tree."""

    closed: Any
    signature: Signature
    out_tree: Any
    out_template: Any  # ``order_skeleton`` of the function's outputs (its dict order)

    def same_avals(self, other: Trace) -> bool:
        return (
            self.signature.in_tree == other.signature.in_tree
            and self.signature.avals == other.signature.avals
        )

    def describe(self) -> str:
        avals = ", ".join(graphs.aval_text(a, sizes=True) for a in self.signature.avals)
        return f"({avals})"


class TracedFunction(Program):
    """The compiled program of a traced function.

    Call it like the function (same pytree inputs, same shapes and dtypes). ``.jaxpr`` is the
    closed jaxpr, ``.graph`` its text, ``.hlo`` the StableHLO, ``.export()`` the ``jax.export``
    bytes that ``tracing.load`` reads back; ``.export(polymorphic_shapes="b, ...")`` traces the
    function again at symbolic shapes, for a loaded function that takes any batch size.
    """

    reshape_remedy = (
        "trace it again at the new shapes, or export it with polymorphic_shapes= "
        "(traced.export(polymorphic_shapes='b, ...')) and call tracing.load(blob), which takes "
        "any size for the symbolic dimensions"
    )
    remade_by = "tracing it again"


def resolve_function(fn: Any) -> tuple[Callable, str]:
    """The function to trace, with its name; an NNX module is called with its state captured."""
    if "flax" in sys.modules:
        from flax import linen, nnx

        if isinstance(fn, nnx.Module):
            graphdef, live = nnx.split(fn)
            # The state as it is now, in Variables of its own: the split's share the module's,
            # so a later weight update would reach a retrace (a polymorphic export).
            state = jax.tree.map(_own_value, live)

            def call_module(*args: Any) -> Any:
                # Fresh Variables inside the trace (NNX refuses updates to ones made outside it,
                # e.g. an Rngs counter); the updates are dropped with the trace.
                return nnx.merge(graphdef, jax.tree.map(lambda leaf: leaf, state))(*args)

            try:  # for the arity checks of the example and check inputs
                call_module.__signature__ = inspect.signature(fn)  # type: ignore[attr-defined]
            except (TypeError, ValueError):
                pass
            return call_module, type(fn).__name__
        if isinstance(fn, linen.Module):
            raise TypeError(
                f"trace a linen module through its apply function: "
                f"tracing.trace({type(fn).__name__}(...).apply, (variables, x))"
            )
    if not callable(fn):
        raise TypeError(
            f"tracing.trace expects a callable or an NNX module, got {type(fn).__name__}"
        )
    return fn, callable_name(fn)


def _own_value(leaf: Any) -> Any:
    """A copy of a NumPy array (the caller may write to it); JAX arrays are immutable."""
    return leaf.copy() if isinstance(leaf, np.ndarray) else leaf


_TRACE_ERROR_HINT = (
    "Hint: a Python `if`, `int()`, `float()` or `np.asarray` on a traced value needs its concrete "
    "value, which a trace does not have. Make such arguments static (bind them with "
    "functools.partial before tracing), branch on data with lax.cond / lax.switch or select with "
    "jnp.where, and keep values out of globals and attributes."
)


@contextlib.contextmanager
def trace_errors_named(
    name: str, hint: str = _TRACE_ERROR_HINT, paths: Sequence[str] = ()
) -> Iterator[None]:
    """JAX's errors for a trace that needed a concrete value, used a leaked tracer or gave
    ``jax.jit`` a tracer for a static argument, as a :class:`TracingCheckError` naming ``name``
    (the user's function) with ``hint``: JAX's own name the function it traced, a wrapper of
    ours, and its flattened arguments (``leaves[1]``), named here by ``paths`` (``inputs[1]``)."""
    try:
        yield
    except (
        jax.errors.ConcretizationTypeError,
        jax.errors.TracerArrayConversionError,
        jax.errors.TracerIntegerConversionError,
        jax.errors.TracerBoolConversionError,
    ) as err:
        raise TracingCheckError(
            f"Tracing {name} failed: it needs the concrete value of a traced input"
            f"{_inputs_named(str(err), paths)}.\n"
            f"{hint}\nOriginal error: {type(err).__name__}: {str(err).splitlines()[0]}"
        ) from err
    except jax.errors.UnexpectedTracerError as err:  # a tracer leaked by an earlier trace, used
        raise TracingCheckError(
            f"Tracing {name} failed: it used a traced value that leaked out of an earlier trace "
            "(kept in a global, a closure, a list or an object attribute).\n"
            f"{hint}\nOriginal error: {type(err).__name__}: {str(err).splitlines()[0]}"
        ) from err
    except ValueError as err:
        if not compat.is_traced_static_argument_error(err):
            raise
        raise TracingCheckError(
            f"Tracing {name} failed: a jax.jit function with static arguments (it, or one it "
            "calls) got a traced value for one, which jax.jit cannot hash: every example input "
            "is traced. Bind static arguments first (functools.partial(fn, n=2)) and trace the "
            f"rest.\nOriginal error: {type(err).__name__}: {str(err).splitlines()[0]}"
        ) from err


_FLAT_ARGUMENT = re.compile(r"\bleaves\[(\d+)\]")  # how JAX names an argument of flat_fn


def _inputs_named(message: str, paths: Sequence[str]) -> str:
    """`` (inputs[1])``: the inputs whose values JAX's ``message`` says were needed, by path."""
    numbers = dict.fromkeys(int(n) for n in _FLAT_ARGUMENT.findall(message))
    named = [paths[n] for n in numbers if n < len(paths)]
    return f" ({', '.join(named)})" if named else ""


def trace_once(fn: Callable, inputs: tuple, name: str) -> Trace:
    """Trace ``fn`` at ``inputs``' avals, for real (never answered from JAX's trace cache)."""
    signature = Signature.of(inputs)
    in_order, skeleton = order_skeleton(inputs), []

    def flat_fn(*leaves: Any) -> Any:
        # A new function object per trace: jax.make_jaxpr caches traces on the function's
        # identity, which would make a retrace of the same function repeat the first one.
        # The function sees its input dicts in the caller's order (pytrees sort dict keys).
        outputs = fn(*keep_dict_order(in_order, jax.tree.unflatten(signature.in_tree, leaves)))
        for path, leaf in jax.tree_util.tree_flatten_with_path(outputs)[0]:
            if not isinstance(leaf, (jax.Array, np.ndarray, np.generic, bool, int, float)):
                raise TypeError(
                    f"{name} returned a {type(leaf).__name__} at outputs"
                    f"{jax.tree_util.keystr(path)}: traced functions return arrays, "
                    "numbers and pytrees of them"
                )
        skeleton.append(order_skeleton(outputs))
        return outputs

    with trace_errors_named(name, paths=signature.paths):
        closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*signature.avals)
    closed = _with_own_constants(closed)
    leaked = leaks.find_leaked_tracer(fn, name)
    if leaked is not None:
        tracer, where = leaked
        raise TracingCheckError(
            f"Tracing {name} failed: a traced value leaked out of the trace: {where} holds a "
            f"tracer ({graphs.aval_text(tracer.aval, sizes=True)}) stored while tracing, so the "
            "traced program would not be self-contained and a later call would read a stale "
            "tracer. Return the value as an output instead of storing it (and clear what holds "
            "it now)."
        )
    return Trace(closed, signature, jax.tree.structure(out_shape), skeleton[0])


def _with_own_constants(closed: Any) -> Any:
    """``closed`` with copies of its NumPy constants: JAX captures a closed-over NumPy array by
    reference, so a caller writing to it later (``w[:] = 5``) would change what the program, its
    checks and its export compute. The values seen when traced are the ones kept, as
    ``jax.jit`` and ``torch.jit.trace`` keep them (JAX arrays are immutable: shared)."""
    jaxpr, consts = compat.open_and_consts(closed)
    if not any(isinstance(c, np.ndarray) for c in consts):
        return closed
    return compat.close_jaxpr(jaxpr, [_own_value(c) for c in consts])


@compat.api_boundary  # (fn's errors show fn's frames, as under jax.jit)
def trace(
    fn: Any,
    example_inputs: Any,
    *,
    check_trace: bool = True,
    check_inputs: Sequence[Any] | None = None,
    check_tolerance: float = 1e-5,
) -> TracedFunction:
    """Trace ``fn`` at ``example_inputs`` into a compiled, exportable program, and check it.

    ``example_inputs`` is a tuple of positional arguments (anything else stands for a 1-tuple);
    the entries of ``check_inputs`` likewise. The checks (see ``check_trace``) trace ``fn`` again
    for the example inputs and every ``check_inputs`` entry, and raise ``TracingCheckError`` when
    the graphs or their captured constants differ; they warn (``TracerWarning``) when the outputs
    disagree with the function run op by op or when a captured PRNG key is drawn from.

    Outputs are compared within ``max(check_tolerance, 4 * eps)`` of the narrowest floating dtype
    on each output's computation path (bfloat16 intermediates give bfloat16 tolerance to a float32
    output), relative to each element and to the output's magnitude, or, for an output that still
    disagrees, to the magnitude of the accumulations on its path (``tracing/tolerance.py`` has
    the exact rule). ``example_inputs`` must be a tuple for several arguments (a list is one
    argument); ``check_inputs`` entries must have its pytree structure (``TypeError`` naming
    ``check_inputs[i]`` otherwise). A Python list of numbers as an input (``([1.0, 2.0],)``)
    raises ``TypeError``: it would be traced as separate scalars, so pass ``jnp.asarray`` of it.
    A tracer the function stores where it can read it again (a global, a closure, an
    attribute) raises ``TracingCheckError``; JAX's own caches do not.

    ``fn`` may be a linen ``model.apply`` (the variables are then an input:
    ``trace(model.apply, (variables, x))``) or an NNX module, whose current state is captured as
    constants of the trace (updates the call makes to it, like BatchNorm statistics, are dropped).

    Example::

        traced = tracing.trace(f, (x, w), check_inputs=[(x2, w)])
        traced(x, w)              # runs the compiled program
        text = traced.graph       # the jaxpr as text
        blob = traced.export()    # tracing.load(blob)(x, w)
    """
    primary, name, resolved = _trace_and_check(
        fn, example_inputs, check_inputs, check_tolerance, run_checks=check_trace
    )

    def retrace(inputs: tuple) -> tuple[Any, Any]:  # for export(polymorphic_shapes=...)
        _check_state_unchanged(resolved, name, primary)
        again = trace_once(resolved, inputs, name)
        return again.closed, again.out_tree

    return TracedFunction(
        primary.closed, primary.signature, primary.out_tree, name, primary.out_template, retrace
    )


def _check_state_unchanged(fn: Callable, name: str, primary: Trace) -> None:
    """``TracingCheckError`` when ``fn`` traced again now, at the traced shapes, captures other
    constants than when it was traced: a polymorphic export traces it again, and would otherwise
    compute other numbers than the traced program (a global setting changed since)."""
    specs = keep_dict_order(primary.signature.order, primary.signature.specs())
    label = "export(polymorphic_shapes=...), which traces it again now"
    now = trace_once(fn, specs, name)  # (a failure: reported as the export's retrace's)
    try:
        reference, other = (graphs.canonicalize(t.closed) for t in (primary, now))
        _compare_graphs(reference, other, primary, now, label)
    except TracingCheckError as err:
        raise ChangedSinceTraced(
            f"{name} reads state that changed since it was traced, so an export at symbolic "
            "shapes would compute other numbers than the traced program; trace it again, or "
            f"restore the state, before exporting.\n{err}"
        ) from None


@compat.api_boundary
def check_trace(
    fn: Any,
    example_inputs: Any,
    check_inputs: Sequence[Any] | None = None,
    *,
    check_tolerance: float = 1e-5,
) -> None:
    """Only the checks of ``trace``: raises ``TracingCheckError`` or warns ``TracerWarning``.

    Example::

        tracing.check_trace(f, (x,), check_inputs=[(x_other_batch,)])
    """
    _trace_and_check(fn, example_inputs, check_inputs, check_tolerance, run_checks=True)


def _trace_and_check(
    fn: Any,
    example_inputs: Any,
    check_inputs: Sequence[Any] | None,
    tolerance: float,
    run_checks: bool,
) -> tuple[Trace, str, Callable]:
    """The trace at the example inputs (with the PRNG-key check) and, if asked, the others."""
    _check_options(run_checks, tolerance)
    fn, name = resolve_function(fn)
    example = as_inputs(example_inputs)
    reject_tracers(example, "example_inputs")
    check_binds(fn, name, example_inputs, example, "example_inputs")
    reject_number_lists(example_inputs, "example_inputs")
    primary = trace_once(fn, example, name)
    randomness.warn_constant_keys(primary.closed, name)
    if run_checks:
        _run_checks(fn, name, primary, example, check_inputs, tolerance)
    return primary, name, fn


def _check_options(check_trace: Any, check_tolerance: Any) -> None:
    """A clear error for option values that would otherwise be misread silently (a string
    ``check_trace`` is truthy, a negative tolerance means the dtype's own)."""
    if not isinstance(check_trace, (bool, np.bool_)):
        raise TypeError(
            f"check_trace must be True or False, got {type(check_trace).__name__} {check_trace!r}"
        )
    if isinstance(check_tolerance, (bool, np.bool_)) or not isinstance(
        check_tolerance, (int, float, np.integer, np.floating)
    ):
        raise TypeError(
            f"check_tolerance must be a number such as 1e-5, got "
            f"{type(check_tolerance).__name__} {check_tolerance!r}"
        )
    if not (np.isfinite(check_tolerance) and check_tolerance >= 0):
        raise ValueError(f"check_tolerance must be finite and >= 0, got {check_tolerance}")


def _run_checks(
    fn: Callable,
    name: str,
    primary: Trace,
    example: tuple,
    check_inputs: Sequence[Any] | None,
    tolerance: float,
) -> None:
    checks = validate_check_inputs(check_inputs, primary.signature, len(example))
    # The example inputs are always traced again: that is what catches state read at trace time
    # (literals may be sizes, so they are only comparable between traces at the same avals).
    input_sets = [example] + checks
    reference = graphs.canonicalize(primary.closed)
    for number, inputs in enumerate(input_sets):
        label = "the example inputs" if number == 0 else f"check_inputs[{number - 1}]"
        again = _trace_entry(fn, inputs, name, label)
        _compare_graphs(reference, graphs.canonicalize(again.closed), primary, again, label)
        traced = primary if again.same_avals(primary) else again
        _compare_outputs(fn, name, traced, with_drawn_values(inputs, number), tolerance)


def _trace_entry(fn: Callable, inputs: tuple, name: str, label: str) -> Trace:
    """``trace_once`` at one entry of the checks; a failure names the entry (``check_inputs[1]``)
    and its shapes, since the function traced at the example inputs."""
    try:
        return trace_once(fn, inputs, name)
    except Exception as err:
        avals = Signature.of(inputs).avals
        shapes = ", ".join(graphs.aval_text(a, sizes=True) for a in avals)
        message = str(err).removeprefix(f"Tracing {name} failed: ")
        raise TracingCheckError(
            f"Tracing {name} at {label} ({shapes}) failed, though it traced at the example "
            f"inputs: {type(err).__name__}: {message}"
        ) from err


def _compare_graphs(
    reference: graphs.Graph, other: graphs.Graph, primary: Trace, again: Trace, label: str
) -> None:
    first_name = f"trace at the example inputs {primary.describe()}"
    other_name = f"trace at {label} {again.describe()}"
    if again.same_avals(primary):  # every size must match too: one that differs was read from state
        reference, other = (graphs.canonicalize(t.closed, sizes=True) for t in (primary, again))
    diff = graphs.describe_difference(reference, other, first_name, other_name)
    if diff:
        raise TracingCheckError("Graphs differed across invocations!\n" + diff)
    for i, ((a, where), (b, _)) in enumerate(zip(reference.consts, other.consts)):
        if compat.aval_of(a).shape == compat.aval_of(b).shape and not graphs.values_equal(a, b):
            raise TracingCheckError(
                "Constants differed in value across invocations. This often indicates that the "
                "function read state at trace time (a Python counter, np.random, a global array) "
                f"that changes between calls.\nCaptured constant #{i}: {graphs.shape_dtype(a)}, "
                f"first used at {where}. Pass the value as an input instead."
            )
    if not again.same_avals(primary):
        return
    for (a, dtype, where), (b, _, _) in zip(reference.literals, other.literals):
        if not graphs.values_equal(a, b):
            raise TracingCheckError(
                "Constants differed in value across invocations. This often indicates that the "
                "function read state at trace time (a Python counter, np.random, a global) that "
                f"changes between calls.\nCaptured scalar {dtype}: {np.asarray(a).item()!r} in "
                f"the first trace, {np.asarray(b).item()!r} when traced again for {label}; used "
                f"at {where}. Pass it as an input instead."
            )


def _fresh_containers(inputs: tuple) -> tuple:
    """``inputs`` in new dicts, lists and tuples (in the caller's dict order), the leaves shared:
    a function that updates its input dict (``batch["x"] = ...``) must not change the caller's,
    as it cannot through the traces, which rebuild them too."""
    leaves, tree = jax.tree.flatten(inputs)
    return keep_dict_order(order_skeleton(inputs), jax.tree.unflatten(tree, leaves))


def _compare_outputs(
    fn: Callable, name: str, traced: Trace, inputs: tuple, check_tolerance: float
) -> None:
    """Warn for each output of the compiled program that disagrees with ``fn`` run op by op,
    beyond the tolerance of the precision it was computed in (``tolerance.py``)."""
    program = Program(traced.closed, traced.signature, traced.out_tree, name)  # leaves only
    got = program(*inputs)
    with jax.disable_jit():
        expected = fn(*_fresh_containers(inputs))
    got_leaves, expected_leaves = jax.tree.leaves(got), jax.tree.leaves(expected)
    if len(got_leaves) != len(expected_leaves):
        warnings.warn(
            f"{name}: the traced function returns {len(got_leaves)} outputs, the "
            f"Python function {len(expected_leaves)}",
            TracerWarning,
            stacklevel=caller_stacklevel(),
        )
        return
    tols = [tolerances.tolerance(d, check_tolerance) for d in tolerances.path_dtypes(traced.closed)]
    errors = [
        tolerances.mismatch(a, b, tol, check_tolerance)
        for a, b, tol in zip(got_leaves, expected_leaves, tols)
    ]
    if any(errors):  # second pass: the magnitudes of the values the outputs were computed from
        involved = tolerances.accumulation_magnitudes(
            traced.closed, traced.signature.flatten(inputs, name), default=0.0
        )
        errors = [
            error and tolerances.mismatch(a, b, tol, check_tolerance, scale)
            for error, a, b, tol, scale in zip(errors, got_leaves, expected_leaves, tols, involved)
        ]
    for number, error in enumerate(errors, start=1):
        if error:
            warnings.warn(
                f"Output nr {number}. of the traced function does not match the corresponding "
                f"output of the Python function. Detailed error:\n{error}",
                TracerWarning,
                stacklevel=caller_stacklevel(),
            )
