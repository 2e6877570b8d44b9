"""float8 autocast (issue 16): accuracy against bfloat16, and GPU step time side by side.

    # accuracy: the digits CNN and the tiny GPT, bfloat16 vs float8 autocast (any backend)
    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/float8.py accuracy [--seeds 0 1]
    # step time of a larger GPT on a GPU: float32, bf16 autocast, hand-written bf16 Flax,
    # float8 autocast, Flax fp8_ops layers (never run this on a CPU: 8-bit is emulated there)
    python benchmarks/float8.py step [--d 2048 --layers 8 --seq 1024 --batch 8]

``step`` also reads each variant's optimized HLO and counts the GEMMs XLA emitted by kind
(cuBLASLt float8 GEMMs are ``__cublas$lt$matmul$f8`` custom calls), so the table shows whether
the float8 pattern was recognised on that device.
"""
from __future__ import annotations

import argparse
import collections
import functools
import math
import os
import re
import statistics
import sys
import time
from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
import jamp  # noqa: E402
from benchmarks.common import environment, markdown_table  # noqa: E402


# --- accuracy ------------------------------------------------------------------------------------

def accuracy(seeds: list[int], digits_epochs: Optional[int], gpt_steps: Optional[int]) -> None:
    import digits
    import tiny_gpt
    rows = []
    for seed in seeds:
        data = digits.load_data()
        runs = {m: digits.train(m, data, epochs=digits_epochs or digits.EPOCHS, seed=seed,
                                progress=False) for m in ("bfloat16", "float8")}
        rows.append(["digits CNN (test accuracy %)", seed, *_accuracy_cells(runs)])
        runs = {m: tiny_gpt.train(m, steps=gpt_steps or tiny_gpt.STEPS, seed=seed, progress=False)
                for m in ("bfloat16", "float8")}
        rows.append(["tiny GPT (token accuracy %)", seed, *_accuracy_cells(runs)])
        print(markdown_table(["model", "seed", "bfloat16", "float8", "float8 - bfloat16",
                              "final loss bf16 / fp8"], rows[-2:]), flush=True)
    print()
    print(markdown_table(["model", "seed", "bfloat16", "float8", "float8 - bfloat16",
                          "final loss bf16 / fp8"], rows))


def _accuracy_cells(runs: dict) -> list[str]:
    bf16, fp8 = runs["bfloat16"], runs["float8"]
    return [f"{bf16['accuracy']:.2f}", f"{fp8['accuracy']:.2f}",
            f"**{fp8['accuracy'] - bf16['accuracy']:+.2f}**",
            f"{bf16['final_loss']:.4f} / {fp8['final_loss']:.4f}"]


# --- a GPT whose layers take a dtype and a dot_general class (hand-written bf16, Flax fp8) -------

class Block(nn.Module):
    heads: int
    dtype: Any = jnp.float32
    dot_general_cls: Any = None

    def dense(self, features: int, name: str) -> nn.Dense:
        extra = {} if self.dot_general_cls is None else {"dot_general_cls": self.dot_general_cls}
        return nn.Dense(features, dtype=self.dtype, name=name, **extra)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        batch, seq, d = x.shape
        head_dim = d // self.heads
        h = nn.LayerNorm(dtype=self.dtype)(x)
        qkv = self.dense(3 * d, "qkv")(h).reshape(batch, seq, 3, self.heads, head_dim)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(head_dim)
        causal = jnp.tril(jnp.ones((seq, seq), bool))
        scores = jnp.where(causal, scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
        weights = jax.nn.softmax(scores, axis=-1).astype(self.dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, seq, d)
        x = x + self.dense(d, "out")(out)
        h = self.dense(4 * d, "up")(nn.LayerNorm(dtype=self.dtype)(x))
        return x + self.dense(d, "down")(nn.gelu(h))


class GPT(nn.Module):
    vocab: int
    d: int
    heads: int
    layers: int
    dtype: Any = jnp.float32
    dot_general_cls: Any = None

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = nn.Embed(self.vocab, self.d, dtype=self.dtype)(tokens)
        x = x + nn.Embed(tokens.shape[1], self.d, dtype=self.dtype)(jnp.arange(tokens.shape[1]))
        for i in range(self.layers):
            x = nn.remat(Block)(self.heads, self.dtype, self.dot_general_cls, name=f"block{i}")(x)
        x = nn.LayerNorm(dtype=self.dtype)(x)
        return nn.Dense(self.vocab, dtype=self.dtype, name="head")(x)


def _flax_fp8_cls() -> Any:
    return getattr(nn, "Fp8DirectDotGeneralOp", None) or nn.Fp8DotGeneralOp


VARIANTS: dict[str, dict[str, Any]] = {
    "float32": {"dtype": jnp.float32, "policy": None},
    "bf16 autocast": {"dtype": jnp.float32, "policy": jamp.Policy(jnp.bfloat16)},
    "bf16 hand-written Flax": {"dtype": jnp.bfloat16, "policy": None},
    "float8 autocast": {"dtype": jnp.float32, "policy": jamp.Policy(jnp.float8_e4m3fn)},
    "Flax fp8_ops layers": {"dtype": jnp.bfloat16, "policy": None, "fp8_ops": True},
}
OWG = "_overwrite_with_gradient"  # flax.linen.fp8_ops.OVERWRITE_WITH_GRADIENT


def make_step(model: GPT, policy: Optional[jamp.Policy], tx: Any) -> Callable:
    """One training step; Flax's fp8 layers keep their scales in the ``_overwrite_with_gradient``
    collection, whose "gradients" are the new values (Flax's documented training loop)."""

    def loss_fn(variables, tokens):
        logits = model.apply(variables, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), tokens[:, 1:]).mean()

    if policy is not None:
        loss_fn = jamp.autocast_transform(loss_fn, policy)

    def step(variables, opt_state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(variables, tokens)
        updates, opt_state = tx.update(grads["params"], opt_state, variables["params"])
        new = dict(variables, params=optax.apply_updates(variables["params"], updates))
        if OWG in variables:
            new[OWG] = grads[OWG]
        return new, opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))


