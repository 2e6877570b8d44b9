"""What crosses the network, on 8 CPU devices: bytes per training step by dtype, the accuracy of
gradient sums with ``Policy(reduce_dtype=jnp.float32)``, and FSDP + ``nn.scan`` memory.

Run:  PYTHONPATH=. JAX_PLATFORMS=cpu python benchmarks/collectives.py

Everything is read from the compiled program (nothing is timed): the collectives from the
program right after XLA's SPMD partitioner (what ``jamp.explain(..., compiled=True)`` reads),
memory from
``Compiled.memory_analysis()`` (bytes per device). A small Flax transformer (2 blocks: LayerNorm,
attention, MLP; d_model 128, sequence 16, batch 64) on a mesh of 8: data parallel (parameters
replicated, batch split) and FSDP (every kernel split over its first axis of a size 8 divides,
optimizer-free step: the gradient, with the parameters' shardings as the output's).
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jamp  # noqa: E402
from jamp import _compat as compat  # noqa: E402
from jamp.collectives import read_collectives  # noqa: E402

D, T, B, HEADS = 128, 16, 64, 4
mesh = Mesh(np.array(jax.devices()), ("data",))


class Block(nn.Module):
    dtype: object = None

    @nn.compact
    def __call__(self, h, _=None):
        a = nn.LayerNorm(dtype=self.dtype)(h)
        a = nn.MultiHeadDotProductAttention(HEADS, dtype=self.dtype)(a, a)
        h = h + a
        m = nn.Dense(4 * D, dtype=self.dtype)(nn.LayerNorm(dtype=self.dtype)(h))
        return h + nn.Dense(D, dtype=self.dtype)(nn.gelu(m)), None


class Transformer(nn.Module):
    layers: int = 2
    scan: bool = False
    dtype: object = None

    @nn.compact
    def __call__(self, x):
        if self.scan:
            stack = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                            length=self.layers)
            h, _ = stack(dtype=self.dtype)(x, None)
        else:
            h = x
            for _ in range(self.layers):
                h, _ = Block(dtype=self.dtype)(h)
        return jnp.mean(h.astype(jnp.float32) ** 2)


def fsdp_spec(p):
    """The first axis 8 divides (after a scanned layer axis), else replicated."""
    start = 1 if p.ndim >= 3 else 0
    for axis in range(start, p.ndim):
        if p.ndim >= 2 and p.shape[axis] % 8 == 0:
            return P(*[None] * axis, "data")
    return P()


def place(params, fsdp):
    return jax.tree.map(
        lambda p: jax.device_put(p, NamedSharding(mesh, fsdp_spec(p) if fsdp else P())), params
    )


POLICIES = {
    "float32": jamp.Policy(jnp.float32),
    "bfloat16": jamp.Policy(jnp.bfloat16),
    "bfloat16 + reduce_dtype=f32": jamp.Policy(jnp.bfloat16, reduce_dtype=jnp.float32),
    "float16": jamp.Policy(jnp.float16),
    "float8": jamp.Policy(jnp.float8_e4m3fn, min_float8_flops=0),
    "float8 + reduce_dtype=f32": jamp.Policy(
        jnp.float8_e4m3fn, min_float8_flops=0, reduce_dtype=jnp.float32
    ),
}


def bytes_per_step(model, params, x):
    """{'gathers': {dtype: bytes}, 'sums': {dtype: bytes}} per device per step, per policy, of
    ``jax.grad(jamp.autocast_transform(loss, policy))`` read after SPMD partitioning."""
    loss = lambda p, x: model.apply(p, x)  # noqa: E731
    shardings = jax.tree.map(lambda p: p.sharding, params)
    rows = {}
    for name, policy in POLICIES.items():
        step = jax.jit(jax.grad(jamp.autocast_transform(loss, policy)), out_shardings=shardings)
        _, text = compat.compile_partitioned(step.lower(params, x))
        c = read_collectives(text)
        sums = {}
        for kind in ("all-reduce", "reduce-scatter"):
            for dtype, n in c.bytes_by(kind).items():
                sums[dtype] = sums.get(dtype, 0) + n
        rows[name] = {"gathers": c.bytes_by("all-gather"), "sums": sums}
    return rows


def show(title, rows):
    print(f"\n{title} (bytes per device per step; ratio of the total to float32's)")
    base = {k: sum(rows["float32"][k].values()) for k in ("gathers", "sums")}
    for name, row in rows.items():
        cells = []
        for k in ("gathers", "sums"):
            total = sum(row[k].values())
            ratio = f"{total / base[k]:.2f}x" if base[k] else "-"
            detail = ", ".join(f"{d} {n:,}" for d, n in sorted(row[k].items())) or "none"
            cells.append(f"{k}: {ratio} ({detail})")
        print(f"  {name:<28} " + " | ".join(cells))


def accuracy():
    """Relative error of the 8-device data-parallel gradient against one device's float32."""
    model = Transformer()
    x = np.random.default_rng(0).normal(size=(B, T, D)).astype(np.float32)
    params = model.init(jax.random.key(0), x[:1])
    loss = lambda p, x: model.apply(p, x)  # noqa: E731
    with jax.default_device(jax.devices()[0]):
        exact = jax.jit(jax.grad(loss))(params, x)
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    ps = place(params, fsdp=False)
    print("\naccuracy: data-parallel gradient on 8 devices vs float32 on one device")
    print("  (relative error ||g - g32|| / ||g32|| over all parameters; median of the kernels)")
    for name in ("bfloat16", "bfloat16 + reduce_dtype=f32", "float16"):
        got = jax.jit(jax.grad(jamp.autocast_transform(loss, POLICIES[name])))(ps, xs)
        flat_g = jnp.concatenate([g.astype(jnp.float32).ravel() for g in jax.tree.leaves(got)])
        flat_e = jnp.concatenate([e.ravel() for e in jax.tree.leaves(exact)])
        total = float(jnp.linalg.norm(flat_g - flat_e) / jnp.linalg.norm(flat_e))
        kernels = [
            float(jnp.linalg.norm(g.astype(jnp.float32) - e) / jnp.linalg.norm(e))
            for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(exact))
            if e.ndim >= 2
        ]
        dtypes = {str(g.dtype) for g in jax.tree.leaves(got)}
        print(f"  {name:<28} all: {total:.2e}  kernels (median): {np.median(kernels):.2e}  "
              f"grads in {sorted(dtypes)}")


