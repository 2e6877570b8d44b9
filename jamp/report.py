"""``jamp.explain``: what ran in which precision, and why.

Example::

    report = jamp.explain(loss_fn, params, batch)
    str(report)                           # a table per primitive and dtype
    report.ops["dot_general"]             # {"bfloat16": 4}
    report.low_precision_flop_share       # share of matmul/conv FLOPs in 16-bit dtypes
    report.float32_reasons                # {("exp", "fp32 table"): 2, ...}
    # float8: compile for this backend and read which GEMMs XLA emitted (float8_check.py)
    jamp.explain(loss_fn, params, batch, policy=fp8, compiled=True).float8_check
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from . import _compat as compat
from .call_args import CallSignature
from .collectives import CollectiveReport, report_collectives
from .float8_check import Float8Check, Float8Dot, check_compiled, tag_scope, warn_fallbacks
from .interpreter import F64, Step, has_subprograms, is_float, matmul_flops
from .policy import Policy, UnmatchedRule


@dataclasses.dataclass
class Report:
    """The outcome of one rewrite. All counts are of equations in the program (loop bodies once).

    Attributes:
      ops: primitive name -> {output dtype name: number of equations}.
      casts: ``convert_element_type`` equations jamp inserted.
      constant_casts: constants and literals jamp cast at rewrite time instead.
      flops: dtype a matmul/convolution computes in (its floating operands' dtype, so an integer
        mask times bfloat16 activations counts as bfloat16) -> FLOPs, a loop body's per
        iteration: a ``scan``'s length times, a ``while``'s where the program says its trip
        count (a counter from a literal to a literal bound); every branch of a ``cond``.
      low_precision_flop_share: share of those FLOPs with 16- or 8-bit operands.
      float8_flop_share: share of those FLOPs on float8 operands (``Policy(jnp.float8_e4m3fn)``).
      float32_reasons: (primitive, reason) -> equations that produced float32/float64, where the
        reason is ``"fp32 table"``, ``"region"``, ``"rule '<glob>'"``, ``"float64"``,
        ``"accumulate_dtype"``, ``"explicit preferred_element_type"``, ``"compute dtype"``,
        ``"inputs arrived in float32"`` or a rule's own reason (``"softmax shift (x - max(x)
        before exp)"``, rules/softmax.py).
      calls: higher-order primitives (jit, scan, cond, ...) whose bodies were rewritten.
      unmatched_rules: the ``Policy.rules`` whose glob matched no scope of the function, each
        with the closest scope paths seen (``jamp.policy.UnmatchedRule``; ``.message()`` says why).
      float8_kept: under a float8 policy, the matmuls/convolutions kept in bfloat16 because they
        have fewer FLOPs than ``Policy.min_float8_flops`` (:class:`KeptDot`).
      float8_check: with ``compiled=True``, what the optimized program runs each float8 dot as
        (``jamp.float8_check.Float8Check``: a float8 GEMM, a fallback and why, or emulated on
        the CPU); None otherwise.
      collectives: with ``compiled=True``, every collective of the program after XLA's SPMD
        partitioning, with its dtype and bytes per device (``jamp.collectives.CollectiveReport``;
        one device and none where no argument is sharded); None otherwise.
      loops_of_unknown_length: ``while`` loops whose trip count depends on values (a
        ``fori_loop`` with a traced bound): their bodies' FLOPs are counted once.
    """

    policy: Policy
    ops: dict[str, dict[str, int]]
    casts: int
    constant_casts: int
    flops: dict[str, int]
    float32_reasons: dict[tuple[str, str], int]
    calls: dict[str, int]
    unmatched_rules: tuple[UnmatchedRule, ...] = ()
    float8_kept: tuple[KeptDot, ...] = ()
    float8_check: Float8Check | None = None
    collectives: CollectiveReport | None = None
    loops_of_unknown_length: int = 0

    @property
    def low_precision_flop_share(self) -> float:
        total = sum(self.flops.values())
        low = sum(n for dtype, n in self.flops.items() if np.dtype(dtype).itemsize < 4)
        return low / total if total else 0.0

    @property
    def float8_flop_share(self) -> float:
        total = sum(self.flops.values())
        low = sum(n for dtype, n in self.flops.items() if np.dtype(dtype).itemsize == 1)
        return low / total if total else 0.0

    def __str__(self) -> str:
        dtypes = sorted({d for counts in self.ops.values() for d in counts})
        width = max([len(p) for p in self.ops] + [9])
        lines = [
            f"jamp.explain (compute dtype {self.policy.compute_dtype.name})",
            f"{'primitive':<{width}}  " + "  ".join(f"{d:>9}" for d in dtypes),
        ]
        for name in sorted(self.ops):
            lines.append(
                f"{name:<{width}}  "
                + "  ".join(f"{self.ops[name].get(d, 0) or '':>9}" for d in dtypes)
            )
        total = sum(self.flops.values())
        lines.append(
            f"casts inserted: {self.casts} (+{self.constant_casts} constants cast at rewrite time)"
        )
        lines.append(
            f"matmul/conv FLOPs in 16-bit dtypes: {self.low_precision_flop_share:.1%} "
            f"of {total:,}" + "".join(f"; {d}: {n:,}" for d, n in sorted(self.flops.items()))
        )
        if self.float8_flop_share:
            lines.append(f"  of which float8: {self.float8_flop_share:.1%}")
        if self.loops_of_unknown_length:
            lines.append(
                f"  (counting {self.loops_of_unknown_length} while loop(s) of unknown length once)"
            )
        if self.calls:
            lines.append(
                "bodies rewritten: " + ", ".join(f"{n} x{c}" for n, c in sorted(self.calls.items()))
            )
        if self.float32_reasons:
            lines.append("ops that produced float32/float64, and why:")
            for (name, reason), count in sorted(
                self.float32_reasons.items(), key=lambda kv: (-kv[1], kv[0])
            ):
                lines.append(f"  {name:<{width}}  {reason}  x{count}")
        lines.extend(f"unmatched rule: {rule.message()}" for rule in self.unmatched_rules)
        if self.float8_kept:
            lines.append(
                f"kept in bfloat16, below min_float8_flops={self.policy.min_float8_flops:,}:"
            )
            lines.extend(f"  {kept}" for kept in self.float8_kept[:20])
            if len(self.float8_kept) > 20:
                lines.append(f"  ... and {len(self.float8_kept) - 20} more")
        if self.float8_check is not None:
            lines.append(str(self.float8_check))
        if self.collectives is not None:
            lines.append(str(self.collectives))
        if self.policy.reduce_dtype is not None:
            lines.append(
                f"backward matmul/conv products (gradient sums) in {self.policy.reduce_dtype.name} "
                "(Policy.reduce_dtype)"
            )
        return "\n".join(lines)


_MATMUL_LIKE = frozenset({"dot_general", "conv_general_dilated", "ragged_dot_general"})
# How a jax.random sampler's call is named in ``Report.ops`` (``jax.random truncated_normal``).
SAMPLER_PREFIX = "jax.random "


@dataclasses.dataclass(frozen=True)
class KeptDot:
    """A matmul/convolution a float8 policy kept in bfloat16, and why (``"min_float8_flops"``:
    fewer FLOPs than ``Policy.min_float8_flops``)."""

    primitive: str
    where: str  # the user's source line
    scope: str
    shapes: tuple[tuple[int, ...], ...]
    flops: int
    reason: str

    def __str__(self) -> str:
        shapes = " x ".join(str(list(s)) for s in self.shapes)
        scope = f" [{self.scope}]" if self.scope else ""
        return f"{self.primitive} {shapes} at {self.where}{scope}: {self.flops:,} FLOPs"


def _dims(dims: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in dims)


def _compute_dtype(step: Step) -> np.dtype:
    """The dtype a matmul/conv computes in: that of its floating operands (an integer mask or
    index operand is converted to it), else its preferred element type, else its operands'.
    A float8 op (``Step.flop_dtype``) counts in its float8 format."""
    if step.flop_dtype is not None:
        return step.flop_dtype
    operands = [compat.aval_of(a).dtype for a in step.bound_args[:2]]
    if any(d.kind == "c" for d in operands):  # (a complex operand: the product is complex)
        return np.dtype(jnp.result_type(*operands))
    floating = [d for d in operands if is_float(d)]
    if floating:
        return np.dtype(jnp.result_type(*floating))
    preferred = step.params.get("preferred_element_type")
    return np.dtype(preferred if preferred is not None else jnp.result_type(*operands))


class Recorder:
    """Collects what the interpreter did; ``Rewriter`` calls ``equation`` and ``cast``."""

    def __init__(self, policy: Policy, tag_float8: bool = False):
        self.policy = policy
        self.tag_float8 = tag_float8  # compile float8 dots under scopes the HLO check reads
        self.float8_dots: list[Float8Dot] = []
        self.kept: list[KeptDot] = []
        self.ops: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.casts = self.constant_casts = 0
        self.flops: collections.Counter = collections.Counter()
        self.reasons: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()
        self.unmatched: tuple[UnmatchedRule, ...] = ()
        self.unknown_lengths = 0

    def loop_of_unknown_length(self) -> None:
        """A ``while`` whose trip count the program does not say: its body's FLOPs count once."""
        self.unknown_lengths += 1

    def float8_dot(self, step: Step, formats: list) -> Any:
        """Called by the float8 rule as it emits a dot: record it, and return the scope to emit
        it under (or None)."""
        (lhs_c, rhs_c), (lhs_b, rhs_b) = step.params["dimension_numbers"]
        dot = Float8Dot(
            len(self.float8_dots),
            compat.source_line(step.eqn),
            "/".join(step.state.path),
            (formats[0].name, formats[1].name),
            (tuple(step.aval(0).shape), tuple(step.aval(1).shape)),
            (_dims(lhs_c), _dims(rhs_c)),
            (_dims(lhs_b), _dims(rhs_b)),
            matmul_flops(step.eqn),
        )
        self.float8_dots.append(dot)
        return tag_scope(dot.index) if self.tag_float8 else None

    def unmatched_rules(self, rules: tuple[UnmatchedRule, ...]) -> None:
        """Told by the top-level rewriter which rules matched no scope (instead of a warning)."""
        self.unmatched = tuple(rules)

    def cast(self, constant: bool) -> None:
        if constant:
            self.constant_casts += 1
        else:
            self.casts += 1

    def equation(self, step: Step, outs: list[Any]) -> None:
        name = step.eqn.primitive.name
        if compat.calls_a_sampler(step.eqn.primitive, step.params):
            # (run as traced, not rewritten: counted as one operation in the dtype it drew)
            name = SAMPLER_PREFIX + step.params.get("name", "?").lstrip("_")
        elif has_subprograms(step.params):
            self.calls[name] += 1
            return
        if not outs:
            return
        dtypes = [compat.aval_of(o).dtype for o in outs if hasattr(compat.aval_of(o), "dtype")]
        floating = [d for d in dtypes if is_float(d)]
        label = (floating or dtypes or [None])[0]
        self.ops[name][getattr(label, "name", str(label))] += 1
        if name in _MATMUL_LIKE:
            self.flops[_compute_dtype(step).name] += matmul_flops(step.eqn) * step.rewriter.repeats
        if step.scaled_skip is not None:
            self.kept.append(
                KeptDot(
                    name,
                    compat.source_line(step.eqn),
                    "/".join(step.state.path),
                    tuple(tuple(v.aval.shape) for v in step.eqn.invars),
                    matmul_flops(step.eqn),
                    step.scaled_skip,
                )
            )
        if floating and np.dtype(floating[0]).itemsize >= 4:
            self.reasons[(name, self._why_wide(step, floating[0]))] += 1

    def _why_wide(self, step: Step, dtype: Any) -> str:
        name = step.eqn.primitive.name
        if compat.calls_a_sampler(step.eqn.primitive, step.params):
            return "drawn as asked"
        category = self.policy.category(name)
        if np.dtype(dtype) == F64 or any(
            compat.aval_of(a).dtype == F64 for a in step.args if hasattr(compat.aval_of(a), "dtype")
        ):
            return "float64"
        if not step.state.enabled:
            return step.state.decided_by
        if step.why is not None:
            return step.why
        if category == "fp32":
            return "fp32 table"
        if category == "lower":
            if _compute_dtype(step).itemsize < 4:
                return (
                    "accumulate_dtype"
                    if self.policy.accumulate_dtype is not None
                    and self.policy.accumulate_for(_compute_dtype(step))
                    == self.policy.accumulate_dtype
                    else "explicit preferred_element_type"
                )
            return (
                "compute dtype" if step.state.dtype.itemsize >= 4 else "inputs arrived in float32"
            )
        return "inputs arrived in float32"

    def report(
        self, check: Float8Check | None = None, collectives: CollectiveReport | None = None
    ) -> Report:
        return Report(
            self.policy,
            {k: dict(v) for k, v in self.ops.items()},
            self.casts,
            self.constant_casts,
            dict(self.flops),
            dict(self.reasons),
            dict(self.calls),
            self.unmatched,
            tuple(self.kept),
            check,
            collectives,
            self.unknown_lengths,
        )


