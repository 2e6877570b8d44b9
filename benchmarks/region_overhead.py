"""What the region form (``with jamp.autocast():`` anywhere, issue 21) costs.

A region pushes a JAX trace (``jamp/region_trace.py``) that receives every primitive bound in the
block and applies the policy's rule to it as it goes by, instead of tracing the whole function and
rewriting its jaxpr afterwards as ``jamp.autocast_transform`` does. Three questions:

(a) Tracing overhead (``trace``)
  ``jax.make_jaxpr(g)(params, x)`` with ``g`` = ``model.apply`` inside ``with jamp.autocast():``
  ("region") against ``jax.make_jaxpr(f)(params, x)`` of the plain float32 function ("plain"),
  of the same model written by hand in bfloat16 ("hand bf16": Flax ``dtype=jnp.bfloat16``,
  float32 parameters) and ``jax.make_jaxpr(jamp.autocast_transform(f))(params, x)``
  ("transform", trace + rewrite) in the same interleaved loop. Model: the Flax pre-LN transformer stack of
  ``rewrite_overhead.py`` (``stack_case``), 12 / 24 / 48 blocks, d=64, 4 heads, seq 16, batch 2.
  Goals (issue 33): region/hand bf16 <= 1.1x and transform/plain <= 1.1x (issue 21 asked for
  region/plain <= 1.1x; reported too). Also reported: region/transform, which answers
  the issue's question whether ``autocast_transform`` itself should run on the trace path (one
  pass instead of two).

(a') The floor of the transform's rewrite (``floor``)
  ``autocast_transform`` re-emits every equation of the traced program into the caller's trace
  (staged directly where it can, ``compat.stage_like``, else bound). The same ``make_jaxpr``
  with the rules switched off (every equation re-emitted as traced: an ablation) gives what
  that alone costs against plain tracing, which no rule can go below.

(a'') Tracing with full collections shared out (``amortized``)
  (a) forces a collection before every sample, so a side pays a full (generation-2) collection
  only when its own survivors within one call cross the collector's threshold. Here each side
  is traced several times in a row with no forced collection, the sides alternating by round,
  so each pays the full collections its survivors trigger, as a process tracing many programs
  does (``--amortized-calls``, ``--amortized-rounds``; the sides of (a), and the region with
  the reference cycle it had before issue 33's eleventh pass restored, an ablation:
  ``region_cycle_restored``), and the objects one call leaves in reference cycles.

(a''') Where a region's trace spends its time (``attribution``, a diagnostic)
  The largest stack of (a), hand bf16 and region only: every outermost bind each side's trace
  handles is timed by its primitive or ``jnp`` function (``bind_timers``), and each trace split
  into those binds, Flax's parameter check (``Scope.param``) and the rest; the binds where the
  region spends more than hand bf16 come first (``--top`` rows).

(a4) Objects alive at the end of a trace (``alive``, deterministic, not run by default)
  Plain, hand bf16 and region: the objects the garbage collector tracks that are alive when the
  traced function has run (the region still open), less those alive before: what every full
  collection during a trace walks on top of the heap, and what counts towards the collector's
  threshold for one.

(a5) Tracing a train step (``grad-trace``, not run by default)
  ``make_jaxpr`` of the train step of (b) (``jax.value_and_grad`` of the loss and the optax
  update), plain float32, hand bf16, the region and ``autocast_transform`` called under
  ``jax.grad``, at ``--grad-blocks`` (default 4 12 24): the tracing part of (b)'s first call,
  where JAX linearizes every operation the forward binds (issue 33, forty-first pass: the
  transform's operations bound as jitted calls, ``_compat.bind_to_linearize``).

(b) First call of a jitted train step (``compile``)
  ``jax.jit(step)`` with ``step`` = ``jax.value_and_grad(loss)`` + an optax SGD (momentum 0.9)
  update, ``loss = cross_entropy(forward(params, x), labels)`` (float32 log-softmax), traced,
  lowered, compiled and run once (``jitted.lower(...)``, ``.compile()``, one call: JAX's own
  first call does the same three things). The forward is, per side: "region" (the float32 model
  inside ``with jamp.autocast():``), "hand bf16" (the same Flax model written by hand with
  ``dtype=jnp.bfloat16, param_dtype=jnp.float32``), "transform" (``autocast_transform`` of the
  float32 forward) and "f32" (the float32 model, no autocast; a reference). Same float32
  parameters everywhere. Model: the transformer stack at 4 and 12 blocks (same widths as (a)).
  Goal: region/hand <= 1.02x.
  The policy computes a softmax in float32 (as torch's autocast does) where Flax's bf16 model
  computes it in bfloat16, and XLA compiles the two programs in different times. Two more sides
  compare the same numerics: "hand bf16, f32 softmax" (the hand-written model with its softmax
  in float32, ``common.attention_softmax_f32``) against "region", and "region, bf16 softmax" (a
  region whose policy leaves ``exp`` to the promote table: ``BF16_SOFTMAX``) against "hand
  bf16": what the region itself adds to a first call, apart from the numerics it asks for.

(b') What a train step keeps for its backward pass (``residuals``)
  The bytes of the values ``jax.vjp`` of the loss keeps (the leaves of its VJP function, found
  by ``jax.eval_shape``: nothing runs), per side of (b), on a 4-block stack at d=256, seq 256,
  batch 8: how much of a step's activation memory each form keeps, and in which dtype.

(c) Eager steps of the digits CNN (``eager``)
  The CNN of ``examples/digits.py`` (conv-BN-relu x2, max-pool, dense 64, dense 10; batch 64 of
  8x8x1), called without ``jax.jit``: "region" runs the forward inside ``with jamp.autocast():``
  (op by op: every primitive goes through the region's rule and JAX's eager dispatch),
  "transform" calls ``jamp.autocast_transform(forward)`` eagerly (today's eager call: traced
  once per signature, rewritten, compiled and then the executable reused), "plain" is the float32
  forward op by op (a reference for what eager dispatch costs without jamp). Two modes: "forward"
  (``model.apply(variables, x, False)``) and "train step" (eager ``jax.value_and_grad`` of the
  cross-entropy loss of ``model.apply(..., True, mutable=["batch_stats"])`` + an eager optax SGD
  update, the forward region/transformed as above). Measured: steady state (after warm-up
  calls), the first call of a new function object in a warm process (``transform`` traces,
  rewrites and compiles again; the region has nothing to cache), and the first call in a fresh
  process (a subprocess per sample: JAX's per-primitive executables are cold too). Goal (issue
  33): region <= 1.2x plain float32 eager.

(c') The floor of an eager region (``eager-floor``, not run by default)
  The forward of (c) with a fourth side, the region passing every operation through to JAX
  unchanged (``region_passes_through``, an ablation): what being the current trace costs eagerly
  before the policy decides anything (JAX runs a ``jnp`` call's Python ``jit`` path, not its C++
  fast path, under any trace but its own eager one). Then the same per operation: a ``jnp``
  call, a primitive the policy leaves float32 and one it casts, each called eagerly in a row,
  plain, by hand in the dtype the policy gives it, passed through and in a region
  (``EAGER_OPERATIONS``): what being a trace costs per call, and what the policy's decision and
  replay add.

Conventions (as in the other benchmarks)
  Garbage collector on; a ``gc.collect()`` before every sample and the time of full (generation-2)
  collections inside a sample recorded (``common.timed``). The sides are sampled in every
  repetition, in an order that rotates from one repetition to the next, and in (a) every size in
  every repetition, so load drifting on a shared machine hits all of them alike. Ratios are
  medians of per-repetition ratios, with their min-max and interquartile range; "over sizes" pools
  the per-repetition ratios of all sizes. Fresh function objects every sample (a new closure, a
  new ``autocast_transform`` wrapper, a new ``jax.jit``), so neither JAX's trace and compilation
  caches nor jamp's caches answer. What does carry over between samples, on every side alike, is
  what a real process keeps too: JAX's traces of library functions that are ``jax.jit``-ed
  themselves (``jax.nn.gelu``, ``jnp`` helpers) and, for the region, jamp's rewrites of those
  jaxprs (kept per policy across regions, ``region_trace._STORES``).
  ``--processes K`` runs (a) in K fresh processes, one after another, and pools them: one
  process's medians move by a few points between runs of unchanged code (its hash seed and heap
  layout are its own), which pooling averages over; each process's median is printed too.

Usage::

    JAX_PLATFORMS=cpu .venv/bin/python    benchmarks/region_overhead.py   # all but (a''), (a''')
    JAX_PLATFORMS=cpu .venv312/bin/python benchmarks/region_overhead.py
    JAX_PLATFORMS=cpu .venv/bin/python    benchmarks/region_overhead.py --quick    # smoke run
    JAX_PLATFORMS=cpu .venv/bin/python    benchmarks/region_overhead.py --parts trace --profile
    JAX_PLATFORMS=cpu .venv/bin/python    benchmarks/region_overhead.py --parts trace --processes 8 --reps 8
    JAX_PLATFORMS=cpu .venv/bin/python    benchmarks/region_overhead.py --parts amortized --blocks 12 48
    JAX_PLATFORMS=cpu .venv/bin/python    benchmarks/region_overhead.py --parts attribution --blocks 24
    JAX_PLATFORMS=cpu .venv/bin/python    benchmarks/region_overhead.py --parts eager-floor
    JAX_PLATFORMS=cpu .venv/bin/python    benchmarks/region_overhead.py --parts alive --blocks 12 48
    JAX_PLATFORMS=cpu .venv/bin/python    benchmarks/region_overhead.py --parts grad-trace --reps 9
    # also: --blocks 12 24 48, --compile-blocks 4 12, --reps, --compile-reps, --eager-reps,
    #       --cold-reps, --caller-depths 0 8 16 (see rewrite_overhead.py), --top
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import functools
import gc
import json
import math
import os
import pstats
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)
from common import (  # noqa: E402
    BF16,
    F32,
    Transformer,
    count_converts,
    count_eqns,
    FullGcTimer,
    cross_entropy,
    environment,
    hlo_op_counts,
    markdown_table,
    median,
    normalized_hlo,
    timed,
)
from rewrite_overhead import at_depth, stack_case  # noqa: E402
from tests.collector import left_in_cycles  # noqa: E402

import jamp  # noqa: E402

GOAL_TRACE = 1.1     # (a) region / hand-written bf16 make_jaxpr; transform / plain (issue 33)
GOAL_COMPILE = 1.02  # (b) region / hand-written bf16, first call of the jitted train step
D, HEADS, SEQ, BATCH = 64, 4, 16, 2  # the transformer of rewrite_overhead.py


# The default policy with the softmax's exp (and so its shift: rules/softmax.py) left to the
# promote table: a bfloat16 softmax, as Flax's ``dtype=bfloat16`` model computes it.
BF16_SOFTMAX = jamp.Policy(fp32=jamp.Policy().fp32 - {"exp"})


def in_region(fn: Callable, policy: jamp.Policy | None = None) -> Callable:
    """A new function: ``fn`` called inside ``with jamp.autocast(policy):`` (default: the
    default policy, bf16)."""

    def region_fn(*args: Any) -> Any:
        with jamp.autocast(policy):
            return fn(*args)

    return region_fn


def rotated(items: Sequence[Any], i: int) -> list[Any]:
    """``items`` starting at position ``i`` (mod len): the sampling order of repetition ``i``."""
    k = i % len(items)
    return [*items[k:], *items[:k]]


def spread(ratios: Sequence[float]) -> dict[str, float]:
    """Median, min, max and interquartile range of per-repetition ratios."""
    qs = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else \
        [ratios[0]] * 3
    return {"median": median(ratios), "min": min(ratios), "max": max(ratios),
            "q1": qs[0], "q3": qs[2]}


def fmt_spread(s: dict[str, float], bold: bool = False) -> str:
    m = f"**{s['median']:.2f}x**" if bold else f"{s['median']:.2f}x"
    return f"{m} ({s['min']:.2f}–{s['max']:.2f}, IQR {s['q1']:.2f}–{s['q3']:.2f})"


def ratios(num: Sequence[float], den: Sequence[float]) -> list[float]:
    return [a / b for a, b in zip(num, den)]


def load() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"


# --- (a) tracing overhead ---------------------------------------------------------------------

TRACE_SIDES = ("plain", "hand bf16", "region", "transform")


def trace_sides(make_fn: Callable[[], Callable], args: Sequence[Any],
                hand: Any = None) -> dict[str, Callable]:
    """One zero-argument callable per side; each builds fresh function objects and traces.
    ``hand``: the same model written by hand in bfloat16 (issue 33's reference)."""
    return {
        "plain": lambda: jax.make_jaxpr(make_fn())(*args),
        "hand bf16": lambda: jax.make_jaxpr(lambda p, x: hand.apply(p, x))(*args),
        "region": lambda: jax.make_jaxpr(in_region(make_fn()))(*args),
        "transform": lambda: jax.make_jaxpr(jamp.autocast_transform(make_fn()))(*args),
    }


def measure_trace(blocks: Sequence[int], reps: int, warmup: int,
                  depths: Sequence[int]) -> list[dict[str, Any]]:
    cases = [trace_sides(*stack_case(n, d=D, heads=HEADS, seq=SEQ, batch=BATCH),
                         hand=Transformer(n, d=D, heads=HEADS, dtype=BF16)) for n in blocks]
    # samples[size][side] -> [(seconds, full-GC seconds)], one per (repetition, caller depth)
    samples = [{side: [] for side in TRACE_SIDES} for _ in cases]
    for i in range(warmup + reps):
        for depth in depths:
            for case, row in zip(cases, samples):
                for side in rotated(TRACE_SIDES, i):
                    t, gc_s = timed(functools.partial(at_depth, depth, case[side]))
                    if i >= warmup:
                        row[side].append((t, gc_s))
    results = []
    for n, case, row in zip(blocks, cases, samples):
        t = {side: [s[0] for s in row[side]] for side in TRACE_SIDES}
        no_gc = {side: [s[0] - s[1] for s in row[side]] for side in TRACE_SIDES}
        counts = {side: count_eqns(case[side]()) for side in TRACE_SIDES}
        results.append({
            "blocks": n,
            "eqns": {side: sum(c.values()) for side, c in counts.items()},
            "casts": {side: c["convert_element_type"] - counts["plain"]["convert_element_type"]
                      for side, c in counts.items()},
            "ms": {side: median(ts) * 1e3 for side, ts in t.items()},
            "gc_ms": {side: median([s[1] for s in row[side]]) * 1e3 for side in TRACE_SIDES},
            "region/plain": ratios(t["region"], t["plain"]),
            "region/hand": ratios(t["region"], t["hand bf16"]),
            "hand/plain": ratios(t["hand bf16"], t["plain"]),
            "transform/plain": ratios(t["transform"], t["plain"]),
            "region/transform": ratios(t["region"], t["transform"]),
            "region/plain no GC": ratios(no_gc["region"], no_gc["plain"]),
            "transform/plain no GC": ratios(no_gc["transform"], no_gc["plain"]),
        })
    return results


RATIO_KEYS = ("region/plain", "region/hand", "hand/plain", "transform/plain", "region/transform",
              "region/plain no GC", "transform/plain no GC")


def measure_trace_in_processes(blocks: Sequence[int], reps: int, depths: Sequence[int],
                               processes: int) -> list[dict[str, Any]]:
    """(a) in ``processes`` fresh Python processes, one after another (each with its own hash
    seed and heap layout, and JAX's caches cold until its warm-up), pooled: per-repetition
    ratios joined, milliseconds the median of the processes' medians, and each process's median
    ratios kept (``per_process``). One process's medians move by a few points between runs of
    unchanged code (issue 33, forty-second pass); pooled, they are an estimate over layouts."""
    runs = []
    for k in range(processes):
        cmd = [sys.executable, os.path.abspath(__file__), "--trace-samples-json",
               "--blocks", *map(str, blocks), "--reps", str(reps),
               "--caller-depths", *map(str, depths)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"(process {k + 1} of {processes} done, load average {load()})", file=sys.stderr)
    pooled = []
    for i in range(len(blocks)):
        rows = [run[i] for run in runs]
        merged = dict(rows[0])
        for key in RATIO_KEYS:
            merged[key] = [x for row in rows for x in row[key]]
        merged["ms"] = {side: median([row["ms"][side] for row in rows]) for side in TRACE_SIDES}
        merged["gc_ms"] = {side: median([row["gc_ms"][side] for row in rows])
                           for side in TRACE_SIDES}
        merged["per_process"] = {key: [median(row[key]) for row in rows]
                                 for key in ("region/hand", "transform/plain")}
        pooled.append(merged)
    return pooled


def fmt_interval(medians: Sequence[float]) -> str:
    """The median of per-process medians and the sign-test interval for it (``report_trace``):
    from the second smallest to the second largest (the whole range for fewer than 6), with
    its coverage, 1 - 2 P(Binomial(n, 1/2) <= k)."""
    ordered, n = sorted(medians), len(medians)
    k = 1 if n >= 6 else 0
    coverage = 1 - 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return (f"{median(ordered):.3f}x ({ordered[k]:.3f}–{ordered[-1 - k]:.3f}, "
            f"{coverage:.0%})")


def report_trace(results: list[dict[str, Any]], reps: int, depths: Sequence[int],
                 processes: int = 1) -> None:
    per = f"{reps} repetitions" + (f" x caller depths {list(depths)}" if len(depths) > 1 else "")
    if processes > 1:
        per = f"{processes} processes x {per}"
    print(f"## (a) Tracing overhead: `make_jaxpr`, Flax transformer stack\n\n"
          f"d={D}, {HEADS} heads, seq {SEQ}, batch {BATCH}; {per} after 1 warm-up, all sizes and "
          "sides in every repetition. Ratios: median of per-repetition ratios (min–max, IQR).\n")
    rows = []
    for r in results:
        e, c, ms = r["eqns"], r["casts"], r["ms"]
        rows.append([
            f"{r['blocks']} blocks", e["plain"], f"{e['region']} (+{c['region']} casts)",
            f"{e['transform']} (+{c['transform']} casts)",
            f"{ms['plain']:.1f}", f"{ms['hand bf16']:.1f}", f"{ms['region']:.1f}",
            f"{ms['transform']:.1f}",
            fmt_spread(spread(r["region/hand"]), bold=True),
            fmt_spread(spread(r["hand/plain"])),
            fmt_spread(spread(r["region/plain"])),
            fmt_spread(spread(r["transform/plain"])),
            fmt_spread(spread(r["region/transform"])),
            f"{(ms['region'] - ms['plain']) / e['plain'] * 1e3:.0f} / "
            f"{(ms['transform'] - ms['plain']) / e['plain'] * 1e3:.0f}",
            f"{r['gc_ms']['plain']:.0f} / {r['gc_ms']['region']:.0f} / "
            f"{r['gc_ms']['transform']:.0f}",
            f"{spread(r['region/plain no GC'])['median']:.2f}x / "
            f"{spread(r['transform/plain no GC'])['median']:.2f}x",
        ])
    print(markdown_table(
        ["stack", "eqns plain", "eqns region", "eqns transform", "plain ms", "hand bf16 ms",
         "region ms", "transform ms", "region / hand bf16", "hand bf16 / plain",
         "region / plain", "transform / plain", "region / transform",
         "extra µs per plain eqn, region / transform", "full-GC ms plain / region / transform",
         "region / plain, transform / plain without full GC"], rows))
    pooled = {key: spread([x for r in results for x in r[key]])
              for key in ("region/plain", "transform/plain", "region/transform",
                          "region/hand")}
    worst = max(spread(r["region/hand"])["median"] for r in results)
    worst_transform = max(spread(r["transform/plain"])["median"] for r in results)
    print(f"\nOver all sizes and repetitions: region/hand bf16 "
          f"{fmt_spread(pooled['region/hand'])}, region/plain {fmt_spread(pooled['region/plain'])}, "
          f"transform/plain {fmt_spread(pooled['transform/plain'])}, region/transform "
          f"{fmt_spread(pooled['region/transform'])}.\n")
    if processes > 1:
        print("Each process's own median (one per process, in the order run), then the median of "
              "those and a distribution-free interval for it (sign test: the second smallest to "
              "the second largest, the whole range for fewer than 6 processes; its coverage):\n")
        print(markdown_table(
            ["stack", "region / hand bf16", "its median (interval)", "transform / plain",
             "its median (interval)"],
            [[f"{r['blocks']} blocks"]
             + [cell for key in ("region/hand", "transform/plain")
                for cell in (" ".join(f"{m:.3f}" for m in r["per_process"][key]),
                             fmt_interval(r["per_process"][key]))]
             for r in results]))
        print()
    print(f"- goal region/hand bf16 <= {GOAL_TRACE}x (issue 33): "
          f"{'met' if worst <= GOAL_TRACE else 'NOT met'} (worst size median {worst:.3f}x)")
    print(f"- goal transform/plain <= {GOAL_TRACE}x (issue 33): "
          f"{'met' if worst_transform <= GOAL_TRACE else 'NOT met'} (worst size median "
          f"{worst_transform:.3f}x)\n")


def _profiled(fn: Callable[[], Any]) -> dict:
    gc.collect()
    profiler = cProfile.Profile()
    profiler.enable()
    fn()
    profiler.disable()
    return pstats.Stats(profiler).stats


def _binds(stats: dict) -> int:
    """Calls of ``Primitive.bind`` (JAX's ``core.py``) in a profile."""
    return sum(v[1] for k, v in stats.items()
               if k[0].endswith(os.path.join("jax", "_src", "core.py")) and k[2] == "bind")


def profile_trace(blocks: int, top: int) -> None:
    """cProfile of the region trace of the ``blocks`` stack: jamp functions by cumulative time,
    all functions by self time, and the plain trace's totals beside it."""
    make_fn, args = stack_case(blocks, d=D, heads=HEADS, seq=SEQ, batch=BATCH)
    sides = trace_sides(make_fn, args, hand=Transformer(blocks, d=D, heads=HEADS, dtype=BF16))
    for side in TRACE_SIDES:
        sides[side]()  # warm up
    plain = _profiled(sides["plain"])
    stats = _profiled(sides["region"])
    transform = _profiled(sides["transform"])
    totals = {name: max(v[3] for v in st.values())
              for name, st in (("plain", plain), ("region", stats), ("transform", transform))}
    total = totals["region"]
    jamp_dir = os.path.dirname(jamp.__file__)
    own = sum(v[2] for k, v in stats.items() if k[0].startswith(jamp_dir))

    def name(k: tuple) -> str:
        path = os.path.relpath(k[0], ROOT) if k[0].startswith(ROOT) else \
            k[0].split("site-packages/")[-1]
        return f"`{path}:{k[1]}({k[2]})`"

    def table(keys: list[tuple]) -> str:
        return markdown_table(
            ["function", "calls", "cumulative ms", "% of region trace", "self ms"],
            [[name(k), stats[k][1], f"{stats[k][3] * 1e3:.1f}",
              f"{stats[k][3] / total * 100:.0f}%", f"{stats[k][2] * 1e3:.1f}"] for k in keys])

    jamp_keys = sorted((k for k in stats if k[0].startswith(jamp_dir)),
                       key=lambda k: -stats[k][3])[:top]
    self_keys = sorted(stats, key=lambda k: -stats[k][2])[:top]
    print(f"## cProfile of the region trace, {blocks} blocks\n")
    print(f"Under the profiler: plain {totals['plain'] * 1e3:.0f} ms "
          f"({_binds(plain)} `Primitive.bind` calls), region {total * 1e3:.0f} ms "
          f"({_binds(stats)} binds), transform {totals['transform'] * 1e3:.0f} ms "
          f"({_binds(transform)} binds). Self time in jamp's own code during the region trace: "
          f"{own * 1e3:.0f} ms ({own / total * 100:.0f}%).\n\njamp functions by cumulative "
          f"time:\n\n{table(jamp_keys)}\n\nAll functions by self time:\n\n{table(self_keys)}\n")


# --- (a') the rewrite's floor: every equation re-bound, no rule --------------------------------


@contextlib.contextmanager
def rules_off() -> Any:
    """An ablation, not a mode of jamp: ``autocast_transform``'s rewrite re-emits every
    equation as it is traced (``Step.bind``: staged or bound; no rule runs, nothing is tracked).
    What it still costs is the floor of a rewrite that re-emits the program into a new trace."""
    from jamp import interpreter

    apply, track = interpreter.Rewriter.apply, interpreter.track_derived
    interpreter.Rewriter.apply = lambda self, step: step.bind(step.args)
    interpreter.track_derived = lambda step, outs: None
    try:
        yield
    finally:
        interpreter.Rewriter.apply, interpreter.track_derived = apply, track


def floor_sides(make_fn: Callable[[], Callable], args: Sequence[Any]) -> dict[str, Callable]:
    """(a')'s sides. The last two start from the program already traced (plain tracing's
    jaxpr, traced once here): "rewrite alone" is ``jamp.autocast_jaxpr`` of it (the transform
    without its trace), "re-emitted by JAX" is ``make_jaxpr`` of JAX's own interpreter
    evaluating it (``jaxpr_as_fun``): the second pass of any rewrite built on JAX's
    interpreter, with nothing changed."""
    import jax.extend.core as jex

    def transform_no_rule() -> Any:
        with rules_off():
            return jax.make_jaxpr(jamp.autocast_transform(make_fn()))(*args)

    closed = jax.make_jaxpr(make_fn())(*args)
    flat = jax.tree.leaves(args)

    def re_emitted() -> Any:  # (a new function each call: make_jaxpr caches per function)
        return jax.make_jaxpr(lambda *xs: jex.jaxpr_as_fun(closed)(*xs))(*flat)

    return {"plain": lambda: jax.make_jaxpr(make_fn())(*args),
            "transform": lambda: jax.make_jaxpr(jamp.autocast_transform(make_fn()))(*args),
            "transform, no rule": transform_no_rule,
            "rewrite alone": lambda: jamp.autocast_jaxpr(closed),
            "re-emitted by JAX": re_emitted}


FLOOR_SIDES = ("plain", "transform", "transform, no rule", "rewrite alone", "re-emitted by JAX")


def measure_floor(blocks: Sequence[int], reps: int) -> None:
    sides = FLOOR_SIDES
    rows = []
    for n in blocks:
        fns = floor_sides(*stack_case(n, d=D, heads=HEADS, seq=SEQ, batch=BATCH))
        for f in fns.values():
            f()
        t: dict[str, list[float]] = {side: [] for side in sides}
        for i in range(reps):
            for side in rotated(sides, i):
                t[side].append(timed(fns[side])[0])
        rows.append([f"{n} blocks", *(f"{median(t[s]) * 1e3:.1f}" for s in sides),
                     fmt_spread(spread(ratios(t["transform"], t["plain"]))),
                     fmt_spread(spread(ratios(t["transform, no rule"], t["plain"])), True),
                     fmt_spread(spread(ratios(t["rewrite alone"], t["plain"]))),
                     fmt_spread(spread(ratios(t["re-emitted by JAX"], t["plain"])), True)])
    print("## (a') The floor of `autocast_transform`'s rewrite\n\n"
          f"The transformer stack of (a); {reps} interleaved repetitions per size. 'no rule': the "
          "rewrite re-emits every equation as traced (staged directly where it can, else bound), "
          "without running any rule (an ablation: the floor of re-emitting a program into a "
          "new trace). 'rewrite alone' (`jamp.autocast_jaxpr`) and 're-emitted by JAX' "
          "(`make_jaxpr` of `jax.extend.core.jaxpr_as_fun`) start from the program plain "
          "tracing made, traced once beforehand: the second pass alone, jamp's and JAX's own. "
          "A transform that traces and then re-emits costs at least plain + the second "
          "pass.\n")
    print(markdown_table(["stack", *(f"{side} ms" for side in sides), "transform / plain",
                          "no rule / plain", "rewrite alone / plain",
                          "re-emitted by JAX / plain"], rows))
    print()


# --- (a''') where a region's trace spends its time, against hand bf16's -------------------------


@contextlib.contextmanager
def bind_timers(acc: dict[str, float], calls: dict[str, int]) -> Any:
    """A diagnostic, not a mode of jamp: times every outermost bind a trace handles (the region's
    ``RegionTrace.process_primitive``, a jaxpr trace's ``process_primitive``) by its primitive, a
    ``jnp`` function's call by its name, into ``acc``/``calls``; Flax's parameter check
    (``Scope.param``: ``jax.eval_shape`` of the initializer) under "flax param" with the binds it
    makes. Everything these do is counted once, in the outermost one."""
    from flax.core import scope as flax_scope
    from jax._src.interpreters import partial_eval

    from jamp import region_trace

    depth = [0]

    def timed_bind(method: Callable) -> Callable:
        def wrapper(self: Any, primitive: Any, args: Any, params: dict) -> Any:
            if depth[0]:
                return method(self, primitive, args, params)
            name = (f"jnp {params.get('name', '?')}" if primitive.name in ("pjit", "jit")
                    else primitive.name)
            depth[0] += 1
            start = time.perf_counter()
            try:
                return method(self, primitive, args, params)
            finally:
                depth[0] -= 1
                acc[name] = acc.get(name, 0.0) + time.perf_counter() - start
                calls[name] = calls.get(name, 0) + 1
        return wrapper

    def timed_param(method: Callable) -> Callable:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            depth[0] += 1
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                depth[0] -= 1
                if not depth[0]:
                    acc["flax param"] = acc.get("flax param", 0.0) + time.perf_counter() - start
        return wrapper

    patched = [(region_trace.RegionTrace, "process_primitive", timed_bind),
               (partial_eval.DynamicJaxprTrace, "process_primitive", timed_bind),
               (flax_scope.Scope, "param", timed_param)]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patched]
    for owner, name, wrap in patched:
        setattr(owner, name, wrap(getattr(owner, name)))
    try:
        yield
    finally:
        for owner, name, method in saved:
            setattr(owner, name, method)


