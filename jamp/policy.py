"""Precision policies: which primitive runs in which dtype, and per-scope rules.

A :class:`Policy` is an immutable, hashable value (usable as a ``jax.jit`` static argument and as
a cache key). The three tables hold primitive names (``str(eqn.primitive)``), so they can be
extended without importing JAX internals::

    policy = jamp.Policy(jnp.bfloat16)
    policy = policy.replace(fp32=policy.fp32 | {"tanh"}, rules=(("*/head", None),))
    policy                          # Policy(fp32=FP32 | {'tanh'}, rules=(('*/head', None),))
    jamp.Policy.from_string("compute=bf16,output=f32")    # jmp.get_policy's format

Table names are checked against the running JAX's primitives and rule globs against regex
syntax at construction; a rule that matched no scope warns (``UnmatchedRuleWarning``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import fnmatch
import math
import numbers
import os
import re
import sys
import warnings
from collections.abc import Callable, ItemsView, Iterable, Iterator, KeysView, Mapping, Sequence
from collections.abc import Set as AbstractSet
from types import FrameType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _compat as compat

# Matrix multiplies and convolutions: operands in the compute dtype, output in the compute dtype.
LOWER: frozenset[str] = frozenset(
    {
        "dot_general",
        "conv_general_dilated",
        "ragged_dot_general",
    }
)

# Numerically sensitive ops (torch's fp32 list keyed on lax primitives): run in float32.
FP32: frozenset[str] = frozenset(
    {
        "exp",
        "exp2",
        "log",
        "log1p",
        "log2",
        "expm1",
        "pow",
        "rsqrt",
        "tan",
        "acos",
        "asin",
        "sinh",
        "cosh",
        "acosh",
        "asinh",
        "atanh",
        "erf_inv",
        "lgamma",
        "digamma",
        "polygamma",
        "zeta",
        "igamma",
        "igammac",
        "igamma_grad_a",
        "regularized_incomplete_beta",
        "bessel_i0e",
        "bessel_i1e",
        "reduce_sum",
        "reduce_prod",
        "cumsum",
        "cumprod",
        "cumlogsumexp",
        # Only where their result is summed (a one-pass variance E[x^2] - E[x]^2); elsewhere they run
        # in the dtype their operand arrives in, so tanh-GELU's x**3 stays bfloat16 (rules/powers.py).
        "square",
        "integer_pow",
        # FFTs and decompositions have no bfloat16/float16 kernels (torch keeps linalg_* and fft_* in fp32).
        "fft",
        "cholesky",
        "eig",
        "eigh",
        "lu",
        "qr",
        "svd",
        "triangular_solve",
        "schur",
        "hessenberg",
        "householder_product",
        "tridiagonal",
        "tridiagonal_solve",
    }
)

# Ops whose floating operands must agree: mixed operands run in the widest of them, while weakly
# typed and rank-0 operands (Python scalars, constants built with the traced dtype) adapt.
PROMOTE: frozenset[str] = frozenset(
    {
        "add",
        "add_any",
        "sub",
        "mul",
        "div",
        "max",
        "min",
        "rem",
        "atan2",
        "nextafter",
        "complex",
        "select_n",
        "clamp",
        "concatenate",
        "pad",
        "dynamic_update_slice",
        "scatter",
        "scatter-add",
        "scatter-sub",
        "scatter-mul",
        "scatter-min",
        "scatter-max",
        "eq",
        "ne",
        "lt",
        "le",
        "gt",
        "ge",
        "select_and_scatter_add",
        "select_and_gather_add",
    }
)

BF16 = np.dtype(jnp.bfloat16)
# float8 compute (``Policy(jnp.float8_e4m3fn)``, jamp/fp8.py): the lower table runs on per-tensor
# scaled float8 operands (e4m3 forward, e5m2 cotangents: TransformerEngine's HYBRID format); values
# between those ops are bfloat16. Only e4m3 is a compute dtype: e5m2 is the gradient format.
FLOAT8_COMPUTE = np.dtype(jnp.float8_e4m3fn)
# Policy.min_float8_flops default: a matmul below 2 * 4096**3 FLOPs (2 per multiply-add) stays
# bfloat16 under a float8 policy. Measured (benchmarks/README.md, "float8 on an H200"): one
# matmul forward and backward in float8 ran at 0.83-0.89x bfloat16's speed up to 8192x2048x2048
# (6.9e10 FLOPs) and at 1.09-1.45x from 4096x4096x4096 (1.4e11) up: the amax and cast passes
# cost more than a small GEMM saves. 2 * 4096**3 is the smallest measured size that won.
MIN_FLOAT8_FLOPS = 2 * 4096**3
# The dtypes a policy (and a ``jamp.autocast`` region) computes in.
COMPUTE_DTYPES = (BF16, np.dtype(jnp.float16), np.dtype(jnp.float32), FLOAT8_COMPUTE)


def is_float8(dtype: Any) -> bool:
    return np.dtype(dtype).itemsize == 1 and jnp.issubdtype(dtype, jnp.floating)


def value_dtype(compute: np.dtype) -> np.dtype:
    """The dtype values take outside the lower table: bfloat16 under a float8 compute dtype (an
    activation stored in float8 would lose its per-tensor scale), else the compute dtype."""
    return BF16 if is_float8(compute) else compute


_DEFAULT_TABLES = {
    "lower": ("LOWER", lambda: LOWER),
    "fp32": ("FP32", lambda: FP32),
    "promote": ("PROMOTE", lambda: PROMOTE),
}


class UnmatchedRuleWarning(UserWarning):
    """A ``Policy.rules`` glob matched no scope of the function it was applied to."""


class _DefaultTable:
    """Sentinel default of a table argument: the signature reads ``lower=LOWER`` instead of
    listing every primitive name (``help(jamp.Policy)`` stays readable)."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name

    def __iter__(self) -> Iterator[str]:  # an Iterable[str], like the table it stands for
        return iter(_DEFAULT_TABLES[self.name.lower()][1]())


