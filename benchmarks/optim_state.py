"""Training state in fewer bytes (jamp.optim, issue 30): bytes, accuracy and cost of each recipe.

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/optim_state.py [--gpt-steps N] [--digits-epochs E]
        [--zoo-steps N] [--seeds 0,1,2] [--cost-params N] [--rounds R] [--cost-calls C]
        [--skip accuracy,cost]

Recipes (AdamW everywhere; "bf16 compute" = the loss under ``jamp.autocast_transform``):

  float32                      f32 params, f32 AdamW state, float32 compute
  bf16 compute                 f32 params and state, bf16 compute
  bf16 moments                 + ``jamp.optim.state_dtype(adamw)``
  bf16 params, round-to-nearest  bf16 params, plain optax AdamW (state bf16, rounded to nearest)
  bf16 params + masters        ``master_weights(state_dtype(adamw))`` on bf16 params
  bf16 params + stochastic     ``stochastic_rounding(state_dtype(adamw))`` on bf16 params
  bf16 params + Kahan          ``compensated(state_dtype(adamw))`` on bf16 params

1. Memory: bytes of persistent training state (parameters + optimizer state) per parameter,
   counted from the pytrees and from ``memory_analysis()`` of the jitted train step (its argument
   bytes less the batch's). Goals (issue 30): float32 12; bf16 params + bf16 state with stochastic
   rounding <= 6.1; master weights + bf16 moments <= 10.1.
2. Accuracy, one jitted ``lax.scan`` over all steps per run, ``--seeds`` (3 by default): the tiny
   GPT of ``examples/tiny_gpt.py`` (final loss: mean of the last 10% of steps; held-out token
   accuracy), the digits CNN of ``examples/digits.py`` (test accuracy) and the zoo's Flax lm1b
   ``TransformerLM`` (``tests/zoo/models.py``, the same configuration, dropout off) trained on the
   tiny GPT's sort-digits sequences (``--zoo-steps``; a workload given 0 steps or epochs is left
   out). Goals: stochastic rounding within 1% of float32's final loss (0.5 points of its digits
   accuracy), master weights within 0.5%.
3. Cost: the jitted optimizer update alone (``tx.update`` + ``optax.apply_updates``, float32
   arithmetic inside), with stochastic rounding against the same update with nearest rounding,
   samples (``--cost-calls`` updates in a row each) interleaved, median of per-round ratios, gc
   on. Goal <= 1.3x (CPU).
4. With ``--step-config gpt-539m`` (a GPU's figures, issue 35): the train step of
   ``benchmarks/float8.py``'s GPT under each bf16-compute recipe, compiled then timed in
   interleaved rounds, with its state's bytes and XLA's temporary buffer size; the cost (3.) is
   then measured on that GPT's parameters. ``--step-config tiny`` checks the script on a CPU:

       python benchmarks/optim_state.py --skip memory,accuracy --step-config gpt-539m --rounds 9
"""
from __future__ import annotations

import argparse
import os
import statistics
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
from common import environment, markdown_table, paired_ratio, timed  # noqa: E402

BF16 = jnp.bfloat16
ZOO_STEPS = 300
optim = jamp.optim


def recipes(lr: Any) -> dict[str, tuple[bool, bool, optax.GradientTransformation]]:
    """name -> (bf16 parameters, bf16 compute, optimizer)."""
    adamw = optax.adamw(lr, weight_decay=1e-4)
    return {
        "float32": (False, False, adamw),
        "bf16 compute": (False, True, adamw),
        "bf16 moments": (False, True, optim.state_dtype(adamw)),
        "bf16 params, round-to-nearest": (True, True, adamw),
        "bf16 params + masters": (True, True, optim.master_weights(optim.state_dtype(adamw))),
        "bf16 params + stochastic": (True, True,
                                     optim.stochastic_rounding(optim.state_dtype(adamw))),
        "bf16 params + Kahan": (True, True, optim.compensated(optim.state_dtype(adamw))),
    }


def nbytes(tree: Any) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def to_bf16(tree: Any) -> Any:
    return jax.tree.map(lambda x: x.astype(BF16) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                        tree)


# --- workloads ------------------------------------------------------------------------------------