def measure_attribution(n_blocks: int, reps: int, top: int) -> None:
    sides = ("hand bf16", "region")
    fns = trace_sides(*stack_case(n_blocks, d=D, heads=HEADS, seq=SEQ, batch=BATCH),
                      hand=Transformer(n_blocks, d=D, heads=HEADS, dtype=BF16))
    samples: dict[str, list[tuple[float, dict, dict]]] = {side: [] for side in sides}
    acc: dict[str, float] = {}
    calls: dict[str, int] = {}
    with bind_timers(acc, calls):
        for side in sides:
            fns[side]()
        for i in range(reps):
            for side in rotated(sides, i):
                acc.clear()
                calls.clear()
                t = timed(fns[side])[0]
                samples[side].append((t, dict(acc), dict(calls)))

    def part(side: str, key: str) -> float:
        return median([s[1].get(key, 0.0) for s in samples[side]])

    def count(side: str, key: str) -> int:
        return samples[side][-1][2].get(key, 0)

    totals = {side: median([s[0] for s in samples[side]]) for side in sides}
    binds = {side: median([sum(v for k, v in s[1].items() if k != "flax param")
                           for s in samples[side]]) for side in sides}
    params = {side: part(side, "flax param") for side in sides}
    print(f"## (a''') Where a region's trace spends its time, against hand bf16's\n\n"
          f"The transformer stack of (a) at {n_blocks} blocks, {reps} interleaved repetitions, "
          "medians. Every outermost bind a side's trace handles is timed (the region's "
          "`RegionTrace.process_primitive`, with the staging it does on the program; hand "
          "bf16's jaxpr trace's `process_primitive`), by primitive or `jnp` function; \"flax "
          "param\" is Flax's parameter check (`Scope.param`: `jax.eval_shape` of the "
          "initializer), \"rest\" the user-level Python around them (Flax, `jnp`). The timers "
          "add about a microsecond a bind to both sides. A diagnostic (`bind_timers`).\n")
    rows = [[side, f"{totals[side] * 1e3:.1f}", f"{binds[side] * 1e3:.1f}",
             f"{params[side] * 1e3:.1f}",
             f"{(totals[side] - binds[side] - params[side]) * 1e3:.1f}"] for side in sides]
    print(markdown_table(["side", "trace ms", "binds ms", "flax param ms", "rest ms"], rows))
    print()
    keys = {k for side in sides for s in samples[side] for k in s[1] if k != "flax param"}
    diffs = sorted(keys, key=lambda k: part("hand bf16", k) - part("region", k))
    rows = []
    for k in diffs[:top]:
        h, r = part("hand bf16", k), part("region", k)
        nh, nr = count("hand bf16", k), count("region", k)
        rows.append([f"`{k}`", str(nh), f"{h * 1e3:.2f}", f"{h / max(nh, 1) * 1e6:.1f}", str(nr),
                     f"{r * 1e3:.2f}", f"{r / max(nr, 1) * 1e6:.1f}", f"{(r - h) * 1e3:+.2f}"])
    print(markdown_table(["bind", "hand binds", "hand ms", "hand µs each", "region binds",
                          "region ms", "region µs each", "region − hand ms"], rows))
    print()


