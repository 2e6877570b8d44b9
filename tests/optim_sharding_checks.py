"""jamp.optim and jamp.stochastic_round on sharded arrays (meshes of Auto and of Explicit axes)
and inside shard_map, in a subprocess with 8 host devices (run by tests/test_optim.py). Exits
non-zero with a message on the first failed check."""
import os

# The test run's compile flags (tests/conftest.py) stay: without them this process compiled
# at full optimisation, three times as long (sharding_checks 22 against 7 s).
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"])
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jamp  # noqa: E402

assert len(jax.devices()) == 8, jax.devices()
COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")


def check(condition, message):
    if not condition:
        raise SystemExit(f"FAILED: {message}")


def collectives(compiled):
    text = compiled.as_text()
    return [c for c in COLLECTIVES if c in text]


x = jax.random.normal(jax.random.key(0), (64, 32)) + 2.0**-12
key = jax.random.key(1)
round_bf16 = jax.jit(jamp.stochastic_round, static_argnums=1)
single = np.asarray(round_bf16(jax.device_put(x, jax.devices()[0]), jnp.bfloat16, key), np.float32)
for shape, spec in (((2, 4), P("a", "b")),):
    mesh = Mesh(np.array(jax.devices()).reshape(shape), ("a", "b"))
    sharded = jax.device_put(x, NamedSharding(mesh, spec))
    out = round_bf16(sharded, jnp.bfloat16, key)
    check(np.array_equal(np.asarray(out, np.float32), single),
          f"stochastic_round on a {shape} mesh differs from one device")
    check(out.sharding.is_equivalent_to(sharded.sharding, 2), f"result sharding {out.sharding}")
    found = collectives(round_bf16.lower(sharded, jnp.bfloat16, key).compile())
    check(not found, f"stochastic_round on a {shape} mesh compiled with {found}")

mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
shardings = {"w": NamedSharding(mesh, P("data", "model")), "b": NamedSharding(mesh, P("model"))}
params = jax.device_put({"w": jnp.ones((16, 8), jnp.bfloat16), "b": jnp.zeros((8,), jnp.bfloat16)},
                        shardings)
grads = jax.device_put({"w": jnp.full((16, 8), 1e-3, jnp.float32),
                        "b": jnp.full((8,), -1e-3, jnp.float32)}, shardings)
recipes = {
    "stochastic_rounding(state_dtype(adamw))":
        jamp.optim.stochastic_rounding(jamp.optim.state_dtype(optax.adamw(1e-3))),
    "master_weights(state_dtype(adamw))":
        jamp.optim.master_weights(jamp.optim.state_dtype(optax.adamw(1e-3))),
}
for name, tx in recipes.items():
    state = tx.init(params)  # eagerly: zeros_like keeps the parameter's sharding
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        if leaf.ndim:
            where = jax.tree_util.keystr(path)
            like = shardings["w" if leaf.shape == (16, 8) else "b"]
            check(leaf.sharding.is_equivalent_to(like, leaf.ndim),
                  f"{name}: state{where} is {leaf.sharding}, its parameter {like}")
    update = jax.jit(tx.update)
    found = collectives(update.lower(grads, state, params).compile())
    check(not found, f"{name}: compiled update has {found}")
    updates, new_state = update(grads, state, params)  # (stochastic_round: checked above)
    new_params = optax.apply_updates(params, updates)
    check(new_params["w"].sharding.is_equivalent_to(shardings["w"], 2), f"{name}: param sharding")

# A mesh of explicit axes (jax.make_mesh's default) with the key on it, as a jitted step's own
# outputs are: float16 and float8 raised ShardingTypeError, and the bits were hashed whole on
# every device and sliced. Same bits as on one device, made shard by shard.
explicit = jax.make_mesh((8,), ("data",))
rows = NamedSharding(explicit, P("data"))
key_on_mesh = jax.device_put(key, NamedSharding(explicit, P()))
for dtype in (jnp.bfloat16, jnp.float16):
    name = jnp.dtype(dtype).name
    alone = np.asarray(round_bf16(jax.device_put(x, jax.devices()[0]), dtype, key), np.float32)
    compiled = round_bf16.lower(jax.device_put(x, rows), dtype, key_on_mesh).compile()
    out = compiled(jax.device_put(x, rows), key_on_mesh)
    check(np.array_equal(np.asarray(out, np.float32), alone),
          f"{name}: stochastic_round on an explicit mesh differs from one device")
    check(out.sharding.spec == P("data", None), f"{name}: result sharding {out.sharding}")
    text = compiled.as_text()
    check(not [c for c in COLLECTIVES if c in text], f"{name}: explicit mesh, collectives")
    check("u32[64,32]" not in text, f"{name}: the bits of the whole array on every device")
