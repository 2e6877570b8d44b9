"""Port of DeepMind jmp's ``jmp/_src/loss_scale_test.py`` (google-deepmind/jmp at 9c1cdbb).

Same inputs and expected numbers. jamp keeps jmp's names but differs by design where noted:
every field is a pytree leaf (so ``period``, ``factor`` and ``min_loss_scale`` survive ``jit``),
``unscale`` always returns float32, and construction rejects scales that would stall training
(0, negative, non-finite, a float ``period``) instead of accepting or warning.
"""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jamp

# jmp's own expected values compute float32(10) / 3**100, which numpy reports as an overflow.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")


def test_no_op_loss_scale():
    loss_scale = jamp.NoOpLossScale()
    tree = {"a": jnp.ones([])}
    assert loss_scale.scale(tree) is tree
    # jmp: unscale(tree) is tree. jamp's unscale returns float32 copies for every scale (a
    # bfloat16 gradient comes back float32), so here the values are equal, not the object.
    unscaled = loss_scale.unscale(tree)
    assert unscaled["a"].dtype == jnp.float32 and float(unscaled["a"]) == 1.0


@pytest.mark.parametrize("cls, scale", [
    (jamp.StaticLossScale, 2), (jamp.StaticLossScale, 3), (jamp.StaticLossScale, 4),
    (jamp.DynamicLossScale, 2.), (jamp.DynamicLossScale, 3.), (jamp.DynamicLossScale, 4.),
])
def test_static_loss_scale(cls, scale):
    loss_scale = cls(scale)
    tree = {"a": jnp.array(1.)}
    scaled_tree = {"a": jnp.array(1. * scale)}
    assert loss_scale.scale(tree) == scaled_tree
    assert loss_scale.unscale(scaled_tree) == tree


def test_static_empty_trees():
    assert jax.tree_util.tree_leaves(jamp.NoOpLossScale()) == []
    # jmp: StaticLossScale(0) has no leaves. In jamp the scale is a leaf (it can be traced and
    # changed under jit), and 0 is rejected: every gradient would be 0/0.
    assert jax.tree_util.tree_leaves(jamp.StaticLossScale(2)) == [2.0]
    with pytest.raises(ValueError, match="StaticLossScale.loss_scale must be > 0"):
        jamp.StaticLossScale(0)


def test_dynamic_loss_scale_no_warnings():
    with warnings.catch_warnings(record=True) as logged_warnings:
        warnings.simplefilter("always")
        jamp.DynamicLossScale(2. ** 15)
    assert logged_warnings == []


def test_dynamic_loss_scale_tree():
    scale = jnp.ones([])
    counter = jnp.zeros([], jnp.int32)
    period = 2000
    factor = 2
    loss_scale = jamp.DynamicLossScale(scale, counter, period, factor)
    # jmp: the leaves are [scale, counter]. jamp: every field, so all of them survive jit.
    assert jax.tree_util.tree_leaves(loss_scale) == [
        scale, counter, period, factor, 1.0, np.finfo(np.float32).max, 0]
    assert jax.tree_util.tree_map(lambda x: x, loss_scale) == loss_scale


@pytest.mark.parametrize("period, factor", [(20, 2), (30, 3)])
def test_dynamic_loss_scale_adjust_increases_on_finite(period, factor):
    grads_finite = jnp.bool_(True)
    loss_scale = jamp.DynamicLossScale(jnp.float32(10), jnp.int32(0), period, factor)
    for i in range(1, period):
        loss_scale = loss_scale.adjust(grads_finite)
        assert loss_scale.loss_scale == 10
        assert loss_scale.counter == i
        assert loss_scale.period == period
        assert loss_scale.factor == factor

    # Loss scale should wrap.
    loss_scale = loss_scale.adjust(grads_finite)
    assert loss_scale.loss_scale == 10 * factor
    assert loss_scale.counter == 0
    assert loss_scale.period == period
    assert loss_scale.factor == factor


@pytest.mark.parametrize("period, factor", [(20, 2), (30, 3)])
def test_dynamic_loss_scale_adjust_reduce_on_non_finite(period, factor):
    grads_finite = jnp.bool_(False)
    init = np.float32(10)
    loss_scale = jamp.DynamicLossScale(jnp.asarray(init), jnp.int32(0), period, factor)
    assert init / (factor ** 100) < 1, "should cover max(1, S)"
    for i in range(100):
        loss_scale = loss_scale.adjust(grads_finite)
        np.testing.assert_allclose(loss_scale.loss_scale, max(1, init / (factor ** (i + 1))),
                                   rtol=1e-5)
        assert loss_scale.counter == 0
        assert loss_scale.period == period
        assert loss_scale.factor == factor


