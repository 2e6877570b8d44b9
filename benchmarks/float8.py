"""float8 autocast (issues 16, 23): accuracy against bfloat16, and GPU step time side by side.

    # accuracy: the digits CNN and the tiny GPT, bfloat16 vs float8 autocast (any backend)
    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/float8.py accuracy [--seeds 0 1]
    # GPT step time on a GPU: float32, bf16 autocast (transform, region, cast_inputs=True), hand-written
    # bf16 Flax, float8 autocast, Flax fp8_ops layers. --config gpt-539m (d=2048, 8 layers, seq 1024, batch 8; the default)
    # or gpt-1.3b (d=2048, 24 layers, seq 2048, batch 4); --d/--layers/... override it; --remat
    # dots|none saves the blocks' dense outputs or everything instead of recomputing each block.
    python benchmarks/float8.py step [--config gpt-1.3b] [--remat full|dots|none]
    # GPU step time of a ResNet-50 train step (batch 128, 224x224, SGD with momentum): float32,
    # hand-written bf16 Flax (dtype=), bf16 autocast (both forms), float8 autocast
    python benchmarks/float8.py resnet
    # what each ResNet variant's train step computes in which dtype (elements per primitive and
    # output dtype, from its jaxpr; any backend, nothing runs)
    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/float8.py resnet --tiny --dtype-elements
    # one matmul, forward and backward, bf16 autocast vs float8 autocast, over torchao's shapes:
    # the data for Policy.min_float8_flops' default (measured on an H200, benchmarks/README.md)
    python benchmarks/float8.py matmul
    # one GEMM on operands already in float8 (e4m3 x e4m3, e5m2 x e4m3) against bf16: the kernel
    # XLA picks (cuBLASLt float8 or a Triton GEMM) and its own speed, no quantization around it
    python benchmarks/float8.py gemm
    # every command at a tiny size, to check the script on a CPU (times mean nothing there:
    # 8-bit arithmetic is emulated)
    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/float8.py step --tiny   # resnet, matmul too

The variants of one command are compiled first, then timed in interleaved rounds (drift hits
every variant alike). Each compiled program goes through jamp's fallback check
(``jamp.float8_check.check_compiled``): the table counts its GEMMs by kernel (cuBLASLt float8
GEMMs are ``__cublas$lt$matmul$f8`` custom calls) and the GEMMs that read float8 data upcast to a
wider type, and a float8 program that falls back warns (``jamp.Float8FallbackWarning``).
``--explain`` adds ``jamp.explain(loss, ..., compiled=True)`` of the float8 variant's loss: a
verdict per float8 dot of the forward pass.
"""
from __future__ import annotations

import argparse
import collections
import functools
import math
import os
import statistics
import sys
import time
from typing import Any, Callable, Optional

import flax.linen as nn
import jax
import jax.extend as jex
import jax.numpy as jnp
import optax

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
import jamp  # noqa: E402
from benchmarks.common import environment, markdown_table  # noqa: E402
from jamp import float8_check  # noqa: E402


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


# How each block keeps what its backward pass needs: recomputed whole ("full", the default, as
# in the figures of issues 16 and 23), its dense layers' outputs saved and attention recomputed
# ("dots"), or everything saved ("none"; a 539M model fits an H100's memory without remat).
REMAT: dict[str, Callable[[type], type]] = {
    "full": nn.remat,
    "dots": functools.partial(nn.remat,
                              policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable),
    "none": lambda block: block,
}


class GPT(nn.Module):
    vocab: int
    d: int
    heads: int
    layers: int
    dtype: Any = jnp.float32
    dot_general_cls: Any = None
    remat: str = "full"

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = nn.Embed(self.vocab, self.d, dtype=self.dtype)(tokens)
        x = x + nn.Embed(tokens.shape[1], self.d, dtype=self.dtype)(jnp.arange(tokens.shape[1]))
        for i in range(self.layers):
            block = REMAT[self.remat](Block)
            x = block(self.heads, self.dtype, self.dot_general_cls, name=f"block{i}")(x)
        x = nn.LayerNorm(dtype=self.dtype)(x)
        return nn.Dense(self.vocab, dtype=self.dtype, name="head")(x)


