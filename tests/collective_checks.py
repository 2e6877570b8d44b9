"""What crosses the network, on 8 host devices (run in a subprocess by test_collectives.py, since
the device count is fixed when JAX starts). Every dtype is read from the program right after
XLA's SPMD partitioner, by a regular expression of its own (not jamp's HLO reader), and
``jamp.explain(compiled=True)`` must list the same collectives. Gradient dtypes are read with
``jax.eval_shape`` (nothing compiled twice).

Exits non-zero with a message on the first failed check.
"""
import os

# The test run's compile flags (tests/conftest.py) stay: without them this process compiled
# at full optimisation, three times as long (sharding_checks 22 against 7 s).
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"])
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import re  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jamp  # noqa: E402
from jamp import _compat as compat  # noqa: E402

assert len(jax.devices()) == 8, jax.devices()
mesh = Mesh(np.array(jax.devices()), ("data",))
F32, BF16, FP8 = jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn
BF16_POLICY = jamp.Policy(BF16)
REDUCE_F32 = jamp.Policy(BF16, reduce_dtype=F32)
FP8_POLICY = jamp.Policy(FP8, min_float8_flops=0)
FP8_REDUCE = jamp.Policy(FP8, min_float8_flops=0, reduce_dtype=F32)
_COLLECTIVE = re.compile(
    r"= (\w+)\[([\d,]*)\]\S* (all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)\("
)
_NAMES = {"bf16": "bfloat16", "f32": "float32", "f8e4m3fn": "float8_e4m3fn", "f16": "float16"}


def check(condition, message):
    if not condition:
        raise SystemExit(f"FAILED: {message}")


def read(text):
    """[(kind, dtype, shape)] of the collectives in partitioned HLO text."""
    return [
        (kind, _NAMES.get(dtype, dtype), tuple(int(d) for d in dims.split(",") if d))
        for dtype, dims, kind in _COLLECTIVE.findall(text)
    ]


def partitioned(fn, *args):
    _, text = compat.compile_partitioned(jax.jit(fn).lower(*args))
    check(text is not None, f"no partitioned program for {fn}")
    return read(text)


def explained(fn, *args, policy):
    """The collective report, checked against the partitioned program it was read from."""
    report = jamp.explain(fn, *args, policy=policy, compiled=True).collectives
    listed = [(c.kind, c.dtype, c.shape) for c in report.collectives]
    check(listed == read(report.hlo), f"report {listed} vs HLO {read(report.hlo)}")
    check(report.devices == 8, f"devices {report.devices}")
    total = sum(c.bytes * c.runs for c in report.collectives)
    check(sum(report.bytes_by_dtype.values()) == total, "bytes by dtype")
    check("bytes crossing per call" in str(report), "report text")
    return report


def sums(found, shapes):
    """dtypes of the all-reduces/reduce-scatters whose result has one of ``shapes``."""
    return sorted(d for k, d, s in found if k in ("all-reduce", "reduce-scatter") and s in shapes)


def as_found(report):
    return [(c.kind, c.dtype, c.shape) for c in report.collectives]


def grad_dtypes(fn, *args):
    return {str(g.dtype) for g in jax.tree.leaves(jax.eval_shape(fn, *args))}


def loss(params, x):
    h = jnp.tanh(x @ params["w1"])
    return jnp.mean((h @ params["w2"]) ** 2)


key1, key2, key3 = jax.random.split(jax.random.PRNGKey(0), 3)
w1 = jax.random.normal(key1, (16, 32)) * 0.3
w2 = jax.random.normal(key2, (32, 8)) * 0.3
x = jax.device_put(jax.random.normal(key3, (64, 16)), NamedSharding(mesh, P("data")))
replicated = {k: jax.device_put(v, NamedSharding(mesh, P())) for k, v in (("w1", w1), ("w2", w2))}
fsdp = {k: jax.device_put(v, NamedSharding(mesh, P("data"))) for k, v in (("w1", w1), ("w2", w2))}
GRAD_SHAPES = {(16, 32), (32, 8), (32, 16), (8, 32)}  # a gradient, or its transposed product

