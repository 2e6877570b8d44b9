"""Shared pieces of the jamp benchmarks: the Flax models, jaxpr/HLO counting and table printing.

Every model takes ``dtype`` (computation dtype, ``None`` = float32 like a plain Flax model) and
``param_dtype`` (always float32 here), so the float32 model and the hand-written bfloat16 model
share one parameter tree.
"""
from __future__ import annotations

import collections
import dataclasses
import gc
import math
import os
import re
import statistics
import subprocess
import time
from typing import Any, Callable, Iterable, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from jamp import _compat as jamp_compat  # version-dependent scan params (num_consts / ft_in)

F32 = jnp.float32
BF16 = jnp.bfloat16


# --- models ----------------------------------------------------------------------------------

def attention_softmax_f32(query: jax.Array, key: jax.Array, value: jax.Array, bias: Any = None,
                           mask: Any = None, dtype: Any = None) -> jax.Array:
    """``nn.dot_product_attention`` with the softmax computed in float32 and its weights rounded
    to the attention's dtype for the product with the values: by hand, what jamp's policy (and
    torch's autocast) does to a softmax between two 16-bit matmuls. (Flax's own
    ``force_fp32_for_softmax`` keeps the weights float32, which makes that product float32.)"""
    weights = nn.dot_product_attention_weights(query, key, bias, mask, dtype=dtype,
                                               force_fp32_for_softmax=True)
    return jnp.einsum("...hqk,...khd->...qhd", weights.astype(value.dtype), value)


class Block(nn.Module):
    """Pre-LN transformer block: LN -> multi-head self-attention -> residual, LN -> MLP(gelu).

    ``softmax_f32``: the attention's softmax in float32 (``attention_softmax_f32``)."""

    d: int
    heads: int
    dtype: Any = None
    param_dtype: Any = F32
    softmax_f32: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        h = nn.LayerNorm(**kw)(x)
        attention = attention_softmax_f32 if self.softmax_f32 else nn.dot_product_attention
        h = nn.MultiHeadDotProductAttention(num_heads=self.heads, attention_fn=attention,
                                            **kw)(h, h)
        x = x + h
        h = nn.LayerNorm(**kw)(x)
        h = nn.Dense(4 * self.d, **kw)(h)
        h = nn.gelu(h)
        h = nn.Dense(self.d, **kw)(h)
        return x + h


class Transformer(nn.Module):
    """``n_blocks`` pre-LN blocks, a final LayerNorm and a linear head.

    ``remat=True`` wraps every block in ``nn.remat`` (``jax.checkpoint``): the backward pass
    recomputes each block's activations instead of storing them.
    """

    n_blocks: int
    d: int = 64
    heads: int = 4
    dtype: Any = None
    param_dtype: Any = F32
    remat: bool = False
    softmax_f32: bool = False  # (Block's)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        block = nn.remat(Block) if self.remat else Block
        for _ in range(self.n_blocks):
            x = block(self.d, self.heads, softmax_f32=self.softmax_f32, **kw)(x)
        x = nn.LayerNorm(**kw)(x)
        return nn.Dense(self.d, **kw)(x)


class CNN(nn.Module):
    """Small image classifier: 3 x (conv 3x3 -> relu -> avg-pool 2x2), then a 2-layer MLP head."""

    features: Sequence[int] = (32, 64, 64)
    classes: int = 10
    dtype: Any = None
    param_dtype: Any = F32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        for f in self.features:
            x = nn.relu(nn.Conv(f, (3, 3), **kw)(x))
            x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        x = x.reshape(x.shape[0], -1)
        x = nn.relu(nn.Dense(128, **kw)(x))
        return nn.Dense(self.classes, **kw)(x)


class MLP(nn.Module):
    """``depth`` x (Dense -> gelu), then a linear head."""

    depth: int = 4
    width: int = 256
    dtype: Any = None
    param_dtype: Any = F32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        for _ in range(self.depth):
            x = nn.gelu(nn.Dense(self.width, **kw)(x))
        return nn.Dense(10, **kw)(x)


