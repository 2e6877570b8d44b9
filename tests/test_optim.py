"""jamp.optim: 16-bit parameters that still learn, optimizer state in 16 bits, exact landing of
updates, skipped steps, checkpoints, Flax linen / NNX, sharding (subprocess, 8 host devices),
errors in the user's terms. Equinox: tests/zoo/test_optim_equinox.py (the zoo extra has it)."""
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jamp
from tests.check_modules import run_check_module

BF16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
optim = jamp.optim


@jax.jit
def regression_data(seed):
    # one program (drawn eagerly, each of its operations compiled a program of its own)
    k1, k2 = jax.random.split(jax.random.key(seed))
    w_true = jax.random.normal(k1, (16, 4))
    x = jax.random.normal(k2, (128, 16))
    return w_true, x, x @ w_true


def regression(seed=0):
    """A linear least-squares problem whose solution is ~1 away from the start."""
    w_true, x, y = regression_data(seed)

    def loss(params):
        return jnp.mean((x @ params["w"].astype(F32) + params["b"].astype(F32) - y) ** 2)

    start = {"w": jax.device_put(np.asarray(w_true) + np.float32(0.5)),
             "b": jax.device_put(np.zeros(4, np.float32))}
    return loss, start


def train(tx, params, loss, steps):
    """``steps`` optimizer steps in one compiled scan; returns (params, state, losses)."""
    def step(carry, _):
        p, s = carry
        value, grads = jax.value_and_grad(loss)(p)
        updates, s = tx.update(grads, s, p)
        return (optax.apply_updates(p, updates), s), value

    (params, state), losses = jax.jit(lambda p, s: jax.lax.scan(step, (p, s), None, steps))(
        params, tx.init(params))
    return params, state, losses


def cast(tree, dtype):
    # On the host (ml_dtypes rounds to nearest even, as XLA does), put with jax.device_put, which
    # compiles nothing: an eager astype, and jnp.asarray of a numpy array, compile a program per
    # shape and dtype. (The same for the other test data built on the host below.)
    return jax.tree.map(lambda x: jax.device_put(np.asarray(x).astype(dtype)), tree)


def test_tiny_updates_plain_optax_stalls_wrappers_track_float32():
    """Adam at lr 1e-4 moves a weight ~1e-4 a step, below half a bfloat16 step at 1.0 (2**-8):
    plain optax on bfloat16 parameters never moves; the wrappers follow float32."""
    loss, start = regression()
    lr, steps = 1e-4, 300
    _, _, f32 = train(optax.adam(lr), start, loss, steps)
    bf16_start = cast(start, BF16)
    plain, _, stalled = train(optax.adam(lr), bf16_start, loss, steps)
    unchanged = np.asarray(plain["w"], np.float32) == np.asarray(bf16_start["w"], np.float32)
    assert unchanged.mean() > 0.9  # only weights near 0, where a bf16 step is tiny, moved
    gained = float(f32[0] - f32[-1])
    assert gained > 0.05 * float(f32[0])
    assert float(stalled[0] - stalled[-1]) < 0.1 * gained  # a tenth of float32's progress
    for tx in (optim.stochastic_rounding(optax.adam(lr)),
               optim.stochastic_rounding(optim.state_dtype(optax.adam(lr))),
               optim.master_weights(optax.adam(lr)),
               optim.master_weights(optax.adam(lr), rounding="stochastic"),
               optim.compensated(optax.adam(lr))):
        params, _, losses = train(tx, bf16_start, loss, steps)
        assert params["w"].dtype == BF16
        # the same progress as float32, to within 15% of it (the loss at bfloat16-rounded
        # weights alone differs from float32's by ~5% of the progress; seeds of stochastic
        # rounding spread ~+-6% around that)
        assert abs(float(losses[-1] - f32[-1])) < 0.15 * gained, (losses[-1], f32[-1])


def nbytes(tree):
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def test_state_dtypes_and_bytes_per_parameter():
    params = {"w": jnp.zeros((256, 64)), "b": jnp.zeros((64,))}
    n = sum(x.size for x in jax.tree.leaves(params))
    bf16 = cast(params, BF16)
    adamw = optax.adamw(1e-3)
    recipes = {
        "float32": (adamw, params, 12),
        "bf16 moments": (optim.state_dtype(adamw), params, 8),
        "bf16 params + stochastic rounding": (
            optim.stochastic_rounding(optim.state_dtype(adamw)), bf16, 6),
        "bf16 params + master weights + bf16 moments": (
            optim.master_weights(optim.state_dtype(adamw)), bf16, 10),
        "bf16 params + compensation + bf16 moments": (
            optim.compensated(optim.state_dtype(adamw)), bf16, 8),
    }
    per_param = {}
    for name, (tx, p, expected) in recipes.items():
        state = tx.init(p)
        per_param[name] = (nbytes(p) + nbytes(state)) / n
        # the goals: <= 6.1 and <= 10.1 bytes (scalars: step counts, rounding counters)
        assert expected <= per_param[name] < expected + 0.01, (name, per_param[name])
    state = optim.stochastic_rounding(optim.state_dtype(adamw)).init(bf16)
    adam = state.inner_state.inner_state[0]
    assert adam.count.dtype == jnp.int32  # integer leaves untouched
    assert {adam.mu["w"].dtype, adam.nu["w"].dtype} == {BF16}
    master = optim.master_weights(adamw).init(bf16)
    assert master.master["w"].dtype == F32 and master.inner_state[0].mu["w"].dtype == F32


