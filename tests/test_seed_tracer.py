"""Ports of PyTorch's tracer tests (test/jit/test_tracer.py) that make sense in JAX.

Each test names the torch test it ports. What differs in JAX: reading a traced value as a Python
value raises instead of warning (test_trace_warn, test_trace_checker_dot_data), memoizing a
traced value leaks a tracer, and a call with another pytree structure (an extra dict key) is an
error rather than ignored, because the compiled program's signature is the pytree.
"""
import collections
import copy
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tracing

Point = collections.namedtuple("Point", "x y")


def rand(*shape, seed=0):
    """Test data drawn with numpy and transferred (jax.device_put compiles nothing, where
    jnp.asarray or jax.random compile a program for each shape): a float32 jax.Array."""
    return jax.device_put(np.random.default_rng(seed).random(shape, np.float32))


def assert_trace_matches(fn, inputs, *other_inputs):
    """torch's checkTrace: trace at ``inputs``; the traced function matches ``fn`` everywhere."""
    traced = tracing.trace(fn, inputs)
    for args in (inputs,) + other_inputs:
        chex.assert_trees_all_close(traced(*args), fn(*args), rtol=1e-6, atol=1e-6)
    return traced


def test_simple():
    assert_trace_matches(lambda x, y: jax.nn.sigmoid(jnp.tanh(x * (x + y))),
                         (jnp.array([0.4]), jnp.array([0.7])),
                         (jnp.array([-2.0]), jnp.array([3.0])))


def test_constant():
    assert_trace_matches(lambda x: x @ jnp.diag(jnp.array([2.0, 2.0])), (rand(2, 2),),
                         (jnp.ones((2, 2)),))


def test_wrapped_number_and_no_inputs():
    traced = tracing.trace(lambda: -10000.0 * jnp.ones(1, jnp.float32), ())
    assert traced().dtype == jnp.float32
    chex.assert_trees_all_close(traced(), jnp.full(1, -10000.0))


def test_trace_aliased_parameter():
    param = rand(3, 4)
    traced = tracing.trace(lambda y: param + y, (param,))
    chex.assert_trees_all_close(traced(rand(3, 4, seed=1)), param + rand(3, 4, seed=1))


def test_repeated_input_and_output():
    x = rand(2, 2)
    traced = assert_trace_matches(lambda a, b: a + b, (x, x))
    assert len(traced.jaxpr.jaxpr.invars if hasattr(traced.jaxpr, "jaxpr") else
               traced.jaxpr.invars) == 2

    def twice(a, b):
        z = a + b
        return z, z

    traced = assert_trace_matches(twice, (x, rand(2, 2, seed=1)))
    jaxpr = traced.jaxpr.jaxpr if hasattr(traced.jaxpr, "jaxpr") else traced.jaxpr
    assert jaxpr.outvars[0] is jaxpr.outvars[1]  # one value returned twice, not computed twice


def test_trace_tuple_and_nested_datatypes():
    x, y = rand(2, 2), (jnp.ones((2, 2)), rand(2, 2, seed=1))
    traced = assert_trace_matches(lambda x, y: (x, (x * y[1], x * y[0])), (x, y))
    assert jax.tree.structure(traced(x, y)) == jax.tree.structure((x, (x, x)))

    def nested(x):
        stuff = [[x + 1, x - 1], [x + 2, x - 2]]
        return stuff[0][0], stuff[1][1]

    assert_trace_matches(nested, (rand(3, 4),))


def test_trace_namedtuple():
    traced = assert_trace_matches(lambda p: Point(p.x + p.y, p.y),
                                  (Point(rand(3), rand(3, seed=1)),))
    assert isinstance(traced(Point(rand(3), rand(3))), Point)


def test_input_dict_remembers_keys():
    traced = tracing.trace(lambda d: d["x"], ({"x": jnp.array(1)},))
    assert traced({"x": jnp.array(1)}) == 1
    assert traced({"x": jnp.array(2)}) == 2
    with pytest.raises(TypeError, match=r"inputs\[0\]\['y'\]"):
        traced({"y": jnp.array(3)})
    with pytest.raises(TypeError, match=r"unexpected inputs\[0\]\['y'\]"):
        traced({"x": jnp.array(4), "y": jnp.array(3)})


