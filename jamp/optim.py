"""Training state in fewer bytes: optax wrappers for 16-bit parameters and optimizer state.

Each function wraps any optax ``GradientTransformation`` and returns one (composing with
``optax.chain``, ``optax.MultiSteps``, ``optax.apply_if_finite`` and jamp's loss scaling):

- :func:`state_dtype` stores the wrapped optimizer's floating state in bfloat16 (or another
  narrow dtype), computes it in float32 inside ``update`` and rounds it back.
- :func:`master_weights` keeps a float32 copy of 16-bit parameters in the state.
- :func:`stochastic_rounding` keeps no copy: parameters land on the stochastically rounded
  ``param + update``, so updates smaller than half a 16-bit step still count on average.
- :func:`compensated` keeps a 16-bit Kahan compensation buffer: what rounding the parameter
  dropped is carried to the next step.

The parameter wrappers hand ``tx`` float32 gradients and float32 parameters (the master copy,
or the 16-bit ones widened), so ``tx``'s own state is float32 unless ``state_dtype`` stores it
narrower. The updates they return are in the gradients' dtype (as optax's wrappers expect) and
are chosen so that ``optax.apply_updates(params, updates)`` lands exactly on the new 16-bit
value: the update is ``new - param``, exact in float32 and in a 16-bit dtype whenever the
parameter at most doubles or halves in the step (the difference of two bfloat16 values within a
factor 2 of each other is a bfloat16 value). A bigger jump with 16-bit gradients (82 to 26.6 in
one step, or a sign change near 0) may have no 16-bit update that reaches it: the parameter then
lands on the closest value an update can reach, as plain optax would, and the next step aims
from where it landed (``master_weights`` keeps the exact value in its copy, so it catches up).

Random bits need no key: a ``seed`` and a step counter in the state give every step and every
leaf its own bits, so a restored checkpoint draws the same bits as an uninterrupted run. A
leaf's bits depend on its pytree path, so wrappers with one seed side by side over one tree
(one per ``optax.multi_transform`` group, which keeps the whole tree's paths) draw their own;
give each a different ``seed`` only when they update separate trees whose paths are the same.
The counter is part of the state: a step that ``optax.apply_if_finite`` (wrapped around these)
or ``jamp.select_tree`` skips leaves it unchanged with the rest. A leaf's bits come from each
element's index in the whole array under ``jax.jit`` on sharded arrays (the same as on one
device); inside ``jax.shard_map`` the index is the shard's own and the key is the same on every
shard, so every shard of a split parameter would draw the same bits: call ``update`` outside
``shard_map``, under ``jit`` on the sharded arrays (no collective is added).

``optax.lookahead`` goes outside the parameter wrappers
(``optax.lookahead(jamp.optim.master_weights(tx), ...)``), which then see its fast parameters;
:func:`state_dtype` can wrap it.

Example::

    tx = jamp.optim.stochastic_rounding(jamp.optim.state_dtype(optax.adamw(1e-3)))
    params = {"w": jnp.zeros((4, 4), jnp.bfloat16)}
    opt_state = tx.init(params)      # Adam's moments in bfloat16
    grads = {"w": jnp.ones((4, 4), jnp.bfloat16)}
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)   # still bfloat16
"""

from __future__ import annotations

import contextvars
import fnmatch
import hashlib
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax

from .policy import UnmatchedRuleWarning, user_stacklevel
from .rounding import F32, check_target, is_narrow, stochastic_round_many

__all__ = [
    "state_dtype",
    "master_weights",
    "stochastic_rounding",
    "compensated",
    "StateDtypeState",
    "MasterWeightsState",
    "StochasticRoundingState",
    "CompensatedState",
    "UnmatchedKeepWarning",
]


class UnmatchedKeepWarning(UnmatchedRuleWarning):
    """A ``state_dtype(keep=...)`` glob matched no leaf of the optimizer state."""


class StateDtypeState(NamedTuple):
    """:func:`jamp.optim.state_dtype`'s state: the rounding counter (``step``) and ``tx``'s state, stored
    narrow."""

    step: jax.Array
    inner_state: Any


class MasterWeightsState(NamedTuple):
    """:func:`jamp.optim.master_weights`'s state: the rounding counter (``step``), the float32
    master copy of each 16-bit parameter (``optax.MaskedNode()`` for the others) and ``tx``'s state."""

    step: jax.Array
    master: Any
    inner_state: Any


# The path entry of its master copies (``state.master``), which ``state_dtype`` never narrows.
_MASTER_COPY = jax.tree_util.GetAttrKey("master")


class StochasticRoundingState(NamedTuple):
    """:func:`jamp.optim.stochastic_rounding`'s state: the rounding counter (``step``) and ``tx``'s
    state."""

    step: jax.Array
    inner_state: Any


class CompensatedState(NamedTuple):
    """:func:`jamp.optim.compensated`'s state: each 16-bit parameter's rounding error, in its own dtype
    and in units of the parameter's spacing (the gap to its neighbouring value; so the error
    is ``compensation * spacing``), ``optax.MaskedNode()`` for the others, and ``tx``'s state."""

    compensation: Any
    inner_state: Any


# Each wrapper folds its own constant into the key, so two wrappers with the same seed (the
# parameters' rounding and the moments' rounding) never draw the same bits for leaf i.
_SALTS = {"state_dtype": 0x5D7E, "master_weights": 0x3A57, "stochastic_rounding": 0x5120}


# Each rounding takes all of a step's leaves at once (stochastic rounding shares its hashing
# between them): (arrays, their target dtypes, the step's key, each array's salt from its
# pytree path) -> rounded arrays.
_RoundMany = Callable[
    [Sequence[jax.Array], Sequence[Any], Any, Sequence[tuple[int, int]]], list[jax.Array]
]


