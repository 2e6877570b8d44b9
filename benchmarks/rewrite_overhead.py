"""Rewrite overhead of ``jamp.autocast_transform`` at trace time.

What is measured
  ``jax.make_jaxpr(jamp.autocast_transform(f))(*args)`` against ``jax.make_jaxpr(f)(*args)``, i.e.
  the extra cost a user pays every time JAX traces an autocast function (under ``jax.jit`` that is
  once per new input shape). The autocast side traces ``f`` to a jaxpr and then re-binds every
  equation with casts inserted, so its cost is "trace f" + "rewrite"; the rewrite alone is also
  timed (``jamp.autocast_jaxpr`` on a freshly traced jaxpr, the trace untimed).

Why fresh function objects
  JAX caches traces per function object and jamp caches rewrites per transformed function, so
  every repetition builds a new lambda on both sides (and a new ``autocast_transform`` wrapper):
  neither cache can answer and each sample is a full trace.

Workloads
  * A Flax linen transformer stack (pre-LN blocks: LayerNorm, ``nn.MultiHeadDotProductAttention``,
    MLP with gelu) of 12 / 24 / 48 blocks at small widths: tracing through Flax is expensive, which
    is the realistic case. Goal: autocast/plain <= 1.5x, time linear in the number of equations.
  * A pure-jnp MLP (``tanh(x @ w + b)`` per layer): tracing it costs almost nothing, so its ratio
    shows the interpreter's own cost per equation.
  * Higher-order primitives (``--workloads lstm remat``): the transformer stack with every block
    in ``nn.remat`` (``jax.checkpoint``; jamp rewrites the ``checkpoint``/``remat`` body), and a
    stack of ``nn.RNN(nn.LSTMCell)`` layers (a Flax lifted ``nn.scan`` per layer; jamp rebuilds
    every ``scan`` with ``lax.scan`` around its rewritten body).
  * ``--grad`` adds, for each Flax workload, the trace of a training step:
    ``jax.make_jaxpr(jax.grad(jamp.autocast_transform(loss)))`` against
    ``jax.make_jaxpr(jax.grad(loss))`` with ``loss = cross_entropy(model.apply(p, x), labels)``;
    there "rewrite only" is the rewrite of the forward ``loss`` jaxpr (what ``grad`` then
    differentiates), per equation of that jaxpr.

Samples of the two sides are interleaved and preceded by a garbage collection; the table shows
medians, and the ratio is the median of per-repetition ratios. Time spent in full (generation-2)
garbage collections during a sample is recorded separately: the autocast side allocates about
twice as much (the traced program and the rewritten one) and on large programs crosses the
collector's threshold for one full collection, whose cost depends on the whole Python heap rather
than on jamp; the last column shows the ratio with that time taken out.

Caller stack depth (``--caller-depths``)
  On CPython 3.11/3.12 the same trace takes up to ~1.6x longer depending only on how deep in the
  Python stack it starts: a call that crosses the boundary of the interpreter's frame-stack
  chunks allocates and frees a chunk every time, and Flax's hot loops land on such a boundary
  or not by chance. ``autocast_transform`` adds frames, so at one fixed caller depth the ratio
  measures where both sides fall relative to those boundaries as much as jamp (an LSTM at 32
  layers: 0.80x to 1.64x over caller depths 0-64). ``--caller-depths 0 8 ... 64`` samples
  every side at each depth and adds the ratio of each side's best depth, the range of per-depth
  ratios, and the ratio of each side's fastest sample over all depths and repetitions with the
  time of full garbage collections taken out, which the verdict then uses. That last one is
  ``timeit``'s statistic (timeit turns the collector off and recommends the minimum: slower
  samples measure interference, not the code); the full collections are reported next to it,
  since their cost depends on the size of the whole Python heap rather than on jamp.

``--interleave-rows`` samples every row in every repetition instead of row after row, so that
rows (e.g. the remat stack against the plain one) are compared under the same load.

``--profile`` adds a cProfile of the rewrite of the largest stack and lists the jamp functions
with the largest cumulative time.

Usage::

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/rewrite_overhead.py [--quick] [--profile]
    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/rewrite_overhead.py --workloads lstm remat --grad
    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/rewrite_overhead.py --workloads lstm \
        --caller-depths 0 8 16 24 32 40 48 56 64
"""
from __future__ import annotations

