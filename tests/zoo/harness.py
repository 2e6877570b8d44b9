"""One harness for every zoo model: run a model under a policy, then judge it check by check.

A model adapter (``models.py``) gives a :class:`ZooCase`; :class:`ZooRun` runs it under one jamp
policy, lazily and at most once per stage (a stage that raised re-raises in every check that needs
it), and each function in :data:`CHECKS` asserts one property of the run against float32.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import os
import time
import warnings
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jamp
import jamp.interpreter
import tracing
from tests.jaxpr_utils import dtype_signatures

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class ZooCase:
    """A model as its user calls it.

    forward: ``forward(*args)``, the user's function (outputs include updated state, if any).
    args: the caller's example arguments (NNX modules, Equinox modules, pytrees). They are
      copied before every call, so no call sees another's mutations.
    loss_fn: ``loss_fn(params, *rest)`` -> outputs to differentiate; ``grad_args`` is
      ``(params, *rest)`` and the gradient is taken with respect to ``params`` only.
    depth: the number of 16-bit roundings that compound along the longest path from input to
      output (see :func:`relative_error_bound`).
    jit: how the library's users compile ``forward`` (``eqx.filter_jit`` for Equinox modules,
      ``nnx.jit`` for NNX modules); ``grad`` likewise (``nnx.grad`` differentiates an NNX
      module's ``nnx.Param`` state), and ``params_of(grad_args[0])`` is what it differentiates.
    """
    forward: Callable[..., Any]
    args: tuple
    loss_fn: Callable[..., Any]
    grad_args: tuple
    depth: int
    jit: Callable[[Callable], Callable] = jax.jit
    grad: Callable[[Callable], Callable] = jax.grad
    params_of: Callable[[Any], Any] = lambda params: params
    # Smallest accepted gradient cosine to float32 per compute dtype name (default 0.99); a
    # model that lowers it says next to the value why its float32 gradient cannot do better.
    grad_cosine: dict = dataclasses.field(default_factory=dict)
    # The model's inference call, for the freeze/export check (``ZooModel.freezes``).
    inference: Optional["FreezeCase"] = None


@dataclasses.dataclass(frozen=True)
class FreezeCase:
    """The model's inference call as ``tracing.freeze`` takes it:
    ``tracing.freeze(target, variables, *inputs, **kwargs)``. ``batch_axes`` gives each input's
    batch axis (None for an input without one, e.g. a PRNG key)."""
    target: Any
    variables: Any
    inputs: tuple
    batch_axes: tuple
    kwargs: dict = dataclasses.field(default_factory=dict)

    def polymorphic_shapes(self) -> tuple:
        """``polymorphic_shapes`` with each batch axis symbolic: "b, ..." or "_, b, ..."."""
        return tuple(None if axis is None else ", ".join(["_"] * axis + ["b", "..."])
                     for axis in self.batch_axes)

    def at_batch(self, extra: int) -> tuple:
        """The inputs with ``extra`` more examples along their batch axes (repeated)."""
        def grow(x, axis):
            moved = jnp.moveaxis(x, axis, 0)
            return jnp.moveaxis(jnp.resize(moved, (moved.shape[0] + extra,) + moved.shape[1:]),
                                0, axis)
        return tuple(x if axis is None else jax.tree.map(lambda a: grow(a, axis), x)
                     for x, axis in zip(self.inputs, self.batch_axes))


@dataclasses.dataclass(frozen=True)
class ZooModel:
    name: str
    build: Callable[[], ZooCase]
    slow: bool = False
    # The model feeds a value the region computes (16-bit) into a loop as its initial carry:
    # JAX refuses that before jamp sees the loop (docs/reference/dtypes.md, "Regions").
    region_carry_limit: bool = False
    # Indices into ``ZooCase.grad_args`` of the arguments batched on axis 0 (all their arrays):
    # the trace check (``check_trace_other_batch``) checks ``loss_fn`` at the example batch and
    # at a larger one. Empty: not trace-checked (arguments that are not arrays, no batch axis).
    batch_args: tuple[int, ...] = ()
    # The model's ZooCase has an ``inference`` call to freeze: checked by ``freeze_batch``.
    freezes: bool = False


POLICIES = {
    "bf16": jamp.Policy(jnp.bfloat16),
    "fp16": jamp.Policy(jnp.float16),
    "cast_inputs": jamp.Policy(cast_inputs=True),
}


def relative_error_bound(policy: jamp.Policy, depth: int) -> float:
    """Largest acceptable relative L2 error of a 16-bit run against float32.

    Each 16-bit rounding (an operand cast to the compute dtype, a matmul output rounded to it)
    has relative error at most u = eps/2 (bfloat16 2**-8 ~ 3.9e-3, float16 2**-11 ~ 4.9e-4).
    ``depth`` counts the rounding levels along the longest path (2 per layer: operand cast and
    output rounding). We allow 4 u per level, added linearly (the worst case, errors aligned;
    random errors would add as sqrt(depth)), with 4x headroom for layers whose gain exceeds 1
    (ReLU networks at init, recurrent steps). float16's bound is floored at 4 * 2**-9 (~7.8e-3):
    BatchNorm statistics over 2-6 examples and 16-bit inputs of a few hundred features make
    relative differences of that order in any 16-bit vs float32 comparison. A result above the
    bound is not rounding noise but a wrong dtype somewhere (a variance, a reduction or a
    softmax in 16 bits) or a NaN. Known looseness: for the deepest models (depth 36) the bf16
    bound reaches ~0.56; the table script prints measured errors to tighten it per model.
    """
    unit = float(jnp.finfo(policy.compute_dtype).eps) / 2
    return max(4 * unit * depth, 4 * 2.0**-9 if policy.compute_dtype == jnp.float16 else 0.0)


# ---------------------------------------------------------------------------------------------
# Trees: copying the caller's arguments, snapshotting them, comparing outputs.

def fresh_copy(tree: Any) -> Any:
    """A deep copy of the caller's arguments: NNX graphs cloned, arrays copied."""
    def copy(x):
        if isinstance(x, nnx.Module):
            return nnx.clone(x)
        if isinstance(x, jax.Array):
            return jnp.array(x, copy=True) if not jnp.issubdtype(x.dtype, jax.dtypes.prng_key) \
                else jax.random.wrap_key_data(jnp.array(jax.random.key_data(x), copy=True),
                                              impl=jax.random.key_impl(x))
        if isinstance(x, np.ndarray):
            return x.copy()
        return x
    return jax.tree.map(copy, tree, is_leaf=lambda x: isinstance(x, nnx.Module))


def snapshot(tree: Any) -> dict[str, tuple[str, np.ndarray]]:
    """path -> (dtype name, host value) for every array the caller owns, NNX state included."""
    def expand(x):
        return nnx.state(x) if isinstance(x, nnx.Module) else x
    expanded = jax.tree.map(expand, tree, is_leaf=lambda x: isinstance(x, nnx.Module))
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(expanded)[0]:
        if isinstance(leaf, (jax.Array, np.ndarray)):
            if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
                out[jax.tree_util.keystr(path)] = (str(leaf.dtype), np.asarray(jax.random.key_data(leaf)))
            else:
                out[jax.tree_util.keystr(path)] = (str(leaf.dtype), np.asarray(leaf))
    return out


def array_leaves(tree: Any) -> list[tuple[str, Any]]:
    return [(jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
            if isinstance(x, (jax.Array, np.ndarray))]


def is_float(x: Any) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating)


def relative_l2(x: Any, ref: Any) -> float:
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    denom = np.linalg.norm(ref)
    return float(np.linalg.norm(x - ref) / denom) if denom else float(np.linalg.norm(x))


def cosine(a: list[Any], b: list[Any]) -> float:
    a = np.concatenate([np.asarray(x, np.float64).ravel() for x in a])
    b = np.concatenate([np.asarray(x, np.float64).ravel() for x in b])
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def projection_loss(loss_fn: Callable[..., Any], out_shapes: Any) -> Callable[..., Any]:
    """loss(params, *rest): a fixed random projection of every floating output, in float32.

    A random projection gives every output element a cotangent of its own (a sum or a mean of
    squares would weight them by sign or size); the cast to float32 is the user's, as in a
    mixed-precision loss.
    """
    leaves = [s for s in jax.tree.leaves(out_shapes) if jnp.issubdtype(s.dtype, jnp.floating)]
    keys = jax.random.split(jax.random.key(1234), max(len(leaves), 1))
    weights = [np.asarray(jax.random.normal(k, s.shape, F32)) for k, s in zip(keys, leaves)]

    def loss(params, *rest):
        outs = [o for o in jax.tree.leaves(loss_fn(params, *rest))
                if jnp.issubdtype(o.dtype, jnp.floating)]
        return sum(jnp.mean(o.astype(F32) * w) for o, w in zip(outs, weights))
    return loss


# ---------------------------------------------------------------------------------------------
# A run: one model under one policy.

class StageFailed(AssertionError):
    pass


def stage(method):
    """A lazily computed run stage; its exception (or result) is kept and re-raised on reuse."""
    name = method.__name__

    @functools.wraps(method)
    def wrapper(self):
        if name not in self._stages:
            start = time.perf_counter()
            try:
                self._stages[name] = (True, method(self))
            except Exception as e:  # recorded for every check that needs this stage
                self._stages[name] = (False, e)
            self.seconds[name] = time.perf_counter() - start
        ok, value = self._stages[name]
        if not ok:
            notes = "".join("\n" + n for n in getattr(value, "__notes__", ()))
            raise StageFailed(f"{self.label}: stage {name!r} raised "
                              f"{type(value).__name__}: {value}{notes}") from value
        return value
    return property(wrapper)


class Float32Run:
    """A model's float32 results, computed once per process and shared by every policy."""

    def __init__(self, model: ZooModel):
        self.model = model
        self.label = f"{model.name}[float32]"
        self.case = model.build()
        self._stages: dict[str, tuple[bool, Any]] = {}
        self.seconds: dict[str, float] = {}

    @stage
    def reference(self):
        """The float32 model, compiled as its users compile it (NNX state updates included):
        (outputs, warnings it emits, (arguments before, after))."""
        args = fresh_copy(self.case.args)
        before = snapshot(args)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = jax.block_until_ready(self.case.jit(self.case.forward)(*args))
        return out, [f"{w.category.__name__}: {w.message}" for w in caught], (before, snapshot(args))

    @stage
    def loss(self):
        shapes = jax.eval_shape(self.case.loss_fn, *self.case.grad_args)
        return projection_loss(self.case.loss_fn, shapes)

    @stage
    def reference_grads(self):
        return self.case.jit(self.case.grad(self.loss))(*fresh_copy(self.case.grad_args))

    @stage
    def trace_check(self):
        """The warnings of ``tracing.check_trace`` of the float32 ``loss_fn`` at two batches."""
        return check_trace_at_two_batches(self.case.loss_fn, self.case, self.model.batch_args)


def larger_batch(args: tuple, batch_args: tuple[int, ...]) -> tuple:
    """``args`` with the arrays of the ``batch_args`` arguments 2 examples longer (repeated)."""
    grow = lambda x: jnp.resize(x, (x.shape[0] + 2,) + x.shape[1:])
    return tuple(jax.tree.map(grow, a) if i in batch_args else a for i, a in enumerate(args))


def check_trace_at_two_batches(fn: Callable, case: ZooCase, batch_args: tuple[int, ...]):
    """Run ``tracing.check_trace(fn, grad_args, check_inputs=[grad_args at a larger batch])``;
    its ``TracingCheckError`` propagates, its warnings (``TracerWarning``) are returned."""
    args = fresh_copy(case.grad_args)
    jamp.interpreter._warned.clear()  # jamp warns once per process; every run must see it
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tracing.check_trace(fn, args, check_inputs=[larger_batch(args, batch_args)])
    return [f"{w.category.__name__}: {w.message}" for w in caught]


_FLOAT32_RUNS: dict[str, Float32Run] = {}


class ZooRun:
    def __init__(self, model: ZooModel, policy_name: str):
        self.model, self.policy_name = model, policy_name
        self.policy = POLICIES[policy_name]
        self.label = f"{model.name}[{policy_name}]"
        self._stages: dict[str, tuple[bool, Any]] = {}
        self.seconds: dict[str, float] = {}       # stage -> wall time (for the zoo's budget)
        self.relative_errors: dict[str, float] = {}  # output path -> measured error (rel_error)
        self.warnings: dict[str, list[str]] = {}   # stage -> jamp-caused warning messages
        self.mutations: dict[str, tuple[dict, dict]] = {}  # stage -> (before, after) snapshots

    @functools.cached_property
    def shared(self) -> "Float32Run":
        if self.model.name not in _FLOAT32_RUNS:
            _FLOAT32_RUNS[self.model.name] = Float32Run(self.model)
        return _FLOAT32_RUNS[self.model.name]

    @property
    def case(self) -> ZooCase:
        return self.shared.case

    # -- helpers ------------------------------------------------------------------------------
    def _call(self, stage_name: str, fn: Callable, args: tuple, reference_warnings=()) -> Any:
        """Call ``fn`` on a fresh copy of ``args``, recording warnings and what it did to them."""
        args = fresh_copy(args)
        before = snapshot(args)
        jamp.interpreter._warned.clear()  # jamp warns once per process; every run must see it
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = jax.block_until_ready(fn(*args))
        reference = set(reference_warnings)
        self.warnings[stage_name] = [f"{w.category.__name__}: {w.message}" for w in caught
                                     if f"{w.category.__name__}: {w.message}" not in reference]
        self.mutations[stage_name] = (before, snapshot(args))
        return out

    @functools.cached_property
    def transformed(self) -> Callable:
        return jamp.autocast_transform(self.case.forward, self.policy)

    # -- float32 references (shared by the model's runs under every policy) --------------------
    @property
    def reference(self):
        return self.shared.reference

    @property
    def loss(self):
        return self.shared.loss

    @property
    def reference_grads(self):
        return self.shared.reference_grads

    # -- jamp stages ----------------------------------------------------------------------------
    @stage
    def eager(self):
        return self._call("eager", self.transformed, self.case.args, self.reference[1])

    @stage
    def jitted(self):
        """Compiled as the library's users compile it, under ``jax_enable_checks`` (JAX then
        type-checks every jaxpr it builds, jamp's rewritten program included)."""
        with jax.enable_checks(True):
            return self._call("jit", self.case.jit(self.transformed), self.case.args,
                              self.reference[1])

    @stage
    def grads_outer(self):
        """jax.grad(autocast_transform(loss)), the README's recommended order, under
        ``jax_enable_checks``."""
        fn = self.case.jit(self.case.grad(jamp.autocast_transform(self.loss, self.policy)))
        with jax.enable_checks(True):
            return self._call("grad(autocast(f))", fn, self.case.grad_args)

    @stage
    def grads_inner(self):
        """autocast_transform(jax.grad(loss)), with the README's advice for this order:
        ``output_dtype=float32`` so gradients come back in float32, not the matmul dtype."""
        fn = self.case.jit(jamp.autocast_transform(self.case.grad(self.loss),
                                             self.policy.replace(output_dtype=F32)))
        return self._call("autocast(grad(f))", fn, self.case.grad_args)

    def _grads_with_region(self, around_grad: bool):
        """Gradients of the loss with ``jamp.autocast(policy)`` around the ``jax.grad`` call
        (``around_grad``) or inside the differentiated loss, both in the user's jit."""
        grad, loss, policy = self.case.grad, self.loss, self.policy

        def region_loss(*args):
            with jamp.autocast(policy):
                return loss(*args)

        def grad_in_region(*args):
            with jamp.autocast(policy):
                return grad(loss)(*args)

        fn = grad_in_region if around_grad else grad(region_loss)
        name = "grad inside a region" if around_grad else "grad of a region"
        return self._call(name, self.case.jit(fn), self.case.grad_args)

    @stage
    def grads_in_region(self):
        return self._grads_with_region(around_grad=True)

    @stage
    def grads_of_region(self):
        return self._grads_with_region(around_grad=False)

    @functools.cached_property
    def region_function(self) -> Callable:
        """``forward`` with ``with jamp.autocast(policy):`` around its body, no wrapper."""
        forward, policy = self.case.forward, self.policy

        def in_region(*args):
            with jamp.autocast(policy):
                return forward(*args)

        return in_region

    @stage
    def region(self):
        """The region form inside the user's jit."""
        return self._call("region", self.case.jit(self.region_function), self.case.args,
                          self.reference[1])

    @stage
    def report(self):
        args = fresh_copy(self.case.args)
        return jamp.explain(self.case.forward, *args, policy=self.policy)

    @stage
    def frozen_export(self):
        """The inference call frozen under the policy, exported with a symbolic batch and
        loaded: [(loaded outputs, outputs of the call frozen at that batch)] at the example
        batch and at one 2 larger."""
        spec = self.case.inference
        assert spec is not None, f"{self.model.name} freezes but its ZooCase has no inference"

        def freeze(inputs):
            return tracing.freeze(spec.target, spec.variables, *inputs, policy=self.policy,
                                  **spec.kwargs)
        blob = freeze(spec.inputs).export(polymorphic_shapes=spec.polymorphic_shapes())
        loaded = tracing.load(blob)
        return [(loaded(*inputs), freeze(inputs)(*inputs))
                for inputs in (spec.inputs, spec.at_batch(2))]

    @stage
    def trace_check(self):
        """The warnings of ``tracing.check_trace`` of the autocast ``loss_fn`` at two batches."""
        fn = jamp.autocast_transform(self.case.loss_fn, self.policy)
        return check_trace_at_two_batches(fn, self.case, self.model.batch_args)


# ---------------------------------------------------------------------------------------------
# The checks. Each takes a ZooRun and raises AssertionError with what went wrong.

def check_runs_clean(run: ZooRun) -> None:
    """No exception and no warning (beyond those the float32 model itself emits) in any call."""
    problems = []
    for name in ("eager", "jitted", "grads_outer", "grads_inner", "report"):
        try:
            getattr(run, name)
        except StageFailed as e:
            problems.append(str(e))
    problems += [f"{stage}: {msg}" for stage, msgs in run.warnings.items() for msg in msgs]
    assert not problems, "\n".join(problems)


def check_jit_equals_eager(run: ZooRun) -> None:
    """``jax.jit(f)`` and eager ``f`` agree to within 2 units in the last place of the output's
    dtype at the output's scale: the same program, at most rounded differently where XLA fuses
    differently (eager calls compile the same rewritten program)."""
    eager, jitted = array_leaves(run.eager), array_leaves(run.jitted)
    assert [p for p, _ in eager] == [p for p, _ in jitted]
    bad = []
    for (path, e), (_, j) in zip(eager, jitted):
        if e.dtype != j.dtype:
            bad.append(f"{path}: dtype eager {e.dtype} vs jit {j.dtype}")
        elif is_float(e):
            scale = float(np.max(np.abs(np.asarray(j, np.float64)), initial=0.0))
            tol = 2 * float(jnp.finfo(e.dtype).eps) * scale
            err = float(np.max(np.abs(np.asarray(e, np.float64) - np.asarray(j, np.float64)),
                               initial=0.0))
            if not err <= tol:
                bad.append(f"{path}: max |eager - jit| = {err:.3g} > {tol:.3g} ({e.dtype})")
        elif not np.array_equal(snapshot_value(e), snapshot_value(j)):
            bad.append(f"{path}: {e.dtype} values differ")
    assert not bad, "\n".join(bad)


def snapshot_value(x):
    return np.asarray(jax.random.key_data(x)) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) \
        else np.asarray(x)


