"""``freeze``: an inference program with the variables folded in, like ``torch.jit.freeze``.

The call is traced with the variables and the inputs as abstract inputs; then, in order:
the autocast rewrite (``policy=``, so weights are stored already cast), constant folding with the
variables known (``passes.fold_constants``), dead-code removal, BatchNorm folding into the conv or
dense before it (``passes.fold_batchnorm``), dead-code removal again and, with ``weights=``,
weight quantization (``passes.quantize_weights``). The frozen program owns
its constants: none of them is one of the caller's arrays, so the variables can be freed.
``export(polymorphic_shapes=...)`` runs the same pipeline again at symbolic input shapes, from
the caller's variables if they are still alive (they are held weakly, not kept).

Freezing is for inference: a call that updates variables (``mutable=[...]``, a BatchNorm in
training mode, an NNX module not in eval mode) raises ``ValueError`` instead of silently dropping
the update.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import re
import sys
import weakref
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jamp import _compat as compat
from jamp.policy import Policy

from . import passes
from .passes.fold_constants import with_aval
from .passes.quantize_weights import Kernel, Rules, kernel_report, kernels, weight_rules
from .program import CannotRetrace, Program, callable_name
from .shapes import is_symbolic
from .signature import Signature, keep_dict_order, leaf_aval, order_skeleton
from .trace import trace_errors_named

_NO_RNGS = object()  # the frozen function has no rngs input


class FrozenFunction(Program):
    """The program of a frozen call: the inputs only, the variables folded in as constants.

    Call it with the example inputs' structure, shapes and dtypes. When ``rngs=`` was given to
    ``freeze`` it stays an input: pass ``rngs=`` again, or leave it out to reuse the freeze-time
    value. ``.jaxpr``, ``.graph``, ``.hlo`` and ``.export()`` are as for ``TracedFunction``; the
    exported program takes the rngs, when there are any, as its last positional argument.
    ``.export(polymorphic_shapes="b, ...")`` freezes the call again at symbolic shapes, from the
    same variables, which must still be alive then (the frozen function does not keep them).
    """

    reshape_remedy = (
        "freeze it again at the new shapes, or export it with polymorphic_shapes= "
        "(frozen.export(polymorphic_shapes='b, ...')) and call tracing.load(blob), which takes "
        "any size for the symbolic dimensions"
    )
    remade_by = "freezing it again"
    # Each matmul/convolution kernel's scope, stored dtype and bytes (passes.Kernel).
    kernels: tuple[Kernel, ...] = ()

    def report(self) -> str:
        """Per kernel: scope, shape, stored dtype, bytes (scales included), scale granularity;
        and the totals against the same kernels in float32 and in bfloat16.

        Example::

            print(tracing.freeze(model, variables, x, weights=jnp.int8).report())
        """
        return kernel_report(self.__name__, self.kernels)

    def __init__(
        self,
        closed: Any,
        signature: Signature,
        out_tree: Any,
        name: str,
        rngs: Any = _NO_RNGS,
        retrace: Any = None,
        out_template: Any = None,
    ) -> None:
        super().__init__(closed, signature, out_tree, name, out_template, retrace)
        self._rngs = rngs

    @property
    def takes_rngs(self) -> bool:
        return self._rngs is not _NO_RNGS

    def __call__(self, *inputs: Any, rngs: Any = _NO_RNGS) -> Any:
        expected = len(self.signature.in_tree.children()) - int(self.takes_rngs)
        if len(inputs) == expected + 1:  # frozen(variables, x): called as the module is
            one = "the example input" if expected == 1 else f"the {expected} example inputs"
            xs = "x" if expected == 1 else ", ".join(f"x{i}" for i in range(expected))
            if self.takes_rngs and rngs is _NO_RNGS and _same_structure(inputs[-1], self._rngs):
                raise TypeError(  # frozen(x, rngs)
                    f"{self.__name__} takes {one} positionally and the rngs by keyword, got "
                    f"{len(inputs)} positional arguments: call it as frozen({xs}, rngs=rngs)"
                )
            raise TypeError(
                f"{self.__name__} takes {one} only, got {len(inputs)} positional arguments: "
                "the variables are folded into the frozen function as constants, so call it "
                f"without them, as frozen({xs}), not frozen(variables, {xs})"
            )
        if not self.takes_rngs:
            if rngs is not _NO_RNGS:
                raise TypeError(
                    f"{self.__name__} was frozen without rngs=, so it takes no rngs; "
                    "freeze again with rngs=... to make them an input"
                )
            return super().__call__(*inputs)
        return super().__call__(*inputs, self._rngs if rngs is _NO_RNGS else rngs)


def _same_structure(value: Any, rngs: Any) -> bool:
    """Whether ``value`` looks like the rngs: their structure, leaf dtypes and shapes."""
    expected: Any = jax.tree.structure(rngs)
    if expected != jax.tree.structure(value):
        return False
    return all(
        jnp.shape(a) == jnp.shape(b) and getattr(a, "dtype", None) == getattr(b, "dtype", None)
        for a, b in zip(jax.tree.leaves(value), jax.tree.leaves(rngs))
    )


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
        _check_same_paths(name, state, variables)
        state = variables

    def call_and_state(state: Any, inputs: tuple, kwargs: dict) -> tuple[Any, Any]:
        """(the call's outputs, the model's state after it)."""
        model = nnx.merge(graphdef, state)
        fn = (
            getattr(model, method)
            if isinstance(method, str)
            else functools.partial(method, model)
            if method is not None
            else model
        )
        return fn(*inputs, **kwargs), nnx.split(model)[1]

    def call(state: Any, inputs: tuple, kwargs: dict) -> Any:
        return _call_keeping_state(name, call_and_state, state, inputs, kwargs)

    return _Target(name, state, call)


def _check_same_paths(name: str, own: Any, variables: Any) -> None:
    """A clear error for the state of another model (Flax's merge says only that the number of
    leaves differs): name the first Variable one has and the other lacks."""
    from flax import nnx

    paths = lambda state: [".".join(map(str, path)) for path, _ in nnx.to_flat_state(state)]
    expected, got = paths(own), paths(variables)
    if expected == got:
        return
    missing = [p for p in expected if p not in set(got)]
    extra = [p for p in got if p not in set(expected)]
    differs = [
        *([f"{name} has {missing[0]}, which variables lacks"] if missing else []),
        *([f"variables has {extra[0]}, which {name} does not have"] if extra else []),
    ] or ["they hold the same Variables in another order"]
    raise ValueError(
        f"freeze: variables is not the state of {name}: {'; '.join(differs)}. Pass "
        f"variables=None to freeze the model's own state, or nnx.state(model) of a {name}"
    )


def _leaves_by_path(state: Any) -> dict[str, Any]:
    return {
        jax.tree_util.keystr(path): leaf
        for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]
    }


def _call_keeping_state(
    name: str, call_and_state: Callable, state: Any, inputs: tuple, kwargs: dict
) -> Any:
    """The outputs of ``call_and_state(state, inputs, kwargs)``; ValueError naming the state
    it updates.

    The call is traced as a jaxpr of its own, then inlined: NNX's transforms (``nnx.jit``,
    ``nnx.remat``, ``nnx.scan``) hand every Variable back as a new value even when it passes
    through unchanged, which only the jaxpr tells apart from an update."""
    from flax import nnx

    written: list[tuple[Any, bool]] = []  # (key path, traced) of each state leaf not as it was
    variable_types: dict[tuple[str, ...], type] = {}  # after the call, by path

    def run(state: Any, inputs: tuple) -> tuple[Any, list[Any]]:
        before = _leaves_by_path(state)  # merge shares Variables with ``state``: snapshot now
        out, after = call_and_state(state, inputs, kwargs)
        variable_types.update(
            (tuple(str(k) for k in path), type(var)) for path, var in nnx.to_flat_state(after)
        )
        new_values = []
        for path, leaf in jax.tree_util.tree_flatten_with_path(after)[0]:
            if before.get(jax.tree_util.keystr(path)) is not leaf:
                written.append((path, compat.is_tracer(leaf)))
                new_values.extend([leaf] if compat.is_tracer(leaf) else [])
        return out, new_values

    closed, (out_shape, _) = jax.make_jaxpr(run, return_shape=True)(state, inputs)
    jaxpr, consts = compat.open_and_consts(closed)
    input_at = {
        jax.tree_util.keystr(path): i
        for i, (path, _) in enumerate(jax.tree_util.tree_flatten_with_path(state)[0])
    }
    n_out = len(jax.tree.leaves(out_shape))
    sources = iter(_forwarded_inputs(jaxpr)[n_out:])  # of the new values, in ``written`` order
    changed = [
        path
        for path, traced in written
        if not traced  # not an array: an assignment of a Python value
        or not _is_input(next(sources), input_at.get(jax.tree_util.keystr(path)))
    ]
    if changed:
        _refuse_state_update(name, changed, variable_types)
    flat = compat.eval_jaxpr(jaxpr, consts, jax.tree.leaves((state, inputs)))
    return jax.tree.unflatten(jax.tree.structure(out_shape), flat[:n_out])


def _is_input(source: int | None, expected: int | None) -> bool:
    """Whether a new value is the input it was (a new Variable, sown, was none)."""
    return source is not None and source == expected


# Calls whose body takes the equation's operands one for one and gives its outputs.
_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call", "checkpoint", "remat", "remat2"})


def _forwarded_inputs(jaxpr: Any) -> list[int | None]:
    """For each output of ``jaxpr``, the index of the input it is, handed through unchanged
    (by calls, scan and while carries, a scan's stacked inputs, cond branches), or None."""
    source = {id(var): i for i, var in enumerate(jaxpr.invars)}
    for eqn in jaxpr.eqns:
        if not any(id(var) in source for var in eqn.invars):
            continue
        for out, operand in zip(eqn.outvars, _operands_handed_through(eqn)):
            if operand is not None and id(eqn.invars[operand]) in source:
                source[id(out)] = source[id(eqn.invars[operand])]
    return [source.get(id(var)) for var in jaxpr.outvars]


def _operands_handed_through(eqn: Any) -> list[int | None]:
    """For each output of ``eqn``, the index of the operand it is unchanged, or None."""
    params, name = eqn.params, eqn.primitive.name
    body = lambda key: _forwarded_inputs(compat.open_and_consts(params[key])[0])
    none: list[int | None] = [None] * len(eqn.outvars)
    if name in _CALLS:
        return body("jaxpr" if "jaxpr" in params else "call_jaxpr")
    if name == "scan":  # operands: consts, carry, stacked; outputs: carry, stacked
        n_consts, n_carry = compat.scan_counts(params, len(eqn.invars))
        return [
            k
            if k is not None and (k == n_consts + i if i < n_carry else k >= n_consts + n_carry)
            else None
            for i, k in enumerate(body("jaxpr"))
        ]
    if name == "while":  # operands: cond consts, body consts, carry; outputs: carry
        n_cond, n_body = params["cond_nconsts"], params["body_nconsts"]
        return [n_cond + k if k == n_body + i else None for i, k in enumerate(body("body_jaxpr"))]
    if name == "cond":  # operands: index, then each branch's inputs
        branches = [_forwarded_inputs(compat.open_and_consts(b)[0]) for b in params["branches"]]
        return [
            1 + ks[0] if ks[0] is not None and len(set(ks)) == 1 else None for ks in zip(*branches)
        ]
    return none


def _refuse_state_update(
    name: str, changed: list[Any], variable_types: dict[tuple[str, ...], type]
) -> None:
    """Raise ValueError naming the state a call updated (``changed``: key paths of the state's
    leaves; ``variable_types``: the type of each Variable after the call, by path)."""
    described: dict[str, None] = {}
    kinds = []
    for path in changed:
        keys = tuple(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)
        # The Variable holding the leaf: a sown tuple's leaf is features.value.0.
        owner = next(
            (keys[:n] for n in range(len(keys), 0, -1) if keys[:n] in variable_types), keys
        )
        kind = variable_types.get(owner)
        kinds.append(kind)
        described[f"{kind.__name__ if kind else 'state'} {'.'.join(owner)}"] = None
    raise ValueError(
        f"freeze: calling {name} updates its state ({', '.join(described)}); a frozen "
        f"function cannot update state. {_nnx_remedy(name, kinds)}"
    )


def _nnx_remedy(name: str, kinds: list[Any]) -> str:
    """What to do, for the kinds of Variable a call updated: model.eval() only helps where the
    training mode is what updates them (BatchNorm statistics, Dropout's random state)."""
    from flax import nnx

    is_kind = lambda base: [k is not None and issubclass(k, base) for k in kinds]
    remedies = []
    if any(is_kind(nnx.Intermediate)):
        remedies.append(
            f"{name} sows intermediates (self.sow(nnx.Intermediate, ...)), which a frozen "
            "function cannot keep: freeze a method that does not sow (method=...), or one that "
            "pops them: def popped(model, x): y = model(x); nnx.pop(model, nnx.Intermediate); "
            "return y, then tracing.freeze(model, None, x, method=popped)."
        )
    if any(is_kind((nnx.BatchStat, nnx.RngState))):
        remedies.append(_inference_hint(True))
    if not all(is_kind((nnx.Intermediate, nnx.BatchStat, nnx.RngState))):
        remedies.append(
            "Freeze a call that leaves the model's variables as they are (a method= that does "
            "not assign to them)."
        )
    return " ".join(remedies)


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


def _variable_leaves(variables: Any) -> tuple[list[str], list[Any]]:
    """(each leaf's path, as ``variables['w']``; the leaves)."""
    with_paths = jax.tree_util.tree_flatten_with_path(variables)[0]
    paths = ["variables" + jax.tree_util.keystr(path) for path, _ in with_paths]
    for where, (_, leaf) in zip(paths, with_paths):
        leaf_aval(leaf, where)  # a clear error for non-arrays
    return paths, [leaf for _, leaf in with_paths]


def _owned(closed: Any, caller_leaves: list[Any]) -> Any:
    """``closed`` with every constant that is one of the caller's arrays replaced by a copy."""
    caller = {id(leaf) for leaf in caller_leaves}
    numpy_leaves = [leaf for leaf in caller_leaves if isinstance(leaf, np.ndarray)]

    def is_callers(c: Any) -> bool:  # JAX may wrap a NumPy constant in a view of its memory
        return id(c) in caller or (
            isinstance(c, np.ndarray) and any(np.may_share_memory(c, leaf) for leaf in numpy_leaves)
        )

    jaxpr, consts = compat.open_and_consts(closed)
    if not any(is_callers(c) for c in consts):
        return closed
    owned = [
        with_aval(jnp.array(c, copy=True), compat.aval_of(c)) if is_callers(c) else c
        for c in consts
    ]
    return compat.trace_to_closed(
        lambda *args: compat.eval_jaxpr(jaxpr, owned, args), [v.aval for v in jaxpr.invars]
    )


@compat.api_boundary  # (the target's errors show its frames, as under jax.jit)
def freeze(
    target: Any,
    variables: Any = None,
    *example_inputs: Any,
    policy: Policy | None = None,
    fold_batchnorm: bool = True,
    method: Any = None,
    weights: Any = None,
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

    ``weights=`` stores the matmul and convolution kernels quantized, dequantized right before
    each product in the dtype it reads them in (the policy's compute dtype): ``jnp.int8``
    (a scale per output channel), ``jnp.int4`` (a scale per output channel and group of at most
    128 along the contraction; packed two a byte), ``jnp.float8_e4m3fn`` (a scale per output
    channel); ``(glob, dtype or None)`` rules over scope paths as ``Policy.rules`` (``None``
    keeps a scope as frozen), or a ``jamp.tune_weights`` result. Biases, norms, embeddings read
    by a gather and every other constant stay as they were; ``frozen.kernels`` lists each
    kernel's stored dtype and bytes, ``frozen.report()`` as a table (``passes/quantize_weights``).

    Example::

        model = ResNet()                  # linen, BatchNorm(use_running_average=True)
        frozen = tracing.freeze(model, variables, x)
        frozen(x)                             # same outputs, no variables needed
        # bfloat16 weights:
        frozen16 = tracing.freeze(model, variables, x, policy=jamp.Policy())
        # before del: a polymorphic export freezes again, reading the variables
        any_batch = frozen.export(polymorphic_shapes="b, ...")
        del variables                         # the frozen programs own their constants
        blob = frozen.export()                # tracing.load(blob)(x)

        nnx_model.eval()                                                       # NNX
        nnx_frozen = tracing.freeze(nnx_model, None, x)
    """
    if not isinstance(fold_batchnorm, (bool, np.bool_)):  # "no" would fold: it is truthy
        raise TypeError(
            f"freeze: fold_batchnorm must be True or False, got "
            f"{type(fold_batchnorm).__name__} {fold_batchnorm!r}"
        )
    if policy is not None:  # a Policy, or a dtype meaning Policy(dtype), as autocast_transform
        from jamp.transform import resolve_policy

        policy = resolve_policy(policy, where="freeze")
    rngs = apply_kwargs.pop("rngs", _NO_RNGS)
    _check_rngs(rngs)
    resolved = _resolve(target, variables, method, apply_kwargs)
    name = f"freeze({resolved.name})"
    has_rngs = rngs is not _NO_RNGS
    signature = Signature.of(tuple(example_inputs) + ((rngs,) if has_rngs else ()))
    if has_rngs:  # the last input, passed as rngs=
        signature = signature.with_last_input_named("rngs")
    paths, leaves = _variable_leaves(resolved.variables)
    freezer = _Freezer(  # not the target itself: it holds the variables
        resolved.call,
        name,
        jax.tree.structure(resolved.variables),
        order_skeleton(resolved.variables),
        order_skeleton(tuple(example_inputs)),
        apply_kwargs,
        has_rngs,
        policy,
        bool(fold_batchnorm),
        None if weights is None else weight_rules(weights, "freeze"),
    )
    closed, out_tree = freezer.freeze(leaves, signature)
    held = _HeldVariables(paths, leaves)  # weakly: the frozen program owns copies of what it needs

    def retrace(inputs: tuple) -> tuple[Any, Any]:  # for export(polymorphic_shapes=...)
        return freezer.freeze(held.get(name), Signature.of(inputs))

    frozen = FrozenFunction(
        closed,
        signature,
        out_tree,
        name,
        rngs if has_rngs else _NO_RNGS,
        retrace,
        freezer.out_template,
    )
    frozen.kernels = tuple(freezer.kernels)
    return frozen


# Freezing traces every example input: a flag such as ``train`` is static as a keyword.
_FREEZE_ERROR_HINT = (
    "Hint: every example input is traced, so a Python `if`, `int()` or `bool()` on one (a "
    "`train` flag, a count) needs a value the trace does not have. Pass such an argument as a "
    "keyword of freeze (freeze(model, variables, x, train=False)), which stays a Python value, "
    "or branch on data with lax.cond / jnp.where."
)
# Freezing again at symbolic shapes (export(polymorphic_shapes=...)): the call froze at the
# example shapes, so a flag cannot be the cause. (No "symbolic dimension" here: the export's own
# hint would replace this one.)
_SYMBOLIC_FREEZE_ERROR_HINT = (
    "Hint: the call froze at the example shapes, so what needs a concrete value here is a size "
    "made symbolic: a dimension that the model's parameters fix (a Conv or Dense layer's input "
    "features, checked against its kernel's shape) or that the code branches on cannot be "
    "symbolic. Keep it fixed: its number in polymorphic_shapes (e.g. 'b, h, w, 3'), or None "
    "for an input of fixed shape."
)


@dataclasses.dataclass
class _Freezer:
    """The freeze pipeline for one target, at any input signature (symbolic ones included)."""

    call: Callable[[Any, tuple, dict], Any]  # the target's
    name: str  # freeze(the target's name), for errors
    var_tree: Any
    # ``order_skeleton``s of the variables and the example inputs: the target sees their dicts
    # in the caller's order, as it would called directly (pytrees sort dict keys)
    var_order: Any
    in_order: Any
    apply_kwargs: dict
    has_rngs: bool
    policy: Policy | None
    fold_batchnorm: bool
    weights: Rules | None
    kernels: list[Kernel] = dataclasses.field(default_factory=list)  # of the last freeze
    out_template: Any = None  # ``order_skeleton`` of the target's outputs, at the last freeze

    def freeze(self, leaves: list[Any], signature: Signature) -> tuple[Any, Any]:
        """(closed jaxpr over the inputs, output tree) with ``leaves`` as the variables."""
        var_avals = [leaf_aval(leaf, "variables") for leaf in leaves]

        skeleton: list[Any] = []

        def flat_fn(*flat: Any) -> Any:
            frozen_vars = jax.tree.unflatten(self.var_tree, flat[: len(leaves)])
            inputs = jax.tree.unflatten(signature.in_tree, flat[len(leaves) :])
            kwargs = dict(self.apply_kwargs)
            if self.has_rngs:
                inputs, kwargs["rngs"] = inputs[:-1], inputs[-1]
            outputs = self.call(
                keep_dict_order(self.var_order, frozen_vars),
                keep_dict_order(self.in_order, tuple(inputs)),
                kwargs,
            )
            skeleton.append(order_skeleton(outputs))
            return outputs

        symbolic = any(is_symbolic(aval.shape) for aval in signature.avals)
        hint = _SYMBOLIC_FREEZE_ERROR_HINT if symbolic else _FREEZE_ERROR_HINT
        with trace_errors_named(self.name, hint):
            closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(
                *var_avals, *signature.avals
            )
        if self.policy is not None:
            from jamp.transform import autocast_jaxpr

            closed = autocast_jaxpr(closed, self.policy)
        self.out_template = skeleton[0]
        closed = passes.dce(passes.fold_constants(closed, leaves))
        if self.fold_batchnorm:
            closed = passes.dce(passes.fold_batchnorm(closed))
        self.kernels = []
        if self.weights is not None:  # last: nothing may fold the dequantization back
            closed = passes.quantize_weights(closed, self.weights, "freeze", self.kernels)
        else:
            self.kernels = kernels(closed)
        return _owned(closed, leaves), jax.tree.structure(out_shape)


class _HeldVariables:
    """The caller's variable arrays, held weakly (the frozen program must not keep them alive:
    ``del variables`` frees them); Python numbers, which cannot be, are held as they are.

    NumPy arrays can change in place after the freeze (a training loop writing into them), so a
    digest of their bytes is kept to refuse a re-freeze from weights the frozen function does
    not hold; jax arrays are immutable, but can be deleted (donated)."""

    def __init__(self, paths: list[str], leaves: list[Any]) -> None:
        self._paths = paths
        self._refs = [_weak(leaf) for leaf in leaves]
        self._digests = [_digest(leaf) for leaf in leaves]

    def get(self, name: str) -> list[Any]:
        leaves = [ref() for ref in self._refs]
        if any(leaf is None or _is_deleted(leaf) for leaf in leaves):
            raise CannotRetrace(
                f"{name}.export(polymorphic_shapes=...): {name} was frozen from variables that "
                "have since been freed (del variables, a deleted or donated jax array, "
                "or an NNX module updated or deleted), and exporting with polymorphic_shapes "
                "freezes the call again from them: export before freeing them, or freeze again "
                "and export that"
            )
        for where, leaf, digest in zip(self._paths, leaves, self._digests):
            if digest is not None and _digest(leaf) != digest:
                raise CannotRetrace(
                    f"{name}.export(polymorphic_shapes=...): {where} has changed since the "
                    "freeze (written in place), and exporting with polymorphic_shapes freezes "
                    "the call again from the variables: export before changing it, or freeze "
                    "again"
                )
        return leaves


def _digest(leaf: Any) -> bytes | None:
    """A digest of a NumPy array's bytes (the only mutable kind of leaf); None for others."""
    if not isinstance(leaf, np.ndarray):
        return None
    as_bytes: Any = np.ascontiguousarray(leaf).reshape(-1).view(np.uint8)  # bfloat16: no buffer
    return hashlib.blake2b(as_bytes, digest_size=16).digest()


def _is_deleted(leaf: Any) -> bool:
    is_deleted = getattr(leaf, "is_deleted", None)
    return bool(is_deleted()) if callable(is_deleted) else False


def _weak(leaf: Any) -> Callable[[], Any]:
    try:
        return weakref.ref(leaf)
    except TypeError:  # a Python or NumPy scalar
        return lambda: leaf
