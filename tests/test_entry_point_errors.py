"""Errors and warnings of the analyses, tracing and jamp.optim entry points, in the user's terms.

An error raised in the user's function shows the user's frames, not jamp's, tracing's or JAX's
(as under jax.jit); option values that would be misread silently (a string flag, a dict of
rules, a nested wrapper) raise an error that says what to write instead.
"""

import warnings

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jamp
import tracing
from jamp import optim
from tests.host_data import ones
from tests.user_frames import assert_only_user_frames

BF16 = jnp.bfloat16

# --- an error in the user's function: the user's frames ----------------------------------------


def _raising_loss(w, x):
    return jnp.tanh(x @ w).sum() + _fails_here(x)


def _fails_here(x):
    raise ValueError("the user's own error")


def _raising_apply(variables, x):
    return _raising_loss(variables["w"], x)


# Built on the host and transferred: jnp.ones would compile a program per shape.
_W, _X = ones(3, 3), ones(2, 3)


@pytest.mark.parametrize("call", [
    lambda: jamp.explain(_raising_loss, _W, _X),
    lambda: jamp.find_nonfinite(_raising_loss, _W, _X),
    lambda: jamp.value_ranges(_raising_loss, _W, _X),
    lambda: jamp.tune(_raising_loss, _W, _X),
    lambda: tracing.trace(_raising_loss, (_W, _X)),
    lambda: tracing.check_trace(_raising_loss, (_W, _X)),
    lambda: tracing.freeze(_raising_apply, {"w": _W}, _X),
], ids=["explain", "find_nonfinite", "value_ranges", "tune", "trace", "check_trace", "freeze"])
def test_an_error_in_the_users_function_shows_only_the_users_frames(call, traceback_filtering):
    # These entry points were no API boundary: the traceback showed up to eight frames of jamp,
    # tracing and JAX (profiler.py, partial_eval.py, ...) between the call and the user's
    # function, where autocast_transform shows none.
    with pytest.raises(ValueError, match="the user's own error") as info:
        call()
    innermost = [("test_entry_point_errors.py", "_raising_loss"),
                 ("test_entry_point_errors.py", "_fails_here")]
    assert_only_user_frames(info.value, traceback_filtering, innermost)


def test_a_tracer_warning_points_at_the_users_call_through_the_boundary():
    # The warnings counted frames (stacklevel=4 and 5): one more frame, the API boundary's,
    # would make them point into JAX's traceback_util.
    key = jax.random.key(0)

    def noisy(x):
        return x + jax.random.normal(key, x.shape)

    for call in (tracing.trace, tracing.check_trace):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            call(noisy, (jnp.ones(3),))
        found = [w for w in caught if issubclass(w.category, tracing.TracerWarning)]
        assert found and all(w.filename == __file__ for w in found), [w.filename for w in found]


# --- tracing.freeze(weights=..., fold_batchnorm=...) -------------------------------------------


class _Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4, name="head")(nn.relu(nn.Dense(8, name="body")(x)))


@pytest.fixture(scope="module")
def mlp():
    # One compiled init: an eager one compiles each of its operations.
    return _Mlp(), jax.jit(_Mlp().init)(jax.random.key(0), _X), _X


@pytest.mark.parametrize("weights, got, fix", [
    ({"*head*": None, "*": jnp.int8}, "got a dict",
     "write weights=(('*head*', None), ('*', jnp.int8))"),
    ({("*", jnp.int8)}, "got a set, which has no order", "weights=(('*', jnp.int8),)"),
    (frozenset({("*", jnp.int4)}), "got a frozenset", "weights=(('*', jnp.int4),)"),
    (("*", jnp.int8), "got the single pair ('*', jnp.int8)", "write weights=(('*', jnp.int8),)"),
    (["*head*", None], "got the single pair ('*head*', None)", "write weights=(('*head*', None),)"),
], ids=["dict", "set", "frozenset", "pair", "list pair"])
def test_freeze_weights_in_a_form_that_is_not_rules_says_what_to_write(mlp, weights, got, fix):
    # A dict or set was read as a dtype ("cannot store weights as {...}"), a single pair as two
    # rules ("weights[0] ... got '*'"): Policy(rules=...) names the form to write.
    model, variables, x = mlp
    with pytest.raises(TypeError, match="weights= takes a dtype") as info:
        tracing.freeze(model, variables, x, weights=weights)
    assert got in str(info.value) and fix in str(info.value), str(info.value)


