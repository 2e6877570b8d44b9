"""Cost of ``jamp.tune`` against one jitted forward+backward per scope, and (``--train``) the
quality of a tuned float8 policy on the tiny GPT.

What is measured, per model (the tiny GPT of ``examples/tiny_gpt.py``, the digits CNN of
``examples/digits.py``, one training batch, the loaders of ``benchmarks/nonfinite.py``):

  * ``step``: ``jax.jit(jax.value_and_grad(jamp.autocast_transform(loss, jamp.Policy())))``,
    one forward+backward of the bfloat16 loss: **cold** (a fresh function: trace, compile, run;
    median of ``--cold-reps``) and **warm** (median of ``--reps`` calls);
  * ``tune``: ``jamp.tune(loss, *batch, candidates=..., tolerance=...)`` on a fresh function
    (every run it makes compiles a program of its own: there is no warm tune), once per
    configuration: bfloat16 alone, and bfloat16 + float8 (base ``Policy(min_float8_flops=0)``:
    every matmul of these small models is below the default threshold).

Goal (issue 22): ``tune`` under 20x one jitted forward+backward times the number of scopes. The
ratio is printed against the cold step (what tune does per run: trace, compile, run) and against
the warm one.

``--train`` (tiny GPT only): tune with candidates bfloat16 and float8 on one batch, then train
bfloat16 autocast and the tuned policy with ``examples/tiny_gpt.py``'s loop (its ``train``, with
the tuned policy registered as a mode) and compare held-out token accuracy and the share of
matmul FLOPs in float8. Issue 22's goal: within 0.5 points of bfloat16 with >= 80% of the
matmul FLOPs in float8. float8 is emulated on a CPU (slow, and says nothing of GPU speed).

Usage::

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/tune.py [--models tiny_gpt digits_cnn] \
        [--reps 5] [--cold-reps 1] [--train --steps 150 --tolerance-f8 0.1]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import environment, markdown_table, median  # noqa: E402
from nonfinite import MODELS, block, fresh, seconds  # noqa: E402

import jamp  # noqa: E402

CONFIGS = {
    "bf16": dict(candidates=(jnp.bfloat16,), tolerance=1e-2),
    "bf16+f8": dict(candidates=(jnp.bfloat16, jnp.float8_e4m3fn), tolerance=0.1,
                    policy=jamp.Policy(min_float8_flops=0)),
}


def measure(name: str, reps: int, cold_reps: int, configs: list[str]) -> list[list[Any]]:
    loss, args = MODELS[name]()
    policy = jamp.Policy()
    cold = []
    for _ in range(cold_reps):
        f = fresh(loss)
        cold.append(seconds(lambda f=f: jax.jit(jax.value_and_grad(
            jamp.autocast_transform(f, policy)))(*args)))
    step = jax.jit(jax.value_and_grad(jamp.autocast_transform(loss, policy)))
    block(step(*args))
    warm = median([seconds(lambda: step(*args)) for _ in range(reps)])
    rows = []
    for config in configs:
        start = time.perf_counter()
        result = jamp.tune(fresh(loss), *args, **CONFIGS[config])
        took = time.perf_counter() - start
        n = len(result.scopes)
        chosen = ", ".join(f"{d} {sum(r.chosen == d for r in result.scopes)}"
                           for d in sorted({r.chosen for r in result.scopes}))
        rows.append([name, config, n, result.runs, f"{median(cold):.1f}", f"{warm * 1e3:.1f}",
                     f"{took:.1f}", f"**{took / (median(cold) * n):.2f}x**",
                     f"{took / (warm * n):.0f}x", f"{result.error:.3g}", chosen])
    return rows


def train_tuned(steps: int, tolerance: float, seed: int) -> None:
    """Tune the tiny GPT for float8 on one batch, then train bfloat16 and the tuned policy."""
    import tiny_gpt as gpt

    loss, args = MODELS["tiny_gpt"]()
    start = time.perf_counter()
    result = jamp.tune(loss, *args, candidates=(jnp.bfloat16, jnp.float8_e4m3fn),
                       tolerance=tolerance, policy=jamp.Policy(min_float8_flops=0))
    print(f"tune: {time.perf_counter() - start:.0f} s\n\n```text\n{result}\n```\n",
          flush=True)
    gpt.COMPUTE_DTYPES["tuned"] = result.policy  # tiny_gpt.train takes a policy per mode
    runs = {mode: gpt.train(mode, steps=steps, seed=seed, progress=False)
            for mode in ("bfloat16", "tuned")}
    gap = runs["tuned"]["accuracy"] - runs["bfloat16"]["accuracy"]
    print(markdown_table(
        ["run", "held-out token acc %", "sequences %", "final loss", "matmul FLOPs in float8"],
        [[mode, f"{r['accuracy']:.2f}", f"{r['sequence_accuracy']:.1f}", f"{r['final_loss']:.4f}",
          f"{result.float8_flop_share:.1%}" if mode == "tuned" else "0%"]
         for mode, r in runs.items()]))
    ok = abs(gap) <= 0.5 and result.float8_flop_share >= 0.8
    print(f"\ntuned - bfloat16: {gap:+.2f} points; float8 share {result.float8_flop_share:.1%} "
          f"({'met' if ok else 'NOT met'}: within 0.5 points with >= 80% in float8); "
          f"{steps} steps, seed {seed}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--cold-reps", type=int, default=1)
    parser.add_argument("--train", action="store_true", help="the float8 training comparison")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tolerance-f8", type=float, default=0.1)
    parser.add_argument("--skip-timing", action="store_true")
    args = parser.parse_args()
    print(environment(), "\n", flush=True)
    if not args.skip_timing:
        header = ["model", "candidates", "scopes", "runs", "cold step s", "warm step ms",
                  "tune s", "tune / (cold step x scopes), goal < 20x",
                  "tune / (warm step x scopes)", "error", "chosen"]
        print(markdown_table(header, []), flush=True)
        for name in args.models:
            for row in measure(name, args.reps, args.cold_reps, args.configs):
                print("| " + " | ".join(str(c) for c in row) + " |", flush=True)
    if args.train:
        print()
        train_tuned(args.steps, args.tolerance_f8, args.seed)


if __name__ == "__main__":
    main()
