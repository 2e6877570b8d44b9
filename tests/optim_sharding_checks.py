"""jamp.optim and jamp.stochastic_round on sharded arrays, in a subprocess with 8 host devices
(run by tests/test_optim.py). Exits non-zero with a message on the first failed check."""
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
print("optim sharding checks passed")
