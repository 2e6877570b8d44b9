"""Loss scales: the dynamic state machine, pytree survival, unscale dtype, the one-call step."""
import re

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


# --- construction validates every field, naming it ----------------------------------------------

@pytest.mark.parametrize("kwargs, error, culprit", [
    (dict(factor=0.5), ValueError, "DynamicLossScale.factor must be finite and > 1, got 0.5"),
    (dict(factor=1), ValueError, "DynamicLossScale.factor must be finite and > 1"),
    (dict(factor=float("inf")), ValueError, "DynamicLossScale.factor must be finite and > 1"),
    (dict(period=0), ValueError, "DynamicLossScale.period must be >= 1, got 0"),
    (dict(period=-5), ValueError, "DynamicLossScale.period must be >= 1, got -5"),
    (dict(period=2.5), TypeError, "DynamicLossScale.period must be an int"),
    (dict(counter=-1), ValueError, "DynamicLossScale.counter must be >= 0"),
    (dict(counter=2000), ValueError, "DynamicLossScale.counter must be < period (2000)"),
    (dict(loss_scale=float("inf")), ValueError, "DynamicLossScale.loss_scale must be finite"),
    (dict(loss_scale=float("nan")), ValueError, "DynamicLossScale.loss_scale must be finite"),
    (dict(loss_scale=-1.0), ValueError, "DynamicLossScale.loss_scale must be > 0, got -1.0"),
    (dict(loss_scale=0), ValueError, "DynamicLossScale.loss_scale must be > 0"),
    (dict(loss_scale=lambda: jnp.float16(2 ** 16)), ValueError, "float16 cannot hold the value"),
    (dict(loss_scale=1e39), ValueError, "DynamicLossScale.loss_scale=1e+39 overflows float32"),
    (dict(loss_scale=jnp.ones(2)), ValueError, "DynamicLossScale.loss_scale must be a scalar"),
    (dict(loss_scale="big"), TypeError, "DynamicLossScale.loss_scale must be a real number"),
    (dict(loss_scale=4.0, min_loss_scale=8.0), ValueError,
     "DynamicLossScale.min_loss_scale=8.0 must be <= loss_scale=4.0"),
    (dict(min_loss_scale=0.0), ValueError, "DynamicLossScale.min_loss_scale must be > 0"),
    (dict(min_loss_scale=float("-inf")), ValueError, "DynamicLossScale.min_loss_scale must be finite"),
    (dict(loss_scale=8.0, max_loss_scale=4.0), ValueError,
     "DynamicLossScale.max_loss_scale=4.0 must be >= loss_scale=8.0"),
    (dict(max_loss_scale=float("inf")), ValueError, "DynamicLossScale.max_loss_scale must be finite"),
])
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_dynamic_scale_fields_are_validated_by_name(kwargs, error, culprit):
    kwargs = {k: v() if callable(v) else v for k, v in kwargs.items()}  # build float16 inf here
    with pytest.raises(error) as info:
        jamp.DynamicLossScale(**kwargs)
    assert culprit in str(info.value)


@pytest.mark.parametrize("value, culprit", [
    (0.0, "must be > 0"), (-2.0, "must be > 0"), (float("inf"), "must be finite"),
    (lambda: jnp.float16(70000), "float16 cannot hold"), (True, "must be a real number"),
    (None, "must be a real number, got NoneType"),
])
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_static_scale_is_validated(value, culprit):
    value = value() if callable(value) else value
    with pytest.raises((ValueError, TypeError), match=f"StaticLossScale.loss_scale.*{culprit}"):
        jamp.StaticLossScale(value)


def test_a_static_scale_past_the_losss_dtype_is_refused_where_a_dynamic_one_backs_off():
    """2**16 is inf in float16: a float16 loss scaled by it, and every gradient, is inf at every
    step, and a static scale never backs off (every step was skipped, silently)."""
    params, x = {"w": jnp.full((4, 2), 0.1)}, jnp.ones((8, 4))

    def loss16(p, x):
        return jnp.mean((x.astype(F16) @ p["w"].astype(F16)) ** 2)

    with pytest.raises(ValueError, match=r"StaticLossScale\(65536\)\.scale: the scale is past "
                                         r"float16's largest value \(65504\).*every step"):
        jamp.scaled_value_and_grad(loss16)(jamp.StaticLossScale(2.0 ** 16), params, x)
    fits = jamp.scaled_value_and_grad(loss16)(jamp.StaticLossScale(2.0 ** 12), params, x)
    assert bool(fits[3])  # finite at a scale float16 holds
    assert jamp.StaticLossScale(2.0 ** 16).scale(jnp.float32(0.5)) == 2.0 ** 15  # float32 loss
    dynamic = jamp.scaled_value_and_grad(loss16)(jamp.DynamicLossScale(2.0 ** 16), params, x)
    assert not bool(dynamic[3]) and float(dynamic[2].loss_scale) == 2.0 ** 15  # backs off