def check_finite(run: ZooRun) -> None:
    bad = [f"{p}: {int(np.sum(~np.isfinite(np.asarray(x, np.float32))))} non-finite of {x.size}"
           for p, x in array_leaves(run.eager) if is_float(x) and not np.all(np.isfinite(np.asarray(x, np.float32)))]
    assert not bad, "\n".join(bad)


def check_relative_error(run: ZooRun) -> None:
    """Every floating output within :func:`relative_error_bound` of float32 (relative L2);
    integer outputs (counters, indices) equal."""
    bound = relative_error_bound(run.policy, run.case.depth)
    ref, out = array_leaves(run.reference[0]), array_leaves(run.eager)
    assert [p for p, _ in ref] == [p for p, _ in out]
    bad = []
    for (path, r), (_, o) in zip(ref, out):
        if is_float(r):
            err = relative_l2(o, r)
            run.relative_errors[path] = err
            if not err <= bound:
                bad.append(f"{path}: relative L2 error {err:.3g} > bound {bound:.3g} "
                           f"(output {o.dtype})")
        elif not np.array_equal(snapshot_value(o), snapshot_value(r)):
            bad.append(f"{path}: {r.dtype} output differs from float32 run")
    assert not bad, "\n".join(bad)


def _grad_stages(run: ZooRun):
    return {"grad(autocast(f))": run.grads_outer, "autocast(grad(f))": run.grads_inner}