class LSTM(nn.Module):
    """``layers`` x ``nn.RNN(nn.LSTMCell(hidden))`` over ``[batch, time, features]``, then a
    linear head on the last time step.

    ``nn.RNN`` is a Flax lifted ``nn.scan``: one ``scan`` per layer whose body (the cell, eight
    ``Dense`` layers) receives the cell's float32 parameters as loop-invariant constants. The carry
    (``c``, ``h``) is float32 in both variants (``initialize_carry`` uses ``param_dtype``).
    """

    hidden: int = 256
    layers: int = 2
    classes: int = 10
    dtype: Any = None
    param_dtype: Any = F32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        for _ in range(self.layers):
            x = nn.RNN(nn.LSTMCell(self.hidden, **kw))(x)
        return nn.Dense(self.classes, **kw)(x[:, -1])


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy over all positions, computed in float32 (``logits[..., c]``
    against integer ``labels`` of ``logits.shape[:-1]``), as a training loop would write it."""
    logp = jax.nn.log_softmax(logits.astype(F32))
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))


def jnp_mlp(params: Sequence[tuple[jax.Array, jax.Array]], x: jax.Array) -> jax.Array:
    """Pure-jnp MLP: ``x = tanh(x @ w + b)`` per layer. Tracing it costs almost nothing."""
    for w, b in params:
        x = jnp.tanh(x @ w + b)
    return x


def jnp_mlp_params(layers: int, width: int) -> list[tuple[jax.Array, jax.Array]]:
    keys = jax.random.split(jax.random.key(0), layers)
    return [(jax.random.normal(k, (width, width), F32) / math.sqrt(width), jnp.zeros((width,), F32))
            for k in keys]


# --- jaxpr and HLO inspection ------------------------------------------------------------------

# Primitives that only move or replicate data: a loop constant stays loop-invariant through them.
_SHAPE_ONLY = frozenset({"broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose"})

def _sub_jaxprs(value: Any) -> Iterable[Any]:
    """Jaxprs (open or closed, any JAX version) found in one equation parameter."""
    if isinstance(value, (tuple, list)):
        for v in value:
            yield from _sub_jaxprs(v)
    elif hasattr(value, "eqns"):
        yield value
    elif hasattr(value, "jaxpr") and hasattr(value.jaxpr, "eqns"):
        yield value.jaxpr


def primitive_name(eqn: Any) -> str:
    return eqn.primitive.name


def primitive_and_dtype(eqn: Any) -> tuple[str, str]:
    """``(primitive, dtype of the first output)``, e.g. ``("add", "bfloat16")``."""
    aval = eqn.outvars[0].aval if eqn.outvars else None
    return eqn.primitive.name, str(getattr(aval, "dtype", ""))


def count_eqns(jaxpr: Any, key: Callable[[Any], Any] = primitive_name) -> collections.Counter:
    """Counts of ``key(eqn)`` over ``jaxpr`` and, recursively, every sub-jaxpr (jit bodies, ...)."""
    jaxpr = jaxpr.jaxpr if hasattr(jaxpr, "jaxpr") and hasattr(jaxpr.jaxpr, "eqns") else jaxpr
    counts: collections.Counter = collections.Counter()
    for eqn in jaxpr.eqns:
        counts[key(eqn)] += 1
        for value in eqn.params.values():
            for sub in _sub_jaxprs(value):
                counts.update(count_eqns(sub, key))
    return counts


def _open(jaxpr: Any) -> Any:
    return jaxpr.jaxpr if hasattr(jaxpr, "jaxpr") and hasattr(jaxpr.jaxpr, "eqns") else jaxpr


def _invariant_casts(body: Any, invariant: Iterable[Any]) -> int:
    """``convert_element_type`` equations of ``body`` (not of its sub-jaxprs) whose operand is
    one of ``invariant`` or a reshape/broadcast of one."""
    invariant, casts = set(invariant), 0
    for eqn in body.eqns:
        name = eqn.primitive.name
        if name in _SHAPE_ONLY | {"convert_element_type"} and eqn.invars[0] in invariant:
            invariant.add(eqn.outvars[0])
            casts += name == "convert_element_type"
    return casts


def loop_constant_casts(jaxpr: Any) -> int:
    """Casts of loop constants traced inside ``scan``/``while`` bodies, over every (nested) loop.

    A loop constant is a value the body receives unchanged every iteration (a scan's ``consts``,
    e.g. the weights of an RNN cell). A cast of one is the same every iteration: as traced, it
    runs once per iteration, unless something hoists it out of the loop.
    """
    jaxpr, casts = _open(jaxpr), 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            body = _open(eqn.params["jaxpr"])
            n_consts, _ = jamp_compat.scan_counts(eqn.params, len(eqn.invars))  # params vary
            casts += _invariant_casts(body, [*body.constvars, *body.invars[:n_consts]])
        elif eqn.primitive.name == "while":
            body = _open(eqn.params["body_jaxpr"])
            casts += _invariant_casts(body, [*body.constvars,
                                             *body.invars[:eqn.params["body_nconsts"]]])
        for value in eqn.params.values():
            for sub in _sub_jaxprs(value):
                casts += loop_constant_casts(sub)
    return casts


_HLO_OP = re.compile(r"=\s*(\w+)\[[^\]]*\][^ ]*\s+([\w-]+)\(")


def hlo_op_counts(hlo_text: str) -> collections.Counter:
    """``(opcode, result type)`` counts over an HLO module's instructions, fusions included."""
    counts: collections.Counter = collections.Counter()
    for line in hlo_text.splitlines():
        m = _HLO_OP.search(line)
        if m:
            counts[(m.group(2), m.group(1))] += 1
    return counts


