"""How many programs does an eager loop compile when it passes a changing Python number?

An eager loop (no ``jax.jit``) of 40 steps, each calling three of JAX's jitted functions with a
number that changes every step, as a torch-style loop does with a learning rate or a step count:
``x * (0.1 * i)`` (jnp's multiply), ``lax.cond(i % 2, inc, dec, x)`` and ``jnp.clip(x, 0, i)``,
and (``--loops``) two of JAX's loops with the same body every step, ``lax.fori_loop(0, 3, body,
x)`` and ``lax.scan``, which plain JAX compiles once too.
Plain JAX traces each callee with the number as an operand and compiles it once; counted here,
with JAX's own test helper (``jtu.count_jit_and_pmap_lowerings``), against the same loop inside
``with jamp.autocast():``, with the garbage collector on, once per side in one process (plain
first: the region's rewritten calls are compiled programs of their own, not JAX's cache entries).

    JAX_PLATFORMS=cpu .venv/bin/python    benchmarks/eager_scalars.py [--steps 40] [--loops]
    JAX_PLATFORMS=cpu .venv312/bin/python benchmarks/eager_scalars.py [--loops]
"""
from __future__ import annotations

import argparse
import time
from typing import Any

import jax
import jax.numpy as jnp
from jax._src import test_util as jtu  # benchmark only: JAX's lowering counter

import jamp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--loops", action="store_true", help="also fori_loop and scan per step")
    args = parser.parse_args()
    x = jnp.ones((8, 8))
    inc, dec = (lambda a: a + 1), (lambda a: a - 1)

    def body(j: Any, a: Any) -> Any:
        return jnp.tanh(a @ x) + j

    def scanned(a: Any, w: Any) -> tuple:
        return jnp.tanh(a @ w), a.sum()

    def step(i: int) -> tuple:
        outs = x * (0.1 * i), jax.lax.cond(i % 2, inc, dec, x), jnp.clip(x, 0, i)
        if args.loops:
            outs += jax.lax.fori_loop(0, 3, body, x), jax.lax.scan(scanned, x, jnp.stack([x, x]))
        return outs

    def loop() -> None:
        for i in range(1, args.steps + 1):
            jax.block_until_ready(step(i))

    def in_region() -> None:
        with jamp.autocast():
            loop()

    loops = ", with fori_loop and scan" if args.loops else ""
    print(f"jax {jax.__version__}, {args.steps} steps{loops}\n")
    print("| side | lowerings | seconds |\n|---|---|---|")
    for side, run in (("plain", loop), ("region", in_region)):
        with jtu.count_jit_and_pmap_lowerings() as count:
            start = time.perf_counter()
            run()
            seconds = time.perf_counter() - start
        print(f"| {side} | {count()} | {seconds:.2f} |")


if __name__ == "__main__":
    main()