# --- (a'') tracing with the collector's cost shared out over many calls ------------------------

@contextlib.contextmanager
def region_cycle_restored() -> Any:
    """An ablation, not a mode of jamp: regions made while it is active hold themselves in a
    reference cycle again, as before issue 33's eleventh pass (their references' callback a
    bound method of the region), so what they traced waits for a full collection."""
    from jamp import region_trace

    init = region_trace.RegionEnv.__init__

    def with_cycle(env: Any) -> None:
        init(env)
        env._on_death = env._forget

    region_trace.RegionEnv.__init__ = with_cycle
    try:
        yield
    finally:
        region_trace.RegionEnv.__init__ = init


AMORTIZED_SIDES = ("plain", "hand bf16", "region", "region, cycle restored", "transform")


def measure_amortized(blocks: Sequence[int], calls: int, rounds: int) -> None:
    """Each side traced ``calls`` times in a row with no collection forced before a call, the
    sides alternating by round: a full collection is paid by the side whose survivors trigger
    it, and a full collection is longer by what earlier calls left in reference cycles, as in a
    process that traces many programs. (a) collects before every sample, so a side whose
    survivors stay under the collector's threshold within one call never pays one."""
    sides = AMORTIZED_SIDES
    rows = []
    for n in blocks:
        fns = trace_sides(*stack_case(n, d=D, heads=HEADS, seq=SEQ, batch=BATCH),
                          hand=Transformer(n, d=D, heads=HEADS, dtype=BF16))

        def region_with_cycle(region: Callable = fns["region"]) -> Any:
            with region_cycle_restored():
                return region()

        fns["region, cycle restored"] = region_with_cycle
        for side in sides:
            fns[side]()
        cycles = {side: len(left_in_cycles(fns[side])) for side in sides}
        per_call: dict[str, list[float]] = {side: [] for side in sides}
        full: dict[str, list[float]] = {side: [] for side in sides}
        gc.collect()
        for r in range(rounds):
            for side in rotated(sides, r):
                with FullGcTimer() as full_gc:
                    start = time.perf_counter()
                    for _ in range(calls):
                        fns[side]()
                    per_call[side].append((time.perf_counter() - start) / calls)
                full[side].append(full_gc.seconds / calls)
        for side in sides:
            reference = "plain" if side in ("plain", "transform") else "hand bf16"
            ratio = ("" if side == reference else
                     fmt_spread(spread(ratios(per_call[side], per_call[reference])),
                                side in ("region", "transform")) + f" / {reference}")
            rows.append([f"{n} blocks", side, f"{median(per_call[side]) * 1e3:.1f}",
                         f"{median(full[side]) * 1e3:.1f}", cycles[side], ratio])
    print("## (a'') Tracing with full collections shared out\n\n"
          f"The transformer stack of (a); per side {rounds} rounds of {calls} calls in a row, no "
          "collection forced between calls, sides alternating by round; mean ms per call, of "
          "it ms in full (generation-2) collections, and the objects one call leaves in "
          "reference cycles (for full collections to find). \"region, cycle restored\" is an "
          "ablation: the region as it was before the eleventh pass of issue 33.\n")
    print(markdown_table(["stack", "side", "ms per call", "of it in full collections, ms",
                          "objects left in cycles per call", "ratio (per round)"], rows))
    print()


