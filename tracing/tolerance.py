"""How close a traced output must be to the same output computed op by op.

XLA fuses and reorders a compiled program, so its results round differently from the same
operations run one at a time: by a few units in the last place (ulps) of the narrowest floating
dtype the value went through, and by more where a reduction adds many terms. The rule, per output
leaf of the traced program:

* ``dtype`` is the narrowest floating dtype on the output's computation path: the jaxpr is walked
  backwards from the output through every equation it depends on (the output, the equations'
  operands and results, and every value inside their sub-jaxprs: scan/while/cond bodies, calls,
  remat, custom rules). A float32 output of a bfloat16 LayerNorm has ``dtype`` bfloat16.
* ``tol = max(check_tolerance, ULPS * eps(dtype))`` with ``ULPS = 4``: ``check_tolerance`` (1e-5
  by default) for float32 paths, 4 bfloat16 ulps (0.03) or 4 float16 ulps (0.004) otherwise.
* An element agrees when ``|traced - python| <= tol * |python| + atol`` with
  ``atol = max(check_tolerance, tol * M)``; ``M`` is the magnitude of the values involved: the
  largest finite ``|python|`` of the output, raised, for an output that still disagrees, to the
  largest finite magnitude among the results of the additive accumulations on its path
  (``reduce_sum``, ``dot_general``, convolutions, cumulative sums, ``add``/``sub``, and calls
  and control flow, whose insides are not looked at one by one): a variance
  computed as ``E[x^2] - E[x]^2`` of large numbers is exact only to the rounding of ``E[x^2]``.
  That second pass evaluates the program op by op once more, so it runs only for outputs that
  fail the first one.
* Integer, boolean and key outputs must be equal.

A real divergence (a branch on a shape, a number drawn in Python) changes outputs by far more.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jamp import _compat as compat

ULPS = 4

# Primitives whose rounding error scales with the magnitude of what they add up, not with their
# result: the results of these on an output's path are "the values involved".
ACCUMULATIONS = frozenset(
    {
        "reduce_sum",
        "dot_general",
        "conv_general_dilated",
        "cumsum",
        "add",
        "sub",
        "add_any",
        "ragged_dot",
        "ragged_dot_general",
        "reduce_precision",
    }
)


def is_floating(dtype: Any) -> bool:
    """True for real and complex floating dtypes, bfloat16 and float8s included (NumPy's
    ``dtype.kind`` calls bfloat16 ``'V'``)."""
    try:
        return bool(jnp.issubdtype(dtype, jnp.inexact))
    except TypeError:  # extended dtypes (PRNG keys)
        return False


def _eps(dtype: Any) -> float:
    return float(jnp.finfo(dtype).eps)


def _narrowest(dtypes: Iterable[Any]) -> np.dtype | None:
    floating = [np.dtype(d) for d in dtypes if d is not None and is_floating(d)]
    return max(floating, key=_eps, default=None)


def _dtype_of(var: Any) -> Any:
    return getattr(getattr(var, "aval", None), "dtype", None)


def _all_dtypes(closed: Any) -> set:
    """Every dtype inside a (sub-)jaxpr, recursively."""
    jaxpr, _ = compat.open_and_consts(closed)
    found = {_dtype_of(v) for v in (*jaxpr.constvars, *jaxpr.invars)}
    for eqn in jaxpr.eqns:
        found.update(_dtype_of(v) for v in (*eqn.invars, *eqn.outvars))
        for sub in compat.sub_jaxprs(eqn.params):
            found |= _all_dtypes(sub)
    return found


class _Paths:
    """For each output of a jaxpr, the equations its value depends on (backwards walk)."""

    def __init__(self, closed: Any) -> None:
        self.jaxpr, _ = compat.open_and_consts(closed)
        producer = {}
        for eqn in self.jaxpr.eqns:
            for var in eqn.outvars:
                producer[id(var)] = eqn
        self._producer = producer

    def equations(self, outvar: Any) -> list[Any]:
        seen: dict[int, Any] = {}
        stack = [outvar]
        while stack:
            var = stack.pop()
            eqn = None if isinstance(var, compat.Literal) else self._producer.get(id(var))
            if eqn is None or id(eqn) in seen:
                continue
            seen[id(eqn)] = eqn
            stack.extend(eqn.invars)
        return list(seen.values())


def path_dtypes(closed: Any) -> list[np.dtype | None]:
    """The narrowest floating dtype on each output's computation path (None: no floats)."""
    paths = _Paths(closed)
    result = []
    for outvar in paths.jaxpr.outvars:
        dtypes = {_dtype_of(outvar)}
        for eqn in paths.equations(outvar):
            dtypes.update(_dtype_of(v) for v in (*eqn.invars, *eqn.outvars))
            for sub in compat.sub_jaxprs(eqn.params):
                dtypes |= _all_dtypes(sub)
        result.append(_narrowest(dtypes))
    return result


