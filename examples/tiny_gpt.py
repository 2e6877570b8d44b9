"""A tiny decoder-only transformer learns to sort digits: float32 against bfloat16 autocast.

    JAX_PLATFORMS=cpu .venv/bin/python examples/tiny_gpt.py [--steps N] [--seed S] [--plot out.png]

Task (generated with numpy, no download): a sequence of ``LENGTH`` random digits, a separator,
then the same digits sorted, e.g. ``3 1 4 1 5 9 2 6 | 1 1 2 3 4 5 6 9``. The model sees the whole
sequence with a causal mask and is trained to predict the next token; the loss and the reported
accuracy cover only the sorted half (the first half is random, nothing to learn). Accuracy is
teacher-forced token accuracy on held-out sequences, plus the share of sequences sorted entirely
right.

The model is a GPT in miniature (Flax linen): token and position embeddings, pre-LayerNorm blocks
of causal multi-head self-attention and a gelu MLP, a final LayerNorm and a linear head. Each block
is wrapped in ``nn.remat`` (``jax.checkpoint``): its activations are recomputed in the backward
pass instead of stored, and under autocast the recomputation runs in bfloat16 like the forward.

Runs: **float32**; **bfloat16** with ``jamp.autocast_transform`` (matmuls in bfloat16, softmax,
LayerNorm statistics and the loss in float32, float32 gradients for the float32 parameters); and
**float16** with ``jamp.DynamicLossScale`` (``--modes float32,bfloat16`` to leave it out). The
optimizer (optax adam) stays outside autocast, in float32. Prints the same table as
``digits.py`` and writes a PNG of the loss curves.

bfloat16/float16 are emulated on this project's CPUs, so those runs are slower here.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import textwrap
import time
from typing import Any, Callable, NamedTuple, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jamp  # noqa: E402
from digits import (COMPUTE_DTYPES, LOSS_SCALE_PERIOD, MODES, _progress,  # noqa: E402
                    describe_loss_scale, format_table, make_loss_scale, matmul_dtypes,
                    memory_note, plot_losses, temp_bytes)

VOCAB = 10           # digits 0..9
SEP = VOCAB          # separator token
LENGTH = 8           # digits to sort; a sequence is 2 * LENGTH + 1 tokens
STEPS = 400
QUICK_STEPS = 150
BATCH_SIZE = 64
LEARNING_RATE = 3e-3
TEST_SEQUENCES = 512
MAX_ACCURACY_GAP = 2.0  # token-accuracy points between float32 and the mixed-precision runs


# --- data -----------------------------------------------------------------------------------------

def make_sequences(rng: np.random.Generator, n: int, length: int = LENGTH) -> np.ndarray:
    """``[n, 2 * length + 1]`` int32: digits, separator, the digits sorted."""
    digits = rng.integers(0, VOCAB, size=(n, length))
    sep = np.full((n, 1), SEP)
    return np.concatenate([digits, sep, np.sort(digits, axis=1)], axis=1).astype(np.int32)


# --- model ----------------------------------------------------------------------------------------

class CausalSelfAttention(nn.Module):
    heads: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        batch, seq, d = x.shape
        head_dim = d // self.heads
        qkv = nn.Dense(3 * d, name="qkv")(x).reshape(batch, seq, 3, self.heads, head_dim)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(head_dim)
        causal = jnp.tril(jnp.ones((seq, seq), bool))
        # finfo(float32).min: jamp casts constants saturating, so a bfloat16 mask stays finite.
        scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
        weights = jax.nn.softmax(scores, axis=-1)     # float32 under autocast (exp is fp32-table)
        out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, seq, d)
        return nn.Dense(d, name="out")(out)


class Block(nn.Module):
    heads: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        d = x.shape[-1]
        x = x + CausalSelfAttention(self.heads)(nn.LayerNorm()(x))
        h = nn.Dense(4 * d)(nn.LayerNorm()(x))
        return x + nn.Dense(d)(nn.gelu(h))


class TinyGPT(nn.Module):
    vocab: int = VOCAB + 1
    max_len: int = 2 * LENGTH
    d: int = 64
    heads: int = 4
    blocks: int = 2

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = nn.Embed(self.vocab, self.d, name="tokens")(tokens)
        x = x + nn.Embed(self.max_len, self.d, name="positions")(jnp.arange(tokens.shape[1]))
        # Recompute each block in the backward pass rather than storing its activations.
        RematBlock = nn.remat(Block)
        for i in range(self.blocks):
            x = RematBlock(self.heads, name=f"block{i}")(x)
        return nn.Dense(self.vocab, name="head")(nn.LayerNorm()(x))


# --- training -----------------------------------------------------------------------------------

def split(seqs: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Inputs are all tokens but the last; targets are the next tokens of the sorted half."""
    return seqs[:, :-1], seqs[:, LENGTH + 1:]


