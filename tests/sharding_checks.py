"""Sharding checks, run in a subprocess with 8 host devices (see test_parallel.py).

Exits non-zero with a message on the first failed check.
"""
import os

# The test run's compile flags (tests/conftest.py) stay: without them this process compiled
# at full optimisation, three times as long (sharding_checks 22 against 7 s).
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"])
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import warnings  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jamp  # noqa: E402
from tests.jaxpr_utils import in_region, operand_dtypes  # noqa: E402

warnings.simplefilter("error", jamp.UnsupportedPrimitiveWarning)
assert len(jax.devices()) == 8, jax.devices()
mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
BF16 = jnp.dtype(jnp.bfloat16)


def check(condition, message):
    if not condition:
        raise SystemExit(f"FAILED: {message}")


def mlp(w1, w2, x):
    h = jax.lax.with_sharding_constraint(jnp.tanh(x @ w1), NamedSharding(mesh, P("data", "model")))
    return jnp.mean((h @ w2) ** 2), h


x = jax.device_put(jax.random.normal(jax.random.PRNGKey(0), (16, 8)), NamedSharding(mesh, P("data")))
w1 = jax.device_put(jax.random.normal(jax.random.PRNGKey(1), (8, 32)) * 0.3,
                    NamedSharding(mesh, P(None, "model")))
w2 = jax.device_put(jax.random.normal(jax.random.PRNGKey(2), (32, 4)) * 0.3,
                    NamedSharding(mesh, P("model", None)))

plain = jax.jit(mlp)
mixed = jax.jit(jamp.autocast_transform(mlp))
(loss_p, h_p), (loss_m, h_m) = plain(w1, w2, x), mixed(w1, w2, x)
check(h_m.dtype == BF16, f"activation dtype {h_m.dtype}")
check(h_m.sharding.is_equivalent_to(h_p.sharding, h_p.ndim), f"{h_m.sharding} vs {h_p.sharding}")
check(loss_m.sharding.is_equivalent_to(loss_p.sharding, 0), "loss sharding")
np.testing.assert_allclose(loss_m, loss_p, rtol=5e-2)
grad_p = jax.jit(jax.grad(lambda *a: mlp(*a)[0], argnums=(0, 1)))(w1, w2, x)
grad_m = jax.jit(jax.grad(lambda *a: jamp.autocast_transform(mlp)(*a)[0], argnums=(0, 1)))(w1, w2, x)
for gp, gm in zip(grad_p, grad_m):
    check(gm.dtype == jnp.float32, f"grad dtype {gm.dtype}")
    check(gm.sharding.is_equivalent_to(gp.sharding, gp.ndim), f"grad {gm.sharding} vs {gp.sharding}")
    np.testing.assert_allclose(gm, gp, rtol=0.1, atol=2e-2)
text = mixed.lower(w1, w2, x).as_text()
check("sharding" in text and "bf16" in text, "lowered program lost shardings or bf16")


def sharded(a, w):
    def body(a, w):
        partial = a @ w                                   # per-shard matmul
        total = jax.lax.psum(partial, "model")            # collective on the rewritten value
        gathered = jax.lax.all_gather(total, "data", tiled=True)
        return total, gathered
    return jax.shard_map(body, mesh=mesh, in_specs=(P("data", "model"), P("model", None)),
                         out_specs=(P("data", None), P(None, None)), check_vma=False)(a, w)


a = jax.random.normal(jax.random.PRNGKey(3), (16, 8))
w = jax.random.normal(jax.random.PRNGKey(4), (8, 6))
f = jamp.autocast_transform(sharded)
total, gathered = jax.jit(f)(a, w)
ref_total, ref_gathered = sharded(a, w)
check(total.dtype == BF16 and gathered.dtype == BF16, f"shard_map outputs {total.dtype}")
np.testing.assert_allclose(np.asarray(total, np.float32), ref_total, rtol=5e-2, atol=5e-2)
np.testing.assert_allclose(np.asarray(gathered, np.float32), ref_gathered, rtol=5e-2, atol=5e-2)
dots = operand_dtypes(jax.make_jaxpr(f)(a, w), "dot_general")
check(dots == [("bfloat16", "bfloat16")], f"shard_map body dots {dots}")
g = jax.grad(lambda w: f(a, w)[0].astype(jnp.float32).sum())(w)
check(g.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(g))), "shard_map grad")

# The region form (issue 21): a region around the sharded call, and one inside the shard_map body.
def region_around(a, w):
    with jamp.autocast():
        return sharded(a, w)


def region_inside(a, w):
    def body(a, w):
        with jamp.autocast():
            return jax.lax.psum(a @ w, "model")
    return jax.shard_map(body, mesh=mesh, in_specs=(P("data", "model"), P("model", None)),
                         out_specs=P("data", None), check_vma=False)(a, w)