def _round_nearest(
    xs: Sequence[jax.Array], targets: Sequence[Any], key: Any, salts: Any
) -> list[jax.Array]:
    del key, salts
    return [x.astype(t) for x, t in zip(xs, targets)]


def _path_salt(path: Sequence[Any]) -> tuple[int, int]:
    """Two uint32 words from a leaf's pytree path, the same in every process (``hash()`` of a
    str is not). A wrapper sees only its own leaves, numbered from 0, but ``optax.masked`` and
    ``optax.multi_transform`` keep the whole tree's paths: with the path in its bits, a leaf
    draws other bits than another group's leaf i under a wrapper with the same seed."""
    digest = hashlib.blake2b(_path_text(path).encode(), digest_size=8).digest()
    return int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:], "little")


_ROUNDINGS: dict[str, _RoundMany] = {
    "nearest": _round_nearest,
    "stochastic": stochastic_round_many,
}


def _check_rounding(rounding: Any, where: str) -> _RoundMany:
    if not isinstance(rounding, str) or rounding not in _ROUNDINGS:
        raise ValueError(
            f"{where}(rounding=...) must be one of {sorted(_ROUNDINGS)}, got {rounding!r}"
        )
    return _ROUNDINGS[rounding]


def _check_tx(tx: Any, where: str) -> optax.GradientTransformationExtraArgs:
    """``tx`` as a GradientTransformation that takes extra arguments (``optax.MultiSteps``, a
    class with ``init``/``update`` of its own, is accepted through its transformation)."""
    if isinstance(tx, optax.MultiSteps):
        tx = tx.gradient_transformation()
    if isinstance(tx, optax.GradientTransformation):
        return optax.with_extra_args_support(tx)
    hint = (
        f"; {getattr(tx, '__name__', 'it')} is a function: call it, e.g. optax.adamw(1e-3)"
        if callable(tx)
        else ""
    )
    raise TypeError(
        f"{where}(tx): tx must be an optax GradientTransformation such as optax.adamw(1e-3), "
        f"got {type(tx).__name__}{hint}"
    )


def _check_seed(seed: Any, where: str) -> int:
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool):
        raise TypeError(f"{where}(seed=...) must be an int, got {seed!r}")
    return int(seed)


