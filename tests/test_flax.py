"""Training Flax models under autocast: linen (mutable batch_stats) and NNX (state written back)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import jamp

BF16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
X = jax.random.normal(jax.random.PRNGKey(0), (16, 8, 8, 1))
Y = jax.random.randint(jax.random.PRNGKey(1), (16,), 0, 10)


class LinenCNN(nn.Module):
    @nn.compact
    def __call__(self, x, train):
        x = nn.Conv(8, (3, 3))(x)
        x = nn.relu(nn.BatchNorm(use_running_average=not train)(x))
        return nn.Dense(10)(x.reshape(x.shape[0], -1))


def _xent(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(F32), labels).mean()


@pytest.mark.parametrize("policy", [jamp.Policy(), jamp.Policy(cast_inputs=True)])
def test_linen_training_steps_with_batch_stats(policy):
    model = LinenCNN()
    variables = model.init(jax.random.PRNGKey(2), X, False)
    apply = jamp.autocast_transform(model.apply, policy)
    tx = optax.adam(1e-2)  # kept outside autocast: Adam's b2 = 0.999 rounds to 1.0 in bfloat16

    def loss_fn(params, stats):
        logits, updates = apply({"params": params, "batch_stats": stats}, X, True,
                                mutable=["batch_stats"])
        assert logits.dtype == BF16
        return _xent(logits, Y), updates["batch_stats"]

    @jax.jit
    def step(params, stats, opt_state):
        (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, stats)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), stats, opt_state, loss, grads

    params, stats = variables["params"], variables["batch_stats"]
    opt_state, losses = tx.init(params), []
    for _ in range(5):
        params, new_stats, opt_state, loss, grads = step(params, stats, opt_state)
        assert {g.dtype for g in jax.tree.leaves(grads)} == {F32}
        assert jamp.all_finite(grads)
        assert {s.dtype for s in jax.tree.leaves(new_stats)} == {F32}
        assert not np.allclose(new_stats["BatchNorm_0"]["mean"], stats["BatchNorm_0"]["mean"])
        stats = new_stats
        losses.append(float(loss))
    assert losses[-1] < losses[0]


class NNXNet(nnx.Module):
    def __init__(self, rngs):
        self.conv = nnx.Conv(1, 8, (3, 3), rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.head = nnx.Linear(8 * 8 * 8, 10, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.bn(self.conv(x)))
        return self.head(x.reshape(x.shape[0], -1))


def test_nnx_module_argument_state_is_written_back():
    model = NNXNet(nnx.Rngs(0))
    before = np.asarray(model.bn.mean[...])
    logits = jamp.autocast_transform(lambda m, x: m(x))(model, X)
    assert logits.dtype == BF16
    assert model.bn.mean[...].dtype == F32
    assert not np.allclose(model.bn.mean[...], before)  # BatchNorm statistics came back
    model.eval()
    frozen = np.asarray(model.bn.mean[...])
    jamp.autocast_transform(lambda m, x: m(x))(model, X)
    np.testing.assert_array_equal(model.bn.mean[...], frozen)


def test_nnx_training_with_value_and_grad_and_jit():
    model = NNXNet(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    loss_fn = jamp.autocast_transform(lambda m, x, y: _xent(m(x), y))

    @nnx.jit
    def step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
        optimizer.update(model, grads)
        return loss, grads

    losses = []
    for _ in range(5):
        loss, grads = step(model, optimizer, X, Y)
        leaves = jax.tree.leaves(grads)
        assert leaves and {g.dtype for g in leaves} == {F32}
        assert all(bool(jnp.all(jnp.isfinite(g))) for g in leaves)
        losses.append(float(loss))
    assert losses[-1] < losses[0]
