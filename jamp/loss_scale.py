"""Loss scaling for float16 training: static and dynamic scales, finiteness checks.

The names follow DeepMind's jmp so code can switch, without its known bugs: every field
(``min_loss_scale`` included) is a pytree leaf, so a scale survives ``jax.jit`` and
``jax.tree.map``; ``unscale`` casts gradients to float32 before dividing; the scale itself is
float32 whatever the compute dtype; and :func:`scaled_value_and_grad` unscales with the scale the
loss was multiplied by, not the adjusted one.

Example::

    loss_scale = jamp.DynamicLossScale()
    step_fn = jamp.scaled_value_and_grad(loss_fn)
    loss, grads, loss_scale, finite = step_fn(loss_scale, params, batch)
    # skip the update on overflow with optax: optax.apply_if_finite(tx, max_consecutive_errors=...)
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

F32 = jnp.float32


def _coerce(value: Any, dtype: Any) -> Any:
    """Numbers and arrays become ``dtype`` arrays; other leaves (the placeholders JAX passes while
    flattening and unflattening pytrees) are left alone."""
    if isinstance(value, (bool, int, float, np.ndarray, np.generic, jax.Array)):
        return jnp.asarray(value, dtype)
    return value


def _scale_leaf(x: Any, scale: jax.Array) -> Any:
    return x * scale.astype(x.dtype) if jnp.issubdtype(jnp.result_type(x), jnp.floating) else x


def _unscale_leaf(x: Any, scale: jax.Array) -> Any:
    dtype = jnp.result_type(x)
    if not jnp.issubdtype(dtype, jnp.floating):
        return x
    wide = jnp.float64 if dtype == jnp.float64 else F32
    return jnp.asarray(x).astype(wide) / scale.astype(wide)


class _LossScale:
    loss_scale: jax.Array

    def scale(self, tree: Any) -> Any:
        """Multiply every floating leaf (usually the loss) by the loss scale."""
        return jax.tree.map(lambda x: _scale_leaf(x, self.loss_scale), tree)

    def unscale(self, tree: Any) -> Any:
        """Divide every floating leaf by the loss scale, in float32 (float64 stays float64)."""
        return jax.tree.map(lambda x: _unscale_leaf(x, self.loss_scale), tree)

    def adjust(self, grads_finite: jax.Array) -> "_LossScale":
        return self


@functools.partial(jax.tree_util.register_dataclass, data_fields=[], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class NoOpLossScale(_LossScale):
    """A loss scale of 1 that never changes (for bfloat16/float32 training)."""

    @property
    def loss_scale(self) -> jax.Array:  # type: ignore[override]
        return jnp.ones((), F32)

    def scale(self, tree: Any) -> Any:
        return tree


@functools.partial(jax.tree_util.register_dataclass, data_fields=["loss_scale"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class StaticLossScale(_LossScale):
    """A fixed loss scale: ``jamp.StaticLossScale(2.0 ** 12)``."""

    loss_scale: Any

    def __post_init__(self) -> None:
        object.__setattr__(self, "loss_scale", _coerce(self.loss_scale, F32))


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["loss_scale", "counter", "period", "factor", "min_loss_scale"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class DynamicLossScale(_LossScale):
    """A loss scale that grows after ``period`` finite steps and backs off on overflow.

    ``adjust(grads_finite)``: after ``period`` consecutive finite steps the scale is multiplied by
    ``factor``; on a non-finite step it is divided by ``factor`` (never below
    ``min_loss_scale``) and the counter restarts.
    """

    loss_scale: Any = 2.0 ** 15
    counter: Any = 0
    period: Any = 2000
    factor: Any = 2
    min_loss_scale: Any = 1.0

    def __post_init__(self) -> None:
        for name, dtype in (("loss_scale", F32), ("counter", jnp.int32), ("period", jnp.int32),
                            ("factor", F32), ("min_loss_scale", F32)):
            object.__setattr__(self, name, _coerce(getattr(self, name), dtype))

    def adjust(self, grads_finite: jax.Array) -> "DynamicLossScale":
        grads_finite = jnp.asarray(grads_finite)
        grow = self.counter == self.period - 1
        grown = jnp.where(grow, self.loss_scale * self.factor, self.loss_scale)
        backed_off = jnp.maximum(self.min_loss_scale, self.loss_scale / self.factor)
        return dataclasses.replace(
            self,
            loss_scale=jnp.where(grads_finite, grown, backed_off),
            counter=jnp.where(grads_finite, jnp.where(grow, 0, self.counter + 1), 0))


LossScale = Union[NoOpLossScale, StaticLossScale, DynamicLossScale]


def all_finite(tree: Any) -> jax.Array:
    """A scalar bool: every floating leaf of ``tree`` is free of inf and NaN."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
              if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


def select_tree(pred: Any, a: Any, b: Any) -> Any:
    """``a`` where the scalar ``pred`` is true, else ``b``, leaf by leaf (same structures)."""
    if jax.tree.structure(a) != jax.tree.structure(b):
        raise ValueError("select_tree needs trees of one structure, got "
                         f"{jax.tree.structure(a)} and {jax.tree.structure(b)}")
    pred = jnp.asarray(pred)
    if pred.shape != () or pred.dtype != jnp.bool_:
        raise ValueError(f"select_tree's pred must be a scalar bool, got {pred.dtype}{list(pred.shape)}")
    return jax.tree.map(lambda x, y: jax.lax.select(pred, x, y), a, b)


def scaled_value_and_grad(fn: Callable, *, argnums: Union[int, Sequence[int]] = 0,
                          has_aux: bool = False) -> Callable:
    """``jax.value_and_grad`` with loss scaling, in one call.

    Returns ``step(loss_scale, *args, **kwargs) -> (value, grads, new_loss_scale, grads_finite)``:
    the loss is multiplied by the current scale, gradients are unscaled with that same scale
    (then checked for inf/NaN), and only then is the scale adjusted. ``value`` is the unscaled
    loss (``(loss, aux)`` with ``has_aux``); ``grads`` are float32.

    Example::

        step = jamp.scaled_value_and_grad(jamp.autocast_transform(loss_fn, dtype=jnp.float16))
        loss, grads, loss_scale, finite = step(loss_scale, params, batch)
        params = jamp.select_tree(finite, optax.apply_updates(params, updates), params)
    """
    def scaled(loss_scale: LossScale, *args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        loss, aux = out if has_aux else (out, None)
        return loss_scale.scale(loss), (loss, aux)

    grad_fn = jax.value_and_grad(scaled, argnums=_shift(argnums), has_aux=True)

    def step(loss_scale: LossScale, *args: Any, **kwargs: Any) -> Any:
        (_, (loss, aux)), grads = grad_fn(loss_scale, *args, **kwargs)
        grads = loss_scale.unscale(grads)  # the scale the loss was multiplied by
        finite = all_finite(grads)
        value = (loss, aux) if has_aux else loss
        return value, grads, loss_scale.adjust(finite), finite

    return step


def _shift(argnums: Union[int, Sequence[int]]) -> Union[int, tuple[int, ...]]:
    return argnums + 1 if isinstance(argnums, int) else tuple(a + 1 for a in argnums)
