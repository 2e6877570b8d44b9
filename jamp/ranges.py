"""``jamp.value_ranges``: how close every 16-bit value of a call came to overflow and underflow.

Example::

    ranges = jamp.value_ranges(loss_fn, params, batch, policy=policy, grad=True)
    print(ranges)                       # closest to overflow first, then float16 underflow
    worst = ranges.entries[0]           # .max_fraction: largest |x| / the dtype's max

One compiled pass of the instrumented program (``probe.py``), loops included (maxima and counts
accumulate over iterations).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from . import _compat as compat
from .policy import Policy
from .probe import (
    FINITE_PRESERVING,
    Observer,
    Site,
    decision,
    forward_site,
    made_nonfinite,
    trace_program,
)

F16 = np.dtype(np.float16)
# |x| below half the smallest float16 subnormal rounds to zero; below the smallest normal it
# keeps fewer than 11 significant bits.
_F16_FLUSH = float(jnp.finfo(jnp.float16).smallest_subnormal) / 2
_F16_NORMAL = float(jnp.finfo(jnp.float16).smallest_normal)
_F16_MAX = float(jnp.finfo(jnp.float16).max)


def _measured(site: Site) -> bool:
    return site.sixteen_bit and site.primitive not in MOVES_VALUES


class _Ranges(Observer):
    """Per 16-bit site: max |x| (inf where it holds an overflow; not for the -inf of a mask),
    and counts of nonzero / float16-flushing / subnormal values."""

    kind = "ranges"

    def init(self, n_sites: int, depth: int) -> Any:
        return (jnp.zeros((n_sites,), jnp.float32),) + (jnp.zeros((n_sites,), jnp.int32),) * 3

    def measure(self, site, invals, outs, iters):
        if not _measured(site):
            return None
        values = [
            jnp.abs(o.astype(jnp.float32)).ravel()
            for o in outs
            if hasattr(o, "dtype") and o.dtype == site.out_dtype
        ]
        x = jnp.concatenate(values) if len(values) > 1 else values[0]
        nz = x != 0
        if not site.deliberate_nonfinite:
            largest = jnp.max(jnp.where(jnp.isnan(x), 0.0, x), initial=0.0)
        else:  # a -inf mask is no overflow: inf only where this equation made one
            largest = jnp.max(jnp.where(jnp.isfinite(x), x, 0.0), initial=0.0)
            if site.primitive not in FINITE_PRESERVING:
                made = made_nonfinite(site, invals, outs, nan=False)
                largest = jnp.where(made, jnp.inf, largest)
        return (
            largest,
            jnp.sum(nz, dtype=jnp.int32),
            jnp.sum(nz & (x <= _F16_FLUSH), dtype=jnp.int32),
            jnp.sum(nz & (x < _F16_NORMAL), dtype=jnp.int32),
        )

    def fold(self, state, sites, measures, iters):
        ids = jnp.asarray([s.index for s in sites], jnp.int32)
        peak, *counts = state
        stacked = [jnp.stack(column) for column in zip(*measures)]
        return (
            peak.at[ids].max(stacked[0]),
            *(c.at[ids].add(new) for c, new in zip(counts, stacked[1:])),
        )


# Only move or copy values: their range is their operand's (listed under its own equation), so
# they are neither measured nor listed.
MOVES_VALUES = frozenset(
    {
        "reshape",
        "broadcast_in_dim",
        "squeeze",
        "expand_dims",
        "transpose",
        "copy",
        "copy_p",
        "rev",
        "optimization_barrier",
        "sharding_constraint",
    }
)


@dataclasses.dataclass(frozen=True)
class RangeEntry:
    """One 16-bit equation of the call (values of all loop iterations together).

    Attributes:
      max_abs: largest magnitude, inf if it overflowed (an infinity the program writes on
        purpose, a ``-inf`` mask, is no overflow and left out); max_fraction: that over the
        dtype's max.
      flush_share: share of the nonzero values that would round to zero in float16.
      subnormal_share: share of the nonzero values below float16's smallest normal number.
      backward_of: for an equation of the backward pass, the forward equation it derives from.
    """

    primitive: str
    dtype: str
    scope: str
    source: str
    caller: str | None
    backward_of: str | None
    decision: str
    max_abs: float
    max_fraction: float
    flush_share: float
    subnormal_share: float
    nonzero: int
    index: int

    @property
    def float16_fraction(self) -> float:
        """``max_abs`` over float16's maximum (65504): above 1 it overflows in float16."""
        return self.max_abs / _F16_MAX

    @property
    def where(self) -> str:
        scope = f" [{self.scope}]" if self.scope else ""
        if self.backward_of:
            return f"{self.dtype}{scope} backward of {self.backward_of}"
        return f"{self.dtype}{scope} `{self.primitive}` at {self.caller or self.source}"


