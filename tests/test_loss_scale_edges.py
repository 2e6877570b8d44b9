"""Loss scales at the edges: complex gradients, a 16-bit loss and a scale its dtype rounds,
a wrapped static scale's range check, and checkpoints through flax.serialization."""
import functools
import os
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import serialization
from flax.training import train_state

import jamp

F16, BF16, F32 = jnp.float16, jnp.bfloat16, jnp.float32


# --- complex parameters ------------------------------------------------------------------------

def _complex_loss(p):
    return jnp.sum(jnp.abs(p["c"] * 2.0) ** 2) + jnp.sum(p["r"] ** 2)


def test_complex_gradients_are_unscaled_like_real_ones():
    params = {"c": jax.device_put(np.array([1 + 1j, 2 - 1j], np.complex64)),
              "r": jax.device_put(np.array([1.0, 2.0], np.float32))}
    expected = jax.jit(jax.grad(_complex_loss))(params)  # (eagerly: a program per operation)
    _, grads, _, finite = jamp.scaled_value_and_grad(_complex_loss)(
        jamp.StaticLossScale(1024.0), params)
    assert bool(finite) and grads["c"].dtype == jnp.complex64
    chex.assert_trees_all_close(grads, expected, rtol=1e-6)


def test_scale_and_unscale_multiply_and_divide_complex_leaves():
    scale = jamp.StaticLossScale(4.0)
    scaled = scale.scale(jnp.asarray(2 + 2j, jnp.complex64))
    assert scaled.dtype == jnp.complex64 and complex(scaled) == 8 + 8j
    unscaled = scale.unscale({"c": jnp.asarray(8 + 8j, jnp.complex64), "n": jnp.int32(3)})
    assert unscaled["c"].dtype == jnp.complex64 and complex(unscaled["c"]) == 2 + 2j
    assert unscaled["n"] == 3
    # and an overflowed complex gradient is not finite
    assert not bool(jamp.all_finite(scale.unscale(jnp.asarray(complex(np.inf, 0), jnp.complex64))))


# --- a 16-bit loss is scaled by the scale rounded to its dtype --------------------------------

def _loss_in(dtype):
    def loss(w, x):
        return jnp.sum(w.astype(dtype) * x.astype(dtype))
    return loss


def _grown_dynamic_scale():
    scale = jamp.DynamicLossScale(loss_scale=8.0, factor=3, period=1)
    for _ in range(7):
        scale = scale.adjust(jnp.asarray(True))  # 8 * 3**7 = 17496: 17536 in bfloat16, 17504
    return scale                                 # in float16


_W = jax.device_put(np.array([1.0, -2.0, 0.5], np.float32))
_X = jax.device_put(np.array([1.0, 0.25, -0.5], np.float32))  # x * scale fits float16


@functools.cache
def _reference_grad(dtype):
    """One compiled program a dtype, shared by the scales (casts and products: exact, as eager)."""
    return jax.jit(jax.grad(_loss_in(dtype)))


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("make", [lambda: jamp.StaticLossScale(3001.0),
                                  lambda: jamp.StaticLossScale(12345.0),
                                  _grown_dynamic_scale], ids=["3001", "12345", "dynamic_17496"])
def test_gradients_of_a_16_bit_loss_are_divided_by_the_factor_it_was_multiplied_by(dtype, make):
    scale = make()
    w, x = _W, _X
    assert float(scale.loss_scale.astype(dtype)) != float(scale.loss_scale)  # rounded in dtype
    expected = _reference_grad(dtype)(w, x)
    _, grads, _, finite = jax.jit(jamp.scaled_value_and_grad(_loss_in(dtype)))(scale, w, x)
    assert bool(finite) and grads.dtype == F32
    # unbiased: divided by the float32 scale, 3001 gave 1.0023x in bfloat16, 1.0003x in float16
    np.testing.assert_allclose(grads, expected, rtol=1e-6)


