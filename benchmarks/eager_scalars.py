"""How many programs does an eager loop compile when it passes a changing Python number?

An eager loop (no ``jax.jit``) of 40 steps, each calling three of JAX's jitted functions with a
number that changes every step, as a torch-style loop does with a learning rate or a step count:
``x * (0.1 * i)`` (jnp's multiply), ``lax.cond(i % 2, inc, dec, x)`` and ``jnp.clip(x, 0, i)``.
Plain JAX traces each callee with the number as an operand and compiles it once; counted here,
with JAX's own test helper (``jtu.count_jit_and_pmap_lowerings``), against the same loop inside
``with jamp.autocast():``, with the garbage collector on, once per side in one process (plain
first: the region's rewritten calls are compiled programs of their own, not JAX's cache entries).

    JAX_PLATFORMS=cpu .venv/bin/python    benchmarks/eager_scalars.py [--steps 40]
    JAX_PLATFORMS=cpu .venv312/bin/python benchmarks/eager_scalars.py
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
from jax._src import test_util as jtu  # benchmark only: JAX's lowering counter

import jamp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    x = jnp.ones((8, 8))
    inc, dec = (lambda a: a + 1), (lambda a: a - 1)

    def step(i: int) -> tuple:
        return x * (0.1 * i), jax.lax.cond(i % 2, inc, dec, x), jnp.clip(x, 0, i)

    def loop() -> None:
        for i in range(1, args.steps + 1):
            jax.block_until_ready(step(i))

    def in_region() -> None:
        with jamp.autocast():
            loop()

    print(f"jax {jax.__version__}, {args.steps} steps\n")
    print("| side | lowerings | seconds |\n|---|---|---|")
    for side, run in (("plain", loop), ("region", in_region)):
        with jtu.count_jit_and_pmap_lowerings() as count:
            start = time.perf_counter()
            run()
            seconds = time.perf_counter() - start
        print(f"| {side} | {count()} | {seconds:.2f} |")


if __name__ == "__main__":
    main()
