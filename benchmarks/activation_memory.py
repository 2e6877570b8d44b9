"""Activation memory of a transformer loss under autocast, and the demo CNN's train step.

What is measured
  1. **Residual bytes** (backend-independent): ``loss, vjp_fn = jax.vjp(loss_fn, params)`` keeps
     the values the backward pass needs inside ``vjp_fn``; their size is
     ``sum(x.nbytes for x in jax.tree.leaves(vjp_fn))``. Measured for a Flax transformer language
     model loss (token embedding, pre-LN blocks of ``common.Block``, final LayerNorm, linear head,
     softmax cross-entropy) in four modes:

       * ``float32``       the plain model;
       * ``hand bf16``     the same model written by hand with ``dtype=bfloat16,
                           param_dtype=float32`` (the loss casts the logits to float32 first, as
                           usual with hand-written bf16 models);
       * ``autocast``      ``jamp.autocast_transform(loss_fp32)``, the default policy;
       * ``cast_inputs``   ``jamp.autocast_transform(loss_fp32, jamp.Policy(cast_inputs=True))``.

     Both eagerly (``jax.vjp(loss_fn, ...)``, op by op) and with the loss under ``jax.jit``
     (``jax.vjp(jax.jit(loss_fn), ...)``: the residuals are what partial evaluation of the
     jitted program keeps). Goals: ``autocast`` <= 0.8x ``float32``; ``cast_inputs`` <= ``hand
     bf16``, while the fp32-table ops (reductions, exp, log, rsqrt, ...) still run in float32 under
     ``cast_inputs`` (checked on the rewritten jaxpr: every equation of a ``Policy.fp32``
     primitive outputs float32).
  2. **The demo CNN's train step** (``examples/digits.py``: conv+BatchNorm+relu x2, dense x2,
     batch 64 of 8x8 digits, adam): compiled temporary memory
     (``jax.jit(step).lower(...).compile().memory_analysis().temp_size_in_bytes``) and the median
     time of a step, for the four modes above plus the demo's float16 autocast with a dynamic loss
     scale. No goal: bfloat16/float16 are emulated on this CPU and XLA widens them internally.

Usage::

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/activation_memory.py [--quick]
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
import jamp  # noqa: E402
from common import Block, count_eqns, environment, markdown_table, primitive_and_dtype  # noqa: E402

F32, BF16 = jnp.float32, jnp.bfloat16
GOAL_DEFAULT = 0.8  # autocast (default policy) residual bytes / float32 residual bytes
MODES = ("float32", "hand bf16", "autocast", "cast_inputs")


class LM(nn.Module):
    """Token + position embedding, ``blocks`` pre-LN transformer blocks, LayerNorm, vocab head."""

    vocab: int = 256
    d: int = 128
    heads: int = 4
    blocks: int = 4
    max_len: int = 512
    dtype: Any = None
    param_dtype: Any = F32

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        x = nn.Embed(self.vocab, self.d, name="tokens", **kw)(tokens)
        x = x + nn.Embed(self.max_len, self.d, name="positions", **kw)(jnp.arange(tokens.shape[1]))
        for _ in range(self.blocks):
            x = Block(self.d, self.heads, **kw)(x)
        x = nn.LayerNorm(**kw)(x)
        return nn.Dense(self.vocab, **kw)(x)


def lm_losses(cfg: argparse.Namespace) -> tuple[dict[str, Callable], Any, tuple]:
    """The four loss functions ``loss(params, tokens, targets)``, the float32 params, the batch."""
    arch = dict(vocab=cfg.vocab, d=cfg.d, heads=cfg.heads, blocks=cfg.blocks)
    fp32_model, bf16_model = LM(**arch), LM(**arch, dtype=BF16)
    tokens = jax.random.randint(jax.random.key(0), (cfg.batch, cfg.seq), 0, cfg.vocab)
    targets = jax.random.randint(jax.random.key(1), (cfg.batch, cfg.seq), 0, cfg.vocab)
    params = fp32_model.init(jax.random.key(2), tokens)

    def make(model: nn.Module) -> Callable:
        def loss(params, tokens, targets):
            logits = model.apply(params, tokens).astype(F32)  # a no-op in the float32 model
            return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
        return loss

    losses = {
        "float32": make(fp32_model),
        "hand bf16": make(bf16_model),
        "autocast": jamp.autocast_transform(make(fp32_model)),
        "cast_inputs": jamp.autocast_transform(make(fp32_model), jamp.Policy(cast_inputs=True)),
    }
    return losses, params, (tokens, targets)


def residuals(loss: Callable, params: Any, batch: tuple, jit: bool,
              heads: int = 0) -> dict[str, Any]:
    """Bytes (total, per dtype, and of attention-matrix shape ``[batch, heads, seq, seq]``) and
    count of the leaves of ``jax.vjp``'s backward function."""
    fn = jax.jit(loss) if jit else loss
    value, vjp_fn = jax.vjp(lambda p: fn(p, *batch), params)
    leaves = jax.tree.leaves(vjp_fn)
    by_dtype: collections.Counter = collections.Counter()
    for leaf in leaves:
        by_dtype[str(leaf.dtype)] += leaf.nbytes
    b, t = batch[0].shape
    grads = vjp_fn(jnp.ones_like(value))[0]
    return {"bytes": sum(by_dtype.values()), "by_dtype": dict(by_dtype), "count": len(leaves),
            "attention_bytes": sum(x.nbytes for x in leaves if x.shape == (b, heads, t, t)),
            "loss": float(value),
            "grad_dtypes": sorted({str(g.dtype) for g in jax.tree.leaves(grads)})}


