"""Loss scales: the dynamic state machine, pytree survival, unscale dtype, the one-call step."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jamp

F16, F32 = jnp.float16, jnp.float32


def test_dynamic_scale_grows_after_period_finite_steps_and_backs_off():
    scale = jamp.DynamicLossScale(loss_scale=8.0, period=3, factor=2, min_loss_scale=2.0)
    history = []
    for finite in [True, True, True, True, False, False, False, True]:
        scale = scale.adjust(jnp.asarray(finite))
        history.append((float(scale.loss_scale), int(scale.counter)))
    assert history == [(8.0, 1), (8.0, 2), (16.0, 0), (16.0, 1), (8.0, 0), (4.0, 0), (2.0, 0),
                       (2.0, 1)]


def test_min_loss_scale_survives_jit_and_tree_map():
    scale = jamp.DynamicLossScale(loss_scale=4.0, min_loss_scale=3.0, period=5)
    scale = jax.jit(lambda s: s.adjust(jnp.asarray(False)))(scale)
    assert float(scale.loss_scale) == 3.0 and float(scale.min_loss_scale) == 3.0
    mapped = jax.tree.map(lambda x: x, scale)
    assert isinstance(mapped, jamp.DynamicLossScale)
    chex.assert_trees_all_equal(mapped, scale)
    assert int(jax.jit(lambda s: s.period)(scale)) == 5
    for leaf in (jamp.StaticLossScale(4.0), jamp.NoOpLossScale()):
        assert jax.tree.structure(jax.jit(lambda s: s)(leaf)) == jax.tree.structure(leaf)


@pytest.mark.parametrize("make", [lambda: jamp.StaticLossScale(1024),
                                  lambda: jamp.DynamicLossScale(2.0 ** 10)])
def test_scale_is_float32_and_unscale_divides_in_float32(make):
    scale = make()
    assert scale.loss_scale.dtype == F32
    grads = {"w": jnp.full((3,), 2048.0, F16), "step": jnp.int32(7)}
    out = scale.unscale(grads)
    assert out["w"].dtype == F32 and out["step"].dtype == jnp.int32
    np.testing.assert_allclose(out["w"], 2.0)
    assert scale.scale(jnp.float32(3.0)) == 3072.0
    assert jamp.NoOpLossScale().scale(jnp.float32(3.0)) == 3.0


def test_all_finite_and_select_tree():
    good = {"a": jnp.ones(3), "b": jnp.int32(1)}
    bad = {"a": jnp.array([1.0, jnp.inf, 0.0]), "b": jnp.int32(1)}
    assert bool(jamp.all_finite(good)) and not bool(jamp.all_finite(bad))
    assert not bool(jamp.all_finite({"a": jnp.array([jnp.nan])}))
    picked = jamp.select_tree(jnp.asarray(False), bad, good)
    chex.assert_trees_all_equal(picked, good)
    with pytest.raises(ValueError, match="one structure"):
        jamp.select_tree(jnp.asarray(True), good, {"a": jnp.ones(3)})
    with pytest.raises(ValueError, match="scalar bool"):
        jamp.select_tree(jnp.ones(2, bool), good, good)


def test_one_call_step_unscales_with_the_scale_before_adjust_on_a_growth_step():
    # period=1: every finite step grows the scale. The gradient must still be the true gradient
    # (an implementation that unscales with the adjusted scale halves it on every growth step).
    loss_fn = lambda w, x: jnp.sum(w * x)
    step = jamp.scaled_value_and_grad(loss_fn)
    scale = jamp.DynamicLossScale(loss_scale=2.0 ** 4, period=1)
    x = jnp.array([1.0, 2.0, 3.0])
    loss, grads, new_scale, finite = jax.jit(step)(scale, jnp.ones(3), x)
    assert bool(finite) and float(new_scale.loss_scale) == 2.0 ** 5
    np.testing.assert_allclose(grads, x)
    np.testing.assert_allclose(loss, 6.0)


def test_one_call_step_reports_overflow_and_optax_skips_the_update():
    loss_fn = jamp.autocast_transform(lambda w, x: jnp.sum((x @ w) ** 2), dtype=F16)
    step = jamp.scaled_value_and_grad(loss_fn)
    w, x = jnp.ones((4, 4)), jnp.full((2, 4), 100.0)
    scale = jamp.DynamicLossScale(loss_scale=2.0 ** 15)
    _, grads, new_scale, finite = step(scale, w, x)
    assert not bool(finite) and float(new_scale.loss_scale) == 2.0 ** 14
    tx = optax.apply_if_finite(optax.sgd(0.1), max_consecutive_errors=5)
    state = tx.init(w)
    updates, state = tx.update(grads, state, w)
    np.testing.assert_array_equal(optax.apply_updates(w, updates), w)  # skipped
    skipped_by_select = jamp.select_tree(finite, optax.apply_updates(w, updates), w)
    np.testing.assert_array_equal(skipped_by_select, w)


def test_one_call_step_with_aux_and_argnums():
    step = jamp.scaled_value_and_grad(lambda a, b: (jnp.sum(a * b), {"n": a.size}),
                                      argnums=(0, 1), has_aux=True)
    (loss, aux), (ga, gb), _, finite = step(jamp.StaticLossScale(8.0), jnp.ones(2), jnp.full(2, 3.0))
    assert float(loss) == 6.0 and aux == {"n": 2} and bool(finite)
    np.testing.assert_allclose(ga, 3.0)
    np.testing.assert_allclose(gb, 1.0)
