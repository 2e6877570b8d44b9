"""How much does ``tracing.freeze`` save on a ResNet-style CNN, and how close is it to the limit?

Three programs at batch 32 (32x32x3 images):
- ``unfrozen``: ``jax.jit(model.apply)(variables, x)``, the variables as arguments;
- ``frozen``: ``tracing.freeze(model, variables, x)`` called as ``frozen(x)``;
- ``no_bn``: the same network written without BatchNorm (convs with bias), jitted like
  ``unfrozen``: what BatchNorm folding can reach at best.

Printed (markdown): work equations (recursing into calls, not counting the call wrappers), the
median of per-round latency ratios over interleaved rounds, freeze time and the frozen program's
agreement with the unfrozen one. Goals: frozen work equations <= no_bn; frozen latency <= 1.05x
no_bn and < unfrozen.

``--weights`` (issue 34) measures ``freeze(weights=...)`` instead: the exported blob's bytes
(``len(frozen.export())``, scales included) and the relative L2 error of the outputs against the
unfrozen float32 model on held-out inputs, per storage mode, for the tiny GPT of
``examples/tiny_gpt.py`` (random init; d=64 as there, and d=256), and this CNN (BatchNorm
statistics made non-trivial, folded before quantizing); plus a ``jamp.tune_weights`` choice
(tolerance 2e-2, candidates int8 and int4, calibrated on other inputs). Goals: int8 <= 0.27x
and int4 <= 0.15x of float32's bytes; int8 error <= 2e-2. Bytes and errors are deterministic.
``--weights --zoo`` measures the same for the zoo's Flax lm1b Transformer and ResNet (as
``tests/zoo`` freezes them; needs the zoo extra and the repository root on ``PYTHONPATH``), and
for both at a wider configuration (lm1b emb 256 / mlp 1024, ResNet 64 filters).

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/freeze.py [--quick] [--rounds N]
    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/freeze.py --weights
    PYTHONPATH=$PWD JAX_PLATFORMS=cpu .venv/bin/python benchmarks/freeze.py --weights --zoo
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tracing  # noqa: E402
from benchmarks.common import environment, markdown_table, paired_ratio  # noqa: E402
from benchmarks.runtime import latencies  # noqa: E402

CALL_WRAPPERS = frozenset({"jit", "pjit", "closed_call", "core_call", "custom_jvp_call",
                           "custom_vjp_call", "checkpoint", "remat"})


def work_eqns(closed: Any) -> collections.Counter:
    """Equations by primitive, recursing into sub-jaxprs; call wrappers count only their bodies."""
    jaxpr = closed.jaxpr if hasattr(closed, "jaxpr") and hasattr(closed.jaxpr, "eqns") else closed
    counts: collections.Counter = collections.Counter()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name not in CALL_WRAPPERS:
            counts[eqn.primitive.name] += 1
        for value in eqn.params.values():
            for sub in (value if isinstance(value, (tuple, list)) else (value,)):
                if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
                    counts.update(work_eqns(sub))
    return counts


class Block(nn.Module):
    """Basic residual block: conv-BN-relu, conv-BN, shortcut (1x1 conv-BN when shapes change)."""
    features: int
    strides: int = 1
    batchnorm: bool = True

    def norm_conv(self, x: jax.Array, kernel: int, strides: int = 1) -> jax.Array:
        x = nn.Conv(self.features, (kernel, kernel), strides, use_bias=not self.batchnorm)(x)
        return nn.BatchNorm(use_running_average=True)(x) if self.batchnorm else x

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        y = nn.relu(self.norm_conv(x, 3, self.strides))
        y = self.norm_conv(y, 3)
        if x.shape != y.shape:
            x = self.norm_conv(x, 1, self.strides)
        return nn.relu(x + y)


class ResNet(nn.Module):
    """Stem conv, three stages of ``blocks`` residual blocks (16/32/64 features), pool, dense."""
    blocks: int = 2
    batchnorm: bool = True
    classes: int = 10

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.Conv(16, (3, 3), use_bias=not self.batchnorm)(x)
        x = nn.relu(nn.BatchNorm(use_running_average=True)(x) if self.batchnorm else x)
        for stage, features in enumerate((16, 32, 64)):
            for block in range(self.blocks):
                strides = 2 if stage > 0 and block == 0 else 1
                x = Block(features, strides, self.batchnorm)(x)
        return nn.Dense(self.classes)(x.mean(axis=(1, 2)))


def trained_like(variables: Any, key: jax.Array) -> Any:
    """Non-trivial BatchNorm statistics (init gives mean 0, var 1)."""
    leaves, tree = jax.tree_util.tree_flatten_with_path(variables)
    keys = jax.random.split(key, len(leaves))
    out = []
    for (path, leaf), k in zip(leaves, keys):
        name = jax.tree_util.keystr(path)
        if "mean" in name:
            leaf = jax.random.normal(k, leaf.shape) * 0.1
        elif "var" in name:
            leaf = jax.random.uniform(k, leaf.shape, minval=0.5, maxval=1.5)
        out.append(leaf)
    return jax.tree.unflatten(jax.tree.structure(variables), out)


def time_freeze(model: nn.Module, variables: Any, x: jax.Array,
                reps: int) -> tuple[float, float, float]:
    """Seconds of the first ``tracing.freeze`` in the process (JAX compiles each folded op on
    first use), the median of the later ones, and the frozen function's first call (compile)."""
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        frozen = tracing.freeze(model, variables, x)
        times.append(time.perf_counter() - start)
    start = time.perf_counter()
    jax.block_until_ready(frozen(x))
    warm = statistics.median(times[1:]) if len(times) > 1 else float("nan")
    return times[0], warm, time.perf_counter() - start