def fp32_table_counts(fn: Callable, *args: Any) -> collections.Counter:
    """``(primitive, output dtype)`` counts of the ``Policy.fp32`` primitives in ``fn``'s program
    (floating outputs only), sub-jaxprs included."""
    table = jamp.Policy().fp32
    counts = count_eqns(jax.make_jaxpr(fn)(*args), primitive_and_dtype)
    return collections.Counter({k: n for k, n in counts.items()
                                if k[0] in table and k[1] in ("float32", "bfloat16", "float16")})


def fp32_table_report(losses: dict[str, Callable], params: Any, batch: tuple) -> dict[str, Any]:
    """Where the fp32-table primitives run, forward only and forward + backward."""
    out = {}
    for mode in ("hand bf16", "autocast", "cast_inputs"):
        fwd = fp32_table_counts(losses[mode], params, *batch)
        both = fp32_table_counts(jax.value_and_grad(losses[mode]), params, *batch)
        out[mode] = {
            "forward_f32": sum(n for (_, d), n in fwd.items() if d == "float32"),
            "forward_total": sum(fwd.values()),
            "forward_not_f32": sorted(f"{p} {d} x{n}" for (p, d), n in fwd.items()
                                      if d != "float32"),
            "all_f32": sum(n for (_, d), n in both.items() if d == "float32"),
            "all_total": sum(both.values()),
            "all_not_f32": sorted(f"{p} {d} x{n}" for (p, d), n in both.items() if d != "float32"),
        }
    return out


def mib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / 2 ** 20:.2f}"