def _paths(fn: Callable, args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    """Each leaf of the call with the user's pytree path (``params['Dense_0']['kernel']``),
    named by ``fn``'s parameters where its signature says them."""
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        params = []
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path((args, kwargs))[0]:
        where, key = path[0], path[1] if len(path) > 1 else None
        index = getattr(key, "idx", None)
        if getattr(where, "idx", 0) == 0 and index is not None:
            head = params[index] if index < len(params) else f"args[{index}]"
        else:
            head = str(getattr(key, "key", key))
        out.append((head + jax.tree_util.keystr(tuple(path[2:])), leaf))
    return out


def _arg_names(fn: Callable, args: tuple, kwargs: dict, flat: list[Any]) -> list[str]:
    """The user's pytree path of each traced leaf."""
    paths: dict[int, str] = {}
    for name, leaf in _paths(fn, args, kwargs):
        paths.setdefault(id(leaf), name)
    return [paths.get(id(x), f"argument {i}") for i, x in enumerate(flat)]


def _stand_ins(
    fn: Callable, args: tuple, kwargs: dict
) -> tuple[tuple, dict, dict[int, jax.ShapeDtypeStruct]]:
    """The call with each ``jax.ShapeDtypeStruct`` replaced by an array of its shape and dtype
    that takes no memory (a broadcast zero: only its type is traced), and those arrays' ids ->
    the structs they stand for (their shardings are compiled for)."""
    leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
    if not any(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in leaves):
        return args, kwargs, {}
    structs: dict[int, jax.ShapeDtypeStruct] = {}
    out = []
    for name, leaf in _paths(fn, args, kwargs):
        if isinstance(leaf, jax.ShapeDtypeStruct):
            if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.extended):
                raise TypeError(
                    f"explain: argument {name} is a jax.ShapeDtypeStruct of {leaf.dtype}, which "
                    "explain cannot stand in for; pass an array of it (jax.random.key(0))"
                )
            stand_in = np.broadcast_to(np.zeros((), leaf.dtype), leaf.shape)
            structs[id(stand_in)] = leaf
            leaf = stand_in
        out.append(leaf)
    args, kwargs = jax.tree_util.tree_unflatten(tree, out)
    return args, kwargs, structs


