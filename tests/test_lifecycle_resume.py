"""Resuming and changing course: loss scales that reach a process without their constructor
(unpickled, rebuilt from a treedef) serialize with flax; a state saved under another
``state_dtype`` configuration is refused naming the leaf; parameters added or reshaped between
steps are named by ``state_dtype``, ``stochastic_rounding`` and ``accumulate_micro_batches``."""
import copyreg
import os
import pickle
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import serialization
from flax.training import train_state

import jamp
from tests.check_modules import ROOT

BF16, F16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)
optim = jamp.optim


# --- loss scales made without their constructor, in a fresh interpreter ----------------------


def _scales():
    return {
        "dynamic": jamp.DynamicLossScale(2.0**10, counter=3, period=7),
        "micro": jamp.MicroBatchLossScale(jamp.StaticLossScale(8.0), every_k=2),
        "none": jamp.NoOpLossScale(),
    }


class _OldPickler(pickle.Pickler):
    """Pickles loss scales as the default protocol did before they had ``__reduce__`` (a new
    object and its field dict), as a pickle written by an older jamp holds them."""

    def reducer_override(self, obj):
        if isinstance(obj, jamp.loss_scale._LossScale):
            return copyreg.__newobj__, (type(obj),), dict(obj.__dict__)
        return NotImplemented


def _pickled(how):
    if how == "old pickle":
        import io

        buffer = io.BytesIO()
        _OldPickler(buffer).dump(_scales())
        return buffer.getvalue()
    if how == "treedef":
        leaves, treedef = jax.tree.flatten(_scales())
        return pickle.dumps((treedef, [np.asarray(x) for x in leaves]))
    return pickle.dumps(_scales())


# The child makes no scale with a constructor: the state comes from the pickle, or from a
# treedef and leaves, as a loaded export's outputs or an orbax restore into its in_tree are.
_CHILD = """
import pickle, sys
import jax, numpy as np
import jamp
from flax import serialization
how = sys.argv[2]
loaded = pickle.load(open(sys.argv[1], "rb"))
state = jax.tree.unflatten(*loaded) if how == "treedef" else loaded
assert type(state["dynamic"]).__name__ == "DynamicLossScale", state
blob = serialization.to_bytes(state)
back = serialization.from_bytes(state, blob)
assert type(back["dynamic"]) is jamp.DynamicLossScale, back
assert type(back["micro"]) is jamp.MicroBatchLossScale, back
assert type(back["micro"].inner) is jamp.StaticLossScale, back
assert type(back["none"]) is jamp.NoOpLossScale, back
assert float(back["dynamic"].loss_scale) == 2.0**10 and int(back["dynamic"].counter) == 3
assert int(back["dynamic"].period) == 7 and int(back["micro"].every_k) == 2
assert float(back["micro"].loss_scale) == 8.0
print("round trip ok")
"""


@pytest.mark.parametrize("how", ["pickle", "old pickle", "treedef"])
def test_a_loss_scale_made_without_its_constructor_serializes_with_flax(tmp_path, how):
    """In a fresh interpreter where no scale was constructed (one constructor call registers
    every scale), a scale that was unpickled or unflattened goes through to_bytes and
    from_bytes: msgpack raised "can not serialize 'DynamicLossScale' object", and from_bytes
    into such a target returned a plain dict."""
    path = tmp_path / "state.pkl"
    path.write_bytes(_pickled(how))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", _CHILD, str(path), how], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "round trip ok" in out.stdout