def test_keep_globs_and_unmatched_keep_warns():
    params = {"w": jnp.ones((8, 8))}
    state = optim.state_dtype(optax.adamw(1e-3), keep=("*nu*",)).init(params)
    adam = state.inner_state[0]
    assert adam.mu["w"].dtype == BF16 and adam.nu["w"].dtype == F32
    with pytest.warns(optim.UnmatchedKeepWarning, match=r"'\*velocity\*'.*0/mu/w"):
        optim.state_dtype(optax.adamw(1e-3), keep=("*velocity*",)).init(params)
    assert issubclass(optim.UnmatchedKeepWarning, jamp.UnmatchedRuleWarning)
    # a kept leaf keeps its dtype across updates; float16 storage works too
    tx = optim.state_dtype(optax.adam(1e-3), jnp.float16, keep=("*nu*",), rounding="nearest")
    s = tx.init(params)
    _, s = jax.jit(tx.update)({"w": jnp.full((8, 8), 0.5)}, s, params)
    assert s.inner_state[0].mu["w"].dtype == jnp.float16 and s.inner_state[0].nu["w"].dtype == F32


def test_scalar_state_leaves_hyperparameters_and_bookkeeping_stay_as_tx_made_them():
    """Narrowed to bfloat16, ``inject_hyperparams``' b2 = 0.999 was 1 (Adam's bias correction
    divided by zero: NaN updates) and ``reduce_on_plateau``'s best loss missed 0.1% gains (it
    cut the learning rate of a loss that kept improving)."""
    params, grads = {"w": jnp.ones((4,))}, {"w": jnp.full((4,), 0.1)}
    injected = optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)
    tx = optim.state_dtype(injected)
    state = tx.init(params)
    assert {v.dtype for v in state.inner_state.hyperparams.values()} == {F32}
    assert state.inner_state.inner_state[0].mu["w"].dtype == BF16  # moments still narrowed
    updates, _ = jax.jit(tx.update)(grads, state, params)
    expected, _ = jax.jit(injected.update)(grads, injected.init(params), params)
    np.testing.assert_allclose(updates["w"], expected["w"], rtol=1e-2)

    def plateau():
        return optax.chain(optax.sgd(1.0), optax.contrib.reduce_on_plateau(patience=3, rtol=1e-4))

    scales = {}
    for name, tx in (("optax", plateau()), ("state_dtype", optim.state_dtype(plateau()))):
        state, loss = tx.init(params), 3.0
        # optax's own run, the reference, compiled once (eager, its cond compiled at every step)
        update = jax.jit(tx.update) if name == "optax" else tx.update
        for _ in range(20):
            loss *= 0.999
            _, state = update(grads, state, params, value=jnp.float32(loss))
        inner = state if name == "optax" else state.inner_state
        scales[name] = float(inner[1].scale)
    assert scales == {"optax": 1.0, "state_dtype": 1.0}


def random_targets(rng, n):
    """bfloat16 pairs (param, target) at most a factor 2 apart, of one sign (the new value of
    a parameter that at most doubles or halves in a step)."""
    p = rng.standard_normal(n).astype(np.float32) * np.exp2(rng.integers(-8, 8, n))
    p = p.astype(jnp.bfloat16)
    t = (p.astype(np.float32) * rng.uniform(0.5, 2.0, n).astype(np.float32)).astype(jnp.bfloat16)
    return p, t


def aiming(delta):
    """master_weights of a transformation whose update is ``delta`` (float32, whatever the
    gradients' dtype): the master copy, starting at the parameters, moves to ``params + delta``
    (exact in float32 for the bfloat16 values here) and the parameters are asked to land there."""
    inner = optax.GradientTransformation(
        lambda p: optax.EmptyState(),
        lambda g, s, p=None: ({"w": jnp.asarray(delta, F32)}, s))
    return optim.master_weights(inner)