def test_freeze_weights_rules_from_a_dict_written_as_told_freeze_as_the_dict_meant(mlp):
    model, variables, x = mlp
    frozen = tracing.freeze(model, variables, x, weights=(("*head*", None), ("*", jnp.int8)))
    assert [(k.scope, k.stored) for k in frozen.kernels] == [
        ("_Mlp/body", "int8"), ("_Mlp/head", "float32")]


def test_freeze_weights_as_a_generator_of_pairs_is_its_rules_in_order(mlp):
    model, variables, x = mlp
    pairs = (("*head*", None), ("*", jnp.int8))
    from_generator = tracing.freeze(model, variables, x, weights=(p for p in pairs))
    from_tuple = tracing.freeze(model, variables, x, weights=pairs)
    assert from_generator.kernels == from_tuple.kernels
    chex.assert_trees_all_equal(from_generator(x), from_tuple(x))


def test_freeze_weights_with_a_regex_looking_glob_raises_with_the_glob_it_meant(mlp):
    # It was only warned about (matched no kernel), and nothing was quantized.
    model, variables, x = mlp
    with pytest.raises(ValueError, match=r"weights\[0\]\[0\] = '\^\.\*head\$' looks like a "
                                         r"regular expression.*e\.g\. '\*head'"):
        tracing.freeze(model, variables, x, weights=(("^.*head$", jnp.int8),))


def test_an_unmatched_weights_rule_warns_at_the_users_call(mlp):
    model, variables, x = mlp
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tracing.freeze(model, variables, x, weights=(("*hed*", None), ("*", jnp.int8)))
    found = [w for w in caught if issubclass(w.category, jamp.UnmatchedRuleWarning)]
    assert len(found) == 1 and found[0].filename == __file__, [w.filename for w in found]


@pytest.mark.parametrize("flag", ["no", "false", None, 0, 1])
def test_freeze_fold_batchnorm_must_be_a_bool(mlp, flag):
    # "no" and "false" are truthy: they folded; None and 0 did not. trace(check_trace=...) refuses
    # such values already.
    model, variables, x = mlp
    with pytest.raises(TypeError, match=r"fold_batchnorm must be True or False, got "
                                        rf"{type(flag).__name__} {flag!r}"):
        tracing.freeze(model, variables, x, fold_batchnorm=flag)


def test_freeze_fold_batchnorm_takes_a_numpy_bool(mlp):
    model, variables, x = mlp
    for flag in (np.True_, np.False_):
        frozen = tracing.freeze(model, variables, x, fold_batchnorm=flag)
        chex.assert_trees_all_close(frozen(x), model.apply(variables, x), rtol=1e-5)


# --- jamp.optim: nested parameter wrappers, reshaped parameters ---------------------------------


_WRAPPERS = {
    "master_weights": optim.master_weights,
    "stochastic_rounding": optim.stochastic_rounding,
    "compensated": optim.compensated,
}


@pytest.mark.parametrize("outer", sorted(_WRAPPERS))
@pytest.mark.parametrize("inner", sorted(_WRAPPERS))
def test_a_parameter_wrapper_nested_in_another_names_the_nesting(outer, inner):
    # The inner wrapper sees the outer one's float32 parameters; it said "no parameter is in a
    # 16-bit dtype (found float32) ... Cast the parameters first", of the user's bfloat16 ones.
    params = {"w": jnp.ones((2, 2), BF16), "b": jnp.zeros((2,), jnp.float32)}
    tx = _WRAPPERS[outer](optax.chain(optax.clip(1.0), _WRAPPERS[inner](optax.adam(1e-3))))
    with pytest.raises(ValueError, match=rf"jamp\.optim\.{inner} is nested inside "
                                         rf"jamp\.optim\.{outer}") as info:
        tx.init(params)
    message = str(info.value)
    assert "Cast the parameters" not in message
    assert f"jamp.optim.{inner}(tx)" in message
    if {inner, outer} == {"master_weights", "stochastic_rounding"}:
        assert "master_weights(tx, rounding='stochastic')" in message