import argparse
import cProfile
import functools
import gc
import os
import pstats
import sys
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jamp  # noqa: E402
from common import (LSTM, Transformer, count_eqns, cross_entropy, environment,  # noqa: E402
                    jnp_mlp, jnp_mlp_params, loglog_slope, markdown_table, median, paired_ratio,
                    timed)

GOAL_RATIO = 1.5


def measure(make_fn: Callable[[], Callable], args: Sequence[Any], reps: int,
            warmup: int, grad: bool = False, depths: Sequence[int] = (0,)) -> dict[str, Any]:
    """Median times of plain tracing, autocast tracing and the rewrite alone, plus eqn counts.

    ``make_fn()`` must return a new function object on every call. With ``grad``, the traced
    function is ``jax.grad(f)`` (``jax.grad(autocast_transform(f))``), and the rewrite alone is
    that of ``f``'s jaxpr.
    """
    return measure_rows([(make_fn, args, grad)], reps, warmup, depths)[0]


def at_depth(depth: int, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` called ``depth`` Python frames deeper than here (see ``--caller-depths``)."""
    return fn(*args) if depth == 0 else at_depth(depth - 1, fn, *args)


def measure_rows(rows: Sequence[tuple[Callable[[], Callable], Sequence[Any], bool]], reps: int,
                 warmup: int, depths: Sequence[int] = (0,)) -> list[dict[str, Any]]:
    """``measure`` for several ``(make_fn, args, grad)`` rows, interleaved: every repetition
    samples every row, so that load drifting on a shared machine affects all rows alike. With
    several caller ``depths`` every repetition samples each row at each depth."""
    all_sides = []
    for make_fn, args, grad in rows:
        outer = jax.grad if grad else (lambda f: f)
        forward = lambda make_fn=make_fn, args=args: jax.make_jaxpr(make_fn())(*args)
        plain = lambda make_fn=make_fn, args=args, outer=outer: \
            jax.make_jaxpr(outer(make_fn()))(*args)
        amp = lambda make_fn=make_fn, args=args, outer=outer: \
            jax.make_jaxpr(outer(jamp.autocast_transform(make_fn())))(*args)
        # The rewrite alone, of a freshly traced jaxpr (the trace is not timed). Rewriting one
        # jaxpr object again and again is up to ~20% faster on large programs (warm objects),
        # which would understate the cost inside autocast_transform.
        all_sides.append((("plain", plain, None), ("amp", amp, None),
                          ("rewrite", jamp.autocast_jaxpr, forward)))
    samples = [{name: [] for name, _, _ in sides} for sides in all_sides]
    full_gc = [{name: [] for name, _, _ in sides} for sides in all_sides]
    # (side, depth) -> sample times, and the same without full-GC time
    by_depth = [{(name, d): [] for name, _, _ in sides for d in depths} for sides in all_sides]
    by_depth_no_gc = [{key: [] for key in row} for row in by_depth]
    for i in range(warmup + reps):
        for depth in depths:
            for sides, row_samples, row_gc, row_depth, row_depth_no_gc in zip(
                    all_sides, samples, full_gc, by_depth, by_depth_no_gc):
                for name, fn, setup in sides:
                    t, gc_seconds = timed(functools.partial(at_depth, depth, fn), setup)
                    if i >= warmup:
                        row_samples[name].append(t)
                        row_gc[name].append(gc_seconds)
                        row_depth[name, depth].append(t)
                        row_depth_no_gc[name, depth].append(t - gc_seconds)
    results = []
    for sides, row_samples, row_gc, row_depth, row_depth_no_gc in zip(
            all_sides, samples, full_gc, by_depth, by_depth_no_gc):
        medians = {key: median(ts) for key, ts in row_depth.items()}
        medians_no_gc = {key: median(ts) for key, ts in row_depth_no_gc.items()}
        depth_ratios = [medians["amp", d] / medians["plain", d] for d in depths]
        (_, plain, _), (_, amp, _), (_, _, forward) = sides
        no_gc = {name: [t - g for t, g in zip(row_samples[name], row_gc[name])]
                 for name in ("plain", "amp")}
        plain_counts, amp_counts = count_eqns(plain()), count_eqns(amp())
        results.append({
            "rewrite_eqns": sum(count_eqns(forward()).values()),
            "ratio": paired_ratio(row_samples["amp"], row_samples["plain"]),
            "ratio_no_gc": paired_ratio(no_gc["amp"], no_gc["plain"]),
            "plain": median(row_samples["plain"]), "amp": median(row_samples["amp"]),
            "rewrite": median(row_samples["rewrite"]),
            "gc_plain": median(row_gc["plain"]), "gc_amp": median(row_gc["amp"]),
            "eqns": sum(plain_counts.values()), "amp_eqns": sum(amp_counts.values()),
            "converts": amp_counts["convert_element_type"] - plain_counts["convert_element_type"],
            # Best over caller depths: each side at the depth where CPython's frame stack does
            # not get in its way (see the module docstring), and the spread of per-depth ratios.
            "ratio_best_depth": min(medians["amp", d] for d in depths)
            / min(medians["plain", d] for d in depths),
            "ratio_best_depth_no_gc": min(medians_no_gc["amp", d] for d in depths)
            / min(medians_no_gc["plain", d] for d in depths),
            # timeit's statistic: each side's fastest sample over all depths and repetitions,
            # full-GC time taken out (timeit turns the collector off while it times).
            "ratio_fastest": min(no_gc["amp"]) / min(no_gc["plain"]),
            "depth_ratios": (min(depth_ratios), max(depth_ratios)),
        })
    return results


def flax_case(model: Any, x: jax.Array, grad: bool = False):
    """``(make_fn, args)`` for ``model.apply``, or with ``grad`` for a cross-entropy loss of it."""
    params = model.init(jax.random.key(0), x)
    if not grad:
        return (lambda: (lambda p, x: model.apply(p, x))), (params, x)
    out = jax.eval_shape(model.apply, params, x)
    labels = jax.random.randint(jax.random.key(2), out.shape[:-1], 0, out.shape[-1])
    return (lambda: (lambda p, x, y: cross_entropy(model.apply(p, x), y))), (params, x, labels)


def stack_case(n_blocks: int, d: int, heads: int, seq: int, batch: int, remat: bool = False,
               grad: bool = False):
    model = Transformer(n_blocks, d=d, heads=heads, remat=remat)
    x = jax.random.normal(jax.random.key(1), (batch, seq, d), jnp.float32)
    return flax_case(model, x, grad)


def lstm_case(layers: int, d: int, seq: int, batch: int, grad: bool = False):
    x = jax.random.normal(jax.random.key(1), (batch, seq, d), jnp.float32)
    return flax_case(LSTM(d, layers), x, grad)


def mlp_case(layers: int, width: int, batch: int):
    params = jnp_mlp_params(layers, width)
    x = jax.random.normal(jax.random.key(1), (batch, width), jnp.float32)
    return (lambda: (lambda p, x: jnp_mlp(p, x))), (params, x)


def row(name: str, r: dict[str, Any], depths: bool = False) -> list[Any]:
    cells = [name, r["eqns"], f"{r['amp_eqns']} (+{r['converts']} casts)",
             f"{r['plain'] * 1e3:.1f}", f"{r['amp'] * 1e3:.1f}", f"**{r['ratio']:.2f}x**",
             f"{r['rewrite'] * 1e3:.1f}",
             f"{r['plain'] / r['eqns'] * 1e6:.0f}", f"{r['amp'] / r['eqns'] * 1e6:.0f}",
             f"{(r['amp'] - r['plain']) / r['eqns'] * 1e6:.0f}",
             f"{r['rewrite'] / r['rewrite_eqns'] * 1e6:.0f}",
             f"{r['gc_plain'] * 1e3:.0f} / {r['gc_amp'] * 1e3:.0f}", f"{r['ratio_no_gc']:.2f}x"]
    if depths:
        low, high = r["depth_ratios"]
        cells += [f"{r['ratio_best_depth']:.2f}x", f"{r['ratio_best_depth_no_gc']:.2f}x",
                  f"{low:.2f}–{high:.2f}x", f"**{r['ratio_fastest']:.2f}x**"]
    return cells


HEADER = ["workload", "eqns (plain)", "eqns (autocast)", "plain ms", "autocast ms", "ratio",
          "rewrite only ms", "plain µs/eqn", "autocast µs/eqn", "overhead µs/eqn",
          "rewrite µs/eqn", "full-GC ms plain / autocast", "ratio without full GC"]
DEPTH_HEADER = ["ratio, best over caller depths", "the same without full GC",
                "ratio per caller depth", "ratio of the fastest samples, without full GC"]


def profile_rewrite(make_fn: Callable[[], Callable], args: Sequence[Any], top: int) -> str:
    """cProfile of ``autocast_jaxpr`` (the rewrite alone): jamp functions by cumulative time."""
    jamp.autocast_jaxpr(jax.make_jaxpr(make_fn())(*args))  # warm up
    closed = jax.make_jaxpr(make_fn())(*args)  # a fresh jaxpr, like autocast_transform's
    gc.collect()
    profiler = cProfile.Profile()
    profiler.enable()
    jamp.autocast_jaxpr(closed)
    profiler.disable()
    stats = pstats.Stats(profiler)
    total = max(v[3] for v in stats.stats.values())  # the outermost cumulative time
    jamp_dir = os.path.dirname(jamp.__file__)
    own = sum(v[2] for k, v in stats.stats.items() if k[0].startswith(jamp_dir))
    rows = sorted(((v[3], v[2], v[1], f"{os.path.relpath(k[0], os.path.dirname(jamp_dir))}:"
                    f"{k[1]}({k[2]})") for k, v in stats.stats.items()
                   if k[0].startswith(jamp_dir)), reverse=True)[:top]
    table = markdown_table(
        ["jamp function", "calls", "cumulative ms", "% of rewrite", "self ms"],
        [[f"`{name}`", calls, f"{cum * 1e3:.1f}", f"{cum / total * 100:.0f}%", f"{tot * 1e3:.1f}"]
         for cum, tot, calls, name in rows])
    return (f"{table}\n\nTotal under the profiler: {total * 1e3:.1f} ms; self time inside jamp's "
            f"own code: {own * 1e3:.1f} ms ({own / total * 100:.0f}%); the rest is JAX re-binding "
            "the primitives (tracing) and the profiler itself.")


WORKLOADS = ("transformer", "mlp", "remat", "lstm")
FLAX_WORKLOADS = ("transformer", "remat", "lstm")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions, smaller stacks")
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=["transformer", "mlp"],
                        help="transformer: Flax pre-LN stack; mlp: pure-jnp MLP; remat: the stack "
                             "with nn.remat blocks; lstm: nn.RNN(nn.LSTMCell) layers "
                             "(default: transformer mlp)")
    parser.add_argument("--grad", action="store_true",
                        help="also trace jax.grad of a cross-entropy loss (Flax workloads)")
    parser.add_argument("--blocks", type=int, nargs="+", default=None,
                        help="transformer depths (default 12 24 48; --quick: 12 24)")
    parser.add_argument("--lstm-layers", type=int, nargs="+", default=None,
                        help="LSTM depths (default 2 8 32; --quick: 2 8)")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions (default 7)")
    parser.add_argument("--d", type=int, default=64, help="model width (LSTM: features, hidden)")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--mlp-layers", type=int, nargs="+", default=[50, 200])
    parser.add_argument("--interleave-rows", action="store_true",
                        help="sample all rows in every repetition (instead of row after row), "
                             "so that rows are compared under the same load")
    parser.add_argument("--caller-depths", type=int, nargs="+", default=[0],
                        help="sample every side at these Python stack depths and add the ratio "
                             "of each side's best depth and of its fastest sample, which the "
                             "verdict then uses (e.g. 0 4 8 ... 60)")
    parser.add_argument("--profile", action="store_true",
                        help="cProfile the rewrite of the largest model of the first Flax workload")
    parser.add_argument("--top", type=int, default=15, help="rows of the profile table")
    args = parser.parse_args()
    blocks = args.blocks or ([12, 24] if args.quick else [12, 24, 48])
    lstm_layers = args.lstm_layers or ([2, 8] if args.quick else [2, 8, 32])
    reps = args.reps or (3 if args.quick else 7)
    warmup = 1
    depths = tuple(args.caller_depths)

    def sizes(workload: str) -> list[tuple[str, Callable[..., Any]]]:
        """``(label, case(grad=...))`` per model size of one workload."""
        dims = dict(d=args.d, seq=args.seq, batch=args.batch)
        if workload in ("transformer", "remat"):
            remat = workload == "remat"
            name = "Flax remat transformer" if remat else "Flax transformer"
            return [(f"{name}, {n} blocks", functools.partial(
                stack_case, n, heads=args.heads, remat=remat, **dims)) for n in blocks]
        if workload == "lstm":
            return [(f"Flax LSTM (nn.RNN), {n} layer{'s' * (n > 1)}",
                     functools.partial(lstm_case, n, **dims)) for n in lstm_layers]
        return [(f"jnp MLP, {n} layers", lambda n=n, grad=False: mlp_case(n, args.d, 16))
                for n in args.mlp_layers]

    print(f"# jamp rewrite overhead\n\n{environment()}\n")
    interleaved = "; all rows sampled in every repetition" if args.interleave_rows else ""
    if len(depths) > 1:
        print(f"Every side sampled at caller stack depths {list(depths)} in every repetition; "
              "the verdict uses the ratio of each side's fastest sample over all depths and "
              "repetitions, full-GC time taken out (timeit's statistic).\n")
    print(f"Transformer: d={args.d}, heads={args.heads}, seq={args.seq}, batch={args.batch}; "
          f"median of {reps} interleaved repetitions after {warmup} warm-up, fresh function "
          f"objects on both sides{interleaved}. "
          f"jnp MLP: width {args.d}, batch 16. LSTM: {args.d} features "
          f"and hidden units, seq={args.seq}, batch={args.batch}.\n")
    plan = [(workload, grad, label, case) for workload in args.workloads
            for grad in ((False, True) if args.grad and workload in FLAX_WORKLOADS else (False,))
            for label, case in sizes(workload)]
    if args.interleave_rows:
        measured = measure_rows([(*case(grad=grad), grad) for _, grad, _, case in plan],
                                reps, warmup, depths)
    else:
        measured = [measure(*case(grad=grad), reps, warmup, grad=grad, depths=depths)
                    for _, grad, _, case in plan]
    rows, families = [], {}  # families: (workload, grad) -> results over model sizes
    for (workload, grad, label, _), r in zip(plan, measured):
        rows.append(row(label + (", grad" if grad else ""), r, depths=len(depths) > 1))
        families.setdefault((workload, grad), []).append(r)
    families = [(workload, grad, results) for (workload, grad), results in families.items()]
    print(markdown_table(HEADER + (DEPTH_HEADER if len(depths) > 1 else []), rows))

    print()
    for workload, grad, results in families:
        if len(results) < 2:
            continue
        eqns = [r["eqns"] for r in results]
        slopes = []
        for label, key in (("plain trace", "plain"), ("autocast trace", "amp"),
                           ("rewrite-only", "rewrite")):
            slope = loglog_slope(eqns, [r[key] for r in results])
            if slope is not None:
                slopes.append(f"{label} k={slope:.2f}")
        print(f"- {workload}{' (grad)' if grad else ''}: time ~ eqns^k over the sizes "
              f"(1.00 = linear): {', '.join(slopes)}")
    for grad in (False, True):
        key = "ratio_fastest" if len(depths) > 1 else "ratio"
        ratios = [r[key] for workload, g, results in families if g == grad
                  and workload in FLAX_WORKLOADS for r in results]
        if ratios:
            what = "jax.grad of the Flax workloads (no goal set)" if grad else \
                "the Flax workloads"
            verdict = "" if grad else \
                f"{'met' if max(ratios) <= GOAL_RATIO else 'NOT met'} "
            print(f"- {'goal ' if not grad else ''}autocast/plain"
                  f"{f' <= {GOAL_RATIO}x' if not grad else ''} on {what}: {verdict}"
                  f"(worst {max(ratios):.2f}x)")

    if args.profile:
        workload = next((w for w in args.workloads if w in FLAX_WORKLOADS), "transformer")
        label, case = sizes(workload)[-1]
        print(f"\n## cProfile of the rewrite (`autocast_jaxpr`), {label}\n")
        print(profile_rewrite(*case(), args.top))


if __name__ == "__main__":
    main()