def run(batch: int, blocks: int, rounds: int, min_sample_s: float, freeze_reps: int) -> str:
    x = jax.random.normal(jax.random.key(0), (batch, 32, 32, 3))
    model, plain = ResNet(blocks), ResNet(blocks, batchnorm=False)
    variables = trained_like(model.init(jax.random.key(1), x), jax.random.key(2))
    plain_vars = plain.init(jax.random.key(1), x)

    cold_s, warm_s, first_call_s = time_freeze(model, variables, x, freeze_reps)
    frozen = tracing.freeze(model, variables, x)
    unfrozen, no_bn = jax.jit(model.apply), jax.jit(plain.apply)
    fns: dict[str, Callable[[], Any]] = {
        "unfrozen": lambda: unfrozen(variables, x),
        "frozen": lambda: frozen(x),
        "no_bn": lambda: no_bn(plain_vars, x),
    }
    error = float(jnp.max(jnp.abs(frozen(x) - unfrozen(variables, x))))
    eqns = {"unfrozen": work_eqns(jax.make_jaxpr(model.apply)(variables, x)),
            "frozen": work_eqns(frozen.jaxpr),
            "no_bn": work_eqns(jax.make_jaxpr(plain.apply)(plain_vars, x))}
    times = latencies(fns, rounds, min_sample_s)

    rows = []
    for name in fns:
        c = eqns[name]
        rows.append([name, sum(c.values()), c["conv_general_dilated"],
                     c["rsqrt"], c["sub"], c["mul"], c["add"],
                     f"{statistics.median(times[name]) * 1e3:.2f}",
                     f"{paired_ratio(times[name], times['no_bn']):.3f}",
                     f"{paired_ratio(times[name], times['unfrozen']):.3f}"])
    table = markdown_table(
        ["program", "work eqns", "conv", "rsqrt", "sub", "mul", "add", "median ms",
         "/ no_bn", "/ unfrozen"], rows)
    frozen_eqns, plain_eqns = sum(eqns["frozen"].values()), sum(eqns["no_bn"].values())
    vs_plain = paired_ratio(times["frozen"], times["no_bn"])
    vs_unfrozen = paired_ratio(times["frozen"], times["unfrozen"])
    goals = [
        f"- frozen work eqns <= no_bn: {frozen_eqns} <= {plain_eqns}: "
        f"{'met' if frozen_eqns <= plain_eqns else 'NOT met'}",
        f"- frozen latency <= 1.05x no_bn: {vs_plain:.3f}x: "
        f"{'met' if vs_plain <= 1.05 else 'NOT met'}",
        f"- frozen latency < unfrozen: {vs_unfrozen:.3f}x: "
        f"{'met' if vs_unfrozen < 1 else 'NOT met'}",
    ]
    frozen_primitives = ", ".join(f"{k} {v}" for k, v in sorted(eqns["frozen"].items()))
    return "\n".join([
        f"ResNet-style CNN, {3 * blocks} blocks ({len(jax.tree.leaves(variables))} variable "
        f"arrays), batch {batch}, 32x32x3, float32; {rounds} interleaved rounds",
        "", table, "",
        f"freeze time: first {cold_s:.2f} s, then {warm_s:.2f} s (median of {freeze_reps - 1}); "
        f"first frozen call (compile + run): {first_call_s:.2f} s; "
        f"max |frozen - unfrozen| = {error:.2e}",
        f"frozen program: {frozen_primitives}", "", *goals])


