"""``example_inputs`` and ``check_inputs``, validated before anything is traced.

A wrong entry should be reported where the user wrote it (``check_inputs[1]``, a pytree path,
the function's own parameters), not as an error from inside their function or from JAX.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jamp import _compat as compat

from .signature import Signature, weak_type_mismatch

_CHECK_INPUTS_FORM = (
    "check_inputs is a list with one tuple of positional arguments per check, "
    "like example_inputs: check_inputs=[(x2, w), (x3, w)]"
)


def as_inputs(example_inputs: Any) -> tuple:
    """A plain tuple is the positional arguments; anything else (a list, a namedtuple) is one."""
    return example_inputs if type(example_inputs) is tuple else (example_inputs,)


_OUTSIDE = (
    "tracing.trace and check_trace cannot run inside jax.jit, grad, vmap or another "
    "transformation. Call them outside, with concrete arrays or jax.ShapeDtypeStruct; "
    "the TracedFunction they return can then be called inside jit."
)


def reject_tracers(inputs: tuple, label: str) -> None:
    """TypeError when an input is a tracer, or JAX is tracing: ``trace`` was called inside jit,
    grad or vmap."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(inputs)[0]:
        if compat.is_tracer(leaf):
            raise TypeError(
                f"{label}{jax.tree_util.keystr(path)} is a traced value "
                f"({getattr(leaf, 'aval', leaf)}): {_OUTSIDE}"
            )
    if compat.under_transformation():
        raise TypeError(f"JAX is tracing (the call is inside a transformation): {_OUTSIDE}")


def _is_number_list(x: Any) -> bool:
    """A Python list (of lists) whose leaves are all Python numbers: ``[1.0, 2.0]``."""
    if type(x) is not list:
        return False
    leaves = jax.tree.leaves(x)
    return bool(leaves) and all(type(leaf) in (bool, int, float, complex) for leaf in leaves)


def reject_number_lists(raw: Any, label: str) -> None:
    """TypeError for a Python list of numbers among the inputs ``raw`` (as the user gave them,
    named ``label``). As a pytree it would be traced as that many separate scalar inputs, fixed
    in count (calls with an array, or a list of another length, then fail), where an array is
    what is meant (torch.jit.trace refuses it too). Separate scalars remain possible as a list
    of arrays."""
    inputs = as_inputs(raw)
    with_paths = jax.tree_util.tree_flatten_with_path(inputs, is_leaf=_is_number_list)[0]
    for path, leaf in with_paths:
        if _is_number_list(leaf):
            path = path if inputs is raw else path[1:]  # raw stood for the one argument
            text = repr(leaf) if len(repr(leaf)) <= 40 else "[...]"
            raise TypeError(
                f"{label}{jax.tree_util.keystr(path)} is a Python list of numbers, {text}: as "
                f"a pytree it would be traced as {len(jax.tree.leaves(leaf))} separate scalar "
                f"inputs, not as one array. Pass jnp.asarray({text}) for an array input, or a "
                "list of arrays (jnp.float32(v) for each v) for separate scalars"
            )