# vmap over the split axis, a key an example (jax 0.12 lost the mesh in a where of scalars)
keys = jax.random.split(key, 64)
per_row = jax.jit(jax.vmap(lambda r, k: jamp.stochastic_round(r, jnp.float16, k)))
batched = per_row(jax.device_put(x, rows), jax.device_put(keys, rows))
check(np.array_equal(np.asarray(batched, np.float32), np.asarray(per_row(x, keys), np.float32)),
      "vmap on an explicit mesh differs from one device")

# Inside shard_map the body sees its shard alone: one key gives every shard the same bits (the
# documented limit). Folding the shard's position into the key gives each its own; a value
# replicated across the axis keeps the plain key and stays the same on every shard.
piece = jnp.full((512,), 1.0 + 2.0**-8)  # a bfloat16 half step over 1: up with probability 1/2
half = jax.device_put(jnp.tile(piece, 8), rows)


def shard_rounding(fold):
    def body(split, replicated):
        own = jax.random.fold_in(key, jax.lax.axis_index("data")) if fold else key
        return (jamp.stochastic_round(split, jnp.bfloat16, own),
                jamp.stochastic_round(replicated, jnp.bfloat16, key)[None])
    mapped = jax.shard_map(body, mesh=explicit, in_specs=(P("data"), P()),
                           out_specs=(P("data"), P("data")))
    everywhere = jax.device_put(piece, NamedSharding(explicit, P()))
    split, replicated = jax.jit(mapped)(half, everywhere)
    return np.asarray(split, np.float32).reshape(8, 512), np.asarray(replicated, np.float32)


same, _ = shard_rounding(fold=False)
check(all(np.array_equal(same[0], same[i]) for i in range(8)), "shard_map: shards' bits differ")
own, replicated = shard_rounding(fold=True)
up = own > 1
check(abs(up.mean() - 0.5) < 0.02, f"shard_map with the folded key: {up.mean()} went up")
# each pair of shards agrees on about half the elements (unrelated draws), not on all
agree = [np.mean(up[0] == up[i]) for i in range(1, 8)]
check(all(abs(a - 0.5) < 0.1 for a in agree), f"shard_map with the folded key: agreement {agree}")
shard_keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(8))
alone = jax.jit(jax.vmap(lambda k: jamp.stochastic_round(piece, jnp.bfloat16, k)))(shard_keys)
check(np.array_equal(own, np.asarray(alone, np.float32)), "shard_map: a shard not its key's")
check(all(np.array_equal(replicated[i], replicated[0]) for i in range(8)),
      "shard_map: a replicated value rounded differently on some shard")

# jamp.optim's key comes from its state: the guide's remedy is the update outside shard_map,
# under jit on the sharded arrays, where the bits are the whole array's. sgd moves 1.0 by an
# eighth of a bfloat16 step: up with probability 1/8, not on the same elements of each shard.
tx = jamp.optim.stochastic_rounding(optax.sgd(2.0**-10))
weights = {"w": jax.device_put(jnp.ones((8 * 256,), jnp.bfloat16), rows)}
grads_of = jax.shard_map(lambda w: {"w": -jnp.ones_like(w["w"], jnp.float32)}, mesh=explicit,
                         in_specs=P("data"), out_specs=P("data"))


@jax.jit
def step(w, s):
    updates, s = tx.update(grads_of(w), s, w)
    return optax.apply_updates(w, updates)


moved = np.asarray(step(weights, tx.init(weights))["w"], np.float32).reshape(8, 256) > 1
check(abs(moved.mean() - 1 / 8) < 0.03, f"update outside shard_map: {moved.mean()} went up")
check(not all(np.array_equal(moved[0], moved[i]) for i in range(8)),
      "update outside shard_map: every shard rounded alike")
print("optim sharding checks passed")
