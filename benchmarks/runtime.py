"""Runtime of autocast programs against hand-written bfloat16 Flax models.

What is measured
  ``jax.jit(jamp.autocast_transform(model_fp32.apply))`` against ``jax.jit(model_bf16.apply)``,
  where ``model_bf16`` is the same Flax model written by hand with ``dtype=jnp.bfloat16,
  param_dtype=jnp.float32`` and both run on the same float32 parameters. Reported per model:

  * latency per call: median over interleaved rounds, and the autocast/hand ratio as the median
    of the per-round ratios (goal: <= 1.03x); the ratio of the best rounds is shown as well,
    being the least disturbed by other processes on a shared machine, and so is the noise floor:
    the same ratio for a second, separately compiled copy of the hand-written program;
  * ``convert`` instructions in the optimized HLO (``.lower(...).compile().as_text()``, lines
    containing `` convert(``, fused computations included; goal: autocast has no more than
    hand-written), plus the casts in the jaxpr and in the unoptimized StableHLO, which do not
    depend on the backend;
  * whether the optimized HLO of the two is the same program (instructions compared without
    names, metadata and order);
  * output dtype and relative error against the float32 model;
  * the structural differences between the two programs: jaxpr equations per primitive and
    output dtype that differ (e.g. autocast runs softmax's ``exp`` in float32 where Flax's
    bfloat16 attention runs it in bfloat16).

Caveat: bfloat16 arithmetic is emulated on the CPU (XLA widens bf16 elementwise ops to f32 with
convert pairs, so the optimized-HLO convert counts are dominated by that emulation and an op moved
from bf16 to f32 *removes* converts there). Only compare mixed-precision programs with each other,
never bf16 against f32 wall time.

Usage::

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/runtime.py [--quick]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jamp  # noqa: E402
from common import (BF16, CNN, MLP, Transformer, count_converts, count_eqns,  # noqa: E402
                    environment, hlo_op_counts, markdown_table, median, normalized_hlo,
                    paired_ratio, primitive_and_dtype)

GOAL_RATIO = 1.03


@dataclasses.dataclass
class Case:
    name: str
    make: Callable[..., Any]  # make(dtype=None | jnp.bfloat16) -> Flax module
    shape: tuple[int, ...]


def cases(quick: bool) -> list[Case]:
    blocks = 2 if quick else 4
    return [
        Case("MLP 4x256 gelu, batch 64", lambda **kw: MLP(4, 256, **kw), (64, 256)),
        Case("CNN 3 conv + 2 dense, 8x32x32x3", lambda **kw: CNN(**kw), (8, 32, 32, 3)),
        Case(f"Transformer {blocks} blocks d=128, 4x64 tokens",
             lambda **kw: Transformer(blocks, d=128, heads=4, **kw), (4, 64, 128)),
    ]


def latencies(fns: dict[str, Callable[[], Any]], rounds: int,
              min_sample_s: float) -> dict[str, list[float]]:
    """Seconds per call of each zero-argument function: one sample of each per round, the order
    rotating from round to round so that no program always runs first."""
    inner = {}
    for name, fn in fns.items():  # warm up, then size each sample to last about min_sample_s
        for _ in range(3):
            jax.block_until_ready(fn())
        start = time.perf_counter()
        jax.block_until_ready(fn())
        inner[name] = max(1, int(min_sample_s / max(time.perf_counter() - start, 1e-6)))
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:  # rotate the order
            fn = fns[name]
            start = time.perf_counter()
            for _ in range(inner[name]):
                out = fn()
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - start) / inner[name])
    return times


@dataclasses.dataclass
class Program:
    """One jitted variant of a model and what its lowered and compiled forms contain."""

    fn: Callable
    out: Any
    hlo_converts: int
    hlo_counts: Any
    hlo_normalized: list[str]
    stablehlo_converts: int
    jaxpr_counts: Any

    @classmethod
    def build(cls, fn: Callable, params: Any, x: Any) -> "Program":
        jitted = jax.jit(fn)
        lowered = jitted.lower(params, x)
        hlo = lowered.compile().as_text()
        return cls(fn=jitted, out=jitted(params, x),
                   hlo_converts=count_converts(hlo), hlo_counts=hlo_op_counts(hlo),
                   hlo_normalized=normalized_hlo(hlo),
                   stablehlo_converts=lowered.as_text().count("stablehlo.convert"),
                   jaxpr_counts=count_eqns(jax.make_jaxpr(fn)(params, x), primitive_and_dtype))

    @property
    def jaxpr_casts(self) -> int:
        return sum(n for (prim, _), n in self.jaxpr_counts.items()
                   if prim == "convert_element_type")


def rel_error(out: Any, ref: Any) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def structural_diff(a: Any, b: Any) -> str:
    """Counts per (primitive or opcode, dtype) that differ between two programs, compactly."""
    by_prim: dict[str, list[str]] = {}
    for key in sorted(set(a) | set(b)):
        if a[key] != b[key]:
            prim, dtype = key
            by_prim.setdefault(prim, []).append(f"{dtype or '-'} {a[key]}→{b[key]}")
    if not by_prim:
        return "identical"
    return "; ".join(f"`{prim}` {', '.join(parts)}" for prim, parts in by_prim.items())


def run_case(case: Case, rounds: int, min_sample_s: float) -> dict[str, Any]:
    x = jax.random.normal(jax.random.key(1), case.shape, jnp.float32)
    model32 = case.make()
    params = model32.init(jax.random.key(0), x)
    ref = jax.jit(model32.apply)(params, x)
    hand = Program.build(case.make(dtype=BF16).apply, params, x)
    amp = Program.build(jamp.autocast_transform(model32.apply), params, x)
    # A second, separately compiled copy of the hand-written program: its ratio to the first
    # is the noise floor of the measurement (the same program, timed the same way).
    copy = jax.jit(case.make(dtype=BF16).apply)
    lat = latencies({"hand": lambda: hand.fn(params, x), "autocast": lambda: amp.fn(params, x),
                     "copy": lambda: copy(params, x)}, rounds, min_sample_s)
    return {"case": case, "hand": hand, "amp": amp,
            "hand_ms": median(lat["hand"]) * 1e3, "amp_ms": median(lat["autocast"]) * 1e3,
            "ratio": paired_ratio(lat["autocast"], lat["hand"]),
            "noise": paired_ratio(lat["copy"], lat["hand"]),
            "best_ratio": min(lat["autocast"]) / min(lat["hand"]),
            "err_hand": rel_error(hand.out, ref), "err_amp": rel_error(amp.out, ref)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer rounds, smaller transformer")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 31)")
    parser.add_argument("--min-sample-ms", type=float, default=None,
                        help="calls per sample are chosen so one sample lasts about this long")
    args = parser.parse_args()
    rounds = args.rounds or (7 if args.quick else 31)
    min_sample_s = (args.min_sample_ms or (5.0 if args.quick else 20.0)) / 1e3

    print(f"# jamp runtime: autocast vs hand-written bfloat16 Flax\n\n{environment()}\n")
    print(f"Latency: median of {rounds} interleaved rounds, each sample about "
          f"{min_sample_s * 1e3:.0f} ms of back-to-back calls, program order rotating; the ratio "
          "is the median of the per-round ratios, \"best\" the ratio of the fastest samples, "
          "\"noise floor\" the ratio of two copies of the hand-written program.\n")
    results = [run_case(case, rounds, min_sample_s) for case in cases(args.quick)]

    print(markdown_table(
        ["model", "hand bf16 ms", "autocast ms", "autocast / hand", "best / best",
         "noise floor (hand copy / hand)", "same optimized HLO",
         "HLO converts hand / autocast", "StableHLO converts", "jaxpr casts",
         "output dtype hand / autocast", "rel. error vs f32 hand / autocast"],
        [[r["case"].name, f"{r['hand_ms']:.3f}", f"{r['amp_ms']:.3f}", f"**{r['ratio']:.2f}x**",
          f"{r['best_ratio']:.2f}x", f"{r['noise']:.2f}x",
          "yes" if r["hand"].hlo_normalized == r["amp"].hlo_normalized else "no",
          f"{r['hand'].hlo_converts} / **{r['amp'].hlo_converts}**",
          f"{r['hand'].stablehlo_converts} / {r['amp'].stablehlo_converts}",
          f"{r['hand'].jaxpr_casts} / {r['amp'].jaxpr_casts}",
          f"{r['hand'].out.dtype} / {r['amp'].out.dtype}",
          f"{r['err_hand']:.1e} / {r['err_amp']:.1e}"] for r in results]))

    print("\n## Structural differences, hand → autocast\n\nEquations per primitive and output "
          "dtype in the jaxpr, instructions per opcode and result type in the optimized HLO "
          "(only the counts that differ).\n")
    for r in results:
        hand, amp = r["hand"], r["amp"]
        print(f"- {r['case'].name}\n"
              f"  - jaxpr: {structural_diff(hand.jaxpr_counts, amp.jaxpr_counts)}\n"
              f"  - optimized HLO: {structural_diff(hand.hlo_counts, amp.hlo_counts)}")

    worst = max(r["ratio"] for r in results)
    converts_ok = all(r["amp"].hlo_converts <= r["hand"].hlo_converts for r in results)
    print(f"\n- goal autocast/hand <= {GOAL_RATIO}x: {'met' if worst <= GOAL_RATIO else 'NOT met'} "
          f"(worst {worst:.2f}x)")
    print(f"- goal optimized-HLO converts autocast <= hand: {'met' if converts_ok else 'NOT met'}")


if __name__ == "__main__":
    main()