@pytest.mark.parametrize("grad_dtype", [F32, BF16, jnp.dtype(jnp.float16)])
def test_updates_land_exactly_on_the_new_master(grad_dtype):
    """optax.apply_updates(params, updates) == round(master), updates in the gradients' dtype,
    for parameters that at most double or halve in a step (float32 gradients: any step)."""
    p, t = random_targets(np.random.default_rng(0), 4000)
    params = {"w": jax.device_put(p)}
    tx = aiming(np.asarray(t, np.float32) - np.asarray(p, np.float32))
    zero = {"w": jax.device_put(np.zeros(p.shape, grad_dtype))}
    updates, _ = jax.jit(tx.update)(zero, tx.init(params), params)
    assert updates["w"].dtype == grad_dtype
    landed = optax.apply_updates(params, updates)["w"]
    np.testing.assert_array_equal(np.asarray(landed, np.float32), np.asarray(t, np.float32))
    eager = jax.tree.map(lambda a, u: (a + u).astype(a.dtype), params, updates)["w"]
    np.testing.assert_array_equal(np.asarray(eager, np.float32), np.asarray(t, np.float32))


def test_a_jump_16_bit_updates_cannot_reach_is_caught_up_next_step():
    """82 -> 26.625 in bfloat16: 26.625 - 82 = -55.375 is no bfloat16 value, and neither
    -55.25 nor -55.5 lands on 26.625. The parameter lands as close as it can (26.5), the
    master keeps 26.625, and the next step (a zero update) lands on it exactly. With float32
    gradients the same jump lands at once."""
    params = {"w": jnp.asarray([82.0], BF16)}
    jump, stay = aiming([26.625 - 82.0]), aiming([0.0])
    zero = {"w": jnp.zeros((1,), BF16)}
    updates, state = jump.update(zero, jump.init(params), params)
    params = optax.apply_updates(params, updates)
    assert float(params["w"][0]) == 26.5 and float(state.master["w"][0]) == 26.625
    updates, state = stay.update(zero, state, params)
    assert float(optax.apply_updates(params, updates)["w"][0]) == 26.625
    once = {"w": jnp.asarray([82.0], BF16)}
    updates, _ = jump.update({"w": jnp.zeros((1,), F32)}, jump.init(once), once)
    assert float(optax.apply_updates(once, updates)["w"][0]) == 26.625


def test_parameters_changed_between_steps_restart_the_master_copy():
    # The master copy answered for the parameters whatever they had become: pretrained weights
    # put in after init (TrainState.replace) were thrown away for the fresh init, and a
    # projection onto w >= 0 after each step was undone by the master drifting negative.
    fresh = {"w": jnp.full((4,), 0.5, BF16)}
    tx = optim.master_weights(optax.sgd(0.1))
    state = tx.init(fresh)
    pretrained = {"w": jnp.asarray([3.0, -1.0, 1e-3, 40.0], BF16)}
    zero = {"w": jnp.zeros((4,), BF16)}
    updates, state = tx.update(zero, state, pretrained)
    chex_equal(optax.apply_updates(pretrained, updates), pretrained)
    chex_equal(state.master["w"], pretrained["w"].astype(F32))
    params, state = {"w": jnp.zeros((4,), BF16)}, tx.init({"w": jnp.zeros((4,), BF16)})
    for step in range(3):  # gradients push w below 0; the projection holds it at 0 ...
        grads = {"w": jnp.asarray([1.0, 1.0, -1.0, 0.0], BF16)}
        updates, state = tx.update(grads, state, params)
        params = jax.tree.map(lambda w: jnp.maximum(w, 0), optax.apply_updates(params, updates))
    # ... so one step back up moves it off 0, as plain optax does (it stayed at 0 before).
    updates, state = tx.update({"w": -jnp.ones((4,), BF16)}, state, params)
    np.testing.assert_allclose(np.asarray(optax.apply_updates(params, updates)["w"], F32),
                               [0.1, 0.1, 0.4, 0.1], rtol=1e-2)
    # Its own updates, either rounding, leave the copy alone (the exactness tests above).
    sr = optim.master_weights(optax.sgd(1e-4), rounding="stochastic")
    params = {"w": jnp.linspace(-2, 2, 64).astype(BF16)}
    start, state = params["w"].astype(F32), sr.init(params)
    for _ in range(5):
        updates, state = sr.update({"w": jnp.ones((64,), BF16)}, state, params)
        params = optax.apply_updates(params, updates)
    np.testing.assert_allclose(state.master["w"], start - 5e-4, atol=1e-6)