# --- data parallel: the gradient sums in the compute dtype, float32 with reduce_dtype ---------
for policy, expected in ((jamp.Policy(F32), "float32"), (BF16_POLICY, "bfloat16"),
                         (REDUCE_F32, "float32"), (FP8_REDUCE, "float32")):
    # autocast_transform(jax.grad(loss)): the backward products are equations of the program
    found = sums(as_found(explained(jax.grad(loss), replicated, x, policy=policy)), GRAD_SHAPES)
    check(found == [expected] * 2, f"DP transform(grad) {policy}: gradient sums {found}")
    # jax.grad(autocast_transform(loss)): JAX's transposes, widened by reduce_dtype's custom_vjp
    fn = jax.grad(jamp.autocast_transform(loss, policy))
    if policy.compute_dtype != F32:
        found = sums(partitioned(fn, replicated, x), GRAD_SHAPES)
        check(found == [expected] * 2, f"DP grad(transform) {policy}: gradient sums {found}")
    check(grad_dtypes(fn, replicated, x) == {"float32"}, f"DP grad(transform) {policy} dtypes")


def region_loss(params, x):
    with jamp.autocast(REDUCE_F32):
        return loss(params, x)


found = sums(partitioned(jax.grad(region_loss), replicated, x), GRAD_SHAPES)
check(found == ["float32"] * 2, f"DP region, reduce_dtype=float32: {found}")
check(grad_dtypes(jax.grad(region_loss), replicated, x) == {"float32"}, "region grad dtype")

# 16-bit parameters: their gradients come back 16-bit, summed in float32 first.
bf16_params = jax.tree.map(lambda a: a.astype(BF16), replicated)
fn = jax.grad(jamp.autocast_transform(loss, REDUCE_F32))
check(sums(partitioned(fn, bf16_params, x), GRAD_SHAPES) == ["float32"] * 2,
      "bf16 params: sums in float32")
check(grad_dtypes(fn, bf16_params, x) == {"bfloat16"}, "bf16 params' grads")

# Accuracy: the 8-device gradient with reduce_dtype=float32 is closer to the one-device float32
# gradient than the one summed in bfloat16.
exact = jax.grad(loss)(jax.tree.map(np.asarray, replicated), np.asarray(x))
errors = {}
for name, policy in (("bf16", BF16_POLICY), ("reduce_f32", REDUCE_F32)):
    got = jax.jit(jax.grad(jamp.autocast_transform(loss, policy)))(replicated, x)
    errors[name] = max(
        float(jnp.linalg.norm(got[k].astype(F32) - exact[k]) / jnp.linalg.norm(exact[k]))
        for k in exact
    )
check(errors["reduce_f32"] < errors["bf16"], f"relative errors {errors}")

# --- FSDP: kernels gathered in the compute dtype (float8 under the float8 policy) --------------
gathered = {}
for policy, expected in ((jamp.Policy(F32), "float32"), (BF16_POLICY, "bfloat16"),
                         (FP8_POLICY, "float8_e4m3fn"), (REDUCE_F32, "bfloat16")):
    report = explained(jax.grad(loss), fsdp, x, policy=policy)
    kernels = [c for c in report.collectives if c.kind == "all-gather"]
    check({c.dtype for c in kernels} == {expected}, f"FSDP {policy}: gathers {report}")
    check({c.moves for c in kernels} == {"params['w1']", "params['w2']"}, f"moves {report}")
    gathered[str(policy)] = {c.moves: c.bytes for c in kernels}  # one kernel's gather, in bytes
    if policy.reduce_dtype is not None:
        found = set(sums(as_found(report), GRAD_SHAPES))
        check(found == {"float32"}, f"FSDP {policy}: sums {found}")