def normalized_hlo(hlo_text: str) -> list[str]:
    """The instructions of an HLO module without names, metadata and order: two programs that
    normalize equally compute the same thing the same way (up to instruction order)."""
    body = hlo_text[hlo_text.find("\n\n%") + 1:] if "\n\n%" in hlo_text else hlo_text
    lines = []
    for line in body.splitlines():
        line = re.sub(r",?\s*metadata=\{[^}]*\}", "", line)
        line = re.sub(r"%[\w.\-]+", "%v", line)
        line = re.sub(r"\b(fused_computation|region|wrapped)[\w.\-]*", r"\1", line).strip()
        if line:
            lines.append(line)
    return sorted(lines)


def count_converts(hlo_text: str) -> int:
    """Lines of an HLO module containing `` convert(`` (fused computations included)."""
    return sum(" convert(" in line for line in hlo_text.splitlines())


_HLO_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s*\(")
_HLO_CALLEE = re.compile(r"(?:calls|body|condition|to_apply|true_computation|false_computation)"
                         r"=%([\w.\-]+)|branch_computations=\{([^}]*)\}")
_HLO_TYPE = re.compile(r"=\s*(\w+)\[([^\]]*)\]")
_HLO_OP_NAME = re.compile(r'op_name="([^"]*)"')


def hlo_computations(hlo_text: str) -> dict[str, list[str]]:
    """Instruction lines of every computation of an HLO module, by computation name."""
    comps: dict[str, list[str]] = {}
    current: Optional[list[str]] = None
    for line in hlo_text.splitlines():
        m = _HLO_COMPUTATION.match(line)
        if m and line.rstrip().endswith("{"):
            current = comps[m.group(1)] = []
        elif line.startswith("}"):
            current = None
        elif current is not None:
            current.append(line)
    return comps


def hlo_loop_computations(comps: dict[str, list[str]]) -> set[str]:
    """Names of the computations that run once per iteration of some ``while`` loop: the loops'
    bodies and conditions and everything they call (fusions, reductions, nested loops)."""
    pending = [name for lines in comps.values() for line in lines if " while(" in line
               for name in re.findall(r"(?:body|condition)=%([\w.\-]+)", line)]
    seen: set[str] = set()
    while pending:
        name = pending.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        for line in comps[name]:
            for m in _HLO_CALLEE.finditer(line):
                pending += [m.group(1)] if m.group(1) else \
                    [c.strip().lstrip("%") for c in m.group(2).split(",")]
    return seen


@dataclasses.dataclass(frozen=True)
class ConvertSite:
    """One ``convert`` instruction of an optimized HLO module."""

    in_loop: bool      # in a computation that runs once per while-loop iteration
    dtype: str         # result element type, e.g. "bf16"
    shape: tuple       # result shape
    op_name: str       # JAX name stack of the op it came from ("" if XLA inserted it)
    line: str          # the instruction, metadata stripped

    @property
    def from_loop_body(self) -> bool:
        """Traced inside a scan/while body (JAX's name stack says ``while/body``)."""
        return "while/body" in self.op_name

    @property
    def is_user_cast(self) -> bool:
        """A ``convert_element_type`` of the program rather than one XLA inserted (bf16
        emulation on the CPU, fusions)."""
        return self.op_name.endswith("convert_element_type")


def hlo_convert_sites(hlo_text: str) -> list[ConvertSite]:
    """Every ``convert`` of an optimized HLO module, with whether it runs inside a loop."""
    comps = hlo_computations(hlo_text)
    loops = hlo_loop_computations(comps)
    sites = []
    for name, lines in comps.items():
        for line in lines:
            if " convert(" not in line:
                continue
            m, meta = _HLO_TYPE.search(line), _HLO_OP_NAME.search(line)
            shape = tuple(int(d) for d in m.group(2).split(",") if d.strip()) if m else ()
            sites.append(ConvertSite(
                in_loop=name in loops, dtype=m.group(1) if m else "?", shape=shape,
                op_name=meta.group(1) if meta else "",
                line=re.sub(r",?\s*metadata=\{[^}]*\}", "", line).strip()))
    return sites


# --- timing and output -------------------------------------------------------------------------

class FullGcTimer:
    """Seconds spent in full (generation-2) garbage collections while active.

    A full collection walks the whole Python heap (JAX, Flax and the programs being built), so a
    workload that allocates more can cross the collector's threshold and pay one in a sample.
    """

    def __init__(self) -> None:
        self.seconds = 0.0
        self._start = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start

    def __enter__(self) -> "FullGcTimer":
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: Any) -> None:
        gc.callbacks.remove(self._callback)


