"""One process of the multi-host check in test_distributed.py.

    python -m tests.distributed_worker OUT                   one process with 8 CPU devices
    python -m tests.distributed_worker OUT --port P --process-id I
                                                             process I of 2, 4 CPU devices each

Both forms build one global 8-device mesh and train the same data-parallel Flax model with
float16 autocast and a dynamic loss scale, then take one step on a batch that overflows on the
last device only. A process of the pair also traces the forward pass and exports the sharded
step with ``tracing``. Each process writes what it ended with to OUT/<name>.npz for the test to
compare, and exits non-zero with a message on the first failed check.
"""
import argparse
import os
import warnings

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--port", type=int)
parser.add_argument("--process-id", type=int)
args = parser.parse_args()
# JAX's CPU collectives across processes (the default today; named so a change shows up here).
jax.config.update("jax_cpu_collectives_implementation", "gloo")
if args.port is None:
    jax.config.update("jax_num_cpu_devices", 8)
    name = "one_process"
else:
    jax.config.update("jax_num_cpu_devices", 4)
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{args.port}", num_processes=2,
                               process_id=args.process_id, initialization_timeout=120)
    name = f"process_{args.process_id}"

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jamp  # noqa: E402
import tracing  # noqa: E402

STEPS = 24


def check(condition, message):
    if not condition:
        raise SystemExit(f"FAILED in {name}: {message}")


check(jax.device_count() == 8 and jax.local_device_count() == 8 // jax.process_count(),
      f"{jax.device_count()} devices, {jax.local_device_count()} local")
mesh = jax.make_mesh((8,), ("data",))   # the default axis types (explicit sharding)
replicated, by_rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(nn.relu(nn.Dense(32)(x)))


model = MLP()
rng = np.random.default_rng(0)
X = rng.normal(size=(64, 16)).astype(np.float32)   # the global batch, the same on every host
Y = rng.integers(0, 4, size=64).astype(np.int32)


def global_batch(array):
    """This process's rows of ``array`` as its part of one array sharded over all devices."""
    rows = len(array) // jax.process_count()
    local = array[jax.process_index() * rows:(jax.process_index() + 1) * rows]
    return jax.make_array_from_process_local_data(by_rows, local, array.shape)


def forward(params, x):
    return model.apply(params, x)


def loss_fn(params, x, y):
    # One-hot labels: on jax 0.12 the gradient of the integer-label form (a gather) raises a
    # ShardingTypeError on a batch-sharded explicit mesh, with or without jamp.
    labels = jax.nn.one_hot(y, 4)
    return optax.softmax_cross_entropy(forward(params, x), labels).mean()


# Plain SGD: Adam's normalized steps would magnify the rounding differences between the
# two-process and one-process sums of near-zero gradients into differences of the step size.
tx = optax.sgd(0.1)
loss16 = jamp.autocast_transform(loss_fn, dtype=jnp.float16)
scaled_grads = jamp.scaled_value_and_grad(loss16)


@jax.jit
def train_step(params, opt_state, loss_scale, x, y):
    loss, grads, loss_scale, finite = scaled_grads(loss_scale, params, x, y)
    updates, new_opt_state = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    params, opt_state = jamp.select_tree(finite, (new_params, new_opt_state),
                                         (params, opt_state))
    return params, opt_state, loss_scale, loss, finite


params = jax.jit(model.init, out_shardings=replicated)(jax.random.key(0), jnp.zeros((1, 16)))
opt_state = jax.jit(tx.init, out_shardings=replicated)(params)
# Starts too high, so the first steps overflow and back off; period=4 makes it grow again.
loss_scale = jax.device_put(jamp.DynamicLossScale(loss_scale=2.0**20, period=4), replicated)
x, y = global_batch(X), global_batch(Y)
losses, finites, scales = [], [], []
for _ in range(STEPS):
    params, opt_state, loss_scale, loss, finite = train_step(params, opt_state, loss_scale, x, y)
    losses.append(float(loss))
    finites.append(bool(finite))
    scales.append(float(loss_scale.loss_scale))


def local_copy(tree):
    """This process's copy of a replicated tree, after checking its devices agree."""
    def one(leaf):
        check(leaf.sharding.is_fully_replicated, f"{leaf.shape} is not replicated")
        shards = [np.asarray(s.data) for s in leaf.addressable_shards]
        check(all(np.array_equal(s, shards[0]) for s in shards), "local replicas differ")
        return shards[0]
    return jax.tree.map(one, tree)


trained = local_copy((params, loss_scale))
# An overflow in one device's rows (the last device, on the second host) is seen by all: the
# gradients are summed across devices before the finiteness check.
X_bad = X.copy()
X_bad[-1] = 1e5                      # beyond float16's 65504
after = train_step(params, opt_state, loss_scale, global_batch(X_bad), y)
check(not bool(after[4]), "the overflowing step was taken as finite")
check(float(after[2].loss_scale) == float(loss_scale.loss_scale) / 2, "the scale did not halve")
skipped = local_copy((after[0], after[2]))
check(all(jax.tree.leaves(jax.tree.map(np.array_equal, skipped[0], trained[0]))),
      "the overflowing step changed the parameters")

if args.port is not None:
    # tracing on many hosts: traced and checked on the global arrays (the checks gather an
    # output split over both hosts), then run like any jitted function.
    forward16 = jamp.autocast_transform(forward, dtype=jnp.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tracing.TracerWarning)
        traced = tracing.trace(forward16, (params, x))
    check(bool(jnp.allclose(traced(params, x), jax.jit(forward16)(params, x), rtol=1e-3)),
          "the traced forward pass differs from the jitted one on the global batch")
    # The sharded step, exported (under the mesh: its avals carry the explicit shardings) and
    # loaded again: an 8-device program that every host runs on its part of the batch. Its
    # checks are off: run op by op on explicit shardings, jax 0.12's log_softmax raises
    # ShardingTypeError ("select cases must have the same shardings"), without jamp too.
    with jax.set_mesh(mesh):
        blob = tracing.trace(train_step, (params, opt_state, loss_scale, x, y),
                             check_trace=False).export()
    loaded = tracing.load(blob)
    check(loaded.exported.nr_devices == 8, f"exported for {loaded.exported.nr_devices} devices")
    expected = train_step(params, opt_state, loss_scale, x, y)
    got = loaded(params, opt_state, loss_scale, x, y)
    same = jax.tree.map(lambda a, b: bool(jnp.allclose(a, b, rtol=1e-5)), got, expected)
    check(all(jax.tree.leaves(same)), "the loaded step differs from the jitted one")

leaves = jax.tree_util.tree_flatten_with_path(trained)[0]
np.savez(os.path.join(args.out, f"{name}.npz"),
         **{jax.tree_util.keystr(path): leaf for path, leaf in leaves},
         losses=np.array(losses), finites=np.array(finites), scales=np.array(scales),
         skipped_scale=skipped[1].loss_scale)
print(f"{name} done")