def _check_min_loss_scale_sequence(loss_scale, init, factor, floor):
    for i in range(100):
        loss_scale = loss_scale.adjust(jnp.bool_(False))
        np.testing.assert_allclose(loss_scale.loss_scale, max(floor, init / (factor ** (i + 1))),
                                   rtol=1e-5)
        assert loss_scale.counter == 0
        assert loss_scale.factor == factor


@pytest.mark.parametrize("period, factor, min_loss_scale", [(20, 2, .3125), (30, 3, .37)])
def test_dynamic_loss_scale_explicit_min_loss_scale(period, factor, min_loss_scale):
    init = np.float32(10)
    loss_scale = jamp.DynamicLossScale(jnp.asarray(init), jnp.int32(0), period, factor,
                                       jnp.asarray(min_loss_scale))
    assert init / (factor ** 100) < 1, "should cover max(1, S)"
    _check_min_loss_scale_sequence(loss_scale, init, factor, min_loss_scale)


def test_dynamic_loss_scale_explicit_min_loss_scale_zero():
    # jmp's third case, (period=5., factor=2., min_loss_scale=0.), is rejected by jamp: a float
    # period and a zero minimum (the scale could reach 0 and every gradient become 0/0).
    init = np.float32(10)
    with pytest.raises(TypeError, match="DynamicLossScale.period must be an int"):
        jamp.DynamicLossScale(jnp.asarray(init), jnp.int32(0), 5., 2., jnp.asarray(0.))
    with pytest.raises(ValueError, match="DynamicLossScale.min_loss_scale must be > 0"):
        jamp.DynamicLossScale(jnp.asarray(init), jnp.int32(0), 5, 2., jnp.asarray(0.))
    # "no minimum" is min_loss_scale=None (as flax), and gives jmp's expected numbers.
    loss_scale = jamp.DynamicLossScale(jnp.asarray(init), jnp.int32(0), 5, 2., None)
    _check_min_loss_scale_sequence(loss_scale, init, 2., 0.)


def test_dynamic_loss_scale_adjust_requires_scalar_input():
    # Empty in jmp; jamp checks it.
    with pytest.raises(ValueError, match="expects a scalar bool"):
        jamp.DynamicLossScale(jnp.float32(10)).adjust(jnp.array([True, False]))


def test_dynamic_loss_scale_int_loss_scale_is_converted():
    # jmp warns "Expected floating type for loss_scale"; jamp converts to float32 (the scale's
    # dtype whatever it is given in), so nothing is left to warn about.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss_scale = jamp.DynamicLossScale(jnp.asarray(1, dtype=jnp.int32))
    assert loss_scale.loss_scale.dtype == jnp.float32


def test_dynamic_loss_scale_int_min_loss_scale_is_converted():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss_scale = jamp.DynamicLossScale(jnp.asarray(1, dtype=jnp.float32),
                                           min_loss_scale=jnp.asarray(1, dtype=jnp.int32))
    assert loss_scale.min_loss_scale.dtype == jnp.float32


@pytest.mark.parametrize("non_finite", [jnp.inf, jnp.nan])
def test_all_finite(non_finite):
    assert jamp.all_finite(None)
    assert jamp.all_finite({})
    assert not jamp.all_finite({"a": jnp.array(non_finite)})
    assert not jamp.all_finite({"a": jnp.ones([]), "b": jnp.array(non_finite)})
    assert not jamp.all_finite({"a": jnp.array(non_finite), "b": jnp.ones([])})
    assert jamp.all_finite({"a": jnp.ones([]), "b": jnp.ones([])})


def test_select_tree():
    a = {"a": jnp.ones([]), "b": jnp.zeros([])}
    b = {"a": jnp.zeros([]), "b": jnp.ones([])}
    assert jamp.select_tree(jnp.bool_(True), None, None) is None
    assert jamp.select_tree(jnp.bool_(False), None, None) is None
    assert jamp.select_tree(jnp.bool_(True), a, b) == a
    assert jamp.select_tree(jnp.bool_(False), a, b) == b


def test_select_tree_rejects_non_scalar():
    # jmp raises AssertionError("expected boolean scalar"); jamp a ValueError (asserts vanish
    # under python -O).
    with pytest.raises(ValueError, match="scalar bool"):
        jamp.select_tree(jnp.ones([1]), None, None)
