"""Shared pieces of the jamp benchmarks: the Flax models, jaxpr/HLO counting and table printing.

Every model takes ``dtype`` (computation dtype, ``None`` = float32 like a plain Flax model) and
``param_dtype`` (always float32 here), so the float32 model and the hand-written bfloat16 model
share one parameter tree.
"""
from __future__ import annotations

import collections
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

F32 = jnp.float32
BF16 = jnp.bfloat16


# --- models ----------------------------------------------------------------------------------

class Block(nn.Module):
    """Pre-LN transformer block: LN -> multi-head self-attention -> residual, LN -> MLP(gelu)."""

    d: int
    heads: int
    dtype: Any = None
    param_dtype: Any = F32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        h = nn.LayerNorm(**kw)(x)
        h = nn.MultiHeadDotProductAttention(num_heads=self.heads, **kw)(h, h)
        x = x + h
        h = nn.LayerNorm(**kw)(x)
        h = nn.Dense(4 * self.d, **kw)(h)
        h = nn.gelu(h)
        h = nn.Dense(self.d, **kw)(h)
        return x + h


class Transformer(nn.Module):
    """``n_blocks`` pre-LN blocks, a final LayerNorm and a linear head."""

    n_blocks: int
    d: int = 64
    heads: int = 4
    dtype: Any = None
    param_dtype: Any = F32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        for _ in range(self.n_blocks):
            x = Block(self.d, self.heads, **kw)(x)
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