def gpt_workload(steps: int) -> dict:
    import tiny_gpt as g

    model = g.TinyGPT()

    def data(seed):
        rng = np.random.default_rng(seed)
        train = jnp.asarray(g.make_sequences(rng, steps * g.BATCH_SIZE).reshape(
            steps, g.BATCH_SIZE, -1))
        test = jnp.asarray(g.make_sequences(np.random.default_rng(10_000 + seed),
                                            g.TEST_SEQUENCES))
        return train, test

    def loss_fn(params, seqs):
        inputs, targets = g.split(seqs)
        logits = model.apply({"params": params}, inputs)[:, g.LENGTH:]
        return optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), targets).mean()

    def init(seed, train):
        return model.init(jax.random.key(seed), train[0, :, :-1])["params"]

    def evaluate(params, test):
        inputs, targets = g.split(test)
        logits = jamp.autocast_transform(model.apply)({"params": params}, inputs)[:, g.LENGTH:]
        return 100.0 * jnp.mean(jnp.argmax(logits, -1) == targets)

    lr = optax.warmup_cosine_decay_schedule(0.0, g.LEARNING_RATE, steps // 10, steps,
                                            g.LEARNING_RATE / 10)
    return dict(name="tiny GPT", data=data, loss=loss_fn, init=init, evaluate=evaluate, lr=lr,
                stateful=False, length=f"{steps} steps")


def digits_workload(epochs: int) -> dict:
    import digits as d

    model = d.CNN()
    raw = d.load_data()

    def data(seed):
        order = d.batch_order(len(raw.x_train), d.BATCH_SIZE, epochs, seed)
        return ((jnp.asarray(raw.x_train[order]), jnp.asarray(raw.y_train[order])),
                (jnp.asarray(raw.x_test), jnp.asarray(raw.y_test)))

    def loss_fn(params, batch_stats, batch):
        x, y = batch
        logits, updates = model.apply({"params": params, "batch_stats": batch_stats}, x, True,
                                      mutable=["batch_stats"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y)
        return loss.mean(), updates["batch_stats"]

    def init(seed, train):
        variables = model.init(jax.random.key(seed), train[0][0], False)
        return variables["params"], variables["batch_stats"]

    def evaluate(params, batch_stats, test):
        x, y = test
        logits = jamp.autocast_transform(model.apply)(
            {"params": params, "batch_stats": batch_stats}, x, False)
        return 100.0 * jnp.mean(jnp.argmax(logits, -1) == y)

    return dict(name="digits CNN", data=data, loss=loss_fn, init=init, evaluate=evaluate,
                lr=d.LEARNING_RATE, stateful=True, length=f"{epochs} epochs")


def zoo_lm1b_workload(steps: int) -> dict:
    """The zoo's ``flax_lm1b`` TransformerLM (Flax's examples/lm1b model, 2 layers, width 32, the
    configuration of ``tests/zoo/models.py``) learning the tiny GPT's sort-digits task. Dropout is
    off so that the recipes differ only in precision. Token 0 is the model's padding, so digits
    are shifted to 1..10 and the separator is 11; the model shifts its inputs right itself, so
    the logits at position i predict token i."""
    import tiny_gpt as g

    from tests.zoo.flax_examples import lm1b_models as m

    config = m.TransformerConfig(vocab_size=64, output_vocab_size=64, emb_dim=32, num_heads=4,
                                 num_layers=2, qkv_dim=32, mlp_dim=64, max_len=32,
                                 dropout_rate=0.1, attention_dropout_rate=0.1, deterministic=True)
    model = m.TransformerLM(config)

    def data(seed):
        rng = np.random.default_rng(20_000 + seed)
        train = g.make_sequences(rng, steps * g.BATCH_SIZE).reshape(steps, g.BATCH_SIZE, -1)
        test = g.make_sequences(np.random.default_rng(30_000 + seed), g.TEST_SEQUENCES)
        return jnp.asarray(train + 1), jnp.asarray(test + 1)

    def loss_fn(params, seqs):
        logits = model.apply({"params": params}, seqs)[:, g.LENGTH + 1:]
        return optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), seqs[:, g.LENGTH + 1:]).mean()

    def init(seed, train):
        return model.init(jax.random.key(seed), train[0])["params"]

    def evaluate(params, test):
        logits = jamp.autocast_transform(model.apply)({"params": params}, test)[:, g.LENGTH + 1:]
        return 100.0 * jnp.mean(jnp.argmax(logits, -1) == test[:, g.LENGTH + 1:])

    lr = optax.warmup_cosine_decay_schedule(0.0, g.LEARNING_RATE, steps // 10, steps,
                                            g.LEARNING_RATE / 10)
    return dict(name="zoo lm1b Transformer", data=data, loss=loss_fn, init=init,
                evaluate=evaluate, lr=lr, stateful=False, length=f"{steps} steps")


