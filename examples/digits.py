"""Train a small CNN on scikit-learn's handwritten digits three ways: float32, bfloat16, float16.

    ./scripts/demo                                   # or:
    JAX_PLATFORMS=cpu .venv/bin/python examples/digits.py [--epochs N] [--seed S] [--plot out.png]

The data set is the 8x8 ``load_digits`` set that ships inside scikit-learn (1797 images, no
download), split once into train and test with a fixed seed. The same Flax linen CNN (conv ->
BatchNorm -> relu, twice, then max-pool and two dense layers), from the same float32 initial
parameters and with the same batch order, is trained

* in **float32**: plain JAX, the reference;
* with **bfloat16** autocast: ``jamp.autocast_transform(loss_fn)`` runs the convolutions and
  matmuls in bfloat16 while BatchNorm statistics, the softmax and the loss stay in float32, and the
  gradients come back in float32 for the float32 parameters;
* with **float16** autocast and dynamic loss scaling: float16 has 5 exponent bits, so small
  gradients underflow to zero unless the loss is multiplied by a large scale before the backward
  pass. ``jamp.scaled_value_and_grad`` scales, unscales (with the scale the loss was multiplied by)
  and checks the gradients; ``optax.apply_if_finite`` skips the update when they overflowed and
  the ``jamp.DynamicLossScale`` backs off.

It prints the loss-scale settings it uses and why, a table (test accuracy, final loss, median step
time, compiled temporary memory of the train step, the float16 loss-scale history) and a note on
that memory, writes a PNG (loss curves, their difference from float32, the loss-scale history)
and exits non-zero if the test accuracies differ by more than 1.5 points.

The loss scale's growth period is 25 steps here, not ``jamp.DynamicLossScale``'s default of 2000:
the demo is about 250 steps long and should show the whole state machine (see
``LOSS_SCALE_PERIOD``). Keep 2000 for real training.

On this project's CPU machines bfloat16 and float16 arithmetic is emulated: XLA's CPU backend runs
the 16-bit convolutions and matmuls in float32 and converts around them, so the mixed-precision
runs are *slower* here and their train step needs slightly *more* temporary memory (16-bit values
and their float32 copies live at once). On a GPU they are the fast and small ones: on an H100
(jax 0.11.2, batch 64) the train step's temporary memory was 2.53 MiB in float32, 1.89 MiB in
bfloat16 and 1.88 MiB in float16 (44.0 / 35.1 / 35.0 MiB with ``--batch-size 1024``).
"""
from __future__ import annotations

import argparse
import collections
import os
import re
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

import jamp

MODES = ("float32", "bfloat16", "float16")
# float8: --modes only (benchmarks/float8.py). The example's matmuls are far below the default
# Policy.min_float8_flops, which would keep them all in bfloat16: 0 puts them in float8.
COMPUTE_DTYPES = {"float32": None, "bfloat16": jnp.bfloat16, "float16": jnp.float16,
                  "float8": jamp.Policy(jnp.float8_e4m3fn, min_float8_flops=0)}
MAX_ACCURACY_GAP = 1.5  # percentage points between any two of the three runs
SPLIT_SEED = 0          # the train/test split is the same for every --seed

# Full run: 1347 training images, 21 steps of 64 per epoch.
EPOCHS = 12
QUICK_EPOCHS = 5
BATCH_SIZE = 64
LEARNING_RATE = 3e-3
# float16: start at 2**15 like jmp and torch, but grow after 25 finite steps rather than 2000, so
# that a demo of a few hundred steps shows the whole state machine: the scale doubles until the
# scaled gradients overflow float16 (max 65504), that step is skipped and the scale halves. For
# real training keep the default period of 2000.
LOSS_SCALE_PERIOD = 25


# --- model and data -------------------------------------------------------------------------------

class CNN(nn.Module):
    """conv(16)-BN-relu -> conv(32)-BN-relu -> max-pool -> dense(64)-relu -> dense(10).

    ``dtype`` exists so benchmarks can build the hand-written bfloat16 twin
    (``CNN(dtype=jnp.bfloat16)``); the examples use the float32 model and let autocast decide.
    """

    dtype: Any = None
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        for features in (16, 32):
            x = nn.Conv(features, (3, 3), use_bias=False, **kw)(x)
            x = nn.BatchNorm(use_running_average=not train, momentum=0.9, **kw)(x)
            x = nn.relu(x)
        x = nn.max_pool(x, (2, 2), strides=(2, 2))
        x = x.reshape(x.shape[0], -1)
        x = nn.relu(nn.Dense(64, **kw)(x))
        return nn.Dense(10, **kw)(x)


