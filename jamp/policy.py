"""Precision policies: which primitive runs in which dtype, and per-scope rules.

A :class:`Policy` is an immutable, hashable value (usable as a ``jax.jit`` static argument and as
a cache key). The three tables hold primitive names (``str(eqn.primitive)``), so they can be
extended without importing JAX internals::

    policy = jamp.Policy(jnp.bfloat16)
    policy = policy.replace(fp32=policy.fp32 | {"tanh"}, rules=(("*/head", None),))
"""
from __future__ import annotations

import dataclasses
import fnmatch
from typing import Any, Iterable, Optional

import jax.numpy as jnp
import numpy as np

# Matrix multiplies and convolutions: operands in the compute dtype, output in the compute dtype.
LOWER: frozenset[str] = frozenset({
    "dot_general", "conv_general_dilated", "ragged_dot_general",
})

# Numerically sensitive ops (torch's fp32 list keyed on lax primitives): run in float32.
FP32: frozenset[str] = frozenset({
    "exp", "exp2", "log", "log1p", "log2", "expm1", "pow", "rsqrt", "tan", "acos", "asin",
    "sinh", "cosh", "acosh", "asinh", "atanh", "erf_inv", "lgamma", "digamma", "polygamma", "zeta",
    "igamma", "igammac", "igamma_grad_a", "regularized_incomplete_beta", "bessel_i0e", "bessel_i1e",
    "reduce_sum", "reduce_prod", "cumsum", "cumprod", "cumlogsumexp",
    # Only where their result is summed (a one-pass variance E[x^2] - E[x]^2); elsewhere they run
    # in the dtype their operand arrives in, so tanh-GELU's x**3 stays bfloat16 (rules/powers.py).
    "square", "integer_pow",
    # FFTs and decompositions have no bfloat16/float16 kernels (torch keeps linalg_* and fft_* in fp32).
    "fft", "cholesky", "eig", "eigh", "lu", "qr", "svd", "triangular_solve", "schur", "hessenberg",
    "householder_product", "tridiagonal", "tridiagonal_solve",
})

# Ops whose floating operands must agree: mixed operands run in the widest of them, while weakly
# typed and rank-0 operands (Python scalars, constants built with the traced dtype) adapt.
PROMOTE: frozenset[str] = frozenset({
    "add", "add_any", "sub", "mul", "div", "max", "min", "rem", "atan2", "nextafter", "complex",
    "select_n", "clamp", "concatenate", "pad", "dynamic_update_slice",
    "scatter", "scatter-add", "scatter-sub", "scatter-mul", "scatter-min", "scatter-max",
    "eq", "ne", "lt", "le", "gt", "ge", "select_and_scatter_add", "select_and_gather_add",
})

_FLOATING_COMPUTE = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32))


def _dtype_or_none(value: Any, field: str) -> Optional[np.dtype]:
    if value is None:
        return None
    try:
        dtype = np.dtype(value)
    except TypeError as err:
        raise ValueError(f"Policy.{field} must be a dtype such as jnp.bfloat16, got {value!r}") from err
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"Policy.{field} must be a floating dtype (bfloat16, float16, float32), "
                         f"got {dtype.name}")
    return dtype


def _names(value: Iterable[str], field: str) -> frozenset[str]:
    if isinstance(value, str) or not all(isinstance(v, str) for v in value):
        raise TypeError(f"Policy.{field} must be a set of primitive names (str), got {value!r}")
    return frozenset(value)


def _rules(value: Iterable[Any]) -> tuple[tuple[str, Optional[np.dtype]], ...]:
    rules = []
    for i, rule in enumerate(value):
        if not (isinstance(rule, tuple) and len(rule) == 2 and isinstance(rule[0], str)):
            raise TypeError(f"Policy.rules[{i}] must be a (glob pattern, dtype or None) pair, got {rule!r}")
        rules.append((rule[0], _dtype_or_none(rule[1], f"rules[{i}][1]")))
    return tuple(rules)


