"""How long do eager calls of ``autocast_transform(model.apply)`` take, first and steady state?

An eager call (outside ``jax.jit``) traces the function, rewrites it and compiles the rewritten
program once per input signature, then reuses the executable. Compared, on the ResNet-style Flax
CNN of ``freeze.py`` (BatchNorm in inference mode, batch 32 of 32x32x3 images):

- ``jit f32``: ``jax.jit(model.apply)(variables, x)``, the float32 model;
- ``jit autocast``: ``jax.jit(jamp.autocast_transform(model.apply))``, the same bf16 program
  compiled by an explicit ``jax.jit`` (what an eager call cannot beat);
- ``autocast eager``: ``jamp.autocast_transform(model.apply)(variables, x)``, no ``jax.jit``;
- ``autocast op by op``: the same under ``jax.disable_jit()``, i.e. every primitive dispatched on
  its own (what eager calls did before they were compiled).

Each side runs in a fresh subprocess, so no side reuses another's compilations. "first" is the
first call (trace + rewrite + compile + run), "steady" the median of later calls. Goal: autocast
eager as fast as ``jit autocast`` (first call and steady state, within noise). Against ``jit f32``
the bf16 program costs more on this CPU (bf16 is emulated: XLA compiles and runs extra converts).

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/eager_compile.py [--blocks 2] [--calls 20]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SIDES = ("jit f32", "jit autocast", "autocast eager", "autocast op by op")


def measure(side: str, blocks: int, calls: int) -> dict[str, float]:
    import jax

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import jamp
    from benchmarks.freeze import ResNet

    x = jax.random.normal(jax.random.key(0), (32, 32, 32, 3))
    model = ResNet(blocks)
    variables = jax.block_until_ready(model.init(jax.random.key(1), x))
    fn = {"jit f32": jax.jit(model.apply),
          "jit autocast": jax.jit(jamp.autocast_transform(model.apply)),
          "autocast eager": jamp.autocast_transform(model.apply),
          "autocast op by op": jamp.autocast_transform(model.apply)}[side]

    def call() -> float:
        start = time.perf_counter()
        if side == "autocast op by op":
            with jax.disable_jit():
                jax.block_until_ready(fn(variables, x))
        else:
            jax.block_until_ready(fn(variables, x))
        return time.perf_counter() - start

    first = call()
    later = [call() for _ in range(calls)]
    return {"first_s": first, "steady_ms": 1e3 * statistics.median(later)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=2, help="residual blocks per stage")
    parser.add_argument("--calls", type=int, default=20, help="later calls for the steady state")
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # subprocess mode
    args = parser.parse_args()
    if args.side:
        print(json.dumps(measure(args.side, args.blocks, args.calls)))
        return
    rows = {}
    for side in SIDES:
        out = subprocess.run([sys.executable, __file__, "--side", side, "--blocks",
                              str(args.blocks), "--calls", str(args.calls)],
                             check=True, capture_output=True, text=True).stdout
        rows[side] = json.loads(out.strip().splitlines()[-1])
    import jax
    print(f"ResNet-style CNN, {3 * args.blocks} blocks, batch 32; jax {jax.__version__}; "
          f"load average {os.getloadavg()[0]:.1f}\n")
    print("| side | first call (s) | steady state (ms) | first call / jit f32 |")
    print("|---|---|---|---|")
    base = rows["jit f32"]["first_s"]
    for side, r in rows.items():
        print(f"| {side} | {r['first_s']:.2f} | {r['steady_ms']:.1f} | {r['first_s'] / base:.2f}x |")


if __name__ == "__main__":
    main()