def _step_key(seed: int, salt: int, step: jax.Array) -> Any:
    """The key of one step's rounding: every leaf draws its own words from it."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), salt), step)


def _floating(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def _path_text(path: Sequence[Any]) -> str:
    """A pytree path as '/'-joined names, as Policy.rules globs read scope paths:
    ``0/mu/dense/kernel`` for ``state[0].mu['dense']['kernel']``."""
    parts = []
    for entry in path:
        for attr in ("key", "name", "idx"):  # DictKey, GetAttrKey, SequenceKey
            if hasattr(entry, attr):
                parts.append(str(getattr(entry, attr)))
                break
        else:
            parts.append(str(entry))
    return "/".join(parts)


def _land(param: jax.Array, target: jax.Array, update_dtype: Any) -> jax.Array:
    """The update in ``update_dtype`` that takes ``param`` to ``target`` under
    ``optax.apply_updates`` (``(param + update).astype(param.dtype)``).

    ``target - param`` is exact in float32 for 16-bit values less than 2**16 apart in ratio;
    when it also fits ``update_dtype`` the sum is exactly ``target`` however the backend adds
    (float32 always; a 16-bit dtype when the value at most doubles or halves). Otherwise no
    update of that dtype may reach ``target``: rounding the difference to nearest gives the
    closest landing there is (a neighbouring update is never closer: it is at least as far from
    the difference), so none is searched for."""
    return (target.astype(F32) - param.astype(F32)).astype(update_dtype)


def _update_dtype(grad: Any, param: Any) -> Any:
    return grad.dtype if _floating(grad) else param.dtype


# The parameter wrapper whose tx is being initialised: it hands tx float32 parameters (its
# master copies, or the 16-bit ones widened), so a parameter wrapper inside it finds none of
# the 16-bit ones the user passed.
_WIDENING_WRAPPER: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "jamp_optim_widening_wrapper", default=None
)


def _init_inner(inner: Any, params: Any, where: str) -> Any:
    """``inner.init(params)``, with ``where`` known to parameter wrappers inside it."""
    token = _WIDENING_WRAPPER.set(where)
    try:
        return inner.init(params)
    finally:
        _WIDENING_WRAPPER.reset(token)


def _no_narrow_error(wrapper: str, params: Any) -> ValueError:
    outer = _WIDENING_WRAPPER.get()
    if outer is not None:
        return _nested_error(wrapper, outer)
    found = sorted({str(x.dtype) for x in jax.tree.leaves(params) if _floating(x)})
    return ValueError(
        f"{wrapper}(tx).init(params): no parameter is in a 16-bit (or narrower) floating "
        f"dtype (found {', '.join(found) or 'no floating parameters'}), so there is nothing "
        "to do: float32 parameters need neither master weights nor stochastic rounding. Cast "
        "the parameters first, e.g. jax.tree.map(lambda p: p.astype(jnp.bfloat16), params), or "
        "use the optimizer without this wrapper"
    )


def _nested_error(inner: str, outer: str) -> ValueError:
    """Two parameter wrappers, one inside the other: the inner one sees the outer one's float32
    parameters, so it would do nothing (a master copy of a float32 value, a rounding to
    float32) while looking as if it did."""
    hint = ""
    if {inner, outer} == {"jamp.optim.master_weights", "jamp.optim.stochastic_rounding"}:
        hint = (
            "; for master copies rounded stochastically into the 16-bit parameters write "
            "jamp.optim.master_weights(tx, rounding='stochastic')"
        )
    use = (
        f"Use it once: {inner}(tx)"
        if inner == outer
        else f"Use one of them, not both: {outer}(tx) or {inner}(tx)"
    )
    return ValueError(
        f"{inner}(tx).init(params): {inner} is nested inside {outer}, which hands its tx "
        f"float32 parameters, so {inner} finds no 16-bit parameter to work on. {use}, with "
        f"jamp.optim.state_dtype inside for narrow optimizer state{hint}"
    )


def _need_params(params: Any, where: str) -> None:
    if params is None:
        raise ValueError(
            f"{where}: update needs the current parameters: call "
            "tx.update(grads, opt_state, params)"
        )


def state_dtype(
    tx: Any,
    dtype: Any = jnp.bfloat16,
    *,
    keep: Sequence[str] = (),
    rounding: str = "stochastic",
    seed: int = 0,
) -> optax.GradientTransformationExtraArgs:
    """Store ``tx``'s floating state in ``dtype``; compute it in float32 inside ``update``.

    Every floating leaf of ``tx``'s state (Adam's moments, momentum, accumulators) is stored in
    ``dtype`` (bfloat16, float16 or a float8 type), except leaves whose pytree path matches a
    glob in ``keep``, which stay as ``tx`` made them. Paths are '/'-joined names such as
    ``0/nu/dense/kernel`` for ``optax.adamw``'s second moment (``keep=("*nu*",)`` keeps it;
    a glob that matches nothing warns with :class:`UnmatchedKeepWarning`). An
    ``nnx.Optimizer``'s state holds ``nnx`` variables, so its paths end in ``/value``
    (``0/nu/head/kernel/value``): end a glob with ``*`` (``"*nu/head/kernel*"``). Integer
    leaves (step counts), float64 leaves and scalars (rank 0) are left alone: a floating scalar is a
    hyperparameter (``optax.inject_hyperparams``'s; in bfloat16 Adam's ``b2 = 0.999`` is 1 and
    its bias correction divides by zero) or bookkeeping (``optax.contrib.reduce_on_plateau``'s
    best loss, which must see a 0.1% improvement), and narrowing it saves nothing (so a scalar
    parameter's moments stay as ``tx`` made them too). ``update`` widens the stored leaves to
    float32, runs ``tx``, and stores the new state back with ``rounding``: ``"stochastic"``
    (unbiased, so a moving average such as Adam's ``b2 = 0.999`` keeps moving; the bits come
    from ``seed`` and a counter in the state) or ``"nearest"``. ``tx`` gets 16-bit gradients
    widened to float32 too, so it computes in float32 throughout (and ``optax.apply_if_finite``
    or ``optax.conditionally_transform`` inside, whose branches must agree in dtype, work).
    Updates come back in the gradients' dtype (updates of another structure than the gradients,
    such as ``optax.lookahead``'s, come back as ``tx`` returned them).

    ``dtype`` must be narrower than float32: an integer or float64 dtype raises ``ValueError``.

    ``seed`` picks the bits of ``rounding="stochastic"`` with the step counter in the state; a
    leaf's bits also depend on its pytree path, so wrappers with the same seed over one tree
    (one per ``optax.multi_transform`` group) draw their own. Give optimizers of separate trees
    with the same paths different seeds.

    Example::

        tx = jamp.optim.state_dtype(optax.adamw(1e-3), jnp.bfloat16)
        opt_state = tx.init({"w": jnp.zeros((256, 256))})  # mu and nu: 2 bytes a parameter each
    """
    where = "jamp.optim.state_dtype"
    inner = _check_tx(tx, where)
    target = check_target(dtype, f"{where}(dtype=...)")
    if isinstance(keep, str):
        keep = (keep,)
    if not all(isinstance(g, str) and g for g in keep):
        raise TypeError(f"{where}(keep=...) must be a sequence of glob strings, got {keep!r}")
    globs = tuple(keep)
    round_fn = _check_rounding(rounding, where)
    seed = _check_seed(seed, where)

    def widened(leaf: Any) -> Any:
        """A 16-bit (or narrower) floating leaf in float32, for ``tx`` to compute in."""
        return leaf.astype(F32) if _floating(leaf) and is_narrow(leaf.dtype) else leaf

    def narrowed(path: Any, leaf: Any) -> bool:
        """Stored in ``target``: floating, not float64, not a scalar, not a master copy of
        ``master_weights`` inside (a float32 copy is its whole point), not kept."""
        if not _floating(leaf) or leaf.dtype == np.float64 or not np.ndim(leaf):
            return False
        if _MASTER_COPY in tuple(path):
            return False
        text = _path_text(path)
        return not any(fnmatch.fnmatchcase(text, g) for g in globs)

    # inner.init's state as shapes and dtypes, by the parameters' shapes and dtypes: what a kept
    # leaf in a 16-bit dtype is checked against (made once for a configuration, then looked up)
    made_for: dict[Any, Any] = {}

    def made_by_init(params: Any) -> Any:
        leaves, params_def = jax.tree.flatten(params)
        key = (params_def, tuple((np.shape(x), jnp.result_type(x)) for x in leaves))
        try:
            return made_for[key]
        except KeyError:
            if len(made_for) >= 8:
                made_for.clear()
            made_for[key] = _abstract_init(inner, params)
            return made_for[key]
        except TypeError:  # an unhashable node in the parameters' treedef: made each time
            return _abstract_init(inner, params)

    def check_stored(flat: list[Any], treedef: Any, stored_at: list[int], params: Any) -> None:
        """The state in the dtypes this configuration stores (a state saved under another one
        and restored with flax.serialization, which keeps the saved dtypes, would stay in those
        for good, and a guarded step fails on the mismatch without naming it)."""
        for i in stored_at:
            path, leaf = flat[i]
            if leaf.dtype != target:
                raise _stored_dtype_error(
                    where, path, leaf.dtype, target, f"state_dtype(tx, dtype={target.name})"
                )
        at = set(stored_at)
        kept = [
            i
            for i, (_, x) in enumerate(flat)
            if i not in at and _floating(x) and np.ndim(x) and is_narrow(x.dtype)
        ]
        if not kept or params is None:
            return  # (what tx.init makes is known from the parameters only)
        made = made_by_init(params)
        if made is None:
            return
        made_leaves, made_def = jax.tree.flatten(made)
        if made_def != treedef:
            return  # another structure: inner.update fails, and the error names it
        for i in kept:
            path, leaf = flat[i]
            if made_leaves[i].dtype != leaf.dtype:
                why = (
                    "a master copy, as tx.init makes it"
                    if _MASTER_COPY in tuple(path)
                    else f"kept by keep={globs!r}, as tx.init makes it"
                )
                raise _stored_dtype_error(where, path, leaf.dtype, made_leaves[i].dtype, why)

    def init(params: Any) -> StateDtypeState:
        state = inner.init(params)
        flat = jax.tree_util.tree_flatten_with_path(state)[0]
        paths = [_path_text(p) for p, _ in flat]
        for glob in globs:
            if not any(fnmatch.fnmatchcase(p, glob) for p in paths):
                shown = ", ".join(paths[:8]) + (", ..." if len(paths) > 8 else "")
                warnings.warn(
                    f"{where}(keep=({glob!r}, ...)): the glob matched no leaf of the optimizer "
                    f"state, so every floating leaf is stored in {target.name}. Paths are "
                    f"'/'-joined, e.g. {shown or '(the state has no leaves)'}",
                    UnmatchedKeepWarning,
                    stacklevel=user_stacklevel(),
                )
        stored = jax.tree_util.tree_map_with_path(
            lambda p, x: x.astype(target) if narrowed(p, x) else x, state
        )
        return StateDtypeState(step=jnp.zeros([], jnp.int32), inner_state=stored)

    def update(
        updates: Any, state: StateDtypeState, params: Any = None, **extra: Any
    ) -> tuple[Any, StateDtypeState]:
        _check_state(state, StateDtypeState, f"{where}(tx)")
        stored = state.inner_state
        old_flat, treedef = jax.tree_util.tree_flatten_with_path(stored)
        treedef = cast(Any, treedef)  # typed PyTreeDef? in jax's stubs, without its methods
        stored_at = [i for i, (path, old) in enumerate(old_flat) if narrowed(path, old)]
        check_stored(old_flat, treedef, stored_at, params)
        # All of it in float32, kept narrow leaves and gradients too: a tx with a lax.cond
        # inside (apply_if_finite) needs the same dtypes from the step it takes and the one
        # it skips (the gradients, or the state as it came in).
        wide = jax.tree.map(widened, stored)
        try:
            new_updates, new_state = inner.update(
                jax.tree.map(widened, updates), wide, params, **extra
            )
        except (ValueError, TypeError) as err:
            found = None if _ours(err) else _mismatch(inner, stored, params, updates, where)
            if found is None:
                raise
            raise found from err
        new_leaves = treedef.flatten_up_to(new_state)
        rounded = round_fn(
            [_saturated(jnp.asarray(new_leaves[i]).astype(F32), target) for i in stored_at],
            [target] * len(stored_at),
            _step_key(seed, _SALTS["state_dtype"], state.step),
            [_path_salt(old_flat[i][0]) for i in stored_at],
        )
        kept_leaves = list(new_leaves)
        for (_, old), new, i in zip(old_flat, new_leaves, range(len(new_leaves))):
            if hasattr(old, "dtype") and hasattr(new, "dtype") and new.dtype != old.dtype:
                kept_leaves[i] = new.astype(old.dtype)  # kept leaves keep their type
        for i, new in zip(stored_at, rounded):
            kept_leaves[i] = new
        # Updates of another structure (optax.lookahead's: fast and slow) line up with no
        # gradient: they come back as tx returned them.
        if cast(Any, jax.tree.structure(new_updates)) == jax.tree.structure(updates):
            reshaped: list[Any] = []

            def like_grad(u: Any, g: Any) -> Any:
                if np.shape(u) != np.shape(g):  # a state of other shapes, broadcast by tx
                    reshaped.append(u)
                return u.astype(g.dtype) if _floating(u) and _floating(g) else u

            new_updates = jax.tree.map(like_grad, new_updates, updates)
            if reshaped:
                raise _mismatch(inner, stored, params, updates, where) or _reshaped_error(
                    where, new_updates, updates, "grads"
                )
        return new_updates, StateDtypeState(
            step=state.step + 1, inner_state=treedef.unflatten(kept_leaves)
        )

    return optax.GradientTransformationExtraArgs(init, update)


def _stored_dtype_error(where: str, path: Any, found: Any, expected: Any, why: str) -> ValueError:
    return ValueError(
        f"{where}(tx).update: opt_state.inner_state{jax.tree_util.keystr(path)} is "
        f"{np.dtype(found).name} but this state_dtype stores it in {np.dtype(expected).name} "
        f"({why}): a state saved under another configuration? (flax.serialization.from_bytes "
        "keeps the dtypes it was saved in.) Convert it once to the dtypes init makes: restore "
        "with orbax and the abstract target jax.eval_shape(tx.init, params), which casts, or "
        "opt_state = jax.tree.map(lambda x, t: x.astype(t.dtype), opt_state, "
        "jax.eval_shape(tx.init, params))"
    )


def _ours(err: Exception) -> bool:
    """An error a jamp wrapper inside raised, in the user's terms already (they start with the
    wrapper's name): passed on as it is."""
    return str(err).startswith("jamp.")


def _abstract_init(inner: Any, params: Any) -> Any:
    """``inner.init(params)`` as shapes and dtypes, or None where it cannot be made here."""
    try:
        shapes = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)), params
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (state_dtype's keep= warning, given at init)
            return jax.eval_shape(inner.init, shapes)
    except Exception:  # (on an error path only: the caller raises the error it has)
        return None


def _listed(paths: list[str], prefix: str) -> str:
    shown = ", ".join(prefix + p for p in paths[:3])
    return shown + (f", ... ({len(paths)} in all)" if len(paths) > 3 else "")


def _param_path(params: Any, state_path: str) -> str | None:
    """The parameter a state leaf mirrors (``['enc']['w']`` for ``[0].mu['enc']['w']``): the
    longest parameter path the state path ends with."""
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    ends = [p for p in paths if p and state_path.endswith(p)]
    return max(ends, key=len) if ends else None


def _mismatch(inner: Any, stored: Any, params: Any, grads: Any, where: str) -> ValueError | None:
    """Why ``inner.update`` failed, in the user's terms, where the parameters changed structure
    or shape since ``init`` made the state (or the gradients are not shaped as the parameters),
    as :func:`master_weights` says it; None for another cause. Only on an error path: it traces
    ``inner.init``."""
    subject = "params" if params is not None else "grads"
    like = params if params is not None else grads
    made = _abstract_init(inner, like)
    if made is not None:
        want = jax.tree_util.tree_flatten_with_path(made)[0]
        got = jax.tree_util.tree_flatten_with_path(stored)[0]
        if cast(Any, jax.tree.structure(made)) != jax.tree.structure(stored):
            want_paths = [jax.tree_util.keystr(p) for p, _ in want]
            got_paths = [jax.tree_util.keystr(p) for p, _ in got]
            lacking = [p for p in want_paths if p not in set(got_paths)]
            unknown = [p for p in got_paths if p not in set(want_paths)]
            parts = []
            if lacking:
                parts.append(
                    f"init({subject}) makes {_listed(lacking, 'opt_state.inner_state')}, which "
                    "opt_state lacks"
                )
            if unknown:
                parts.append(
                    f"opt_state has {_listed(unknown, 'opt_state.inner_state')}, which "
                    f"init({subject}) does not make"
                )
            detail = "; ".join(parts) or (
                f"{jax.tree.structure(stored)} where init({subject}) makes "
                f"{jax.tree.structure(made)}"
            )
            return ValueError(
                f"{where}(tx).update: opt_state.inner_state and {subject} differ in structure: "
                f"{detail}. A parameter added or removed since init made the state? Make the "
                f"state again with init({subject})"
            )
        for (path, w), (_, g) in zip(want, got):
            if np.shape(w) == np.shape(g):
                continue
            state_path = jax.tree_util.keystr(path)
            leaf = _param_path(like, state_path)
            if leaf is None:
                return ValueError(
                    f"{where}(tx).update: opt_state.inner_state{state_path} has shape "
                    f"{tuple(np.shape(g))} but init({subject}) makes {tuple(np.shape(w))}; make "
                    "the state again with init(params) after changing a parameter's shape"
                )
            return ValueError(
                f"{where}(tx).update: {subject}{leaf} has shape {tuple(np.shape(w))} but had "
                f"{tuple(np.shape(g))} when init made the state "
                f"(opt_state.inner_state{state_path}); make the state again with init(params) "
                "after changing a parameter's shape"
            )
    if params is not None:
        try:
            flat_grads = cast(Any, jax.tree.structure(params)).flatten_up_to(grads)
        except (ValueError, TypeError) as err:
            return ValueError(f"{where}(tx).update: grads and params differ in structure: {err}")
        for (path, p), g in zip(jax.tree_util.tree_flatten_with_path(params)[0], flat_grads):
            if np.shape(g) != np.shape(p):
                at = jax.tree_util.keystr(path)
                return ValueError(
                    f"{where}(tx).update: grads{at} has shape {tuple(np.shape(g))} but "
                    f"params{at} has shape {tuple(np.shape(p))}"
                )
    return None


def _reshaped_error(where: str, updates: Any, like: Any, what: str) -> ValueError:
    """tx's updates of other shapes than ``like`` (the gradients or the parameters), no cause
    found in the state."""
    flat = jax.tree_util.tree_flatten_with_path(updates)[0]
    for (path, u), x in zip(flat, jax.tree.leaves(like)):
        if np.shape(u) != np.shape(x):
            at = jax.tree_util.keystr(path)
            return ValueError(
                f"{where}(tx).update: tx returned updates{at} of shape {tuple(np.shape(u))} for "
                f"{what}{at} of shape {tuple(np.shape(x))}"
            )
    return ValueError(f"{where}(tx).update: tx returned updates of other shapes than the {what}")


def _saturated(value: jax.Array, dtype: Any) -> jax.Array:
    """``value`` clipped to ``dtype``'s largest finite magnitude: a second moment over float16's
    65504 (a gradient of 256) or float8's range is stored as that, not inf (which froze the
    parameter: updates of 0 from then on) or NaN. inf and NaN stay what they are."""
    limit = float(jnp.finfo(dtype).max)
    return jnp.where(jnp.isfinite(value), jnp.clip(value, -limit, limit), value)


def _split(params: Any, where: str) -> tuple[list[Any], Any, list[bool]]:
    if isinstance(params, optax.LookaheadParams):
        # Its gradients are the fast parameters' alone, so no leaf lines up with a gradient.
        raise TypeError(
            f"{where}: params is optax.LookaheadParams (fast and slow copies), which "
            "optax.lookahead updates from the fast parameters' gradients alone; put lookahead "
            "outside the jamp wrapper, e.g. optax.lookahead(jamp.optim.master_weights(tx), "
            "sync_period=6, slow_step_size=0.5): the wrapper then sees the fast parameters"
        )
    leaves, treedef = jax.tree.flatten(params)
    narrow = [_floating(x) and is_narrow(x.dtype) for x in leaves]
    return leaves, treedef, narrow


def _salts(params: Any, at: Sequence[int]) -> list[tuple[int, int]]:
    """The path salts of the parameter leaves at positions ``at``."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return [_path_salt(flat[i][0]) for i in at]


def _check_state(state: Any, cls: type, where: str) -> None:
    """``update`` was given the state its ``init`` made (an AttributeError deep inside else)."""
    if not isinstance(state, cls):
        raise TypeError(
            f"{where}.update(grads, opt_state, params): opt_state must be the {cls.__name__} "
            f"this transformation's init returned, got {type(state).__name__} (the state of "
            "another optimizer, or the arguments in another order?)"
        )


def _flat_like(tree: Any, treedef: Any, what: str, where: str) -> list[Any]:
    """``tree``'s leaves at the parameters' leaves, or an error naming ``what`` mismatched."""
    try:
        return treedef.flatten_up_to(tree)
    except (ValueError, TypeError) as err:
        raise ValueError(f"{where}.update: {what} and params differ in structure: {err}") from err


def _check_narrow_unchanged(
    params: Any, kept: list[Any], narrow: list[bool], what: str, where: str
) -> None:
    """Each parameter is 16-bit where init kept ``what`` for it (a ``MaskedNode`` elsewhere),
    and in the shape init saw: a parameter cast since (a checkpoint restored in float32) would
    leave it stale, silently, and one reshaped since fails in jnp's terms, without its path."""
    # (the paths are flattened only for an error: update runs this at every eager step)
    path = lambda i: jax.tree_util.keystr(jax.tree_util.tree_flatten_with_path(params)[0][i][0])
    for i, (leaf, held, is_narrow_now) in enumerate(zip(jax.tree.leaves(params), kept, narrow)):
        if isinstance(held, optax.MaskedNode) == is_narrow_now:
            was = "not 16-bit, so the state holds none" if is_narrow_now else "16-bit"
            raise ValueError(
                f"{where}.update: params{path(i)} is {leaf.dtype} but was "
                f"{was} when init made the state ({what}); make the state again with "
                "init(params) after changing a parameter's dtype, or cast the parameters back"
            )
        if is_narrow_now and np.shape(held) != np.shape(leaf):
            raise ValueError(
                f"{where}.update: params{path(i)} has shape "
                f"{tuple(np.shape(leaf))} but had {tuple(np.shape(held))} when init made the "
                f"state ({what}); make the state again with init(params) after changing a "
                "parameter's shape"
            )


def _widened_grads(
    grads: Any, treedef: Any, narrow: list[bool], where: str
) -> tuple[list[Any], Any]:
    flat = _flat_like(grads, treedef, "grads", where)
    return flat, treedef.unflatten(
        [g.astype(F32) if n and _floating(g) else g for g, n in zip(flat, narrow)]
    )


def _followed(master: jax.Array, param: jax.Array) -> jax.Array:
    """``master`` where ``param`` is still its rounding, else ``param`` widened: a parameter the
    caller changed since the last update (pretrained weights put in with ``TrainState.replace``,
    a projection onto a constraint) restarts its master copy from the caller's value, as plain
    optax starts every update from the ``params`` it is given. After this wrapper's update a
    parameter is within a 16-bit step of its copy (either rounding); only a jump no 16-bit
    update can reach (a factor over 2, see the module docstring) lands farther, and the copy
    then restarts from where it landed, as plain optax goes on."""
    wide = param.astype(F32)
    gap = jnp.abs(wide - master)
    return jnp.where(
        gap <= 2 * _spacing(jnp.maximum(jnp.abs(wide), jnp.abs(master)), param.dtype), master, wide
    )


def _spacing(magnitude: jax.Array, dtype: Any) -> jax.Array:
    """The gap between neighbouring ``dtype`` values at ``magnitude`` (float32, >= 0), from the
    format's exponent range and mantissa bits (``jnp.nextafter`` has no float8_e4m3fn), but at
    least float32's smallest normal: bfloat16's gap under 2**-119 (2**-133 at 0) is a float32
    subnormal, which XLA on the CPU flushes to 0, and ``compensated`` divides by it."""
    info = jnp.finfo(dtype)
    _, exponent = jnp.frexp(magnitude)  # magnitude = m * 2**exponent, m in [0.5, 1)
    binade = jnp.where(magnitude == 0, info.minexp, jnp.maximum(exponent - 1, info.minexp))
    smallest_normal = int(jnp.finfo(F32).minexp)
    return jnp.ldexp(jnp.ones_like(magnitude), jnp.maximum(binade - info.nmant, smallest_normal))


def _carried(compensation: jax.Array, param: jax.Array) -> jax.Array:
    """``compensated``'s stored error (in units of ``param``'s spacing) in float32."""
    return compensation.astype(F32) * _spacing(jnp.abs(param.astype(F32)), param.dtype)


def master_weights(
    tx: Any, *, rounding: str = "nearest", seed: int = 0
) -> optax.GradientTransformationExtraArgs:
    """Keep a float32 master copy of 16-bit parameters; the parameters follow it, rounded.

    For every parameter in a 16-bit (or float8) dtype (the copy the forward pass reads and
    FSDP gathers), the state holds a float32 master copy. ``update`` hands ``tx`` float32
    gradients and the master copy, adds ``tx``'s update to the master in float32 and returns
    updates such that ``optax.apply_updates(params, updates)`` is exactly the new master
    rounded to the parameter's dtype (``rounding``: ``"nearest"`` or ``"stochastic"``). float32
    and float64 parameters are passed through to ``tx`` as they are. Bytes: the parameter (2) +
    master (4) + ``tx``'s state (wrap ``tx`` in :func:`state_dtype` to store it in bfloat16).

    A parameter changed between updates (pretrained weights put in with
    ``TrainState.replace``, a projection after each step) restarts its master copy from the new
    value, as plain optax starts from the ``params`` it is given.

    ``seed`` picks the bits of ``rounding="stochastic"`` with the step counter in the state; a
    leaf's bits also depend on its pytree path, so wrappers with the same seed over one tree
    (one per ``optax.multi_transform`` group) draw their own. Give optimizers of separate trees
    with the same paths different seeds.

    Put ``optax.MultiSteps`` inside (``master_weights(optax.MultiSteps(tx, k))``): it then
    accumulates float32 gradients. Parameters with no 16-bit leaf raise ``ValueError``
    (nothing to do); ``update`` needs ``params``, and raises ``ValueError`` for a parameter
    whose dtype changed since ``init`` (its master copy would go stale).

    Example::

        tx = jamp.optim.master_weights(optax.adamw(1e-3))
        params = {"w": jnp.ones((4, 4), jnp.bfloat16)}
        opt_state = tx.init(params)     # opt_state.master["w"] is float32
    """
    where = "jamp.optim.master_weights"
    inner = _check_tx(tx, where)
    round_fn = _check_rounding(rounding, where)
    seed = _check_seed(seed, where)

    def init(params: Any) -> MasterWeightsState:
        leaves, treedef, narrow = _split(params, f"{where}(tx).init(params)")
        if not any(narrow):
            raise _no_narrow_error(where, params)
        master = [x.astype(F32) if n else optax.MaskedNode() for x, n in zip(leaves, narrow)]
        view = [m if n else x for m, x, n in zip(master, leaves, narrow)]
        return MasterWeightsState(
            step=jnp.zeros([], jnp.int32),
            master=treedef.unflatten(master),
            inner_state=_init_inner(inner, treedef.unflatten(view), where),
        )

    def update(
        grads: Any, state: MasterWeightsState, params: Any = None, **extra: Any
    ) -> tuple[Any, MasterWeightsState]:
        _need_params(params, f"{where}(tx)")
        _check_state(state, MasterWeightsState, f"{where}(tx)")
        leaves, treedef, narrow = _split(params, f"{where}(tx).update")
        master = _flat_like(state.master, treedef, "opt_state.master", f"{where}(tx)")
        _check_narrow_unchanged(params, master, narrow, "its float32 master copy", f"{where}(tx)")
        master = [_followed(m, x) if n else m for m, x, n in zip(master, leaves, narrow)]
        view = [m if n else x for m, x, n in zip(master, leaves, narrow)]
        flat_grads, wide_grads = _widened_grads(grads, treedef, narrow, f"{where}(tx)")
        inner_updates, inner_state = inner.update(
            wide_grads, state.inner_state, treedef.unflatten(view), **extra
        )
        flat_updates = treedef.flatten_up_to(inner_updates)
        new_master = [
            m + jnp.asarray(u).astype(F32) if n else m
            for m, u, n in zip(master, flat_updates, narrow)
        ]
        at = [i for i, n in enumerate(narrow) if n]
        rounded = round_fn(
            [new_master[i] for i in at],
            [leaves[i].dtype for i in at],
            _step_key(seed, _SALTS["master_weights"], state.step),
            _salts(params, at),
        )
        out = list(flat_updates)
        for i, r in zip(at, rounded):
            out[i] = _land(leaves[i], r, _update_dtype(flat_grads[i], leaves[i]))
        return treedef.unflatten(out), MasterWeightsState(
            step=state.step + 1, master=treedef.unflatten(new_master), inner_state=inner_state
        )

    return optax.GradientTransformationExtraArgs(init, update)


def stochastic_rounding(tx: Any, *, seed: int = 0) -> optax.GradientTransformationExtraArgs:
    """16-bit parameters land on the stochastically rounded ``param + update``; no master copy.

    ``update`` hands ``tx`` float32 gradients and the parameters widened to float32, then
    returns updates such that ``optax.apply_updates(params, updates)`` is
    ``jamp.stochastic_round(param + tx_update, param.dtype, key)``: an update smaller than half
    a bfloat16 step moves the parameter one step with the matching probability, so on average
    it is not lost. Bytes: the parameter (2) + ``tx``'s state (2 a moment under
    ``state_dtype``). float32/float64 parameters are passed through; parameters with no 16-bit
    leaf raise ``ValueError``. Put ``optax.MultiSteps`` inside, as for :func:`master_weights`.

    ``seed`` picks the random bits with the step counter in the state; a leaf's bits also
    depend on its pytree path, so wrappers with the same seed over one tree (one per
    ``optax.multi_transform`` group) draw their own. Give optimizers of separate trees with the
    same paths different seeds.

    Example::

        tx = jamp.optim.stochastic_rounding(jamp.optim.state_dtype(optax.adamw(1e-3)))
        params = {"w": jnp.ones((4, 4), jnp.bfloat16)}
        opt_state = tx.init(params)
    """
    where = "jamp.optim.stochastic_rounding"
    inner = _check_tx(tx, where)
    seed = _check_seed(seed, where)

    def widened(leaves: list[Any], treedef: Any, narrow: list[bool]) -> Any:
        return treedef.unflatten([x.astype(F32) if n else x for x, n in zip(leaves, narrow)])

    def init(params: Any) -> StochasticRoundingState:
        leaves, treedef, narrow = _split(params, f"{where}(tx).init(params)")
        if not any(narrow):
            raise _no_narrow_error(where, params)
        return StochasticRoundingState(
            step=jnp.zeros([], jnp.int32),
            inner_state=_init_inner(inner, widened(leaves, treedef, narrow), where),
        )

    def update(
        grads: Any, state: StochasticRoundingState, params: Any = None, **extra: Any
    ) -> tuple[Any, StochasticRoundingState]:
        _need_params(params, f"{where}(tx)")
        _check_state(state, StochasticRoundingState, f"{where}(tx)")
        leaves, treedef, narrow = _split(params, f"{where}(tx).update")
        flat_grads, wide_grads = _widened_grads(grads, treedef, narrow, f"{where}(tx)")
        wide_params = widened(leaves, treedef, narrow)
        try:
            inner_updates, inner_state = inner.update(
                wide_grads, state.inner_state, wide_params, **extra
            )
        except (ValueError, TypeError) as err:
            found = None
            if not _ours(err):
                found = _mismatch(inner, state.inner_state, wide_params, wide_grads, where)
            if found is None:
                raise
            raise found from err
        out = _flat_like(inner_updates, treedef, "tx's updates", f"{where}(tx)")
        if any(np.shape(u) != np.shape(x) for u, x in zip(out, leaves)):
            # a state of other shapes (a parameter reshaped since init) broadcasts against a
            # gradient where it can (4x4 moments, a 1x4 gradient): the update would reshape it
            raise _mismatch(
                inner, state.inner_state, wide_params, wide_grads, where
            ) or _reshaped_error(where, treedef.unflatten(out), params, "params")
        at = [i for i, n in enumerate(narrow) if n]
        rounded = stochastic_round_many(
            [leaves[i].astype(F32) + jnp.asarray(out[i]).astype(F32) for i in at],
            [leaves[i].dtype for i in at],
            _step_key(seed, _SALTS["stochastic_rounding"], state.step),
            _salts(params, at),
        )
        for i, r in zip(at, rounded):
            out[i] = _land(leaves[i], r, _update_dtype(flat_grads[i], leaves[i]))
        return treedef.unflatten(out), StochasticRoundingState(
            step=state.step + 1, inner_state=inner_state
        )

    return optax.GradientTransformationExtraArgs(init, update)


def compensated(tx: Any) -> optax.GradientTransformationExtraArgs:
    """Kahan-compensated updates of 16-bit parameters: a 16-bit buffer carries what rounding
    to nearest dropped into the next step.

    The state holds, for each 16-bit parameter, the part of the updates its rounding lost, in
    the parameter's dtype (2 bytes a parameter in bfloat16: the parameter and its compensation
    together carry about 16 significant bits, 22 in float16). It is stored in units of the
    parameter's spacing (the gap to its neighbouring value, a power of 2, so the scaling is
    exact): half a step of a float16 parameter under 0.125 is below float16's smallest normal,
    so an error stored as it is lost most of its bits (updates of 0.04 steps each moved a
    parameter of 1e-3 61% too far). The unit is at least float32's smallest normal (a bfloat16
    parameter's spacing under 2**-119, 2**-133 at 0, is a float32 subnormal, which XLA on the
    CPU flushes to 0). ``update`` hands ``tx`` float32 gradients and the compensated parameters
    (parameter + compensation, in float32), adds the compensation to ``tx``'s update, rounds to
    nearest, and keeps the new rounding error. Deterministic: no random bits. float32/float64
    parameters are passed through; parameters with no 16-bit leaf raise ``ValueError``, and so
    does ``update`` for a parameter whose dtype changed since ``init``.

    Example::

        tx = jamp.optim.compensated(jamp.optim.state_dtype(optax.adamw(1e-3)))
        params = {"w": jnp.ones((4, 4), jnp.bfloat16)}
        opt_state = tx.init(params)     # opt_state.compensation["w"] is bfloat16 zeros
    """
    where = "jamp.optim.compensated"
    inner = _check_tx(tx, where)

    def init(params: Any) -> CompensatedState:
        leaves, treedef, narrow = _split(params, f"{where}(tx).init(params)")
        if not any(narrow):
            raise _no_narrow_error(where, params)
        compensation = [
            jnp.zeros_like(x) if n else optax.MaskedNode() for x, n in zip(leaves, narrow)
        ]
        view = [x.astype(F32) if n else x for x, n in zip(leaves, narrow)]
        return CompensatedState(
            compensation=treedef.unflatten(compensation),
            inner_state=_init_inner(inner, treedef.unflatten(view), where),
        )

    def update(
        grads: Any, state: CompensatedState, params: Any = None, **extra: Any
    ) -> tuple[Any, CompensatedState]:
        _need_params(params, f"{where}(tx)")
        _check_state(state, CompensatedState, f"{where}(tx)")
        leaves, treedef, narrow = _split(params, f"{where}(tx).update")
        carried = _flat_like(state.compensation, treedef, "opt_state.compensation", f"{where}(tx)")
        _check_narrow_unchanged(params, carried, narrow, "its compensation", f"{where}(tx)")
        view = [
            x.astype(F32) + _carried(c, x) if n else x for x, c, n in zip(leaves, carried, narrow)
        ]
        flat_grads, wide_grads = _widened_grads(grads, treedef, narrow, f"{where}(tx)")
        inner_updates, inner_state = inner.update(
            wide_grads, state.inner_state, treedef.unflatten(view), **extra
        )
        out, new_carried = [], []
        for p, g, c, u, n in zip(
            leaves, flat_grads, carried, treedef.flatten_up_to(inner_updates), narrow
        ):
            if not n:
                out.append(u)
                new_carried.append(c)
                continue
            wide = p.astype(F32)
            step = jnp.asarray(u).astype(F32) + _carried(c, p)
            target = (wide + step).astype(p.dtype)
            lost = step - (target.astype(F32) - wide)
            new_carried.append(
                (lost / _spacing(jnp.abs(target.astype(F32)), p.dtype)).astype(c.dtype)
            )
            out.append(_land(p, target, _update_dtype(g, p)))
        return treedef.unflatten(out), CompensatedState(
            compensation=treedef.unflatten(new_carried), inner_state=inner_state
        )

    return optax.GradientTransformationExtraArgs(init, update)