def test_skipped_steps_change_nothing_apply_if_finite_and_loss_scaling():
    loss, start = regression()
    params = cast(start, BF16)
    inner = optim.master_weights(optim.state_dtype(optax.adam(1e-2)), rounding="stochastic")
    tx = optax.apply_if_finite(inner, 3)
    state = tx.init(params)
    grads = jax.jit(jax.grad(loss))(params)  # (one program; eagerly, one per operation)
    updates, state = jax.jit(tx.update)(grads, state, params)
    params = optax.apply_updates(params, updates)
    bad = jax.tree.map(lambda g: jax.device_put(with_nan_first(np.asarray(g))), grads)
    updates, skipped = jax.jit(tx.update)(bad, state, params)
    assert int(skipped.notfinite_count) == 1
    chex_equal(optax.apply_updates(params, updates), params)
    chex_equal(skipped.inner_state, state.inner_state)  # master, moments, rounding counter
    # jamp's loss scaling: an overflowing float16 step is skipped with select_tree
    scaled = jamp.scaled_value_and_grad(jamp.autocast_transform(loss, dtype=jnp.float16))
    sr = optim.stochastic_rounding(optim.state_dtype(optax.adam(1e-2)))
    state = sr.init(params)

    @jax.jit
    def step(params, state, loss_scale):
        _, grads, loss_scale, finite = scaled(loss_scale, params)
        updates, new_state = sr.update(grads, state, params)
        new = optax.apply_updates(params, updates)
        params, state = jamp.select_tree(finite, (new, new_state), (params, state))
        return params, state, loss_scale, finite

    new_params, new_state, _, finite = step(params, state, jamp.StaticLossScale(2.0**100))
    assert not bool(finite)
    chex_equal((new_params, new_state), (params, state))
    new_params, new_state, _, finite = step(params, state, jamp.StaticLossScale(1.0))
    assert bool(finite) and int(new_state.step) == 1


def with_nan_first(a):
    a = a.copy()
    a[0] = np.nan  # (as g.at[0].set(jnp.nan): a 2-D gradient's first row)
    return a


def chex_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


def test_multisteps_inside_accumulates_float32_gradients():
    """master_weights(MultiSteps(tx, k)): the accumulator is float32, and the master follows a
    float32 MultiSteps run bit for bit (16-bit gradients smaller than the sum's bfloat16 step
    are not lost)."""
    params = {"w": jnp.ones((4,), BF16)}
    tx = optim.master_weights(optax.MultiSteps(optax.sgd(1.0), every_k_schedule=4))
    reference = optax.MultiSteps(optax.sgd(1.0), every_k_schedule=4)
    state, ref_params = tx.init(params), cast(params, F32)
    ref_state = reference.init(ref_params)
    assert state.inner_state.acc_grads["w"].dtype == F32
    grads = [jnp.full((4,), g, BF16) for g in (2.0**-10, 2.0**-10, 2.0**-11, 2.0**-9)]
    # the reference compiled once (eager, its cond compiled at every step); its sums of powers
    # of two are exact, so it computes the same bits either way
    reference_update = jax.jit(reference.update)
    for g in grads:
        updates, state = tx.update({"w": g}, state, params)
        params = optax.apply_updates(params, updates)
        ref_updates, ref_state = reference_update({"w": g.astype(F32)}, ref_state, ref_params)
        ref_params = optax.apply_updates(ref_params, ref_updates)
    chex_equal(state.master, ref_params)
    assert float(state.master["w"][0]) != 1.0  # the mean (~2**-10) moved the master


CHECKPOINT_TX = optim.stochastic_rounding(optim.state_dtype(optax.adamw(3e-3)), seed=5)


def resumable_run():
    loss, start = regression()

    @functools.partial(jax.jit, static_argnums=2)
    def run(params, state, steps):
        def step(carry, _):
            p, s = carry
            updates, s = CHECKPOINT_TX.update(jax.grad(loss)(p), s, p)
            return (optax.apply_updates(p, updates), s), None
        return jax.lax.scan(step, (params, state), None, steps)[0]

    params = cast(start, BF16)
    return run, params, CHECKPOINT_TX.init(params)


def test_resume_from_saved_arrays_equals_uninterrupted_run_bit_for_bit():
    """What a checkpoint holds (the state's arrays, on the host) is all the next steps need:
    the rounding counter in the state picks the same bits. (orbax: the slow test below.)"""
    run, params, state = resumable_run()
    uninterrupted = run(params, state, 6)
    saved = jax.tree.map(np.asarray, run(params, state, 3))
    resumed = run(*jax.tree.map(jnp.asarray, saved), 3)
    chex_equal(resumed, uninterrupted)
    assert int(resumed[1].step) == 6
    # the seed matters: another seed draws other bits
    other = optim.stochastic_rounding(optim.state_dtype(optax.adamw(3e-3)), seed=6)
    grads = jax.tree.map(lambda p: jnp.full(p.shape, 1e-3, F32), params)
    u, _ = other.update(grads, other.init(params), params)
    v, _ = CHECKPOINT_TX.update(grads, state, params)
    assert any(np.any(np.asarray(a, np.float32) != np.asarray(b, np.float32))
               for a, b in zip(jax.tree.leaves(u), jax.tree.leaves(v)))