def timed(fn: Callable[..., Any], setup: Optional[Callable[[], Any]] = None) -> tuple[float, float]:
    """(seconds one call of ``fn`` takes, seconds of it spent in full garbage collections).

    Calls ``fn(setup())`` if ``setup`` is given, the setup untimed. A collection runs first, so
    that garbage of earlier samples is collected in none.
    """
    args = () if setup is None else (setup(),)
    gc.collect()
    with FullGcTimer() as full_gc:
        start = time.perf_counter()
        fn(*args)
        elapsed = time.perf_counter() - start
    return elapsed, full_gc.seconds


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def paired_ratio(num: Sequence[float], den: Sequence[float]) -> float:
    """Median of per-round ratios of interleaved samples: robust to load that drifts between
    rounds (the machine may be shared), unlike the ratio of two medians."""
    return statistics.median(a / b for a, b in zip(num, den))


def loglog_slope(xs: Sequence[float], ys: Sequence[float]) -> Optional[float]:
    """Least-squares slope of log(y) against log(x): 1.0 means y grows linearly in x."""
    if len(xs) < 2:
        return None
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    den = sum((a - mx) ** 2 for a in lx)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / den if den else None


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def environment() -> str:
    import platform
    import sys

    import flax
    import jaxlib
    try:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        commit = subprocess.run(["git", "-C", root, "describe", "--always", "--dirty"],
                                capture_output=True, text=True, timeout=10).stdout.strip() or "n/a"
    except (OSError, subprocess.SubprocessError):
        commit = "n/a"
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    return (f"python {sys.version.split()[0]}, jax {jax.__version__}, jaxlib {jaxlib.__version__}, "
            f"flax {flax.__version__}, backend {jax.default_backend()}, "
            f"{os.cpu_count()} CPU cores, {platform.machine()}, load average at start {load}; "
            f"jamp at {commit}")