def test_min_loss_scale_none_means_no_minimum_as_flax():
    scale = jamp.DynamicLossScale(loss_scale=1.0, min_loss_scale=None, factor=2)
    for _ in range(10):
        scale = scale.adjust(jnp.asarray(False))
    assert float(scale.loss_scale) == 2.0 ** -10  # below jamp's default minimum of 1
    for _ in range(200):
        scale = scale.adjust(jnp.asarray(False))
    # never 0 (0 would make every unscaled gradient 0/0 = NaN): the smallest normal float32
    assert float(scale.loss_scale) == np.finfo(np.float32).tiny


def test_integer_and_numpy_fields_are_accepted_and_converted():
    scale = jamp.DynamicLossScale(loss_scale=np.int64(1024), counter=np.int32(3),
                                  period=jnp.int32(10), factor=3, min_loss_scale=jnp.float32(2))
    assert scale.loss_scale.dtype == F32 and float(scale.loss_scale) == 1024.0
    assert scale.counter.dtype == jnp.int32 and scale.period.dtype == jnp.int32
    assert scale.factor.dtype == F32 and scale.max_loss_scale.dtype == F32


# --- growth is capped ----------------------------------------------------------------------------

def test_growth_stops_at_the_float32_maximum_by_default():
    scale = jamp.DynamicLossScale(loss_scale=2.0 ** 127, period=1)
    for _ in range(3):
        scale = scale.adjust(jnp.asarray(True))
        assert np.isfinite(float(scale.loss_scale))
    assert float(scale.loss_scale) == np.finfo(np.float32).max
    # and an overflow from there backs off to a finite, smaller scale
    assert float(scale.adjust(jnp.asarray(False)).loss_scale) == np.finfo(np.float32).max / 2


def test_max_loss_scale_caps_growth_under_jit():
    scale = jamp.DynamicLossScale(loss_scale=2.0 ** 14, period=1, max_loss_scale=2.0 ** 15)
    adjust = jax.jit(lambda s: s.adjust(jnp.asarray(True)))
    history = []
    for _ in range(3):
        scale = adjust(scale)
        history.append(float(scale.loss_scale))
    assert history == [2.0 ** 15] * 3
    assert float(scale.max_loss_scale) == 2.0 ** 15


def test_adjust_wants_a_scalar_bool():
    with pytest.raises(ValueError, match="adjust\\(grads_finite\\) expects a scalar bool.*float32\\[3\\]"):
        jamp.DynamicLossScale().adjust(jnp.ones(3))
    with pytest.raises(ValueError, match="expects a scalar bool"):
        jamp.StaticLossScale(2.0).adjust(jnp.ones((), jnp.int32))


# --- pytree-ness and jit survive validation ------------------------------------------------------

def test_scales_made_of_tracers_and_placeholders_are_not_validated():
    scale = jamp.DynamicLossScale(loss_scale=8.0, period=4)
    # jit, tree.map to placeholders and eval_shape rebuild scales from non-numbers
    assert jax.tree.leaves(jax.tree.map(lambda x: None, scale)) == []
    shapes = jax.eval_shape(lambda s: s.adjust(jnp.asarray(True)), scale)
    assert shapes.loss_scale.shape == () and shapes.counter.dtype == jnp.int32
    # built inside jit from traced values (no concrete value to check there)
    made = jax.jit(lambda v: jamp.DynamicLossScale(loss_scale=v, period=4))(jnp.float32(16))
    assert float(made.loss_scale) == 16.0
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(scale)[0]]
    assert paths == [".loss_scale", ".counter", ".period", ".factor", ".min_loss_scale",
                     ".max_loss_scale", ".skips_at_min"]


# --- scale/unscale accept Python and numpy scalars -----------------------------------------------

@pytest.mark.parametrize("make", [lambda: jamp.StaticLossScale(8.0),
                                  lambda: jamp.DynamicLossScale(8.0)])