def _dtype_or_none(value: Any, field: str) -> np.dtype | None:
    if value is None:
        return None
    try:
        dtype = np.dtype(value)
    except TypeError as err:
        raise ValueError(
            f"Policy.{field} must be a dtype such as jnp.bfloat16, got {value!r}"
        ) from err
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(
            f"Policy.{field} must be a floating dtype (bfloat16, float16, float32), "
            f"got {dtype.name}"
        )
    if dtype == np.float64 and field.startswith(("rules", "accumulate")):
        # (as compute_dtype: a policy narrows, and float64 values already pass through as they are)
        raise ValueError(
            f"Policy.{field} cannot be float64: a policy computes in bfloat16, float16 or "
            "float32, and leaves float64 values as they are"
        )
    if is_float8(dtype) and (dtype != FLOAT8_COMPUTE or not field.startswith(("compute", "rules"))):
        raise ValueError(
            f"Policy.{field} cannot be {dtype.name}: float8 is only a compute dtype, and only "
            "float8_e4m3fn (matmul/conv operands are scaled per tensor to e4m3 forward and to "
            "e5m2 for cotangents; values between those ops are bfloat16)"
        )
    return dtype


def _reduce_dtype(value: Any, compute: np.dtype) -> np.dtype | None:
    """``Policy.reduce_dtype``: a floating dtype at least as wide as what the backward products
    compute in (the compute dtype; bfloat16 under float8), or None."""
    dtype = _dtype_or_none(value, "reduce_dtype")
    narrowest = value_dtype(compute)
    if dtype is not None and (
        dtype.itemsize < narrowest.itemsize
        or (dtype.itemsize == narrowest.itemsize and dtype != narrowest)
    ):
        raise ValueError(
            f"Policy.reduce_dtype={dtype.name} is not at least as wide as the {narrowest.name} the "
            f"backward matmuls of a {compute.name} policy compute in: gradients would be rounded "
            f"before they are summed. Use jnp.float32 (or None to sum in {narrowest.name})"
        )
    return dtype


def _holds(wide: np.dtype, narrow: np.dtype) -> bool:
    """Whether ``wide`` holds every value of ``narrow`` in range and precision."""
    a, b = jnp.finfo(wide), jnp.finfo(narrow)
    return a.nmant >= b.nmant and a.maxexp >= b.maxexp


def _accumulate_dtype(value: Any, compute: np.dtype) -> np.dtype | None:
    """``Policy.accumulate_dtype``: None, or a dtype holding every value of the compute dtype in
    range and precision (a matmul output is never rounded below what it computes in, nor moved
    to the other 16-bit format: float16 and bfloat16 each lack what the other has)."""
    dtype = _dtype_or_none(value, "accumulate_dtype")
    if dtype is None or dtype == compute:
        return dtype
    wide, narrow = jnp.finfo(dtype), jnp.finfo(compute)
    lacks = []
    if wide.nmant < narrow.nmant:
        lacks.append(f"precision ({wide.nmant + 1} significant bits against {narrow.nmant + 1})")
    if wide.maxexp < narrow.maxexp:  # (exponent range: bfloat16's max is float32's rounded)
        lacks.append(f"range (largest value {float(wide.max):.4g} against {float(narrow.max):.4g})")
    if lacks:
        instead = (
            "None (a float32 policy's matmuls return float32)"
            if compute == np.float32
            else f"jnp.float32, or None for {value_dtype(compute).name} outputs"
        )
        raise ValueError(
            f"Policy.accumulate_dtype={dtype.name} must hold every value of the compute dtype "
            f"{compute.name}, but has less {' and less '.join(lacks)}: matmul and convolution "
            f"results would lose what {compute.name} holds. Use accumulate_dtype={instead}"
        )
    return dtype


def _flop_count(value: Any) -> int:
    """``Policy.min_float8_flops``: a whole, finite, non-negative number (``1e9`` reads as 10**9)."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, float)):
        raise TypeError(
            "Policy.min_float8_flops must be a number of FLOPs (2 per multiply-add, e.g. "
            f"2 * 2048**3 for a 2048x2048x2048 matmul), got {type(value).__name__} {value!r}"
        )
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        raise ValueError(
            f"Policy.min_float8_flops must be a whole, finite number of FLOPs, got {value!r}"
        )
    if value < 0:
        raise ValueError(
            f"Policy.min_float8_flops must be >= 0 (0 runs every matmul with a weight operand "
            f"in float8), got {value!r}"
        )
    return int(value)


def suggestions(name: str, known: Iterable[str]) -> list[str]:
    """Known names close to ``name``: the same up to case and ``-``/``_`` (``scatter_add`` ->
    ``scatter-add``), difflib's close matches, then names it is a prefix of (``dot``)."""
    norm = lambda s: s.lower().replace("-", "_")
    known = sorted(known)
    same = [k for k in known if norm(k) == norm(name)]
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    prefixed = sorted((k for k in known if norm(k).startswith(norm(name))), key=len)
    return list(dict.fromkeys(same + prefixed[:1] + close + prefixed))[:3]


