"""Weight-only quantization: matmul and convolution kernels stored in 8 or 4 bits with scales.

After constant folding (and BatchNorm folding) a kernel is a constant operand of a
``dot_general`` or ``conv_general_dilated`` whose other operand is not constant. This pass stores
it in a narrow format with float scales and puts the dequantization into the program right
before the product: ``convert(q, dtype) * scale``, in the dtype the product read the kernel in
(the policy's compute dtype under ``policy=``, else the kernel's own), so the product itself is
unchanged. Formats (``FORMATS``, a registry keyed by dtype):

- ``int8``: symmetric, one scale per output channel (per index of the kernel's non-contracted
  dims): ``q = round(w / s)`` in ``[-127, 127]``, ``s = amax / 127``.
- ``int4``: symmetric, one scale per output channel and group of at most 128 consecutive
  entries along the contracted dims (flattened, split into equal groups of an even size: 300
  entries are 3 groups of 100), values in ``[-7, 7]``. ``jax.export`` stores a ``jnp.int4``
  constant one byte a value, so the values are packed two a byte into an int8 array and
  unpacked in the program by shifts.
- ``float8_e4m3fn``: one scale per output channel, ``s = amax / 448`` (the format's max).

Scales are stored in the dtype of the dequantized kernel. What stays as it was: kernels that
are not floating or are 8 bits already (a float8 policy's), float64 kernels (never cast), a
constant with any other use than as a kernel (a tied embedding also read by a gather), biases,
norms and everything else that does not feed a product as its kernel, and products inside loop
or branch bodies (only the top level of the program is rewritten, as ``fold_batchnorm`` does).

This is the last pass of ``freeze``: nothing folds the dequantization back into a wide constant
(``fold_constants`` also keeps a widening convert of an 8-bit constant for run time).

Which kernel gets which format is decided by rules, as ``jamp.Policy.rules`` decides a scope's
dtype: ``(glob, dtype or None)`` pairs matched against the ``/``-joined scope path of the product
(Flax module paths, ``jax.named_scope`` names; not the scope ``jnp.einsum`` names by its
subscripts), shallow to deep (a rule matching a deeper scope overrides one matching its parent;
at one scope the later rule wins), ``'@file.py:12'`` rules against the source lines of products
outside any scope rule, and a glob matching the empty path (``'*'``) for kernels outside every
scope.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import math
import os
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jamp import _compat as compat
from jamp.policy import (
    LINE_RULE,
    UnmatchedRuleWarning,
    check_rule_glob,
    is_line_rule,
    line_rule_hits,
    own_frame,
)

from ..errors import caller_stacklevel
from .fold_constants import bind

GROUP = 128  # int4: entries along the contraction sharing a scale (torchao's and qwix's default)


@dataclasses.dataclass(frozen=True)
class Format:
    """How one stored dtype quantizes a ``(contracted, kept)`` float32 matrix and dequantizes it.

    ``quantize(matrix, scale_dtype) -> (stored, scale)``: the stored array and the scales;
    ``dequantize(stored, scale, rows, dtype) -> matrix`` builds the ``(rows, kept)`` kernel in
    ``dtype`` inside the program being traced."""

    name: str
    granularity: str
    quantize: Callable[[np.ndarray, np.dtype], tuple[np.ndarray, np.ndarray]]
    dequantize: Callable[[Any, Any, int, np.dtype], Any]


def _scales(raw: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Scales as stored (in ``dtype``; 1 where a channel is all zeros), rounded up where
    ``dtype`` rounds them down: a tiny channel's scale (``amax / 448`` below float16's smallest
    value) would otherwise be 0, and its weights 0/0 = NaN or clipped to 0."""
    scale = raw.astype(dtype)
    up = np.nextafter(scale, np.asarray(np.inf, dtype))
    scale = np.where(scale.astype(np.float32) < raw, up, scale)
    return np.where(raw > 0, scale, np.ones((), dtype))


