"""BatchNorm folding: a conv or dense followed by per-feature affine ops becomes one conv/dense.

After constant folding, an inference-mode BatchNorm after a conv is a chain of elementwise ops
with constant operands: ``((conv(x, k) + b) - mean) * (rsqrt(var + eps) * scale) + beta`` (the
statistics parts are already folded), possibly wrapped in ``convert_element_type`` when the
BatchNorm runs in another dtype. Whatever the chain's spelling (Flax linen, NNX, a hand-written
functional BatchNorm), it is ``y * s + t`` for per-feature constants ``s`` and ``t``, so it folds to
``conv(x, k * s) + t``: one conv, one add. The fold is computed in float32 (float64 when the values
are) and cast back to the kernel's dtype, so a bfloat16 model stays bfloat16.

A chain only continues through values with a single use that are not program outputs: a conv
whose output has other uses stays unfolded (its other readers need the unscaled value).

Which ops extend a chain (``STEPS``) and which equations start one (``BASES``) are registries.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jamp import _compat as compat

from .fold_constants import bind, with_aval


@dataclasses.dataclass
class Base:
    """What a conv/dense allows: its constant kernel, the output axes a scale may vary along."""

    kernel_index: int
    feature_axes: tuple[int, ...]
    scale_kernel: Callable[[np.ndarray, np.ndarray], np.ndarray]  # (kernel, s) -> kernel * s


@dataclasses.dataclass
class Affine:
    """The chain so far, as ``y * scale + shift`` of the base output ``y`` (per feature)."""

    scale: np.ndarray
    shift: np.ndarray
    has_shift: bool = False


ConstOf = Callable[[Any], Any | None]
# name -> base(eqn, const_of) -> Base | None
BASES: dict[str, Callable[[Any, ConstOf], Base | None]] = {}
# name -> step(position of the chain value among the invars, constant or None) -> update | None
Update = Callable[[Affine], Affine]
STEPS: dict[str, Callable[[int, np.ndarray | None], Update | None]] = {}


def base(name: str) -> Callable:
    def wrap(rule: Callable) -> Callable:
        BASES[name] = rule
        return rule

    return wrap


def step(*names: str) -> Callable:
    def wrap(rule: Callable) -> Callable:
        for name in names:
            STEPS[name] = rule
        return rule

    return wrap


@base("conv_general_dilated")
def conv_base(eqn: Any, const_of: ConstOf) -> Base | None:
    lhs, rhs = eqn.invars
    if const_of(lhs) is not None or const_of(rhs) is None or eqn.params["batch_group_count"] != 1:
        return None
    dn = eqn.params["dimension_numbers"]
    out_axis, kernel_axis = dn.out_spec[1], dn.rhs_spec[0]

    def scale_kernel(kernel: np.ndarray, s: np.ndarray) -> np.ndarray:
        shape = [1] * kernel.ndim
        shape[kernel_axis] = kernel.shape[kernel_axis]  # output features, also when grouped
        return kernel * s.reshape(shape)

    return Base(1, (out_axis,), scale_kernel)


@base("dot_general")
def dot_base(eqn: Any, const_of: ConstOf) -> Base | None:
    known = tuple(const_of(v) is not None for v in eqn.invars)
    if known not in ((False, True), (True, False)):
        return None
    k = known.index(True)
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    contracting, batch = (lc, rc), (lb, rb)
    free = [
        [d for d in range(eqn.invars[i].aval.ndim) if d not in contracting[i] and d not in batch[i]]
        for i in (0, 1)
    ]
    # dot_general's output axes: batch dims, then lhs free dims, then rhs free dims.
    first = len(lb) + (len(free[0]) if k == 1 else 0)
    out_axes = tuple(range(first, first + len(free[k])))

    def scale_kernel(kernel: np.ndarray, s: np.ndarray) -> np.ndarray:
        shape = [1] * kernel.ndim
        for dim, axis in zip(free[k], out_axes):
            shape[dim] = s.shape[axis]
        return kernel * s.reshape(shape)

    return Base(k, out_axes, scale_kernel)


@step("add")
def add_step(position: int, c: np.ndarray | None) -> Update:
    return lambda a: Affine(a.scale, a.shift + c, True)


@step("sub")
def sub_step(position: int, c: np.ndarray | None) -> Update:
    if position == 0:  # y - c
        return lambda a: Affine(a.scale, a.shift - c, True)
    return lambda a: Affine(-a.scale, c - a.shift, True)  # c - y


@step("mul")
def mul_step(position: int, c: np.ndarray | None) -> Update:
    return lambda a: Affine(a.scale * c, a.shift * c, a.has_shift)


@step("div")
def div_step(position: int, c: np.ndarray | None) -> Update | None:
    if position != 0:  # c / y is not affine in y
        return None
    return lambda a: Affine(a.scale / c, a.shift / c, a.has_shift)


@step("neg")
def neg_step(position: int, c: np.ndarray | None) -> Update:
    return lambda a: Affine(-a.scale, -a.shift, a.has_shift)


@step("convert_element_type")
def convert_step(position: int, c: np.ndarray | None) -> Update:
    return lambda a: a  # the dtype is tracked by the chain; the value is unchanged


@dataclasses.dataclass
class Fold:
    """A planned rewrite: the base equation with a new kernel, then a convert and a bias add."""

    kernel_index: int
    kernel: Any
    bias: Any  # None when the chain adds nothing
    end: Any  # the chain's last variable, defined by the rewrite
    last: Any  # the chain's last equation (its source info goes on the bias add)
    skipped: list[Any]  # the chain's equations


def _is_float(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


class _Planner:
    def __init__(self, jaxpr: Any, consts: Sequence[Any]) -> None:
        self.consts = {v: c for v, c in zip(jaxpr.constvars, consts)}
        self.uses: dict[Any, int] = {}
        self.consumer: dict[Any, Any] = {}
        for eqn in jaxpr.eqns:
            for var in eqn.invars:
                if not isinstance(var, compat.Literal):
                    self.uses[var] = self.uses.get(var, 0) + 1
                    self.consumer[var] = eqn
        self.outputs = {v for v in jaxpr.outvars if not isinstance(v, compat.Literal)}

    def const_of(self, var: Any) -> Any | None:
        if isinstance(var, compat.Literal):
            return var.val
        return self.consts.get(var)

    def plan(self, eqn: Any) -> Fold | None:
        rule = BASES.get(eqn.primitive.name)
        info = rule(eqn, self.const_of) if rule else None
        if info is None:
            return None
        var = eqn.outvars[0]
        if not _is_float(var.aval.dtype):
            return None
        shape = tuple(
            n if axis in info.feature_axes else 1 for axis, n in enumerate(var.aval.shape)
        )
        chain: list[tuple[Any, int, Any | None]] = []
        while self.uses.get(var, 0) == 1 and var not in self.outputs:
            link = self._link(self.consumer[var], var, info.feature_axes)
            if link is None:
                break
            chain.append(link)
            var = link[0].outvars[0]
        affine_steps = [c for c in chain if c[0].primitive.name != "convert_element_type"]
        has_shift = any(c[0].primitive.name in ("add", "sub") for c in chain)
        base_dtype, end_dtype = eqn.outvars[0].aval.dtype, var.aval.dtype
        rewritten = int(base_dtype != end_dtype) + int(has_shift)
        if not affine_steps or rewritten >= len(chain):
            return None
        return self._fold(eqn, info, chain, shape, var)

    def _link(self, consumer: Any, var: Any, feature_axes: tuple[int, ...]) -> tuple | None:
        """(equation, position of ``var``, constant operand) if ``consumer`` extends the chain."""
        name = consumer.primitive.name
        out = consumer.outvars
        if (
            name not in STEPS
            or len(out) != 1
            or out[0].aval.shape != var.aval.shape
            or not _is_float(out[0].aval.dtype)
        ):
            return None
        position = next(i for i, v in enumerate(consumer.invars) if v is var)
        others = [v for i, v in enumerate(consumer.invars) if i != position]
        if not others:
            return (consumer, position, None)
        if len(others) != 1:
            return None
        c = self.const_of(others[0])
        if c is None or not _is_float(others[0].aval.dtype):
            return None
        c_shape = np.shape(c)
        if c_shape and (
            len(c_shape) != var.aval.ndim
            or any(n != 1 and axis not in feature_axes for axis, n in enumerate(c_shape))
        ):
            return None  # varies along a non-feature axis: not a per-feature affine op
        return (consumer, position, c)

    def _fold(self, eqn: Any, info: Base, chain: list, shape: tuple, end: Any) -> Fold | None:
        kernel_var = eqn.invars[info.kernel_index]
        kernel = self.const_of(kernel_var)
        if not _is_float(kernel_var.aval.dtype):
            return None  # e.g. an int8 kernel: a per-feature scale cannot be stored in it
        dtypes = [kernel_var.aval.dtype, end.aval.dtype] + [
            v.aval.dtype for e, _, _ in chain for v in e.invars
        ]
        acc = np.float64 if any(np.dtype(d) == np.float64 for d in dtypes) else np.float32
        affine = Affine(np.ones(shape, acc), np.zeros(shape, acc))
        for consumer, position, c in chain:
            c = None if c is None else np.broadcast_to(np.asarray(c).astype(acc), shape)
            update = STEPS[consumer.primitive.name](position, c)
            if update is None:
                return None
            affine = update(affine)
        new_kernel = info.scale_kernel(np.asarray(kernel).astype(acc), affine.scale)
        new_kernel = with_aval(
            jnp.asarray(new_kernel.astype(kernel_var.aval.dtype)), kernel_var.aval
        )
        bias = jnp.asarray(affine.shift.astype(end.aval.dtype)) if affine.has_shift else None
        return Fold(
            info.kernel_index, new_kernel, bias, end, chain[-1][0], [e for e, _, _ in chain]
        )


def fold_batchnorm(closed: Any) -> Any:
    """Fold per-feature affine chains (inference BatchNorms) into the conv/dense before them.

    Expects constants already folded (see ``fold_constants``); returns a closed jaxpr over the
    same inputs. Only the top level of the program is rewritten.

    Example::

        folded = fold_batchnorm(fold_constants(closed, variables))
        # conv_general_dilated with a scaled kernel, then one add; no rsqrt, sub or mul
    """
    jaxpr, consts = compat.open_and_consts(closed)
    planner = _Planner(jaxpr, consts)
    folds = {}
    for eqn in jaxpr.eqns:
        fold = planner.plan(eqn)
        if fold is not None:
            folds[id(eqn)] = fold
    if not folds:
        return closed
    skipped = {id(e) for fold in folds.values() for e in fold.skipped}

    def run(*args: Any) -> list[Any]:
        env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, args))

        def read(var: Any) -> Any:
            return var.val if isinstance(var, compat.Literal) else env[var]

        for eqn in jaxpr.eqns:
            if id(eqn) in skipped:
                continue
            values = [read(v) for v in eqn.invars]
            fold = folds.get(id(eqn))
            if fold is None:
                for var, out in zip(eqn.outvars, bind(eqn, values)):
                    if not isinstance(var, compat.DropVar):
                        env[var] = out
                continue
            values[fold.kernel_index] = fold.kernel
            out = bind(eqn, values)[0]
            with compat.equation_context(fold.last):
                if compat.aval_of(out).dtype != fold.end.aval.dtype:
                    out = compat.convert(out, fold.end.aval.dtype)
                if fold.bias is not None:
                    out = jax.lax.add(out, fold.bias)
                env[fold.end] = with_aval(out, fold.end.aval)
        return [read(v) for v in jaxpr.outvars]

    return compat.trace_to_closed(run, [v.aval for v in jaxpr.invars])