def _names(value: Any, field: str) -> frozenset[str]:
    if isinstance(value, _DefaultTable):
        return _DEFAULT_TABLES[field][1]()
    items = None if isinstance(value, str) or not isinstance(value, Iterable) else list(value)
    if items is None or not all(isinstance(v, str) for v in items):
        raise TypeError(f"Policy.{field} must be a set of primitive names (str), got {value!r}")
    names = frozenset(items)
    # Names of the default tables are accepted even where this JAX lacks them (log2 before 0.11).
    known = compat.primitive_names() | LOWER | FP32 | PROMOTE
    for name in sorted(names - known):
        close = suggestions(name, known)
        hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
        raise ValueError(
            f"Policy.{field}: {name!r} is not a primitive of this JAX ({jax.__version__}){hint} "
            "Tables hold primitive names as jaxprs print them (`jax.make_jaxpr(f)(x)`), e.g. "
            "'dot_general', 'scatter-add'. A primitive of your own must be defined (its lowering "
            "registered) before the Policy is built."
        )
    return names


# Signs that a rule was written as a regular expression: rules are fnmatch globs.
_REGEX_SIGNS = ("^", "$", ".*", ".+", "\\", "(?", "|")


# A rule whose glob starts with "@" names source lines instead of scope paths ("@model.py:12"):
# code without scopes (plain functions, Flax NNX modules) has no path a rule could match.
LINE_RULE = "@"


_METHOD_SUFFIX = re.compile(r"\.[A-Za-z_]\w*$")


def scope_matches(path: str, glob: str) -> bool:
    """Does a scope-rule glob match a '/'-joined scope path? A Flax linen method other than
    ``__call__`` names its scope ``embed.attend``: the path with such suffixes dropped
    (``LM/embed``) matches too, so a rule on a module covers all its methods (a tied
    embedding's ``attend`` is the module's matmul)."""
    if fnmatch.fnmatchcase(path, glob):
        return True
    bare = "/".join(_METHOD_SUFFIX.sub("", name) for name in path.split("/"))
    return bare != path and fnmatch.fnmatchcase(bare, glob)


def is_line_rule(glob: str) -> bool:
    return glob.startswith(LINE_RULE)


def line_names(file: str, line: int) -> tuple[str, str]:
    """What a line rule is matched against for one frame: ``@<basename>:<line>`` and
    ``@<full path>:<line>`` (a basename shared by two files is told apart by a glob on the path)."""
    return f"{LINE_RULE}{os.path.basename(file)}:{line}", f"{LINE_RULE}{file}:{line}"


def line_rule_hits(file: str, line: int, rules: Sequence[tuple[str, Any]]) -> list[int]:
    """Indices of the line rules (``"@file:line"`` globs) among ``rules`` matching one frame."""
    names = line_names(file, line)
    return [
        i
        for i, (pattern, _) in enumerate(rules)
        if is_line_rule(pattern) and any(fnmatch.fnmatchcase(n, pattern) for n in names)
    ]


def check_rule_glob(glob: str, where: str) -> None:
    """A ``ValueError`` naming ``where`` for a rule's pattern that would match nothing as meant:
    a regular expression (matched as a glob, it matches no scope) or a line rule without its
    line (``Policy.rules``, ``tracing.freeze(weights=...)``)."""
    if any(sign in glob for sign in _REGEX_SIGNS):
        raise ValueError(
            f"{where} = {glob!r} looks like a regular expression; rules are shell-style globs "
            "(fnmatch: '*' any text, '?' one character, '[ab]' a set) matched against the whole "
            f"scope path, e.g. {_glob_for(glob)!r}"
        )
    if is_line_rule(glob) and ":" not in glob:
        raise ValueError(
            f"{where} = {glob!r}: a rule starting with '@' names a source line as "
            "'@<file>:<line>', e.g. '@model.py:12' (a glob over the file's name or path)"
        )


def _glob_for(regex_like: str) -> str:
    """The glob a regex-looking rule most likely meant: ``^.*head$`` -> ``*head``."""
    glob = regex_like.removeprefix("^").removesuffix("$")
    for regex, wildcard in ((".*", "*"), (".+", "?*"), ("\\.", ".")):
        glob = glob.replace(regex, wildcard)
    return glob


def _pair_text(glob: Any, dtype: Any) -> str:
    """``('*/head', jnp.float32)``: a rule as the user would write it (their value if not a dtype)."""
    try:
        return f"({glob!r}, {_dtype_repr(_dtype_or_none(dtype, 'rules'))})"
    except (TypeError, ValueError):
        return repr((glob, dtype))


def _is_pair(rule: Any) -> bool:
    return isinstance(rule, (tuple, list)) and len(rule) == 2


def _rules(value: Any) -> tuple[tuple[str, np.dtype | None], ...]:
    form = "Policy.rules must be a sequence of (glob, dtype or None) pairs"
    if isinstance(value, Mapping):  # a dict of glob -> dtype reads naturally, but is not the form
        pairs = ", ".join(_pair_text(g, d) for g, d in value.items())
        raise TypeError(
            f"{form} (the later rule wins at the same scope), got a {type(value).__name__}; "
            f"write rules=({pairs}{',' if len(value) == 1 else ''})"
        )
    if isinstance(value, AbstractSet) and not isinstance(value, (KeysView, ItemsView)):
        # (a dict's views keep its order; a set's order changes with PYTHONHASHSEED)
        shown = sorted(_pair_text(*r) if _is_pair(r) else repr(r) for r in value)
        raise TypeError(
            f"{form} in the order they apply (the later rule wins at the same scope), got a "
            f"{type(value).__name__}, which has no order: which rule won would change from run "
            f"to run. Write rules=({', '.join(shown)}{',' if len(shown) == 1 else ''}) in the "
            "order you mean"
        )
    if isinstance(value, str):
        raise TypeError(
            f"{form}, got the string {value!r}; write rules=({_pair_text(value, None)},) to "
            "turn autocast off there, or put a dtype in place of None"
        )
    if not isinstance(value, Iterable):
        raise TypeError(
            f"{form}, got {type(value).__name__} {value!r}"
            + ("; use rules=() for no rules" if value is None else "")
        )
    if (
        isinstance(value, tuple)
        and len(value) == 2
        and isinstance(value[0], str)
        and not isinstance(value[1], (str, tuple, list))
    ):
        pair = _pair_text(*value)
        raise TypeError(f"{form}, got the single pair {pair}: write rules=({pair},)")
    rules = []
    for i, rule in enumerate(value):
        if not _is_pair(rule):
            raise TypeError(
                f"Policy.rules[{i}] must be a (glob pattern, dtype or None) pair, got {rule!r}"
            )
        glob, dtype = rule
        if not isinstance(glob, str) or not glob:
            raise TypeError(
                f"Policy.rules[{i}][0] must be a non-empty glob string such as "
                f"'*/head', got {glob!r}"
            )
        check_rule_glob(glob, f"Policy.rules[{i}][0]")
        rules.append((glob, _dtype_or_none(dtype, f"rules[{i}][1]")))
    return tuple(rules)


