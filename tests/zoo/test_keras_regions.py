"""Keras 3 on the JAX backend (the zoo job, where Keras is installed): what the "Keras 3 (JAX
backend)" section of docs/reference/transforming.md says of regions and rules."""
import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import jamp  # noqa: E402
from tests.jaxpr_utils import eqns_named  # noqa: E402

X = jnp.ones((4, 16))


def mlp(autocast: bool) -> keras.Model:
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    h = keras.layers.Dense(16, autocast=autocast)(inputs)
    h = keras.layers.Activation("tanh", autocast=autocast)(h)
    outputs = keras.layers.Dense(4, autocast=autocast, name="head")(h)
    return keras.Model(inputs, outputs, name="net")


def stateless(model):
    def call(trainable, non_trainable, x):
        return model.stateless_call(trainable, non_trainable, x, training=True)[0]

    return call, [v.value for v in model.trainable_variables], [
        v.value for v in model.non_trainable_variables]


def tanh_dtypes(fn, *args):
    return {e.outvars[0].aval.dtype for e in eqns_named(jax.make_jaxpr(fn)(*args), "tanh")}


@pytest.mark.parametrize("autocast, in_region", [(True, jnp.float32), (False, jnp.bfloat16)])
def test_keras_casts_layer_inputs_back_to_float32_in_a_region(autocast, in_region):
    call, trainable, non_trainable = stateless(mlp(autocast))

    def with_region(*args):
        with jamp.autocast():
            return call(*args)

    assert tanh_dtypes(with_region, trainable, non_trainable, X) == {np.dtype(in_region)}
    # the transform cannot see Keras's cast (of a float32 value: nothing in the program)
    assert tanh_dtypes(jamp.autocast_transform(call), trainable, non_trainable, X) == {
        np.dtype(jnp.bfloat16)}


def test_rule_paths_start_at_the_layer_under_stateless_call_and_at_the_model_under_a_call():
    call, trainable, non_trainable = stateless(mlp(True))
    for glob, matches_a_call in (("head", False), ("*head", True)):
        policy = jamp.Policy(rules=((glob, None),))
        report = jamp.explain(call, trainable, non_trainable, X, policy=policy)
        assert not report.unmatched_rules  # stateless_call: the path is "head"
        model = mlp(True)
        called = jamp.explain(lambda x: model(x), X, policy=policy)
        assert (not called.unmatched_rules) == matches_a_call  # model(x): "net/head"