def make_run(work: dict, recipe: tuple) -> Callable[[int], tuple[float, float]]:
    """``run(seed) -> (final loss: mean of the last 10% of steps, held-out accuracy %)``; the
    whole training is one jitted ``lax.scan``, compiled once for all seeds."""
    bf16_params, bf16_compute, tx = recipe
    loss = work["loss"]
    if bf16_compute:
        loss = jamp.autocast_transform(loss)
    if work["stateful"]:
        grad_fn = jax.value_and_grad(loss, has_aux=True)
    else:
        grad_fn = jax.value_and_grad(lambda p, _, b: loss(p, b))

    def step(carry, batch):
        p, s, e = carry
        if work["stateful"]:
            (value, e), grads = grad_fn(p, e, batch)
        else:
            value, grads = grad_fn(p, e, batch)
        updates, s = tx.update(grads, s, p)
        return (optax.apply_updates(p, updates), s, e), value

    @jax.jit
    def train_all(p, s, e, batches):
        return jax.lax.scan(step, (p, s, e), batches)

    evaluate = jax.jit(work["evaluate"])

    def run(seed: int) -> tuple[float, float]:
        train, test = work["data"](seed)
        if work["stateful"]:
            params, extra = work["init"](seed, train)
        else:
            params, extra = work["init"](seed, train), None
        if bf16_params:
            params = to_bf16(params)
        (params, _, extra), losses = train_all(params, tx.init(params), extra, train)
        losses = np.asarray(losses)
        final = float(np.mean(losses[-max(1, len(losses) // 10):]))
        args = (params, extra, test) if work["stateful"] else (params, test)
        return final, float(evaluate(*args))

    return run


def memory_rows(work: dict, names: list[str]) -> list[list[Any]]:
    rows = []
    for name in names:
        bf16_params, bf16_compute, tx = recipes(1e-3)[name]
        train, _ = work["data"](0)
        if work["stateful"]:
            params, extra = work["init"](0, train)
        else:
            params, extra = work["init"](0, train), None
        if bf16_params:
            params = to_bf16(params)
        state = tx.init(params)
        n = sum(x.size for x in jax.tree.leaves(params))
        loss = jamp.autocast_transform(work["loss"]) if bf16_compute else work["loss"]

        def train_step(p, s, batch, e=extra):
            if work["stateful"]:
                (_, e), grads = jax.value_and_grad(loss, has_aux=True)(p, e, batch)
            else:
                grads = jax.grad(loss)(p, batch)
            updates, s = tx.update(grads, s, p)
            return optax.apply_updates(p, updates), s

        batch = jax.tree.map(lambda a: a[0], train)
        compiled = jax.jit(train_step, donate_argnums=(0, 1)).lower(params, state, batch).compile()
        analysis = compiled.memory_analysis()
        from_xla = None
        if analysis is not None:
            from_xla = (analysis.argument_size_in_bytes - nbytes(batch)) / n
        rows.append([name, n, f"{(nbytes(params) + nbytes(state)) / n:.3f}",
                     f"{from_xla:.3f}" if from_xla is not None else "n/a"])
    return rows


# --- cost -----------------------------------------------------------------------------------------

def square_params(n_params: int) -> dict[str, jax.Array]:
    side = int(np.sqrt(n_params))
    return {"w": jax.random.normal(jax.random.key(0), (side, side)) * 0.05,
            "b": jnp.zeros((side,))}


def cost_rows(params32: Any, rounds: int, calls: int = 10) -> list[list[Any]]:
    """The update alone on ``params32`` (float32 leaves). Each sample times ``calls`` updates in
    a row (ms per update): one ~1 ms call after a full collection is mostly cache refill and
    scheduling noise on the shared machine."""
    count = sum(x.size for x in jax.tree.leaves(params32))
    grads = jax.tree.map(lambda p: jnp.full(p.shape, 1e-3, jnp.float32), params32)
    adamw = optax.adamw(1e-3)
    pairs = {
        "state_dtype(adamw) on f32 params": (
            params32,
            optim.state_dtype(adamw, rounding="stochastic"),
            optim.state_dtype(adamw, rounding="nearest")),
        "master_weights(state_dtype(adamw)) on bf16 params": (
            to_bf16(params32),
            optim.master_weights(optim.state_dtype(adamw), rounding="stochastic"),
            optim.master_weights(optim.state_dtype(adamw, rounding="nearest"))),
    }
    rows = []
    for name, (params, stochastic, nearest) in pairs.items():
        fns = []
        for tx in (stochastic, nearest):
            @jax.jit
            def step(p, s, g, tx=tx):  # the gradients an argument: XLA folds no constant of them
                updates, s = tx.update(g, s, p)
                return optax.apply_updates(p, updates), s
            state = tx.init(params)
            jax.block_until_ready(step(params, state, grads))  # compile
            fns.append((step, state))
        samples: list[list[float]] = [[], []]
        for _ in range(rounds):
            for i, (step, state) in enumerate(fns):
                def run(step=step, state=state):
                    for _ in range(calls):
                        jax.block_until_ready(step(params, state, grads))

                seconds, _ = timed(run)
                samples[i].append(seconds / calls)
        ms = [1e3 * statistics.median(s) for s in samples]
        spread = [1e3 * (max(s) - min(s)) for s in samples]
        rows.append([name, f"{count:,}", f"{ms[0]:.2f} (±{spread[0] / 2:.2f})",
                     f"{ms[1]:.2f} (±{spread[1] / 2:.2f})",
                     f"{paired_ratio(samples[0], samples[1]):.2f}x"])
    return rows


# --- train step of a larger GPT (a GPU's figures) ------------------------------------------------

STEP_RECIPES = ["bf16 compute", "bf16 moments", "bf16 params, round-to-nearest",
                "bf16 params + masters", "bf16 params + stochastic", "bf16 params + Kahan"]


def step_rows(config: str, rounds: int, steps: int) -> tuple[list[list[Any]], Any]:
    """The train step (loss under bf16 autocast, AdamW) of ``benchmarks/float8.py``'s GPT
    ``config`` under each recipe: compiled, then timed in interleaved rounds (float8.py's
    harness); returns the table's rows and the float32 parameters (for the update's cost)."""
    import float8

    cfg = float8.GPT_CONFIGS[config]
    model = float8.GPT(cfg["vocab"], cfg["d"], cfg["heads"], cfg["layers"])
    tokens = jax.random.randint(jax.random.key(1), (cfg["batch"], cfg["seq"] + 1), 0,
                                cfg["vocab"])
    params32 = model.init(jax.random.key(0), tokens[:1, :-1])["params"]
    count = sum(x.size for x in jax.tree.leaves(params32))
    gpt_loss = float8.gpt_loss(model)
    loss = jamp.autocast_transform(lambda p, t: gpt_loss({"params": p}, t))
    variants, memory = [], {}
    for name in STEP_RECIPES:
        bf16_params, bf16_compute, tx = recipes(1e-4)[name]
        assert bf16_compute, name  # every recipe here computes in bf16: the float32 row is 0.5x

        def train_step(p, s, batch, tx=tx):
            value, grads = jax.value_and_grad(loss)(p, batch)
            updates, s = tx.update(grads, s, p)
            return optax.apply_updates(p, updates), s, value

        params = to_bf16(params32) if bf16_params else jax.tree.map(jnp.copy, params32)
        state = tx.init(params)
        state_bytes = nbytes(params) + nbytes(state)
        variant = float8.Variant(name, jax.jit(train_step, donate_argnums=(0, 1)),
                                 (params, state), tokens)
        analysis = variant.exe.memory_analysis()
        memory[name] = (state_bytes, analysis.temp_size_in_bytes if analysis else None)
        variants.append(variant)
        print(f"compiled {name}: {variant.compile_s:.0f} s", flush=True)
    float8.time_interleaved(variants, rounds, steps)
    base = statistics.median(variants[0].times)
    rows = []
    for v in variants:
        ms = [1e3 * t for t in v.times]
        state_bytes, temp = memory[v.name]
        rows.append([v.name, f"{statistics.median(ms):.1f} ({min(ms):.1f}-{max(ms):.1f})",
                     f"{base / statistics.median(v.times):.3f}x", f"{state_bytes / count:.3f}",
                     f"{state_bytes / 2**30:.2f}",
                     f"{temp / 2**30:.2f}" if temp is not None else "n/a", f"{v.loss:.4f}"])
    return rows, params32


# --- entry point ----------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpt-steps", type=int, default=200)
    parser.add_argument("--digits-epochs", type=int, default=5)
    parser.add_argument("--zoo-steps", type=int, default=ZOO_STEPS,
                        help="steps of the zoo lm1b Transformer (accuracy only); 0 leaves it out")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--cost-params", type=int, default=1 << 20)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--cost-calls", type=int, default=10,
                        help="updates timed in a row for one cost sample")
    parser.add_argument("--skip", default="", help="comma-separated: memory, accuracy, cost")
    parser.add_argument("--step-config", default=None,
                        help="also time the train step of benchmarks/float8.py's GPT of this "
                             "config (gpt-539m: a GPU's figures) under each recipe, and the "
                             "update alone on its parameters (instead of --cost-params')")
    parser.add_argument("--step-rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5, help="steps a round and recipe")
    args = parser.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    seeds = [int(s) for s in args.seeds.split(",")]
    print(environment(), flush=True)
    works = ([gpt_workload(args.gpt_steps)] if args.gpt_steps else []) + (
        [digits_workload(args.digits_epochs)] if args.digits_epochs else [])
    names = list(recipes(1e-3))

    if "memory" not in skip:
        for work in works:
            print(f"\n### Bytes of training state per parameter: {work['name']} (AdamW)\n")
            print(markdown_table(["recipe", "parameters", "pytrees", "memory_analysis()"],
                                 memory_rows(work, names)), flush=True)

    if "accuracy" not in skip:
        zoo = [zoo_lm1b_workload(args.zoo_steps)] if args.zoo_steps else []
        for work in works + zoo:
            start = time.perf_counter()
            results = {}
            for name, recipe in recipes(work["lr"]).items():
                run = make_run(work, recipe)
                results[name] = [run(seed) for seed in seeds]
                print(f"  {name}: {results[name]} ({time.perf_counter() - start:.0f} s)",
                      flush=True)
            base = np.mean([r[0] for r in results["float32"]])
            base_acc = np.mean([r[1] for r in results["float32"]])
            rows = []
            for name, rs in results.items():
                loss = np.mean([r[0] for r in rs])
                acc = np.mean([r[1] for r in rs])
                rows.append([name, f"{loss:.4f}", " / ".join(f"{r[0]:.3f}" for r in rs),
                             f"{100 * (loss - base) / base:+.2f}%", f"{acc:.2f}",
                             f"{acc - base_acc:+.2f}"])
            print(f"\n### Accuracy: {work['name']}, {work['length']}, seeds {args.seeds} "
                  f"({time.perf_counter() - start:.0f} s)\n")
            print(markdown_table(["recipe", "final loss (mean)", "per seed", "vs float32",
                                  "accuracy %", "vs float32 (points)"], rows))

    cost_params = None
    if args.step_config:
        rows, cost_params = step_rows(args.step_config, args.step_rounds, args.steps)
        print(f"\n### Train step: {args.step_config} GPT of benchmarks/float8.py, bf16 autocast, "
              f"AdamW ({args.step_rounds} interleaved rounds of {args.steps} steps after 3 "
              f"warm-up steps; median ms, range)\n")
        print(markdown_table(["recipe", "step ms", "speed vs f32 state", "state bytes/param",
                              "state GiB", "XLA temp GiB", "loss after the run"], rows),
              flush=True)

    if "cost" not in skip:
        print(f"\n### Cost of the update: stochastic against nearest rounding "
              f"({args.rounds} interleaved rounds of {args.cost_calls} updates a side; median "
              f"ms an update, ± half the range)\n")
        print(markdown_table(["update", "parameters", "stochastic ms", "nearest ms",
                              "ratio (median of per-round)"],
                             cost_rows(cost_params or square_params(args.cost_params),
                                       args.rounds, args.cost_calls)))


if __name__ == "__main__":
    main()