def test_scale_and_unscale_python_and_numpy_scalars(make):
    scale = make()
    product = scale.scale(3.0)
    assert float(product) == 24.0 and product.dtype == F32
    half = scale.scale(np.float16(3.0))
    assert float(half) == 24.0 and half.dtype == F16
    assert float(scale.unscale(24.0)) == 3.0 and scale.unscale(np.float16(24.0)).dtype == F32
    assert scale.scale({"loss": 1.5, "step": 3}) == {"loss": 12.0, "step": 3}  # ints untouched
    assert jamp.NoOpLossScale().scale(3.0) == 3.0


# --- scaled_value_and_grad says what it expected -------------------------------------------------

def _loss(w, x):
    return jnp.sum(w * x)


def test_step_rejects_a_float_where_the_loss_scale_goes():
    step = jamp.scaled_value_and_grad(_loss)
    with pytest.raises(TypeError) as info:
        step(2.0 ** 15, jnp.ones(2), jnp.ones(2))
    message = str(info.value)
    assert "the first argument must be a jamp loss scale" in message
    assert "got float 32768.0" in message and "jamp.StaticLossScale(32768.0)" in message


def test_step_detects_swapped_arguments():
    step = jamp.scaled_value_and_grad(_loss)
    with pytest.raises(TypeError, match="got float32\\[2\\], and a loss scale as argument 2.*swapped"):
        step(jnp.ones(2), jamp.DynamicLossScale(), jnp.ones(2))


def test_a_loss_aux_pair_without_has_aux_is_explained():
    step = jamp.scaled_value_and_grad(lambda w, x: (_loss(w, x), {"n": 1}))
    with pytest.raises(TypeError, match="returned a tuple of 2.*pass has_aux=True"):
        step(jamp.DynamicLossScale(), jnp.ones(2), jnp.ones(2))
    with_aux = jamp.scaled_value_and_grad(_loss, has_aux=True)
    with pytest.raises(TypeError, match="_loss must return a \\(loss, aux\\) pair, got float32\\[\\]"):
        with_aux(jamp.DynamicLossScale(), jnp.ones(2), jnp.ones(2))


def test_a_non_scalar_loss_is_explained():
    step = jamp.scaled_value_and_grad(lambda w: w * 2)
    with pytest.raises(TypeError, match="must return a scalar floating loss, got float32\\[3\\]"):
        step(jamp.StaticLossScale(2.0), jnp.ones(3))


@pytest.mark.parametrize("argnums, shown", [(5, "argnums=5"), ((0, 2), "argnums=(0, 2)"),
                                            (-3, "argnums=-3")])
def test_argnums_out_of_range_reports_the_users_index(argnums, shown):
    step = jamp.scaled_value_and_grad(_loss, argnums=argnums)
    with pytest.raises(ValueError) as info:
        step(jamp.DynamicLossScale(), jnp.ones(2), jnp.ones(2))
    message = str(info.value)
    assert f"{shown} is out of range" in message and "called with 2 arguments" in message
    assert "argnums=6" not in message and "argnums=(1, 3)" not in message


def test_negative_argnums_count_from_the_end_as_in_jax():
    step = jamp.scaled_value_and_grad(_loss, argnums=-1)
    _, grads, _, _ = step(jamp.StaticLossScale(4.0), jnp.full(2, 5.0), jnp.ones(2))
    np.testing.assert_allclose(grads, 5.0)


@pytest.mark.parametrize("kwargs, culprit", [
    (dict(argnums="0"), "argnums=...) must be an int"), (dict(argnums=()), "non-empty"),
    (dict(argnums=True), "must be an int"), (dict(has_aux=1), "has_aux=...) must be a bool"),
])
def test_scaled_value_and_grad_checks_its_own_arguments(kwargs, culprit):
    with pytest.raises(TypeError, match=re.escape(culprit)):
        jamp.scaled_value_and_grad(_loss, **kwargs)
    with pytest.raises(TypeError, match="expects a callable, got int"):
        jamp.scaled_value_and_grad(3)


def test_step_keeps_the_functions_name_and_works_under_jit():
    step = jamp.scaled_value_and_grad(_loss)
    assert step.__name__ == "_loss"
    loss, grads, scale, finite = jax.jit(step)(jamp.DynamicLossScale(period=1), jnp.ones(2),
                                              jnp.full(2, 3.0))
    assert float(loss) == 6.0 and bool(finite) and float(scale.loss_scale) == 2.0 ** 16
    np.testing.assert_allclose(grads, 3.0)