def _flax_fp8_cls() -> Any:
    return getattr(nn, "Fp8DirectDotGeneralOp", None) or nn.Fp8DotGeneralOp


VARIANTS: dict[str, dict[str, Any]] = {
    "float32": {"dtype": jnp.float32, "policy": None},
    "bf16 autocast": {"dtype": jnp.float32, "policy": jamp.Policy(jnp.bfloat16)},
    "bf16 autocast region": {"dtype": jnp.float32, "policy": jamp.Policy(jnp.bfloat16),
                             "form": "region"},
    "bf16 autocast cast_inputs": {"dtype": jnp.float32,
                                  "policy": jamp.Policy(jnp.bfloat16, cast_inputs=True)},
    "bf16 hand-written Flax": {"dtype": jnp.bfloat16, "policy": None},
    "float8 autocast": {"dtype": jnp.float32, "policy": jamp.Policy(jnp.float8_e4m3fn)},
    "Flax fp8_ops layers": {"dtype": jnp.bfloat16, "policy": None, "fp8_ops": True},
}
OWG = "_overwrite_with_gradient"  # flax.linen.fp8_ops.OVERWRITE_WITH_GRADIENT


def gpt_loss(model: GPT) -> Callable:
    def loss_fn(variables, tokens):
        logits = model.apply(variables, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), tokens[:, 1:]).mean()
    return loss_fn


def under_policy(loss_fn: Callable, policy: Optional[jamp.Policy], form: str) -> Callable:
    """``loss_fn`` under ``policy``: transformed, or run inside a ``with jamp.autocast(policy):``
    region (the torch-style form), as a user would write either."""
    if policy is None:
        return loss_fn
    if form == "transform":
        return jamp.autocast_transform(loss_fn, policy)

    def in_region(*args: Any) -> Any:
        with jamp.autocast(policy):
            return loss_fn(*args)
    return in_region


def make_step(loss_fn: Callable, policy: Optional[jamp.Policy], tx: Any,
              form: str = "transform") -> Callable:
    """One training step; Flax's fp8 layers keep their scales in the ``_overwrite_with_gradient``
    collection, whose "gradients" are the new values (Flax's documented training loop)."""
    loss_fn = under_policy(loss_fn, policy, form)

    def step(variables, opt_state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(variables, tokens)
        updates, opt_state = tx.update(grads["params"], opt_state, variables["params"])
        new = dict(variables, params=optax.apply_updates(variables["params"], updates))
        if OWG in variables:
            new[OWG] = grads[OWG]
        return new, opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))




# --- compiling, checking and timing variants side by side ---------------------------------------

TINY_FP8 = jamp.Policy(jnp.float8_e4m3fn, min_float8_flops=0)  # tiny sizes: all in float8


def fp8_policy(args: argparse.Namespace) -> jamp.Policy:
    """The float8 variant's policy: the default size threshold, or none at --tiny sizes (where
    it would keep every matmul in bfloat16)."""
    if args.tiny:
        return TINY_FP8
    if args.min_float8_flops is not None:
        return jamp.Policy(jnp.float8_e4m3fn, min_float8_flops=args.min_float8_flops)
    return jamp.Policy(jnp.float8_e4m3fn)


def gemm_columns(check: float8_check.Float8Check) -> list[Any]:
    """f8 GEMMs, the other GEMMs by kernel, and the GEMMs that read float8 data upcast."""
    others = {k: n for k, n in sorted(check.counts().items()) if k != "cuBLASLt float8"}
    return [check.float8_gemms, ", ".join(f"{k} {n}" for k, n in others.items()) or "0",
            len(check.fallback_gemms)]


GEMM_HEADER = ["f8 GEMMs", "other GEMMs", "GEMMs on upcast float8"]


