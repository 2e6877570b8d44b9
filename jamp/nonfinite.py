"""``jamp.find_nonfinite``: the first equation of the mixed-precision program that turns finite
values into inf or NaN, why it ran in its dtype, and the narrowest change of policy that stops it.
An infinity the program writes on purpose (``jnp.where(mask, s, -jnp.inf)``) and passes on is
not one: the equation found is where a value first went out of range.

Example::

    found = jamp.find_nonfinite(loss_fn, params, batch, policy=policy, grad=True)
    if found is not None:
        print(found)                 # primitive, dtype, policy decision, scope, source line, ...
        policy = found.remedy.policy  # verified to make the call finite

How: one compiled pass of the instrumented program (``probe.py``) returns the index of the first
such equation and its loop iterations; only then is the program walked op by op up to it,
for the operand values. Remedies are verified with the same compiled pass.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from . import _compat as compat
from .interpreter import KEEP_TRACED_DTYPES, SHAPE_ONLY, is_float
from .policy import Policy
from .probe import (
    FINITE_PRESERVING,
    SIXTEEN_BIT,
    Observer,
    Program,
    Site,
    _is_library,
    bind,
    decision,
    forward_site,
    made_nonfinite,
    trace_program,
)

F32 = np.dtype(np.float32)


def _may_create_nonfinite(site: Site) -> bool:
    """False for the sites that cannot turn finite operands into inf or NaN (not measured)."""
    if site.primitive in FINITE_PRESERVING:
        return False
    return not (site.primitive == "convert_element_type" and _widening(site.eqn))


class _FirstNonFinite(Observer):
    """Compiled pass: (index of the first site that turned finite values into inf or NaN, or -1;
    its loop iterations)."""

    kind = "first_nonfinite"

    def init(self, n_sites: int, depth: int) -> Any:
        return jnp.int32(-1), jnp.zeros((depth,), jnp.int32)

    def measure(self, site, invals, outs, iters):
        if not _may_create_nonfinite(site):
            return None
        return ~made_nonfinite(site, invals, outs)  # (the fold reads True as fine)

    def fold(self, state, sites, measures, iters):
        first, where = state
        bad = ~jnp.stack(measures)
        batch_first = jnp.asarray([s.index for s in sites], jnp.int32)[jnp.argmax(bad)]
        hit = (first < 0) & jnp.any(bad)
        if iters:
            where = jnp.where(hit, jnp.stack([jnp.asarray(i, jnp.int32) for i in iters]), where)
        return jnp.where(hit, batch_first, first), where


def _widening(eqn: Any) -> bool:
    """A float-to-float cast that cannot overflow (to float32/float64, or bfloat16 -> float16 is
    not one: float16 has the smaller range)."""
    source, target = np.dtype(eqn.invars[0].aval.dtype), np.dtype(eqn.params["new_dtype"])
    return is_float(source) and is_float(target) and jnp.finfo(target).max >= jnp.finfo(source).max


class _Found(Exception):
    def __init__(self, site: Site, invals: Sequence[Any], outs: Sequence[Any], iters: tuple):
        super().__init__(site.index)
        self.site, self.invals, self.outs, self.iters = site, invals, outs, iters


class _StopAtNonFinite(Observer):
    """Eager walk: stops at the first site that turns finite values into inf or NaN (the test of
    the compiled pass, on concrete values); keeps the output range of each 16-bit lower-table
    site on the way (the producers of large values)."""

    kind = "eager"

    def __init__(self, lower: frozenset[str] = frozenset()) -> None:
        self.lower = lower
        self.ranges: dict[int, ValueRange] = {}  # id(eqn) -> its last output's range

    def measure(self, site, invals, outs, iters):
        if site.primitive in self.lower and site.sixteen_bit and outs:
            self.ranges[id(site.eqn)] = ValueRange.of(outs[0])
        if _may_create_nonfinite(site) and bool(made_nonfinite(site, invals, outs)):
            raise _Found(site, invals, outs, tuple(int(i) for i in iters))
        return None


@dataclasses.dataclass(frozen=True)
class ValueRange:
    """What an operand or output held: dtype, shape, min/max of the finite values, counts."""

    dtype: str
    shape: tuple
    min: float
    max: float
    nan: int
    inf: int

    @classmethod
    def of(cls, value: Any) -> ValueRange:
        array = np.asarray(value)
        wide = array.astype(np.float64) if is_float(array.dtype) else array
        finite = wide[np.isfinite(wide)] if is_float(array.dtype) else wide.ravel()
        nan = int(np.isnan(wide).sum()) if is_float(array.dtype) else 0
        inf = int(np.isinf(wide).sum()) if is_float(array.dtype) else 0
        lo, hi = (float(np.min(finite)), float(np.max(finite))) if finite.size else (np.nan, np.nan)
        return cls(np.dtype(array.dtype).name, tuple(array.shape), lo, hi, nan, inf)

    def __str__(self) -> str:
        counts = "".join(f", {n} {what}" for n, what in ((self.nan, "NaN"), (self.inf, "inf")) if n)
        values = (
            f"finite values in [{self.min:.6g}, {self.max:.6g}]"
            if self.min == self.min
            else "no finite values"
        )
        return f"{self.dtype}{list(self.shape)} {values}{counts}"


@dataclasses.dataclass(frozen=True)
class Remedy:
    """A change that makes the call finite: a policy (rule, fp32-table entry or, as a last resort,
    ``compute_dtype=float32``) or a loss scale.

    ``code`` is what to write; ``policy`` and ``loss_scale`` are the checked values;
    ``equations_changed`` counts the equations whose precision the change can affect.
    """

    kind: str
    code: str
    policy: Policy = dataclasses.field(repr=False)
    loss_scale: float | None = None
    equations_changed: int = 0
    why: str = ""  # what the change does and why it helps here, in words

    def __str__(self) -> str:
        return f"{self.kind}: {self.code}" + (f"\n      ({self.why})" if self.why else "")


@dataclasses.dataclass(frozen=True)
class Producer:
    """The matmul or convolution (lower-table op) whose outputs the first non-finite equation's
    operands came from, following them back through the program.

    ``share_of_max``: the largest magnitude among its outputs as a share of its dtype's maximum
    (0.64 for outputs reaching 42,000 in float16), None where it was not measured.
    """

    primitive: str
    dtype: str
    source: str
    caller: str | None
    scope: str
    output: ValueRange | None
    share_of_max: float | None

    def __str__(self) -> str:
        where = self.source + (f", called from {self.caller}" if self.caller else "")
        scope = f", scope {self.scope}" if self.scope else ""
        text = f"`{self.primitive}` -> {self.dtype} at {where}{scope}"
        if self.output is not None and self.share_of_max is not None:
            text += f": outputs {self.output}, {self.share_of_max:.2f} of {self.dtype}'s maximum"
        return text


@dataclasses.dataclass(frozen=True)
class NonFinite:
    """The first equation of a call that turned finite values into inf or NaN
    (``find_nonfinite``'s answer).

    Attributes:
      primitive, dtype: the equation's primitive and output dtype.
      decision: why it ran in that dtype (table, region, rule, operand dtypes).
      scope: its scope path (``jax.named_scope`` / Flax module names joined by ``/``).
      source: the source line it was traced from, e.g. ``model.py:12:8 (batch_norm)``.
      caller: when ``source`` is inside an installed library (a Flax layer), the innermost line
        of the user's own code that led there, else None.
      iterations: ``((loop primitive, iteration), ...)`` of the enclosing loops, outermost first.
      backward_of: for an equation of the backward pass, the forward equation it derives from
        (``"`rsqrt` at model.py:12:8 (f)"``), else None.
      operands, output: ranges of what went in and came out.
      float32_finite: whether the same equation on the same operands, computed in float32,
        makes no inf or NaN of them (None if it cannot run in float32).
      remedy: the narrowest verified change after which no equation makes inf or NaN, or None.
      tried: every change tried, with whether it made the call finite.
      produced_by: the matmul or convolution (lower-table op) the out-of-range operands came
        from (a :class:`Producer`), followed back through the program; None if none feeds it.
      producer_remedy: a verified change at that producer (its source line or scope in
        float32), when one makes the call finite; the fix at the cause rather than where the
        inf appeared.
    """

    primitive: str
    dtype: str
    decision: str
    scope: str
    source: str
    caller: str | None
    iterations: tuple
    backward_of: str | None
    operands: tuple
    output: tuple
    float32_finite: bool | None
    remedy: Remedy | None
    tried: tuple
    index: int
    produced_by: Producer | None = None
    producer_remedy: Remedy | None = None

    @property
    def equation(self) -> str:
        return (
            f"backward of {self.backward_of}"
            if self.backward_of
            else f"`{self.primitive}` at {self.source}"
        )

    def __str__(self) -> str:
        where = "".join(f", {name} iteration {i}" for name, i in self.iterations)
        lines = [
            f"first non-finite value: `{self.primitive}` -> {self.dtype} (equation "
            f"{self.index} in program order{where})"
        ]
        if self.backward_of:
            lines.append(f"  backward of {self.backward_of}")
        lines.append(f"  source:   {self.source}")
        if self.caller:
            lines.append(f"  called from {self.caller}")
        lines += [f"  scope:    {self.scope or '(top level)'}", f"  decision: {self.decision}"]
        lines += [f"  operand {i}: {r}" for i, r in enumerate(self.operands)]
        lines += [f"  output {i}:  {r}" for i, r in enumerate(self.output)]
        f32 = {True: "finite", False: "also non-finite", None: "could not be computed"}[
            self.float32_finite
        ]
        lines.append(f"  the same equation in float32 on these operands: {f32}")
        if self.produced_by is not None:
            lines.append(f"  its operands came from {self.produced_by}")
        if self.remedy is not None:
            lines.append(f"  remedy (verified, the call is then finite): {self.remedy}")
        if self.producer_remedy is not None and self.producer_remedy != self.remedy:
            lines.append(f"  remedy at that producer (verified): {self.producer_remedy}")
        if self.remedy is None and self.producer_remedy is None:
            lines.append("  no remedy found" + (", tried:" if self.tried else ""))
            lines += [f"    {r}" for r, _ in self.tried]
        return "\n".join(lines)


@compat.api_boundary  # (fn's errors show fn's frames, as under jax.jit)
def find_nonfinite(
    fn: Callable,
    *args: Any,
    policy: Policy | DTypeLike | None = None,
    grad: Any = False,
    max_remedies: int = 6,
    **kwargs: Any,
) -> NonFinite | None:
    """Run ``autocast_transform(fn, policy)(*args, **kwargs)`` and find the first equation that
    turns finite values into inf or NaN (an overflow, ``log(0)``, ``inf - inf``).

    An infinity the function writes on purpose, a ``-inf`` attention mask (a literal or a
    constant), and what it passes on (broadcasts, casts, selects, ``x - max``) is no such
    equation: a masked function whose values all stay in range, or that returns a ``-inf`` on
    purpose, reports None.

    Equations are checked in program order, inside jit, scan, while, cond, remat and
    custom_jvp/custom_vjp bodies, with the loop iteration. With ``grad=True`` (or an argument index
    or tuple of them) the checked program is ``jax.value_and_grad`` of the mixed-precision
    function, as it runs in training, and backward equations are covered too. Returns None when
    no equation makes an inf or NaN, else a :class:`NonFinite` whose ``remedy`` (if any) was
    checked: under it, no equation does. Up to ``max_remedies`` candidate changes are tried,
    narrowest first.

    Example::

        found = jamp.find_nonfinite(model.apply, variables, x, policy=jamp.Policy(jnp.float16))
        assert found is None, str(found)
    """
    from .transform import resolve_policy

    policy = resolve_policy(policy, where="find_nonfinite")
    max_remedies = _check_max_remedies(max_remedies)  # (before tracing, which may be slow)
    program, leaves = trace_program(fn, policy, grad, args, kwargs, "find_nonfinite")
    first, where = _first(program, leaves)
    if first < 0:
        return None
    sites = program.sites(_FirstNonFinite.kind)
    site = sites[first]
    walk = _StopAtNonFinite(frozenset(program.policy.lower))
    found = _drill_down(program, leaves, walk)
    if found is None:  # finite op by op: only the compiled program (XLA fusion) overflowed
        found = _Found(site, [], [], tuple(where))
    site = found.site
    f32 = _finite_in_float32(site, found.invals) if found.invals else None
    outputs = [ValueRange.of(v) for v in found.outs]
    # (an inf it made, not a -inf mask it passed on beside a NaN it made)
    overflow = (
        bool(made_nonfinite(site, found.invals, found.outs, nan=False))
        if found.invals
        else any(r.inf for r in outputs)
    )
    producer_site = _producer(program.policy, site, sites) if overflow else None
    producer, producer_remedy = None, None
    if producer_site is not None:
        producer = _describe_producer(producer_site, walk.ranges.get(id(producer_site.eqn)))
        if producer.share_of_max is not None and producer.share_of_max < _LARGE:
            producer = None  # its outputs were small: not named as what overflowed
    candidates = _candidates(program, site, sites, f32, overflow)
    if producer_site is not None and producer is None and f32:
        # Though its values were small, float32 at the producer hands the overflowing op (in
        # float32 on these operands, finite) float32 operands, and with them float32: a
        # candidate among the others, often far narrower than float32 throughout.
        extra = _producer_candidates(program, producer_site, sites, site, overflow)
        candidates = sorted(candidates + extra, key=lambda r: r.equations_changed)
    tried, remedy = [], None
    for candidate in candidates[:max_remedies]:
        ok = _verify(fn, candidate, program, leaves, grad, args, kwargs)
        tried.append((candidate, ok))
        if ok:
            remedy = candidate
            break
    if producer_site is not None and producer is not None:
        for candidate in _producer_candidates(program, producer_site, sites, site, overflow):
            ok = candidate == remedy or _verify(fn, candidate, program, leaves, grad, args, kwargs)
            tried.append((candidate, ok))
            if ok:
                producer_remedy = candidate
                break
    backward_of = None
    if site.backward:
        forward = forward_site(site, sites)
        backward_of = (
            f"`{forward.primitive}` at {forward.source}"
            if forward is not None
            else f"an equation at {site.source}"
        )
    return NonFinite(
        primitive=site.primitive,
        dtype=getattr(site.out_dtype, "name", str(site.out_dtype)),
        decision=_decision_text(program.policy, site, sites),
        scope=site.scope,
        source=site.source,
        caller=site.caller,
        iterations=tuple(zip(site.loops, found.iters)),
        backward_of=backward_of,
        operands=_operand_ranges(site, found.invals),
        output=tuple(outputs),
        float32_finite=f32,
        remedy=remedy,
        tried=tuple(tried),
        index=site.index,
        produced_by=producer,
        producer_remedy=producer_remedy,
    )


def _check_max_remedies(value: Any) -> int:
    """How many candidate remedies to verify: an int >= 0 (a string would fail in a slice, a
    negative count would drop candidates from the end of the list)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(
            "find_nonfinite(max_remedies=...) must be an int >= 0 (how many candidate remedies "
            f"to verify; 0 verifies none), got {type(value).__name__} {value!r}"
        )
    if value < 0:
        raise ValueError(
            f"find_nonfinite(max_remedies=...) must be >= 0 (0 verifies none), got {value}"
        )
    return int(value)


def _operand_ranges(site: Site, invals: Sequence[Any]) -> tuple[ValueRange, ...]:
    """A literal operand arrives as a Python number: shown in its traced dtype (float32[],
    not numpy's float64[])."""
    return tuple(
        ValueRange.of(
            np.asarray(v, getattr(var.aval, "dtype", None))
            if isinstance(var, compat.Literal)
            else v
        )
        for var, v in zip(site.eqn.invars, invals)
    )


def _first(program: Program, leaves: Sequence[Any], scale: float = 1.0) -> tuple[int, list[int]]:
    first, where = program.run(_FirstNonFinite(), leaves, scale)
    return int(first), [int(i) for i in np.asarray(where)]


def _drill_down(
    program: Program, leaves: Sequence[Any], observer: _StopAtNonFinite
) -> _Found | None:
    try:
        program.walk_eagerly(observer, leaves)
    except _Found as found:
        # (without its traceback: the frames it holds, ours included, would hold it in a
        # reference cycle, and with it the program's arrays until a full collection)
        return found.with_traceback(None)
    return None


def _decision_text(policy: Policy, site: Site, sites: dict[int, Site]) -> str:
    if not site.backward:
        return decision(policy, site)
    forward = forward_site(site, sites)
    if forward is None:
        return "derived by jax.grad"
    return (
        f"derived by jax.grad from the forward `{forward.primitive}` ({decision(policy, forward)})"
    )


# --- the same equation in float32 ---------------------------------------------------------------

_DTYPE_PARAMS = ("new_dtype", "preferred_element_type")


def _finite_in_float32(site: Site, invals: Sequence[Any]) -> bool | None:
    """Whether the equation, its 16-bit operands and dtype params widened to float32, makes no
    inf or NaN of finite values (a -inf mask it passes on stays, in any dtype)."""
    eqn = site.eqn
    widened = [
        jnp.asarray(v, F32) if hasattr(v, "dtype") and np.dtype(v.dtype) in SIXTEEN_BIT else v
        for v in invals
    ]
    params = {
        k: (F32 if k in _DTYPE_PARAMS and v is not None and np.dtype(v) in SIXTEEN_BIT else v)
        for k, v in eqn.params.items()
    }
    try:
        outs = bind(eqn.replace(params=params), widened)
    except Exception:  # a primitive whose params pin its operand dtypes
        return None
    return not bool(made_nonfinite(site, widened, outs))


# --- remedies -----------------------------------------------------------------------------------


def _glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


_NOT_A_TABLE_REMEDY = SHAPE_ONLY | KEEP_TRACED_DTYPES | {"convert_element_type"}


def _ancestors(site: Site, sites: dict[int, Site], limit: int = 24) -> list[Site]:
    """Leaf equations of the same jaxpr that feed ``site``, nearest first."""
    by_eqn = {id(s.eqn): s for s in sites.values() if s.jaxpr is site.jaxpr}
    producer = {id(v): e for e in site.jaxpr.eqns for v in e.outvars}
    seen: set[int] = set()
    queue = [site.eqn]
    out: list[Site] = []
    while queue and len(out) < limit:
        eqn = queue.pop(0)
        for v in eqn.invars:
            parent = producer.get(id(v))
            if parent is None or id(parent) in seen:
                continue
            seen.add(id(parent))
            if id(parent) in by_eqn:
                out.append(by_eqn[id(parent)])
            queue.append(parent)
    return out


def _table_candidate(
    policy: Policy, name: str, sites: dict[int, Site], site: Site, overflow: bool
) -> Remedy:
    changes = {"fp32": policy.fp32 | {name}}
    code = f'policy.replace(fp32=policy.fp32 | {{"{name}"}}'
    if name in policy.promote:
        changes["promote"] = policy.promote - {name}
        code += f', promote=policy.promote - {{"{name}"}}'
    changed = sum(1 for s in sites.values() if s.primitive == name and s.sixteen_bit)
    every = f"runs every `{name}` ({_count(changed)}) in float32"
    promoted = (
        f" (the promote table runs `{site.primitive}` in the widest dtype its operands arrive in)"
        if policy.category(site.primitive) == "promote"
        else ""
    )
    why = (
        f"{every}: the one that overflowed {_dtype_name(site)} is finite in float32"
        if name == site.primitive
        else f"{every}: one of them computes a value the {_bad(overflow)} `{site.primitive}` "
        f"uses, which then arrives in float32{promoted}"
    )
    return Remedy(
        "fp32-table entry",
        code + ")",
        policy.replace(**changes),
        equations_changed=changed,
        why=why,
    )


def _bad(overflow: bool) -> str:
    return "overflowing" if overflow else "non-finite"


def _scope_remedy(policy: Policy, path: Sequence[str], sites: dict, included: str) -> Remedy:
    """A rule running everything under the scope ``path`` in float32; ``included`` says which
    operation of the report that takes in."""
    pattern = "/".join(_glob_escape(p) for p in path)
    depth = len(path)
    # (the equations whose precision it changes: those in 16 bits, as "compute dtype" counts)
    changed = sum(
        1 for s in sites.values() if s.sixteen_bit and tuple(s.state.path[:depth]) == tuple(path)
    )
    return Remedy(
        "rule",
        f'policy.replace(rules=policy.rules + (("{pattern}", jnp.float32),))',
        policy.replace(rules=policy.rules + ((pattern, jnp.float32),)),
        equations_changed=changed,
        why=f"runs everything under scope {pattern} ({_count(changed)}) in float32, {included}",
    )


def _count(n: int) -> str:
    return f"{n} equation{'s' if n != 1 else ''}"


def _dtype_name(site: Site) -> str:
    return getattr(site.out_dtype, "name", str(site.out_dtype))


def _candidates(
    program: Program, site: Site, sites: dict[int, Site], f32: bool | None, overflow: bool
) -> list[Remedy]:
    """Changes that could make the call finite, fewest equations affected first."""
    policy = program.policy
    out: list[Remedy] = []
    if site.backward and site.sixteen_bit and f32 and program.argnums is not None:
        # The forward pass was finite: scaling the loss down keeps the cotangents in range.
        for exponent in (4, 8, 12, 16):
            out.append(
                Remedy(
                    "loss scale",
                    f"jamp.StaticLossScale(2.0 ** -{exponent})",
                    policy,
                    loss_scale=2.0**-exponent,
                    why=f"multiplies the loss by 2**-{exponent} before differentiating: the "
                    "forward pass is finite and the inf appeared in the backward pass, whose "
                    f"{_dtype_name(site)} cotangents are then {2**exponent} times smaller "
                    "(unscale the gradients by the same factor: jamp.scaled_value_and_grad does)",
                )
            )
    tabled = set()
    for s in ([site] if site.sixteen_bit and f32 else []) + _ancestors(site, sites):
        name = s.primitive
        if (
            s.sixteen_bit
            and name not in tabled
            and name not in _NOT_A_TABLE_REMEDY
            and policy.category(name) in (None, "promote")
        ):
            tabled.add(name)
            out.append(_table_candidate(policy, name, sites, site, overflow))
    path = site.state.path
    for depth in range(len(path), 0, -1):
        out.append(
            _scope_remedy(
                policy, path[:depth], sites, f"the `{site.primitive}` that overflowed included"
            )
        )
    if site.primitive in policy.lower and site.sixteen_bit and f32:
        # a matmul/conv whose float16 output overflowed: float32 at its line (after the scope
        # rules, which win a tie: a module path reads better than a line number)
        out.extend(
            r
            for r in _producer_candidates(program, site, sites, site, overflow)
            if r.kind != "rule"
        )
    if policy.compute_dtype != F32:
        # Last resort, when nothing narrower works: no mixed precision at all (and no 16-bit
        # accumulation or reduction, which a float32 policy refuses).
        in_float32 = policy.with_compute_dtype(jnp.float32)
        dropped = [
            f", {field}=None"
            for field in ("accumulate_dtype", "reduce_dtype")
            if getattr(policy, field) is not None and getattr(in_float32, field) is None
        ]
        out.append(
            Remedy(
                "compute dtype",
                f"policy.replace(compute_dtype=jnp.float32{''.join(dropped)})",
                in_float32,
                equations_changed=sum(s.sixteen_bit for s in sites.values()),
                why="turns mixed precision off: every operation runs in float32 (the last "
                "resort, tried when no narrower change is)",
            )
        )
    return sorted(out, key=lambda r: r.equations_changed)  # stable: milder loss scales first


# --- the producer of the out-of-range values -----------------------------------------------------

# A producer is named when its outputs reached this share of their dtype's maximum: smaller
# values are not what overflowed downstream (a product or a sum of values near 1% of float16's
# maximum already overflows only when it multiplies them by ~100).
_LARGE = 0.01


def _producer(policy: Policy, site: Site, sites: dict[int, Site]) -> Site | None:
    """The nearest 16-bit lower-table equation (matmul, conv) that ``site``'s operands were
    computed from, in its jaxpr (the operands followed back, breadth first)."""
    if site.primitive in policy.lower:
        return None  # the matmul itself overflowed: it is its own producer
    for ancestor in _ancestors(site, sites, limit=400):
        if ancestor.primitive in policy.lower and ancestor.sixteen_bit:
            return ancestor
    return None


def _describe_producer(site: Site, output: ValueRange | None) -> Producer:
    share = None
    if output is not None and output.min == output.min:  # some finite values
        largest = max(abs(output.min), abs(output.max))
        share = largest / float(jnp.finfo(site.out_dtype).max)
    return Producer(
        site.primitive, _dtype_name(site), site.source, site.caller, site.scope, output, share
    )


def _own_line(site: Site) -> tuple[str, int] | None:
    """The innermost frame of the user's own code the equation was traced from."""
    for file, line, _ in site.frames:
        if not _is_library(file):
            return file, line
    return None


def _producer_candidates(
    program: Program, producer: Site, sites: dict[int, Site], site: Site, overflow: bool
) -> list[Remedy]:
    """Float32 at the producer: its scope (a rule on its module path), then its source line (a
    '@file:line' rule)."""
    policy = program.policy
    out = []
    own = _own_line(producer)
    what = (
        f"the `{producer.primitive}` that overflowed"
        if producer is site
        else f"the `{producer.primitive}` whose outputs the {_bad(overflow)} `{site.primitive}` "
        "uses"
    )
    if producer.state.path:
        out.append(
            _scope_remedy(
                policy,
                producer.state.path,
                sites,
                f"{what} included: its outputs are then float32",
            )
        )
    if own is not None:
        file, line = own
        glob = f"@{_glob_escape(os.path.basename(file))}:{line}"
        changed = sum(
            1 for s in sites.values() if (file, line) in [f[:2] for f in compat.user_frames(s.eqn)]
        )
        out.append(
            Remedy(
                "line rule",
                f'policy.replace(rules=policy.rules + (("{glob}", jnp.float32),))',
                policy.replace(rules=policy.rules + ((glob, jnp.float32),)),
                equations_changed=changed,
                why=f"runs the operations traced from {os.path.basename(file)}:{line} "
                f"({_count(changed)}) in float32, {what} among them: its outputs, and what is "
                "computed from them, are then float32",
            )
        )
    return out


def _verify(
    fn: Callable,
    remedy: Remedy,
    program: Program,
    leaves: Sequence[Any],
    grad: Any,
    args: tuple,
    kwargs: dict,
) -> bool:
    """Whether, under the remedy, no equation of the call turns finite values into inf or NaN
    (one compiled pass: the test that found the site, so the remedied call reports nothing;
    an infinity the function returns on purpose, a fully masked row's -inf, does not count)."""
    if remedy.loss_scale is not None:
        return _first(program, leaves, remedy.loss_scale)[0] < 0
    fixed, _ = trace_program(fn, remedy.policy, grad, args, kwargs, "find_nonfinite")
    return _first(fixed, leaves)[0] < 0