def make_loss_fn(model: nn.Module, mode: str) -> Callable:
    def loss_fn(params, seqs):
        inputs, targets = split(seqs)
        logits = model.apply({"params": params}, inputs)[:, LENGTH:]  # after the separator
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    if COMPUTE_DTYPES[mode] is None:
        return loss_fn
    return jamp.autocast_transform(loss_fn, COMPUTE_DTYPES[mode])


class TrainState(NamedTuple):
    params: Any
    opt_state: Any
    loss_scale: Any


def make_train_step(model: nn.Module, mode: str, learning_rate: float,
                    steps: int) -> tuple[Callable, optax.GradientTransformation]:
    grad_fn = jamp.scaled_value_and_grad(make_loss_fn(model, mode))
    schedule = optax.warmup_cosine_decay_schedule(0.0, learning_rate, steps // 10, steps,
                                                  learning_rate / 10)
    tx = optax.adam(schedule)
    if mode == "float16":
        tx = optax.apply_if_finite(tx, max_consecutive_errors=20)

    def train_step(state: TrainState, seqs: jax.Array):
        loss, grads, loss_scale, finite = grad_fn(state.loss_scale, state.params, seqs)
        # Optimizer outside autocast, in float32: Adam's b2=0.999 is 1.0 in bfloat16.
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = (loss, finite, state.loss_scale.loss_scale)
        return TrainState(params, opt_state, loss_scale), metrics

    return train_step, tx


def make_eval(model: nn.Module, mode: str) -> Callable:
    apply = model.apply
    if COMPUTE_DTYPES[mode] is not None:
        apply = jamp.autocast_transform(apply, COMPUTE_DTYPES[mode])

    @jax.jit
    def evaluate(params, seqs):
        inputs, targets = split(seqs)
        predictions = jnp.argmax(apply({"params": params}, inputs)[:, LENGTH:], axis=-1)
        correct = predictions == targets
        return 100.0 * jnp.mean(correct), 100.0 * jnp.mean(jnp.all(correct, axis=1))

    return evaluate