def check_grads_finite(run: ZooRun) -> None:
    bad = [f"{order} {p}: non-finite" for order, g in _grad_stages(run).items()
           for p, x in array_leaves(g) if not np.all(np.isfinite(np.asarray(x, np.float32)))]
    assert not bad, "\n".join(bad)


def check_grads_dtype(run: ZooRun) -> None:
    params = array_leaves(run.case.params_of(run.case.grad_args[0]))
    bad = []
    for order, grads in _grad_stages(run).items():
        g = array_leaves(grads)
        assert [p for p, _ in g] == [p for p, _ in params], f"{order}: gradient tree differs"
        bad += [f"{order} {p}: gradient {x.dtype}, parameter {w.dtype}"
                for (p, x), (_, w) in zip(g, params) if x.dtype != w.dtype]
    assert not bad, "\n".join(bad)


def check_grads_cosine(run: ZooRun) -> None:
    """Cosine similarity of all parameters' gradients (one vector) to float32's >= 0.99 (or the
    model's justified ``grad_cosine`` for the compute dtype)."""
    ref = [x for _, x in array_leaves(run.reference_grads)]
    bound = run.case.grad_cosine.get(np.dtype(run.policy.compute_dtype).name, 0.99)
    bad = []
    for order, grads in _grad_stages(run).items():
        c = cosine([x for _, x in array_leaves(grads)], ref)
        if not c >= bound:
            bad.append(f"{order}: cosine to float32 gradients {c:.4f} < {bound}")
    assert not bad, "\n".join(bad)