def _dtype_repr(dtype: np.dtype | None) -> str:
    return "None" if dtype is None else f"jnp.{dtype.name}"


def _set_repr(names: Iterable[str]) -> str:
    names = sorted(names)
    return "{" + ", ".join(map(repr, names)) + "}" if names else "set()"


def _table_repr(names: frozenset, field: str) -> str | None:
    """``FP32 - {'exp'} | {'tanh'}`` for a table that differs from its default, else None."""
    const, default = _DEFAULT_TABLES[field][0], _DEFAULT_TABLES[field][1]()
    if names == default:
        return None
    added, removed = names - default, default - names
    if len(added) + len(removed) > len(names):
        return _set_repr(names)
    return (
        const
        + (f" - {_set_repr(removed)}" if removed else "")
        + (f" | {_set_repr(added)}" if added else "")
    )


# jmp's dtype spellings (``jmp.get_policy``); ``half`` is platform-dependent as in jmp.
_DTYPE_NAMES = {
    "bf16": jnp.bfloat16,
    "bfloat16": jnp.bfloat16,
    "f16": jnp.float16,
    "float16": jnp.float16,
    "full": jnp.float32,
    "f32": jnp.float32,
    "float32": jnp.float32,
    "f64": jnp.float64,
    "float64": jnp.float64,
}
# Beyond jmp: float8 (a compute dtype only; Policy refuses it elsewhere, naming the field).
_DTYPE_NAMES.update(dict.fromkeys(("float8_e4m3fn", "float8", "fp8", "f8", "e4m3"), FLOAT8_COMPUTE))
_BOOL_NAMES = {
    "true": True,
    "1": True,
    "yes": True,
    "on": True,
    "false": False,
    "0": False,
    "no": False,
    "off": False,
}


def _half() -> np.dtype:
    """jmp's ``half``: bfloat16 on TPU, float16 elsewhere."""
    return np.dtype(jnp.bfloat16 if jax.default_backend() == "tpu" else jnp.float16)


def _parse_dtype(key: str, value: str) -> np.dtype:
    if value == "half":
        return _half()
    if value not in _DTYPE_NAMES:
        close = suggestions(value, [*_DTYPE_NAMES, "half"])
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(
            f"Policy.from_string: {key}={value!r} is not a dtype{hint}; use one of "
            "bf16, bfloat16, f16, float16, half, f32, float32, full (compute: also float8_e4m3fn)"
        )
    return np.dtype(_DTYPE_NAMES[value])


def _parse_params(key: str, value: str) -> dict[str, Any]:
    if _parse_dtype(key, value) != np.float32:
        raise ValueError(
            f"Policy.from_string: {key}={value!r}: jamp never casts parameters (gradients come "
            "back in the dtype you store them in), so params=float32 is the only value it "
            "accepts. Store them in 16 bits yourself, or add cast_inputs=true to compute from "
            "16-bit copies of every floating input."
        )
    return {}


def _parse_bool(key: str, value: str) -> bool:
    if value.lower() not in _BOOL_NAMES:
        raise ValueError(f"Policy.from_string: {key}={value!r} must be true or false")
    return _BOOL_NAMES[value.lower()]


# key (jmp's long and short spellings) -> (Policy argument, parser returning keyword changes).
_STRING_KEYS: dict[str, Callable[[str, str], dict[str, Any]]] = {
    "compute": lambda k, v: {"compute_dtype": _parse_dtype(k, v)},
    "output": lambda k, v: {"output_dtype": _parse_dtype(k, v)},
    "params": _parse_params,
    "accumulate": lambda k, v: {"accumulate_dtype": _parse_dtype(k, v)},
    "cast_inputs": lambda k, v: {"cast_inputs": _parse_bool(k, v)},
}
_STRING_KEYS.update(
    {"c": _STRING_KEYS["compute"], "o": _STRING_KEYS["output"], "p": _STRING_KEYS["params"]}
)