def scan_memory():
    """FSDP + nn.scan: per-device temp memory of the gradient step, float32 vs hand-written
    bfloat16 (Flax dtype=bfloat16) vs jamp, at 4 and 8 layers; where the gathers run."""
    print("\nFSDP + nn.scan: temp bytes per device (Compiled.memory_analysis), gradient step")
    for layers in (4, 8):
        x = jax.device_put(jnp.ones((B, T, D)), NamedSharding(mesh, P("data")))
        params = place(Transformer(layers, scan=True).init(jax.random.key(0), x[:1]), True)
        shardings = jax.tree.map(lambda p: p.sharding, params)
        steps = {
            "float32": jax.grad(lambda p, x: Transformer(layers, True).apply(p, x)),
            "hand-written bf16": jax.grad(
                lambda p, x: Transformer(layers, True, jnp.bfloat16).apply(p, x)
            ),
            "jamp bf16": jax.grad(
                jamp.autocast_transform(lambda p, x: Transformer(layers, True).apply(p, x))
            ),
        }
        temps = {}
        for name, step in steps.items():
            lowered = jax.jit(step, out_shardings=shardings).lower(params, x)
            compiled, text = compat.compile_partitioned(lowered)
            temps[name] = compiled.memory_analysis().temp_size_in_bytes
            gathers = [c for c in read_collectives(text).collectives if c.kind == "all-gather"
                       and len(c.shape) >= 2]
            in_loop = sum(1 for c in gathers if c.runs == layers)
            shapes = sorted({c.shape for c in gathers})
            print(f"  L={layers} {name:<18} temp {temps[name]:>10,} B   kernel gathers: "
                  f"{len(gathers)} ({in_loop} inside the layer loop, x{layers}; shapes {shapes})")
        ratio = temps["jamp bf16"] / temps["hand-written bf16"]
        print(f"  L={layers} jamp / hand-written bf16: {ratio:.3f}x")
        sharded = sum(p.addressable_shards[0].data.nbytes for p in jax.tree.leaves(params))
        print(f"  L={layers} sharded float32 parameters per device: {sharded:,} B")


if __name__ == "__main__":
    print(f"jax {jax.__version__}, {jax.device_count()} CPU devices")
    x = jax.device_put(jnp.ones((B, T, D)), NamedSharding(mesh, P("data")))
    model = Transformer()
    params = model.init(jax.random.key(0), x[:1])
    show("data parallel", bytes_per_step(model, place(params, fsdp=False), x))
    show("FSDP", bytes_per_step(model, place(params, fsdp=True), x))
    accuracy()
    scan_memory()
