"""Gradient accumulation over micro-batches that skips a step whose gradients overflowed, as
torch's ``GradScaler`` does: ``jamp.accumulate_micro_batches(tx, every_k)``.

Why not ``optax.MultiSteps``: with loss scaling, one micro-batch in a thousand overflows, and
MultiSteps cannot skip the step it belongs to. Its accumulator is reset by multiplying it by 0,
and ``0 * inf`` is NaN, so an overflowed micro-batch stays in the accumulator for the rest of
training (``MultiSteps(apply_if_finite(tx), k)`` then skips every later step); and its
``should_skip_update_fn`` drops the overflowed micro-batch alone, so the step is applied from the
others and the step boundaries shift. This transformation keeps MultiSteps' interface (an
``optax.GradientTransformation``; zero updates between steps) and differs in those two points:
the accumulator is reset by selection, and a step whose accumulated gradients are not finite is
skipped as a whole (no update, the inner optimizer's state unchanged).
"""

from __future__ import annotations

from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np

from .loss_scale import all_finite


class MicroBatchesState(NamedTuple):
    """State of :func:`jamp.accumulate_micro_batches`."""

    mini_step: jax.Array  # micro-batches of the current step seen so far, in [0, every_k)
    acc_grads: Any  # their gradients' sum (float32 for 16-bit or float32 parameters)
    inner_state: Any  # the wrapped optimizer's state
    skipped_steps: jax.Array  # steps skipped because their gradients were not finite


def _accumulator(p: Any) -> jax.Array:
    dtype = jnp.result_type(p)
    wide = jnp.promote_types(dtype, jnp.float32) if jnp.issubdtype(dtype, jnp.floating) else dtype
    return jnp.zeros(jnp.shape(p), wide)


def _mismatch(acc_grads: Any, grads: Any) -> ValueError | None:
    """The gradients are not shaped as the parameters ``init`` made the state for were, in the
    terms :func:`jamp.optim.master_weights` says it in (JAX's error names no path); None if they
    are."""
    where = "jamp.accumulate_micro_batches(tx, every_k).update"
    try:
        flat = cast(Any, jax.tree.structure(acc_grads)).flatten_up_to(grads)
    except (ValueError, TypeError) as err:
        return ValueError(
            f"{where}: opt_state.acc_grads and grads differ in structure: {err} A parameter "
            "added or removed since init made the state? Make the state again with init(params)"
        )
    for (path, a), g in zip(jax.tree_util.tree_flatten_with_path(acc_grads)[0], flat):
        if np.shape(g) != np.shape(a):
            at = jax.tree_util.keystr(path)
            return ValueError(
                f"{where}: grads{at} has shape {tuple(np.shape(g))} but had "
                f"{tuple(np.shape(a))} when init made the state (opt_state.acc_grads{at}); make "
                "the state again with init(params) after changing a parameter's shape"
            )
    return None


def accumulate_micro_batches(tx: Any, every_k: int) -> Any:
    """``tx`` applied once every ``every_k`` calls, to the mean of those calls' gradients, and
    skipped as a whole when that mean is not finite (one micro-batch overflowed).

    The optimizer half of torch's ``GradScaler`` loop with gradient accumulation; the loss-scale
    half is :class:`jamp.MicroBatchLossScale` with the same ``every_k``, which adjusts the scale
    once per step. Between steps the updates are zeros, as ``optax.MultiSteps`` returns (why not
    MultiSteps itself: see this module's docstring). ``tx``'s state keeps the dtypes ``tx.init``
    gave it, as in MultiSteps (16-bit parameters' moments stay 16-bit under float32 gradients).

    Example::

        def loss_fn(params, x):
            return jnp.mean((x @ params["w"]) ** 2)

        tx = jamp.accumulate_micro_batches(optax.adamw(1e-3), every_k=4)
        scale = jamp.MicroBatchLossScale(jamp.DynamicLossScale(), every_k=4)
        step = jamp.scaled_value_and_grad(jamp.autocast_transform(loss_fn, dtype=jnp.float16))
        params = {"w": jnp.full((4, 2), 0.1)}
        opt_state = tx.init(params)
        for batch in [jnp.ones((8, 4))] * 4:                 # one optimizer step
            loss, grads, scale, finite = step(scale, params, batch)
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
    """
    if isinstance(every_k, (bool, np.bool_)) or not isinstance(every_k, (int, np.integer)):
        raise ValueError(f"accumulate_micro_batches: every_k must be an int >= 1, got {every_k!r}")
    every_k = int(every_k)  # (a numpy integer too: np.int64(2) from a config array)
    if every_k < 1:
        raise ValueError(f"accumulate_micro_batches: every_k must be an int >= 1, got {every_k!r}")
    if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
        raise TypeError(
            "accumulate_micro_batches expects an optax.GradientTransformation (init and "
            f"update), got {type(tx).__name__}"
        )
    import optax  # flax's dependency; imported here so `import jamp` does not need it

    def init(params: Any) -> MicroBatchesState:
        return MicroBatchesState(
            jnp.zeros((), jnp.int32),
            jax.tree.map(_accumulator, params),
            tx.init(params),
            jnp.zeros((), jnp.int32),
        )

    def update(
        grads: Any, state: MicroBatchesState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, MicroBatchesState]:
        reshaped: list[Any] = []

        def accumulated(a: jax.Array, g: Any) -> jax.Array:
            if np.shape(g) != a.shape:  # (a 1x4 gradient would broadcast into 4x4 silently)
                reshaped.append(g)
                return a
            return a + jnp.asarray(g).astype(a.dtype)

        try:
            acc = jax.tree.map(accumulated, state.acc_grads, grads)
        except ValueError as err:  # another structure: a parameter added or removed since init
            found = _mismatch(state.acc_grads, grads)
            if found is None:
                raise
            raise found from err
        if reshaped:
            raise cast(ValueError, _mismatch(state.acc_grads, grads))  # (it names the leaf)
        last = state.mini_step == every_k - 1
        finite = all_finite(acc)
        mean = jax.tree.map(lambda a, g: (a / every_k).astype(jnp.result_type(g)), acc, grads)

        # The branches take what they read as operands, not as closures: eagerly, a state held
        # as numpy arrays (flax.serialization's restore) would become constants of the program,
        # which XLA folds (2 ulps off the same step on jax arrays) and compiles again per value.
        def inner_update(operands: Any) -> Any:
            mean, stored, params = operands
            updates, inner_state = tx.update(mean, stored, params, **extra_args)
            # The state keeps the dtypes tx.init gave it, as in optax.MultiSteps: bfloat16
            # parameters' Adam moments stay bfloat16 under float32 gradients (and both branches
            # of the cond below must agree on them).
            return updates, jax.tree.map(
                lambda old, new: jnp.asarray(new, jnp.result_type(old)),
                stored,
                inner_state,
            )

        def hold(operands: Any) -> Any:
            shapes = jax.eval_shape(inner_update, operands)[0]
            return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes), operands[1]

        operands = (mean, state.inner_state, params)
        updates, inner_state = jax.lax.cond(last & finite, inner_update, hold, operands)
        return updates, MicroBatchesState(
            jnp.where(last, 0, state.mini_step + 1).astype(jnp.int32),
            jax.tree.map(lambda a: jnp.where(last, jnp.zeros_like(a), a), acc),
            inner_state,
            state.skipped_steps + (last & ~finite).astype(jnp.int32),
        )

    return optax.GradientTransformationExtraArgs(init, update)