@dataclasses.dataclass(frozen=True, init=False, repr=False)
class Policy:
    """How ``autocast_transform`` assigns precisions.

    Args:
      compute_dtype: dtype of matmuls/convs (the ``lower`` table), ``bfloat16`` by default.
        ``jnp.float8_e4m3fn`` runs them on float8 operands scaled per tensor from their current
        absolute maximum (cotangents in ``float8_e5m2``), with bfloat16 everywhere else the
        bfloat16 policy would use it (see ``jamp.fp8``).
      accumulate_dtype: if set (e.g. ``jnp.float32``), lower-table ops return this dtype instead of
        the compute dtype. Costs memory and makes backward matmuls mix dtypes; use for logits only.
        It must hold every value of the compute dtype, in range and precision: float32 or the
        compute dtype itself (bfloat16 and float16 refuse each other; under float8, bfloat16
        and float16 hold every float8 value); a narrower one raises ``ValueError``. A scope a
        rule runs in a dtype it does not hold (a float32 head) returns that dtype.
      output_dtype: if set, floating (non-float64) outputs of the function are cast to it
        (float64 only with ``jax_enable_x64``, as any JAX array: float32 without, warned).
      cast_inputs: cast floating (non-float64) inputs to the compute dtype on entry, except a
        Flax model's running statistics (linen's ``batch_stats``, NNX ``BatchStat``), which
        keep their dtype as Flax's ``dtype=`` layers keep them (``autocast_jaxpr``, given a
        program without its arguments' pytrees, casts every input).
      lower, fp32, promote: sets of primitive names (``LOWER``, ``FP32``, ``PROMOTE`` in
        ``jamp.policy`` by default; see the README for the full tables). Every name must be a
        primitive of the running JAX: ``Policy(lower={"dot"})`` raises ``ValueError`` suggesting
        ``'dot_general'``.
      rules: ``((glob, dtype_or_None), ...)`` matched against each equation's scope path
        (``jax.named_scope`` names and Flax module paths joined by ``/``). ``None`` disables
        autocast there, a dtype changes the compute dtype. The innermost matching scope wins; at the
        same scope the later rule wins; ``jamp.autocast`` regions inside a scope win over rules.
        Globs, not regular expressions (``^.*head$`` raises ``ValueError``). A rule that matches no
        scope of a transformed function warns once (:class:`jamp.UnmatchedRuleWarning`, naming the
        closest scope paths) and is listed by ``jamp.explain``. A glob starting with ``@`` names
        a source line instead: ``("@model.py:12", None)`` applies to every operation traced
        while that line ran (the line and what it called; file basename or full path) where no
        scope rule or region decided, the innermost such line winning: rules for code without
        scopes (plain functions, Flax NNX modules).
      min_float8_flops: under a float8 compute dtype, a matmul or convolution with fewer FLOPs
        (2 per multiply-add, forward product) stays bfloat16: for a small GEMM the amax and cast
        passes cost more than float8 saves. The default, ``2 * 4096**3`` (``MIN_FLOAT8_FLOPS``),
        is the smallest size at which jamp's float8 matmul, forward and backward, measured
        faster than bfloat16 on an H200 (1.11x; 8192x2048x2048 ran at 0.89x). Tune it on your
        GPU; ``0`` puts every eligible matmul in float8.
        ``jamp.explain`` lists the matmuls it kept in bfloat16. Other compute dtypes ignore it.
      reduce_dtype: the dtype gradients are summed across devices in (PyTorch FSDP's
        ``MixedPrecision(reduce_dtype=...)``). With ``jnp.float32`` the backward products of a
        16-bit or float8 matmul/convolution (its cotangents with respect to its operands)
        accumulate and come out in float32, so a reduction XLA partitions after them
        (all-reduce, reduce-scatter) moves float32; gradients still come back in the dtypes the
        operands arrived in (a float32 parameter's gradient is never rounded to 16 bits). None
        (the default) leaves them in the compute dtype. Must be a floating dtype at least as
        wide as the compute dtype (bfloat16 under float8). Applies to convolutions and to
        matmuls without batch dimensions (a weight's gradient; attention's batched products keep
        the compute dtype). Reverse mode only: ``jax.jvp`` and ``jax.jacfwd`` of a function
        whose matmuls it applies to raise.

    Example::

        policy = jamp.Policy(jnp.float16, rules=(("*/LayerNorm_*", None),))
        f16_fn = jamp.autocast_transform(fn, policy)
        # repr: Policy(jnp.float16, fp32=FP32 | ...)
        policy.replace(fp32=policy.fp32 | {"tanh"})
        jamp.Policy.from_string("compute=bf16,output=f32")   # jmp.get_policy's format
    """

    compute_dtype: np.dtype
    accumulate_dtype: np.dtype | None
    output_dtype: np.dtype | None
    cast_inputs: bool
    lower: frozenset
    fp32: frozenset
    promote: frozenset
    rules: tuple
    min_float8_flops: int
    reduce_dtype: np.dtype | None

    def __init__(
        self,
        compute_dtype: Any = jnp.bfloat16,
        *,
        accumulate_dtype: Any = None,
        output_dtype: Any = None,
        cast_inputs: bool = False,
        lower: Iterable[str] = _DefaultTable("LOWER"),
        fp32: Iterable[str] = _DefaultTable("FP32"),
        promote: Iterable[str] = _DefaultTable("PROMOTE"),
        rules: Iterable[Any] = (),
        min_float8_flops: int = MIN_FLOAT8_FLOPS,
        reduce_dtype: Any = None,
    ):
        compute = _dtype_or_none(compute_dtype, "compute_dtype")
        if compute is None or compute not in COMPUTE_DTYPES:
            raise ValueError(
                "Policy.compute_dtype must be bfloat16, float16, float32 or "
                f"float8_e4m3fn, got {compute_dtype!r}"
            )
        if not isinstance(cast_inputs, bool):
            raise TypeError(f"Policy.cast_inputs must be a bool, got {cast_inputs!r}")
        set_ = lambda name, value: object.__setattr__(self, name, value)  # frozen dataclass
        set_("compute_dtype", compute)
        set_("accumulate_dtype", _accumulate_dtype(accumulate_dtype, compute))
        set_("output_dtype", _dtype_or_none(output_dtype, "output_dtype"))
        set_("cast_inputs", cast_inputs)
        set_("lower", _names(lower, "lower"))
        set_("fp32", _names(fp32, "fp32"))
        set_("promote", _names(promote, "promote"))
        set_("rules", _rules(rules))
        set_("min_float8_flops", _flop_count(min_float8_flops))
        set_("reduce_dtype", _reduce_dtype(reduce_dtype, compute))
        overlap = (
            (self.lower & self.fp32) | (self.lower & self.promote) | (self.fp32 & self.promote)
        )
        if overlap:
            raise ValueError(
                f"Policy tables overlap on {sorted(overlap)}: each primitive belongs to "
                "at most one of lower / fp32 / promote"
            )

    @classmethod
    def from_string(cls, spec: str) -> Policy:
        """A policy from jmp's ``get_policy`` format, for config files and command lines.

        ``"compute=bfloat16,output=float32"``; keys ``compute``/``c``, ``output``/``o``,
        ``params``/``p``, ``accumulate`` and ``cast_inputs`` (``true``/``false``); dtypes
        ``bf16``/``bfloat16``, ``f16``/``float16``, ``f32``/``float32``/``full`` and ``half``
        (bfloat16 on TPU, float16 elsewhere, as jmp). A bare dtype (``"bf16"``) sets the compute
        and output dtypes. Unlike jmp, a missing ``output`` leaves outputs in the dtypes the
        rewrite gives them (a float32 loss stays float32), and ``params`` accepts only float32:
        jamp never casts parameters. Bad keys or values raise ``ValueError`` naming them.

        Example::

            jamp.Policy.from_string("c=f16,o=f32")   # Policy(jnp.float16, output_dtype=jnp.float32)
        """
        if not isinstance(spec, str):
            raise TypeError(f"Policy.from_string expects a str, got {type(spec).__name__}")
        text = spec.strip()
        if not text:
            raise ValueError(
                "Policy.from_string: empty policy string; write e.g. "
                "'compute=bfloat16,output=float32'"
            )
        if "=" not in text and "," not in text:  # jmp's bare dtype form
            dtype = _parse_dtype("dtype", text)
            if is_float8(dtype):
                raise ValueError(
                    f"Policy.from_string({spec!r}): a bare dtype sets the compute and output "
                    "dtypes, and float8 is only a compute dtype; write "
                    "'compute=float8_e4m3fn'"
                )
            return cls(dtype, output_dtype=dtype)
        changes: dict[str, Any] = {}
        seen: dict[str, str] = {}
        for part in text.split(","):
            key, sep, value = (s.strip() for s in part.partition("="))
            if not sep or not key or not value:
                raise ValueError(
                    f"Policy.from_string: {part.strip()!r} in {spec!r} is not key=value"
                )
            if key not in _STRING_KEYS:
                close = suggestions(key, [k for k in _STRING_KEYS if len(k) > 1])
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ValueError(
                    f"Policy.from_string: unknown key {key!r} in {spec!r}{hint}; "
                    "keys are compute, output, params, accumulate, cast_inputs"
                )
            canonical = next(k for k, f in _STRING_KEYS.items() if f is _STRING_KEYS[key])
            if canonical in seen:
                raise ValueError(f"Policy.from_string: {canonical!r} given twice in {spec!r}")
            seen[canonical] = value
            changes.update(_STRING_KEYS[key](key, value))
        try:
            return cls(**changes)
        except ValueError as err:
            raise ValueError(f"Policy.from_string({spec!r}): {err}") from err

    def replace(self, **changes: Any) -> Policy:
        """A copy with some fields changed: ``policy.replace(compute_dtype=jnp.float16)``."""
        fields = [f.name for f in dataclasses.fields(self)]
        unknown = sorted(set(changes) - set(fields))
        if unknown:
            raise TypeError(f"Policy has no field {unknown[0]!r}; fields are {fields}")
        current = {f: getattr(self, f) for f in fields}
        current.update(changes)
        compute = current.pop("compute_dtype")
        return Policy(compute, **current)

    def with_compute_dtype(self, dtype: Any) -> Policy:
        """A copy computing in ``dtype``, without an ``accumulate_dtype`` or ``reduce_dtype`` that
        cannot hold ``dtype``'s values (which ``replace`` refuses): what a nested ``dtype=``
        region or a float32 remedy means by "this policy, in ``dtype``"."""
        compute = _dtype_or_none(dtype, "compute_dtype")
        kept = {}
        for field, check in (
            ("accumulate_dtype", _accumulate_dtype),
            ("reduce_dtype", _reduce_dtype),
        ):
            try:
                kept[field] = None if compute is None else check(getattr(self, field), compute)
            except ValueError:
                kept[field] = None
        return self.replace(compute_dtype=dtype, **kept)

    @property
    def value_dtype(self) -> np.dtype:
        """The dtype values take between lower-table ops (bfloat16 under a float8 compute
        dtype, else the compute dtype)."""
        return value_dtype(self.compute_dtype)

    def accumulate_for(self, dtype: Any, otherwise: Any = None) -> np.dtype:
        """The output dtype of a matmul or convolution computed in ``dtype``: ``accumulate_dtype``
        where it holds every value of ``dtype`` (checked against the compute dtype when made, but
        a rule may run a scope in another: a float32 head under ``accumulate_dtype=bfloat16``
        keeps float32), else ``otherwise`` (by default ``dtype``; a float8 product's 16-bit
        value dtype)."""
        dtype = np.dtype(dtype)
        accumulate = self.accumulate_dtype
        if accumulate is None or not _holds(accumulate, dtype):
            return dtype if otherwise is None else np.dtype(otherwise)
        return accumulate

    def category(self, primitive_name: str) -> str | None:
        """``'lower'``, ``'fp32'``, ``'promote'`` or None for a primitive name."""
        if primitive_name in self.lower:
            return "lower"
        if primitive_name in self.fp32:
            return "fp32"
        if primitive_name in self.promote:
            return "promote"
        return None

    def __repr__(self) -> str:
        """Only what differs from ``Policy()``: ``Policy(jnp.float16, fp32=FP32 | {'tanh'})``."""
        parts = [] if self.compute_dtype == jnp.bfloat16 else [_dtype_repr(self.compute_dtype)]
        for name in ("accumulate_dtype", "output_dtype"):
            if getattr(self, name) is not None:
                parts.append(f"{name}={_dtype_repr(getattr(self, name))}")
        if self.cast_inputs:
            parts.append("cast_inputs=True")
        for name in _DEFAULT_TABLES:
            table = _table_repr(getattr(self, name), name)
            if table is not None:
                parts.append(f"{name}={table}")
        if self.rules:
            rules = ", ".join(f"({glob!r}, {_dtype_repr(dtype)})" for glob, dtype in self.rules)
            parts.append(f"rules=({rules}{',' if len(self.rules) == 1 else ''})")
        if self.min_float8_flops != MIN_FLOAT8_FLOPS:
            parts.append(f"min_float8_flops={self.min_float8_flops}")
        if self.reduce_dtype is not None:
            parts.append(f"reduce_dtype={_dtype_repr(self.reduce_dtype)}")
        return f"Policy({', '.join(parts)})"