def check_binds(fn: Callable, name: str, raw: Any, inputs: tuple, label: str) -> None:
    """TypeError naming ``label`` when ``inputs`` cannot be ``fn``'s positional arguments."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins and C callables: JAX reports
        return
    try:
        signature.bind(*inputs)
    except TypeError as err:
        message = f"{label} gives {name}{signature} {len(inputs)} positional argument(s): {err}."
        if type(raw) is list and _binds(signature, raw):
            message += (
                f" {label} is a list, which stands for one argument (a list pytree); "
                "give the positional arguments as a tuple: "
                f"({', '.join(f'a{i}' for i in range(len(raw)))},)"
            )
        raise TypeError(message) from None


def _binds(signature: inspect.Signature, args: Sequence[Any]) -> bool:
    try:
        signature.bind(*args)
        return True
    except TypeError:
        return False


def validate_check_inputs(
    check_inputs: Sequence[Any] | None, example: Signature, example_count: int
) -> list[tuple]:
    """The entries of ``check_inputs`` as input tuples, each with ``example``'s pytree structure.

    Raises TypeError naming ``check_inputs[i]`` and the first differing pytree path.
    """
    if check_inputs is None:
        return []
    if (
        isinstance(check_inputs, (str, bytes))
        or not isinstance(check_inputs, Sequence)
        or compat.is_tracer(check_inputs)
        or isinstance(check_inputs, jax.Array)
    ):
        raise TypeError(
            f"check_inputs must be a list of input tuples, got "
            f"{type(check_inputs).__name__}. {_CHECK_INPUTS_FORM}"
        )
    entries = []
    for number, raw in enumerate(check_inputs):
        label = f"check_inputs[{number}]"
        inputs = as_inputs(raw)
        reject_tracers(inputs, label)
        reject_number_lists(raw, label)
        if len(inputs) != example_count:
            kind = (
                "a list, which stands for one argument"
                if type(raw) is list
                else "not a tuple, so it stands for one argument"
                if type(raw) is not tuple
                else "a tuple"
            )
            raise TypeError(
                f"{label} has {len(inputs)} positional argument(s) ({kind}), "
                f"example_inputs {example_count}. {_CHECK_INPUTS_FORM}"
            )
        with_paths, tree = jax.tree_util.tree_flatten_with_path(inputs)
        if tree != example.in_tree:
            raise TypeError(
                f"{label} differs from example_inputs in pytree structure: "
                f"{example.structure_mismatch(with_paths, tree)}"
            )
        try:
            signature = Signature.of(inputs)
        except TypeError as err:
            raise TypeError(f"{label}: {err}") from None
        _check_types(label, example, signature)
        entries.append(inputs)
    return entries


def _check_types(label: str, example: Signature, entry: Signature) -> None:
    """Each leaf of a ``check_inputs`` entry has its example's dtype, rank and weak type (a
    Python number or not): the program takes no other (its calls refuse them), so its trace
    there would differ for no fault of the function's (reported as "Graphs differed")."""
    for path, want, got in zip(example.paths, example.avals, entry.avals):
        if got.dtype != want.dtype or len(got.shape) != len(want.shape):
            raise TypeError(
                f"{label}: {path} is {_type_text(got)} where example_inputs have "
                f"{_type_text(want)}; check_inputs retrace the function at other sizes of the "
                "same dtypes and ranks (the traced program takes no other)"
            )
        weak = weak_type_mismatch(path, got, want)
        if weak:
            raise TypeError(f"{label}: {weak}")


def _type_text(aval: Any) -> str:
    return f"{aval.dtype}[{','.join(map(str, aval.shape))}]"  # (float32[3,4] on every JAX)


def with_drawn_values(inputs: tuple, seed: int) -> tuple:
    """``inputs`` with each ``jax.ShapeDtypeStruct`` leaf replaced by an array of its shape and
    dtype, for the output check, which runs the function and so needs values: floating and
    complex leaves are drawn from a standard normal (a fixed key per ``seed`` and leaf), the
    others (integers, bools, PRNG keys) are zeros, valid as indices and keys."""
    leaves, tree = jax.tree.flatten(inputs)
    if not any(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in leaves):
        return inputs
    key = jax.random.key(seed)
    drawn = [
        _drawn(leaf, jax.random.fold_in(key, number))
        if isinstance(leaf, jax.ShapeDtypeStruct)
        else leaf
        for number, leaf in enumerate(leaves)
    ]
    return jax.tree.unflatten(tree, drawn)


def _drawn(spec: jax.ShapeDtypeStruct, key: Any) -> Any:
    if jnp.issubdtype(spec.dtype, jnp.inexact):
        wide = jnp.complex64 if jnp.issubdtype(spec.dtype, jnp.complexfloating) else jnp.float32
        value = jax.random.normal(key, spec.shape, wide).astype(spec.dtype)
    else:
        value = jnp.zeros(spec.shape, spec.dtype)
    return compat.convert(value, spec.dtype, weak_type=True) if spec.weak_type else value