def test_input_dict_insertion_order():
    input_x_then_y = {"x": jnp.array(1), "y": jnp.array(2)}
    traced = tracing.trace(lambda d: (d["x"], d["y"]), (input_x_then_y,))
    assert traced(input_x_then_y) == (1, 2)
    input_y_then_x = {"y": jnp.array(4), "x": jnp.array(3)}
    assert traced(input_y_then_x) == (3, 4)


def test_input_dict_recursive_tuple_of_dicts_and_lists():
    traced = tracing.trace(lambda d: d["x"][1], ({"x": {1: jnp.array(1)}},))
    assert traced({"x": {1: jnp.array(2)}}) == 2
    inputs = {"x": {"y": rand(2, 3)}}
    assert_trace_matches(lambda t: t[0]["x"]["y"], ((inputs, inputs),))
    assert_trace_matches(lambda d: d["x"][0] + d["x"][1], ({"x": [rand(2), rand(2, seed=1)]},))
    assert_trace_matches(lambda items: items[0][1] * items[1][0],
                         ([(rand(2), rand(2, seed=1)), (rand(2, seed=2), rand(2, seed=3))],))
    assert_trace_matches(lambda d: (d["int"], d["float"]),
                         ({"int": jnp.ones((2, 2), jnp.int32), "float": jnp.ones((2, 2))},))


def test_input_dict_empty_and_empty_list():
    traced = tracing.trace(lambda d, x: x * 2, ({}, rand(2)))
    chex.assert_trees_all_close(traced({}, rand(2)), rand(2) * 2)
    traced = tracing.trace(lambda d: d["x"] if d["y"] == [] else None,
                           ({"x": rand(2), "y": []},))
    chex.assert_trees_all_close(traced({"x": rand(2), "y": []}), rand(2))


def test_trace_dict_output_keeps_keys_and_order():
    x = (rand(3), rand(3, seed=1))
    traced = tracing.trace(lambda a, b: {"b": b, "a": a}, x)
    out = traced(*x)
    assert list(out) == ["b", "a"]
    chex.assert_trees_all_close(out, {"b": x[1], "a": x[0]})


def test_trace_with_number_and_tensor_list_outputs():
    traced = tracing.trace(lambda: [jnp.zeros(1), jnp.zeros(5)], ())
    assert [o.shape for o in traced()] == [(1,), (5,)]
    numbers = tracing.trace(lambda: [1, 5], ())
    assert [int(o) for o in numbers()] == [1, 5]
    with pytest.raises(TypeError, match=r"returned a str at outputs\[1\]"):
        tracing.trace(lambda: [jnp.zeros(1), "five"], ())


def test_trace_optional_none_leaves():
    def maybe(x):
        return jnp.zeros(1) if x is None else x

    assert tracing.trace(maybe, (None,))(None).shape == (1,)
    chex.assert_trees_all_close(tracing.trace(maybe, (jnp.ones(2),))(jnp.ones(2)), jnp.ones(2))


def test_trace_slice_index_and_casts():
    x = rand(4, 6)
    assert_trace_matches(lambda x: x[1:3, ::2] + x[-1, ::2], (x,))
    assert_trace_matches(lambda x, i: x[i], (x, jnp.array(2)), (x, jnp.array(0)))
    traced = assert_trace_matches(lambda x: (x.astype(jnp.int32), x.astype(jnp.bfloat16)),
                                  (x * 10,))
    assert [o.dtype for o in traced(x)] == [jnp.int32, jnp.bfloat16]


def test_conv_and_max_pool():
    from flax import linen as nn

    conv = nn.Conv(4, (3, 3))
    x = rand(2, 8, 8, 3)
    variables = conv.init(jax.random.key(0), x)
    assert_trace_matches(conv.apply, (variables, x), (variables, rand(2, 8, 8, 3, seed=1)))
    assert_trace_matches(lambda x: nn.max_pool(x, (2, 2), strides=(2, 2)), (x,))


def test_trace_checker_control_flow():
    def foo(x):
        for _ in range(x.shape[0]):
            x = -x
        return x

    with pytest.raises(tracing.TracingCheckError, match=r"Graphs differed across invocations!"):
        tracing.trace(foo, rand(3, 4), check_inputs=[rand(4, 4)])