@dataclasses.dataclass(frozen=True)
class UnmatchedRule:
    """A rule whose glob matched no scope path of a traced function (see ``ScopeLog``)."""

    index: int
    glob: str
    dtype: np.dtype | None
    closest: tuple[str, ...]  # the scope paths seen that come closest to the glob
    hint: str

    def message(self, where: str = "") -> str:
        what = ("source line", "lines") if is_line_rule(self.glob) else ("scope", "scope paths")
        seen = (
            f"; closest {what[1]} seen: {', '.join(map(repr, self.closest))}"
            if self.closest
            else ""
        )
        return (
            f"Policy.rules[{self.index}] ({self.glob!r}, {_dtype_repr(self.dtype)}) matched "
            f"no {what[0]}{' of ' + where if where else ''}{seen}. {self.hint}"
        )


class ScopeLog:
    """The scope paths one rewrite entered, to find the rules that matched none of them."""

    def __init__(self) -> None:
        self.paths: set[str] = set()
        self.lines: set[str] = set()  # line_names of the frames seen (only with line rules)

    def add(self, path: tuple[str, ...]) -> None:
        if path:
            self.paths.add("/".join(path))

    def add_lines(self, frames: Iterable[tuple[str, int]]) -> None:
        for file, line in frames:
            self.lines.update(line_names(file, line))

    def unmatched(self, rules: tuple) -> tuple[UnmatchedRule, ...]:
        seen = lambda glob: self.lines if is_line_rule(glob) else self.paths
        matched = lambda glob: any(
            (fnmatch.fnmatchcase if is_line_rule(glob) else scope_matches)(p, glob)
            for p in seen(glob)
        )
        return tuple(
            UnmatchedRule(i, glob, dtype, self._closest(glob, seen(glob)), self._hint(glob))
            for i, (glob, dtype) in enumerate(rules)
            if not matched(glob)
        )

    def _closest(self, glob: str, seen: set[str]) -> tuple[str, ...]:
        """Seen paths nearest the glob, by difflib on the whole path and on its last name."""
        core = glob.replace("*", "").replace("?", "")
        last = core.rsplit("/", 1)[-1]
        score = lambda path: max(
            difflib.SequenceMatcher(None, core, path).ratio(),
            difflib.SequenceMatcher(None, last.lower(), path.rsplit("/", 1)[-1].lower()).ratio(),
        )
        ranked = sorted(seen, key=lambda p: (-score(p), p))
        return tuple(p for p in ranked[:3] if score(p) >= 0.3)

    def _hint(self, glob: str) -> str:
        """Why the glob probably missed, from the nearest variant that would have matched."""
        if is_line_rule(glob):
            return (
                "A '@<file>:<line>' rule matches the operations traced while that line of your "
                "code ran (file basename or full path), where no scope rule or region decided."
            )
        nnx = (
            "Flax NNX modules enter no scopes: name their code with jax.named_scope or match "
            "its lines with a '@<file>:<line>' rule."
        )
        if not self.paths:
            return (
                "The code traced entered no scopes: rules match jax.named_scope names and Flax "
                f"linen module paths joined by '/'. {nnx}"
            )
        for variant, why in (
            (glob + "*", "Flax linen names unnamed submodules with a _<n> suffix ('Head_0')"),
            (glob.removeprefix("*/"), "a '*/' prefix needs a parent scope"),
            ("*/" + glob, "the glob must match the whole path from the top"),
            ("*" + glob, "the glob must match the whole path from the top"),
        ):
            hits = sorted(p for p in self.paths if fnmatch.fnmatchcase(p, variant))
            if hits:
                return f"{why}: {variant!r} would match {hits[0]!r}."
        lower = sorted(p for p in self.paths if fnmatch.fnmatchcase(p.lower(), glob.lower()))
        if lower:
            return f"Globs are case-sensitive: {lower[0]!r} differs only in case."
        return f"Rules are case-sensitive globs over the whole '/'-joined scope path. {nnx}"


