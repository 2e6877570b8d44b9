"""Constant folding: evaluate, at freeze time, every equation whose inputs are all known.

The leading inputs of the program (the variables) become known values; the rest stay inputs.
The program is walked equation by equation under a fresh ``jax.make_jaxpr``: an equation whose
inputs are all known is evaluated eagerly (``jax.ensure_compile_time_eval``) and its outputs are
known too; any other equation is re-bound under the trace, and the known values it reads become
constants of the new program. ``jit`` calls and other pure call wrappers are inlined, and a
``cond`` whose branch index is known runs the chosen branch inline (``RULES``), so folding reaches
into them. Never folded: random primitives and everything downstream of them
(a frozen sampler must still draw), equations with effects (callbacks, prints), and higher-order
equations whose bodies hold either.

A custom-derivative call (``custom_jvp``/``custom_vjp``) that reads a known value runs its
primal body inline, so the known part folds (the frozen program's derivative through it is then
JAX's own, not the custom rule). Three details keep the folded program faithful and lean:
- a folded value gets exactly the dtype and weak type the original program gave that value;
- values built from scalars alone (``broadcast_in_dim`` of a literal, ``iota``, and cheap
  elementwise and shape equations of those: ``jnp.eye``, a causal mask) are known for folding
  but re-emitted as the cheap equations when the program reads them, not stored as a large
  constant (XLA builds them inside fusions for free);
- a known 8-bit value (int8, float8: quantized weights) widened to a float stays narrow: the
  convert runs in the program instead of storing the widened copy;
- a layout-only equation (``LAYOUT_ONLY``: a transpose, reshape or broadcast) of a known value
  that the program also reads stays in the program when both would be stored: a tied embedding
  (Flax's ``Embed.attend`` reads ``embedding.T``) is stored once, not also transposed.

A program traced at symbolic shapes (``export(polymorphic_shapes=...)``) folds the same way;
an equation with a symbolic size in its outputs or parameters stays in the program.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jamp import _compat as compat

# Never evaluated at freeze time: a frozen sampler draws on every call, as the original did.
RANDOM_PRIMITIVES = frozenset(
    {
        "random_bits",
        "random_seed",
        "random_wrap",
        "random_unwrap",
        "random_split",
        "random_fold_in",
        "random_clone",
        "threefry2x32",
        "rng_bit_generator",
        "rng_uniform",
    }
)

Rule = Callable[["Folder", Any, list], list]
# Primitive name -> rule(folder, eqn, values) -> output values. The default is fold_or_bind.
RULES: dict[str, Rule] = {}


def register(*names: str) -> Callable[[Rule], Rule]:
    def wrap(rule: Rule) -> Rule:
        for name in names:
            RULES[name] = rule
        return rule

    return wrap


def is_known(value: Any) -> bool:
    return not compat.is_tracer(value)


class Folder:
    """Walks a jaxpr with known values and traced unknowns; see the module docstring."""

    def __init__(self) -> None:
        self._impure: dict[int, bool] = {}  # id(jaxpr) -> holds random or effectful eqns
        self._generators: dict[int, tuple[Any, list]] = {}  # id(value) -> (eqn, its inputs)
        self._staged: dict[int, Any] = {}  # id(value) -> the tracer it was re-emitted as
        self._views: dict[int, tuple[Any, Any]] = {}  # id(value) -> (layout eqn, its input)
        self._alive: list[Any] = []  # keeps ids above unique while the walk runs

    def run(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
        env: dict[Any, Any] = {}

        def read(var: Any) -> Any:
            return var.val if isinstance(var, compat.Literal) else env[var]

        for var, value in zip(jaxpr.constvars, consts):
            env[var] = value
        for var, value in zip(jaxpr.invars, args):
            env[var] = value
        for eqn in jaxpr.eqns:
            values = [read(v) for v in eqn.invars]
            outs = RULES.get(eqn.primitive.name, fold_or_bind)(self, eqn, values)
            for var, out in zip(eqn.outvars, outs):
                if not isinstance(var, compat.DropVar):
                    env[var] = out
        return [read(v) for v in jaxpr.outvars]

    def foldable(self, eqn: Any) -> bool:
        """Not random, no effects, and no sub-jaxpr holding either."""
        if eqn.primitive.name in RANDOM_PRIMITIVES or eqn.effects:
            return False
        return not any(self._holds_impure(sub) for sub in compat.sub_jaxprs(eqn.params))

    def _holds_impure(self, closed: Any) -> bool:
        key = id(closed)
        if key not in self._impure:
            jaxpr, _ = compat.open_and_consts(closed)
            self._impure[key] = any(not self.foldable(e) for e in jaxpr.eqns)
        return self._impure[key]

    def stage(self, value: Any) -> Any:
        """A known value as the program reads it: re-emit a generator (and the generators it is
        made of), else a constant."""
        if not is_known(value) or id(value) not in self._generators:
            return value
        if id(value) not in self._staged:
            eqn, inputs = self._generators[id(value)]
            self._staged[id(value)] = bind(eqn, [self.stage(v) for v in inputs])[0]
        return self._staged[id(value)]

    def note_generator(self, eqn: Any, values: list, outs: list) -> None:
        """A large output made from scalars alone, directly (``iota``, a broadcast literal) or
        through cheap elementwise and shape equations of such values (``jnp.eye``'s compare of
        two iotas, ``jnp.tril``'s mask): re-emitted, not stored. A costlier equation (a matmul,
        a reduction) of them is folded into a constant, as any other."""
        if len(outs) != 1 or _size(outs[0]) <= 1:
            return
        made_of_scalars = all(_size(v) <= 1 for v in values)
        if made_of_scalars or (
            eqn.primitive.name in CHEAP_FROM_GENERATORS
            and all(_size(v) <= 1 or id(v) in self._generators for v in values)
        ):
            self._generators[id(outs[0])] = (eqn, values)
            self._alive.append(outs[0])

    def note_view(self, eqn: Any, values: list, outs: list) -> None:
        """A known value rearranged by a layout-only equation: kept by ``restage_views`` as the
        equation, should both it and the value it rearranges be stored."""
        if (
            eqn.primitive.name in LAYOUT_ONLY
            and len(values) == 1
            and len(outs) == 1
            and _size(outs[0]) > 1
            and id(outs[0]) not in self._generators
        ):
            self._views[id(outs[0])] = (eqn, values[0])
            self._alive.append(outs[0])

    def restage_views(self, closed: Any) -> Any:
        """``closed`` with each constant that is a view of another constant (through a chain of
        layout-only equations) computed from it in the program instead of stored."""
        jaxpr, consts = compat.open_and_consts(closed)
        index = {id(c): i for i, c in enumerate(consts)}

        def const_of(value: Any) -> int | None:
            found = index.get(id(value))
            if found is None and isinstance(value, np.ndarray):  # JAX may wrap NumPy constants
                found = next(
                    (
                        i
                        for i, c in enumerate(consts)
                        if isinstance(c, np.ndarray)
                        and c.shape == value.shape
                        and np.may_share_memory(c, value)
                    ),
                    None,
                )
            return found

        def of_a_constant(value: Any) -> bool:
            while id(value) in self._views:
                value = self._views[id(value)][1]
                if const_of(value) is not None:
                    return True
            return False

        tied = {i for i, c in enumerate(consts) if id(c) in self._views and of_a_constant(c)}
        if not tied:
            return closed

        def run(*args: Any) -> list[Any]:
            made: dict[int, Any] = {}

            def rebuild(view: Any) -> Any:
                if id(view) not in made:
                    eqn, source = self._views[id(view)]
                    i = const_of(source)
                    # The constant itself, so the program reads the one stored copy.
                    read = source if i is None or i in tied else consts[i]
                    read = rebuild(read) if i is None or i in tied else read
                    made[id(view)] = bind(eqn, [read])[0]
                return made[id(view)]

            restaged = [rebuild(c) if i in tied else c for i, c in enumerate(consts)]
            return compat.eval_jaxpr(jaxpr, restaged, args)

        return compat.trace_to_closed(run, [v.aval for v in jaxpr.invars])


# Equations that only move a value's entries: a view of a stored constant is re-emitted.
LAYOUT_ONLY = frozenset({"transpose", "reshape", "broadcast_in_dim", "squeeze", "expand_dims"})

# Equations whose cost is their output's size: of generators, they are re-emitted as generators.
CHEAP_FROM_GENERATORS = frozenset(
    {
        "iota", "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose", "rev",
        "slice", "pad", "concatenate", "convert_element_type", "select_n", "clamp",
        "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not", "xor",
        "add", "sub", "mul", "div", "rem", "neg", "abs", "sign", "max", "min",
        "floor", "ceil", "round", "integer_pow", "square", "copy", "copy_p",
    }
)  # fmt: skip


def _size(value: Any) -> int:
    return math.prod(getattr(value, "shape", np.shape(value)))


def bind(eqn: Any, values: Sequence[Any]) -> list[Any]:
    """Bind the equation's primitive under the current trace, with its source info."""
    with compat.equation_context(eqn):
        out = eqn.primitive.bind(*values, **compat.bind_params(eqn))
    return list(out) if eqn.primitive.multiple_results else [out]