def _int8_quantize(m: np.ndarray, scale_dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    scale = _scales(np.max(np.abs(m), axis=0, keepdims=True) / 127, scale_dtype)
    q = np.clip(np.rint(m / scale.astype(np.float32)), -127, 127).astype(np.int8)
    return q, scale


def _float8_quantize(m: np.ndarray, scale_dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    top = float(jnp.finfo(jnp.float8_e4m3fn).max)
    scale = _scales(np.max(np.abs(m), axis=0, keepdims=True) / top, scale_dtype)
    q = np.clip(m / scale.astype(np.float32), -top, top).astype(jnp.float8_e4m3fn)
    return q, scale


def _plain_dequantize(stored: Any, scale: Any, rows: int, dtype: np.dtype) -> Any:
    return jax.lax.convert_element_type(stored, dtype) * scale


def _int4_group(rows: int) -> int:
    """Equal groups of at most ``GROUP`` rows, an even number each (pairs share a byte): a
    3x3x16 convolution's 144 rows are two groups of 72, not 128 and 16 padded to 256."""
    groups = -(-rows // GROUP)
    group = -(-rows // groups)
    return group + group % 2


def _int4_quantize(m: np.ndarray, scale_dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    rows, kept = m.shape
    group = _int4_group(rows)
    padded = -(-rows // group) * group
    groups = np.pad(m, ((0, padded - rows), (0, 0))).reshape(padded // group, group, kept)
    scale = _scales(np.max(np.abs(groups), axis=1, keepdims=True) / 7, scale_dtype)
    q = np.clip(np.rint(groups / scale.astype(np.float32)), -7, 7).astype(np.int8)
    pairs = q.reshape(padded // 2, 2, kept)  # consecutive rows share a byte: low, high nibble
    return (pairs[:, 0] & np.int8(0xF)) | (pairs[:, 1] << np.int8(4)), scale


def _int4_dequantize(packed: Any, scale: Any, rows: int, dtype: np.dtype) -> Any:
    four = np.int8(4)
    low = jax.lax.shift_right_arithmetic(jax.lax.shift_left(packed, four), four)  # sign-extend
    high = jax.lax.shift_right_arithmetic(packed, four)
    half, kept = packed.shape
    q = jnp.stack([low, high], axis=1).reshape(scale.shape[0], 2 * half // scale.shape[0], kept)
    w = (jax.lax.convert_element_type(q, dtype) * scale).reshape(2 * half, kept)
    return w[:rows] if rows != 2 * half else w


INT4 = np.dtype(jnp.int4)
FORMATS: dict[np.dtype, Format] = {
    np.dtype(np.int8): Format("int8", "per output channel", _int8_quantize, _plain_dequantize),
    INT4: Format(
        "int4",
        f"per output channel and group of up to {GROUP} along the contraction",
        _int4_quantize,
        _int4_dequantize,
    ),
    np.dtype(jnp.float8_e4m3fn): Format(
        "float8_e4m3fn", "per output channel", _float8_quantize, _plain_dequantize
    ),
}


def weight_dtype(value: Any, where: str) -> np.dtype | None:
    """``value`` as a key of ``FORMATS`` (None stays None), or a ValueError naming ``where``."""
    if value is None:
        return None
    try:
        dtype = np.dtype(value)
    except TypeError:
        dtype = None
    if dtype not in FORMATS:
        allowed = ", ".join(f"jnp.{d.name}" for d in FORMATS)
        hint = (
            "; float8 weights are stored as float8_e4m3fn (e5m2 is a gradient format)"
            if dtype is not None and dtype.name.startswith("float8")
            else ""
        )
        raise ValueError(
            f"{where}: cannot store weights as {getattr(value, '__name__', value)!r}; weight "
            f"formats are {allowed} (or None: keep as frozen){hint}"
        )
    return dtype


Rules = tuple[tuple[str, "np.dtype | None"], ...]


def weight_rules(weights: Any, where: str = "freeze") -> Rules:
    """``weights=`` as rules: a dtype is ``(("*", dtype),)``; ``(glob, dtype or None)`` pairs as
    given; a ``jamp.tune_weights`` result (anything with ``weights_rules``) its rules."""
    rules = getattr(weights, "weights_rules", None)
    if rules is not None:
        weights = rules
    if isinstance(weights, Iterator):  # a generator of pairs: its order is the rules' order
        weights = tuple(weights)
    _check_rules_form(weights, where)
    if isinstance(weights, (str, type, np.dtype)) or not isinstance(weights, Sequence):
        return (("*", weight_dtype(weights, f"{where}(weights=...)")),)
    out = []
    for i, rule in enumerate(weights):
        if not (isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str)):
            raise TypeError(
                f"{where}: weights[{i}] must be a (glob, dtype or None) pair such as "
                f"('*head*', None) or ('*', jnp.int8), got {rule!r}"
            )
        glob = rule[0]
        # As Policy.rules refuses them: matched as a glob, it would quantize nothing.
        check_rule_glob(glob, f"{where}: weights[{i}][0]")
        out.append((glob, weight_dtype(rule[1], f"{where}: weights[{i}][1]")))
    return tuple(out)


_RULES_FORM = (
    "weights= takes a dtype, a sequence of (glob, dtype or None) pairs (at one scope the later "
    "rule wins) or a jamp.tune_weights result"
)


def _check_rules_form(weights: Any, where: str) -> None:
    """A TypeError with the form to write for rules given in a form that reads naturally but is
    not one (a dict, a set, a single pair), instead of a dtype error or a wrong rule number."""
    if isinstance(weights, Mapping):
        pairs = [_pair_text(glob, dtype) for glob, dtype in weights.items()]
        raise TypeError(
            f"{where}: {_RULES_FORM}, got a {type(weights).__name__}; write "
            f"weights=({', '.join(pairs)}{',' if len(pairs) == 1 else ''})"
        )
    if isinstance(weights, AbstractSet):  # no order, so no rule could be the later one
        pairs = [_pair_text(*rule) if _is_pair(rule) else repr(rule) for rule in weights]
        raise TypeError(
            f"{where}: {_RULES_FORM}, got a {type(weights).__name__}, which has no order; "
            f"write a tuple with the rules in the order you mean, e.g. "
            f"weights=({', '.join(pairs)}{',' if len(pairs) == 1 else ''})"
        )
    if _is_pair(weights) and not isinstance(weights[1], (tuple, list)):
        pair = _pair_text(*weights)
        raise TypeError(
            f"{where}: {_RULES_FORM}, got the single pair {pair}: write weights=({pair},)"
        )


def _is_pair(value: Any) -> bool:
    return isinstance(value, (tuple, list)) and len(value) == 2 and isinstance(value[0], str)


def _pair_text(glob: Any, dtype: Any) -> str:
    """``('*head*', jnp.int8)``: a rule as the user would write it (their value if no format)."""
    try:
        stored = weight_dtype(dtype, "weights")
    except ValueError:
        return repr((glob, dtype))
    return f"({glob!r}, {'None' if stored is None else f'jnp.{stored.name}'})"


def decide(rules: Rules, path: Sequence[str], frames: Sequence[tuple[str, int]]) -> tuple:
    """(decided, dtype or None, indices of the rules that matched) for a product at ``path``
    traced from ``frames``: as ``Policy.rules`` decides (see the module docstring)."""
    matched: set[int] = set()
    decided, dtype = False, None
    for depth in range(1, len(path) + 1):
        joined = "/".join(path[:depth])
        new = [
            i
            for i, (glob, _) in enumerate(rules)
            if i not in matched and not is_line_rule(glob) and fnmatch.fnmatchcase(joined, glob)
        ]
        if new:
            matched.update(new)
            decided, dtype = True, rules[new[-1]][1]
    if decided:
        return True, dtype, matched
    for file, line in frames:
        hits = line_rule_hits(file, line, rules)
        if hits:
            return True, rules[hits[-1]][1], matched | set(hits)
    if not path:
        hits = [i for i, (glob, _) in enumerate(rules) if fnmatch.fnmatchcase("", glob)]
        if hits:
            return True, rules[hits[-1]][1], matched | set(hits)
    return False, None, matched


# --- where the kernels are --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Layout:
    """A kernel seen as a ``(contracted, kept)`` matrix: ``perm`` puts the contracted dims first."""

    perm: tuple[int, ...]
    shape: tuple[int, ...]
    rows: int  # entries along the contraction

    def matrix(self, kernel: np.ndarray) -> np.ndarray:
        return np.transpose(kernel, self.perm).reshape(self.rows, -1)

    def kernel(self, matrix: Any) -> Any:
        permuted = matrix.reshape([self.shape[d] for d in self.perm])
        if self.perm == tuple(range(len(self.perm))):
            return permuted
        return jnp.transpose(permuted, tuple(int(d) for d in np.argsort(self.perm)))


def _layout(shape: tuple[int, ...], contracted: Sequence[int]) -> Layout:
    kept = [d for d in range(len(shape)) if d not in contracted]
    perm = (*contracted, *kept)
    return Layout(tuple(perm), tuple(shape), math.prod(shape[d] for d in contracted))


# primitive name -> site(eqn, is_constant) -> (kernel operand index, its layout) or None
SITES: dict[str, Callable[[Any, Callable[[Any], bool]], tuple[int, Layout] | None]] = {}


def site(name: str) -> Callable:
    def wrap(rule: Callable) -> Callable:
        SITES[name] = rule
        return rule

    return wrap


@site("dot_general")
def dot_site(eqn: Any, is_constant: Callable[[Any], bool]) -> tuple[int, Layout] | None:
    constant = [is_constant(v) for v in eqn.invars]
    if constant not in ([False, True], [True, False]):
        return None
    k = constant.index(True)
    contracting = eqn.params["dimension_numbers"][0][k]
    return k, _layout(eqn.invars[k].aval.shape, tuple(contracting))


@site("conv_general_dilated")
def conv_site(eqn: Any, is_constant: Callable[[Any], bool]) -> tuple[int, Layout] | None:
    lhs, rhs = eqn.invars
    if is_constant(lhs) or not is_constant(rhs):
        return None
    out_axis, *contracted = eqn.params["dimension_numbers"].rhs_spec  # (out, in, *spatial)
    return 1, _layout(rhs.aval.shape, tuple(contracted))


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One quantizable kernel: where it is read, and what ``freeze`` stored for it.

    ``scope`` is the product's scope path (``"Model/head"``) or, outside scopes, its source line
    (``"@model.py:12"``); ``stored`` the stored dtype name (``"int4"`` values are packed two a
    byte), ``nbytes`` the stored bytes with the scales, ``frozen_nbytes`` those of the kernel as
    frozen (in the dtype the product reads)."""

    scope: str
    shape: tuple[int, ...]
    dtype: str
    stored: str
    nbytes: int
    frozen_nbytes: int
    granularity: str
    path: tuple[str, ...] = dataclasses.field(repr=False, default=())
    frames: tuple[tuple[str, int], ...] = dataclasses.field(repr=False, default=())


@dataclasses.dataclass
class _Candidate:
    var: Any
    value: Any
    layout: Layout
    uses: list[tuple[Any, int]]  # (eqn, operand index)

    @property
    def first(self) -> Any:
        return self.uses[0][0]


def _own_line(frames: Sequence[tuple[str, int]]) -> str:
    """The innermost line of the user's own code, as ``jamp.tune`` names it: two NNX Linears
    share the line in Flax that runs their product, not the lines that call them."""
    frame = own_frame(frames)
    if frame is None:
        return "(no scope, no source line)"
    file, line = frame
    return f"{LINE_RULE}{os.path.basename(file)}:{line}"


def _candidates(
    jaxpr: Any, consts: Sequence[Any], kept: list[tuple[_Candidate, str]] | None = None
) -> list[_Candidate]:
    """The top-level floating constants (float64 aside) read only as kernels (in one layout),
    in program order, 8-bit ones (a float8 policy's) included: see ``_quantizable``.

    ``kept`` receives the others that products read as their kernel, each with why it stays as
    it is (an output of the program, another use): what an error names when none is left."""
    values = dict(zip(jaxpr.constvars, consts))
    is_constant = lambda v: not isinstance(v, compat.Literal) and v in values
    found: dict[Any, _Candidate] = {}
    other_use = {  # why a constant is not a kernel only
        v: "it is also an output of the frozen function"
        for v in jaxpr.outvars
        if not isinstance(v, compat.Literal)
    }
    for eqn in jaxpr.eqns:
        rule = SITES.get(eqn.primitive.name)
        at = rule(eqn, is_constant) if rule else None
        for i, var in enumerate(eqn.invars):
            if not is_constant(var):
                continue
            if at is None or at[0] != i:  # read by something else than a product, as its kernel
                other_use.setdefault(var, f"a {eqn.primitive.name} also reads it")
                continue
            known = found.get(var)
            if known is None:
                found[var] = _Candidate(var, values[var], at[1], [(eqn, i)])
            elif known.layout != at[1]:
                other_use.setdefault(var, "products read it in two layouts")
            else:
                known.uses.append((eqn, i))
    storable = [
        (v, c)
        for v, c in found.items()
        if jnp.issubdtype(v.aval.dtype, jnp.floating) and v.aval.dtype != np.float64
    ]
    if kept is not None:
        kept.extend((c, other_use[v]) for v, c in storable if v in other_use)
    return [c for v, c in storable if v not in other_use]


def _quantizable(c: _Candidate) -> bool:
    """Whether ``weights=`` stores the kernel narrower: one of 16 or 32 bits. An 8-bit kernel (a
    float8 policy's, already scaled) stays as it is, and is still listed as a kernel."""
    return c.var.aval.dtype.itemsize >= 2


def _describe(c: _Candidate) -> tuple[tuple[str, ...], tuple[tuple[str, int], ...], str]:
    path = compat.scope_names(c.first)
    frames = compat.frame_lines(c.first.source_info)
    return path, frames, "/".join(path) if path else _own_line(frames)


def kernels(closed: Any) -> list[Kernel]:
    """The program's kernels as frozen (``stored`` is their dtype): those ``quantize_weights``
    could quantize, and 8-bit ones (a float8 policy's) it leaves as they are.

    Example::

        [k.scope for k in kernels(frozen.jaxpr)]      # ['MLP/Dense_0', 'MLP/Dense_1']
    """
    jaxpr, consts = compat.open_and_consts(closed)
    out = []
    for c in _candidates(jaxpr, consts):
        path, frames, scope = _describe(c)
        nbytes = int(c.var.aval.size * c.var.aval.dtype.itemsize)
        dtype = c.var.aval.dtype.name
        out.append(Kernel(scope, c.var.aval.shape, dtype, dtype, nbytes, nbytes, "-", path, frames))
    return out


def quantize_weights(
    closed: Any, rules: Rules, where: str = "freeze", log: list[Kernel] | None = None
) -> Any:
    """``closed`` with its kernels stored as ``rules`` decide, dequantized before each product.

    Raises ``ValueError`` when the program has no kernel to quantize; warns
    (``jamp.UnmatchedRuleWarning``) about a rule that matched no kernel. ``log`` receives one
    :class:`Kernel` per kernel found (kept ones, 8-bit ones among them, with their own dtype as
    ``stored``).

    Example::

        closed = quantize_weights(frozen_closed, (("*head*", None), ("*", jnp.int8)))
    """
    jaxpr, consts = compat.open_and_consts(closed)
    kept: list[tuple[_Candidate, str]] = []
    found = _candidates(jaxpr, consts, kept)
    candidates = [c for c in found if _quantizable(c)]
    kept = [(c, why) for c, why in kept if _quantizable(c)]
    if not candidates and kept:
        named = "; ".join(
            f"{_describe(c)[2]} ({c.var.aval.dtype.name}{list(c.var.aval.shape)}): {why}"
            for c, why in kept[:4]
        )
        more = f" and {len(kept) - 4} more" if len(kept) > 4 else ""
        raise ValueError(
            f"{where}: weights= found no kernel to quantize: the program's matmul or convolution "
            f"kernels are also used otherwise, so they stay as they are ({named}{more}). A "
            "kernel is stored quantized only where products alone read it: freeze a function "
            "that does not return the kernel or read it otherwise, or drop weights="
        )
    if not candidates:
        raise ValueError(
            f"{where}: weights= found no kernel to quantize: no matmul or convolution reads a "
            "floating constant of 16 or 32 bits (the variables folded in) at the top level of "
            "the frozen program; drop weights=, or check that the model has Dense/Conv layers "
            "(kernels inside a scan or cond body are not quantized; a float8 policy stores its "
            "kernels in float8 already)"
        )
    plans: dict[Any, tuple[Format, np.ndarray, np.ndarray]] = {}
    used: set[int] = set()
    scopes = []
    for c in found:  # (in program order, for the log)
        path, frames, scope = _describe(c)
        scopes.append(scope)
        _, dtype, matched = decide(rules, path, frames)
        used |= matched  # (a rule that names an 8-bit kernel matched it: it stays as it is)
        if not _quantizable(c):
            dtype = None
        aval = c.var.aval
        frozen_nbytes = int(aval.size * aval.dtype.itemsize)
        record = functools.partial(Kernel, scope, aval.shape, aval.dtype.name, path=path)
        if dtype is None:
            if log is not None:
                log.append(
                    record(aval.dtype.name, frozen_nbytes, frozen_nbytes, "-", frames=frames)
                )
            continue
        fmt = FORMATS[dtype]
        matrix = c.layout.matrix(np.asarray(c.value, np.float32))
        stored, scale = fmt.quantize(matrix, aval.dtype)
        plans[c.var] = (fmt, stored, scale)
        if log is not None:
            nbytes = stored.nbytes + scale.nbytes
            log.append(record(fmt.name, nbytes, frozen_nbytes, fmt.granularity, frames=frames))
    _warn_unmatched(rules, used, scopes, where)
    if not plans:
        return closed
    layouts = {c.var: c.layout for c in candidates}

    def run(*args: Any) -> list[Any]:
        env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, args))
        dequantized: dict[Any, Any] = {}

        def read(var: Any) -> Any:
            if isinstance(var, compat.Literal):
                return var.val
            return dequantized.get(var, env.get(var))

        for eqn in jaxpr.eqns:
            for var in eqn.invars:
                if not isinstance(var, compat.Literal) and var in plans and var not in dequantized:
                    fmt, stored, scale = plans[var]
                    layout = layouts[var]
                    # Emitted without the product's source info: jax.export stores an op's
                    # location with each op, ~600 bytes a kernel (2-4% of a small CNN's blob).
                    # XLA's constant folding would widen the kernel again at compile time (the
                    # executable would hold it in float): a barrier keeps the narrow constant,
                    # dequantized at run time (in the product's fusion where the backend can).
                    q, s = jax.lax.optimization_barrier((stored, scale))
                    matrix = fmt.dequantize(q, s, layout.rows, var.aval.dtype)
                    dequantized[var] = layout.kernel(matrix)
            for var, out in zip(eqn.outvars, bind(eqn, [read(v) for v in eqn.invars])):
                if not isinstance(var, compat.DropVar):
                    env[var] = out
        return [read(v) for v in jaxpr.outvars]

    return compat.trace_to_closed(run, [v.aval for v in jaxpr.invars])


def _warn_unmatched(rules: Rules, used: set[int], scopes: list[str], where: str) -> None:
    shown = ", ".join(repr(s) for s in dict.fromkeys(scopes[:12]))
    for i, (glob, dtype) in enumerate(rules):
        if i in used:
            continue
        name = "None" if dtype is None else f"jnp.{dtype.name}"
        warnings.warn(
            f"{where}: weights rule {i} ({glob!r}, {name}) matched no kernel; the kernels' "
            f"scopes are {shown}{' ...' if len(scopes) > 12 else ''}. Rules are globs over the "
            "whole '/'-joined scope path (or '@file.py:12' for code outside scopes)",
            UnmatchedRuleWarning,
            stacklevel=caller_stacklevel(),
        )


def kernel_report(name: str, found: Sequence[Kernel]) -> str:
    """The text of ``FrozenFunction.report()``: a row per kernel, then the totals."""
    if not found:
        return f"{name}: no matmul or convolution kernel at the top level of the program"
    width = max(len(k.scope) for k in found)
    lines = [
        f"{'scope':<{width}}  {'shape':<16}  {'stored':<14}  {'bytes':>11}  scales",
        *(
            f"{k.scope:<{width}}  {str(k.shape):<16}  {k.stored:<14}  {k.nbytes:>11,}  "
            f"{k.granularity}"
            for k in found
        ),
    ]
    total = sum(k.nbytes for k in found)
    size = sum(math.prod(k.shape) for k in found)
    lines.append(
        f"{len(found)} kernels: {total:,} bytes stored, {total / (4 * size):.3f}x of float32 "
        f"({4 * size:,}), {total / (2 * size):.3f}x of bfloat16 ({2 * size:,})"
    )
    return "\n".join(lines)