_warned: set[tuple[str, str, tuple[str, ...]]] = set()
# JAX, and the ``tracing`` package jamp's distribution ships beside jamp (it calls jamp: a rule
# warning raised under ``tracing.freeze(policy=...)`` belongs at the user's call of it).
_OWN_PACKAGES = (
    os.path.dirname(str(jax.__file__)) + os.sep,
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tracing") + os.sep,
)


def warn_unmatched(unmatched: Iterable[UnmatchedRule], where: str, paths: Iterable[str]) -> None:
    """Warn once per (function, rule) about rules that matched nothing.

    ``where`` labels the function (``"loss_fn at model.py:12"``) and, with the scope paths seen,
    keys the once-only check, so a retrace at new shapes does not warn again."""
    if _is_internal(where):  # a label naming jamp's own wrapper says nothing to the user
        where = ""
    seen = tuple(sorted(paths))
    for rule in unmatched:
        key = (where, rule.glob, seen)
        if key in _warned:
            continue
        _warned.add(key)
        warnings.warn(rule.message(where), UnmatchedRuleWarning, stacklevel=user_stacklevel())


def report_unmatched_rules(rewriter: Any, jaxpr: Any) -> None:
    """Called by the top-level ``interpreter.Rewriter`` when it finishes a program: a recorder
    (``jamp.explain``) lists the rules that matched no scope, a plain rewrite warns."""
    unmatched = rewriter.scope_log.unmatched(rewriter.policy.rules)
    record = getattr(rewriter.recorder, "unmatched_rules", None)
    if callable(record):
        record(unmatched)
    elif unmatched:
        warn_unmatched(
            unmatched, _own_label(compat.function_label(jaxpr)), rewriter.scope_log.paths
        )


