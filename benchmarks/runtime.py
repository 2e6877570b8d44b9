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

Models (``--models``): ``mlp``, ``cnn``, ``transformer`` (the default set), and two with
higher-order primitives: ``lstm`` (two ``nn.RNN(nn.LSTMCell)`` layers, i.e. Flax lifted
``nn.scan``: a ``scan`` per layer whose body gets the cell's weights as loop constants) and
``remat`` (the transformer with every block wrapped in ``nn.remat``, i.e. ``jax.checkpoint``).
``--modes forward grad``: ``forward`` times the model's ``apply``; ``grad`` a training-style step,
``jax.jit(jax.grad(loss))`` with ``loss = cross_entropy(apply(params, x), labels)`` (float32
log-softmax) against ``jax.jit(jax.grad(jamp.autocast_transform(loss_fp32)))``; gradients are
float32 in both.

For the ``lstm`` and ``remat`` rows a second table follows on where the weight casts are:
``jamp`` (like Flax's ``dtype=bfloat16`` layers) casts a scan's float32 weights inside the scan
body, i.e. once per iteration as traced; the table shows whether they are still inside the
``while`` loops of the optimized HLO or were hoisted out of them (by XLA's loop-invariant code
motion for the forward; for ``grad``, JAX's scan partial evaluation already moves loop-invariant
residuals out of the loop in the jaxpr). ``--hlo-evidence`` prints the instructions, ``--dump-hlo
DIR`` writes the optimized HLO modules.

Caveat: bfloat16 arithmetic is emulated on the CPU (XLA widens bf16 elementwise ops to f32 with
convert pairs, so the optimized-HLO convert counts are dominated by that emulation and an op moved
from bf16 to f32 *removes* converts there). Only compare mixed-precision programs with each other,
never bf16 against f32 wall time.

Usage::

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/runtime.py [--quick]
    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/runtime.py --models lstm remat \
        --modes forward grad [--hlo-evidence] [--dump-hlo DIR]
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jamp  # noqa: E402
from common import (BF16, CNN, LSTM, MLP, Transformer, count_converts,  # noqa: E402
                    count_eqns, cross_entropy, environment, hlo_convert_sites, hlo_op_counts,
                    loop_constant_casts, markdown_table, median, normalized_hlo, paired_ratio,
                    primitive_and_dtype)

GOAL_RATIO = 1.03


@dataclasses.dataclass
class Case:
    name: str
    make: Callable[..., Any]  # make(dtype=None | jnp.bfloat16) -> Flax module
    shape: tuple[int, ...]
    higher_order: bool = False  # scan / remat inside: report where the weight casts are


def cases(quick: bool) -> dict[str, Case]:
    blocks = 2 if quick else 4
    layers, steps = (1, 16) if quick else (2, 32)
    return {
        "mlp": Case("MLP 4x256 gelu, batch 64", lambda **kw: MLP(4, 256, **kw), (64, 256)),
        "cnn": Case("CNN 3 conv + 2 dense, 8x32x32x3", lambda **kw: CNN(**kw), (8, 32, 32, 3)),
        "transformer": Case(f"Transformer {blocks} blocks d=128, 4x64 tokens",
                            lambda **kw: Transformer(blocks, d=128, heads=4, **kw), (4, 64, 128)),
        "lstm": Case(f"LSTM {layers}x256 (nn.RNN scan), 16x{steps}x64",
                     lambda **kw: LSTM(256, layers, **kw), (16, steps, 64), higher_order=True),
        "remat": Case(f"Remat transformer {blocks} blocks d=128, 4x64 tokens",
                      lambda **kw: Transformer(blocks, d=128, heads=4, remat=True, **kw),
                      (4, 64, 128), higher_order=True),
    }


DEFAULT_MODELS = ("mlp", "cnn", "transformer")
MODES = ("forward", "grad")


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
    hlo: str
    hlo_converts: int
    hlo_counts: Any
    hlo_normalized: list[str]
    stablehlo_converts: int
    jaxpr_counts: Any
    loop_constant_casts: int

    @classmethod
    def build(cls, fn: Callable, args: tuple) -> "Program":
        jitted = jax.jit(fn)
        lowered = jitted.lower(*args)
        hlo = lowered.compile().as_text()
        jaxpr = jax.make_jaxpr(fn)(*args)
        return cls(fn=jitted, out=jitted(*args), hlo=hlo,
                   hlo_converts=count_converts(hlo), hlo_counts=hlo_op_counts(hlo),
                   hlo_normalized=normalized_hlo(hlo),
                   stablehlo_converts=lowered.as_text().count("stablehlo.convert"),
                   jaxpr_counts=count_eqns(jaxpr, primitive_and_dtype),
                   loop_constant_casts=loop_constant_casts(jaxpr))

    @property
    def jaxpr_casts(self) -> int:
        return sum(n for (prim, _), n in self.jaxpr_counts.items()
                   if prim == "convert_element_type")

    @property
    def out_dtype(self) -> str:
        return "/".join(sorted({str(leaf.dtype) for leaf in jax.tree_util.tree_leaves(self.out)}))

    def weight_casts(self, param_shapes: set) -> dict[str, Any]:
        """Where the optimized HLO casts parameters to bfloat16.

        A parameter cast is a ``convert`` to bf16 that JAX traced as ``convert_element_type``
        (not one XLA inserted to emulate bf16) with the shape of a parameter (or of a parameter
        reshaped with leading 1s, as Flax and jamp do with biases). ``hoisted`` are those outside
        every loop whose JAX name stack says they were traced inside a loop body (``while/body``):
        XLA moved them out of the loop.
        """
        sites = hlo_convert_sites(self.hlo)
        casts = [c for c in sites if c.is_user_cast and c.dtype == "bf16"
                 and c.shape in param_shapes]
        return {"loop_converts": sum(c.in_loop for c in sites),
                "in_loop": [c for c in casts if c.in_loop],
                "outside": [c for c in casts if not c.in_loop],
                "hoisted": [c for c in casts if not c.in_loop and c.from_loop_body]}


def rel_error(out: Any, ref: Any) -> float:
    """Relative error of ``out`` against ``ref`` (arrays or pytrees, e.g. gradients)."""
    flat = lambda tree: np.concatenate([np.ravel(np.asarray(leaf, np.float64))
                                        for leaf in jax.tree_util.tree_leaves(tree)])
    out, ref = flat(out), flat(ref)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def parameter_shapes(params: Any) -> set:
    """Shapes of the parameter leaves, also with up to two leading 1s (a reshaped bias)."""
    shapes = {tuple(leaf.shape) for leaf in jax.tree_util.tree_leaves(params)}
    return {(1,) * k + shape for shape in shapes for k in range(3)}


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


def training_loss(apply: Callable) -> Callable:
    """``loss(params, x, labels)``: float32 softmax cross-entropy of ``apply(params, x)``."""
    return lambda params, x, labels: cross_entropy(apply(params, x), labels)


def run_case(case: Case, mode: str, rounds: int, min_sample_s: float) -> dict[str, Any]:
    x = jax.random.normal(jax.random.key(1), case.shape, jnp.float32)
    model32 = case.make()
    params = model32.init(jax.random.key(0), x)
    if mode == "forward":
        args = (params, x)
        make_hand = lambda: case.make(dtype=BF16).apply
        fp32, amp_fn = model32.apply, jamp.autocast_transform(model32.apply)
    else:  # a training step: gradients of a float32 cross-entropy
        out = jax.eval_shape(model32.apply, params, x)
        labels = jax.random.randint(jax.random.key(2), out.shape[:-1], 0, out.shape[-1])
        args = (params, x, labels)
        make_hand = lambda: jax.grad(training_loss(case.make(dtype=BF16).apply))
        fp32 = jax.grad(training_loss(model32.apply))
        amp_fn = jax.grad(jamp.autocast_transform(training_loss(model32.apply)))
    ref = jax.jit(fp32)(*args)
    hand = Program.build(make_hand(), args)
    amp = Program.build(amp_fn, args)
    # A second, separately compiled copy of the hand-written program: its ratio to the first
    # is the noise floor of the measurement (the same program, timed the same way).
    copy = jax.jit(make_hand())
    lat = latencies({"hand": lambda: hand.fn(*args), "autocast": lambda: amp.fn(*args),
                     "copy": lambda: copy(*args)}, rounds, min_sample_s)
    name = case.name if mode == "forward" else f"{case.name}, train step (grad)"
    return {"case": case, "name": name, "mode": mode, "hand": hand, "amp": amp,
            "param_shapes": parameter_shapes(params),
            "hand_ms": median(lat["hand"]) * 1e3, "amp_ms": median(lat["autocast"]) * 1e3,
            "ratio": paired_ratio(lat["autocast"], lat["hand"]),
            "noise": paired_ratio(lat["copy"], lat["hand"]),
            "best_ratio": min(lat["autocast"]) / min(lat["hand"]),
            "err_hand": rel_error(hand.out, ref), "err_amp": rel_error(amp.out, ref)}


def weight_cast_table(results: list[dict[str, Any]]) -> str:
    rows = []
    for r in results:
        hand, amp = (r[k].weight_casts(r["param_shapes"]) for k in ("hand", "amp"))
        pair = lambda f: f"{f(hand)} / {f(amp)}"
        rows.append([r["name"],
                     f"{r['hand'].loop_constant_casts} / {r['amp'].loop_constant_casts}",
                     pair(lambda w: w["loop_converts"]),
                     f"{len(hand['in_loop'])} / **{len(amp['in_loop'])}**",
                     pair(lambda w: len(w["outside"])), pair(lambda w: len(w["hoisted"]))])
    return markdown_table(
        ["program (every column: hand / autocast)",
         "jaxpr: casts of loop constants inside scan bodies",
         "HLO: converts inside while bodies", "HLO: weight casts inside while bodies",
         "HLO: weight casts outside loops", "of which hoisted out of a loop body by XLA"], rows)


def hlo_evidence(r: dict[str, Any], limit: int) -> str:
    lines = [f"- {r['name']}"]
    for side in ("hand", "amp"):
        w = r[side].weight_casts(r["param_shapes"])
        label = "hand" if side == "hand" else "autocast"
        for kind in ("in_loop", "hoisted"):
            sites = sorted(w[kind], key=lambda c: -math.prod(c.shape))  # kernels first
            where = "inside while bodies" if kind == "in_loop" else "hoisted out of loop bodies"
            lines.append(f"  - {label}, weight casts {where}: {len(sites)}")
            lines += [f"    - `{c.line[:160]}` (op_name `{c.op_name}`)" for c in sites[:limit]]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="fewer rounds, smaller transformers, a 1-layer LSTM of 16 steps")
    parser.add_argument("--models", nargs="+", choices=[*cases(False), "all"],
                        default=list(DEFAULT_MODELS),
                        help=f"models to run (default: {' '.join(DEFAULT_MODELS)})")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=["forward"],
                        help="forward: model.apply; grad: jax.grad of a cross-entropy loss")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 31)")
    parser.add_argument("--min-sample-ms", type=float, default=None,
                        help="calls per sample are chosen so one sample lasts about this long")
    parser.add_argument("--hlo-evidence", type=int, nargs="?", const=4, default=0, metavar="N",
                        help="print up to N (default 4) weight-cast HLO instructions per program")
    parser.add_argument("--dump-hlo", metavar="DIR", help="write the optimized HLO modules here")
    args = parser.parse_args()
    rounds = args.rounds or (7 if args.quick else 31)
    min_sample_s = (args.min_sample_ms or (5.0 if args.quick else 20.0)) / 1e3
    all_cases = cases(args.quick)
    models = list(all_cases) if "all" in args.models else args.models

    print(f"# jamp runtime: autocast vs hand-written bfloat16 Flax\n\n{environment()}\n")
    print(f"Latency: median of {rounds} interleaved rounds, each sample about "
          f"{min_sample_s * 1e3:.0f} ms of back-to-back calls, program order rotating; the ratio "
          "is the median of the per-round ratios, \"best\" the ratio of the fastest samples, "
          "\"noise floor\" the ratio of two copies of the hand-written program.\n")
    results = [run_case(all_cases[m], mode, rounds, min_sample_s)
               for m in models for mode in args.modes]

    print(markdown_table(
        ["model", "hand bf16 ms", "autocast ms", "autocast / hand", "best / best",
         "noise floor (hand copy / hand)", "same optimized HLO",
         "HLO converts hand / autocast", "StableHLO converts", "jaxpr casts",
         "output dtype hand / autocast", "rel. error vs f32 hand / autocast"],
        [[r["name"], f"{r['hand_ms']:.3f}", f"{r['amp_ms']:.3f}", f"**{r['ratio']:.2f}x**",
          f"{r['best_ratio']:.2f}x", f"{r['noise']:.2f}x",
          "yes" if r["hand"].hlo_normalized == r["amp"].hlo_normalized else "no",
          f"{r['hand'].hlo_converts} / **{r['amp'].hlo_converts}**",
          f"{r['hand'].stablehlo_converts} / {r['amp'].stablehlo_converts}",
          f"{r['hand'].jaxpr_casts} / {r['amp'].jaxpr_casts}",
          f"{r['hand'].out_dtype} / {r['amp'].out_dtype}",
          f"{r['err_hand']:.1e} / {r['err_amp']:.1e}"] for r in results]))

    higher = [r for r in results if r["case"].higher_order]
    if higher:
        print("\n## Weight casts in scan and remat programs\n\nCasts of float32 parameters to "
              "bfloat16: in the jaxpr, those traced inside a scan body on a loop constant (run "
              "once per iteration as traced); in the optimized HLO, `convert`s to bf16 traced as "
              "`convert_element_type` with a parameter's shape, inside `while` bodies or outside "
              "every loop (hoisted: outside, though traced in a loop body). \"Converts inside "
              "while bodies\" counts every convert run per iteration (mostly bf16 emulation).\n")
        print(weight_cast_table(higher))
        if args.hlo_evidence:
            print("\n### HLO instructions\n")
            for r in higher:
                print(hlo_evidence(r, args.hlo_evidence))
    if args.dump_hlo:
        os.makedirs(args.dump_hlo, exist_ok=True)
        for r in results:
            stem = re.sub(r"[^\w]+", "_", r["name"]).strip("_").lower()
            for side in ("hand", "amp"):
                with open(os.path.join(args.dump_hlo, f"{stem}.{side}.hlo.txt"), "w") as f:
                    f.write(r[side].hlo)
        print(f"\nOptimized HLO written to {args.dump_hlo}/")

    print("\n## Structural differences, hand → autocast\n\nEquations per primitive and output "
          "dtype in the jaxpr, instructions per opcode and result type in the optimized HLO "
          "(only the counts that differ).\n")
    for r in results:
        hand, amp = r["hand"], r["amp"]
        print(f"- {r['name']}\n"
              f"  - jaxpr: {structural_diff(hand.jaxpr_counts, amp.jaxpr_counts)}\n"
              f"  - optimized HLO: {structural_diff(hand.hlo_counts, amp.hlo_counts)}")

    worst = max(r["ratio"] for r in results)
    converts_ok = all(r["amp"].hlo_converts <= r["hand"].hlo_converts for r in results)
    print(f"\n- goal autocast/hand <= {GOAL_RATIO}x: {'met' if worst <= GOAL_RATIO else 'NOT met'} "
          f"(worst {worst:.2f}x)")
    print(f"- goal optimized-HLO converts autocast <= hand: {'met' if converts_ok else 'NOT met'}")


if __name__ == "__main__":
    main()