def check_enable_checks(run: ZooRun) -> None:
    """The compiled forward and grad(autocast(f)) were traced under ``jax_enable_checks`` (see
    those stages) and ran without error."""
    run.jitted, run.grads_outer


def check_inputs_unchanged(run: ZooRun) -> None:
    """No jamp call changes the dtype of anything the caller passed, nor a value the float32
    call leaves alone; state the model itself updates (NNX BatchNorm statistics, RNG counters)
    changes as the float32 call changes it (same dtype, within the relative-error bound)."""
    _, _, (ref_before, ref_after) = run.reference
    for name in ("eager", "jitted", "grads_outer", "grads_inner"):
        getattr(run, name)
    bound = relative_error_bound(run.policy, run.case.depth)
    bad = []
    for stage_name, (before, after) in run.mutations.items():
        # what the float32 forward call updates (NNX state); pure pytrees: nothing
        ref_changes = {p for p in ref_before if p in ref_after
                       and not np.array_equal(ref_before[p][1], ref_after[p][1])}
        for path, (dtype, value) in before.items():
            if path not in after:
                bad.append(f"{stage_name}: {path} disappeared")
                continue
            new_dtype, new_value = after[path]
            if new_dtype != dtype:
                bad.append(f"{stage_name}: {path} dtype {dtype} -> {new_dtype}")
            elif path in ref_changes and stage_name in ("eager", "jit"):
                expected = ref_after[path][1]
                if np.issubdtype(expected.dtype, np.floating):
                    if not relative_l2(new_value, expected) <= bound:
                        bad.append(f"{stage_name}: {path} updated to {new_value!r:.60}, float32 "
                                   f"run updates it to {expected!r:.60}")
                elif not np.array_equal(new_value, expected):
                    bad.append(f"{stage_name}: {path} updated differently from the float32 run")
            elif path not in ref_changes and not np.array_equal(new_value, value):
                bad.append(f"{stage_name}: {path} value changed (the float32 call keeps it)")
    assert not bad, "\n".join(bad)


