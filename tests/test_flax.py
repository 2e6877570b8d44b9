"""Training Flax models under autocast: linen (mutable batch_stats) and NNX (state written back)."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import jamp
from tests.jaxpr_utils import eqns_named

BF16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
# (Drawn with numpy and placed with device_put: data built with jax ops at import compiles in
# every test process.)
X = jax.device_put(np.random.default_rng(0).standard_normal((16, 8, 8, 1), np.float32))
Y = jax.device_put(np.random.default_rng(1).integers(0, 10, (16,), dtype=np.int32))


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


class _Stack(nn.Module):
    """Dense, LayerNorm, head: from-flax.md's model with its float32 layers left to rules."""

    float32_layers: bool = False

    @nn.compact
    def __call__(self, x):
        f32 = dict(dtype=jnp.float32) if self.float32_layers else {}
        x = nn.relu(nn.Dense(32, dtype=jnp.bfloat16 if self.float32_layers else None)(x))
        x = nn.LayerNorm(**f32)(x)
        return nn.Dense(4, name="head", **f32)(x)


@pytest.mark.parametrize("cast_inputs", [False, True])
def test_a_rule_of_none_runs_its_modules_as_written_in_float32(cast_inputs):
    """``rules=(("*LayerNorm*", None), ("*/head", None))`` is from-flax.md's mapping of
    ``dtype=jnp.float32`` on those layers. Under the transform the LayerNorm's statistics ran in
    bfloat16 (Flax's float32 upcast of a value traced float32 left nothing in the program): the
    output was 14x further from float32 than with no rule. Now it matches the hand-mixed model."""
    x = jax.random.normal(jax.random.key(0), (4, 8))
    variables = _Stack().init(jax.random.key(2), x)
    variables["params"]["Dense_0"]["bias"] = jnp.full((32,), 50.0)  # an activation offset
    policy = jamp.Policy(
        cast_inputs=cast_inputs, rules=(("*LayerNorm*", None), ("*/head", None))
    )
    transformed = jamp.autocast_transform(_Stack().apply, policy)
    jaxpr = jax.make_jaxpr(transformed)(variables, x)
    kept = [
        (e.primitive.name, str(e.outvars[0].aval.dtype))
        for e in jaxpr.eqns
        if e.primitive.name in ("reduce_sum", "rsqrt", "square", "integer_pow", "dot_general")
    ]
    assert kept[0] == ("dot_general", "bfloat16")
    assert kept[1:] and all(dtype == "float32" for _, dtype in kept[1:]), kept
    if cast_inputs:  # (the parameters arrive rounded to bfloat16, then computed in float32)
        variables = jax.tree.map(lambda p: p.astype(jnp.bfloat16).astype(jnp.float32), variables)
    by_hand = _Stack(float32_layers=True).apply(variables, x)
    np.testing.assert_allclose(transformed(variables, x), by_hand, rtol=1e-5, atol=1e-5)


class _TiedLM(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(16, 8, name="embed")
        h = nn.Dense(8, name="mlp")(embed(tokens))
        return embed.attend(h)


@pytest.mark.parametrize("form", ["transform", "region"])
def test_a_rule_on_a_linen_module_covers_its_other_methods(form):
    """``Embed.attend`` (a tied output layer) runs under the scope ``LM/embed.attend``: a rule
    ``*/embed`` missed it, silently (the rule matched the lookup, so nothing warned)."""
    tokens = jnp.arange(6).reshape(2, 3)
    variables = _TiedLM().init(jax.random.key(0), tokens)
    policy = jamp.Policy(rules=(("*/embed", None),))
    if form == "transform":
        run = jamp.autocast_transform(_TiedLM().apply, policy)
    else:
        def run(v, t):
            with jamp.autocast(policy):
                return _TiedLM().apply(v, t)
    with warnings.catch_warnings():
        warnings.simplefilter("error", jamp.UnmatchedRuleWarning)
        jaxpr = jax.make_jaxpr(run)(variables, tokens)
    dots = [str(e.outvars[0].aval.dtype) for e in eqns_named(jaxpr.jaxpr, "dot_general")]
    assert dots == ["bfloat16", "float32"]  # the mlp in bfloat16, attend (as written) float32


class _HalfBlock(nn.Module):
    @nn.compact
    @jamp.autocast(dtype=jnp.float16)
    def __call__(self, x):
        return nn.Dense(4)(x)


def test_a_decorated_linen_method_runs_as_a_region_outside_one():
    """``@jamp.autocast(dtype=...)`` on a linen ``__call__`` (torch's decorated forward) raised
    a TypeError about ``self`` from ``model.init`` and from a plain ``apply``: its module cannot
    be a transformed program's argument, so it makes a region there."""
    x = jnp.ones((2, 4))
    variables = _HalfBlock().init(jax.random.key(0), x)
    assert variables["params"]["Dense_0"]["kernel"].dtype == jnp.float32
    assert _HalfBlock().apply(variables, x).dtype == jnp.float16
    assert jax.jit(_HalfBlock().apply)(variables, x).dtype == jnp.float16
    grads = jax.grad(lambda v: _HalfBlock().apply(v, x).astype(jnp.float32).sum())(variables)
    assert grads["params"]["Dense_0"]["kernel"].dtype == jnp.float32


def test_an_unmatched_rule_on_a_linen_apply_names_no_place_inside_flax():
    """The warning named ``apply at .../site-packages/flax/linen/module.py:2091``: no place of
    the user's (the warning itself is at the user's line)."""
    x = jnp.ones((2, 8))
    variables = _Stack().init(jax.random.key(0), x)
    policy = jamp.Policy(rules=(("*Head", None),))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jamp.autocast_transform(_Stack().apply, policy)(variables, x)
    found = [w for w in caught if issubclass(w.category, jamp.UnmatchedRuleWarning)]
    assert len(found) == 1 and found[0].filename == __file__
    message = str(found[0].message)
    assert "matched no scope of apply;" in message and "site-packages" not in message