class Variant:
    """One compiled program with its state: ``run(state) -> (state, loss)``."""

    def __init__(self, name: str, step: Callable, state: tuple, batch: Any):
        self.name = name
        t0 = time.perf_counter()
        self.exe = step.lower(*state, batch).compile()
        self.compile_s = time.perf_counter() - t0
        self.check = float8_check.check_compiled(self.exe)
        float8_check.warn_fallbacks(self.check, name)  # a float8 program that fell back
        self.state, self.batch = state, batch
        self.times: list[float] = []
        self.loss = float("nan")

    def run(self, steps: int) -> None:
        for _ in range(steps):
            *state, loss = self.exe(*self.state, self.batch)
            self.state = tuple(state)
        self.loss = float(loss)  # blocks until done


def time_interleaved(variants: list[Variant], rounds: int, steps: int) -> None:
    for v in variants:  # warm up
        v.run(3)
    for _ in range(rounds):  # interleaved rounds: drift hits every variant alike
        for v in variants:
            t0 = time.perf_counter()
            v.run(steps)
            v.times.append((time.perf_counter() - t0) / steps)


def step_table(variants: list[Variant], base: str, model_flops: Optional[float]) -> str:
    ref = next((v for v in variants if v.name == base), None)
    rows = []
    for v in variants:
        ms = 1e3 * statistics.median(v.times)
        rows.append([v.name, f"{ms:.1f}",
                     f"{model_flops / (ms / 1e3) / 1e12:.0f}" if model_flops else "n/a",
                     f"{statistics.median(ref.times) * 1e3 / ms:.2f}x" if ref else "n/a",
                     f"{v.compile_s:.0f}", *gemm_columns(v.check), f"{v.loss:.3f}"])
    return markdown_table(["variant", "step ms (median)", "model TFLOP/s", f"speed vs {base}",
                           "compile s", *GEMM_HEADER, "loss after the run"], rows)


def explain_float8(loss_fn: Callable, policy: jamp.Policy, *args: Any) -> None:
    """Per float8 dot of the loss (forward pass): what it compiled to."""
    report = jamp.explain(loss_fn, *args, policy=policy, compiled=True)
    print(report.float8_check)
    if report.float8_kept:
        print(f"{len(report.float8_kept)} matmuls kept in bfloat16 by min_float8_flops")


# --- GPT step time -----------------------------------------------------------------------------

GPT_CONFIGS = {
    # the 539M GPT measured in issue 16 (benchmarks/README.md, float8)
    "gpt-539m": {"d": 2048, "heads": 16, "layers": 8, "seq": 1024, "batch": 8, "vocab": 32768},
    # ~1.3B: MPT-1B's width (llm-foundry's float8 figures), 24 layers, seq 2048
    "gpt-1.3b": {"d": 2048, "heads": 16, "layers": 24, "seq": 2048, "batch": 4, "vocab": 32768},
    "tiny": {"d": 32, "heads": 2, "layers": 2, "seq": 16, "batch": 2, "vocab": 64},
}


