"""How much the caller's Python stack depth alone changes the cost of the same work.

CPython 3.11+ keeps frames in a per-thread stack of memory chunks. A call whose frame does not fit
in the current chunk allocates a new one, and the return frees it again, so code whose hot loop
sits right at a chunk boundary pays an allocation per call. Which code lands on a boundary depends
only on how deep the caller already is. This script shows it twice:

1. pure Python: one tiny function called 200,000 times from caller depths 0..396; the depths at
   which it is more than 1.5x slower than at its best depth are listed;
2. ``jax.make_jaxpr`` of a Flax LSTM (the ``rewrite_overhead.py`` workload) from caller depths
   0..64: the same trace, timed at each depth.

That is why ``rewrite_overhead.py --caller-depths`` samples both sides at several depths.

Usage::

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/stack_depth.py [--layers 32] [--reps 5]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import environment, median, timed  # noqa: E402
from rewrite_overhead import at_depth, lstm_case  # noqa: E402


def leaf(a: int, b: int, c: int, d: int, e: int, f: int, g: int, h: int) -> int:
    return a


def tight_loop() -> float:
    start = time.perf_counter()
    for _ in range(200_000):
        leaf(1, 2, 3, 4, 5, 6, 7, 8)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32, help="LSTM layers")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    print(f"# Caller stack depth\n\n{environment()}\n")

    loop = {depth: min(at_depth(depth, tight_loop) for _ in range(3))
            for depth in range(0, 400, 4)}
    best = min(loop.values())
    slow = {d: t / best for d, t in loop.items() if t / best > 1.5}
    print(f"1. Pure Python, 200,000 calls of a small function: best {best * 1e3:.1f} ms; depths "
          "more than 1.5x slower: " +
          (", ".join(f"{d} ({r:.1f}x)" for d, r in slow.items()) or "none") + "\n")

    import jax
    make_fn, fn_args = lstm_case(args.layers, d=64, seq=16, batch=2)
    jax.make_jaxpr(make_fn())(*fn_args)  # warm-up
    depths = list(range(0, 65, 8))

    def trace() -> None:
        jax.make_jaxpr(make_fn())(*fn_args)  # a fresh function: no trace cache

    times = {d: median([timed(lambda d=d: at_depth(d, trace))[0] for _ in range(args.reps)])
             for d in depths}
    fastest = min(times.values())
    print(f"2. jax.make_jaxpr of a Flax LSTM ({args.layers} layers), median of {args.reps}:\n")
    print("| caller depth | " + " | ".join(str(d) for d in depths) + " |")
    print("|---|" + "---|" * len(depths))
    print("| ms | " + " | ".join(f"{times[d] * 1e3:.0f}" for d in depths) + " |")
    print("| vs fastest | " + " | ".join(f"{times[d] / fastest:.2f}x" for d in depths) + " |")


if __name__ == "__main__":
    main()
