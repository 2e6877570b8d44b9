"""float16 training of a Flax NNX model (BatchNorm, Dropout) with a dynamic loss scale.

``jamp.scaled_value_and_grad(loss, argnums=nnx.DiffState(0, nnx.Param))`` differentiates the
module's parameters through ``nnx.value_and_grad``; a module or state passed whole, with its RNG
state among the differentiated leaves, is an error that names the leaf and that code.
"""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jamp
from tests.jaxpr_utils import operand_dtypes

F16, F32 = np.dtype(jnp.float16), np.dtype(jnp.float32)
PERIOD = 5
STEPS = 36

# Three Gaussian blobs in 8 dimensions, 4 batches of 32.
# (Drawn with numpy and placed with device_put: data built with jax ops at import compiles in
# every test process.)
_RNG = np.random.default_rng(0)
LABELS = jax.device_put(np.arange(128, dtype=np.int32) % 3)
INPUTS = jax.device_put((_RNG.standard_normal((3, 8), np.float32) * 2.0)[np.arange(128) % 3]
                        + _RNG.standard_normal((128, 8), np.float32))


class Classifier(nnx.Module):
    def __init__(self, rngs):
        self.dense1 = nnx.Linear(8, 32, rngs=rngs)
        self.norm = nnx.BatchNorm(32, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)
        self.dense2 = nnx.Linear(32, 3, rngs=rngs)

    def __call__(self, x):
        return self.dense2(self.dropout(nnx.relu(self.norm(self.dense1(x)))))