def step_time(args: argparse.Namespace) -> None:
    cfg = dict(GPT_CONFIGS["tiny" if args.tiny else args.config])
    cfg.update({k: getattr(args, k) for k in cfg if getattr(args, k, None) is not None})
    print(environment())
    print(f"device: {jax.devices()[0].device_kind}; GPT {cfg}, remat {args.remat}")
    tokens = jax.random.randint(jax.random.key(1), (cfg["batch"], cfg["seq"] + 1), 0,
                                cfg["vocab"])
    tx = optax.adam(1e-4)
    variants, params = [], None
    for name, spec in VARIANTS.items():
        if args.only and name not in args.only:
            continue
        model = GPT(cfg["vocab"], cfg["d"], cfg["heads"], cfg["layers"], spec["dtype"],
                    _flax_fp8_cls() if spec.get("fp8_ops") else None, args.remat)
        variables = dict(model.init(jax.random.key(0), tokens[:1, :-1]))
        params = params or sum(x.size for x in jax.tree.leaves(variables["params"]))
        policy = fp8_policy(args) if name == "float8 autocast" else spec["policy"]
        if args.explain and policy is not None and jamp.policy.is_float8(policy.compute_dtype):
            explain_float8(gpt_loss(model), policy, variables, tokens)
        runs = [(name, policy)]
        if name == "float8 autocast":  # the same model under other size thresholds
            runs += [(f"float8 autocast (min {n:.3g} FLOPs)",
                      jamp.Policy(jnp.float8_e4m3fn, min_float8_flops=n))
                     for n in args.also_min_float8_flops]
        for run_name, run_policy in runs:
            step = make_step(gpt_loss(model), run_policy, tx, spec.get("form", "transform"))
            state = jax.tree.map(jnp.copy, variables)  # each variant donates its own state
            variants.append(Variant(run_name, step, (state, tx.init(state["params"])), tokens))
            print(f"compiled {run_name}: {variants[-1].compile_s:.0f} s; "
                  f"{variants[-1].check.counts()}", flush=True)
    time_interleaved(variants, args.rounds, args.steps)
    flops = 6 * params * cfg["batch"] * cfg["seq"] if params else None  # fwd + bwd matmuls
    print(f"\nparameters: {params:,}; model FLOPs per step (6 N T): {flops:.3g}" if params else "")
    print(step_table(variants, "bf16 autocast", flops))


# --- ResNet-50 step time -------------------------------------------------------------------------

class Bottleneck(nn.Module):
    """ResNet v1.5 bottleneck block (Flax's imagenet example, without cross-device BatchNorm)."""
    filters: int
    strides: int = 1
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype)
        norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9,
                                 epsilon=1e-5, dtype=self.dtype)
        y = nn.relu(norm()(conv(self.filters, (1, 1))(x)))
        y = nn.relu(norm()(conv(self.filters, (3, 3), self.strides)(y)))
        y = norm(scale_init=nn.initializers.zeros_init())(conv(4 * self.filters, (1, 1))(y))
        if x.shape != y.shape:
            x = norm()(conv(4 * self.filters, (1, 1), self.strides)(x))
        return nn.relu(x + y)


class ResNet(nn.Module):
    stages: tuple[int, ...] = (3, 4, 6, 3)  # ResNet-50
    filters: int = 64
    classes: int = 1000
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
        x = nn.Conv(self.filters, (7, 7), 2, padding=[(3, 3), (3, 3)], use_bias=False,
                    dtype=self.dtype)(x)
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-5,
                                 dtype=self.dtype)(x))
        x = nn.max_pool(x, (3, 3), (2, 2), "SAME")
        for i, blocks in enumerate(self.stages):
            for j in range(blocks):
                x = Bottleneck(self.filters * 2**i, 2 if i and not j else 1, self.dtype)(x, train)
        return nn.Dense(self.classes, dtype=self.dtype)(jnp.mean(x, axis=(1, 2)))


RESNET_VARIANTS: dict[str, dict[str, Any]] = {
    "float32": {"dtype": jnp.float32, "policy": None},
    "bf16 hand-written Flax": {"dtype": jnp.bfloat16, "policy": None},
    "bf16 autocast": {"dtype": jnp.float32, "policy": jamp.Policy(jnp.bfloat16)},
    "bf16 autocast region": {"dtype": jnp.float32, "policy": jamp.Policy(jnp.bfloat16),
                             "form": "region"},
    "bf16 autocast cast_inputs": {"dtype": jnp.float32,
                                  "policy": jamp.Policy(jnp.bfloat16, cast_inputs=True)},
    "float8 autocast": {"dtype": jnp.float32, "policy": "float8"},
}


def resnet_loss(model: ResNet) -> Callable:
    def loss_fn(params, batch_stats, images, labels):
        logits, updates = model.apply({"params": params, "batch_stats": batch_stats}, images,
                                      mutable=["batch_stats"])
        loss = optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), labels).mean()
        return loss, updates["batch_stats"]
    return loss_fn


def resnet_forward(model: ResNet, params: Any, batch_stats: Any, images: jax.Array) -> jax.Array:
    return model.apply({"params": params, "batch_stats": batch_stats}, images, train=False)