def weights_models() -> list[tuple[str, Any, Any, tuple, tuple, tuple, dict]]:
    """(name, model, variables, freeze inputs, calibration inputs, held-out inputs, apply
    kwargs) per model."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), "examples"))
    import tiny_gpt

    out = []
    for d in (64, 256):
        gpt = tiny_gpt.TinyGPT(d=d)
        tokens = [(jax.random.randint(jax.random.key(k), (8, 16), 0, tiny_gpt.VOCAB + 1),)
                  for k in (10, 11, 12)]
        out.append((f"tiny GPT d={d}", gpt, gpt.init(jax.random.key(0), *tokens[0]), *tokens,
                    {}))
    cnn = ResNet(2)
    images = [(jax.random.normal(jax.random.key(k), (8, 32, 32, 3)),) for k in (10, 11, 12)]
    variables = trained_like(cnn.init(jax.random.key(1), *images[0]), jax.random.key(2))
    out.append(("ResNet-style CNN", cnn, variables, *images, {}))
    return out


def zoo_models() -> list[tuple[str, Any, Any, tuple, tuple, tuple, dict]]:
    """The zoo's Flax lm1b Transformer and ResNet as ``tests/zoo`` freezes them (its
    ``ZooCase.inference``: module, variables, inputs, kwargs), then the same models at a
    representative width through their own configs. Calibration and held-out inputs are other
    PRNG draws of the freeze inputs' shapes; the ResNet's BatchNorm statistics are randomized
    (``trained_like``) so that folding them changes the kernels, and so are its BatchNorm
    scales: the example initializes each block's last one to zero, which would fold that
    block's second convolution into a kernel of zeros (a residual branch that adds nothing)."""
    import flax.linen as fnn

    from tests.zoo import models as zoo
    from tests.zoo.flax_examples import imagenet_models, lm1b_models

    def tokens(shape: tuple, vocab: int) -> list[tuple]:
        # the zoo's padded row: the second sequence ends in padding (token 0)
        return [(jax.random.randint(jax.random.key(k), shape, 1, vocab)
                 .at[1, shape[1] * 3 // 4:].set(0),) for k in (20, 21, 22)]

    def images(shape: tuple) -> list[tuple]:
        return [(jax.random.normal(jax.random.key(k), shape),) for k in (20, 21, 22)]

    def trained_resnet(variables: Any) -> Any:
        params = dict(variables["params"])
        scales = [p for p, _ in jax.tree_util.tree_leaves_with_path(params)
                  if jax.tree_util.keystr(p).endswith("['scale']")]
        keys = dict(zip(map(jax.tree_util.keystr, scales), jax.random.split(
            jax.random.key(3), len(scales))))
        params = jax.tree_util.tree_map_with_path(
            lambda p, leaf: jax.random.uniform(keys[jax.tree_util.keystr(p)], leaf.shape,
                                               minval=0.5, maxval=1.5)
            if jax.tree_util.keystr(p) in keys else leaf, params)
        return trained_like({**variables, "params": params}, jax.random.key(2))

    out = []
    lm1b = zoo.flax_lm1b().inference
    resnet = zoo.flax_resnet().inference
    assert lm1b is not None and resnet is not None
    lm_inputs = tokens(lm1b.inputs[0].shape, lm1b.target.config.vocab_size)
    out.append(("zoo lm1b Transformer (2 layers, emb 32, mlp 64, vocab 64)", lm1b.target,
                lm1b.variables, lm1b.inputs, *lm_inputs[1:], lm1b.kwargs))
    res_inputs = images(resnet.inputs[0].shape)
    out.append(("zoo ResNet (2 stages of 1 block, 8 filters)", resnet.target,
                trained_resnet(resnet.variables), resnet.inputs,
                *res_inputs[1:], resnet.kwargs))

    wide_config = lm1b.target.config.replace(emb_dim=256, qkv_dim=256, mlp_dim=1024)
    wide_lm = lm1b_models.TransformerLM(wide_config)
    wide_params = fnn.unbox(wide_lm.init(jax.random.key(0), *lm_inputs[0])["params"])
    out.append(("lm1b Transformer at emb 256, mlp 1024 (2 layers, vocab 64)", wide_lm,
                {"params": wide_params}, *lm_inputs, {}))
    wide_res = imagenet_models.ResNet(stage_sizes=[1, 1], block_cls=imagenet_models.ResNetBlock,
                                      num_classes=10, num_filters=64)
    wide_images = images((4, 32, 32, 3))
    wide_vars = trained_resnet(wide_res.init(jax.random.key(1), *wide_images[0], train=False))
    out.append(("ResNet at 64 filters (2 stages of 1 block, 32x32 images)", wide_res, wide_vars,
                *wide_images, {"train": False}))
    return out


def weights_table(zoo: bool = False) -> str:
    import jamp

    modes: dict[str, dict[str, Any]] = {
        "float32": {},
        "bfloat16 policy": dict(policy=jamp.Policy()),
        "float8 policy": dict(policy=jamp.Policy(jnp.float8_e4m3fn, min_float8_flops=0)),
        "weights=int8": dict(weights=jnp.int8),
        "weights=float8_e4m3fn": dict(weights=jnp.float8_e4m3fn),
        "weights=int4": dict(weights=jnp.int4),
        "bf16 policy + int8": dict(policy=jamp.Policy(), weights=jnp.int8),
    }
    sections = []
    for name, model, variables, x, calib, held, kw in (zoo_models() if zoo
                                                        else weights_models()):
        ref = model.apply(variables, *held, **kw)
        error = lambda f: float(jnp.linalg.norm((f(*held) - ref).astype(jnp.float32))
                                / jnp.linalg.norm(ref))
        rows, base = [], None
        for mode, kwargs in modes.items():
            frozen = tracing.freeze(model, variables, *x, **kw, **kwargs)
            size = len(frozen.export())
            base = base or size
            rows.append([mode, f"{size:,}", f"{size / base:.3f}", f"{error(frozen):.2e}"])
        plain = tracing.freeze(model, variables, *x, **kw)
        chosen = jamp.tune_weights(plain, *calib, candidates=(jnp.int8, jnp.int4),
                                   tolerance=2e-2)
        tuned = tracing.freeze(model, variables, *x, **kw, weights=chosen)
        size = len(tuned.export())
        counts = collections.Counter(s.chosen for s in chosen.scopes)
        label = "tuned (" + ", ".join(f"{n} {c}" for c, n in sorted(counts.items())) + ")"
        rows.append([label, f"{size:,}", f"{size / base:.3f}", f"{error(tuned):.2e}"])
        kernels = sum(k.frozen_nbytes for k in tuned.kernels)
        sections.append("\n".join([
            f"{name}: {len(tuned.kernels)} kernels, {kernels:,} bytes of {base:,} exported",
            "", markdown_table(["mode", "export bytes", "/ float32", "rel. L2 error"], rows)]))
    return "\n\n".join(sections)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=2, help="residual blocks per stage")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--min-sample-ms", type=float, default=200.0)
    parser.add_argument("--freeze-reps", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="5 rounds, short samples")
    parser.add_argument("--weights", action="store_true",
                        help="export bytes and error per weights= mode (no timing)")
    parser.add_argument("--zoo", action="store_true",
                        help="with --weights: the zoo's Flax lm1b Transformer and ResNet")
    args = parser.parse_args(argv)
    if args.weights:
        print(environment())
        print()
        print(weights_table(args.zoo))
        return
    if args.quick:
        args.rounds, args.min_sample_ms, args.freeze_reps = 5, 50.0, 2
    print(environment())
    print()
    print(run(args.batch, args.blocks, args.rounds, args.min_sample_ms / 1e3, args.freeze_reps))


if __name__ == "__main__":
    main()