def test_trace_checker_memoization():
    def foo(x):  # memoizes a Python decision on the first call: the second trace differs
        if not hasattr(foo, "seen"):
            foo.seen = True
            return x + jnp.negative(x)
        return x + x

    with pytest.raises(tracing.TracingCheckError, match=r"Graphs differed across invocations!"):
        tracing.trace(foo, rand(3, 4), check_inputs=[(rand(3, 4),)])

    def bar(x):  # memoizes the traced value itself: a leaked tracer in JAX
        if not hasattr(bar, "cache"):
            bar.cache = jnp.negative(x)
        return x + bar.cache

    with pytest.raises(tracing.TracingCheckError, match="leaked out of the trace"):
        tracing.trace(bar, rand(3, 4), check_inputs=[(rand(3, 4),)])


def test_trace_warn_becomes_check_errors():
    with pytest.raises(tracing.TracingCheckError, match="needs the concrete value"):
        tracing.trace(lambda x: x + int(x[0]), jnp.array([1]))
    with pytest.raises(tracing.TracingCheckError, match="needs the concrete value"):
        tracing.trace(lambda x: x if x[0] else -x, jnp.array([1]))
    with pytest.raises(tracing.TracingCheckError, match="needs the concrete value"):
        tracing.trace(lambda x: x * float(x[0]), jnp.array([1.0]))
    with pytest.raises(tracing.TracingCheckError, match="needs the concrete value"):
        tracing.trace(lambda x: jnp.array(x.tolist()), jnp.array([1.0]))


def test_trace_checker_dropout_train_and_notrain():
    key = jax.random.key(0)

    def dropout(x, train):
        if not train:
            return x
        keep = jax.random.bernoulli(key, 0.5, x.shape)
        return jnp.where(keep, x / 0.5, 0.0)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tracing.trace(lambda x: dropout(x, True), rand(3, 4), check_inputs=[rand(5, 6)])
    assert any(issubclass(w.category, tracing.TracerWarning)
               and "draws the same random numbers" in str(w.message) for w in caught)
    x = rand(3, 4)
    chex.assert_trees_all_close(tracing.trace(lambda x: dropout(x, False), x)(x), x)


# fast twin: test_tracing.py::
#     test_keys_passed_as_inputs_do_not_warn_and_draws_inside_control_flow_are_followed
@pytest.mark.slow
def test_trace_random_with_the_key_as_input():
    def normal(key, mean, std):
        return mean + std * jax.random.normal(key, mean.shape)

    mean, std = jnp.zeros((5, 5)), jnp.ones((5, 5))
    traced = tracing.trace(normal, (jax.random.key(1), jnp.zeros((2, 3)), jnp.ones((2, 3))),
                           check_inputs=[(jax.random.key(2), mean, std)])
    key = jax.random.key(7)
    traced_at_5 = tracing.trace(normal, (key, mean, std))
    chex.assert_trees_all_close(traced_at_5(key, mean, std), normal(key, mean, std))
    assert not np.allclose(traced_at_5(jax.random.key(8), mean, std), normal(key, mean, std))
    assert traced(key, jnp.zeros((2, 3)), jnp.ones((2, 3))).shape == (2, 3)


def test_trace_save_load_and_copy():
    traced = tracing.trace(lambda x: x + 2, (jnp.ones((2, 2)),))
    loaded = tracing.load(traced.export())
    x = rand(2, 2)
    chex.assert_trees_all_close(loaded(x), traced(x))
    chex.assert_trees_all_close(copy.copy(loaded)(x), x + 2)
    chex.assert_trees_all_close(copy.deepcopy(loaded)(x), x + 2)
    chex.assert_trees_all_close(tracing.load(bytearray(traced.export()))(x), x + 2)


def test_trace_export_of_a_flax_module_with_nested_outputs():
    from flax import linen as nn

    class TwoHeads(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.relu(nn.Dense(8)(x))
            return {"logits": nn.Dense(3)(h), "aux": (h.mean(), None)}

    model, x = TwoHeads(), rand(4, 5)
    variables = model.init(jax.random.key(0), x)
    loaded = tracing.load(tracing.trace(model.apply, (variables, x)).export())
    got, want = loaded(variables, x), model.apply(variables, x)
    chex.assert_trees_all_close(got, want, rtol=1e-6)
    assert jax.tree.structure(got) == jax.tree.structure(want)