def residual_report(cfg: argparse.Namespace) -> dict[str, Any]:
    losses, params, batch = lm_losses(cfg)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    print(f"\n### Residual bytes: LM {cfg.blocks} blocks, d={cfg.d}, {cfg.heads} heads, vocab "
          f"{cfg.vocab}, batch {cfg.batch} x {cfg.seq} tokens ({n_params / 1e6:.2f} M float32 "
          f"parameters = {mib(4 * n_params)} MiB)\n")
    out: dict[str, Any] = {}
    for jit in (False, True):
        out["jit" if jit else "eager"] = {m: residuals(f, params, batch, jit, cfg.heads)
                                          for m, f in losses.items()}
    out["fp32_table"] = fp32_table_report(losses, params, batch)
    ref_e, ref_j = out["eager"]["float32"]["bytes"], out["jit"]["float32"]["bytes"]
    rows = []
    for m in MODES:
        e, j = out["eager"][m], out["jit"][m]
        by_size = sorted(e["by_dtype"].items(), key=lambda kv: -kv[1])
        split = ", ".join(f"{d} {mib(b)}" for d, b in by_size if b >= 2 ** 14)
        rows.append([m, f"{mib(e['bytes'])}", f"**{e['bytes'] / ref_e:.2f}x**", split, e["count"],
                     f"{mib(j['bytes'])}", f"**{j['bytes'] / ref_j:.2f}x**",
                     f"{mib(e['attention_bytes'])} / {mib(j['attention_bytes'])}",
                     f"{e['loss']:.4f}", "/".join(e["grad_dtypes"])])
    print(markdown_table(["mode", "residual MiB (eager)", "vs float32", "by dtype (MiB, eager)",
                          "leaves", "residual MiB (jit)", "vs float32 (jit)",
                          "of which attention matrices MiB (eager / jit)", "loss", "grads"], rows))
    goals = {}
    for where in ("eager", "jit"):
        r = out[where]
        goals[where] = {
            "default_ratio": r["autocast"]["bytes"] / r["float32"]["bytes"],
            "cast_inputs_vs_hand": r["cast_inputs"]["bytes"] / r["hand bf16"]["bytes"],
        }
    out["goals"] = goals
    print()
    for where, g in goals.items():
        print(f"- {where}: autocast / float32 = {g['default_ratio']:.3f} (goal <= {GOAL_DEFAULT}: "
              f"{'met' if g['default_ratio'] <= GOAL_DEFAULT else 'NOT met'}); cast_inputs / hand "
              f"bf16 = {g['cast_inputs_vs_hand']:.3f} (goal <= 1: "
              f"{'met' if g['cast_inputs_vs_hand'] <= 1 else 'NOT met'})")
    print("\nfp32-table primitives (exp, log, rsqrt, reduce_sum, ...): equations with a float32"
          " output / all with a floating output, in the program of the loss (forward) and of"
          " `jax.value_and_grad` of it (forward + backward, as JAX differentiates the rewritten"
          " program)\n")
    print(markdown_table(
        ["mode", "forward", "forward, not float32", "forward + backward", "not float32"],
        [[m, f"{r['forward_f32']} / {r['forward_total']}", ", ".join(r["forward_not_f32"]) or "-",
          f"{r['all_f32']} / {r['all_total']}", ", ".join(r["all_not_f32"]) or "-"]
         for m, r in out["fp32_table"].items()]))
    return out


def sweep_report(cfg: argparse.Namespace) -> list[dict[str, Any]]:
    """The two goal ratios (and the float32-softmax attribution) over sequence lengths: the
    attention matrices grow as seq**2, everything else as seq."""
    rows, out = [], []
    for seq in cfg.sweep:
        losses, params, batch = lm_losses(argparse.Namespace(**{**vars(cfg), "seq": seq}))
        entry: dict[str, Any] = {"seq": seq}
        for where in ("eager", "jit"):
            r = {m: residuals(losses[m], params, batch, where == "jit", cfg.heads) for m in MODES}
            rest = {m: r[m]["bytes"] - r[m]["attention_bytes"] for m in MODES}
            hand = r["hand bf16"]
            entry[where] = {"default_ratio": r["autocast"]["bytes"] / r["float32"]["bytes"],
                            "cast_inputs_vs_hand": r["cast_inputs"]["bytes"] / hand["bytes"],
                            "cast_inputs_vs_hand_rest": rest["cast_inputs"] / rest["hand bf16"],
                            "attention_share_hand": hand["attention_bytes"] / hand["bytes"],
                            "float32_mib": r["float32"]["bytes"] / 2 ** 20}
        out.append(entry)
        e, j = entry["eager"], entry["jit"]
        mark = lambda r, goal: f"**{r:.3f}**" + ("" if r <= goal else " ✗")
        rows.append([seq, f"{e['float32_mib']:.1f}", mark(e["default_ratio"], GOAL_DEFAULT),
                     mark(j["default_ratio"], GOAL_DEFAULT), mark(e["cast_inputs_vs_hand"], 1.0),
                     mark(j["cast_inputs_vs_hand"], 1.0), f"{100 * j['attention_share_hand']:.0f}%",
                     f"{e['cast_inputs_vs_hand_rest']:.3f} / {j['cast_inputs_vs_hand_rest']:.3f}"])
    print(f"\n### Over sequence lengths (LM {cfg.blocks} blocks, d={cfg.d}, {cfg.heads} heads, "
          f"batch {cfg.batch}; ✗ = goal not met)\n")
    print(markdown_table(["seq", "float32 MiB (eager)", "autocast / float32 (eager)",
                          "autocast / float32 (jit)", "cast_inputs / hand bf16 (eager)",
                          "cast_inputs / hand bf16 (jit)", "attention matrices in hand bf16 (jit)",
                          "cast_inputs / hand bf16 without the attention matrices, eager / jit"],
                         rows))
    return out


