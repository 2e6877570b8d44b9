"""Loss scaling for float16 training: static and dynamic scales, finiteness checks.

The names follow DeepMind's jmp so code can switch, without its known bugs: every field
(``min_loss_scale`` included) is a pytree leaf, so a scale survives ``jax.jit`` and
``jax.tree.map``; ``unscale`` casts gradients to float32 before dividing; the scale itself is
float32 whatever the compute dtype; and :func:`scaled_value_and_grad` unscales with the scale the
loss was multiplied by, not the adjusted one (rounded to the loss's dtype, as the loss was).
Growth is capped at ``max_loss_scale`` (the float32 maximum by default, as flax's
``DynamicScale``), and every field is validated at construction with an error naming it
(``DynamicLossScale(factor=0.5)`` raises ``ValueError``), so a scale cannot stall training by
reaching inf, 0 or NaN. The scales are pytrees (orbax checkpoints them) and are registered
with ``flax.serialization`` when the first is made, constructed, unpickled or rebuilt from a
treedef (``to_bytes``, ``from_bytes``, a ``TrainState`` that holds one).

Example::

    loss_scale = jamp.DynamicLossScale()
    step_fn = jamp.scaled_value_and_grad(loss_fn)
    loss, grads, loss_scale, finite = step_fn(loss_scale, params, batch)
    # skip the update on overflow with optax: optax.apply_if_finite(tx, max_consecutive_errors=...)
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable, Hashable, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from . import _compat as compat

F32 = jnp.float32
AxisName = Hashable  # a pmap/shard_map axis name, or a tuple of them
F32_MAX = float(np.finfo(np.float32).max)
F32_TINY = float(np.finfo(np.float32).tiny)


def _coerce(value: Any, dtype: Any) -> Any:
    """Numbers and arrays become ``dtype`` arrays; other leaves (tracers of another dtype stay
    arrays; placeholders such as ``jax.ShapeDtypeStruct`` are left alone)."""
    if isinstance(value, (bool, int, float, np.ndarray, np.generic, jax.Array)):
        return jnp.asarray(value, dtype)
    return value


def _concrete(cls: str, field: str, value: Any) -> np.ndarray | None:
    """The value as a numpy scalar for validation, or None when it is not known here (a tracer
    inside ``jit``, a ``jax.ShapeDtypeStruct``): validation then skips it."""
    if compat.is_tracer(value) or isinstance(value, jax.ShapeDtypeStruct):
        return None
    if not isinstance(value, (bool, int, float, np.ndarray, np.generic, jax.Array)):
        raise TypeError(
            f"{cls}.{field} must be a real number, got {type(value).__name__} {value!r}"
        )
    array = np.asarray(value)
    if array.shape != ():
        raise ValueError(f"{cls}.{field} must be a scalar, got shape {array.shape}")
    if array.dtype == np.bool_ or not (
        np.issubdtype(array.dtype, np.integer) or np.issubdtype(array.dtype, np.floating)
    ):
        raise TypeError(f"{cls}.{field} must be a real number, got {value!r}")
    return array


def _check_scale(cls: str, field: str, value: Any) -> float | None:
    """A loss scale: finite, > 0 and representable in float32 (the scale's dtype), from its
    smallest normal value up (unscaling divides by the scale: 1 / 1e-40 is inf in float32)."""
    if type(value) is int and value.bit_length() > 62:
        # numpy would hold a Python int past int64 as an object ("not a number"): a float here
        sign = "-" if value < 0 else ""
        shown = (
            f"{value:.4g}" if value.bit_length() < 1000 else f"{sign}~2**{value.bit_length() - 1}"
        )
        if value < 0:
            raise ValueError(f"{cls}.{field} must be > 0, got {shown}")
        if value > F32_MAX:
            raise ValueError(
                f"{cls}.{field}={shown} overflows float32 (max {F32_MAX:.4g}), the "
                "dtype loss scales are kept in"
            )
        value = float(value)
    array = _concrete(cls, field, value)
    if array is None:
        return None
    number = float(array)
    if not np.isfinite(number):
        why = (
            f" ({array.dtype.name} cannot hold the value you meant: pass a Python float or float32)"
            if np.isinf(number) and array.dtype.itemsize < 4
            else ""
        )
        raise ValueError(f"{cls}.{field} must be finite, got {number}{why}")
    if number <= 0:
        raise ValueError(f"{cls}.{field} must be > 0, got {number}")
    if number > F32_MAX:
        raise ValueError(
            f"{cls}.{field}={number} overflows float32 (max {F32_MAX:.4g}), the "
            "dtype loss scales are kept in"
        )
    if number < F32_TINY:
        raise ValueError(
            f"{cls}.{field}={number:g} is under float32's smallest normal value "
            f"({F32_TINY:.4g}), the dtype loss scales are kept in: float32 rounds it"
            f"{' to 0' if np.float32(number) == 0 else ''}, and unscaling divides by it, so every "
            f"gradient would be inf or NaN. Use a scale >= {F32_TINY:.4g} (usually >= 1)"
        )
    return number


def _check_count(cls: str, field: str, value: Any, minimum: int) -> int | None:
    array = _concrete(cls, field, value)
    if array is None:
        return None
    if not np.issubdtype(array.dtype, np.integer):
        raise TypeError(f"{cls}.{field} must be an int, got {value!r}")
    if int(array) < minimum:
        raise ValueError(f"{cls}.{field} must be >= {minimum}, got {int(array)}")
    return int(array)


# Floating and complex leaves are scaled and unscaled (complex parameters have complex
# gradients, which the scale multiplies as much as real ones), as jmp does every inexact leaf.


def _scale_leaf(x: Any, scale: jax.Array) -> Any:
    if not jnp.issubdtype(jnp.result_type(x), jnp.inexact):
        return x
    x = jnp.asarray(x)  # Python and numpy scalars too: the product, as jmp returns
    return x * scale.astype(x.dtype)


def _unscale_leaf(x: Any, scale: jax.Array) -> Any:
    dtype = jnp.result_type(x)
    if not jnp.issubdtype(dtype, jnp.inexact):
        return x
    wide = jnp.promote_types(dtype, F32)  # float32 or complex64 at least; 64-bit ones stay
    return jnp.asarray(x).astype(wide) / scale.astype(jnp.finfo(wide).dtype)


def _register(cls: type) -> type:
    """Register a loss-scale dataclass as a pytree whose leaves are all its fields.

    Unflattening bypasses ``__init__``: JAX rebuilds scales from tracers and placeholders
    (``jit``, ``tree.map``) that the constructor's validation must not see."""
    fields = [f.name for f in dataclasses.fields(cls)]

    def unflatten(_: Any, leaves: Any) -> Any:
        return _unchecked(cls, **dict(zip(fields, leaves)))

    jax.tree_util.register_pytree_with_keys(
        cls,
        lambda s: ([(jax.tree_util.GetAttrKey(f), getattr(s, f)) for f in fields], None),
        unflatten,
        lambda s: ([getattr(s, f) for f in fields], None),
    )
    return cls


def _unchecked(cls: type, **values: Any) -> Any:
    """An instance with these field values, without validation (values jamp computed itself).

    Registers the scales with flax here too: a scale rebuilt by unflattening (a loaded export's
    outputs, a state restored into a target made from a treedef) may be the first the process
    has (a dict lookup once done)."""
    _register_with_flax()
    obj: Any = object.__new__(cls)
    for name, value in values.items():
        object.__setattr__(obj, name, value)
    return obj


class _LossScale:
    loss_scale: jax.Array

    def __post_init__(self) -> None:
        _register_with_flax()

    def __reduce__(self) -> tuple[Any, ...]:
        # Unpickled (multiprocessing, cloudpickle), a scale is made without its constructor:
        # through _unchecked, which registers it with flax (and does not validate what was).
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(cast(Any, self))}
        return _unpickle, (type(self), values)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Pickles written before ``__reduce__`` (the default protocol's field dict)."""
        _register_with_flax()
        self.__dict__.update(state)

    def scale(self, tree: Any) -> Any:
        """Multiply every floating or complex leaf (usually the loss) by the loss scale.

        Python and numpy floats are multiplied too (``StaticLossScale(8.0).scale(3.0)`` is a
        float32 ``24.0``); integer leaves are returned unchanged. A 16-bit leaf is multiplied by
        the scale rounded to its dtype (3000 is 3008 in bfloat16)."""
        _check_array_leaves(tree, f"{type(self).__name__}.scale")
        self._check_fits(tree)
        return jax.tree.map(lambda x: _scale_leaf(x, self.loss_scale), tree)

    def _check_fits(self, tree: Any) -> None:
        """Refuse a scale the leaves' dtypes cannot hold, where that is an error (a static one)."""

    def unscale(self, tree: Any) -> Any:
        """Divide every floating or complex leaf by the loss scale, in float32 (complex64 for
        complex leaves; float64 and complex128 stay).

        This divides by the float32 scale. Gradients of a 16-bit loss were multiplied by the
        scale rounded to the loss's dtype, which differs when the scale has more significant
        bits than the dtype (powers of two never do): :func:`jamp.scaled_value_and_grad`
        divides by the rounded value."""
        _check_array_leaves(tree, f"{type(self).__name__}.unscale")
        return jax.tree.map(lambda x: _unscale_leaf(x, self.loss_scale), tree)

    def adjust(self, grads_finite: jax.Array) -> _LossScale:
        """The loss scale for the next step (unchanged for static scales)."""
        _check_grads_finite(grads_finite)
        return self


def _unpickle(cls: type, values: dict[str, Any]) -> Any:
    return _unchecked(cls, **values)


def _check_grads_finite(grads_finite: Any) -> jax.Array:
    if not _is_array_leaf(grads_finite):
        raise TypeError(
            "adjust(grads_finite) expects a scalar bool such as jamp.all_finite(grads), got "
            f"{type(grads_finite).__name__}: pass jamp.all_finite(grads), not the gradients"
        )
    aval = compat.aval_of(jnp.asarray(grads_finite))
    if aval.shape != () or aval.dtype != jnp.bool_:
        raise ValueError(
            "adjust(grads_finite) expects a scalar bool such as "
            f"jamp.all_finite(grads), got {aval.str_short()}"
        )
    return jnp.asarray(grads_finite)


@_register
@dataclasses.dataclass(frozen=True)
class NoOpLossScale(_LossScale):
    """A loss scale of 1 that never changes (for bfloat16/float32 training)."""

    @property
    def loss_scale(self) -> jax.Array:  # type: ignore[override]
        return jnp.ones((), F32)

    def scale(self, tree: Any) -> Any:
        return tree


@_register
@dataclasses.dataclass(frozen=True)
class StaticLossScale(_LossScale):
    """A fixed loss scale: ``jamp.StaticLossScale(2.0 ** 12)``.

    ``loss_scale`` must be finite, > 0 and fit float32, from its smallest normal value
    (``1.1755e-38``) to its largest (``ValueError`` naming the field);
    ``scale`` of a leaf whose dtype cannot hold it (a float16 loss at ``2.0 ** 16``, or at a
    scale so small that float16 rounds it to 0) raises ``ValueError`` too, since it never
    backs off."""

    loss_scale: Any

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_scale("StaticLossScale", "loss_scale", self.loss_scale)
        object.__setattr__(self, "loss_scale", _coerce(self.loss_scale, F32))

    def _check_fits(self, tree: Any) -> None:
        """A leaf whose dtype cannot hold the scale raises ``ValueError``: past its largest value
        (a float16 loss and a scale of 2**16) the loss and every gradient would be inf at every
        step, where a dynamic scale backs off; under its smallest (float16 rounds 2**-26 to 0)
        they would all be 0. Checked where the scale is known, not under ``jax.jit`` with the
        scale an argument."""
        number = _concrete("StaticLossScale", "loss_scale", self.loss_scale)
        if number is None:
            return
        scale = float(number)
        for x in jax.tree.leaves(tree):
            dtype = jnp.result_type(x)
            if not jnp.issubdtype(dtype, jnp.inexact):
                continue
            info = jnp.finfo(dtype)
            if scale > float(info.max):
                raise ValueError(
                    f"StaticLossScale({scale:g}).scale: the scale is past {dtype}'s largest "
                    f"value ({float(info.max):g}), so a {dtype} loss scaled by "
                    "it is inf, and so is every gradient: every step would be skipped. "
                    "Compute the loss in float32 (autocast_transform and a region return "
                    f"a float32 mean or sum), or use a scale under {info.max:g}"
                )
            if np.float32(scale).astype(info.dtype) == 0:  # (numpy: no JAX op while tracing)
                raise ValueError(
                    f"StaticLossScale({scale:g}).scale: {dtype} rounds the scale to 0 (its "
                    f"smallest value is {float(info.smallest_subnormal):g}), so a {dtype} loss "
                    "scaled by it is 0, and so is every gradient. Compute the loss in float32, "
                    "or use a larger scale"
                )


@_register
@dataclasses.dataclass(frozen=True)
class DynamicLossScale(_LossScale):
    """A loss scale that grows after ``period`` finite steps and backs off on overflow.

    ``adjust(grads_finite)``: after ``period`` consecutive finite steps the scale is multiplied by
    ``factor``, never above ``max_loss_scale`` (default: the float32 maximum, as flax's
    ``DynamicScale``, so it cannot become inf); on a non-finite step it is divided by ``factor``,
    never below ``min_loss_scale``, and the counter restarts.

    Every field is checked at construction, with a ``ValueError``/``TypeError`` naming it:
    ``loss_scale`` finite, > 0 and within float32's normal range (``jnp.float16(2**16)`` is
    already inf; under ``1.1755e-38`` unscaling overflows);
    ``counter`` an int in ``[0, period)``; ``period`` an int >= 1; ``factor`` finite and > 1;
    ``min_loss_scale`` finite, > 0 and <= ``loss_scale`` (``None``: no minimum beyond the
    smallest normal float32, as flax's ``minimum_scale=None``; the scale never reaches 0);
    ``max_loss_scale`` finite and >= ``loss_scale``. Values under ``jax.jit`` (tracers) are not
    checked.

    ``skips_at_min`` counts the consecutive steps that overflowed while the scale already sat
    at ``min_loss_scale``: there it cannot back off any further, so the overflow is not the
    loss scale's doing (a parameter or an activation out of the compute dtype's range,
    ``jamp.find_nonfinite`` names it) and every step is skipped until it is fixed. It shows in
    the repr and resets on a finite step; a loop checks it where it logs::

        if int(scale.skips_at_min) > 0:   # the last step(s) skipped at the minimum scale
            raise FloatingPointError(f"overflow at the minimum loss scale: {scale}")

    A float16 loss cannot be scaled by less than float16 holds: with ``min_loss_scale=None``
    a long run of overflows takes the scale to ``2.0 ** -25`` or less, which float16 rounds to 0.
    :func:`jamp.scaled_value_and_grad` then reports the step not finite (its gradients are
    NaN, not 0), so it is skipped and the scale backs off on to its minimum, where
    ``skips_at_min`` counts: the overflow was never the scale's doing.

    Example::

        scale = jamp.DynamicLossScale(loss_scale=2.0 ** 15, period=2000, factor=2)
        grads = {"w": jnp.array([1.0, jnp.inf])}       # an overflow: the scale backs off
        scale = scale.adjust(jamp.all_finite(grads))   # loss_scale 2.0 ** 14, counter 0
    """

    loss_scale: Any = 2.0**15
    counter: Any = 0
    period: Any = 2000
    factor: Any = 2
    min_loss_scale: Any = 1.0
    max_loss_scale: Any = F32_MAX
    skips_at_min: Any = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        name = "DynamicLossScale"
        if self.min_loss_scale is None:  # flax's "no minimum"
            object.__setattr__(self, "min_loss_scale", F32_TINY)
        scale = _check_scale(name, "loss_scale", self.loss_scale)
        period = _check_count(name, "period", self.period, 1)
        counter = _check_count(name, "counter", self.counter, 0)
        _check_count(name, "skips_at_min", self.skips_at_min, 0)
        if counter is not None and period is not None and counter >= period:
            raise ValueError(
                f"{name}.counter must be < period ({period}), got {counter}: the "
                "scale grows when the counter reaches period - 1"
            )
        factor = _concrete(name, "factor", self.factor)
        if factor is not None and not (np.isfinite(float(factor)) and float(factor) > 1):
            raise ValueError(
                f"{name}.factor must be finite and > 1, got {float(factor)}: the scale is "
                "multiplied by factor after `period` finite steps and divided by it on overflow "
                "(flax's backoff_factor=0.5 is factor=2 here)"
            )
        low = _check_scale(name, "min_loss_scale", self.min_loss_scale)
        high = _check_scale(name, "max_loss_scale", self.max_loss_scale)
        if scale is not None and low is not None and low > scale:
            raise ValueError(f"{name}.min_loss_scale={low} must be <= loss_scale={scale}")
        if scale is not None and high is not None and high < scale:
            raise ValueError(f"{name}.max_loss_scale={high} must be >= loss_scale={scale}")
        for field, dtype in (
            ("loss_scale", F32),
            ("counter", jnp.int32),
            ("period", jnp.int32),
            ("factor", F32),
            ("min_loss_scale", F32),
            ("max_loss_scale", F32),
            ("skips_at_min", jnp.int32),
        ):
            object.__setattr__(self, field, _coerce(getattr(self, field), dtype))

    def adjust(self, grads_finite: jax.Array) -> DynamicLossScale:
        grads_finite = _check_grads_finite(grads_finite)
        grow = self.counter == self.period - 1
        grown = jnp.where(
            grow, jnp.minimum(self.loss_scale * self.factor, self.max_loss_scale), self.loss_scale
        )
        backed_off = jnp.maximum(self.min_loss_scale, self.loss_scale / self.factor)
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        at_min = self.loss_scale <= self.min_loss_scale
        values.update(
            loss_scale=jnp.where(grads_finite, grown, backed_off),
            counter=jnp.where(grads_finite, jnp.where(grow, 0, self.counter + 1), 0),
            skips_at_min=jnp.where(
                grads_finite, 0, jnp.where(at_min, self.skips_at_min + 1, 0)
            ).astype(jnp.int32),
        )
        return _unchecked(DynamicLossScale, **values)


@_register
@dataclasses.dataclass(frozen=True)
class MicroBatchLossScale(_LossScale):
    """A loss scale for gradient accumulation: one skip decision and one scale update per
    optimizer step, over ``every_k`` micro-batches, as torch's ``GradScaler`` makes them.

    Every micro-batch of a step is scaled with the same scale; ``adjust(finite)``, called once per
    micro-batch (as ``jamp.scaled_value_and_grad`` does), remembers whether all of the step's
    micro-batches were finite and adjusts the wrapped scale once, at the ``every_k``-th call,
    with that verdict: one overflowing micro-batch backs a dynamic scale off once, not once per
    micro-batch. Skipping goes with it: the sum (or mean) of the step's gradients holds the
    overflowing micro-batch's inf or NaN, so the optimizer step is skipped as a whole by
    ``jamp.all_finite(accumulated)`` in a hand-written loop, or by
    :func:`jamp.accumulate_micro_batches` (not ``optax.MultiSteps``, which keeps an inf in its
    accumulator for good). ``every_k`` must be the accumulation's.

    Fields (all pytree leaves, so it passes through ``jax.jit``): ``inner`` the wrapped scale
    (``DynamicLossScale``, ``StaticLossScale`` or ``NoOpLossScale``), ``every_k`` micro-batches per
    step (int >= 1), ``mini_step`` the micro-batches of the current step seen so far (in
    ``[0, every_k)``), ``finite`` whether all of them were finite.

    Example::

        scale = jamp.MicroBatchLossScale(jamp.DynamicLossScale(2.0 ** 15), every_k=4)
        for finite in [True, False, True, True]:       # one step; micro-batch 2 overflows
            scale = scale.adjust(jnp.asarray(finite))
        float(scale.loss_scale)                        # 2.0 ** 14: backed off once
    """

    inner: Any
    every_k: Any = 1
    mini_step: Any = 0
    finite: Any = True

    def __post_init__(self) -> None:
        super().__post_init__()
        name = "MicroBatchLossScale"
        if not isinstance(self.inner, _LossScale) or isinstance(self.inner, MicroBatchLossScale):
            raise TypeError(
                f"{name}.inner must be a jamp.DynamicLossScale, StaticLossScale or "
                f"NoOpLossScale, got {_describe(self.inner)}"
            )
        every_k = _check_count(name, "every_k", self.every_k, 1)
        mini_step = _check_count(name, "mini_step", self.mini_step, 0)
        if every_k is not None and mini_step is not None and mini_step >= every_k:
            raise ValueError(f"{name}.mini_step must be < every_k ({every_k}), got {mini_step}")
        if not compat.is_tracer(self.finite) and not isinstance(self.finite, jax.ShapeDtypeStruct):
            if np.asarray(self.finite).dtype != np.bool_ or np.shape(self.finite) != ():
                raise TypeError(f"{name}.finite must be a scalar bool, got {self.finite!r}")
        for field, dtype in (("every_k", jnp.int32), ("mini_step", jnp.int32), ("finite", bool)):
            object.__setattr__(self, field, _coerce(getattr(self, field), dtype))

    @property
    def loss_scale(self) -> jax.Array:  # type: ignore[override]
        return self.inner.loss_scale

    def _check_fits(self, tree: Any) -> None:
        self.inner._check_fits(tree)  # a wrapped static scale refuses what it refuses alone

    def adjust(self, grads_finite: jax.Array) -> MicroBatchLossScale:
        """Record one micro-batch; at the ``every_k``-th, adjust the wrapped scale once."""
        grads_finite = _check_grads_finite(grads_finite)
        finite = jnp.logical_and(self.finite, grads_finite)
        mini_step = self.mini_step + 1
        last = mini_step >= self.every_k
        inner = select_tree(last, self.inner.adjust(finite), self.inner)
        return _unchecked(
            MicroBatchLossScale,
            inner=inner,
            every_k=self.every_k,
            mini_step=jnp.where(last, 0, mini_step).astype(jnp.int32),
            finite=jnp.logical_or(last, finite),
        )


LossScale = NoOpLossScale | StaticLossScale | DynamicLossScale | MicroBatchLossScale


# --- flax.serialization: state dicts for to_bytes/from_bytes and TrainState checkpoints -------


def _to_state_dict(scale: Any) -> dict[str, Any]:  # (Any: a loss-scale dataclass)
    from flax import serialization

    return {
        f.name: serialization.to_state_dict(getattr(scale, f.name))
        for f in dataclasses.fields(scale)
    }


def _from_state_dict(target: Any, state: dict[str, Any]) -> Any:
    from flax import serialization

    names = [f.name for f in dataclasses.fields(target)]
    missing = [n for n in names if n not in state]
    unknown = [k for k in state if k not in names]
    if missing or unknown:
        name = type(target).__name__
        raise ValueError(
            f"restoring a {name} at '{serialization.current_path()}': the state dict's keys "
            f"are {list(state)}, a {name}'s fields are {names} (missing: {missing}, "
            f"unknown: {unknown})"
        )
    values = {n: serialization.from_state_dict(getattr(target, n), state[n], n) for n in names}
    return dataclasses.replace(target, **values)  # (validated, naming a bad field)


@functools.cache
def _register_with_flax() -> None:
    """Called as a scale is made (constructed, unflattened or unpickled: every scale flax could
    meet was): ``import jamp`` does not import flax (~0.2 s), and flax finds a type's handlers
    only in its registry."""
    from flax import serialization

    for cls in (NoOpLossScale, StaticLossScale, DynamicLossScale, MicroBatchLossScale):
        serialization.register_serialization_state(cls, _to_state_dict, _from_state_dict)


def all_finite(tree: Any, *, axis_name: AxisName | None = None) -> jax.Array:
    """A scalar bool: every floating leaf of ``tree`` is free of inf and NaN.

    Leaves must be arrays or numbers (integer ones are skipped); a string or another object
    raises ``TypeError`` naming its pytree path. With ``axis_name`` (inside ``jax.pmap`` or
    ``jax.shard_map``: an axis name or a tuple of them), on every device of those axes at once:
    one device's inf makes it False everywhere."""
    _check_array_leaves(tree, "all_finite")
    leaves = [
        jnp.all(jnp.isfinite(x))
        for x in jax.tree.leaves(tree)
        if jnp.issubdtype(jnp.result_type(x), jnp.inexact)
    ]
    finite = jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)
    if axis_name is not None:
        # (pmin of 0/1: collectives take no bools)
        finite = jax.lax.pmin(finite.astype(jnp.int32), axis_name) > 0
    return finite