def resnet_step(loss_fn: Callable, policy: Optional[jamp.Policy], tx: Any,
                form: str = "transform") -> Callable:
    loss_fn = under_policy(loss_fn, policy, form)

    def step(params, batch_stats, opt_state, batch):
        (loss, batch_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, batch_stats, *batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), batch_stats, opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1, 2))


def _elements_by_dtype(closed: Any, counts: collections.Counter) -> None:
    """Add each equation's output elements to ``counts[(primitive, dtype)]``, looking into the
    programs equations carry (remat, jit, custom derivatives)."""
    for eqn in closed.eqns:
        subs = list(jex.core.jaxprs_in_params(eqn.params))
        for sub in subs:
            _elements_by_dtype(sub, counts)
        if not subs:
            for var in eqn.outvars:
                aval = var.aval
                if hasattr(aval, "dtype") and jnp.issubdtype(aval.dtype, jnp.floating):
                    counts[(eqn.primitive.name, str(aval.dtype))] += aval.size


def resnet_dtype_elements(variants: dict[str, Callable], state: dict[str, tuple],
                          batch: tuple) -> None:
    """Per (primitive, output dtype), the floating elements each variant's train step computes
    (from its jaxpr: nothing runs), rows where the variants differ: where a policy's program
    keeps float32 what another rounds to bfloat16."""
    counts = {}
    for name, step in variants.items():
        counts[name] = collections.Counter()
        closed = jax.make_jaxpr(step)(*state[name], batch)
        _elements_by_dtype(closed.jaxpr, counts[name])
    keys = sorted(set().union(*counts.values()))
    rows = [[f"`{prim}`", dtype, *(counts[n][(prim, dtype)] for n in variants)]
            for prim, dtype in keys if len({counts[n][(prim, dtype)] for n in variants}) > 1]
    print("\nfloating elements computed per train step, by primitive and output dtype "
          "(rows where the variants differ):")
    print(markdown_table(["primitive", "dtype", *variants], rows))


def resnet_time(args: argparse.Namespace) -> None:
    batch, image = (4, 32) if args.tiny else (args.batch, args.image)
    shape = {"stages": (1, 1, 1, 1), "filters": 8, "classes": 10} if args.tiny else {}
    print(environment())
    print(f"device: {jax.devices()[0].device_kind}; ResNet-50 {shape or ''} batch {batch}, "
          f"{image}x{image}, SGD momentum 0.9")
    images = jax.random.normal(jax.random.key(1), (batch, image, image, 3))
    labels = jax.random.randint(jax.random.key(2), (batch,), 0, shape.get("classes", 1000))
    tx = optax.sgd(0.1, momentum=0.9)
    variants, flops = [], None
    steps, states = {}, {}
    for name, spec in RESNET_VARIANTS.items():
        if args.only and name not in args.only:
            continue
        model = ResNet(**shape, dtype=spec["dtype"])
        variables = model.init(jax.random.key(0), images[:1])
        policy = fp8_policy(args) if spec["policy"] == "float8" else spec["policy"]
        if args.dtype_elements:
            steps[name] = resnet_step(resnet_loss(model), policy, tx, spec.get("form", "transform"))
            states[name] = (variables["params"], variables["batch_stats"],
                            tx.init(variables["params"]))
            continue
        if flops is None:  # forward FLOPs of the float32 model, times 3 for the train step
            forward = functools.partial(resnet_forward, model)
            report = jamp.explain(forward, variables["params"], variables["batch_stats"], images)
            flops = 3 * sum(report.flops.values())
        if args.explain and spec["policy"] == "float8":
            explain_float8(resnet_loss(model), policy, variables["params"],
                           variables["batch_stats"], images, labels)
        step = resnet_step(resnet_loss(model), policy, tx, spec.get("form", "transform"))
        state = (variables["params"], variables["batch_stats"], tx.init(variables["params"]))
        variants.append(Variant(name, step, state, (images, labels)))
        print(f"compiled {name}: {variants[-1].compile_s:.0f} s; "
              f"{variants[-1].check.counts()}", flush=True)
    if args.dtype_elements:
        resnet_dtype_elements(steps, states, (images, labels))
        return
    time_interleaved(variants, args.rounds, args.steps)
    print(f"\nmodel FLOPs per step (3 x forward matmul/conv FLOPs): {flops:.3g}")
    print(step_table(variants, "bf16 autocast", flops))