# --- the demo CNN's train step --------------------------------------------------------------------

def cnn_report(cfg: argparse.Namespace) -> dict[str, Any]:
    import digits  # examples/digits.py

    data = digits.load_data()
    n = digits.BATCH_SIZE
    x, y = jnp.asarray(data.x_train[:n]), jnp.asarray(data.y_train[:n])
    cast_inputs = jamp.Policy(cast_inputs=True)
    setups = {  # name -> (model, mode for the loss scale / optimizer, autocast policy)
        "float32": (digits.CNN(), "float32", None),
        "hand bf16": (digits.CNN(dtype=BF16), "float32", None),
        "autocast": (digits.CNN(), "bfloat16", None),
        "cast_inputs": (digits.CNN(), "bfloat16", cast_inputs),
        "float16 + loss scale": (digits.CNN(), "float16", None),
    }
    steps, info = {}, {}
    for name, (model, mode, policy) in setups.items():
        step, tx = digits.make_train_step(model, mode, policy=policy)
        state = digits.init_state(model, tx, mode, 0, data.x_train)
        start = time.perf_counter()
        compiled = jax.jit(step).lower(state, x, y).compile()
        info[name] = {"compile_s": time.perf_counter() - start, "temp": digits.temp_bytes(compiled)}
        steps[name] = [compiled, state]
    # Interleaved rounds: each round runs `inner` steps of every mode, the order rotating.
    times: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for r in range(cfg.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            compiled, state = steps[name]
            start = time.perf_counter()
            for _ in range(cfg.inner):
                state, metrics = compiled(state, x, y)
            jax.block_until_ready((state, metrics))
            times[name].append((time.perf_counter() - start) / cfg.inner)
            steps[name][1] = state
    ref = statistics.median(times["float32"])
    rows = []
    for name in names:
        t = statistics.median(times[name])
        info[name]["step_ms"] = 1e3 * t
        rows.append([name, mib(info[name]["temp"]), f"{1e3 * t:.2f}", f"{t / ref:.2f}x",
                     f"{info[name]['compile_s']:.1f}"])
    print(f"\n### Demo CNN train step (examples/digits.py, batch {n}; median of {cfg.rounds} "
          f"interleaved rounds of {cfg.inner} steps)\n")
    print(markdown_table(["mode", "compiled temp MiB", "step ms", "vs float32", "compile s"], rows))
    return info


def main(argv: Any = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller model, fewer rounds")
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=15, help="CNN timing rounds")
    parser.add_argument("--inner", type=int, default=20, help="CNN steps per timing sample")
    parser.add_argument("--sweep", type=lambda v: [int(x) for x in v.split(",") if x],
                        default=[32, 64, 128, 256],
                        help="sequence lengths of the sweep ('' = none)")
    parser.add_argument("--skip-cnn", action="store_true")
    cfg = parser.parse_args(argv)
    if cfg.quick:
        cfg.blocks, cfg.seq, cfg.rounds, cfg.inner, cfg.sweep = 2, 64, 5, 10, [32, 128]
    print(f"## Activation memory\n\n{environment()}")
    results = {"residuals": residual_report(cfg)}
    if cfg.sweep:
        results["sweep"] = sweep_report(cfg)
    if not cfg.skip_cnn:
        results["cnn"] = cnn_report(cfg)
    return results


if __name__ == "__main__":
    main()