def select_tree(pred: Any, a: Any, b: Any) -> Any:
    """``a`` where the scalar ``pred`` is true, else ``b``, leaf by leaf (same structures)."""
    if jax.tree.structure(a) != jax.tree.structure(b):  # type: ignore[operator]  # no jaxlib stub
        raise ValueError(
            "select_tree needs trees of one structure, got "
            f"{jax.tree.structure(a)} and {jax.tree.structure(b)}"
        )
    pred = jnp.asarray(pred)
    if pred.shape != () or pred.dtype != jnp.bool_:
        raise ValueError(
            f"select_tree's pred must be a scalar bool, got {pred.dtype}{list(pred.shape)}"
        )
    _check_array_leaves(a, "select_tree", "a", "parameters or optimizer states")
    _check_array_leaves(b, "select_tree", "b", "parameters or optimizer states")
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
        if jnp.shape(x) != jnp.shape(y) or jnp.result_type(x) != jnp.result_type(y):
            where = jax.tree_util.keystr(path)
            raise TypeError(
                f"select_tree: a{where} is {_describe_leaf(x)} but b{where} is "
                f"{_describe_leaf(y)}; the two trees must agree in shape and dtype leaf by leaf"
            )
    return jax.tree.map(lambda x, y: jax.lax.select(pred, x, y), a, b)