def objects_alive(make_fn: Callable[[], Callable], args: Sequence[Any],
                  region: bool) -> collections.Counter:
    """Objects the collector tracks, by type, alive where ``make_jaxpr`` of the function (inside
    a region when ``region``, still open) has traced all of it, less those alive before (what
    every full collection during such a trace walks besides the rest of the heap)."""
    fn = make_fn()
    alive: list[collections.Counter] = []

    def count() -> None:
        gc.collect()
        alive.append(collections.Counter(type(o).__qualname__ for o in gc.get_objects()))

    def probed(*xs: Any) -> Any:
        if not region:
            out = fn(*xs)
            count()
            return out
        with jamp.autocast():
            out = fn(*xs)
            count()  # (before the region ends: what it keeps lives as long as it is open)
        return out

    jax.make_jaxpr(lambda *xs: probed(*xs))(*args)  # (warm: what caches keep is not counted)
    gc.collect()
    before = collections.Counter(type(o).__qualname__ for o in gc.get_objects())
    jax.make_jaxpr(lambda *xs: probed(*xs))(*args)
    return alive[-1] - before


def measure_alive(blocks: Sequence[int]) -> None:
    rows = []
    for n in blocks:
        make_fn, args = stack_case(n, d=D, heads=HEADS, seq=SEQ, batch=BATCH)
        hand = Transformer(n, d=D, heads=HEADS, dtype=BF16)
        counts = {"plain": objects_alive(make_fn, args, False),
                  "hand bf16": objects_alive(lambda: (lambda p, x: hand.apply(p, x)), args, False),
                  "region": objects_alive(make_fn, args, True)}
        totals = {side: sum(c.values()) for side, c in counts.items()}
        extra = counts["region"] - counts["hand bf16"]
        rows.append([f"{n} blocks", *(totals[s] for s in counts),
                     f"**{totals['region'] / totals['hand bf16']:.2f}x**",
                     ", ".join(f"{k} +{v}" for k, v in extra.most_common(4))])
    print("## (a4) Objects alive at the end of a trace\n\n"
          "Objects the garbage collector tracks, alive when the traced function has run (the "
          "region still open; after a collection) less those alive before the trace: what "
          "each full collection during "
          "such a trace walks besides the rest of the heap. Deterministic.\n")
    print(markdown_table(["stack", "plain", "hand bf16", "region", "region / hand bf16",
                          "region's most over hand bf16, by type"], rows))
    print()