GEMM_KINDS = {
    "cuBLASLt f8": r"__cublas\$lt\$matmul\$f8",
    "cuBLASLt": r"__cublas\$lt\$matmul\"",
    "cuBLAS": r"__cublas\$gemm",
    "triton": r"__triton_gemm",
}


def gemm_counts(hlo: str) -> dict[str, int]:
    return {kind: len(re.findall(pattern, hlo)) for kind, pattern in GEMM_KINDS.items()}


def step_time(args: argparse.Namespace) -> None:
    print(environment())
    print(f"device: {jax.devices()[0].device_kind}; GPT d={args.d} heads={args.heads} "
          f"layers={args.layers} seq={args.seq} batch={args.batch} vocab={args.vocab}")
    tokens = jax.random.randint(jax.random.key(1), (args.batch, args.seq + 1), 0, args.vocab)
    tx = optax.adam(1e-4)
    compiled, states, info = {}, {}, {}
    for name, cfg in VARIANTS.items():
        if args.only and name not in args.only:
            continue
        model = GPT(args.vocab, args.d, args.heads, args.layers, cfg["dtype"],
                    _flax_fp8_cls() if cfg.get("fp8_ops") else None)
        variables = dict(model.init(jax.random.key(0), tokens[:1, :-1]))
        opt_state = tx.init(variables["params"])
        step = make_step(model, cfg["policy"], tx)
        t0 = time.perf_counter()
        lowered = step.lower(variables, opt_state, tokens)
        exe = lowered.compile()
        info[name] = {"compile_s": time.perf_counter() - t0, **gemm_counts(exe.as_text())}
        compiled[name], states[name] = exe, (variables, opt_state)
        print(f"compiled {name}: {info[name]}", flush=True)
    params = sum(x.size for x in jax.tree.leaves(states["float32"][0]["params"])) \
        if "float32" in states else None
    flops = 6 * params * args.batch * args.seq if params else None  # fwd + bwd matmuls
    times: dict[str, list[float]] = collections.defaultdict(list)
    for name, exe in compiled.items():  # warm up
        for _ in range(3):
            v, o, loss = exe(*states[name], tokens)
            states[name] = (v, o)
        loss.block_until_ready()
        info[name]["loss"] = float(loss)
    for _ in range(args.rounds):  # interleaved rounds: drift hits every variant alike
        for name, exe in compiled.items():
            t0 = time.perf_counter()
            for _ in range(args.steps):
                v, o, loss = exe(*states[name], tokens)
                states[name] = (v, o)
            loss.block_until_ready()
            times[name].append((time.perf_counter() - t0) / args.steps)
    rows = []
    base = statistics.median(times["bf16 autocast"]) if "bf16 autocast" in times else None
    for name in compiled:
        ms = 1e3 * statistics.median(times[name])
        rows.append([name, f"{ms:.1f}",
                     f"{flops / (ms / 1e3) / 1e12:.0f}" if flops else "n/a",
                     f"{base * 1e3 / ms:.2f}x" if base else "n/a",
                     f"{info[name]['compile_s']:.0f}", info[name]["cuBLASLt f8"],
                     info[name]["cuBLASLt"] + info[name]["cuBLAS"], info[name]["triton"],
                     f"{info[name]['loss']:.3f}"])
    print(f"\nparameters: {params:,}; model FLOPs per step (6 N T): {flops:.3g}" if params else "")
    print(markdown_table(["variant", "step ms (median)", "model TFLOP/s", "speed vs bf16 autocast",
                          "compile s", "f8 GEMMs", "other cuBLAS GEMMs", "triton GEMMs",
                          "loss after warm-up"], rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    acc = sub.add_parser("accuracy")
    acc.add_argument("--seeds", type=int, nargs="+", default=[0])
    acc.add_argument("--digits-epochs", type=int, default=None)
    acc.add_argument("--gpt-steps", type=int, default=None)
    step = sub.add_parser("step")
    step.add_argument("--d", type=int, default=2048)
    step.add_argument("--heads", type=int, default=16)
    step.add_argument("--layers", type=int, default=8)
    step.add_argument("--seq", type=int, default=1024)
    step.add_argument("--batch", type=int, default=8)
    step.add_argument("--vocab", type=int, default=32768)
    step.add_argument("--rounds", type=int, default=5)
    step.add_argument("--steps", type=int, default=5, help="steps per round and variant")
    step.add_argument("--only", nargs="*", default=None, help="variant names to run")
    args = parser.parse_args()
    if args.command == "accuracy":
        print(environment())
        accuracy(args.seeds, args.digits_epochs, args.gpt_steps)
    else:
        step_time(args)


if __name__ == "__main__":
    main()