for name, fn in (("around", region_around), ("inside", region_inside)):
    out = jax.jit(fn)(a, w)
    out = out[0] if isinstance(out, tuple) else out
    check(out.dtype == BF16, f"region {name} shard_map: output {out.dtype}")
    np.testing.assert_allclose(np.asarray(out, np.float32), ref_total, rtol=5e-2, atol=5e-2)
    dots = operand_dtypes(jax.make_jaxpr(fn)(a, w), "dot_general")
    check(dots == [("bfloat16", "bfloat16")], f"region {name} shard_map dots {dots}")


def region_mlp(w1, w2, x):
    with jamp.autocast():
        return mlp(w1, w2, x)


loss_r, h_r = jax.jit(region_mlp)(w1, w2, x)
check(h_r.dtype == BF16, f"region activation dtype {h_r.dtype}")
check(h_r.sharding.is_equivalent_to(h_p.sharding, h_p.ndim), f"region {h_r.sharding}")
np.testing.assert_allclose(loss_r, loss_m, rtol=1e-2)

# jax.experimental.custom_partitioning: each shard runs what the partition callback returns, not
# the traced body, so the call keeps its traced dtypes under both forms, without a warning (an
# UnsupportedPrimitiveWarning is an error here); what follows it follows the policy.
from jax.experimental.custom_partitioning import custom_partitioning  # noqa: E402

lowered_dtypes = []


@custom_partitioning
def row_sums(a):
    return jnp.sum(a, axis=1, keepdims=True) * jnp.ones_like(a)


def partition(mesh, arg_shapes, result_shape):
    def per_shard(a):  # rows are whole on every shard (the callback replicates the columns)
        lowered_dtypes.append(a.dtype)
        return jnp.sum(a, axis=1, keepdims=True) * jnp.ones_like(a)

    rows = NamedSharding(mesh, P("data", None))
    return mesh, per_shard, rows, (rows,)


row_sums.def_partition(
    infer_sharding_from_operands=lambda mesh, arg_shapes, result_shape: NamedSharding(
        mesh, P("data", None)),
    partition=partition,
    sharding_rule="i j -> i j",
)


def partitioned(a, w):
    return jnp.tanh(row_sums(a) @ w)


a_rows = jax.device_put(a, NamedSharding(mesh, P("data", None)))
want = np.asarray(jax.jit(partitioned)(a_rows, w))

for name, fn in (("transform", jamp.autocast_transform(partitioned)),
                 ("region", in_region(partitioned))):
    lowered_dtypes.clear()
    got = jax.jit(fn)(a_rows, w)
    check(got.dtype == BF16, f"custom_partitioning {name}: output {got.dtype}")
    check(lowered_dtypes and set(lowered_dtypes) == {jnp.dtype(jnp.float32)},
          f"custom_partitioning {name}: the partitioned function saw {lowered_dtypes}")
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=5e-2, atol=5e-2)

# A custom_vjp's cotangents take JAX's cotangent types: an output reduced over a mesh axis
# (jax.P(reduced=...)) has an unreduced cotangent (jamp gave the reduced type, and the pullback
# refused it); a bwd returning None for a reduced input gives JAX's zero of the unreduced type
# (jamp returned the zero JAX's pullback instantiates, untyped, and JAX refused it).
explicit = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))


def reduced_custom_vjp(bwd):
    @jax.custom_vjp
    def passed_through(v):
        return v

    passed_through.defvjp(lambda v: (v, None), bwd)
    return jax.shard_map(passed_through, out_specs=jax.P(reduced={"x"}))


with jax.set_mesh(explicit):
    reduced = jax.device_put(jnp.arange(8.0), jax.P(reduced={"x"}))
    for bwd_gives, bwd in (("g", lambda _, g: (g,)), ("None", lambda _, g: (None,))):
        reduced_body = reduced_custom_vjp(bwd)
        want_grad = jax.jit(jax.grad(lambda v, f=reduced_body: f(v).sum()))(reduced)
        for name, fn in (("transform", jamp.autocast_transform(reduced_body)),
                         ("region", in_region(reduced_body))):
            got_grad = jax.jit(jax.grad(lambda v, f=fn: f(v).sum()))(reduced)
            check(got_grad.sharding == want_grad.sharding,
                  f"reduced custom_vjp {name}, bwd giving {bwd_gives}: "
                  f"{got_grad.sharding} vs {want_grad.sharding}")
            summed = jax.jit(lambda g: jax.reshard(g, jax.P()))  # (an unreduced array: sum it)
            np.testing.assert_allclose(summed(got_grad), summed(want_grad))
# An asynchronous collective (FSDP's weight gather started before a matmul and awaited after it)
# returns a future, a value with no dtype: the region read every output's dtype and failed.
# (JAX's async collectives have no public home yet: jax._src.lax.parallel.)
from jax._src.lax import parallel as async_collectives  # noqa: E402


def overlapped(x, w_shards):
    # FSDP: each device holds rows of the weight; gather them while the first matmul runs.
    @jax.shard_map(out_specs=jax.P("x", None), check_vma=False)
    def body(x, w_shard):
        started = async_collectives.all_gather_start(w_shard, "x", tiled=True)
        h = jnp.tanh((x @ x.T) @ x)                       # overlaps the gather
        return h @ started.done()
    return body(x, w_shards)