# --- (b') what a train step keeps for its backward pass ------------------------------------------

RESIDUAL_SIDES = ("f32", "hand bf16", "region", "transform")


def residual_bytes(loss: Callable, *args: Any) -> tuple[int, int]:
    """(bytes, of them float32) of the values ``jax.vjp(loss, *args)`` keeps for the backward
    pass, as a jitted step computes them: the leaves of the VJP function, abstractly evaluated
    (``jax.eval_shape``: nothing runs; the parameters themselves are leaves too, as in any
    step)."""
    leaves = jax.tree.leaves(jax.eval_shape(lambda *a: jax.vjp(loss, *a)[1], *args))
    sizes = [(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize, np.dtype(x.dtype)) for x in leaves]
    return sum(n for n, _ in sizes), sum(n for n, d in sizes if d == np.float32)


def measure_residuals(n_blocks: int, d: int, seq: int, batch: int) -> None:
    """(b') The values the train step's backward pass reads, per side: the same losses as (b)."""
    model = Transformer(n_blocks, d=d, heads=HEADS)
    hand = Transformer(n_blocks, d=d, heads=HEADS, dtype=BF16)
    x = jax.random.normal(jax.random.key(1), (batch, seq, d), jnp.float32)
    params = model.init(jax.random.key(0), x)

    def loss_of(side: str) -> Callable:
        net = hand if side == "hand bf16" else model
        forward = net.apply
        if side == "region":
            forward = in_region(forward)
        elif side == "transform":
            forward = jamp.autocast_transform(forward)
        return lambda p: jnp.mean(forward(p, x).astype(jnp.float32) ** 2)

    rows = []
    for side in RESIDUAL_SIDES:
        total, f32 = residual_bytes(loss_of(side), params)
        rows.append([side, f"{total / 2**20:.1f}", f"{f32 / 2**20:.1f}"])
    print(f"## (b') What the train step keeps for its backward pass\n\nThe transformer stack, "
          f"{n_blocks} blocks, d={d}, {HEADS} heads, seq {seq}, batch {batch}: the values "
          "`jax.vjp` of the loss keeps (the leaves of its VJP function, abstractly evaluated), "
          "parameters included.\n")
    print(markdown_table(["side", "MiB kept", "of them float32, MiB"], rows))
    print()


# --- (b) first call of a jitted train step -----------------------------------------------------

# The last two are the same numerics from the other side: a hand-written bf16 model whose
# softmax is float32 as the policy's is (``common.attention_softmax_f32``), and a region whose
# policy leaves the softmax bfloat16 as Flax's bf16 model does (``BF16_SOFTMAX``).
COMPILE_SIDES = ("hand bf16", "region", "transform", "f32", "hand bf16, f32 softmax",
                 "region, bf16 softmax")


def compile_case(n_blocks: int) -> tuple[dict[str, Callable[[], Callable]], tuple]:
    """Per side, a factory of fresh train-step functions, and the step's arguments."""
    model = Transformer(n_blocks, d=D, heads=HEADS)
    hand = Transformer(n_blocks, d=D, heads=HEADS, dtype=BF16)
    hand_f32_softmax = Transformer(n_blocks, d=D, heads=HEADS, dtype=BF16, softmax_f32=True)
    x = jax.random.normal(jax.random.key(1), (BATCH, SEQ, D), jnp.float32)
    params = model.init(jax.random.key(0), x)
    labels = jax.random.randint(jax.random.key(2), (BATCH, SEQ), 0, D)
    tx = optax.sgd(1e-2, momentum=0.9)
    opt_state = tx.init(params)

    def new_step(side: str) -> Callable:
        if side == "hand bf16":
            forward = lambda p, x: hand.apply(p, x)  # noqa: E731
        elif side == "region":
            forward = in_region(lambda p, x: model.apply(p, x))
        elif side == "transform":
            forward = jamp.autocast_transform(lambda p, x: model.apply(p, x))
        elif side == "hand bf16, f32 softmax":
            forward = lambda p, x: hand_f32_softmax.apply(p, x)  # noqa: E731
        elif side == "region, bf16 softmax":
            forward = in_region(lambda p, x: model.apply(p, x), BF16_SOFTMAX)
        else:
            forward = lambda p, x: model.apply(p, x)  # noqa: E731

        def loss(p, x, y):
            return cross_entropy(forward(p, x), y)

        def step(p, opt_state, x, y):
            value, grads = jax.value_and_grad(loss)(p, x, y)
            updates, opt_state = tx.update(grads, opt_state, p)
            return optax.apply_updates(p, updates), opt_state, value

        return step

    return {side: functools.partial(new_step, side) for side in COMPILE_SIDES}, \
        (params, opt_state, x, labels)