_ARRAY_LEAVES = (jax.Array, np.ndarray, np.generic, bool, int, float, complex)


def _is_array_leaf(x: Any) -> bool:
    """An array (a tracer too) or a Python number: what the loss-scale helpers compute on."""
    return isinstance(x, _ARRAY_LEAVES) or hasattr(x, "__jax_array__")


def _check_array_leaves(
    tree: Any, where: str, root: str = "tree", such_as: str = "a loss or gradients"
) -> None:
    """TypeError naming the pytree path of the first leaf that is not an array or a number
    (JAX's own error would only say "data type 'a string' not understood")."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not _is_array_leaf(leaf):
            kind = type(leaf).__name__
            raise TypeError(
                f"{where}: {root}{jax.tree_util.keystr(path)} is "
                f"{'an' if kind[0] in 'aeiou' else 'a'} {kind} ({_short(leaf)}), not an array "
                f"or a number; {where} takes pytrees of arrays, such as {such_as}"
            )


def _short(x: Any, limit: int = 40) -> str:
    text = repr(x)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _describe_leaf(x: Any) -> str:
    return f"{jnp.result_type(x)}{list(jnp.shape(x))}"


def scaled_value_and_grad(
    fn: Callable,
    *,
    argnums: int | Any | Sequence[int | Any] = 0,
    has_aux: bool = False,
    axis_name: AxisName | None = None,
) -> Callable:
    """``jax.value_and_grad`` with loss scaling, in one call.

    Returns ``step(loss_scale, *args, **kwargs) -> (value, grads, new_loss_scale, grads_finite)``:
    the loss is multiplied by the current scale, gradients are unscaled with that same scale
    (then checked for inf/NaN), and only then is the scale adjusted. ``value`` is the unscaled
    loss (``(loss, aux)`` with ``has_aux``); ``grads`` are float32 (complex64 for complex
    parameters). ``argnums`` counts ``fn``'s arguments, as ``jax.value_and_grad`` does (the loss
    scale is not one of them).

    A 16-bit loss is multiplied by the scale rounded to the loss's dtype (3000 is 3008 in
    bfloat16), and the gradients are divided by that rounded value, so they come back unbiased.
    A scale that float16 rounds to 0 (``2.0 ** -25`` or less, which a ``DynamicLossScale`` with
    ``min_loss_scale=None`` reaches after a long run of overflows) cannot scale a float16 loss:
    the gradients come back NaN and ``grads_finite`` False, so the step is skipped rather than
    applied with gradients of 0.

    Inside ``jax.pmap`` or ``jax.shard_map(..., check_vma=False)``, where each device's
    gradients come back before you sum them across devices, pass the ``axis_name`` you sum over:
    the finite check is then made across it (``all_finite(grads, axis_name=...)``), so one
    device's overflow skips the step on every device and the loss scale stays replicated.
    (``jax.shard_map`` with ``check_vma=True`` and ``jax.jit`` sum the gradients of replicated
    parameters inside the backward pass already.)

    Flax NNX: ``argnums=nnx.DiffState(0, nnx.Param)`` differentiates the parameters of the
    module in argument 0 only, through ``nnx.value_and_grad``, which writes the state the call
    changed (BatchNorm statistics, Dropout's RNG counts) back into the module; ``grads`` is then
    an ``nnx.State`` for ``nnx.Optimizer.update``.

    Mistakes are reported in these terms: a first argument that is not a loss scale (a float, or
    the arguments swapped), ``argnums`` out of range for the call, a differentiated argument with
    integer or PRNG-key leaves (such as a whole NNX module with its RNG state: the error names
    the leaf and the ``DiffState`` to pass), ``fn`` returning a tuple without ``has_aux=True``
    or a non-scalar loss.

    Example::

        def loss_fn(params, x):
            return jnp.mean((x @ params["w"]) ** 2)

        params, x = {"w": jnp.full((4, 2), 0.1)}, jnp.ones((8, 4))
        tx = optax.sgd(0.1)
        opt_state, loss_scale = tx.init(params), jamp.DynamicLossScale()
        step = jamp.scaled_value_and_grad(jamp.autocast_transform(loss_fn, dtype=jnp.float16))
        loss, grads, loss_scale, finite = step(loss_scale, params, x)
        updates, new_opt_state = tx.update(grads, opt_state, params)
        # skip the update on overflow (the loss scale has already backed off)
        params, opt_state = jamp.select_tree(
            finite, (optax.apply_updates(params, updates), new_opt_state), (params, opt_state)
        )
    """
    if not callable(fn):
        raise TypeError(f"scaled_value_and_grad expects a callable, got {type(fn).__name__}")
    if not isinstance(has_aux, bool):
        raise TypeError(f"scaled_value_and_grad(has_aux=...) must be a bool, got {has_aux!r}")
    requested = _argnums_tuple(argnums)
    name = getattr(fn, "__name__", type(fn).__name__)

    def scaled(loss_scale: LossScale, *args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        if has_aux:
            if not (isinstance(out, (tuple, list)) and len(out) == 2):
                raise TypeError(
                    f"scaled_value_and_grad(has_aux=True): {name} must return a "
                    f"(loss, aux) pair, got {_describe(out)}"
                )
            loss, aux = out
        elif isinstance(out, (tuple, list)):
            raise TypeError(
                f"scaled_value_and_grad: {name} returned {_describe(out)}; the loss "
                "must be a scalar. If it returns (loss, aux), pass has_aux=True."
            )
        else:
            loss, aux = out, None
        aval = compat.aval_of(jnp.asarray(loss)) if _is_arraylike(loss) else None
        if aval is None or aval.shape != () or not jnp.issubdtype(aval.dtype, jnp.floating):
            raise TypeError(
                f"scaled_value_and_grad: {name} must return a scalar floating loss"
                f"{' (the first of (loss, aux))' if has_aux else ''}, got "
                f"{_describe(loss)}"
            )
        return loss_scale.scale(loss), (loss, aux)

    def step(loss_scale: LossScale, *args: Any, **kwargs: Any) -> Any:
        _check_loss_scale_argument(loss_scale, args)
        positions = _positions(requested, argnums, len(args))
        if any(isinstance(a, _diff_state_type()) for a in requested):
            from flax import nnx

            # nnx binds arguments to positions: fn's keyword arguments are closed over.
            nnx_fn = nnx.value_and_grad(
                lambda s, *a: scaled(s, *a, **kwargs), argnums=positions, has_aux=True
            )
            (_, (loss, aux)), grads = nnx_fn(loss_scale, *args)
        else:
            _check_differentiable(fn, name, requested, args)
            grad_fn = jax.value_and_grad(scaled, argnums=positions, has_aux=True)
            (_, (loss, aux)), grads = grad_fn(loss_scale, *args, **kwargs)
        applied = _applied(loss_scale, loss)  # the scale before adjust, as the loss had it
        grads = jax.tree.map(lambda g: _unscale_leaf(g, applied), grads)
        finite = all_finite(grads, axis_name=axis_name)
        value = (loss, aux) if has_aux else loss
        return value, grads, loss_scale.adjust(finite), finite

    # fn's name for jit's messages, but not its signature (step takes the loss scale first)
    step.__name__ = name
    step.__qualname__ = getattr(fn, "__qualname__", name)
    return compat.api_boundary(step)  # (fn's errors show fn's frames, as under jax.grad)


def _applied(loss_scale: LossScale, loss: Any) -> jax.Array:
    """What ``loss_scale.scale(loss)`` multiplied the loss by: the scale rounded to the loss's
    dtype (3000 is 3008 in bfloat16), which the gradients are divided by.

    Where that is 0 (a float16 loss and a scale of 2**-25 or less) every gradient is 0 and 0/0
    makes it NaN: the step is not finite. Where it is inf (past float16's range) the gradients are
    inf or NaN already; dividing by the float32 scale leaves an inf one inf, as flax does."""
    scale = loss_scale.loss_scale
    rounded = scale.astype(jnp.result_type(loss))
    return jnp.where(jnp.isinf(rounded), scale, rounded.astype(scale.dtype))


_LOSS_SCALES = (
    "a jamp loss scale (NoOpLossScale, StaticLossScale, DynamicLossScale or MicroBatchLossScale)"
)


def _is_arraylike(x: Any) -> bool:
    return isinstance(x, (float, int, np.ndarray, np.generic, jax.Array)) and type(x) is not bool


def _describe(x: Any) -> str:
    if isinstance(x, (tuple, list)):
        return f"a {type(x).__name__} of {len(x)}"
    if isinstance(x, (int, float)) and type(x) is not bool:
        return f"{type(x).__name__} {x!r}"
    if _is_arraylike(x):
        return compat.aval_of(jnp.asarray(x)).str_short()
    return type(x).__name__


def _check_loss_scale_argument(loss_scale: Any, args: tuple) -> None:
    if isinstance(loss_scale, _LossScale):
        return
    swapped = [i for i, a in enumerate(args) if isinstance(a, _LossScale)]
    if swapped:
        raise TypeError(
            f"step(loss_scale, *args): the first argument must be {_LOSS_SCALES}, got "
            f"{_describe(loss_scale)}, and a loss scale as argument {swapped[0] + 2} (counting "
            "from 1): are the arguments swapped? Call step(loss_scale, params, ...)"
        )
    fix = (
        f"; wrap it: jamp.StaticLossScale({loss_scale!r}) or "
        f"jamp.DynamicLossScale(loss_scale={loss_scale!r})"
        if _is_arraylike(loss_scale)
        else ""
    )
    raise TypeError(
        f"step(loss_scale, *args): the first argument must be {_LOSS_SCALES}, got "
        f"{_describe(loss_scale)}{fix}"
    )


class _NoDiffState:
    """Stands for ``nnx.DiffState`` while flax is not imported (nothing is an instance)."""


def _diff_state_type() -> Any:  # a type; Any so that isinstance does not narrow to object
    """flax's ``nnx.DiffState``, without importing flax (no DiffState exists before it is)."""
    return getattr(sys.modules.get("flax.nnx"), "DiffState", _NoDiffState)


def _index(argnum: Any) -> int:
    return int(argnum.argnum if isinstance(argnum, _diff_state_type()) else argnum)


def _is_argnum(value: Any) -> bool:
    """An int, not a bool (``True`` is an int to Python, never an argument number here)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _argnums_tuple(argnums: Any) -> tuple[Any, ...]:
    items = (argnums,) if not isinstance(argnums, (tuple, list)) else tuple(argnums)
    diff_state = _diff_state_type()
    if not items or not all(
        _is_argnum(a) or (isinstance(a, diff_state) and _is_argnum(a.argnum)) for a in items
    ):
        raise TypeError(
            "scaled_value_and_grad(argnums=...) must be an int, an nnx.DiffState or a "
            f"non-empty sequence of them, got {argnums!r}"
        )
    return tuple(a if isinstance(a, diff_state) else int(a) for a in items)


def _check_differentiable(fn: Callable, name: str, requested: tuple[Any, ...], args: tuple) -> None:
    """Integer, bool and PRNG-key leaves cannot be differentiated: name them and the way out
    (JAX's own error names only a dtype)."""
    for argnum in requested:
        arg = args[argnum]
        bad = []
        for path, leaf in jax.tree_util.tree_flatten_with_path(arg)[0]:
            if not isinstance(leaf, (bool, int, float, complex)) and not hasattr(leaf, "dtype"):
                continue  # not an array: JAX's own error names it
            dtype = jnp.result_type(leaf)
            if not jnp.issubdtype(dtype, jnp.inexact):
                bad.append(f"{jax.tree_util.keystr(path)} ({dtype})")
        if not bad:
            continue
        from .call_args import CallSignature

        param = CallSignature.of(fn).parameter_name(argnum % len(args))
        leaves = ", ".join(param + b for b in bad[:3]) + (", ..." if len(bad) > 3 else "")
        raise TypeError(
            f"scaled_value_and_grad({name}, argnums={argnum}): argument '{param}' has leaves "
            f"that cannot be differentiated, only floating ones can: {leaves}. "
            + _way_out(arg, name, argnum)
        )


def _way_out(arg: Any, name: str, argnum: int) -> str:
    nnx = sys.modules.get("flax.nnx")
    if nnx is not None and isinstance(arg, nnx.State):
        return (
            "Differentiate the parameters only: pass the module itself with "
            f"jamp.scaled_value_and_grad({name}, argnums=nnx.DiffState({argnum}, nnx.Param)), "
            "or split its state with params, rest = nnx.state(model, nnx.Param, ...) and pass "
            "rest as an argument outside argnums"
        )
    from .graph_nodes import has_graph_nodes

    if has_graph_nodes(arg):
        return (
            "An NNX module's RNG state and counters are not parameters: differentiate its "
            f"nnx.Param only with jamp.scaled_value_and_grad({name}, "
            f"argnums=nnx.DiffState({argnum}, nnx.Param))"
        )
    return "Pass them in an argument outside argnums, or as a keyword argument"


def _positions(requested: tuple[Any, ...], argnums: Any, n_args: int) -> Any:
    """``argnums`` (counting ``fn``'s arguments, negatives from the end) as positions of the
    step's inner function, whose argument 0 is the loss scale."""
    bad = [a for a in requested if not -n_args <= _index(a) < n_args]
    if bad:
        raise ValueError(
            f"scaled_value_and_grad: argnums={argnums!r} is out of range: step(loss_scale, "
            f"*args) was called with {n_args} argument{'s' if n_args != 1 else ''} after the "
            f"loss scale, so argnums must be in [{-n_args}, {n_args - 1}]"
            if n_args
            else "scaled_value_and_grad: step(loss_scale, *args) was called with no arguments to "
            "differentiate after the loss scale"
        )
    shifted = tuple(
        dataclasses.replace(a, argnum=a.argnum % n_args + 1)
        if isinstance(a, _diff_state_type())
        else a % n_args + 1
        for a in requested
    )
    return shifted if isinstance(argnums, (tuple, list)) else shifted[0]