f32_gathers = gathered[str(jamp.Policy(F32))]
for policy, ratio in ((BF16_POLICY, 2), (FP8_POLICY, 4)):
    ratios = {k: f32_gathers[k] / v for k, v in gathered[str(policy)].items()}
    check(set(ratios.values()) == {ratio}, f"{policy}: float32 / gathered bytes {ratios}")

# --- scan over layers: the sums run in the loop, three times a call ---------------------------
def scan_loss(ws, x):
    def layer(h, w):
        return jnp.tanh(h @ w), None
    h, _ = jax.lax.scan(layer, x, ws)
    return jnp.mean(h ** 2)


ws = jax.device_put(jax.random.normal(key1, (3, 16, 16)) * 0.3, NamedSharding(mesh, P()))
for policy, expected in ((BF16_POLICY, "bfloat16"), (REDUCE_F32, "float32")):
    report = explained(jax.grad(scan_loss), ws, x, policy=policy)
    found = [c for c in report.collectives if c.kind == "all-reduce" and c.shape == (16, 16)]
    check([(c.dtype, c.runs) for c in found] == [(expected, 3)], f"scan {policy}: {report}")
fn = jax.grad(jamp.autocast_transform(scan_loss, REDUCE_F32))
found = sums(partitioned(fn, ws, x), {(16, 16)})
check(found == ["float32"], f"scan grad(transform) reduce_dtype: {found}")
check(grad_dtypes(fn, ws, x) == {"float32"}, "scan grad dtype")

# --- unsharded arguments: one device, said so ------------------------------------------------
single = jamp.explain(jax.grad(loss), {"w1": np.asarray(w1), "w2": np.asarray(w2)},
                      np.ones((4, 16), np.float32), compiled=True).collectives
check(single.devices == 1 and not single.collectives and "one device" in str(single),
      f"unsharded: {single}")
# --- loss scaling in pmap: one skip decision for every device (axis_name) --------------------
def pmap_loss(p, x):
    return jnp.mean((x @ p["w"]) ** 2)


rows = np.array(jax.random.normal(key1, (8, 4, 16)), np.float32)
rows[-1, -1] = 1e5  # the last device's rows overflow in float16
pmap_params = {"w": jnp.full((16, 8), 0.05)}
for axis_name, expected_finite in ((None, [True] * 7 + [False]), ("i", [False] * 8)):
    scaled = jamp.scaled_value_and_grad(jamp.autocast_transform(pmap_loss, dtype=jnp.float16),
                                        axis_name=axis_name)

    def pmap_step(scale, p, x):
        _, grads, scale, finite = scaled(scale, p, x)
        grads = jax.lax.pmean(grads, "i")  # the data-parallel sum, after the call
        return scale, finite, jamp.select_tree(finite, jax.tree.map(jnp.subtract, p, grads), p)

    scale, finite, stepped = jax.pmap(pmap_step, axis_name="i", in_axes=(None, None, 0))(
        jamp.DynamicLossScale(), pmap_params, rows)
    # Without axis_name each device decided alone: seven applied the inf sum.
    check(np.asarray(finite).tolist() == expected_finite, f"pmap finite {axis_name}: {finite}")
    if axis_name is not None:
        check(set(np.asarray(scale.loss_scale).tolist()) == {2.0 ** 14}, f"scale {scale}")
        check(bool(jnp.isfinite(stepped["w"]).all()), "pmap params stayed finite")
# --- uncommitted arrays (jnp.ones) go where fn's in_shardings or shard_map put them ---------
def fsdp_loss(p, x):
    return jnp.mean(jnp.tanh(x @ p["w"]) ** 2)


plain = ({"w": jnp.ones((64, 32))}, jnp.ones((64, 64)))
placed = (jax.device_put(plain[0], NamedSharding(mesh, P("data"))),
          jax.device_put(plain[1], NamedSharding(mesh, P("data"))))
fsdp = jax.jit(jax.grad(fsdp_loss), in_shardings=({"w": NamedSharding(mesh, P("data"))},
                                                  NamedSharding(mesh, P("data"))))