def xent(model, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


F16_LOSS = jamp.autocast_transform(xent, dtype=jnp.float16)


def batch(step):
    at = slice(step % 4 * 32, step % 4 * 32 + 32)
    return INPUTS[at], LABELS[at]


def dropout_count(model):
    return int(model.dropout.rngs.count[...])


@pytest.fixture(scope="module")
def run():
    """A float16 training run from a loss scale too high for float16 (2**24): the first steps
    overflow and are skipped, the scale halves until the gradients fit, then grows every
    ``PERIOD`` finite steps. Returns the model and what each step left."""
    model = Classifier(nnx.Rngs(0, dropout=1))
    optimizer = nnx.Optimizer(model, optax.apply_if_finite(optax.adam(1e-2), 10),
                              wrt=nnx.Param)
    scaled_step = jamp.scaled_value_and_grad(F16_LOSS, argnums=nnx.DiffState(0, nnx.Param))

    @nnx.jit
    def train_step(model, optimizer, loss_scale, x, y):
        loss, grads, loss_scale, finite = scaled_step(loss_scale, model, x, y)
        optimizer.update(model, grads)
        return loss, grads, loss_scale, finite

    loss_scale = jamp.DynamicLossScale(loss_scale=2.0**24, period=PERIOD)
    initial = {
        "params": jax.tree.leaves(nnx.state(model, nnx.Param)),
        "stats": jax.tree.leaves(nnx.state(model, nnx.BatchStat)),
        "count": dropout_count(model),
    }
    steps = []
    for i in range(STEPS):
        loss, grads, loss_scale, finite = train_step(model, optimizer, loss_scale, *batch(i))
        steps.append({"loss": float(loss), "scale": float(loss_scale.loss_scale),
                      "finite": bool(finite), "grads": grads,
                      "params": jax.tree.leaves(nnx.state(model, nnx.Param)),
                      "count": dropout_count(model)})
    return model, initial, steps


def test_loss_decreases(run):
    _, _, steps = run
    finite = [s["loss"] for s in steps if s["finite"]]
    assert len(finite) >= STEPS // 2
    assert np.mean(finite[-5:]) < 0.5 * np.mean(finite[:5])


def test_loss_scale_backs_off_on_overflow_and_grows_after_period_finite_steps(run):
    _, _, steps = run
    scales = [2.0**24] + [s["scale"] for s in steps]
    flags = [s["finite"] for s in steps]
    assert not flags[0], "2**24 overflows float16 gradients: the first step must be skipped"
    assert any(flags), "the scale never came down to a value float16 gradients fit"
    run_length = 0
    for before, after, finite in zip(scales, scales[1:], flags):
        run_length = run_length + 1 if finite else 0
        if not finite:
            assert after == before / 2
        elif run_length % PERIOD == 0:
            assert after == before * 2
        else:
            assert after == before
    assert scales[-1] > min(scales), "the scale never grew again after backing off"


def test_overflow_steps_skip_the_update_and_finite_steps_apply_it(run):
    _, initial, steps = run
    before = initial["params"]
    for step in steps:
        unchanged = all(np.array_equal(a, b) for a, b in zip(before, step["params"]))
        assert unchanged == (not step["finite"])
        before = step["params"]


def test_batchnorm_statistics_update_and_stay_float32(run):
    model, initial, _ = run
    stats = jax.tree.leaves(nnx.state(model, nnx.BatchStat))
    assert {x.dtype for x in stats} == {F32}
    assert not any(np.array_equal(a, b) for a, b in zip(stats, initial["stats"]))
    assert float(jnp.abs(model.norm.mean[...]).sum()) > 0


def test_dropout_keys_advance_on_every_step_skipped_or_not(run):
    model, initial, steps = run
    assert [s["count"] for s in steps] == [initial["count"] + i + 1 for i in range(STEPS)]
    model.train()
    x, _ = batch(0)
    assert not jnp.array_equal(model.dropout(x), model.dropout(x))  # a new mask per call


def test_parameters_and_gradients_stay_float32(run):
    model, _, steps = run
    assert {x.dtype for x in jax.tree.leaves(nnx.state(model, nnx.Param))} == {F32}
    grads = steps[-1]["grads"]
    assert isinstance(grads, nnx.State)
    chex.assert_trees_all_equal_structs(grads, nnx.state(model, nnx.Param))
    assert {x.dtype for x in jax.tree.leaves(grads)} == {F32}


def test_the_model_computes_in_float16():
    model = Classifier(nnx.Rngs(0, dropout=1))
    graphdef, state = nnx.split(model)
    scaled_step = jamp.scaled_value_and_grad(F16_LOSS, argnums=nnx.DiffState(0, nnx.Param))
    x, y = batch(0)
    jaxpr = jax.make_jaxpr(
        lambda state: scaled_step(jamp.DynamicLossScale(), nnx.merge(graphdef, state), x, y)
    )(state)
    dots = operand_dtypes(jaxpr, "dot_general")
    assert len(dots) == 5  # 2 layers forward; 2 kernels and 1 activation backward
    assert set(dots) == {("float16", "float16")}


def test_diff_state_argnums_mix_with_ints_and_keyword_arguments():
    model = Classifier(nnx.Rngs(0, dropout=1))
    x, y = batch(1)

    def loss(w, model, x, *, y):
        return F16_LOSS(model, x, y) + jnp.sum(w ** 2)

    step = nnx.jit(jamp.scaled_value_and_grad(loss, argnums=(0, nnx.DiffState(-2, nnx.Param))))
    value, (grad_w, grad_model), _, finite = step(jamp.StaticLossScale(2.0**8), jnp.ones(3),
                                                  model, x, y=y)
    assert bool(finite)
    np.testing.assert_allclose(grad_w, 2.0 * np.ones(3))
    reference = nnx.jit(nnx.value_and_grad(F16_LOSS, argnums=nnx.DiffState(0, nnx.Param)))(
        Classifier(nnx.Rngs(0, dropout=1)), x, y)
    np.testing.assert_allclose(value, reference[0] + 3.0, rtol=1e-6)
    chex.assert_trees_all_close(grad_model, reference[1], rtol=2e-2, atol=1e-4)
    assert dropout_count(model) == 1  # the call's state was written back


def test_diff_state_argnums_out_of_range_names_what_was_written():
    step = jamp.scaled_value_and_grad(xent, argnums=nnx.DiffState(3, nnx.Param))
    with pytest.raises(ValueError, match=r"argnums=DiffState\(argnum=3.*\[-3, 2\]"):
        step(jamp.DynamicLossScale(), Classifier(nnx.Rngs(0)), *batch(0))


def test_diff_state_with_a_bool_argnum_is_refused():
    with pytest.raises(TypeError, match=r"argnums=\.\.\.\) must be an int, an nnx\.DiffState"):
        jamp.scaled_value_and_grad(xent, argnums=nnx.DiffState(True, nnx.Param))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_module_passed_whole_names_its_rng_state_and_the_way_out(jit):
    model = Classifier(nnx.Rngs(0, dropout=1))
    step = jamp.scaled_value_and_grad(F16_LOSS)
    call = jax.jit(step) if jit else step
    with pytest.raises(TypeError) as info:
        call(jamp.DynamicLossScale(), model, *batch(0))
    message = str(info.value)
    assert "argument 'model'" in message and "xent" in message
    assert "model.dropout.rngs.count.value (uint32)" in message
    assert "model.dropout.rngs.key.value (key<" in message
    assert "grad requires" not in message
    fix = "jamp.scaled_value_and_grad(xent, argnums=nnx.DiffState(0, nnx.Param))"
    assert fix in message
    # The code the message gives works (the function's name is the transformed xent's).
    fixed = eval(fix, {"jamp": jamp, "nnx": nnx, "xent": F16_LOSS})
    loss, grads, _, finite = nnx.jit(fixed)(jamp.DynamicLossScale(), model, *batch(0))
    assert bool(finite) and isinstance(grads, nnx.State)
    assert dropout_count(model) == 1


def test_a_state_passed_whole_names_its_rng_state_and_the_way_out():
    model = Classifier(nnx.Rngs(0, dropout=1))
    graphdef = nnx.graphdef(model)

    def state_loss(state, x, y):
        return xent(nnx.merge(graphdef, state, copy=True), x, y)

    with pytest.raises(TypeError) as info:
        jamp.scaled_value_and_grad(state_loss)(jamp.DynamicLossScale(), nnx.state(model),
                                               *batch(0))
    message = str(info.value)
    assert "argument 'state'" in message
    assert "state['dropout']['rngs']['count'].value (uint32)" in message
    assert "argnums=nnx.DiffState(0, nnx.Param)" in message
    assert "params, rest = nnx.state(model, nnx.Param, ...)" in message


def test_the_split_state_way_out_trains():
    # The message's second way: differentiate the parameters, pass the rest alongside.
    model = Classifier(nnx.Rngs(0, dropout=1))
    graphdef = nnx.graphdef(model)
    params, rest = nnx.state(model, nnx.Param, ...)

    def split_loss(params, rest, x, y):
        model = nnx.merge(graphdef, params, rest, copy=True)
        return F16_LOSS(model, x, y), nnx.state(model, nnx.Not(nnx.Param))

    step = jax.jit(jamp.scaled_value_and_grad(split_loss, has_aux=True))
    (loss, new_rest), grads, _, finite = step(jamp.DynamicLossScale(), params, rest, *batch(0))
    assert bool(finite)
    chex.assert_trees_all_equal_structs(grads, params)
    assert int(new_rest["dropout"]["rngs"]["count"][...]) == 1
    assert not jnp.array_equal(new_rest["norm"]["mean"][...], rest["norm"]["mean"][...])


def test_integer_leaves_of_a_plain_pytree_are_named():
    def loss(state, x):
        return jnp.sum(state["w"] * x)

    state = {"w": jnp.ones(3), "step": jnp.int32(7)}
    with pytest.raises(TypeError, match=r"argument 'state'.*state\['step'\] \(int32\).*"
                                        r"outside argnums"):
        jamp.scaled_value_and_grad(loss)(jamp.DynamicLossScale(), state, jnp.ones(3))
