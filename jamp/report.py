"""``jamp.explain``: what ran in which precision, and why.

Example::

    report = jamp.explain(loss_fn, params, batch)
    str(report)                           # a table per primitive and dtype
    report.ops["dot_general"]             # {"bfloat16": 4}
    report.low_precision_flop_share       # share of matmul/conv FLOPs in 16-bit dtypes
    report.float32_reasons                # {("exp", "fp32 table"): 2, ...}
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np

from . import _compat as compat
from .interpreter import F64, Step, has_subprograms, is_float
from .policy import Policy, UnmatchedRule


@dataclasses.dataclass
class Report:
    """The outcome of one rewrite. All counts are of equations in the program (loop bodies once).

    Attributes:
      ops: primitive name -> {output dtype name: number of equations}.
      casts: ``convert_element_type`` equations jamp inserted.
      constant_casts: constants and literals jamp cast at rewrite time instead.
      flops: dtype a matmul/convolution computes in (its floating operands' dtype, so an integer
        mask times bfloat16 activations counts as bfloat16) -> FLOPs.
      low_precision_flop_share: share of those FLOPs with 16- or 8-bit operands.
      float8_flop_share: share of those FLOPs on float8 operands (``Policy(jnp.float8_e4m3fn)``).
      float32_reasons: (primitive, reason) -> equations that produced float32/float64, where the
        reason is ``"fp32 table"``, ``"region"``, ``"rule '<glob>'"``, ``"float64"``,
        ``"accumulate_dtype"``, ``"explicit preferred_element_type"``, ``"compute dtype"`` or
        ``"inputs arrived in float32"``.
      calls: higher-order primitives (jit, scan, cond, ...) whose bodies were rewritten.
      unmatched_rules: the ``Policy.rules`` whose glob matched no scope of the function, each
        with the closest scope paths seen (``jamp.policy.UnmatchedRule``; ``.message()`` says why).
    """

    policy: Policy
    ops: dict[str, dict[str, int]]
    casts: int
    constant_casts: int
    flops: dict[str, int]
    float32_reasons: dict[tuple[str, str], int]
    calls: dict[str, int]
    unmatched_rules: tuple[UnmatchedRule, ...] = ()

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
        return "\n".join(lines)


_MATMUL_LIKE = frozenset({"dot_general", "conv_general_dilated", "ragged_dot_general"})


def _flops(step: Step, outs: list[Any]) -> int:
    out = compat.aval_of(outs[0])
    name, params = step.eqn.primitive.name, step.params
    lhs, rhs = (compat.aval_of(a) for a in step.bound_args[:2])
    if name == "conv_general_dilated":
        out_features_dim = params["dimension_numbers"].rhs_spec[0]
        return 2 * out.size * rhs.size // max(rhs.shape[out_features_dim], 1)
    numbers = params.get("dimension_numbers") or params["ragged_dot_dimension_numbers"]
    contracting = getattr(numbers, "dot_dimension_numbers", numbers)[0][0]
    return 2 * out.size * math.prod(lhs.shape[d] for d in contracting)


def _compute_dtype(step: Step) -> np.dtype:
    """The dtype a matmul/conv computes in: that of its floating operands (an integer mask or
    index operand is converted to it), else its preferred element type, else its operands'.
    A float8 op (``Step.flop_dtype``) counts in its float8 format."""
    if step.flop_dtype is not None:
        return step.flop_dtype
    operands = [compat.aval_of(a).dtype for a in step.bound_args[:2]]
    floating = [d for d in operands if is_float(d)]
    if floating:
        return np.dtype(jnp.result_type(*floating))
    preferred = step.params.get("preferred_element_type")
    return np.dtype(preferred if preferred is not None else jnp.result_type(*operands))


class Recorder:
    """Collects what the interpreter did; ``Rewriter`` calls ``equation`` and ``cast``."""

    def __init__(self, policy: Policy):
        self.policy = policy
        self.ops: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.casts = self.constant_casts = 0
        self.flops: collections.Counter = collections.Counter()
        self.reasons: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()
        self.unmatched: tuple[UnmatchedRule, ...] = ()

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
        if has_subprograms(step.params):
            self.calls[name] += 1
            return
        if not outs:
            return
        dtypes = [compat.aval_of(o).dtype for o in outs if hasattr(compat.aval_of(o), "dtype")]
        floating = [d for d in dtypes if is_float(d)]
        label = (floating or dtypes or [None])[0]
        self.ops[name][getattr(label, "name", str(label))] += 1
        if name in _MATMUL_LIKE:
            self.flops[_compute_dtype(step).name] += _flops(step, outs)
        if floating and np.dtype(floating[0]).itemsize >= 4:
            self.reasons[(name, self._why_wide(step, floating[0]))] += 1

    def _why_wide(self, step: Step, dtype: Any) -> str:
        name = step.eqn.primitive.name
        category = self.policy.category(name)
        if np.dtype(dtype) == F64 or any(
            compat.aval_of(a).dtype == F64 for a in step.args if hasattr(compat.aval_of(a), "dtype")
        ):
            return "float64"
        if not step.state.enabled:
            return step.state.decided_by
        if category == "fp32":
            return "fp32 table"
        if category == "lower":
            if _compute_dtype(step).itemsize < 4:
                return (
                    "accumulate_dtype"
                    if self.policy.accumulate_dtype is not None
                    else "explicit preferred_element_type"
                )
            return (
                "compute dtype" if step.state.dtype.itemsize >= 4 else "inputs arrived in float32"
            )
        return "inputs arrived in float32"

    def report(self) -> Report:
        return Report(
            self.policy,
            {k: dict(v) for k, v in self.ops.items()},
            self.casts,
            self.constant_casts,
            dict(self.flops),
            dict(self.reasons),
            dict(self.calls),
            self.unmatched,
        )


def explain(fn: Callable, *args: Any, policy: Policy | None = None, **kwargs: Any) -> Report:
    """Trace ``fn(*args, **kwargs)`` once, rewrite it under ``policy`` and report what ran where.

    Nothing is computed: only shapes and dtypes of ``args`` matter.

    Example::

        table = str(jamp.explain(model.apply, params, x))
    """
    from .transform import resolve_policy, rewrite_and_eval, trace_call

    policy = resolve_policy(policy)
    if not callable(fn):
        raise TypeError(f"explain expects a callable, got {type(fn).__name__}")
    _, flat, tracer = trace_call(fn, policy, args, kwargs)
    traced = tracer()
    recorder = Recorder(policy)
    compat.trace_to_closed(
        lambda *a: rewrite_and_eval(traced.closed, policy, a, recorder),
        [compat.aval_of(x) for x in flat],
    )
    return recorder.report()