def check_region_equals_transform(run: ZooRun) -> None:
    """The region form (``with jamp.autocast(policy):`` around the call, inside the user's jit)
    makes the decisions ``jit(autocast_transform(f, policy))`` makes: the same operand and result
    dtypes for every matmul/conv and fp32-table equation of the two programs, and the same outputs
    (values within one unit in the last place of the compute dtype at the output's scale: the two
    programs differ in converts jamp leaves for XLA to drop, so XLA fuses them differently and a
    float32 statistic of 16-bit values may round in another order). One output dtype may differ,
    as docs/reference/dtypes.md ("Regions") says: a model that ends by casting to float32 (Flax's ``jnp.asarray(x, dtype)``)
    returns float32 from a region, as torch does, where ``autocast_transform`` sees no cast (the
    value was traced float32) and returns the compute dtype. ``cast_inputs=True`` casts a
    function's inputs, which a region does not have: it is refused with an error that says so."""
    refusals = (
        (run.policy.cast_inputs, "cast_inputs", "a region accepted Policy(cast_inputs=True)"),
        (run.model.region_carry_limit, "inside a jamp.autocast region: the loop's initial carry",
         "the region form now runs this model: drop region_carry_limit"),
    )
    for applies, expected, otherwise in refusals:
        if applies:
            try:
                run.region
            except StageFailed as e:
                assert expected in str(e), str(e)
                return
            raise AssertionError(otherwise)
    region, transform = array_leaves(run.region), array_leaves(run.jitted)
    assert [p for p, _ in region] == [p for p, _ in transform]
    bad = []
    for (path, a), (_, b) in zip(region, transform):
        if a.dtype != b.dtype and not (a.dtype == F32 and b.dtype == run.policy.compute_dtype):
            bad.append(f"{path}: region {a.dtype}, autocast_transform {b.dtype}")
            continue
        if not is_float(a):
            if not np.array_equal(np.asarray(a), np.asarray(b)):
                bad.append(f"{path}: integer outputs differ")
            continue
        a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
        compute = run.policy.compute_dtype
        scale = max(float(np.max(np.abs(b64))), float(jnp.finfo(compute).tiny))
        ulp = float(jnp.finfo(compute).eps) * scale
        worst = float(np.max(np.abs(a64 - b64))) if a64.size else 0.0
        if worst > ulp:
            bad.append(f"{path}: max difference {worst:.3g} > 1 ulp ({ulp:.3g}) of {compute}")
    decisions = {}
    for form, fn in (("region", run.region_function), ("autocast_transform", run.transformed)):
        decisions[form] = table_decisions(fn, run.case.args, run.policy)
    missing = decisions["autocast_transform"] - decisions["region"]
    extra = decisions["region"] - decisions["autocast_transform"]
    if missing or extra:
        bad.append(f"table equations only autocast_transform has: {dict(missing)}; "
                   f"only the region has: {dict(extra)}")
    assert not bad, "\n".join(bad)