@pytest.mark.slow  # ~6 s of orbax; the host round trip above covers the same resume
def test_orbax_checkpoint_resume_equals_uninterrupted_run_bit_for_bit(tmp_path):
    import orbax.checkpoint as ocp  # installed with flax, a dependency
    run, params, state = resumable_run()
    uninterrupted = run(params, state, 6)
    halfway = run(params, state, 3)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "ckpt", halfway)
        checkpointer.wait_until_finished()
        restored = checkpointer.restore(tmp_path / "ckpt", jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), halfway))
    chex_equal(restored, halfway)
    chex_equal(run(*restored, 3), uninterrupted)


def test_flax_linen_train_state_and_nnx_optimizer():
    from flax import nnx
    from flax.training import train_state

    x = jax.random.normal(jax.random.key(0), (32, 8))
    y = jnp.sum(x, axis=1, keepdims=True)
    import flax.linen as nn
    model = nn.Dense(1, param_dtype=jnp.bfloat16, dtype=jnp.float32)
    params = model.init(jax.random.key(1), x)["params"]
    state = train_state.TrainState.create(
        apply_fn=model.apply, params=params,
        tx=optim.master_weights(optim.state_dtype(optax.adam(5e-2))))

    def linen_loss(p):
        return jnp.mean((state.apply_fn({"params": p}, x) - y) ** 2)

    first = float(linen_loss(state.params))
    step = jax.jit(lambda s: s.apply_gradients(grads=jax.grad(linen_loss)(s.params)))
    for _ in range(20):
        state = step(state)
    assert state.params["kernel"].dtype == BF16
    assert float(linen_loss(state.params)) < 0.5 * first
    np.testing.assert_array_equal(
        np.asarray(state.params["kernel"], np.float32),
        np.asarray(state.opt_state.master["kernel"].astype(BF16), np.float32))

    net = nnx.Linear(8, 1, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(net, optim.stochastic_rounding(optim.state_dtype(optax.adam(5e-2))),
                              wrt=nnx.Param)

    def nnx_loss(m):
        return jnp.mean((m(x).astype(F32) - y) ** 2)

    @nnx.jit
    def nnx_step(m, opt):
        grads = nnx.grad(nnx_loss)(m)
        opt.update(m, grads)

    first = float(nnx_loss(net))
    for _ in range(20):
        nnx_step(net, optimizer)
    assert net.kernel[...].dtype == BF16
    assert float(nnx_loss(net)) < 0.5 * first


def test_errors_in_the_users_terms():
    params16 = {"w": jnp.ones((2,), BF16)}
    with pytest.raises(TypeError, match=r"state_dtype\(tx\): tx must be an optax "
                                        r"GradientTransformation.*adam is a function: call it"):
        optim.state_dtype(optax.adam)
    with pytest.raises(TypeError, match="got str"):
        optim.master_weights("adam")
    for wrapper in (optim.master_weights, optim.stochastic_rounding, optim.compensated):
        with pytest.raises(ValueError, match=r"found float32\), so there is nothing to do"):
            wrapper(optax.sgd(0.1)).init({"w": jnp.ones((2,))})
        with pytest.raises(ValueError, match="update needs the current parameters"):
            tx = wrapper(optax.sgd(0.1))
            tx.update(params16, tx.init(params16))
    with pytest.raises(ValueError, match=r"state_dtype\(dtype=\.\.\.\).*int32 is not a floating"):
        optim.state_dtype(optax.sgd(0.1), jnp.int32)
    with pytest.raises(ValueError, match="float64 is wider than float32"):
        optim.state_dtype(optax.sgd(0.1), jnp.float64)
    with pytest.raises(TypeError, match=r"state_dtype\(dtype=\.\.\.\) must be a dtype .*got None"):
        optim.state_dtype(optax.sgd(0.1), None)  # was "float64 is wider than float32"
    with pytest.raises(ValueError, match=r"rounding=\.\.\.\) must be one of"):
        optim.master_weights(optax.sgd(0.1), rounding="up")


def test_update_with_the_wrong_state_or_structure_or_recast_params_names_it():
    """Each was an AttributeError or a bare pytree error from inside jamp, or (a parameter cast
    to float32 after init) a master copy silently left stale."""
    params = {"a": jnp.ones((3,), BF16), "b": jnp.ones((2,))}
    wrappers = {"master_weights": optim.master_weights, "compensated": optim.compensated,
                "stochastic_rounding": optim.stochastic_rounding,
                "state_dtype": optim.state_dtype}
    for name, wrapper in wrappers.items():
        tx = wrapper(optax.adam(1e-3))
        state = tx.init(params)
        for wrong in (optax.adam(1e-3).init(params), params):  # another's state; swapped
            with pytest.raises(TypeError, match=rf"{name}\(tx\)\.update\(grads, opt_state, "
                                                rf"params\): opt_state must be the .*State"):
                tx.update(params, wrong, state)
        if name == "state_dtype":  # (no per-parameter state of its own)
            continue
        with pytest.raises(ValueError, match=rf"{name}\(tx\)\.update: grads and params differ "
                                             r"in structure: Dict key mismatch"):
            tx.update({"a": params["a"]}, state, params)
    widened = {"a": params["a"].astype(F32), "b": params["b"]}  # e.g. restored as float32
    for wrapper, what in ((optim.master_weights, "its float32 master copy"),
                          (optim.compensated, "its compensation")):
        tx = wrapper(optax.adam(1e-3))
        with pytest.raises(ValueError, match=rf"params\['a'\] is float32 but was 16-bit when "
                                             rf"init made the state \({what}\)"):
            tx.update(widened, tx.init(params), widened)
    tx = optim.stochastic_rounding(optax.adam(1e-3))  # holds nothing per parameter: runs
    updates, _ = tx.update(widened, tx.init(params), widened)
    assert updates["a"].dtype == F32


def test_float32_and_float64_parameters_are_left_alone():
    with jax.enable_x64(True):
        params = {"half": jnp.ones((3,), BF16), "single": jnp.ones((3,), F32),
                  "double": jnp.ones((3,), jnp.float64)}
        grads = jax.tree.map(lambda p: jnp.full(p.shape, 0.25, p.dtype), params)
        for tx in (optim.master_weights(optax.sgd(0.5)), optim.stochastic_rounding(optax.sgd(0.5)),
                   optim.state_dtype(optax.sgd(0.5, momentum=0.9))):
            state = tx.init(params)
            updates, state = tx.update(grads, state, params)
            new = optax.apply_updates(params, updates)
            assert {k: v.dtype for k, v in new.items()} == {k: v.dtype for k, v in params.items()}
            assert float(new["double"][0]) == 1.0 - 0.125 and float(new["single"][0]) == 0.875
        state = optim.state_dtype(optax.sgd(0.5, momentum=0.9)).init(params)
        assert state.inner_state[0].trace["double"].dtype == jnp.float64


def test_sharded_state_and_no_gathers_in_a_subprocess():
    """tests/optim_sharding_checks.py on 8 host devices: stochastic_round's result does not
    depend on the device count; the optimizer state is sharded like its parameter; the compiled
    update has no collectives."""
    run_check_module("optim_sharding_checks", "optim sharding checks passed")


@pytest.mark.parametrize("make_tx, param_dtype", [
    (lambda: optim.state_dtype(optax.adam(1e-3), jnp.float16), F32),
    (lambda: optim.stochastic_rounding(optax.sgd(1e-3)), jnp.float16),
    (lambda: optim.master_weights(optax.sgd(1e-3), rounding="stochastic"), jnp.float16),
    (lambda: optim.state_dtype(optax.adam(1e-3), jnp.float8_e4m3fn), F32),
], ids=["state_dtype-float16", "stochastic_rounding-float16", "master_weights-float16",
        "state_dtype-float8"])
def test_steps_on_a_mesh_of_explicit_axes(make_tx, param_dtype):
    """On a mesh of explicit axes (jax.make_mesh's default) the second jitted step, whose step
    counter the first one placed on the mesh, raised ShardingTypeError with a float16 or
    float8 target. It runs, and lands where the same steps off the mesh land."""
    mesh = jax.make_mesh((1,), ("data",))
    tx = make_tx()
    # (built on the host: exact in every param_dtype here; 0.3 rounded as jnp.full rounds it)
    host = 1 + np.arange(64, dtype=np.float32).reshape(16, 4) / np.float32(64)
    params = {"k": jax.device_put(host.astype(param_dtype))}
    grads = {"k": jax.device_put(np.full((16, 4), 0.3, param_dtype))}

    @jax.jit
    def step(p, s):
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s

    def two_steps(p):
        s = tx.init(p)
        for _ in range(2):
            p, s = step(p, s)
        return p, s

    on_mesh = jax.device_put(params, NamedSharding(mesh, P("data")))
    chex.assert_trees_all_equal(two_steps(on_mesh), two_steps(params))


def test_state_dtype_keeps_master_copies_and_saturates_narrow_moments():
    params = {"w": jnp.ones((8,), BF16)}
    outer = optim.state_dtype(optim.master_weights(optax.sgd(0.1, momentum=0.9)))
    state = outer.init(params)
    assert state.inner_state.master["w"].dtype == F32  # was bfloat16
    assert state.inner_state.inner_state[0].trace["w"].dtype == BF16
    updates, state = outer.update({"w": jnp.ones((8,), BF16)}, state, params)
    assert state.inner_state.master["w"].dtype == F32
    # A gradient of 1e4: Adam's second moment (1e-3 * 1e8) is beyond float16's range; it was
    # inf, and the parameter froze (updates of 0).
    tx = optim.state_dtype(optax.adam(0.1), jnp.float16)
    state = tx.init({"w": jnp.zeros((4,))})
    updates, state = tx.update({"w": jnp.full((4,), 1e4)}, state)
    nu = state.inner_state[0].nu["w"]
    assert nu.dtype == jnp.float16 and bool(jnp.all(nu == jnp.finfo(jnp.float16).max))
    updates, state = tx.update({"w": jnp.full((4,), 1e4)}, state)
    assert bool(jnp.all(jnp.isfinite(updates["w"]) & (updates["w"] != 0)))


def test_state_dtype_wraps_lookahead_and_the_parameter_wrappers_say_where_it_goes():
    """state_dtype(optax.lookahead(...)) raised a bare pytree error (its updates are
    LookaheadParams, its gradients the fast parameters'); the parameter wrappers, which cannot
    wrap it, now say to put lookahead outside, where it works."""
    for dtype in (F32, BF16):
        params = optax.LookaheadParams.init_synced({"w": jnp.ones((3,), dtype)})
        grads = {"w": jnp.full((3,), 0.5, dtype)}
        tx = optim.state_dtype(optax.lookahead(optax.adam(0.1), sync_period=2,
                                               slow_step_size=0.5))
        state = tx.init(params)
        assert state.inner_state.fast_state[0].mu["w"].dtype == BF16
        for _ in range(3):
            updates, state = tx.update(grads, state, params)
            params = optax.apply_updates(params, updates)
        assert params.fast["w"].dtype == dtype and float(params.slow["w"][0]) < 1.0
    params = optax.LookaheadParams.init_synced({"w": jnp.ones((3,), BF16)})
    for wrapper in (optim.master_weights, optim.stochastic_rounding, optim.compensated):
        with pytest.raises(TypeError, match=r"params is optax.LookaheadParams.*put lookahead "
                                            r"outside the jamp wrapper"):
            wrapper(optax.lookahead(optax.adam(0.1), 2, 0.5)).init(params)
        tx = optax.lookahead(wrapper(optax.adam(0.1)), sync_period=2, slow_step_size=0.5)
        state = tx.init(params)
        updates, state = tx.update({"w": jnp.full((3,), 0.5, BF16)}, state, params)
        assert float(optax.apply_updates(params, updates).fast["w"][0]) < 1.0


def test_state_dtype_around_a_tx_with_a_cond_on_16_bit_parameters():
    """apply_if_finite and conditionally_transform inside state_dtype raised optax's "cond
    branches must have equal output types" on bfloat16 parameters: the state came in float32,
    the gradients in bfloat16, and the skipping branch returned them as they came."""
    params = {"w": jnp.ones((4,), BF16)}
    grads = {"w": jnp.full((4,), 0.1, BF16)}
    for inner in (optax.apply_if_finite(optax.adam(1e-2), 3),
                  optax.conditionally_transform(optax.adam(1e-2), lambda step: step % 2 == 0)):
        tx = optim.state_dtype(inner)
        updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
        assert updates["w"].dtype == BF16 and float(updates["w"][0]) < 0
    tx = optim.state_dtype(optax.apply_if_finite(optax.adam(1e-2), 3))
    state = tx.init(params)
    updates, skipped = tx.update({"w": grads["w"].at[0].set(jnp.nan)}, state, params)
    assert int(skipped.inner_state.notfinite_count) == 1 and not bool(jnp.any(updates["w"]))
    # a kept 16-bit leaf: computed in float32 too, stored back in its own dtype
    tx = optim.state_dtype(optax.apply_if_finite(optax.adam(1e-2), 3), keep=("*nu*",))
    _, state = tx.update(grads, tx.init(params), params)
    assert state.inner_state.inner_state[0].nu["w"].dtype == BF16


def test_wrappers_with_one_seed_side_by_side_draw_their_own_bits():
    """One wrapper per optax.multi_transform group, both with seed 0: the i-th leaf of each
    drew the same bits, so same-shaped layers rounded up and down together."""
    n = 4096
    params = {"decay": {"kernel": jnp.ones((n,), BF16)}, "no_decay": {"scale": jnp.ones((n,), BF16)}}
    grads = jax.tree.map(lambda p: jnp.full(p.shape, -1.0, F32), params)
    labels = {"decay": {"kernel": "decay"}, "no_decay": {"scale": "no_decay"}}
    for wrapper in (optim.stochastic_rounding,
                    functools.partial(optim.master_weights, rounding="stochastic"),
                    lambda t: optim.stochastic_rounding(optim.state_dtype(t))):
        tx = optax.multi_transform({"decay": wrapper(optax.sgd(2e-3, momentum=0.5)),
                                    "no_decay": wrapper(optax.sgd(2e-3, momentum=0.5))}, labels)
        new = optax.apply_updates(params, tx.update(grads, tx.init(params), params)[0])
        a = np.asarray(new["decay"]["kernel"], np.float32) > 1
        b = np.asarray(new["no_decay"]["scale"], np.float32) > 1
        p = a.mean()  # 2e-3 / 2**-7: up with probability ~0.26
        assert abs(np.mean(a == b) - (p * p + (1 - p) ** 2)) < 0.05, np.mean(a == b)
    # the moments of state_dtype too
    tx = optax.multi_transform({g: optim.state_dtype(optax.adam(1e-3)) for g in ("decay",
                                                                               "no_decay")}, labels)
    small = jax.tree.map(lambda p: jnp.full(p.shape, 1e-3 * (1 + 2**-9), F32), params)
    state = tx.update(small, tx.init(params), params)[1]
    mu = [s.inner_state.inner_state[0].mu for s in state.inner_states.values()]
    a, b = (np.asarray(m[k][w], np.float32) for m, (k, w) in zip(
        mu, (("decay", "kernel"), ("no_decay", "scale"))))
    assert 0.2 < np.mean(a == b) < 0.8


def test_compensated_float16_small_parameters_move_as_far_as_float32():
    """The float16 compensation of a parameter under 0.1 was itself in float16's subnormal
    range: updates of 0.04 steps moved a parameter of 1e-3 61% too far."""
    n, lr, v0 = 1000, 1e-4, 1e-3
    params = {"w": jnp.full((256,), v0, jnp.float16)}
    grads = {"w": jnp.full((256,), 0.37 * v0, F32)}

    def run(tx):
        def step(carry, _):
            p, s = carry
            updates, s = tx.update(grads, s, p)
            return (optax.apply_updates(p, updates), s), None
        (p, _), _ = jax.jit(lambda p, s: jax.lax.scan(step, (p, s), None, n))(params, tx.init(params))
        return float(jnp.mean(p["w"].astype(F32)))

    start = float(np.float16(v0))
    expected = n * lr * float(np.float32(0.37 * v0))
    moved = start - run(optim.compensated(optax.sgd(lr)))
    assert abs(moved / expected - 1) < 0.02, moved / expected
    state = optim.compensated(optax.sgd(lr)).init(params)
    assert state.compensation["w"].dtype == jnp.float16


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_compensated_bfloat16_zero_and_tiny_parameters_stay_finite(jit):
    """A bfloat16 parameter's spacing at 0 is 2**-133, a float32 subnormal that XLA on the CPU
    flushes to 0: a zero parameter with a zero update (a zero-init bias whose gradient is
    exactly 0) stored 0/0 as its compensation and was NaN from the next step on."""
    values = np.array([0, 0, 1e-39, 2**-126, 2**-125, 2**-120, -(2**-121), 1e-30, 1], np.float64)
    steps = np.array([0, 1e-2, 2**-130, 2**-135, -(2**-125), 3 * 2**-127, 1e-33, 1e-3, 1e-3])
    tx = optim.compensated(optax.sgd(1.0))
    update = jax.jit(tx.update) if jit else tx.update
    params = {"b": jnp.asarray(values, BF16)}
    grads = {"b": jnp.asarray(-steps, F32)}  # sgd(1.0)'s update is -grad
    state = tx.init(params)
    for _ in range(3):
        updates, state = update(grads, state, params)
        params = optax.apply_updates(params, updates)
    landed = np.asarray(params["b"], np.float32)
    compensation = np.asarray(state.compensation["b"], np.float32)
    assert np.isfinite(landed).all() and np.isfinite(compensation).all(), (landed, compensation)
    assert landed[0] == 0 and compensation[0] == 0  # no update: stays 0, nothing to carry
    assert params["b"].dtype == BF16 and state.compensation["b"].dtype == BF16
    np.testing.assert_allclose(landed, values + 3 * steps, rtol=2**-7, atol=2**-124)