def _compiled_as(x: Any, structs: dict[int, jax.ShapeDtypeStruct]) -> jax.ShapeDtypeStruct:
    """The type and sharding a traced leaf is compiled for: a ShapeDtypeStruct's own, else a
    committed array's sharding (placed by ``jax.device_put`` or a sharded computation). An
    uncommitted array (``jnp.ones``) goes wherever ``fn``'s own ``in_shardings`` or shard_map
    put it, as in ``jax.jit(fn)(*args)``; pinning it to its one device clashed with them."""
    if id(x) in structs:  # (traced as not weakly typed: so is its stand-in)
        struct = structs[id(x)]
        return jax.ShapeDtypeStruct(struct.shape, struct.dtype, sharding=struct.sharding)
    aval = compat.aval_of(x)
    placed = isinstance(x, jax.Array) and not compat.is_tracer(x) and x.committed
    return jax.ShapeDtypeStruct(
        aval.shape,
        aval.dtype,
        sharding=x.sharding if placed else None,
        weak_type=getattr(aval, "weak_type", False),
    )


def _lower_as_called(
    program: Callable, fn: Callable, args: tuple, kwargs: dict, flat: list, shaped: list
) -> tuple[Any, list[int]]:
    """``jax.jit(program)`` lowered at ``shaped`` (one per traced leaf in ``flat``), called in the
    shape of the user's call so that JAX's lowering errors name the user's pytree paths
    (``p['b']``, ``st.step``) as ``jax.jit(fn).lower`` does, not ``program``'s flat ``a[2]``.
    Leaves that are not traced (static arguments, Python values) pass as ``None``, an empty
    subtree to JAX. Also returns the index in ``flat`` of each of the program's parameters."""
    position = {id(x): i for i, x in enumerate(flat)}
    leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
    position_seen: set[int] = set()
    order: list[int] = []  # the flat index of each leaf passed, in the call's leaf order
    passed: list[Any] = []
    for leaf in leaves:
        i = position.get(id(leaf))
        if i is None or i in position_seen:  # (a leaf passed twice is traced once)
            passed.append(None)
        else:
            position_seen.add(i)
            order.append(i)
            passed.append(shaped[i])
    try:
        if sorted(order) != list(range(len(flat))):
            raise ValueError("the call's leaves are not the traced ones")
        call_args, call_kwargs = jax.tree_util.tree_unflatten(tree, passed)
    except Exception:  # (a pytree node that refuses None or a struct: flat, unnamed)
        return jax.jit(program).lower(*shaped), list(range(len(flat)))

    def as_called(*a: Any, **k: Any) -> Any:
        traced = [None] * len(flat)
        for i, x in zip(order, jax.tree_util.tree_leaves((a, k)), strict=True):
            traced[i] = x
        return program(*traced)

    as_called.__name__ = as_called.__qualname__ = program.__name__
    try:  # JAX names the arguments by the signature it finds
        as_called.__signature__ = inspect.signature(fn)  # type: ignore[attr-defined]
    except (TypeError, ValueError):
        pass
    return jax.jit(as_called).lower(*call_args, **call_kwargs), order