def check_grad_inside_region(run: ZooRun) -> None:
    """``jax.grad`` called inside a region (issue 21) is ``jax.grad`` of the loss with the region
    inside: gradients of the same dtypes (the parameters') and values, to a few units in the last
    place of the compute dtype at each gradient's scale (the two programs differ in converts, so
    XLA may fuse them differently). Where a region refuses the model (``cast_inputs``, a 16-bit
    loop carry), both forms refuse it."""
    try:
        inside = array_leaves(run.grads_of_region)
    except StageFailed as refused:
        try:
            run.grads_in_region
        except StageFailed as also:
            assert type(also.__cause__) is type(refused.__cause__), str(also)
            return
        raise AssertionError(f"grad inside a region ran where grad of a region raised: {refused}")
    around = array_leaves(run.grads_in_region)
    assert [p for p, _ in around] == [p for p, _ in inside]
    compute = run.policy.compute_dtype
    bad = []
    for (path, a), (_, b) in zip(around, inside):
        if a.dtype != b.dtype:
            bad.append(f"{path}: grad inside a region {a.dtype}, grad of a region {b.dtype}")
            continue
        a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
        scale = max(float(np.max(np.abs(b64), initial=0.0)), float(jnp.finfo(compute).tiny))
        tol = 4 * float(jnp.finfo(compute).eps) * scale
        worst = float(np.max(np.abs(a64 - b64), initial=0.0))
        if not worst <= tol:
            bad.append(f"{path}: max difference {worst:.3g} > {tol:.3g}")
    assert not bad, "\n".join(bad)