# --- one matmul: where float8 starts to pay ------------------------------------------------------

# torchao's float8 shapes (M, K, N) and the GPT's (8192 tokens x d=2048 layers).
MATMUL_SHAPES = [(1024, 1024, 1024), (1024, 2048, 1024), (2048, 2048, 2048), (2048, 4096, 2048),
                 (4096, 4096, 4096), (8192, 2048, 2048), (8192, 2048, 8192), (4096, 8192, 4096),
                 (4096, 8192, 16384)]
TINY_SHAPES = [(16, 32, 16), (32, 64, 32)]


def matmul_time(args: argparse.Namespace) -> None:
    """Forward and backward of ``x @ w`` (x bfloat16 activations, w float32 weights, as in a
    bf16-autocast layer) under bf16 autocast and float8 autocast (no size threshold)."""
    print(environment())
    print(f"device: {jax.devices()[0].device_kind}")
    shapes = TINY_SHAPES if args.tiny else [tuple(map(int, s.split("x"))) for s in args.shapes] \
        if args.shapes else MATMUL_SHAPES
    policies = {"bf16 autocast": jamp.Policy(jnp.bfloat16), "float8 autocast": TINY_FP8}
    rows = []
    for m, k, n in shapes:
        x = jax.random.normal(jax.random.key(0), (m, k), jnp.bfloat16)
        w = 0.02 * jax.random.normal(jax.random.key(1), (k, n), jnp.float32)
        c = jax.random.normal(jax.random.key(2), (m, n), jnp.bfloat16)
        variants = []
        for name, policy in policies.items():
            loss = jamp.autocast_transform(
                lambda x, w, c: jnp.sum((x @ w).astype(jnp.float32) * c), policy)
            grad = jax.grad(loss, argnums=(0, 1))

            def step(x, w, c, grad=grad):
                gx, gw = grad(x, w, c)
                return x, w - 1e-6 * gw.astype(w.dtype), jnp.sum(gx.astype(jnp.float32))

            variants.append(Variant(name, jax.jit(step), (x, w), c))
        time_interleaved(variants, args.rounds, args.steps)
        bf16, fp8 = (1e3 * statistics.median(v.times) for v in variants)
        rows.append([f"{m}x{k}x{n}", f"{2 * m * k * n:.3g}", f"{bf16:.3f}", f"{fp8:.3f}",
                     f"**{bf16 / fp8:.2f}x**", variants[1].check.float8_gemms])
        print(rows[-1], flush=True)
    print(markdown_table(["M x K x N", "forward FLOPs", "bf16 ms (fwd+bwd)", "float8 ms",
                          "float8 speed", "f8 GEMMs"], rows))


# --- one GEMM on float8 operands: which kernel XLA picks, and at what speed ---------------------

GEMM_SHAPES = [(4096, 4096, 4096), (4100, 4096, 4104), (8192, 8192, 2048), (1024, 1024, 1024)]