def test_a_scale_float16_rounds_to_zero_skips_the_step_instead_of_applying_zeros():
    """With min_loss_scale=None a dynamic scale can back off under float16's smallest value;
    scaled by 0, a float16 loss has gradients of 0 that are not the gradients."""
    w, x = jnp.array([1.0, 2.0]), jnp.array([3.0, 4.0])
    scale = jamp.DynamicLossScale(loss_scale=2.0 ** -26, min_loss_scale=None)
    assert float(scale.loss_scale.astype(F16)) == 0.0
    _, grads, new_scale, finite = jamp.scaled_value_and_grad(_loss_in(F16))(scale, w, x)
    assert not bool(finite)
    assert not bool(jnp.any(jnp.isfinite(grads)))     # NaN, never a silent 0
    assert float(new_scale.loss_scale) == 2.0 ** -27  # backs off, as for an overflow
    # the smallest scale float16 holds still gives the gradients
    _, grads, _, finite = jamp.scaled_value_and_grad(_loss_in(F16))(
        jamp.DynamicLossScale(loss_scale=2.0 ** -24, min_loss_scale=None), w, x)
    assert bool(finite)
    np.testing.assert_array_equal(grads, x)


def test_a_static_scale_float16_rounds_to_zero_is_refused():
    with pytest.raises(ValueError, match=r"StaticLossScale\(1\.49012e-08\)\.scale: float16 "
                                         r"rounds the scale to 0"):
        jamp.StaticLossScale(2.0 ** -26).scale(jnp.float16(1.0))
    with pytest.raises(ValueError, match="rounds the scale to 0"):
        jamp.scaled_value_and_grad(_loss_in(F16))(
            jamp.StaticLossScale(2.0 ** -26), jnp.ones(2), jnp.ones(2))
    assert float(jamp.StaticLossScale(2.0 ** -24).scale(jnp.float16(1.0))) == 2.0 ** -24
    assert float(jamp.StaticLossScale(2.0 ** -26).scale(jnp.float32(1.0))) == 2.0 ** -26


@pytest.mark.parametrize("scale, rounded", [(1e-39, ""), (1e-40, ""), (1e-50, " to 0")],
                         ids=["1e-39", "1e-40", "1e-50"])
@pytest.mark.parametrize("make", [
    lambda s: jamp.StaticLossScale(s),
    lambda s: jamp.DynamicLossScale(loss_scale=s, min_loss_scale=None),
    lambda s: jamp.DynamicLossScale(loss_scale=1.0, min_loss_scale=s),
], ids=["static", "dynamic", "dynamic_min"])
def test_a_scale_under_float32s_normal_range_is_refused_at_construction(make, scale, rounded):
    """StaticLossScale(1e-40) was accepted and every step's gradients came back NaN (unscaling
    divides by it: 1 / 1e-40 is inf in float32); 1e-50 was stored as 0, then named so."""
    with pytest.raises(ValueError, match=rf"loss_scale={scale:g} is under float32's smallest "
                                         rf"normal value \(1\.175e-38\).*rounds it{rounded},"):
        make(scale)


def test_the_smallest_normal_float32_scale_still_gives_the_gradients():
    tiny = float(np.finfo(np.float32).tiny)
    w, x = jnp.array([1.0, 2.0]), jnp.array([3.0, 4.0])
    _, grads, _, finite = jamp.scaled_value_and_grad(_loss_in(F32))(
        jamp.StaticLossScale(tiny), w, x)
    assert bool(finite)
    np.testing.assert_array_equal(grads, x)


@pytest.mark.parametrize("value, message", [
    (2 ** 200, r"loss_scale=1\.607e\+60 overflows float32"),
    (-(2 ** 200), r"loss_scale must be > 0, got -1\.607e\+60"),
    (2 ** 2000, r"loss_scale=~2\*\*2000 overflows float32"),
])
def test_a_python_int_past_int64_is_checked_as_a_number(value, message):
    """StaticLossScale(2**200) said "must be a real number" (numpy held it as an object)."""
    with pytest.raises(ValueError, match=message):
        jamp.StaticLossScale(value)
    assert float(jamp.StaticLossScale(2 ** 64).loss_scale) == 2.0 ** 64  # fits float32


# --- MicroBatchLossScale keeps the wrapped scale's checks -------------------------------------