def table_decisions(fn: Callable, args: tuple, policy: jamp.Policy) -> collections.Counter:
    """(primitive, operand dtypes, result dtypes) of every lower- and fp32-table equation of the
    program ``fn(*args)`` traces to that the program uses (what XLA runs: a region leaves unused
    the 16-bit square a sum reads recomputed in float32), sub-jaxprs included, counted."""
    flat, tree = jax.tree.flatten(fresh_copy(args))
    at = [i for i, x in enumerate(flat) if isinstance(x, (jax.Array, np.ndarray))]

    def traced(*arrays):
        leaves = list(flat)
        for i, x in zip(at, arrays):
            leaves[i] = x
        return fn(*jax.tree.unflatten(tree, leaves))

    live, _ = jamp._compat.dce_closed(jax.make_jaxpr(traced)(*(flat[i] for i in at)))
    return dtype_signatures(live, (policy.lower | policy.fp32).__contains__)


def check_explain_share(run: ZooRun) -> None:
    share = run.report.low_precision_flop_share
    assert share >= 0.99, (f"16-bit share of matmul/conv FLOPs {share:.4f} < 0.99: "
                           f"{run.report.flops}\n{run.report}")


def check_trace_other_batch(run: ZooRun) -> None:
    """``tracing.check_trace`` of the model's ``loss_fn`` at its example batch and at a larger
    batch (``ZooModel.batch_args``), float32 and under the run's policy, raises nothing and warns
    nothing: its graphs match with every size abstracted, parameters included (Equinox's runtime
    checks in diffrax bind ``pure_callback``s whose ``result_avals`` hold the batch size), and
    its compiled outputs match the function run op by op."""
    problems = []
    for label, source in (("float32", run.shared), (run.policy_name, run)):
        try:
            problems += [f"{label}: {message}" for message in source.trace_check]
        except StageFailed as e:
            problems.append(str(e))
    assert not problems, "\n".join(problems)