def _own_label(label: str) -> str:
    """``loss_fn at model.py:12``, or the name alone for a function of an installed library
    (``model.apply``'s ``apply at .../flax/linen/module.py:2091`` is no place of the user's: the
    warning itself points at the user's line)."""
    name, at, where = label.partition(" at ")
    return name if at and in_installed_package(where) else label


def _is_internal(filename: str) -> bool:
    here = os.path.dirname(os.path.abspath(__file__)) + os.sep
    return (
        here in filename
        or filename == _CONTEXTLIB  # (a region's `with` exits through contextlib's frames)
        or any(p in filename for p in _OWN_PACKAGES)  # (also within a label: 'f at <path>')
    )


_CONTEXTLIB = contextlib.__file__


_LIBRARY = (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}")


def in_installed_package(file: str) -> bool:
    return any(marker in file for marker in _LIBRARY)


def own_frame(frames: Sequence[tuple[str, int]]) -> tuple[str, int] | None:
    """Of an equation's source frames (innermost first), the innermost in the user's own code
    (outside installed packages: an NNX Linear's product runs on a line of Flax's), else the
    innermost outside JAX and jamp. How ``jamp.tune`` and ``tracing.freeze(weights=...)`` name
    a matmul outside any scope."""
    own = [f for f in frames if not in_installed_package(f[0])]
    return own[0] if own else (frames[0] if frames else None)


def user_stacklevel() -> int:
    """The stacklevel of the first caller frame outside jamp and JAX (the user's line)."""
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and (
        _is_internal(frame.f_code.co_filename) or frame.f_code.co_filename.startswith("<")
    ):
        frame, level = frame.f_back, level + 1
    return level


def user_site() -> str:
    """`` at model.py:12``: the user's line ``user_stacklevel`` finds, as a label's tail."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and (
        _is_internal(frame.f_code.co_filename) or frame.f_code.co_filename.startswith("<")
    ):
        frame = frame.f_back
    if frame is None:
        return ""
    return f" at {os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


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
    regions: int = 0  # how many region markers (jamp.autocast regions) enclose it

    @property
    def value_dtype(self) -> np.dtype:
        """What the compute dtype means outside the lower table (bfloat16 for float8)."""
        return value_dtype(self.dtype)

    def enter_scope(self, name: str, rules: tuple) -> RegionState:
        path = self.path + (name,)
        joined = "/".join(path)
        state = dataclasses.replace(self, path=path)
        new = [
            i
            for i, (pattern, _) in enumerate(rules)
            if i not in self.matched
            and not is_line_rule(pattern)
            and scope_matches(joined, pattern)
        ]
        if not new:
            return state
        pattern, dtype = rules[new[-1]]  # the later rule wins among those matching at this scope
        enabled, dtype = (False, self.dtype) if dtype is None else (True, dtype)
        return dataclasses.replace(
            state,
            enabled=enabled,
            dtype=dtype,
            matched=self.matched | frozenset(new),
            decided_by=f"rule {pattern!r}",
        )

    def at_lines(
        self, frames: Sequence[tuple[str, int]], rules: tuple, in_region: int = 0
    ) -> RegionState:
        """The state of an operation traced at ``frames`` (``(file, line)``, innermost first): the
        line rule matching the innermost frame applies, unless a scope rule or a region decided
        (a line is the fallback for code without scopes); at one frame the later rule wins.
        ``in_region``: for the region front end, how many regions enclose the one carrying the
        policy, itself included: that region yields to line rules, a region nested in it
        (``jamp.autocast(enabled=False)``) does not, and a scope rule takes precedence."""
        if self.decided_by.startswith("rule") or (
            self.decided_by == "region" and (not in_region or self.regions > in_region)
        ):
            return self
        for file, line in frames:
            hits = line_rule_hits(file, line, rules)
            if hits:
                pattern, dtype = rules[hits[-1]]
                enabled, dtype = (False, self.dtype) if dtype is None else (True, dtype)
                return dataclasses.replace(
                    self, enabled=enabled, dtype=dtype, decided_by=f"rule {pattern!r}"
                )
        return self
