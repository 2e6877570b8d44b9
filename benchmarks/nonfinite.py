"""Cost of ``jamp.find_nonfinite`` and ``jamp.value_ranges`` against one jitted training step.

What is measured, per model (the tiny GPT of ``examples/tiny_gpt.py``, the digits CNN of
``examples/digits.py``, bfloat16 policy, one training batch):

  * ``step``: ``jax.jit(jax.value_and_grad(jamp.autocast_transform(loss)))``, one forward+backward
    of the plain mixed-precision loss: the reference;
  * ``find_nonfinite(loss, ..., grad=True)`` on the same call, which is finite (the common case:
    the check answers "nothing" after one compiled pass), and ``value_ranges(..., grad=True)``.

Two regimes: **warm** (the call repeated: jamp keeps the traced, compiled check per function,
policy and argument shapes) as the median of ``--reps`` calls, against the warm jitted step;
**cold** (a fresh function object, so everything is traced and compiled again) against the first
call of a freshly jitted step, median of ``--cold-reps``. Goal (issue 15): at most 5x one jitted
forward+backward. With ``--failing`` a third row times a call whose program is *not* finite
(a float16 policy and floating arguments scaled by 1e4): the compiled pass, the op-by-op
drill-down and the remedy search (at most 3 remedies here; each one tried is one more traced and
compiled check; no goal).

When not called, these features cost nothing: they add no hook to the interpreter or to
``autocast_transform``; the check is a separate program built only when asked for.

Usage::

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/nonfinite.py [--reps 20] [--cold-reps 3] \
        [--models tiny_gpt digits_cnn] [--failing]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jamp  # noqa: E402
from common import environment, markdown_table, median  # noqa: E402


def tiny_gpt() -> tuple[Callable, tuple]:
    import tiny_gpt as gpt
    model = gpt.TinyGPT()
    seqs = jnp.asarray(gpt.make_sequences(np.random.default_rng(0), gpt.BATCH_SIZE))
    params = model.init(jax.random.key(0), seqs[:, :-1])["params"]

    def loss(params, seqs):
        inputs, targets = gpt.split(seqs)
        logits = model.apply({"params": params}, inputs)[:, gpt.LENGTH:]
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    return loss, (params, seqs)


def digits_cnn() -> tuple[Callable, tuple]:
    import digits
    data = digits.load_data()
    model = digits.CNN()
    x = jnp.asarray(data.x_train[:digits.BATCH_SIZE])
    y = jnp.asarray(data.y_train[:digits.BATCH_SIZE])
    variables = model.init(jax.random.key(0), x[:1], False)

    def loss(params, batch_stats, x, y):
        logits, _ = model.apply({"params": params, "batch_stats": batch_stats}, x, True,
                                mutable=["batch_stats"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, (variables["params"], variables["batch_stats"], x, y)


MODELS = {"tiny_gpt": tiny_gpt, "digits_cnn": digits_cnn}


def block(tree: Any) -> Any:
    return jax.tree.map(lambda x: x.block_until_ready() if hasattr(x, "block_until_ready") else x,
                        tree)


def seconds(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    block(fn())
    return time.perf_counter() - start


def fresh(loss: Callable) -> Callable:
    """A new function object: no cache (jit's or jamp's) knows it."""
    return lambda *a: loss(*a)


def measure(name: str, reps: int, cold_reps: int, failing: bool) -> list[list[Any]]:
    loss, args = MODELS[name]()
    policy = jamp.Policy(jnp.bfloat16)
    step = jax.jit(jax.value_and_grad(jamp.autocast_transform(loss, policy)))
    seconds(lambda: step(*args))
    checked = lambda: jamp.find_nonfinite(loss, *args, policy=policy, grad=True)
    ranged = lambda: jamp.value_ranges(loss, *args, policy=policy, grad=True)
    assert checked() is None, f"{name} is expected to be finite under bfloat16"
    ranged()
    warm = {"step": [], "find_nonfinite": [], "value_ranges": []}
    for _ in range(reps):  # interleaved, so load on a shared machine hits all three alike
        warm["step"].append(seconds(lambda: step(*args)))
        warm["find_nonfinite"].append(seconds(checked))
        warm["value_ranges"].append(seconds(ranged))
    cold = {"step": [], "find_nonfinite": [], "value_ranges": []}
    for _ in range(cold_reps):
        f = fresh(loss)
        cold["step"].append(seconds(lambda: jax.jit(jax.value_and_grad(
            jamp.autocast_transform(f, policy)))(*args)))
        cold["find_nonfinite"].append(seconds(
            lambda: jamp.find_nonfinite(fresh(loss), *args, policy=policy, grad=True)))
        cold["value_ranges"].append(seconds(
            lambda: jamp.value_ranges(fresh(loss), *args, policy=policy, grad=True)))
    rows = []
    for regime, samples in (("warm", warm), ("cold", cold)):
        ref = median(samples["step"])
        for what in ("find_nonfinite", "value_ranges"):
            t = median(samples[what])
            rows.append([name, regime, what, f"{ref * 1e3:.1f}", f"{t * 1e3:.1f}",
                         f"**{t / ref:.2f}x**"])
    if not failing:
        return rows
    # A failing call: float16 with inputs that overflow it.
    bad_args = jax.tree.map(lambda a: a * 1e4 if jnp.issubdtype(a.dtype, jnp.floating) else a,
                            args)
    f16 = jamp.Policy(jnp.float16)
    t0 = time.perf_counter()
    found = jamp.find_nonfinite(fresh(loss), *bad_args, policy=f16, grad=True, max_remedies=3)
    t_found = time.perf_counter() - t0
    what = (f"found `{found.primitive}` {found.dtype}, {len(found.tried)} remedies tried"
            if found is not None else "finite")
    rows.append([name, "cold, not finite", f"find_nonfinite (float16): {what}",
                 f"{median(cold['step']) * 1e3:.1f}", f"{t_found * 1e3:.1f}",
                 f"{t_found / median(cold['step']):.2f}x"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--cold-reps", type=int, default=3)
    parser.add_argument("--failing", action="store_true",
                        help="also time a call that is not finite (drill-down and remedies)")
    args = parser.parse_args()
    print(environment(), "\n", flush=True)
    header = ["model", "regime", "call", "jitted fwd+bwd ms", "call ms", "ratio (goal <= 5x)"]
    print(markdown_table(header, []), flush=True)
    for name in args.models:
        for row in measure(name, args.reps, args.cold_reps, args.failing):
            print("| " + " | ".join(str(c) for c in row) + " |", flush=True)


if __name__ == "__main__":
    main()