class Data(NamedTuple):
    x_train: np.ndarray  # [N, 8, 8, 1] float32 in [0, 1]
    y_train: np.ndarray  # [N] int32
    x_test: np.ndarray
    y_test: np.ndarray


def load_data(split_seed: int = SPLIT_SEED, test_fraction: float = 0.25) -> Data:
    """The bundled scikit-learn digits, scaled to [0, 1], split stratified with ``split_seed``."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[..., None]
    y = digits.target.astype(np.int32)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=test_fraction, random_state=split_seed, stratify=y)
    return Data(x_train, y_train, x_test, y_test)


def batch_order(n: int, batch_size: int, epochs: int, seed: int) -> np.ndarray:
    """Indices ``[steps, batch_size]``: a fresh shuffle per epoch, the last partial batch dropped
    (so every step has the same shape and the train step compiles once). Same for every mode."""
    rng = np.random.default_rng(seed)
    per_epoch = n // batch_size
    keep = per_epoch * batch_size
    return np.concatenate([rng.permutation(n)[:keep].reshape(per_epoch, batch_size)
                           for _ in range(epochs)])


# --- training -----------------------------------------------------------------------------------

class TrainState(NamedTuple):
    params: Any
    batch_stats: Any
    opt_state: Any
    loss_scale: Any  # jamp.NoOpLossScale for float32/bfloat16, jamp.DynamicLossScale for float16


def make_loss_fn(model: nn.Module, mode: str, policy: Optional[jamp.Policy] = None) -> Callable:
    """``loss_fn(params, batch_stats, x, y) -> (loss, new_batch_stats)`` in ``mode``'s precision
    (or under ``policy``, for benchmarks)."""

    def loss_fn(params, batch_stats, x, y):
        logits, updates = model.apply({"params": params, "batch_stats": batch_stats}, x, True,
                                      mutable=["batch_stats"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return loss, updates["batch_stats"]

    if policy is not None:
        return jamp.autocast_transform(loss_fn, policy)
    if COMPUTE_DTYPES[mode] is None:
        return loss_fn
    # Convs and matmuls in bfloat16/float16; BatchNorm statistics (sums), softmax and the loss in
    # float32; gradients come back in float32 because the parameters are float32.
    return jamp.autocast_transform(loss_fn, COMPUTE_DTYPES[mode])


def make_optimizer(mode: str, learning_rate: float) -> optax.GradientTransformation:
    tx = optax.adam(learning_rate)
    if mode == "float16":
        # Overflowed (inf/NaN) gradients: no update, optimizer state untouched.
        tx = optax.apply_if_finite(tx, max_consecutive_errors=20)
    return tx


def make_train_step(model: nn.Module, mode: str, learning_rate: float = LEARNING_RATE,
                    policy: Optional[jamp.Policy] = None
                    ) -> tuple[Callable, optax.GradientTransformation]:
    """``train_step(state, x, y) -> (state, (loss, grads_finite, loss_scale_used))``."""
    grad_fn = jamp.scaled_value_and_grad(make_loss_fn(model, mode, policy), has_aux=True)
    tx = make_optimizer(mode, learning_rate)

    def train_step(state: TrainState, x: jax.Array, y: jax.Array):
        (loss, batch_stats), grads, loss_scale, finite = grad_fn(
            state.loss_scale, state.params, state.batch_stats, x, y)
        # The optimizer stays OUTSIDE autocast, in float32: Adam's b2=0.999 rounds to 1.0 in
        # bfloat16 (8 bits of mantissa), which would freeze its second-moment estimate, and its
        # eps=1e-8 underflows in float16. The gradients it receives are float32 already.
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        # A skipped step skips the BatchNorm statistics too.
        batch_stats = jamp.select_tree(finite, batch_stats, state.batch_stats)
        new_state = TrainState(params, batch_stats, opt_state, loss_scale)
        return new_state, (loss, finite, state.loss_scale.loss_scale)

    return train_step, tx


def make_loss_scale(mode: str, period: int = LOSS_SCALE_PERIOD) -> Any:
    """float16: a dynamic scale from 2**15 (as jmp and torch's GradScaler); otherwise none."""
    if mode == "float16":
        return jamp.DynamicLossScale(2.0 ** 15, period=period)
    return jamp.NoOpLossScale()


def describe_loss_scale(period: int, steps: int) -> str:
    """The float16 loss-scale settings, as built by ``make_loss_scale``, and why."""
    scale = make_loss_scale("float16", period)
    default_period = jamp.DynamicLossScale().period
    why = (f"the default is {default_period}; this run has only {steps} steps, and growing every "
           f"{scale.period} lets it show the scale doubling until the scaled gradients overflow "
           "float16 (max 65504), that step being skipped and the scale halving. Keep "
           f"{default_period} for real training" if int(scale.period) != int(default_period)
           else "jamp's default")
    return (f"float16 loss scale: jamp.DynamicLossScale(loss_scale={float(scale.loss_scale):g}, "
            f"period={scale.period}, factor={float(scale.factor):g}, "
            f"min_loss_scale={float(scale.min_loss_scale):g}). Start at 2**15 as torch's GradScaler "
            f"and jmp do; multiply by {float(scale.factor):g} after {scale.period} finite steps "
            f"in a row ({why}); on inf/NaN gradients divide by {float(scale.factor):g} and skip "
            "the update "
            "(optax.apply_if_finite).")


def init_state(model: nn.Module, tx: optax.GradientTransformation, mode: str, seed: int,
               example: np.ndarray, loss_scale_period: int = LOSS_SCALE_PERIOD) -> TrainState:
    variables = model.init(jax.random.key(seed), jnp.asarray(example[:1]), False)
    loss_scale = make_loss_scale(mode, loss_scale_period)
    return TrainState(variables["params"], variables["batch_stats"],
                      tx.init(variables["params"]), loss_scale)


def make_predict(model: nn.Module, mode: str) -> Callable:
    apply = model.apply
    if COMPUTE_DTYPES[mode] is not None:
        apply = jamp.autocast_transform(apply, COMPUTE_DTYPES[mode])
    return jax.jit(lambda variables, x: jnp.argmax(apply(variables, x, False), axis=-1))


def temp_bytes(compiled: Any) -> Optional[int]:
    """``temp_size_in_bytes`` of a compiled program, or None where the backend does not say."""
    try:
        analysis = compiled.memory_analysis()
    except Exception:  # some backends raise rather than return None
        return None
    return None if analysis is None else getattr(analysis, "temp_size_in_bytes", None)


_HLO_COMPUTE = re.compile(r"= (\w+)\[[^\]]*\]\S* (?:dot|convolution)\(")


def matmul_dtypes(compiled: Any) -> dict[str, int]:
    """How many dot/convolution ops of the optimized program produce each element type (``f32``,
    ``bf16``, ...), and how many ``convert`` ops it has: what the backend really computes in."""
    try:
        text = compiled.as_text()
    except Exception:  # a backend without HLO text: nothing to report
        return {}
    counts = collections.Counter(_HLO_COMPUTE.findall(text))
    counts["convert"] = len(re.findall(r" convert\(", text))
    return dict(counts)


def memory_note(runs: dict) -> Optional[str]:
    """Why a 16-bit run's train step needs more temporary memory than float32's, when it does:
    the backend computed its matmuls and convolutions in float32 (emulated 16-bit arithmetic)."""
    reference = runs.get("float32", {}).get("temp_bytes")
    emulated = {mode: r for mode, r in runs.items() if mode != "float32"
                and set(r.get("matmul_dtypes", {})) - {"convert"} == {"f32"}}
    if not emulated or reference is None:
        return None
    details = "; ".join(
        f"{mode}: {format_bytes(r['temp_bytes'])}, its {sum(v for k, v in r['matmul_dtypes'].items() if k != 'convert')} "
        f"dot/convolution ops all float32 with {r['matmul_dtypes']['convert']} converts"
        for mode, r in emulated.items())
    return (f"train-step temp mem: on {jax.default_backend()} XLA computes 16-bit matmuls and "
            f"convolutions in float32 ({details}; float32: {format_bytes(reference)}), so a 16-bit "
            "run holds its 16-bit values and their float32 copies at once and saves no memory. "
            "Where the hardware computes in 16 bits (a GPU) the 16-bit runs need less: see the "
            "numbers in examples/digits.py's docstring.")


def train(mode: str, data: Data, *, epochs: int, seed: int, batch_size: int = BATCH_SIZE,
          learning_rate: float = LEARNING_RATE, progress: bool = True,
          loss_scale_period: int = LOSS_SCALE_PERIOD) -> dict:
    """One run; returns accuracy, losses, timings, memory and (float16) the loss-scale history."""
    model = CNN()
    train_step, tx = make_train_step(model, mode, learning_rate)
    state = init_state(model, tx, mode, seed, data.x_train, loss_scale_period)
    order = batch_order(len(data.x_train), batch_size, epochs, seed)
    x_all, y_all = jnp.asarray(data.x_train), jnp.asarray(data.y_train)
    xb, yb = x_all[order[0]], y_all[order[0]]

    start = time.perf_counter()
    compiled = jax.jit(train_step).lower(state, xb, yb).compile()
    compile_seconds = time.perf_counter() - start

    losses, scales, finite_flags, step_seconds = [], [], [], []
    bar = _progress(total=len(order), desc=f"{mode:>8}", disable=not progress)
    for i, idx in enumerate(order):
        xb, yb = x_all[idx], y_all[idx]
        t0 = time.perf_counter()
        state, (loss, finite, scale) = compiled(state, xb, yb)
        loss = float(loss)  # waits for the step
        step_seconds.append(time.perf_counter() - t0)
        losses.append(loss)
        finite_flags.append(bool(finite))
        scales.append(float(scale))
        if i % 10 == 0 or i == len(order) - 1:
            bar.set_postfix(loss=f"{loss:.3f}")
        bar.update(1)
    bar.close()

    predict = make_predict(model, mode)
    predictions = predict({"params": state.params, "batch_stats": state.batch_stats},
                          jnp.asarray(data.x_test))
    accuracy = 100.0 * float(np.mean(np.asarray(predictions) == data.y_test))
    per_epoch = len(order) // epochs
    result = {
        "mode": mode,
        "accuracy": accuracy,
        "final_loss": float(np.mean(losses[-per_epoch:])),  # mean over the last epoch
        "losses": losses,
        "median_step_ms": 1e3 * statistics.median(step_seconds[1:] or step_seconds),
        "compile_seconds": compile_seconds,
        "temp_bytes": temp_bytes(compiled),
        "matmul_dtypes": matmul_dtypes(compiled),
        "steps": len(order),
        "param_dtypes": sorted({str(p.dtype) for p in jax.tree.leaves(state.params)}),
        "batch_stats_dtypes": sorted({str(p.dtype) for p in jax.tree.leaves(state.batch_stats)}),
    }
    if mode == "float16":
        final_scale = float(state.loss_scale.loss_scale)
        result["loss_scale"] = {
            "history": scales + [final_scale],  # the scale each step used, then the final one
            "min": min(scales + [final_scale]),
            "max": max(scales + [final_scale]),
            "final": final_scale,
            "skipped_steps": finite_flags.count(False),
            "skipped_at": [i for i, f in enumerate(finite_flags) if not f],
            "period": loss_scale_period,
            # optax.apply_if_finite's own count, as a cross-check of the skipped updates
            "optax_notfinite": int(state.opt_state.total_notfinite),
        }
    return result


def _progress(**kwargs: Any) -> Any:
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is in the examples extra; run without a bar otherwise
        return _NoBar()
    return tqdm(unit="step", leave=True, **kwargs)


class _NoBar:
    def set_postfix(self, **_: Any) -> None: ...
    def update(self, _: int) -> None: ...
    def close(self) -> None: ...


# --- reporting ------------------------------------------------------------------------------------

def format_bytes(n: Optional[int]) -> str:
    if n is None:
        return "n/a"
    return f"{n / 2 ** 20:.2f} MiB" if n >= 2 ** 20 else f"{n / 2 ** 10:.1f} KiB"


def format_table(runs: dict, accuracy_label: str = "test acc %") -> str:
    header = ["mode", accuracy_label, "final loss", "median step ms", "compile s",
              "train-step temp mem", "loss scale (min / max / final, skipped steps)"]
    rows = []
    for mode, r in runs.items():
        ls = r.get("loss_scale")
        scale = (f"{ls['min']:g} / {ls['max']:g} / {ls['final']:g}, {ls['skipped_steps']} skipped"
                 if ls else "-")
        rows.append([mode, f"{r['accuracy']:.2f}", f"{r['final_loss']:.4f}",
                     f"{r['median_step_ms']:.2f}", f"{r['compile_seconds']:.1f}",
                     format_bytes(r["temp_bytes"]), scale])
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
                     + [line(row) for row in rows])