def first_call(step: Callable, args: tuple) -> dict[str, Any]:
    """Seconds to trace + lower, compile and run once a fresh ``jax.jit(step)``."""
    jitted = jax.jit(step)
    t0 = time.perf_counter()
    lowered = jitted.lower(*args)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    t3 = time.perf_counter()
    return {"lower": t1 - t0, "compile": t2 - t1, "run": t3 - t2, "total": t3 - t0,
            "compiled": compiled}


def measure_compile(blocks: Sequence[int], reps: int) -> list[dict[str, Any]]:
    cases = [compile_case(n) for n in blocks]
    for factories, args in cases[:1]:  # warm-up: JAX's and jamp's one-time costs
        for side in COMPILE_SIDES:
            first_call(factories[side](), args)
    samples = [{side: [] for side in COMPILE_SIDES} for _ in cases]
    last: list[dict[str, Any]] = [{} for _ in cases]
    for i in range(reps):
        for (factories, args), row, keep in zip(cases, samples, last):
            for side in rotated(COMPILE_SIDES, i):
                out: dict[str, Any] = {}
                _, gc_s = timed(functools.partial(
                    lambda out, step, args: out.update(first_call(step, args)),
                    out, factories[side](), args))
                keep[side] = out.pop("compiled")
                row[side].append({**out, "gc": gc_s})
    results = []
    for n, row, keep in zip(blocks, samples, last):
        total = {side: [s["total"] for s in row[side]] for side in COMPILE_SIDES}
        text = {side: keep[side].as_text() for side in COMPILE_SIDES}
        results.append({
            "blocks": n,
            "s": {side: {k: median([s[k] for s in row[side]]) for k in
                         ("lower", "compile", "run", "total", "gc")} for side in COMPILE_SIDES},
            "region/hand": ratios(total["region"], total["hand bf16"]),
            "transform/hand": ratios(total["transform"], total["hand bf16"]),
            "region/transform": ratios(total["region"], total["transform"]),
            "f32/hand": ratios(total["f32"], total["hand bf16"]),
            "same numerics": {  # (the region against a hand model of its own numerics)
                "f32 softmax": ratios(total["region"], total["hand bf16, f32 softmax"]),
                "bf16 softmax": ratios(total["region, bf16 softmax"], total["hand bf16"]),
            },
            "hand f32 softmax/hand": ratios(total["hand bf16, f32 softmax"], total["hand bf16"]),
            "region/hand lower": ratios([s["lower"] for s in row["region"]],
                                        [s["lower"] for s in row["hand bf16"]]),
            "region/hand compile": ratios([s["compile"] for s in row["region"]],
                                          [s["compile"] for s in row["hand bf16"]]),
            "hlo ops": {side: sum(hlo_op_counts(t).values()) for side, t in text.items()},
            "converts": {side: count_converts(t) for side, t in text.items()},
            "same hlo": normalized_hlo(text["region"]) == normalized_hlo(text["hand bf16"]),
            "same hlo, f32 softmax": normalized_hlo(text["region"])
            == normalized_hlo(text["hand bf16, f32 softmax"]),
        })
    return results


def report_compile(results: list[dict[str, Any]], reps: int) -> None:
    print("## (b) First call of a jitted train step (trace + lower, compile, run once)\n\n"
          f"Transformer stack d={D}, {HEADS} heads, seq {SEQ}, batch {BATCH}; "
          "`jax.value_and_grad` of a float32 cross-entropy + optax SGD (momentum 0.9), a fresh "
          f"step function and `jax.jit` every sample; {reps} repetitions after a warm-up of every "
          "side at the first size. Ratios: median of per-repetition ratios (min–max, IQR).\n")
    rows = []
    for r in results:
        s = r["s"]
        for side in COMPILE_SIDES:
            rows.append([f"{r['blocks']} blocks", side, f"{s[side]['lower'] * 1e3:.0f}",
                         f"{s[side]['compile'] * 1e3:.0f}", f"{s[side]['run'] * 1e3:.0f}",
                         f"{s[side]['total'] * 1e3:.0f}", f"{s[side]['gc'] * 1e3:.0f}",
                         r["hlo ops"][side], r["converts"][side]])
    print(markdown_table(["stack", "side", "trace + lower ms", "compile ms", "first run ms",
                          "total ms", "full-GC ms", "optimized HLO instructions",
                          "HLO converts"], rows))
    print()
    rows = [[f"{r['blocks']} blocks", fmt_spread(spread(r["region/hand"]), bold=True),
             f"{spread(r['region/hand lower'])['median']:.2f}x / "
             f"{spread(r['region/hand compile'])['median']:.2f}x",
             fmt_spread(spread(r["transform/hand"])), fmt_spread(spread(r["region/transform"])),
             fmt_spread(spread(r["f32/hand"])), "yes" if r["same hlo"] else "no"]
            for r in results]
    print(markdown_table(["stack", "region / hand bf16 (total)",
                          "region / hand: trace + lower / compile", "transform / hand bf16",
                          "region / transform", "f32 / hand bf16",
                          "region's optimized HLO = hand bf16's"], rows))
    print("\nThe same numerics on both sides: the region (float32 softmax, the policy's) against "
          "the hand-written bf16 model with a float32 softmax, and a region whose policy leaves "
          "the softmax bfloat16 against the hand-written bf16 model (Flax's bf16 softmax); and "
          "what the float32 softmax alone costs the hand-written model.\n")
    rows = [[f"{r['blocks']} blocks",
             fmt_spread(spread(r["same numerics"]["f32 softmax"]), bold=True),
             fmt_spread(spread(r["same numerics"]["bf16 softmax"]), bold=True),
             fmt_spread(spread(r["hand f32 softmax/hand"])),
             "yes" if r["same hlo, f32 softmax"] else "no"] for r in results]
    print(markdown_table(["stack", "region / hand bf16 with f32 softmax",
                          "region with bf16 softmax / hand bf16",
                          "hand bf16 with f32 softmax / hand bf16",
                          "region's optimized HLO = hand bf16 with f32 softmax's"], rows))
    print()
    for name, key in (("region/hand bf16", None), ("same numerics, f32 softmax", "f32 softmax"),
                      ("same numerics, bf16 softmax", "bf16 softmax")):
        per_size = [r["region/hand"] if key is None else r["same numerics"][key]
                    for r in results]
        worst = max(spread(x)["median"] for x in per_size)
        pooled = spread([x for row in per_size for x in row])
        print(f"- goal {name} <= {GOAL_COMPILE}x: "
              f"{'met' if worst <= GOAL_COMPILE else 'NOT met'} (worst size median "
              f"{worst:.2f}x; over sizes {fmt_spread(pooled)})")
    print()


# --- (a5) tracing a train step ------------------------------------------------------------------

GRAD_TRACE_SIDES = ("f32", "hand bf16", "region", "transform")


def measure_grad_trace(blocks: Sequence[int], reps: int) -> None:
    cases = [compile_case(n) for n in blocks]
    samples = [{side: [] for side in GRAD_TRACE_SIDES} for _ in cases]
    for i in range(reps + 1):  # (the first, a warm-up of every side and size, not kept)
        for (factories, args), row in zip(cases, samples):
            for side in rotated(GRAD_TRACE_SIDES, i):
                t, _ = timed(functools.partial(
                    lambda step, args: jax.make_jaxpr(step)(*args), factories[side](), args))
                if i:
                    row[side].append(t)
    print("## (a5) Tracing a train step: `make_jaxpr` of (b)'s step\n\n"
          f"The train step of (b) (transformer stack d={D}, {HEADS} heads, seq {SEQ}, batch "
          f"{BATCH}; `jax.value_and_grad` + optax SGD), a fresh step function every sample; {reps} "
          "repetitions after a warm-up, sides and sizes interleaved. 'transform': the forward "
          "is `autocast_transform(model.apply)`, called under `jax.grad`. Ratios: median of "
          "per-repetition ratios (min–max, IQR).\n")
    rows = []
    for n, row in zip(blocks, samples):
        ms = {side: median(ts) * 1e3 for side, ts in row.items()}
        rows.append([f"{n} blocks", *(f"{ms[side]:.1f}" for side in GRAD_TRACE_SIDES),
                     fmt_spread(spread(ratios(row["region"], row["hand bf16"])), bold=True),
                     fmt_spread(spread(ratios(row["transform"], row["hand bf16"])), bold=True),
                     fmt_spread(spread(ratios(row["transform"], row["f32"]))),
                     fmt_spread(spread(ratios(row["hand bf16"], row["f32"])))])
    print(markdown_table(["stack", *(f"{side} ms" for side in GRAD_TRACE_SIDES),
                          "region / hand bf16", "transform / hand bf16", "transform / f32",
                          "hand bf16 / f32"], rows))
    print()


