"""Check 4 of ``trace``: PRNG keys captured as constants instead of taken as inputs.

A key closed over at trace time (typed, or raw uint32 key data) becomes a constant of the
program, and so does a key made inside from a fixed seed: every call draws the same numbers. The
check follows data dependence on the program's inputs, into sub-jaxprs, to the primitives that
draw bits, and warns for a draw whose key depends on no input.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from jamp import _compat as compat
from jamp import policy

from .errors import TracerWarning, caller_stacklevel

# Primitives that turn a key into random bits: which operands are keys.
DRAWS: dict[str, tuple[int, ...]] = {
    "random_bits": (0,),
    "threefry2x32": (0, 1),
    "rng_bit_generator": (0,),
}


def _sub_jaxpr_operands(eqn: Any) -> list[tuple[Any, list[Any]]]:
    """(sub-jaxpr, the equation's operands bound to its inputs) for each sub-jaxpr."""
    name = eqn.primitive.name
    if name == "cond":
        return [(b, list(eqn.invars[1:])) for b in eqn.params["branches"]]
    if name == "while":
        nc, nb = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
        carry = list(eqn.invars[nc + nb :])
        return [
            (eqn.params["cond_jaxpr"], list(eqn.invars[:nc]) + carry),
            (eqn.params["body_jaxpr"], list(eqn.invars[nc : nc + nb]) + carry),
        ]
    # Calls, scan, remat, custom rules, shard_map: a body taking the operands one to one.
    return [
        (sub, list(eqn.invars))
        for sub in compat.sub_jaxprs(eqn.params)
        if len(compat.open_and_consts(sub)[0].invars) == len(eqn.invars)
    ]


def _draw_line(eqn: Any) -> str:
    """The user's line an equation was traced from: JAX counts an installed library's frames
    (Flax's Dropout) as user code, so the innermost frame outside installed packages is named,
    with the library's line after it, as ``jamp.tune`` names a layer."""
    source = compat.source_line(eqn)
    try:
        frames = compat.user_frames(eqn)
    except Exception:  # (no traceback recorded): JAX's summary only
        return source
    own = policy.own_frame([(file, line) for file, line, _ in frames])
    if not frames or own is None or own == frames[0][:2]:
        return source
    function = next(fn for file, line, fn in frames if (file, line) == own)
    return f"{own[0]}:{own[1]} ({function}), inside {source}"


class _InputDependence:
    """Forward data dependence on the program's inputs; reports draws from input-free keys."""

    def __init__(self, report: Callable[[Any, str], None]) -> None:
        self.report = report  # (key aval, source line of the draw)

    def run(self, closed: Any, dependent_inputs: list[bool], outer_source: str) -> list[bool]:
        jaxpr, _ = compat.open_and_consts(closed)
        dependent = {id(v) for v, dep in zip(jaxpr.invars, dependent_inputs) if dep}

        def dep(var: Any) -> bool:
            return not isinstance(var, compat.Literal) and id(var) in dependent

        for eqn in jaxpr.eqns:
            source = _draw_line(eqn)
            if source.startswith("<"):  # inside jax.random: point at the caller's line
                source = outer_source
            name = eqn.primitive.name
            if name in DRAWS and not any(dep(eqn.invars[i]) for i in DRAWS[name]):
                self.report(eqn.invars[DRAWS[name][0]].aval, source)
            any_dep = any(dep(v) for v in eqn.invars)
            out_deps = [any_dep] * len(eqn.outvars)
            for sub, operands in _sub_jaxpr_operands(eqn):
                inner = self.run(sub, [dep(v) for v in operands], source)
                if len(inner) == len(eqn.outvars) and name not in ("cond", "while"):
                    out_deps = inner
            dependent.update(id(v) for v, d in zip(eqn.outvars, out_deps) if d)
        return [dep(v) for v in jaxpr.outvars]


def input_free_draws(closed: Any) -> list[tuple[Any, str]]:
    """(key aval, source line) for each draw whose key depends on no input of the program."""
    found: list[tuple[Any, str]] = []
    jaxpr, _ = compat.open_and_consts(closed)
    _InputDependence(lambda aval, where: found.append((aval, where))).run(
        closed, [True] * len(jaxpr.invars), "<unknown source>"
    )
    return found


def warn_constant_keys(closed: Any, name: str) -> None:
    """Warn once per trace when random bits are drawn from a key that depends on no input."""
    draws = input_free_draws(closed)
    if draws:
        aval, where = draws[0]
        warnings.warn(
            f"{name}: the PRNG key {aval.str_short()} drawn from at {where} is a constant of the "
            "trace (captured from outside, or made from a fixed seed inside), so every call of "
            "the traced function draws the same random numbers. Pass the key as an input "
            "instead: trace(fn, (key, x)).",
            TracerWarning,
            stacklevel=caller_stacklevel(),
        )