mapped = jax.shard_map(lambda p, x: jax.lax.pmean(fsdp_loss(p, x), "data"), mesh=mesh,
                       in_specs=(P(), P("data")), out_specs=P())
# (placed as fn places them: the same program)
as_mapped = (jax.device_put(plain[0], NamedSharding(mesh, P())), placed[1])
for fn, where in ((fsdp, placed), (mapped, as_mapped)):
    jax.jit(fn)(*plain)  # runs, so explain must too
    check(as_found(explained(fn, *plain, policy=BF16_POLICY))
          == as_found(explained(fn, *where, policy=BF16_POLICY)), f"uncommitted {fn}")
# --- ShapeDtypeStructs with shardings: compiled as arrays placed so would be -----------------
structs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                       placed)
check(as_found(explained(jax.grad(fsdp_loss), *structs, policy=BF16_POLICY))
      == as_found(explained(jax.grad(fsdp_loss), *placed, policy=BF16_POLICY)),
      "ShapeDtypeStructs")
# --- a lowering error names the user's pytree paths, as jax.jit(fn).lower's does -------------
on_one = jax.ShapeDtypeStruct((64, 64), F32, sharding=jax.sharding.SingleDeviceSharding(
    jax.devices()[0]))
try:
    jamp.explain(fsdp_loss, structs[0], on_one, compiled=True)
    check(False, "explain lowered arguments on different devices")
except ValueError as error:
    check("argument p['w']" in str(error) and "argument x " in str(error)
          and "a[0]" not in str(error), f"lowering error names: {error}")
# --- loop trip counts: as often as the counter steps to the bound, else unknown ------------
def loops(x):
    v = x.sum(0)
    # 1 -> 9 -> 81 -> 729: three runs a float condition does not say (not 100)
    a = jax.lax.while_loop(lambda v: v[0] < 100.0,
                           lambda v: jax.lax.psum(v, "data") + 0 * v, jnp.ones(16))
    # i = 0, 3, 6, 9: four runs (not 12)
    b = jax.lax.while_loop(lambda c: c[0] < 12,
                           lambda c: (c[0] + 3, c[1] + jax.lax.pmax(v, "data")),
                           (0, jnp.zeros(16)))[1]
    c = jax.lax.fori_loop(2, 9, lambda i, c: c + jax.lax.pmin(v, "data") * i, jnp.zeros(16))
    d = jax.lax.scan(lambda c, _: (c + jax.lax.psum(v * 2, "data"), None), jnp.zeros(16), None,
                     length=5)[0]
    return a + b + c + d


looped = jamp.explain(jax.shard_map(loops, mesh=mesh, in_specs=P("data"), out_specs=P()),
                      jax.device_put(jnp.ones((64, 16)), NamedSharding(mesh, P("data"))),
                      compiled=True).collectives
runs = sorted((c.runs is None, c.runs or 0) for c in looped.collectives)
check(runs == [(False, 4), (False, 5), (False, 7), (True, 0)], f"loop runs: {looped}")
check(" x?" in str(looped), f"unknown count shown: {looped}")
# --- the persistent compilation cache: a program found there is not partitioned again ---------
import tempfile  # noqa: E402

from tests.conftest import compilation_cache_options  # noqa: E402

with tempfile.TemporaryDirectory() as cache_dir, compilation_cache_options(
    jax_compilation_cache_dir=cache_dir,
    jax_persistent_cache_min_compile_time_secs=0,
    jax_persistent_cache_min_entry_size_bytes=0,
):  # (restored after, and the deleted folder forgotten)
    cached = [as_found(explained(jax.grad(fsdp_loss), *placed, policy=BF16_POLICY))
              for _ in range(2)]
    check(cached[0] and cached[0] == cached[1], f"explain with a persistent cache: {cached}")
    jax.jit(lambda x: x * 3)(placed[1]).block_until_ready()
    check(os.listdir(cache_dir), "the persistent cache is in use again after explain")
print("collective checks passed")