def gemm_time(args: argparse.Namespace) -> None:
    """``lax.dot`` of two operands already in float8 (e4m3 x e4m3, and the e5m2 x e4m3 of a
    backward product) against the same dot in bfloat16: no quantization around it, so the ratio
    is the kernels' own. Which kernel each compiled to comes from the fallback check."""
    print(environment())
    print(f"device: {jax.devices()[0].device_kind}")
    shapes = TINY_SHAPES if args.tiny else [tuple(map(int, s.split("x"))) for s in args.shapes] \
        if args.shapes else GEMM_SHAPES
    pairs = {"bf16": (jnp.bfloat16, jnp.bfloat16), "e4m3 x e4m3": (jnp.float8_e4m3fn,) * 2,
             "e5m2 x e4m3": (jnp.float8_e5m2, jnp.float8_e4m3fn)}
    rows = []
    for m, k, n in shapes:
        programs, times = {}, {}
        for name, (ta, tb) in pairs.items():
            a = jax.random.normal(jax.random.key(0), (m, k)).astype(ta)
            b = jax.random.normal(jax.random.key(1), (k, n)).astype(tb)

            def gemm_probe(a, b):
                return jax.lax.dot(a, b, preferred_element_type=jnp.bfloat16)

            exe = jax.jit(gemm_probe).lower(a, b).compile()
            programs[name] = (exe, a, b, float8_check.check_compiled(exe))
            times[name] = []
        for _ in range(args.rounds):  # interleaved
            for name, (exe, a, b, _) in programs.items():
                jax.block_until_ready(exe(a, b))
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    out = exe(a, b)
                jax.block_until_ready(out)
                times[name].append((time.perf_counter() - t0) / args.steps)
        ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
        for name, (_, _, _, check) in programs.items():
            kernels = ", ".join(f"{k} {n}" for k, n in sorted(check.counts().items()))
            rows.append([f"{m}x{k}x{n}", name, kernels, f"{ms[name]:.3f}",
                         f"{2 * m * k * n / ms[name] / 1e9:.0f}",
                         f"**{ms['bf16'] / ms[name]:.2f}x**"])
            print(rows[-1], flush=True)
    print(markdown_table(["M x K x N", "operands", "kernel (fallback check)", "ms", "TFLOP/s",
                          "speed vs bf16"], rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    acc = sub.add_parser("accuracy")
    acc.add_argument("--seeds", type=int, nargs="+", default=[0])
    acc.add_argument("--digits-epochs", type=int, default=None)
    acc.add_argument("--gpt-steps", type=int, default=None)
    timed = []
    for name in ("step", "resnet", "matmul", "gemm"):
        cmd = sub.add_parser(name)
        cmd.add_argument("--tiny", action="store_true",
                         help="tiny sizes, to check the script on a CPU (no meaningful times)")
        cmd.add_argument("--rounds", type=int, default=5)
        cmd.add_argument("--steps", type=int, default=5, help="steps per round and variant")
        cmd.add_argument("--min-float8-flops", type=int, default=None,
                         help="Policy.min_float8_flops of the float8 variant (default: jamp's)")
        timed.append(cmd)
    step, resnet, matmul, gemm = timed
    step.add_argument("--also-min-float8-flops", type=int, nargs="*", default=[],
                      help="more float8 variants, one per Policy.min_float8_flops given")
    step.add_argument("--config", choices=[c for c in GPT_CONFIGS if c != "tiny"],
                      default="gpt-539m")
    step.add_argument("--remat", choices=list(REMAT), default="full",
                      help="what each block saves for its backward pass (default: recompute all)")
    for key in GPT_CONFIGS["tiny"]:
        step.add_argument(f"--{key}", type=int, default=None, help="overrides --config")
    for cmd in (step, resnet):
        cmd.add_argument("--only", nargs="*", default=None, help="variant names to run")
        cmd.add_argument("--explain", action="store_true",
                         help="also jamp.explain(compiled=True) the float8 variant's loss")
    resnet.add_argument("--batch", type=int, default=128)
    resnet.add_argument("--image", type=int, default=224)
    resnet.add_argument("--dtype-elements", action="store_true",
                        help="instead of timing: the floating elements each variant's train "
                             "step computes per primitive and dtype (any backend)")
    for cmd in (matmul, gemm):
        cmd.add_argument("--shapes", nargs="*", default=None, help="MxKxN, e.g. 4096x4096x4096")
    args = parser.parse_args()
    if args.command == "accuracy":
        print(environment())
        accuracy(args.seeds, args.digits_epochs, args.gpt_steps)
    else:
        {"step": step_time, "resnet": resnet_time, "matmul": matmul_time,
         "gemm": gemm_time}[args.command](args)


if __name__ == "__main__":
    main()
