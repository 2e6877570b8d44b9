"""Loss scaling across micro-batches with GradScaler's semantics, and a dynamic scale stuck at its
minimum (issue 32, items 1 and 4)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jamp

K = 4


def loss_fn(params, x):
    return jnp.mean((x @ params["w"]) ** 2)


STEP = jax.jit(jamp.scaled_value_and_grad(jamp.autocast_transform(loss_fn, dtype=jnp.float16)))
PARAMS = {"w": jnp.full((3, 2), 0.1)}
GOOD = [jnp.full((2, 3), 0.5 + i) for i in range(K)]
# micro-batch 1 of the step overflows float16 (1e5 > 65504 as a matmul operand)
ONE_BAD = [GOOD[0], jnp.full((2, 3), 1e5), GOOD[2], GOOD[3]]


def hand_written_step(params, opt_state, scale, tx, micro_batches):
    """The jamp version of torch's accumulation loop: scaler.scale(loss).backward() per
    micro-batch, then scaler.step(opt) (skipped on inf) and scaler.update() once."""
    acc = jax.tree.map(jnp.zeros_like, params)
    for batch in micro_batches:
        _, grads, scale, _ = STEP(scale, params, batch)
        acc = jax.tree.map(lambda a, g: a + g / len(micro_batches), acc, grads)
    finite = jamp.all_finite(acc)
    updates, new_opt_state = tx.update(acc, opt_state, params)
    params, opt_state = jamp.select_tree(
        finite, (optax.apply_updates(params, updates), new_opt_state), (params, opt_state))
    return params, opt_state, scale


def multisteps_step(params, opt_state, scale, tx, micro_batches):
    for batch in micro_batches:
        _, grads, scale, _ = STEP(scale, params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    return params, opt_state, scale


FORMS = {
    "hand_written": (lambda: optax.sgd(0.1), hand_written_step),
    "accumulate_micro_batches": (lambda: jamp.accumulate_micro_batches(optax.sgd(0.1), K),
                                 multisteps_step),
}


@pytest.mark.parametrize("form", sorted(FORMS))
def test_one_overflowing_micro_batch_skips_the_step_and_halves_the_scale_once(form):
    make_tx, run_step = FORMS[form]
    tx = make_tx()
    scale = jamp.MicroBatchLossScale(jamp.DynamicLossScale(2.0 ** 10, period=1000), every_k=K)
    params, opt_state = PARAMS, tx.init(PARAMS)

    params, opt_state, scale = run_step(params, opt_state, scale, tx, ONE_BAD)
    np.testing.assert_array_equal(params["w"], PARAMS["w"])       # the whole step skipped
    assert float(scale.loss_scale) == 2.0 ** 9                   # halved once, not per batch
    assert int(scale.mini_step) == 0 and bool(scale.finite)      # the next step starts afresh

    params, opt_state, scale = run_step(params, opt_state, scale, tx, GOOD)
    assert bool(jnp.all(params["w"] != PARAMS["w"]))              # a finite step applies
    assert bool(jnp.all(jnp.isfinite(params["w"])))
    assert float(scale.loss_scale) == 2.0 ** 9
    assert int(scale.inner.counter) == 1                         # one finite step counted
    if form == "accumulate_micro_batches":
        assert int(opt_state.skipped_steps) == 1 and int(opt_state.mini_step) == 0


def test_accumulated_steps_match_one_step_on_the_mean_gradient():
    tx = jamp.accumulate_micro_batches(optax.adam(0.01), K)
    params, opt_state = PARAMS, tx.init(PARAMS)
    scale = jamp.MicroBatchLossScale(jamp.StaticLossScale(8.0), every_k=K)
    history = []
    for batch in GOOD:
        _, grads, scale, _ = STEP(scale, params, batch)
        history.append(grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        if len(history) < K:
            assert all(not bool(jnp.any(u)) for u in jax.tree.leaves(updates))  # zeros between
        params = optax.apply_updates(params, updates)
    mean = jax.tree.map(lambda *g: sum(g) / K, *history)
    reference = optax.adam(0.01)
    expected, _ = reference.update(mean, reference.init(PARAMS), PARAMS)
    np.testing.assert_allclose(params["w"], optax.apply_updates(PARAMS, expected)["w"],
                               rtol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("make_tx", [lambda: optax.adam(0.01), lambda: optax.sgd(0.1, momentum=0.9)],
                         ids=["adam", "momentum"])
def test_16_bit_parameters_state_keeps_its_dtypes_under_float32_gradients(dtype, make_tx):
    """scaled_value_and_grad returns float32 gradients for 16-bit parameters; tx's state made from
    those parameters stays 16-bit, as optax.MultiSteps keeps it (the first step crashed)."""
    # (built on the host and put with jax.device_put, which compiles nothing, unlike jnp.full)
    params = {"w": jax.device_put(np.full((3, 2), 0.1, dtype))}
    ours, multisteps = jamp.accumulate_micro_batches(make_tx(), K), optax.MultiSteps(make_tx(), K)
    ours_state, multisteps_state = ours.init(params), multisteps.init(params)
    init_dtypes = jax.tree.map(lambda x: x.dtype, ours_state.inner_state)
    scale = jamp.MicroBatchLossScale(jamp.StaticLossScale(8.0), every_k=K)
    ours_params = multisteps_params = params
    # the reference compiled once: eager, MultiSteps' cond compiled anew at every call
    multisteps_update = jax.jit(multisteps.update)
    for i, batch in enumerate(GOOD * 2):   # two optimizer steps
        _, grads, scale, _ = STEP(scale, ours_params, batch)
        assert grads["w"].dtype == jnp.float32
        updates, ours_state = ours.update(grads, ours_state, ours_params)
        reference, multisteps_state = multisteps_update(grads, multisteps_state, multisteps_params)
        if i == K - 1:  # the first step: the same float32 update from the same state
            np.testing.assert_allclose(updates["w"], reference["w"], rtol=1e-5)
        ours_params = optax.apply_updates(ours_params, updates)
        multisteps_params = optax.apply_updates(multisteps_params, reference)
    assert jax.tree.map(lambda x: x.dtype, ours_state.inner_state) == init_dtypes
    landed, start = np.asarray(ours_params["w"], np.float32), np.asarray(params["w"], np.float32)
    assert ours_params["w"].dtype == dtype and np.all(landed != start)
    np.testing.assert_allclose(landed, np.asarray(multisteps_params["w"], np.float32), rtol=1e-2)


def test_optax_multisteps_keeps_an_overflow_for_good():
    """Why accumulate_micro_batches exists: MultiSteps resets its accumulator by multiplying it
    by 0, so after one overflowed micro-batch apply_if_finite skips every later step too (if
    optax changes that, the docs' "why not MultiSteps" needs revisiting)."""
    tx = optax.MultiSteps(optax.apply_if_finite(optax.sgd(0.1), max_consecutive_errors=10),
                          every_k_schedule=K)
    scale = jamp.MicroBatchLossScale(jamp.DynamicLossScale(2.0 ** 10), every_k=K)
    params, opt_state, scale = multisteps_step(PARAMS, tx.init(PARAMS), scale, tx, ONE_BAD)
    params, opt_state, scale = multisteps_step(params, opt_state, scale, tx, GOOD)
    np.testing.assert_array_equal(params["w"], PARAMS["w"])       # the finite step was lost


def test_accumulate_micro_batches_checks_its_arguments():
    with pytest.raises(ValueError, match="every_k must be an int >= 1, got 0"):
        jamp.accumulate_micro_batches(optax.sgd(0.1), 0)
    with pytest.raises(TypeError, match="expects an optax.GradientTransformation"):
        jamp.accumulate_micro_batches(lambda g: g, 2)
    with pytest.raises(ValueError, match="every_k must be an int >= 1, got True"):
        jamp.accumulate_micro_batches(optax.sgd(0.1), True)
    tx = jamp.accumulate_micro_batches(optax.sgd(1.0), np.int64(2))  # a numpy integer (was refused)
    state = tx.init({"w": jnp.zeros(2)})
    for _ in range(2):
        updates, state = tx.update({"w": jnp.ones(2)}, state)
    np.testing.assert_allclose(updates["w"], -1.0)  # the mean of two micro-batches, applied


def test_per_micro_batch_scale_changes_only_at_the_step_boundary():
    scale = jamp.MicroBatchLossScale(jamp.DynamicLossScale(2.0 ** 10, period=1), every_k=K)
    seen = []
    for batch in GOOD:
        seen.append(float(scale.loss_scale))   # the scale each micro-batch's loss is scaled by
        _, _, scale, _ = STEP(scale, PARAMS, batch)
    assert seen == [2.0 ** 10] * K                         # one scale for the whole step
    assert float(scale.loss_scale) == 2.0 ** 11            # period=1: grown once, per step


def test_micro_batch_gradients_match_the_plain_scale():
    plain = STEP(jamp.DynamicLossScale(2.0 ** 10), PARAMS, GOOD[0])
    micro = STEP(jamp.MicroBatchLossScale(jamp.DynamicLossScale(2.0 ** 10), every_k=K),
                 PARAMS, GOOD[0])
    np.testing.assert_array_equal(plain[1]["w"], micro[1]["w"])
    assert float(plain[0]) == float(micro[0])


def test_every_k_one_is_the_wrapped_scale():
    scale = jamp.MicroBatchLossScale(jamp.DynamicLossScale(8.0), every_k=1)
    assert float(scale.adjust(jnp.asarray(False)).loss_scale) == 4.0


def test_micro_batch_scale_fields_are_checked_by_name():
    with pytest.raises(TypeError, match="MicroBatchLossScale.inner must be a jamp"):
        jamp.MicroBatchLossScale(2.0 ** 15)
    with pytest.raises(ValueError, match="MicroBatchLossScale.every_k must be >= 1"):
        jamp.MicroBatchLossScale(jamp.DynamicLossScale(), every_k=0)
    with pytest.raises(ValueError, match="mini_step must be < every_k"):
        jamp.MicroBatchLossScale(jamp.DynamicLossScale(), every_k=2, mini_step=2)
    with pytest.raises(TypeError, match="inner must be"):
        jamp.MicroBatchLossScale(jamp.MicroBatchLossScale(jamp.DynamicLossScale()))


# --- a dynamic scale at its minimum that still overflows ---------------------------------------

def test_skips_at_the_minimum_scale_are_counted_and_shown():
    bad = jnp.full((2, 3), 1e5)
    step = jax.jit(STEP)
    scale = jamp.DynamicLossScale(4.0, min_loss_scale=1.0)
    counts = []
    for _ in range(5):
        _, _, scale, finite = step(scale, PARAMS, bad)
        assert not bool(finite)
        counts.append(int(scale.skips_at_min))
    # 4 -> 2 -> 1 back off; from then on each overflow is one at the minimum
    assert counts == [0, 0, 1, 2, 3]
    assert float(scale.loss_scale) == 1.0
    assert "skips_at_min=Array(3" in repr(scale)
    _, _, scale, finite = step(scale, PARAMS, GOOD[0])
    assert bool(finite) and int(scale.skips_at_min) == 0    # a finite step resets it


def test_skips_at_min_is_validated():
    with pytest.raises(ValueError, match="skips_at_min must be >= 0"):
        jamp.DynamicLossScale(skips_at_min=-1)


# --- gradient dtypes with 16-bit parameters (documented contrast, training guide) -------------

def test_scaled_gradients_are_float32_while_plain_ones_follow_the_parameters():
    params = {"w": jnp.full((3, 2), 0.1, jnp.bfloat16)}

    def region_loss(params, x):
        with jamp.autocast():
            return jnp.mean((x @ params["w"]) ** 2)

    _, plain = jax.value_and_grad(region_loss)(params, GOOD[0])
    _, scaled, _, _ = jamp.scaled_value_and_grad(region_loss)(
        jamp.DynamicLossScale(), params, GOOD[0])
    assert plain["w"].dtype == jnp.bfloat16 and scaled["w"].dtype == jnp.float32
    np.testing.assert_allclose(scaled["w"], plain["w"].astype(jnp.float32), rtol=2 ** -7)