def test_pickled_scales_come_back_equal():
    """``__reduce__`` keeps every field (and validates nothing anew: a traced counter is
    not checked either)."""
    for name, scale in _scales().items():
        back = pickle.loads(pickle.dumps(scale))
        assert type(back) is type(scale), name
        for a, b in zip(jax.tree.leaves(scale), jax.tree.leaves(back)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            assert np.asarray(a).dtype == np.asarray(b).dtype


# --- a state saved under another state_dtype configuration ------------------------------------


PARAMS = {"w": jnp.full((4, 4), 0.5), "b": jnp.zeros((4,))}
GRADS = jax.tree.map(lambda a: jnp.full(a.shape, 0.01), PARAMS)


def _saved_then_restored(old_tx, new_tx):
    """A TrainState trained one step under ``old_tx``, saved with flax.serialization and
    restored (flax's documented way) into a TrainState made with ``new_tx``."""
    st = train_state.TrainState.create(apply_fn=None, params=PARAMS, tx=old_tx)
    blob = serialization.to_bytes(st.apply_gradients(grads=GRADS))
    target = train_state.TrainState.create(apply_fn=None, params=PARAMS, tx=new_tx)
    return serialization.from_bytes(target, blob)


def _moments(st):
    adam = st.opt_state.inner_state[0]
    return adam.mu["w"].dtype, adam.nu["w"].dtype


@pytest.mark.parametrize("jit", [False, True])
def test_a_narrowed_leaf_in_another_dtype_is_refused_naming_it(jit):
    """bfloat16 moments given to state_dtype(adamw, float16, keep nu): mu was stored float16
    from then on but nu stayed bfloat16 for good, and a guarded step failed on the mismatch
    without naming its cause."""
    new_tx = optim.state_dtype(optax.adamw(1e-2), jnp.float16, keep=("*nu*",))
    resumed = _saved_then_restored(optim.state_dtype(optax.adamw(1e-2)), new_tx)
    assert _moments(resumed) == (BF16, BF16)
    step = lambda s: s.apply_gradients(grads=GRADS)
    with pytest.raises(ValueError, match=(
            r"state_dtype\(tx\)\.update: opt_state\.inner_state\[0\]\.mu\['b'\] is bfloat16 but "
            r"this state_dtype stores it in float16 \(state_dtype\(tx, dtype=float16\)\).*"
            r"jax\.eval_shape\(tx\.init, params\)")):
        (jax.jit(step) if jit else step)(resumed)


def test_a_kept_leaf_in_another_dtype_is_refused_naming_the_keep_glob():
    """float16 moments (mu as this configuration stores it) with nu kept: nu must be what
    adamw makes, float32."""
    new_tx = optim.state_dtype(optax.adamw(1e-2), jnp.float16, keep=("*nu*",))
    resumed = _saved_then_restored(optim.state_dtype(optax.adamw(1e-2), jnp.float16), new_tx)
    assert _moments(resumed) == (F16, F16)
    with pytest.raises(ValueError, match=(
            r"opt_state\.inner_state\[0\]\.nu\['b'\] is float16 but this state_dtype stores it "
            r"in float32 \(kept by keep=\('\*nu\*',\), as tx\.init makes it\)")):
        jax.jit(lambda s: s.apply_gradients(grads=GRADS))(resumed)


def test_a_plain_optax_state_given_to_state_dtype_is_refused():
    resumed = _saved_then_restored(optax.adam(1e-2), optax.adam(1e-2))
    tx = optim.state_dtype(optax.adam(1e-2))
    with pytest.raises(ValueError, match=r"\[0\]\.mu\['b'\] is float32 but this state_dtype "
                                         r"stores it in bfloat16"):
        tx.update(GRADS, optim.StateDtypeState(jnp.zeros([], jnp.int32), resumed.opt_state),
                  PARAMS)


def test_the_conversion_the_error_gives_resumes_in_the_configured_dtypes():
    """The message's conversion (cast to jax.eval_shape(tx.init, params)) gives a state that
    steps in this configuration's dtypes, guarded steps and apply_if_finite included."""
    new_tx = optim.state_dtype(optax.adamw(1e-2), jnp.float16, keep=("*nu*",))
    resumed = _saved_then_restored(optim.state_dtype(optax.adamw(1e-2)), new_tx)
    opt_state = jax.tree.map(lambda x, t: x.astype(t.dtype), resumed.opt_state,
                             jax.eval_shape(new_tx.init, PARAMS))
    resumed = resumed.replace(opt_state=opt_state)

    def guarded(s):
        return jamp.select_tree(jnp.array(True), s.apply_gradients(grads=GRADS), s)

    s = resumed
    for _ in range(3):
        s = jax.jit(guarded)(s)
    assert _moments(s) == (F16, F32)
    assert int(s.opt_state.step) == 4  # the saved step, then three
    guarded_tx = optax.apply_if_finite(new_tx, 3)
    g_state = guarded_tx.init(PARAMS)._replace(inner_state=opt_state)
    _, g_state = jax.jit(guarded_tx.update)(GRADS, g_state, PARAMS)
    assert g_state.inner_state.inner_state[0].nu["w"].dtype == F32


def test_16_bit_leaves_adam_made_and_keep_kept_are_not_refused():
    """bfloat16 parameters' moments are bfloat16 as adam makes them: kept, they stay, steps
    go on, eagerly and under jit."""
    params, grads = (jax.tree.map(lambda a: jax.device_put(np.asarray(a).astype(jnp.bfloat16)), t)
                     for t in (PARAMS, GRADS))  # (cast on the host: see host_full)
    tx = optim.state_dtype(optax.adam(1e-2), jnp.float16, keep=("*nu*",))
    state = tx.init(params)
    assert state.inner_state[0].nu["w"].dtype == BF16
    for update in (tx.update, jax.jit(tx.update), tx.update):
        _, state = update(grads, state, params)
    assert (state.inner_state[0].mu["w"].dtype, state.inner_state[0].nu["w"].dtype) == (F16, BF16)


# --- parameters added, removed or reshaped between steps -------------------------------------


def host_full(shape, value, dtype):
    """jnp.full(shape, value, dtype), built on the host and put with jax.device_put, which
    compiles nothing (eagerly, jnp.full, and jnp.asarray of a numpy array, compile a program per
    shape and dtype)."""
    return jax.device_put(np.full(shape, value, dtype))


P = {"enc": {"w": host_full((4, 4), 0.5, jnp.bfloat16)},
     "head": {"w": host_full((4, 2), 0.25, jnp.bfloat16), "b": host_full((2,), 0.0, np.float32)}}


def re_shape(shape):
    return str(tuple(shape)).replace("(", r"\(").replace(")", r"\)")


def _grads(params):
    return jax.tree.map(lambda a: host_full(a.shape, 0.01, a.dtype), params)


def _wrappers():
    return {
        "state_dtype": ("state_dtype", lambda: optim.state_dtype(optax.adam(1e-2))),
        "stochastic_rounding(state_dtype)": (
            "state_dtype",
            lambda: optim.stochastic_rounding(optim.state_dtype(optax.adam(1e-2)))),
        "stochastic_rounding": ("stochastic_rounding",
                                lambda: optim.stochastic_rounding(optax.adam(1e-2))),
    }


ADDED = {**P, "new": {"w": host_full((3,), 1.0, jnp.bfloat16)}}
RESHAPED = {**P, "enc": {"w": host_full((4, 5), 0.5, jnp.bfloat16)}}
# 1x4 against 4x4 moments broadcasts: the parameter would have come back 4x4
BROADCAST = {**P, "enc": {"w": host_full((1, 4), 0.5, jnp.bfloat16)}}


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("name", sorted(_wrappers()))
def test_a_parameter_added_since_init_is_named(name, jit):
    who, make = _wrappers()[name]
    tx = make()
    state = tx.init(P)
    update = jax.jit(tx.update) if jit else tx.update
    with pytest.raises(ValueError, match=(
            rf"jamp\.optim\.{who}\(tx\)\.update: opt_state\.inner_state and params differ in "
            r"structure: init\(params\) makes opt_state\.inner_state(\.inner_state)?\[0\]\.mu"
            r"\['new'\]\['w'\].*which opt_state lacks\. A parameter added or removed")):
        update(_grads(ADDED), state, ADDED)


def test_a_parameter_removed_since_init_is_named():
    tx = optim.state_dtype(optax.adam(1e-2))
    state = tx.init(P)
    fewer = {"enc": P["enc"], "head": {"w": P["head"]["w"]}}
    with pytest.raises(ValueError, match=(
            r"differ in structure: opt_state has opt_state\.inner_state\[0\]\.mu\['head'\]\['b'\]"
            r".*which init\(params\) does not make")):
        tx.update(_grads(fewer), state, fewer)


@pytest.mark.parametrize("params", [RESHAPED, BROADCAST], ids=["4x5", "1x4"])
@pytest.mark.parametrize("name", sorted(_wrappers()))
def test_a_parameter_reshaped_since_init_is_named(name, params):
    who, make = _wrappers()[name]
    tx = make()
    state = tx.init(P)
    with pytest.raises(ValueError, match=(
            rf"jamp\.optim\.{who}\(tx\)\.update: params\['enc'\]\['w'\] has shape "
            + re_shape(params["enc"]["w"].shape) + r" but had \(4, 4\) when init made the state "
            r"\(opt_state\.inner_state.*\['enc'\]\['w'\]\); make the state again with "
            r"init\(params\)")):
        tx.update(_grads(params), state, params)


def test_grads_unlike_the_parameters_are_named_by_state_dtype():
    tx = optim.state_dtype(optax.adam(1e-2))
    state = tx.init(P)
    grads = {"enc": _grads(P)["enc"], "head": {"w": _grads(P)["head"]["w"]}}
    with pytest.raises(ValueError, match=r"state_dtype\(tx\)\.update: grads and params differ "
                                         r"in structure"):
        tx.update(grads, state, P)


@pytest.mark.parametrize("jit", [False, True])
def test_accumulate_micro_batches_names_a_parameter_added(jit):
    tx = jamp.accumulate_micro_batches(optax.adam(1e-2), 2)
    state = tx.init(P)
    update = jax.jit(tx.update) if jit else tx.update
    with pytest.raises(ValueError, match=(
            r"jamp\.accumulate_micro_batches\(tx, every_k\)\.update: opt_state\.acc_grads and "
            r"grads differ in structure: .*'new'.*A parameter added or removed")):
        update(_grads(ADDED), state, ADDED)


@pytest.mark.parametrize("params", [RESHAPED, BROADCAST], ids=["4x5", "1x4"])
def test_accumulate_micro_batches_names_a_parameter_reshaped(params):
    tx = jamp.accumulate_micro_batches(optax.adam(1e-2), 2)
    state = tx.init(P)
    with pytest.raises(ValueError, match=(
            r"accumulate_micro_batches\(tx, every_k\)\.update: grads\['enc'\]\['w'\] has shape "
            + re_shape(params["enc"]["w"].shape) + r" but had \(4, 4\) when init made the state "
            r"\(opt_state\.acc_grads\['enc'\]\['w'\]\)")):
        tx.update(_grads(params), state, params)


def test_unchanged_parameters_step_as_before():
    """The checks add nothing a normal step sees: same updates as the wrapped optimizers'."""
    for _, make in _wrappers().values():
        tx = make()
        state = tx.init(P)
        for _ in range(2):
            updates, state = tx.update(_grads(P), state, P)
        assert jax.tree.structure(updates) == jax.tree.structure(P)
        assert all(u.shape == p.shape for u, p in zip(jax.tree.leaves(updates),
                                                      jax.tree.leaves(P)))
    acc = jamp.accumulate_micro_batches(optax.adam(1e-2), 2)
    state = acc.init(P)
    for _ in range(2):
        updates, state = acc.update(_grads(P), state, P)
    assert int(state.mini_step) == 0 and int(state.skipped_steps) == 0


def test_accumulation_from_a_numpy_state_is_the_step_from_jax_arrays_bit_for_bit():
    """flax.serialization's restore gives numpy arrays: the branches of the accumulation's cond
    captured them as constants, which XLA folded (2 ulps off, eagerly)."""
    params = {"w": jnp.full((4, 4), 0.5), "b": jnp.zeros((4,))}
    grads = jax.tree.map(lambda a: jnp.full(a.shape, 0.01), params)
    tx = jamp.accumulate_micro_batches(optax.adam(1e-2), 2)
    _, state = tx.update(grads, tx.init(params), params)
    expected, _ = tx.update(grads, state, params)
    got, _ = tx.update(grads, jax.tree.map(np.asarray, state), jax.tree.map(np.asarray, params))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