# --- (c) eager steps of the digits CNN ---------------------------------------------------------

EAGER_SIDES = ("plain", "hand bf16", "region", "transform")
EAGER_MODES = ("forward", "train step")


def eager_case(mode: str) -> tuple[Callable[[str], Callable], tuple]:
    """A factory of fresh eager callables per side for ``mode``, and their arguments."""
    from examples.digits import CNN

    model = CNN()
    hand = CNN(dtype=BF16)  # the same model written by hand in bfloat16 (same parameters)
    x = jax.random.uniform(jax.random.key(0), (64, 8, 8, 1), jnp.float32)
    y = jax.random.randint(jax.random.key(1), (64,), 0, 10)
    variables = model.init(jax.random.key(2), x[:1], False)
    train = mode == "train step"
    tx = optax.sgd(1e-2)
    opt_state = tx.init(variables["params"])

    def new(side: str) -> Callable:
        net = hand if side == "hand bf16" else model

        def forward(v, x):
            if train:
                return net.apply(v, x, True, mutable=["batch_stats"])
            return net.apply(v, x, False)

        if side == "region":
            forward = in_region(forward)
        elif side == "transform":
            forward = jamp.autocast_transform(forward)
        if not train:
            return forward

        def loss(params, batch_stats, x, y):
            logits, updates = forward({"params": params, "batch_stats": batch_stats}, x)
            ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y)
            return ce.mean(), (updates["batch_stats"], logits)

        def step(variables, opt_state, x, y):
            (value, (batch_stats, logits)), grads = jax.value_and_grad(loss, has_aux=True)(
                variables["params"], variables["batch_stats"], x, y)
            updates, opt_state = tx.update(grads, opt_state, variables["params"])
            params = optax.apply_updates(variables["params"], updates)
            return {"params": params, "batch_stats": batch_stats}, opt_state, value, logits

        return step

    return new, ((variables, opt_state, x, y) if train else (variables, x))


@contextlib.contextmanager
def region_passes_through() -> Any:
    """An ablation, not a mode of jamp: the region stays the current trace, but every operation
    it is handed (a primitive, a ``jnp`` function's jit) is bound on its parent unchanged. What
    that still costs eagerly (JAX's Python ``jit`` path for every ``jnp`` call, the bind's
    redirection) is the floor of an eager region that decides anything at all."""
    from jamp import _compat as compat
    from jamp import region_trace

    cls = region_trace.RegionTrace
    saved = cls.process_primitive
    cls.process_primitive = lambda self, primitive, args, params: compat.bind_on(
        self.parent, primitive, args, params)
    try:
        yield
    finally:
        cls.process_primitive = saved


def measure_eager_floor(reps: int, warmup: int) -> None:
    """(c') The eager forward of (c): plain float32, hand bf16, the region, and the region with
    every operation passed through (``region_passes_through``), interleaved."""
    new, args = eager_case("forward")
    sides = ("plain", "hand bf16", "region", "region, passed through")
    fns = {side: new("region" if side == "region, passed through" else side) for side in sides}

    def call(side: str) -> float:
        if side != "region, passed through":
            return timed(functools.partial(call_once, fns[side], args))[0]
        with region_passes_through():
            return timed(functools.partial(call_once, fns[side], args))[0]

    for _ in range(warmup):
        for side in sides:
            call(side)
    t: dict[str, list[float]] = {side: [] for side in sides}
    for i in range(reps):
        for side in rotated(sides, i):
            t[side].append(call(side))
    print("## (c') The floor of an eager region\n\n"
          f"The forward of (c), {reps} interleaved calls per side after {warmup} warm-up calls. "
          "'passed through': the region is the current trace but binds every operation on its "
          "parent unchanged, in float32 (an ablation: what being a trace costs eagerly, before "
          "any decision).\n")
    print(markdown_table(
        ["side", "ms", "/ plain float32"],
        [[side, f"{median(t[side]) * 1e3:.2f}",
          fmt_spread(spread(ratios(t[side], t["plain"])), side != "plain")] for side in sides]))
    print()


# One eager operation each, on float32 operands (64x64), and the dtype the policy runs it in
# ("hand": the same operation on operands cast to that dtype beforehand, without jamp).
EAGER_OPERATIONS: dict[str, tuple[Callable[[Any, Any], Any], Any]] = {
    "jnp.multiply (a jnp function: an inline jit)": (lambda x, w: jnp.multiply(x, w), F32),
    "lax.mul (a primitive the policy leaves float32)": (lambda x, w: jax.lax.mul(x, w), F32),
    "lax.dot (a primitive the policy casts to bfloat16)": (lambda x, w: jax.lax.dot(x, w), BF16),
}
OPERATION_CALLS = 200  # calls per sample (one sample: ~3-40 ms)


def measure_eager_operations(reps: int) -> None:
    """(c') per operation: one ``jnp`` call and two primitives called eagerly
    ``OPERATION_CALLS`` times in a row: plain float32; by hand in the dtype the policy gives it
    (operands cast beforehand); in a region passing every operation through; in a region;
    interleaved. Where an eager region's time goes per call: the Python ``jit`` path JAX takes
    for a ``jnp`` call under any trace, and the policy's decision and replay (the region's time
    less the pass-through's, less what the operation costs in its new dtype by hand; for a
    ``jnp`` call that difference can fall below zero: the region runs its rewrite of the call
    through ``jax.jit``'s C++ dispatch, where the pass-through binds the call on JAX's Python
    path)."""
    x = jax.random.normal(jax.random.key(0), (64, 64), F32)
    w = jax.random.normal(jax.random.key(1), (64, 64), F32)
    sides = ("plain", "hand", "region, passed through", "region")

    def sample(operation: Callable, dtype: Any, side: str) -> float:
        a, b = (x.astype(dtype), w.astype(dtype)) if side == "hand" else (x, w)

        def run() -> None:
            for _ in range(OPERATION_CALLS):  # (each waited for: no call overlaps the next)
                jax.block_until_ready(operation(a, b))

        if side in ("plain", "hand"):
            return timed(run)[0] / OPERATION_CALLS
        through = region_passes_through() if side != "region" else contextlib.nullcontext()
        with through, jamp.autocast():
            return timed(run)[0] / OPERATION_CALLS

    rows = []
    for name, (operation, dtype) in EAGER_OPERATIONS.items():
        for side in sides:
            sample(operation, dtype, side)  # (warm-up: JAX's executables, the region's decisions)
        t: dict[str, list[float]] = {side: [] for side in sides}
        for i in range(reps):
            for side in rotated(sides, i):
                t[side].append(sample(operation, dtype, side))
        us = {side: median(t[side]) * 1e6 for side in sides}
        trace = us["region, passed through"] - us["plain"]
        policy = us["region"] - us["region, passed through"] - (us["hand"] - us["plain"])
        rows.append([name, *(f"{us[side]:.1f}" for side in sides), f"{trace:+.1f}",
                     f"{policy:+.1f}"])
    print(f"Per operation: {OPERATION_CALLS} eager calls in a row per sample, each waited for, "
          f"{reps} interleaved samples per side, µs per call (medians); 'hand': the operation "
          "on operands cast beforehand to the dtype the policy runs it in.\n")
    print(markdown_table(
        ["operation", "plain µs", "hand µs", "passed through µs", "region µs",
         "being a trace (passed through - plain)",
         "the policy (region - passed through - (hand - plain))"],
        rows))
    print()


def call_once(fn: Callable, args: tuple) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def eager_cold(side: str, mode: str) -> dict[str, float]:
    """In a fresh process: the first call, then one more (what the first one left cached)."""
    new, args = eager_case(mode)
    fn = new(side)
    first = call_once(fn, args)
    return {"first": first, "second": call_once(fn, args)}