def check_freeze_export_other_batch(run: ZooRun) -> None:
    """The model's inference call frozen under the run's policy (``tracing.freeze``, BatchNorms
    folded), exported with its batch dimension symbolic (``polymorphic_shapes``) and loaded,
    runs at the example batch and at a batch 2 larger, and agrees with the call frozen at that
    batch: same pytree and dtypes, values within 2 units in the last place of the output's
    dtype at the output's scale (the same program, compiled for a symbolic batch)."""
    bad = []
    for got, want in run.frozen_export:
        got, want = array_leaves(got), array_leaves(want)
        assert [p for p, _ in got] == [p for p, _ in want], "output pytrees differ"
        for (path, g), (_, w) in zip(got, want):
            if g.dtype != w.dtype or g.shape != w.shape:
                bad.append(f"{path}: loaded {g.dtype}{g.shape}, frozen {w.dtype}{w.shape}")
                continue
            g64, w64 = np.asarray(g, np.float64), np.asarray(w, np.float64)
            scale = float(np.max(np.abs(w64), initial=0.0))
            tol = 2 * float(jnp.finfo(g.dtype).eps) * scale if is_float(g) else 0.0
            err = float(np.max(np.abs(g64 - w64), initial=0.0))
            if not err <= tol:
                bad.append(f"{path} at batch {g.shape}: max |loaded - frozen| = {err:.3g} > "
                           f"{tol:.3g}")
    assert not bad, "\n".join(bad)


CHECKS = {
    "runs_clean": check_runs_clean,
    "jit_eq_eager": check_jit_equals_eager,
    "finite": check_finite,
    "rel_error": check_relative_error,
    "grads_finite": check_grads_finite,
    "grads_dtype": check_grads_dtype,
    "grads_cosine": check_grads_cosine,
    "enable_checks": check_enable_checks,
    "inputs_unchanged": check_inputs_unchanged,
    "explain_share": check_explain_share,
    "region_eq_transform": check_region_equals_transform,
    "grad_in_region": check_grad_inside_region,
    "trace_batch": check_trace_other_batch,
    "freeze_batch": check_freeze_export_other_batch,
}

# Checks that apply only to some models (the others are not collected for them).
APPLIES: dict[str, Callable[[ZooModel], bool]] = {
    "trace_batch": lambda model: bool(model.batch_args),
    "freeze_batch": lambda model: model.freezes,
}


# Checks run under some policies only, where the other policies would repeat the same path:
# - the region forms take the same path for every compute dtype, and cast_inputs=True is
#   refused by a region (region_eq_transform checks the refusal; float16 would repeat bfloat16);
# - tracing and freezing walk the rewritten program the same way whatever dtypes it holds
#   (a float16 freeze stores float16 weights exactly as bfloat16's stores bfloat16: the unit
#   tests of tracing/ cover every policy), so the zoo checks them under bfloat16.
# Keeps the zoo, run on two JAX versions, inside CI's time (issue 33).
POLICIES_OF: dict[str, tuple[str, ...]] = {
    "grad_in_region": ("bf16",),
    "region_eq_transform": ("bf16", "cast_inputs"),
    "trace_batch": ("bf16",),
    "freeze_batch": ("bf16",),
}

# JAMP_ZOO_POLICIES=bf16 (comma-separated names of POLICIES) runs the zoo under those policies
# only. CI's older JAX version (jax 0.10) uses it: what differs between JAX versions is the
# programs JAX and the model libraries emit, which one policy walks in full; the policies' own
# rules are the same code on every version and are checked under all three on the newest.
ONLY_POLICIES = tuple(p for p in os.environ.get("JAMP_ZOO_POLICIES", "").split(",") if p)
_unknown = set(ONLY_POLICIES) - set(POLICIES)
if _unknown:
    raise ValueError(f"JAMP_ZOO_POLICIES names {sorted(_unknown)}; expected some of "
                     f"{sorted(POLICIES)}")


def policies_for(check: str) -> tuple[str, ...]:
    chosen = POLICIES_OF.get(check, tuple(POLICIES))
    return tuple(p for p in chosen if not ONLY_POLICIES or p in ONLY_POLICIES)


def checks_for(model: ZooModel) -> list[str]:
    return [name for name in CHECKS if APPLIES.get(name, lambda _: True)(model)]