def test_a_wrapped_static_scale_past_float16_is_refused_as_it_is_alone():
    wrapped = jamp.MicroBatchLossScale(jamp.StaticLossScale(2.0 ** 16), every_k=2)
    with pytest.raises(ValueError, match=r"StaticLossScale\(65536\)\.scale: the scale is past "
                                         r"float16's largest value"):
        wrapped.scale(jnp.float16(1.0))
    with pytest.raises(ValueError, match="past float16's largest value"):
        jamp.scaled_value_and_grad(_loss_in(F16))(wrapped, jnp.ones(2), jnp.ones(2))
    assert float(wrapped.scale(jnp.float32(1.0))) == 2.0 ** 16   # a float32 loss holds it
    dynamic = jamp.MicroBatchLossScale(jamp.DynamicLossScale(2.0 ** 16), every_k=2)
    assert np.isinf(float(dynamic.scale(jnp.float16(1.0))))  # a dynamic one backs off instead


# --- flax.serialization -----------------------------------------------------------------------

SCALES = {
    "noop": lambda: jamp.NoOpLossScale(),
    "static": lambda: jamp.StaticLossScale(8.0),
    "dynamic": lambda: jamp.DynamicLossScale(2.0 ** 10, period=10).adjust(jnp.asarray(True)),
    "micro": lambda: jamp.MicroBatchLossScale(
        jamp.DynamicLossScale(2.0 ** 10), every_k=4).adjust(jnp.asarray(False)),
}


def _assert_same_scale(restored, original):
    assert type(restored) is type(original)
    assert jax.tree.structure(restored) == jax.tree.structure(original)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(original)):
        assert jnp.asarray(a).dtype == b.dtype
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name", sorted(SCALES))
def test_loss_scales_round_trip_through_flax_serialization(name):
    scale = SCALES[name]()
    state = serialization.to_state_dict(scale)
    assert isinstance(state, dict)
    _assert_same_scale(serialization.from_state_dict(SCALES[name](), state), scale)
    fresh = type(scale)() if name in ("noop", "dynamic") else SCALES[name]()
    restored = serialization.from_bytes(fresh, serialization.to_bytes(scale))
    _assert_same_scale(restored, scale)


def test_a_train_state_holding_a_loss_scale_round_trips_through_to_bytes():
    class TrainState(train_state.TrainState):
        loss_scale: jamp.DynamicLossScale

    def make(scale):
        return TrainState.create(apply_fn=None, params={"w": jnp.ones(2)}, tx=optax.sgd(0.1),
                                 loss_scale=scale)

    trained = make(jamp.DynamicLossScale(2.0 ** 10, period=3).adjust(jnp.asarray(False)))
    restored = serialization.from_bytes(make(jamp.DynamicLossScale()),
                                        serialization.to_bytes(trained))
    _assert_same_scale(restored.loss_scale, trained.loss_scale)
    assert float(restored.loss_scale.loss_scale) == 2.0 ** 9


def test_a_state_dict_that_does_not_fit_the_scale_is_refused_by_name():
    with pytest.raises(ValueError, match=r"restoring a DynamicLossScale.*missing: \['period'"):
        serialization.from_state_dict(jamp.DynamicLossScale(), {"loss_scale": 4.0, "counter": 3})
    state = serialization.to_state_dict(jamp.DynamicLossScale(period=4))
    state["counter"] = np.int32(7)  # past period: the constructor's check names it
    with pytest.raises(ValueError, match=r"DynamicLossScale.counter must be < period \(4\)"):
        serialization.from_state_dict(jamp.DynamicLossScale(), state)


IMPORT_ORDERS = {
    "jamp_first": "import jamp\nassert 'flax' not in sys.modules\nfrom flax import serialization",
    "flax_first": "from flax import serialization\nimport jamp",
}
ROUND_TRIP = """
blob = serialization.to_bytes({"scale": jamp.StaticLossScale(8.0)})
restored = serialization.from_bytes({"scale": jamp.StaticLossScale(1.0)}, blob)
assert float(restored["scale"].loss_scale) == 8.0, restored
"""


@pytest.mark.parametrize("order", sorted(IMPORT_ORDERS))
def test_registration_does_not_depend_on_the_import_order(order):
    """`import jamp` does not import flax; the scales are registered as the first is made,
    whether flax.serialization was imported before or after jamp."""
    script = "import sys\n" + IMPORT_ORDERS[order] + ROUND_TRIP
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