def test_the_suggested_single_wrapper_trains_the_16_bit_parameters():
    params = {"w": jnp.ones((2, 2), BF16)}
    tx = optim.master_weights(optax.sgd(0.1), rounding="stochastic")
    state = tx.init(params)
    updates, _ = tx.update({"w": jnp.ones((2, 2), BF16)}, state, params)
    new = optax.apply_updates(params, updates)
    assert new["w"].dtype == BF16
    chex.assert_trees_all_close(new["w"].astype(jnp.float32), jnp.full((2, 2), 0.9), atol=1e-2)


def test_float32_parameters_outside_any_wrapper_still_say_cast_them():
    with pytest.raises(ValueError, match="Cast the parameters first"):
        optim.stochastic_rounding(optax.sgd(0.1)).init({"w": jnp.ones((2,))})
    # and a wrapper whose init ran inside another's before does not remember it
    with pytest.raises(ValueError, match="nested inside"):
        optim.master_weights(optim.compensated(optax.sgd(0.1))).init({"w": jnp.ones(2, BF16)})
    with pytest.raises(ValueError, match="Cast the parameters first"):
        optim.compensated(optax.sgd(0.1)).init({"w": jnp.ones((2,))})


@pytest.mark.parametrize("wrapper, held", [
    (optim.master_weights, "its float32 master copy"),
    (optim.compensated, "its compensation"),
])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_update_with_a_parameter_reshaped_since_init_names_it(wrapper, held, jit):
    # It failed in jnp's terms, "sub got incompatible shapes for broadcasting: (4, 4), (2, 2)",
    # with no path; a dtype changed since init is named by path.
    tx = wrapper(optax.sgd(0.1))
    state = tx.init({"w": jnp.ones((2, 2), BF16), "b": jnp.zeros((3,))})
    params = {"w": jnp.ones((4, 4), BF16), "b": jnp.zeros((3,))}
    update = jax.jit(tx.update) if jit else tx.update
    with pytest.raises(ValueError, match=r"params\['w'\] has shape \(4, 4\) but had \(2, 2\) "
                                         rf"when init made the state \({held}\)"):
        update(params, state, params)


# --- find_nonfinite(max_remedies=...) ----------------------------------------------------------


def _overflows(w, x):
    return (x @ w).sum()  # 256 * 16 * 16 = 65536: over float16's largest value, 65504


_ARGS = (jnp.full((256, 4), 16.0), jnp.full((4, 256), 16.0))


@pytest.mark.parametrize("value, error, match", [
    ("3", TypeError, "must be an int >= 0 .*got str '3'"),
    (2.0, TypeError, "got float 2.0"),
    (True, TypeError, "got bool True"),
    (-1, ValueError, "must be >= 0 .*got -1"),
])
def test_find_nonfinite_max_remedies_must_be_a_count(value, error, match):
    # "3" failed in a slice ("slice indices must be integers"), after the whole search; -1
    # silently dropped the last candidate.
    def never_traced(w, x):
        raise AssertionError("checked before tracing")

    for fn in (_overflows, never_traced):
        with pytest.raises(error, match=r"find_nonfinite\(max_remedies=\.\.\.\) .*" + match):
            jamp.find_nonfinite(fn, *_ARGS, policy=jnp.float16, max_remedies=value)


def test_find_nonfinite_max_remedies_takes_numpy_ints_and_zero():
    found = jamp.find_nonfinite(_overflows, *_ARGS, policy=jnp.float16, max_remedies=np.int64(0))
    assert found is not None and found.primitive == "dot_general"
    assert found.remedy is None and found.tried == ()
    found = jamp.find_nonfinite(_overflows, *_ARGS, policy=jnp.float16, max_remedies=np.int32(6))
    assert found is not None and found.remedy is not None


def test_freeze_with_a_policy_rule_that_matches_nothing_warns_at_the_users_call():
    """The warning pointed at tracing/freeze.py and named its inner ``flat_fn``."""
    model = nn.Dense(4)
    variables = jax.jit(model.init)(jax.random.PRNGKey(0), _X)
    policy = jamp.Policy(rules=(("*no_such_scope*", None),))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tracing.freeze(model, variables, _X, policy=policy)
    unmatched = [w for w in caught if issubclass(w.category, jamp.UnmatchedRuleWarning)]
    assert len(unmatched) == 1
    assert unmatched[0].filename == __file__
    assert "flat_fn" not in str(unmatched[0].message) and "freeze.py" not in str(unmatched[0].message)