with jax.set_mesh(explicit):
    x_rows = jax.device_put(jax.random.normal(jax.random.PRNGKey(5), (16, 8)), jax.P("x", None))
    w_rows = jax.device_put(jax.random.normal(jax.random.PRNGKey(6), (8, 8)) * 0.3,
                            jax.P("x", None))
    want = jax.jit(overlapped)(x_rows, w_rows)
    for name, fn in (("transform", jamp.autocast_transform(overlapped)),
                     ("region", in_region(overlapped)),
                     ("jit in a region", in_region(jax.jit(overlapped)))):
        out = jax.jit(fn)(x_rows, w_rows)
        check(out.dtype == BF16, f"async all_gather {name}: output {out.dtype}")
        np.testing.assert_allclose(np.asarray(out, np.float32), want, rtol=5e-2, atol=5e-2)
        dots = operand_dtypes(jax.make_jaxpr(fn)(x_rows, w_rows), "dot_general")
        check(dots == [("bfloat16", "bfloat16")] * 3, f"async all_gather {name} dots {dots}")

# A float8 dot with an out_sharding of its own (JAX asks for one under an explicit-axes mesh where
# the contraction is sharded) was re-emitted without it: JAX refused the sharded contraction, or
# the result came out laid out another way, silently. It runs in float8, laid out as asked.
grid = jax.make_mesh((4, 2), ("x", "y"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
float8 = jamp.Policy(jnp.float8_e4m3fn, min_float8_flops=0)
with jax.set_mesh(grid):
    a = jax.device_put(jnp.linspace(-1, 1, 128).reshape(8, 16), jax.P("x", "y"))
    b = jax.device_put(jnp.linspace(1, -1, 128).reshape(16, 8), jax.P("y", None))
    c = jax.device_put(jnp.linspace(1, -1, 128).reshape(16, 8), jax.P(None, None))
    for name, fn, args, spec in (
        ("sharded contraction", lambda a, b: jnp.matmul(a, b, out_sharding=jax.P("x", None)),
         (a, b), jax.P("x", None)),
        ("layout asked for", lambda a, c: jnp.matmul(a, c, out_sharding=jax.P(None, "x")),
         (a, c), jax.P(None, "x")),
    ):
        out = jax.jit(jamp.autocast_transform(fn, float8))(*args)
        check(jax.typeof(out).sharding.spec == spec,
              f"float8 {name}: {jax.typeof(out).sharding.spec}, asked {spec}")
        np.testing.assert_allclose(np.asarray(out, np.float32), fn(*args), rtol=5e-2, atol=5e-2)
        report = jamp.explain(fn, *args, policy=float8)
        check(report.ops["dot_general"] == {"bfloat16": 1} and not report.float8_kept
              and report.flops.get("float8_e4m3fn"), f"float8 {name}: {report}")
        # the backward products (jamp's own transposes) take their operands' layouts
        loss = lambda a, b, fn=fn: jnp.sum(fn(a, b) ** 2)  # noqa: E731
        grads = jax.jit(jax.grad(jamp.autocast_transform(loss, float8), (0, 1)))(*args)
        want = jax.grad(loss, (0, 1))(*args)
        for got, ref, operand in zip(grads, want, args):
            check(jax.typeof(got).sharding.spec == jax.typeof(operand).sharding.spec,
                  f"float8 {name} gradient: {jax.typeof(got).sharding.spec}")
            np.testing.assert_allclose(got, ref, rtol=0.1, atol=0.1 * float(jnp.abs(ref).max()))

# A polymorphic export whose program jax.export cannot specialise (its shape refinement meets the
# gradient of a collective): tracing.load said the shapes did not fit, though they do.
import tracing  # noqa: E402

ring = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))


def summed_step(w, x):
    body = jax.shard_map(lambda x, w: jax.lax.psum(jnp.tanh(x @ w), "d"), mesh=ring,
                         in_specs=(jax.P("d"), jax.P()), out_specs=jax.P())
    return jnp.sum(body(x, w) ** 2)


w8 = jax.device_put(jnp.full((8, 8), 0.1), NamedSharding(ring, jax.P()))
x16 = jax.device_put(jnp.ones((16, 8)), NamedSharding(ring, jax.P("d")))
blob = tracing.trace(jax.grad(summed_step), (w8, x16)).export(polymorphic_shapes=(None, "8*b, 8"))
try:
    loaded = tracing.load(blob)(w8, x16)
except ValueError as err:  # (jax 0.10 and 0.12)
    check("could not specialise its program to these shapes" in str(err)
          and "do not fit" not in str(err), f"refinement failure: {err}")
else:  # a JAX whose refinement handles it: the program runs, and right
    np.testing.assert_allclose(loaded, jax.grad(summed_step)(w8, x16), rtol=1e-5)
print("sharding checks passed")