def smooth(values: Sequence[float], alpha: float = 0.1) -> np.ndarray:
    """Exponential moving average (for a readable loss curve)."""
    out, acc = [], values[0]
    for v in values:
        acc = (1 - alpha) * acc + alpha * v
        out.append(acc)
    return np.asarray(out)


# One look per mode, so curves that lie on top of each other stay apart: width, dash and marker.
STYLES = {
    "float32": dict(color="black", linestyle="-", linewidth=2.4, marker="o"),
    "bfloat16": dict(color="tab:blue", linestyle="--", linewidth=1.6, marker="s"),
    "float16": dict(color="tab:orange", linestyle=":", linewidth=2.0, marker="^"),
}


def plot_losses(runs: dict, path: str, title: str = "digits CNN: training loss") -> str:
    """Write ``loss_figure(runs, title)`` to the PNG ``path``; returns ``path``."""
    import matplotlib.pyplot as plt

    fig = loss_figure(runs, title)
    fig.savefig(path)
    plt.close(fig)
    return path


def loss_figure(runs: dict, title: str = "digits CNN: training loss") -> Any:
    """Small multiples over the training steps: (1) the loss of every run (EMA, log scale), each
    with its own line style and markers; (2) each run's loss relative to float32's, where curves
    that coincide in (1) come apart; (3) the loss scale of the runs that have one (float16), with
    their skipped steps."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scaled = {mode: r for mode, r in runs.items() if "loss_scale" in r}
    panels = 3 if scaled else 2
    fig, axes = plt.subplots(panels, 1, figsize=(7.5, 2.6 * panels + 0.6), dpi=110, sharex=True,
                             gridspec_kw={"height_ratios": [2.2, 1.3, 1.3][:panels]})
    loss_ax, diff_ax = axes[0], axes[1]
    reference = smooth(runs["float32"]["losses"]) if "float32" in runs else None
    for k, (mode, r) in enumerate(runs.items()):
        style = STYLES.get(mode, dict(linestyle="-", marker="."))
        curve = smooth(r["losses"])
        every = max(1, len(curve) // 10)
        marks = dict(markevery=(k * every // len(runs), every), markersize=5)  # staggered
        loss_ax.plot(curve, label=f"{mode} (held-out acc {r['accuracy']:.1f}%)", **style, **marks)
        if reference is not None and mode != "float32":
            diff_ax.plot(100 * (curve / reference - 1), label=mode, **style, **marks)
        skipped = r.get("loss_scale", {}).get("skipped_at", [])
        if skipped:  # steps whose gradients overflowed: no update, the scale halved
            loss_ax.plot(skipped, curve[skipped], "x", color="red", markersize=9, mew=2,
                         label=f"{mode}: skipped step (overflow)")
    loss_ax.set_yscale("log")
    loss_ax.set_ylabel("loss (EMA)")
    loss_ax.set_title(title)
    loss_ax.legend(fontsize=8)
    diff_ax.axhline(0, **{**STYLES["float32"], "marker": None, "linewidth": 1.2})
    diff_ax.set_ylabel("vs float32 (%)")
    diff_ax.legend(fontsize=8, title="EMA loss / float32's - 1", title_fontsize=8)
    if scaled:
        scale_ax = axes[2]
        for mode, r in scaled.items():
            ls = r["loss_scale"]
            scale_ax.step(range(len(ls["history"])), ls["history"], where="post",
                          color=STYLES.get(mode, {}).get("color"), label=f"{mode} loss scale")
            if ls["skipped_at"]:
                scale_ax.plot(ls["skipped_at"], [ls["history"][i] for i in ls["skipped_at"]],
                              "x", color="red", markersize=9, mew=2, label="skipped (overflow)")
            period = ls.get("period")
            if period:
                scale_ax.set_title(f"DynamicLossScale: x2 after {period} finite steps "
                                   "(default 2000), /2 on overflow", fontsize=9)
        scale_ax.set_yscale("log", base=2)
        scale_ax.set_ylabel("loss scale")
        scale_ax.legend(fontsize=8)
    axes[-1].set_xlabel("step")
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    return fig


# --- entry point ----------------------------------------------------------------------------------

def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=None,
                        help=f"epochs per run (default {EPOCHS}, {QUICK_EPOCHS} with --quick)")
    parser.add_argument("--quick", action="store_true", help="a short run (for tests)")
    parser.add_argument("--seed", type=int, default=0, help="initialisation and batch order")
    parser.add_argument("--lr", type=float, default=LEARNING_RATE)
    parser.add_argument("--batch-size", type=int, default=BATCH_SIZE)
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of "
                        + ", ".join(MODES))
    parser.add_argument("--loss-scale-period", type=int, default=LOSS_SCALE_PERIOD,
                        help=f"float16: finite steps before the loss scale grows (default "
                        f"{LOSS_SCALE_PERIOD} for this short demo; jamp's default is 2000)")
    parser.add_argument("--plot", default="digits_losses.png",
                        help="PNG of the loss curves and the loss-scale history")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> dict:
    """Run the comparison; returns ``{"runs": {mode: result}, "accuracy_gap", "agree", ...}``."""
    args = parse_args(argv)
    epochs = args.epochs or (QUICK_EPOCHS if args.quick else EPOCHS)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(modes) - set(COMPUTE_DTYPES)
    if unknown:
        raise SystemExit(f"--modes: unknown {sorted(unknown)}, expected a subset of {tuple(COMPUTE_DTYPES)}")
    data = load_data()
    print(f"digits: {len(data.x_train)} train / {len(data.x_test)} test images, {epochs} epochs "
          f"of {len(data.x_train) // args.batch_size} steps, batch {args.batch_size}, adam lr "
          f"{args.lr}, seed {args.seed}; jax {jax.__version__} on {jax.default_backend()}")
    if "float16" in modes:
        steps = epochs * (len(data.x_train) // args.batch_size)
        print(textwrap.fill(describe_loss_scale(args.loss_scale_period, steps), 100))
    start = time.perf_counter()
    runs = {mode: train(mode, data, epochs=epochs, seed=args.seed, batch_size=args.batch_size,
                        learning_rate=args.lr, progress=not args.no_progress,
                        loss_scale_period=args.loss_scale_period) for mode in modes}
    accuracies = [r["accuracy"] for r in runs.values()]
    gap = max(accuracies) - min(accuracies)
    results = {"runs": runs, "accuracy_gap": gap, "agree": gap <= MAX_ACCURACY_GAP,
               "epochs": epochs, "seed": args.seed, "train_seconds": time.perf_counter() - start}
    print()
    print(format_table(runs))
    note = memory_note(runs)
    if note:
        print("\n" + textwrap.fill(note, 100))
    print(f"\ntest accuracies agree within {gap:.2f} points "
          f"({'OK' if results['agree'] else 'FAIL'}: at most {MAX_ACCURACY_GAP}); "
          f"{results['train_seconds']:.0f} s for the {len(runs)} runs, compiles included")
    if "float16" in runs:
        ls = runs["float16"]["loss_scale"]
        print(f"float16 loss scale: start {ls['history'][0]:g}, min {ls['min']:g}, max "
              f"{ls['max']:g}, final {ls['final']:g}; {ls['skipped_steps']} skipped steps "
              f"(at {ls['skipped_at'][:10]}{' ...' if len(ls['skipped_at']) > 10 else ''}); "
              f"optax.apply_if_finite counted {ls['optax_notfinite']}")
    if args.plot:
        results["plot"] = plot_losses(runs, args.plot)
        print(f"loss curves: {os.path.abspath(args.plot)}")
    return results


if __name__ == "__main__":
    sys.exit(0 if main()["agree"] else 1)
