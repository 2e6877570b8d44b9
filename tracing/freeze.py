"""``freeze``: an inference program with the variables folded in, like ``torch.jit.freeze``.

The call is traced with the variables and the inputs as abstract inputs; then, in order:
the autocast rewrite (``policy=``, so weights are stored already cast), constant folding with the
variables known (``passes.fold_constants``), dead-code removal, BatchNorm folding into the conv or
dense before it (``passes.fold_batchnorm``) and dead-code removal again. The frozen program owns
its constants: none of them is one of the caller's arrays, so the variables can be freed.

Freezing is for inference: a call that updates variables (``mutable=[...]``, a BatchNorm in
training mode, an NNX module not in eval mode) raises ``ValueError`` instead of silently dropping
the update.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jamp import _compat as compat
from jamp.policy import Policy

from . import passes
from .passes.fold_constants import with_aval
from .program import Program, callable_name
from .signature import Signature, leaf_aval

_NO_RNGS = object()  # the frozen function has no rngs input


class FrozenFunction(Program):
    """The program of a frozen call: the inputs only, the variables folded in as constants.

    Call it with the example inputs' structure, shapes and dtypes. When ``rngs=`` was given to
    ``freeze`` it stays an input: pass ``rngs=`` again, or leave it out to reuse the freeze-time
    value. ``.jaxpr``, ``.graph``, ``.hlo`` and ``.export()`` are as for ``TracedFunction``; the
    exported program takes the rngs, when there are any, as its last positional argument.
    """

    def __init__(
        self, closed: Any, signature: Signature, out_tree: Any, name: str, rngs: Any = _NO_RNGS
    ) -> None:
        super().__init__(closed, signature, out_tree, name)
        self._rngs = rngs

    @property
    def takes_rngs(self) -> bool:
        return self._rngs is not _NO_RNGS

    def __call__(self, *inputs: Any, rngs: Any = _NO_RNGS) -> Any:
        if not self.takes_rngs:
            if rngs is not _NO_RNGS:
                raise TypeError(
                    f"{self.__name__} was frozen without rngs=, so it takes no rngs; "
                    "freeze again with rngs=... to make them an input"
                )
            return super().__call__(*inputs)
        return super().__call__(*inputs, self._rngs if rngs is _NO_RNGS else rngs)


@dataclasses.dataclass
class _Target:
    """What gets frozen: a name, the variables, and ``call(variables, inputs, kwargs)``."""

    name: str
    variables: Any
    call: Callable[[Any, tuple, dict], Any]


def _inference_hint(nnx: bool) -> str:
    how = (
        "call model.eval() before freezing (BatchNorm use_running_average=True, Dropout "
        "deterministic)"
        if nnx
        else "call it without mutable= and with BatchNorm(use_running_average=True) (e.g. "
        "train=False / deterministic=True)"
    )
    return f"Freeze the inference mode instead: {how}."


def _linen_target(module: Any, variables: Any, method: Any, kwargs: dict) -> _Target:
    name = type(module).__name__
    if variables is None:
        raise TypeError(
            f"freeze: {name} is a linen module, so its variables are needed: "
            f"tracing.freeze(model, variables, *example_inputs)"
        )
    mutable = kwargs.get("mutable", False)
    if mutable:
        collections = "every collection" if mutable is True else repr(mutable)
        raise ValueError(
            f"freeze: {name}.apply(..., mutable={mutable!r}) updates {collections}; "
            f"a frozen function cannot update variables. {_inference_hint(False)}"
        )
    from flax import errors as flax_errors

    def call(variables: Any, inputs: tuple, kwargs: dict) -> Any:
        try:
            return module.apply(variables, *inputs, method=method, **kwargs)
        except flax_errors.ModifyScopeVariableError as err:
            found = re.search(r'collection "([^"]+)"', str(err))
            collection = found.group(1) if found else "a collection"
            raise ValueError(
                f"freeze: {name} updates the collection '{collection}' ({str(err).split('.')[0]}); "
                f"a frozen function cannot update variables. {_inference_hint(False)}"
            ) from None

    return _Target(name, variables, call)


def _nnx_target(module: Any, variables: Any, method: Any, kwargs: dict) -> _Target:
    from flax import nnx

    name = type(module).__name__
    graphdef, state = nnx.split(module)
    if variables is not None:
        if not isinstance(variables, nnx.State):
            raise TypeError(
                f"freeze: {name} is an NNX module, whose own state is frozen: pass "
                "variables=None (tracing.freeze(model, None, *example_inputs)) or an "
                f"nnx.State, not a {type(variables).__name__}"
            )
        state = variables

    def call(state: Any, inputs: tuple, kwargs: dict) -> Any:
        before = _leaves_by_path(state)  # merge shares Variables with ``state``: snapshot now
        model = nnx.merge(graphdef, state)
        fn = (
            getattr(model, method)
            if isinstance(method, str)
            else functools.partial(method, model)
            if method is not None
            else model
        )
        out = fn(*inputs, **kwargs)
        _check_nnx_unchanged(name, before, nnx.split(model)[1])
        return out

    return _Target(name, state, call)


def _leaves_by_path(state: Any) -> dict[str, Any]:
    return {
        jax.tree_util.keystr(path): leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]
    }


def _check_nnx_unchanged(name: str, before: dict[str, Any], after: Any) -> None:
    """Raise ValueError naming the state a call updated (its leaves are new tracers)."""
    from flax import nnx

    changed = [
        (path, leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(after)[0]
        if before.get(jax.tree_util.keystr(path)) is not leaf
    ]
    if not changed:
        return
    kinds = {
        tuple(str(k) for k in path): type(var).__name__ for path, var in nnx.to_flat_state(after)
    }
    described = []
    for path, _ in changed:
        keys = tuple(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)
        keys = keys[:-1] if keys and keys[-1] == "value" else keys
        described.append(f"{kinds.get(keys, 'state')} {'.'.join(keys)}")
    raise ValueError(
        f"freeze: calling {name} updates its state ({', '.join(described)}); a frozen "
        f"function cannot update state. {_inference_hint(True)}"
    )


def _function_target(fn: Callable, variables: Any, method: Any, kwargs: dict) -> _Target:
    if method is not None:
        raise TypeError("freeze: method= is for Flax modules; bind it into the function instead")
    return _Target(
        callable_name(fn),
        variables,
        lambda variables, inputs, kwargs: fn(variables, *inputs, **kwargs),
    )


def _resolve(target: Any, variables: Any, method: Any, kwargs: dict) -> _Target:
    if "flax" in sys.modules:
        from flax import linen, nnx

        if isinstance(target, linen.Module):
            return _linen_target(target, variables, method, kwargs)
        if isinstance(target, nnx.Module):
            return _nnx_target(target, variables, method, kwargs)
    if not callable(target):
        raise TypeError(
            f"freeze: target must be a linen Module, an NNX Module or a function "
            f"fn(variables, *inputs), got {type(target).__name__}"
        )
    return _function_target(target, variables, method, kwargs)


def _check_rngs(rngs: Any) -> None:
    if "flax" in sys.modules:
        from flax import nnx

        if isinstance(rngs, nnx.Rngs):
            raise TypeError(
                "freeze: rngs= must be a PRNG key or a dict of keys (e.g. "
                "{'dropout': jax.random.key(0)}), not an nnx.Rngs object"
            )


def _variable_leaves(variables: Any) -> list[Any]:
    with_paths = jax.tree_util.tree_flatten_with_path(variables)[0]
    for path, leaf in with_paths:
        leaf_aval(leaf, "variables" + jax.tree_util.keystr(path))  # a clear error for non-arrays
    return [leaf for _, leaf in with_paths]


def _owned(closed: Any, caller_leaves: list[Any]) -> Any:
    """``closed`` with every constant that is one of the caller's arrays replaced by a copy."""
    caller = {id(leaf) for leaf in caller_leaves}
    jaxpr, consts = compat.open_and_consts(closed)
    if not any(id(c) in caller for c in consts):
        return closed
    owned = [
        with_aval(jnp.array(c, copy=True), compat.aval_of(c)) if id(c) in caller else c
        for c in consts
    ]
    return compat.trace_to_closed(
        lambda *args: compat.eval_jaxpr(jaxpr, owned, args), [v.aval for v in jaxpr.invars]
    )