@dataclasses.dataclass(frozen=True)
class Policy:
    """How ``autocast_transform`` assigns precisions.

    Args:
      compute_dtype: dtype of matmuls/convs (the ``lower`` table), ``bfloat16`` by default.
      accumulate_dtype: if set (e.g. ``jnp.float32``), lower-table ops return this dtype instead of
        the compute dtype. Costs memory and makes backward matmuls mix dtypes; use for logits only.
      output_dtype: if set, floating (non-float64) outputs of the function are cast to it.
      cast_inputs: cast floating (non-float64) inputs to the compute dtype on entry.
      lower, fp32, promote: the primitive-name tables (see README for the full tables).
      rules: ``((glob, dtype_or_None), ...)`` matched against each equation's scope path
        (``jax.named_scope`` names and Flax module paths joined by ``/``). ``None`` disables
        autocast there, a dtype changes the compute dtype. The innermost matching scope wins; at the
        same scope the later rule wins; ``jamp.autocast`` regions inside a scope win over rules.

    Example::

        policy = jamp.Policy(jnp.float16, rules=(("*/LayerNorm_*", None),))
        f16_fn = jamp.autocast_transform(fn, policy)
    """

    compute_dtype: Any = jnp.bfloat16
    accumulate_dtype: Any = None
    output_dtype: Any = None
    cast_inputs: bool = False
    lower: frozenset = LOWER
    fp32: frozenset = FP32
    promote: frozenset = PROMOTE
    rules: tuple = ()

    def __init__(self, compute_dtype: Any = jnp.bfloat16, *, accumulate_dtype: Any = None,
                 output_dtype: Any = None, cast_inputs: bool = False, lower: Iterable[str] = LOWER,
                 fp32: Iterable[str] = FP32, promote: Iterable[str] = PROMOTE,
                 rules: Iterable[Any] = ()):
        compute = _dtype_or_none(compute_dtype, "compute_dtype")
        if compute is None or compute not in _FLOATING_COMPUTE:
            raise ValueError("Policy.compute_dtype must be bfloat16, float16 or float32, "
                             f"got {compute_dtype!r}")
        if not isinstance(cast_inputs, bool):
            raise TypeError(f"Policy.cast_inputs must be a bool, got {cast_inputs!r}")
        set_ = lambda name, value: object.__setattr__(self, name, value)  # frozen dataclass
        set_("compute_dtype", compute)
        set_("accumulate_dtype", _dtype_or_none(accumulate_dtype, "accumulate_dtype"))
        set_("output_dtype", _dtype_or_none(output_dtype, "output_dtype"))
        set_("cast_inputs", cast_inputs)
        set_("lower", _names(lower, "lower"))
        set_("fp32", _names(fp32, "fp32"))
        set_("promote", _names(promote, "promote"))
        set_("rules", _rules(rules))
        overlap = (self.lower & self.fp32) | (self.lower & self.promote) | (self.fp32 & self.promote)
        if overlap:
            raise ValueError(f"Policy tables overlap on {sorted(overlap)}: each primitive belongs to "
                             "at most one of lower / fp32 / promote")

    def replace(self, **changes: Any) -> "Policy":
        """A copy with some fields changed: ``policy.replace(compute_dtype=jnp.float16)``."""
        fields = [f.name for f in dataclasses.fields(self)]
        unknown = sorted(set(changes) - set(fields))
        if unknown:
            raise TypeError(f"Policy has no field {unknown[0]!r}; fields are {fields}")
        current = {f: getattr(self, f) for f in fields}
        current.update(changes)
        compute = current.pop("compute_dtype")
        return Policy(compute, **current)

    def category(self, primitive_name: str) -> Optional[str]:
        """``'lower'``, ``'fp32'``, ``'promote'`` or None for a primitive name."""
        if primitive_name in self.lower:
            return "lower"
        if primitive_name in self.fp32:
            return "fp32"
        if primitive_name in self.promote:
            return "promote"
        return None


@dataclasses.dataclass(frozen=True)
class RegionState:
    """The autocast state an equation runs under, and the scope path that led there.

    ``matched`` holds the rules that already applied at a shallower scope, so a rule whose glob
    also matches deeper paths (``Block_0*``) does not override a region entered in between.
    ``keep_compute_dtype`` is set inside the derivative rules of a custom-derivative call that
    returns the compute dtype under ``Policy(cast_inputs=True)`` (``rules/custom_ad.py``): there an
    fp32-table op whose operands arrive in the compute dtype computes in float32 and returns the
    compute dtype, as ``jnp`` does for bfloat16 arrays.
    """

    enabled: bool
    dtype: np.dtype
    path: tuple[str, ...] = ()
    matched: frozenset = frozenset()
    decided_by: str = "policy"  # what set enabled/dtype last: "policy", "region" or "rule '<glob>'"
    keep_compute_dtype: bool = False

    def enter_scope(self, name: str, rules: tuple) -> "RegionState":
        path = self.path + (name,)
        joined = "/".join(path)
        state = dataclasses.replace(self, path=path)
        new = [i for i, (pattern, _) in enumerate(rules)
               if i not in self.matched and fnmatch.fnmatchcase(joined, pattern)]
        if not new:
            return state
        pattern, dtype = rules[new[-1]]  # the later rule wins among those matching at this scope
        enabled, dtype = (False, self.dtype) if dtype is None else (True, dtype)
        return dataclasses.replace(state, enabled=enabled, dtype=dtype,
                                   matched=self.matched | frozenset(new),
                                   decided_by=f"rule {pattern!r}")