@dataclasses.dataclass(frozen=True)
class Ranges:
    """``value_ranges``'s answer: ``entries`` sorted closest-to-overflow first (overflows in
    their own dtype, then by largest magnitude relative to float16's maximum)."""

    policy: Policy
    entries: tuple

    @property
    def overflows(self) -> list[RangeEntry]:
        return [e for e in self.entries if e.max_fraction >= 1]

    @property
    def underflows(self) -> list[RangeEntry]:
        """Entries with values that flush to zero in float16, most first."""
        return sorted(
            (e for e in self.entries if e.flush_share > 0), key=lambda e: (-e.flush_share, e.index)
        )

    def __str__(self, top: int = 10) -> str:
        lines = [
            f"jamp.value_ranges ({len(self.entries)} 16-bit equations, compute dtype "
            f"{self.policy.compute_dtype.name})",
            "closest to overflow (largest |x| over the dtype's max, and over float16's):",
            f"  {'max |x|':>10}  {'/ max':>9}  {'/ f16 max':>9}  equation",
        ]
        lines += [
            f"  {e.max_abs:10.4g}  {e.max_fraction:9.3g}  {e.float16_fraction:9.3g}  {e.where}"
            for e in self.entries[:top]
        ]
        under = self.underflows
        lines.append(
            "flushed to zero in float16 (share of nonzero values)" + (":" if under else ": none")
        )
        lines += [f"  {e.flush_share:10.1%}  {e.where}" for e in under[:top]]
        if any(e.backward_of for e in under):
            lines.append(
                "backward equations lose gradients to float16 underflow: a loss scale "
                "(jamp.DynamicLossScale) matters here"
            )
        return "\n".join(lines)


@compat.api_boundary  # (fn's errors show fn's frames, as under jax.jit)
def value_ranges(
    fn: Callable,
    *args: Any,
    policy: Policy | DTypeLike | None = None,
    grad: Any = False,
    **kwargs: Any,
) -> Ranges:
    """Run ``autocast_transform(fn, policy)(*args, **kwargs)`` and measure every 16-bit value.

    For each equation with a bfloat16/float16 output: the largest magnitude as a fraction of the
    dtype's maximum (infinite where the equation overflowed; a ``-inf`` mask the program writes on
    purpose is no overflow), and the shares of nonzero values that flush to zero (or go
    subnormal) in float16. Equations that only move values (reshape, transpose, broadcast, ...)
    are not listed: their values are their operand's. ``grad`` as in
    :func:`jamp.find_nonfinite` covers the backward pass.

    Example::

        print(jamp.value_ranges(model.apply, variables, x, policy=jamp.Policy(jnp.float16)))
    """
    from .transform import resolve_policy

    policy = resolve_policy(policy, where="value_ranges")
    program, leaves = trace_program(fn, policy, grad, args, kwargs, "value_ranges")
    peak, nonzero, flushed, subnormal = (np.asarray(a) for a in program.run(_Ranges(), leaves))
    sites = program.sites(_Ranges.kind)
    entries = [
        _entry(
            policy, site, sites, float(peak[i]), int(nonzero[i]), int(flushed[i]), int(subnormal[i])
        )
        for i, site in sorted(sites.items())
        if _measured(site)
    ]
    # Real overflows first, then what would overflow (or come closest to it) in float16.
    entries.sort(key=lambda e: (-min(e.max_fraction, 1.0), -e.float16_fraction, e.index))
    return Ranges(policy, tuple(entries))


def _entry(
    policy: Policy,
    site: Site,
    sites: dict[int, Site],
    peak: float,
    nonzero: int,
    flushed: int,
    subnormal: int,
) -> RangeEntry:
    forward = forward_site(site, sites) if site.backward else None
    backward_of = (
        None
        if not site.backward
        else f"`{forward.primitive}` at {forward.caller or forward.source}"
        if forward is not None
        else f"an equation at {site.source}"
    )
    share = lambda n: n / nonzero if nonzero else 0.0
    dtype_name = getattr(site.out_dtype, "name", str(site.out_dtype))
    return RangeEntry(
        site.primitive,
        dtype_name,
        site.scope,
        site.source,
        site.caller,
        backward_of,
        decision(policy, site),
        peak,
        peak / float(jnp.finfo(site.out_dtype).max),
        share(flushed),
        share(subnormal),
        nonzero,
        site.index,
    )