def evaluate(eqn: Any, values: Sequence[Any]) -> list[Any]:
    """Evaluate the equation now, on concrete values, with its outputs' exact avals."""
    with jax.ensure_compile_time_eval():
        outs = eqn.primitive.bind(*values, **compat.bind_params(eqn))
        outs = list(outs) if eqn.primitive.multiple_results else [outs]
        return [with_aval(out, var.aval) for out, var in zip(outs, eqn.outvars)]


def with_aval(value: Any, aval: Any) -> Any:
    """``value`` with the dtype and weak type the original program gave it."""
    got = compat.aval_of(value)
    if got.dtype == aval.dtype and got.weak_type == aval.weak_type:
        return value
    return compat.convert(value, aval.dtype, weak_type=aval.weak_type)


def is_static(eqn: Any) -> bool:
    """No symbolic size (a polymorphic export's batch) in the outputs or the parameters: such an
    equation cannot be computed now, whatever its inputs (``iota`` or ``broadcast_in_dim`` to a
    batch-sized shape, ``dim_as_value`` of the batch size)."""
    shapes = [getattr(var.aval, "shape", ()) for var in eqn.outvars]
    return not _symbolic_in([*shapes, *eqn.params.values()])


def _symbolic_in(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return any(_symbolic_in(v) for v in value)
    return jax.export.is_symbolic_dim(value)


def fold_or_bind(folder: Folder, eqn: Any, values: list) -> list[Any]:
    if all(is_known(v) for v in values) and folder.foldable(eqn) and is_static(eqn):
        outs = evaluate(eqn, values)
        folder.note_generator(eqn, values, outs)
        folder.note_view(eqn, values, outs)
        return outs
    return bind(eqn, [folder.stage(v) for v in values])


@register("jit", "pjit", "closed_call", "core_call", "checkpoint", "remat", "remat2")
def inline_call(folder: Folder, eqn: Any, values: list) -> list[Any]:
    """Calls carry no meaning for a frozen program: fold through their bodies, inlined."""
    body = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    jaxpr, consts = compat.open_and_consts(body)
    return folder.run(jaxpr, consts, values)


@register("cond")
def known_branch(folder: Folder, eqn: Any, values: list) -> list[Any]:
    """A branch index known at freeze time (a config flag, a variable) selects the branch now."""
    index, operands = values[0], values[1:]
    if not is_known(index):
        return fold_or_bind(folder, eqn, values)
    branches = eqn.params["branches"]
    chosen = branches[min(max(int(index), 0), len(branches) - 1)]  # clamped, as lax.switch does
    jaxpr, consts = compat.open_and_consts(chosen)
    return folder.run(jaxpr, consts, operands)


@register("custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr")
def custom_derivative_call(folder: Folder, eqn: Any, values: list) -> list[Any]:
    """A custom-derivative call reading a known value (a float8 policy's ``scaled_dot`` of an
    activation and a weight) runs its primal body inline, so the weight's part folds: the
    weight is stored already scaled and cast. Calls on unknown values alone stay as they are."""
    body = eqn.params.get("call_jaxpr", eqn.params.get("fun_jaxpr"))
    if body is None or not any(is_known(v) for v in values) or not folder.foldable(eqn):
        return fold_or_bind(folder, eqn, values)
    jaxpr, consts = compat.open_and_consts(body)
    with compat.equation_context(eqn):  # (the call's scopes: the layer its kernel belongs to)
        return folder.run(jaxpr, consts, values)


@register("convert_element_type")
def keep_narrow(folder: Folder, eqn: Any, values: list) -> list[Any]:
    """A known value stored in 8 bits or fewer (int8, uint8, float8; bool excepted) widened to a
    float is widened at run time: folding would store it in the wide dtype (a hand-written
    dequantization ``q.astype(bf16) * scale`` would come back as a bfloat16 weight)."""
    (value,) = values
    src, dst = eqn.invars[0].aval.dtype, eqn.outvars[0].aval.dtype
    narrow = src != np.bool_ and np.dtype(src).itemsize == 1 and _size(value) > 1
    if is_known(value) and narrow and jnp.issubdtype(dst, jnp.floating):
        return bind(eqn, [folder.stage(value)])
    return fold_or_bind(folder, eqn, values)


def fold_constants(closed: Any, known: Sequence[Any]) -> Any:
    """Fold ``closed`` with its leading inputs bound to ``known``; the rest stay inputs.

    Returns a closed jaxpr over the remaining inputs, whose constants are the folded values.

    Example::

        closed = jax.make_jaxpr(lambda w, x: x @ (w * 2))(w, x)
        folded = fold_constants(closed, [w])     # { lambda c; x. dot_general x c }
    """
    jaxpr, consts = compat.open_and_consts(closed)
    if len(known) > len(jaxpr.invars):
        raise ValueError(
            f"fold_constants: {len(known)} known values for a program with "
            f"{len(jaxpr.invars)} inputs"
        )
    unknown_avals = [v.aval for v in jaxpr.invars[len(known) :]]
    folder = Folder()

    def folded(*args: Any) -> list[Any]:
        outs = folder.run(jaxpr, consts, [*known, *args])
        return [folder.stage(out) for out in outs]

    return folder.restage_views(compat.trace_to_closed(folded, unknown_avals))