def accumulation_magnitudes(
    closed: Any, leaves: list[Any], default: float | None = None
) -> list[float]:
    """For each output, the largest finite magnitude among the results of the additive
    accumulations on its path, from one op-by-op evaluation of the program at ``leaves``.

    With ``default`` given, an equation that cannot run op by op (an effect that refuses it)
    gives ``default`` for every output instead of raising: the tolerance then stays the first
    pass's.
    """
    try:
        return _accumulation_magnitudes(closed, leaves)
    except Exception:
        if default is None:
            raise
        return [default] * len(compat.open_and_consts(closed)[0].outvars)


def _accumulation_magnitudes(closed: Any, leaves: list[Any]) -> list[float]:
    paths = _Paths(closed)
    jaxpr, consts = compat.open_and_consts(closed)
    magnitude: dict[int, float] = {}
    env: dict[int, Any] = {id(v): x for v, x in zip(jaxpr.constvars, consts)}
    env.update((id(v), x) for v, x in zip(jaxpr.invars, leaves))

    def read(var: Any) -> Any:
        return var.val if isinstance(var, compat.Literal) else env[id(var)]

    with jax.disable_jit():
        for eqn in jaxpr.eqns:
            with compat.equation_context(eqn):
                outs = eqn.primitive.bind(*map(read, eqn.invars), **compat.bind_params(eqn))
            outs = outs if eqn.primitive.multiple_results else [outs]
            for var, value in zip(eqn.outvars, outs):
                env[id(var)] = value
            if eqn.primitive.name in ACCUMULATIONS or any(compat.sub_jaxprs(eqn.params)):
                magnitude[id(eqn)] = max((_largest_finite(v) for v in outs), default=0.0)
    return [
        max((magnitude.get(id(e), 0.0) for e in paths.equations(outvar)), default=0.0)
        for outvar in jaxpr.outvars
    ]


def _largest_finite(x: Any) -> float:
    if not is_floating(getattr(x, "dtype", None)):
        return 0.0
    from .graph import plain_array

    values = np.abs(plain_array(x).astype(np.float64))
    values = values[np.isfinite(values)]
    return float(values.max()) if values.size else 0.0


def tolerance(path_dtype: np.dtype | None, check_tolerance: float) -> float:
    """``max(check_tolerance, ULPS * eps(path_dtype))``."""
    if path_dtype is None:
        return check_tolerance
    return max(check_tolerance, ULPS * _eps(path_dtype))


def mismatch(
    traced: Any, python: Any, tol: float, check_tolerance: float, involved: float = 0.0
) -> str:
    """Why two outputs disagree beyond the rule above (empty when they agree)."""
    from .graph import plain_array

    if isinstance(python, (bool, int, float, complex)):
        python = jnp.asarray(python)  # a Python number becomes a canonical-dtype array
    a, b = plain_array(traced), plain_array(python)
    if a.dtype != b.dtype and jax.dtypes.canonicalize_dtype(b.dtype) == a.dtype:
        # (a NumPy float64 input stays float64 run op by op; traced, JAX made it float32)
        b = b.astype(a.dtype)
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"traced {a.dtype}{list(a.shape)} against Python {b.dtype}{list(b.shape)}"
    if not is_floating(a.dtype):
        return "" if np.array_equal(a, b) else f"{int(np.sum(a != b))} elements differ"
    a64, b64 = (
        a.astype(np.complex128 if a.dtype.kind == "c" else np.float64),
        b.astype(np.complex128 if b.dtype.kind == "c" else np.float64),
    )
    magnitude = max(_largest_finite(b64.real), _largest_finite(b64.imag), involved)
    atol = max(check_tolerance, tol * magnitude)
    if np.allclose(a64, b64, rtol=tol, atol=atol, equal_nan=True):
        return ""
    abs_err = np.abs(a64 - b64)
    # (relative to a nonzero Python value only: against 0 it is no number, 2e304 said before)
    nonzero = np.abs(b64) > 0
    rel_err = abs_err[nonzero] / np.abs(b64[nonzero])
    relative = f"{np.nanmax(rel_err):.6g}" if rel_err.size else "none (the Python values are 0)"
    return (
        f"Largest absolute error: {np.nanmax(abs_err):.6g}, largest relative error: "
        f"{relative} (tolerance: relative {tol:g}, absolute {atol:g}, from the output's "
        f"magnitude {magnitude:g})"
    )