@compat.api_boundary  # (fn's errors show fn's frames, as under jax.jit)
def explain(
    fn: Callable,
    *args: Any,
    policy: Policy | DTypeLike | None = None,
    compiled: bool = False,
    **kwargs: Any,
) -> Report:
    """Trace ``fn(*args, **kwargs)`` once, rewrite it under ``policy`` and report what ran where.

    Nothing is computed: only shapes and dtypes of ``args`` matter. The report is of
    ``autocast_transform(fn, policy)``: a ``with jamp.autocast():`` block inside ``fn`` is read
    as a region of that transform, so for a function that opens its own regions it shows what
    the transform would run, which can differ from what ``jax.jit(fn)`` runs where the two forms
    do (docs/reference/dtypes.md, "Regions"; the backward products of a ``jax.grad`` taken
    through a region among them). With ``compiled=True`` the
    rewritten program is also lowered and compiled for the default backend, and
    ``Report.float8_check`` says what each float8 dot compiled to: a float8 GEMM, a fallback to
    a wider GEMM and the likely reason, or (on the CPU) emulation. On a GPU a fallback warns
    once per program (:class:`jamp.Float8FallbackWarning`). ``Report.collectives`` lists every
    collective of the program as XLA's SPMD partitioner left it (kind, dtype, bytes per device,
    the parameter or operation it moves), for the shardings the arguments carry: pass
    ``jax.Array``s placed with ``NamedSharding`` (or ``jax.ShapeDtypeStruct(...,
    sharding=...)``, traced at their shapes and dtypes). Arrays never placed (``jnp.ones``) go
    where ``fn``'s own ``in_shardings`` or ``shard_map`` put them, as when it runs; where
    nothing shards them the program compiles for one device, reported as such.

    Example::

        table = str(jamp.explain(model.apply, params, x))
        check = jamp.explain(loss, params, x, policy=fp8, compiled=True).float8_check
        jamp.explain(jax.grad(loss), params, x, compiled=True).collectives.bytes_by_dtype
    """
    from .transform import resolve_policy, rewrite_and_eval, trace_call

    policy = resolve_policy(policy, where="explain")
    if not callable(fn):
        raise TypeError(f"explain expects a callable, got {type(fn).__name__}")
    if not isinstance(compiled, bool):  # before tracing, which may be slow or fail otherwise
        raise TypeError(f"explain(compiled=...) must be True or False, got {compiled!r}")
    # A jax.jit-wrapped fn's static arguments stay Python values, as in autocast_transform.
    signature = CallSignature.of(fn, label="explain")
    args, kwargs, structs = _stand_ins(fn, args, kwargs)
    args, kwargs = signature.mark_static(args, kwargs)
    _, flat, tracer, refuse_untraceable = trace_call(
        signature.call_unmarked, policy, args, kwargs, source=fn, signature=signature
    )
    refuse_untraceable()  # (before the program it compiles, which refuses it unnamed)
    traced = tracer()
    recorder = Recorder(policy, tag_float8=compiled)
    program = lambda *a: rewrite_and_eval(  # noqa: E731
        traced.closed, policy, a, recorder, kept_dtypes=traced.kept_dtypes
    )
    if not compiled:
        compat.trace_to_closed(program, [compat.aval_of(x) for x in flat])
        return recorder.report()
    program.__name__ = program.__qualname__ = traced.name
    shaped = [_compiled_as(x, structs) for x in flat]
    lowered, order = _lower_as_called(program, fn, args, kwargs, flat, shaped)
    names = _arg_names(fn, args, kwargs, flat)
    compiled_program, collectives = report_collectives(lowered, [names[i] for i in order])
    check = check_compiled(compiled_program, recorder.float8_dots)
    warn_fallbacks(check, traced.name)
    return recorder.report(check, collectives)