def measure_eager(reps: int, warmup: int, fresh_reps: int, cold_reps: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for mode in EAGER_MODES:
        new, args = eager_case(mode)
        fns = {side: new(side) for side in EAGER_SIDES}
        for _ in range(warmup):
            for side in EAGER_SIDES:
                call_once(fns[side], args)
        steady = {side: [] for side in EAGER_SIDES}
        for i in range(reps):
            for side in rotated(EAGER_SIDES, i):
                steady[side].append(timed(functools.partial(call_once, fns[side], args))[0])
        fresh = {side: [] for side in EAGER_SIDES}
        for i in range(fresh_reps):
            for side in rotated(EAGER_SIDES, i):
                fresh[side].append(timed(functools.partial(call_once, new(side), args))[0])
        dtype = {}
        for side in EAGER_SIDES:
            out = fns[side](*args)
            dtype[side] = str((out if mode == "forward" else out[-1]).dtype)  # the logits
        results[mode] = {"steady": steady, "fresh": fresh, "cold": {s: [] for s in EAGER_SIDES},
                         "second": {s: [] for s in EAGER_SIDES}, "dtype": dtype}
    for i in range(cold_reps):  # fresh processes, sides and modes interleaved
        for mode in EAGER_MODES:
            for side in rotated(EAGER_SIDES, i):
                out = subprocess.run([sys.executable, os.path.abspath(__file__), "--eager-cold",
                                      side, mode], check=True, capture_output=True, text=True)
                r = json.loads(out.stdout.strip().splitlines()[-1])
                results[mode]["cold"][side].append(r["first"])
                results[mode]["second"][side].append(r["second"])
    return results


def report_eager(results: dict[str, Any], reps: int, warmup: int, fresh_reps: int,
                 cold_reps: int) -> None:
    print("## (c) Eager calls of the digits CNN (`examples/digits.py`), no `jax.jit`\n\n"
          f"Batch 64 of 8x8x1. Steady state: median of {reps} interleaved calls after {warmup} "
          f"warm-up calls per side; new function: first call of a new function object in this "
          f"(warm) process, {fresh_reps} samples; fresh process: first call in a new Python "
          f"process (cold JAX caches), {cold_reps} samples per side, and the second call there. "
          "Ratios: median of per-repetition ratios (min–max, IQR). 'logits' is the dtype the "
          "forward returned.\n")
    rows = []
    for mode, r in results.items():
        for side in EAGER_SIDES:
            cold = r["cold"][side]
            rows.append([mode, side, r["dtype"][side], f"{median(r['steady'][side]) * 1e3:.1f}",
                         f"{median(r['fresh'][side]) * 1e3:.1f}",
                         f"{median(cold):.2f}" if cold else "-",
                         f"{median(r['second'][side]) * 1e3:.1f}" if cold else "-"])
    print(markdown_table(["mode", "side", "logits", "steady ms", "new function, first call ms",
                          "fresh process, first call s", "fresh process, second call ms"], rows))
    print()
    rows = []
    for mode, r in results.items():
        for what, key in (("steady state", "steady"), ("new function", "fresh"),
                          ("fresh process", "cold")):
            if not r[key]["region"]:
                continue
            rows.append([mode, what,
                         fmt_spread(spread(ratios(r[key]["region"], r[key]["hand bf16"])), True),
                         fmt_spread(spread(ratios(r[key]["region"], r[key]["plain"]))),
                         fmt_spread(spread(ratios(r[key]["hand bf16"], r[key]["plain"]))),
                         fmt_spread(spread(ratios(r[key]["region"], r[key]["transform"]))),
                         fmt_spread(spread(ratios(r[key]["transform"], r[key]["plain"])))])
    print(markdown_table(["mode", "call", "region / hand bf16", "region / plain",
                          "hand bf16 / plain", "region / transform", "transform / plain"], rows))
    print("\nbfloat16 is emulated on this CPU: 'region / hand bf16' (the same bf16 ops, dispatched "
          "by hand) is jamp's eager overhead; 'region / plain' adds the cost of the bf16 ops "
          "themselves.")
    print()


# --- entry point ---------------------------------------------------------------------------------

PARTS = ("trace", "compile", "residuals", "eager", "floor", "amortized", "attribution",
         "eager-floor", "alive", "grad-trace")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: small stacks, few repetitions")
    parser.add_argument("--parts", nargs="+", choices=PARTS,
                        default=[p for p in PARTS
                                 if p not in ("amortized", "attribution", "eager-floor",
                                              "alive", "grad-trace")])
    parser.add_argument("--blocks", type=int, nargs="+", default=None,
                        help="(a) stack depths (default 12 24 48; --quick: 4 8)")
    parser.add_argument("--reps", type=int, default=None, help="(a) repetitions (default 7)")
    parser.add_argument("--processes", type=int, default=1,
                        help="(a) run in this many fresh processes, one after another, and pool "
                             "them (default 1: this process)")
    parser.add_argument("--trace-samples-json", action="store_true",
                        help=argparse.SUPPRESS)  # subprocess mode of (a) with --processes
    parser.add_argument("--caller-depths", type=int, nargs="+", default=[0],
                        help="(a) sample every side at these Python stack depths "
                             "(see rewrite_overhead.py)")
    parser.add_argument("--amortized-calls", type=int, default=6,
                        help="(a'') calls in a row per side and round (default 6)")
    parser.add_argument("--amortized-rounds", type=int, default=6,
                        help="(a'') rounds per side (default 6)")
    parser.add_argument("--compile-blocks", type=int, nargs="+", default=None,
                        help="(b) stack depths (default 4 12; --quick: 2)")
    parser.add_argument("--grad-blocks", type=int, nargs="+", default=None,
                        help="(a5) stack depths (default 4 12 24; --quick: 2)")
    parser.add_argument("--compile-reps", type=int, default=None,
                        help="(b) repetitions (default 5)")
    parser.add_argument("--eager-reps", type=int, default=None,
                        help="(c) steady-state calls per side (default 30)")
    parser.add_argument("--fresh-reps", type=int, default=None,
                        help="(c) first calls of new function objects per side (default 5)")
    parser.add_argument("--cold-reps", type=int, default=None,
                        help="(c) fresh processes per side and mode (default 3; --quick: 1)")
    parser.add_argument("--profile", action="store_true",
                        help="cProfile the region trace of the largest stack of (a)")
    parser.add_argument("--top", type=int, default=20, help="rows of the profile tables")
    parser.add_argument("--eager-cold", nargs=2, metavar=("SIDE", "MODE"),
                        help=argparse.SUPPRESS)  # subprocess mode of (c)
    args = parser.parse_args()
    if args.eager_cold:
        print(json.dumps(eager_cold(*args.eager_cold)))
        return
    if args.trace_samples_json:
        results = measure_trace(args.blocks, args.reps, 1, tuple(args.caller_depths))
        print(json.dumps(results))
        return
    q = args.quick
    blocks = args.blocks or ([4, 8] if q else [12, 24, 48])
    reps = args.reps or (3 if q else 7)
    compile_blocks = args.compile_blocks or ([2] if q else [4, 12])
    compile_reps = args.compile_reps or (2 if q else 5)
    eager_reps = args.eager_reps or (5 if q else 30)
    eager_warmup = 2 if q else 5
    fresh_reps = args.fresh_reps or (2 if q else 5)
    cold_reps = args.cold_reps if args.cold_reps is not None else (1 if q else 3)

    print(f"# jamp region form: overhead (issue 21)\n\n{environment()}\n")
    started = time.perf_counter()
    if "trace" in args.parts:
        depths = tuple(args.caller_depths)
        if args.processes > 1:
            results = measure_trace_in_processes(blocks, reps, depths, args.processes)
        else:
            results = measure_trace(blocks, reps, 1, depths)
        report_trace(results, reps, depths, args.processes)
    if "compile" in args.parts:
        report_compile(measure_compile(compile_blocks, compile_reps), compile_reps)
    if "residuals" in args.parts:
        measure_residuals(4, 256, 256, 8) if not q else measure_residuals(2, 64, 16, 2)
    if "floor" in args.parts:
        measure_floor(blocks, reps)
    if "amortized" in args.parts:
        measure_amortized(blocks, args.amortized_calls, args.amortized_rounds)
    if "attribution" in args.parts:
        measure_attribution(max(blocks), reps, args.top)
    if "eager" in args.parts:
        report_eager(measure_eager(eager_reps, eager_warmup, fresh_reps, cold_reps),
                     eager_reps, eager_warmup, fresh_reps, cold_reps)
    if "eager-floor" in args.parts:
        measure_eager_floor(eager_reps, eager_warmup)
        measure_eager_operations(eager_reps)
    if "grad-trace" in args.parts:
        measure_grad_trace(args.grad_blocks or ([2] if q else [4, 12, 24]), reps)
    if "alive" in args.parts:
        measure_alive(blocks)
    if args.profile:
        profile_trace(max(blocks), args.top)
    print(f"Load average at the end: {load()}; {time.perf_counter() - started:.0f} s in all.")


if __name__ == "__main__":
    main()