def train(mode: str, *, steps: int, seed: int, batch_size: int = BATCH_SIZE,
          learning_rate: float = LEARNING_RATE, progress: bool = True) -> dict:
    model = TinyGPT()
    rng = np.random.default_rng(seed)  # same data stream and test set in every mode
    train_seqs = jnp.asarray(make_sequences(rng, steps * batch_size).reshape(steps, batch_size, -1))
    test_seqs = jnp.asarray(make_sequences(np.random.default_rng(10_000 + seed), TEST_SEQUENCES))

    train_step, tx = make_train_step(model, mode, learning_rate, steps)
    params = model.init(jax.random.key(seed), train_seqs[0, :, :-1])["params"]
    loss_scale = make_loss_scale(mode)
    state = TrainState(params, tx.init(params), loss_scale)

    start = time.perf_counter()
    compiled = jax.jit(train_step).lower(state, train_seqs[0]).compile()
    compile_seconds = time.perf_counter() - start

    losses, scales, finite_flags, step_seconds = [], [], [], []
    bar = _progress(total=steps, desc=f"{mode:>8}", disable=not progress)
    for i in range(steps):
        t0 = time.perf_counter()
        state, (loss, finite, scale) = compiled(state, train_seqs[i])
        loss = float(loss)
        step_seconds.append(time.perf_counter() - t0)
        losses.append(loss)
        finite_flags.append(bool(finite))
        scales.append(float(scale))
        if i % 10 == 0 or i == steps - 1:
            bar.set_postfix(loss=f"{loss:.3f}")
        bar.update(1)
    bar.close()

    token_acc, seq_acc = make_eval(model, mode)(state.params, test_seqs)
    result = {
        "mode": mode,
        "accuracy": float(token_acc),
        "sequence_accuracy": float(seq_acc),
        "final_loss": float(np.mean(losses[-max(1, steps // 10):])),  # mean of the last 10%
        "losses": losses,
        "median_step_ms": 1e3 * statistics.median(step_seconds[1:] or step_seconds),
        "compile_seconds": compile_seconds,
        "temp_bytes": temp_bytes(compiled),
        "matmul_dtypes": matmul_dtypes(compiled),
        "steps": steps,
        "param_dtypes": sorted({str(p.dtype) for p in jax.tree.leaves(state.params)}),
    }
    if mode == "float16":
        final_scale = float(state.loss_scale.loss_scale)
        history = scales + [final_scale]
        result["loss_scale"] = {
            "history": history, "min": min(history), "max": max(history), "final": final_scale,
            "skipped_steps": finite_flags.count(False),
            "skipped_at": [i for i, f in enumerate(finite_flags) if not f],
            "optax_notfinite": int(state.opt_state.total_notfinite),
            "period": LOSS_SCALE_PERIOD,
        }
    return result


# --- entry point ----------------------------------------------------------------------------------

def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=None,
                        help=f"steps per run (default {STEPS}, {QUICK_STEPS} with --quick)")
    parser.add_argument("--quick", action="store_true", help="a short run (for tests)")
    parser.add_argument("--seed", type=int, default=0, help="data, initialisation")
    parser.add_argument("--lr", type=float, default=LEARNING_RATE, help="peak learning rate")
    parser.add_argument("--batch-size", type=int, default=BATCH_SIZE)
    parser.add_argument("--modes", default=",".join(MODES),
                        help="comma-separated subset of " + ", ".join(MODES))
    parser.add_argument("--plot", default="tiny_gpt_losses.png", help="PNG of the loss curves")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> dict:
    """Run the comparison; returns ``{"runs": {mode: result}, "accuracy_gap", "agree", ...}``."""
    args = parse_args(argv)
    steps = args.steps or (QUICK_STEPS if args.quick else STEPS)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(modes) - set(COMPUTE_DTYPES)
    if unknown or "float32" not in modes:
        raise SystemExit(f"--modes: expected float32 and a subset of {tuple(COMPUTE_DTYPES)}, got {modes}")
    print(f"tiny GPT: sort {LENGTH} digits; {steps} steps of {args.batch_size} sequences, adam "
          f"peak lr {args.lr}, seed {args.seed}; jax {jax.__version__} on {jax.default_backend()}")
    if "float16" in modes:
        print(textwrap.fill(describe_loss_scale(LOSS_SCALE_PERIOD, steps), 100))
    start = time.perf_counter()
    runs = {mode: train(mode, steps=steps, seed=args.seed, batch_size=args.batch_size,
                        learning_rate=args.lr, progress=not args.no_progress) for mode in modes}
    reference = runs["float32"]["accuracy"]
    gap = max(abs(r["accuracy"] - reference) for r in runs.values())
    results = {"runs": runs, "accuracy_gap": gap, "agree": gap <= MAX_ACCURACY_GAP,
               "steps": steps, "seed": args.seed, "train_seconds": time.perf_counter() - start}
    print()
    print(format_table(runs, accuracy_label="token acc %"))
    note = memory_note(runs)
    if note:
        print(textwrap.fill(note, 100))
    print("sequences sorted entirely right: " + ", ".join(
        f"{m} {r['sequence_accuracy']:.1f}%" for m, r in runs.items()))
    print(f"held-out token accuracy within {gap:.2f} points of float32 "
          f"({'OK' if results['agree'] else 'FAIL'}: at most {MAX_ACCURACY_GAP}); "
          f"{results['train_seconds']:.0f} s for the {len(runs)} runs, compiles included")
    if "float16" in runs:
        ls = runs["float16"]["loss_scale"]
        print(f"float16 loss scale: min {ls['min']:g}, max {ls['max']:g}, final {ls['final']:g}; "
              f"{ls['skipped_steps']} skipped steps; optax.apply_if_finite counted "
              f"{ls['optax_notfinite']}")
    if args.plot:
        results["plot"] = plot_losses(runs, args.plot,
                                      title="tiny GPT (sort digits): training loss")
        print(f"loss curves: {os.path.abspath(args.plot)}")
    return results


if __name__ == "__main__":
    sys.exit(0 if main()["agree"] else 1)