def freeze(
    target: Any,
    variables: Any = None,
    *example_inputs: Any,
    policy: Policy | None = None,
    fold_batchnorm: bool = True,
    method: Any = None,
    **apply_kwargs: Any,
) -> FrozenFunction:
    """Freeze a Flax module or function for inference: the variables become constants.

    ``target`` is a linen ``Module`` (called as ``target.apply(variables, *inputs, method=method,
    **apply_kwargs)``), an NNX ``Module`` (its current state is frozen; ``variables`` is None) or
    a function ``fn(variables, *inputs, **apply_kwargs)``. Everything that depends only on the
    variables is computed now, random draws excepted; inference BatchNorms are folded into the
    conv/dense before them (``fold_batchnorm=False`` keeps them); with ``policy=`` the autocast
    rewrite runs first, so weights are stored already cast. ``rngs=`` stays an input of the
    frozen function. Raises ``ValueError`` when the call updates variables (training mode).

    Example::

        model = ResNet()                  # linen, BatchNorm(use_running_average=True)
        frozen = tracing.freeze(model, variables, x)
        frozen(x)                                         # same outputs, no variables needed
        del variables                                     # the frozen program owns its constants
        blob = frozen.export()                            # tracing.load(blob)(x)

        frozen16 = tracing.freeze(model, variables, x, policy=jamp.Policy())   # bf16 weights
        nnx_model.eval()                                                       # NNX
        nnx_frozen = tracing.freeze(nnx_model, None, x)
    """
    if policy is not None:  # a Policy, or a dtype meaning Policy(dtype), as autocast_transform
        from jamp.transform import resolve_policy

        policy = resolve_policy(policy, where="freeze")
    rngs = apply_kwargs.pop("rngs", _NO_RNGS)
    _check_rngs(rngs)
    resolved = _resolve(target, variables, method, apply_kwargs)
    name = f"freeze({resolved.name})"
    has_rngs = rngs is not _NO_RNGS
    signature = Signature.of(tuple(example_inputs) + ((rngs,) if has_rngs else ()))
    leaves = _variable_leaves(resolved.variables)
    var_tree = jax.tree.structure(resolved.variables)
    var_avals = [leaf_aval(leaf, "variables") for leaf in leaves]

    def flat_fn(*flat: Any) -> Any:
        frozen_vars = jax.tree.unflatten(var_tree, flat[: len(leaves)])
        inputs = jax.tree.unflatten(signature.in_tree, flat[len(leaves) :])
        kwargs = dict(apply_kwargs)
        if has_rngs:
            inputs, kwargs["rngs"] = inputs[:-1], inputs[-1]
        return resolved.call(frozen_vars, tuple(inputs), kwargs)

    closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*var_avals, *signature.avals)
    if policy is not None:
        from jamp.transform import autocast_jaxpr

        closed = autocast_jaxpr(closed, policy)
    closed = passes.dce(passes.fold_constants(closed, leaves))
    if fold_batchnorm:
        closed = passes.dce(passes.fold_batchnorm(closed))
    closed = _owned(closed, leaves)
    return FrozenFunction(
        closed, signature, jax.tree.structure(out_shape), name, rngs if has_rngs else _NO_RNGS
    )
