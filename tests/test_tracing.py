"""tracing.trace / check_trace / TracedFunction / export: the API and each of the six checks."""
import collections
import functools
import subprocess
import sys
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jamp
import tracing
from tests.conftest import compilation_cache_options
from tracing import graph as graphs
from tracing.trace import trace_once

# Test data built with numpy and transferred: jax.device_put compiles nothing, where jnp.arange,
# reshape or jax.random compile a program for each shape.
X = jax.device_put(np.arange(12, dtype=np.float32).reshape(3, 4))
Pair = collections.namedtuple("Pair", "first second")


def recorded_tracer_warnings(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn()
    return result, [str(w.message) for w in caught if issubclass(w.category,
                                                                  tracing.TracerWarning)]


# --- the traced artifact ---

def test_traced_function_runs_the_program_and_exposes_its_forms():
    traced = tracing.trace(lambda x, w: jnp.tanh(x @ w), (X, jnp.ones((4, 2))))
    chex.assert_trees_all_close(traced(X, jnp.ones((4, 2))), jnp.tanh(X @ jnp.ones((4, 2))))
    eqns = (traced.jaxpr.jaxpr if hasattr(traced.jaxpr, "jaxpr") else traced.jaxpr).eqns
    assert [e.primitive.name for e in eqns] == ["dot_general", "tanh"]
    assert "dot_general" in traced.graph and "tanh" in traced.graph
    assert "stablehlo.dot_general" in traced.hlo and "stablehlo.tanh" in traced.hlo


def test_hlo_of_nested_inputs_takes_one_argument_per_leaf():
    traced = tracing.trace(lambda d, p: d["x"] * p.second, ({"x": X}, Pair(None, X)))
    main = next(line for line in traced.hlo.splitlines() if "func.func public @main" in line)
    assert main.count("tensor<3x4xf32>") == 3  # two arguments and the result


def test_single_array_stands_for_a_one_tuple_and_namedtuple_is_one_argument():
    assert tracing.trace(lambda x: x * 2, X)(X).shape == (3, 4)
    traced = tracing.trace(lambda p: p.first + p.second, Pair(X, X))
    chex.assert_trees_all_close(traced(Pair(X, X)), 2 * X)


def test_call_with_another_structure_dtype_or_shape_names_the_leaf():
    traced = tracing.trace(lambda d, p: d["x"] + p.second, ({"x": X, "y": X}, Pair(X, X)))
    with pytest.raises(TypeError,
                       match=r"inputs\[0\]\['z'\].*expected a leaf at inputs\[0\]\['y'\]"):
        traced({"x": X, "z": X}, Pair(X, X))
    with pytest.raises(TypeError, match=r"inputs\[1\]\.second has dtype bfloat16.*float32"):
        traced({"x": X, "y": X}, Pair(X, X.astype(jnp.bfloat16)))
    with pytest.raises(ValueError, match=r"inputs\[1\]\.first has shape \(2, 4\).*\(3, 4\)"):
        traced({"x": X, "y": X}, Pair(X[:2], X))
    with pytest.raises(TypeError, match="missing inputs"):
        traced({"x": X, "y": X})
    with pytest.raises(TypeError,
                       match=r"at inputs\[1\]\[0\]: expected a leaf at inputs\[1\]\.first"):
        traced({"x": X, "y": X}, (X, X))
    on_tuple = tracing.trace(lambda pair: pair[0] * pair[1], ((X, X),))
    with pytest.raises(TypeError, match="container types"):
        on_tuple([X, X])


def test_non_array_inputs_are_rejected_with_their_path():
    with pytest.raises(TypeError, match=r"inputs\[1\]\['mode'\] is a str"):
        tracing.trace(lambda x, cfg: x, (X, {"mode": "train"}))


def test_pytree_inputs_and_outputs_keep_structure_and_dict_order():
    def fn(inputs, pair, items):
        return {"z": inputs["b"] * 2, "a": [pair.second, None, (items[0] + items[1],)],
                "m": Pair(inputs["a"], {"y": items[1], "b": items[0]})}

    args = ({"b": X, "a": X + 1}, Pair(None, X * 3), [X, X - 1])
    traced = tracing.trace(fn, args)
    got, want = traced(*args), fn(*args)
    chex.assert_trees_all_close(got, want)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    assert list(got) == ["z", "a", "m"] and list(got["m"].second) == ["y", "b"]
    assert isinstance(got["m"], Pair) and got["a"][1] is None


def test_export_round_trip_keeps_pytrees_and_checks_inputs():
    def fn(inputs, pair):
        return {"sum": inputs["x"] + pair.first, "parts": [pair.second, None]}

    args = ({"x": X}, Pair(X * 2, jnp.ones(3, jnp.int32)))
    blob = tracing.trace(fn, args).export()
    assert isinstance(blob, bytes)
    loaded = tracing.load(blob)
    got = loaded(*args)
    chex.assert_trees_all_close(got, fn(*args))
    assert jax.tree.structure(got) == jax.tree.structure(fn(*args))
    assert "stablehlo.add" in loaded.hlo
    with pytest.raises(ValueError, match=r"inputs\[1\]\.second has shape \(4,\)"):
        loaded({"x": X}, Pair(X, jnp.ones(4, jnp.int32)))
    with pytest.raises(TypeError, match="inputs differ in structure"):
        loaded({"y": X}, Pair(X, jnp.ones(3, jnp.int32)))
    # Inputs by keyword were "Program.__call__() got an unexpected keyword argument 'pair'".
    for program, name in ((tracing.trace(fn, args), r"\S*fn"), (loaded, r"tracing.load\(\S*fn\)")):
        with pytest.raises(TypeError, match=rf"^{name}: got keyword argument\(s\) pair= but the "
                                            "program takes its inputs by position"):
            program({"x": X}, pair=args[1])


# fast twin: test_export_dict_keys.py::
#     test_the_blob_stays_a_jax_export_blob_and_loads_in_a_fresh_process
@pytest.mark.slow
def test_export_loads_in_a_fresh_process(tmp_path):
    blob = tracing.trace(lambda x: jnp.sin(x) * 3, (X,)).export()
    path = tmp_path / "f.jaxexport"
    path.write_bytes(blob)
    code = ("import sys, numpy as np, jax.numpy as jnp, tracing;"
            f"g = tracing.load(open({str(path)!r}, 'rb').read());"
            "x = jnp.arange(12.0).reshape(3, 4);"
            "np.testing.assert_allclose(g(x), np.sin(np.asarray(x)) * 3, rtol=1e-6)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_load_rejects_bytes_that_are_not_an_export():
    with pytest.raises(ValueError, match="not an intact jax.export serialization"):
        tracing.load(b"not an export")
    with pytest.raises(TypeError, match="bytes"):
        tracing.load("a string")


# --- check 1: graphs ---

# fast twin: test_tracing_properties.py::test_shape_generic_chains_pass_at_any_batch_size
@pytest.mark.slow
def test_shape_generic_function_passes_other_batch_sizes():
    def layer(x, w):
        h = jax.nn.softmax(x @ w, axis=-1)
        return jnp.mean(h, axis=0), h.reshape(-1)[: x.shape[0]]

    w = jnp.ones((4, 5))
    tracing.check_trace(layer, (X, w), check_inputs=[(jnp.ones((7, 4)), w), (jnp.ones((1, 4)), w)])


@jax.custom_vjp
def _linear(x, w):
    return x @ w


_linear.defvjp(lambda x, w: (x @ w, (x, w)), lambda res, g: (g @ res[1].T, res[0].T @ g))

HIGHER_ORDER = {
    "custom_jvp": lambda x, w: jax.nn.relu(x @ w),
    "custom_vjp": _linear,
    "grad of custom_vjp": jax.grad(lambda x, w: _linear(x, w).sum(), argnums=1),
    "scan": lambda x, w: jax.lax.scan(lambda c, r: (jnp.tanh(c @ w + r), c), jnp.zeros(4), x)[1],
    "cond": lambda x, w: jax.lax.cond(x.sum() > 0, lambda v: v @ w, lambda v: v * 2.0, x),
    "while": lambda x, w: jax.lax.while_loop(lambda c: c[0] < 3,
                                             lambda c: (c[0] + 1, c[1] @ w), (0, x))[1],
    "remat": jax.checkpoint(lambda x, w: jnp.sin(x @ w)),
    "jit": jax.jit(lambda x, w: jnp.sin(x @ w)),
    "grad of autocast": jax.grad(
        jamp.autocast_transform(lambda x, w: jax.nn.softmax(x @ w).sum()), argnums=1),
}
# Running the eager grad of an autocast function op by op compiles ~80 small programs (~5 s).
# fast twins: [grad of custom_vjp] and test_autocast_functions_trace_check_and_show_their_casts
SLOW_HIGHER_ORDER = {"grad of autocast"}


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.slow) if name in SLOW_HIGHER_ORDER else name
    for name in sorted(HIGHER_ORDER)])
def test_programs_with_sub_jaxprs_and_rules_check_cleanly_across_batch_sizes(name):
    # custom_jvp/custom_vjp parameters hold thunks whose identity changes per trace: the
    # canonical graph must not see them as differences.
    w = jnp.linspace(-1.0, 1.0, 16).reshape(4, 4)
    traced, warns = recorded_tracer_warnings(lambda: tracing.trace(
        HIGHER_ORDER[name], (X / 10, w), check_inputs=[(jnp.ones((6, 4)) / 3, w)]))
    assert warns == []
    chex.assert_trees_all_close(traced(X / 10, w), HIGHER_ORDER[name](X / 10, w),
                                rtol=1e-5, atol=1e-5)


def test_unrolled_python_loop_over_a_size_differs_and_points_at_the_line():
    def negate_per_row(x):
        for _ in range(x.shape[0]):
            x = -x
        return x

    with pytest.raises(tracing.TracingCheckError,
                       match="Graphs differed across invocations!") as err:
        tracing.trace(negate_per_row, X, check_inputs=[jnp.ones((4, 4))])
    message = str(err.value)
    assert "First difference" in message and "neg" in message
    assert "test_tracing.py" in message and "negate_per_row)" in message


def test_graph_comparison_abstracts_sizes_but_not_ranks_or_dtypes():
    small = graphs.canonicalize(jax.make_jaxpr(lambda x: jnp.broadcast_to(x, (2,) + x.shape))(X))
    large = graphs.canonicalize(
        jax.make_jaxpr(lambda x: jnp.broadcast_to(x, (2,) + x.shape))(jnp.ones((5, 6))))
    assert graphs.first_difference(small, large) is None
    other_rank = graphs.canonicalize(
        jax.make_jaxpr(lambda x: jnp.broadcast_to(x, (2,) + x.shape))(jnp.ones(5)))
    assert graphs.first_difference(small, other_rank) is not None
    other_dtype = graphs.canonicalize(
        jax.make_jaxpr(lambda x: jnp.broadcast_to(x, (2,) + x.shape))(X.astype(jnp.bfloat16)))
    assert graphs.first_difference(small, other_dtype) is not None


def test_retrace_is_never_answered_from_jaxs_trace_cache():
    calls = {"n": 0}

    def branchy(x):
        calls["n"] += 1
        return x * 2 if calls["n"] == 1 else jnp.sin(x)

    # jax.make_jaxpr of the same function object answers a second trace from its cache ...
    jitted = jax.jit(branchy)
    first, second = jax.make_jaxpr(jitted)(X), jax.make_jaxpr(jitted)(X)
    assert str(first) == str(second) and calls["n"] == 1
    # ... the checker traces afresh each time and sees the second behaviour.
    calls["n"] = 0
    with pytest.raises(tracing.TracingCheckError, match="Graphs differed"):
        tracing.check_trace(branchy, (X,))
    assert calls["n"] >= 2


# --- check 2: constants ---

def test_mutated_python_counter_is_a_differing_constant():
    counter = [0]

    def add_count(x):
        counter[0] += 1
        return x + counter[0]

    with pytest.raises(tracing.TracingCheckError,
                       match="Constants differed in value across invocations") as err:
        tracing.trace(add_count, (X,))
    assert "1.0 in the first trace, 2.0" in str(err.value) and "add_count" in str(err.value)


def test_numpy_randomness_at_trace_time_is_a_differing_constant():
    with pytest.raises(tracing.TracingCheckError, match="Constants differed") as err:
        tracing.trace(lambda x: x + np.random.rand(4).astype(np.float32), (X,))
    assert "float32[4]" in str(err.value) and "test_tracing.py" in str(err.value)
    with pytest.raises(tracing.TracingCheckError, match="Constants differed"):
        tracing.trace(lambda x: x * np.random.rand(), (X,), check_inputs=[(X + 1,)])


def test_constant_captured_values_that_do_not_change_pass():
    table = np.linspace(0.0, 1.0, 4, dtype=np.float32)
    traced = tracing.trace(lambda x: x * table + 0.5, (X,), check_inputs=[(jnp.ones((6, 4)),)])
    chex.assert_trees_all_close(traced(X), X * table + 0.5)


def test_size_dependent_literals_do_not_fail_across_shapes():
    tracing.check_trace(lambda x: x / x.shape[0] + jnp.mean(x), (X,),
                        check_inputs=[(jnp.ones((9, 4)),)])


def test_check_trace_false_skips_the_checks():
    counter = [0]

    def add_count(x):
        counter[0] += 1
        return x + counter[0]

    traced = tracing.trace(add_count, (X,), check_trace=False)
    chex.assert_trees_all_close(traced(X), X + 1)
    assert counter[0] == 1


# --- check 3: outputs against the function run op by op ---

def test_outputs_that_differ_from_python_warn_with_errors():
    def traced_path_differs(x):
        scale = 1.001 if isinstance(x, jax.core.Tracer) else 1.0
        return x, x * scale

    _, warns = recorded_tracer_warnings(lambda: tracing.trace(traced_path_differs, (X + 1,)))
    assert len(warns) == 1
    assert warns[0].startswith("Output nr 2. of the traced function does not match the "
                               "corresponding output of the Python function")
    assert "Largest absolute error" in warns[0] and "relative error: 0.001" in warns[0]
    _, warns = recorded_tracer_warnings(
        lambda: tracing.trace(traced_path_differs, (X + 1,), check_tolerance=1e-2))
    assert warns == []


def test_nondeterministic_callback_output_warns():
    def noisy(x):
        noise = jax.pure_callback(lambda: np.random.rand(3, 4).astype(np.float32),
                                  jax.ShapeDtypeStruct((3, 4), jnp.float32))
        return x + noise

    _, warns = recorded_tracer_warnings(lambda: tracing.trace(noisy, (X,)))
    assert any(w.startswith("Output nr 1. of the traced function does not match") for w in warns)


def test_autocast_functions_trace_check_and_show_their_casts():
    mixed = jamp.autocast_transform(lambda x, w: jax.nn.gelu(x @ w))
    w = jnp.linspace(-1, 1, 20).reshape(4, 5)
    traced, warns = recorded_tracer_warnings(
        lambda: tracing.trace(mixed, (X, w), check_inputs=[(jnp.ones((6, 4)), w)]))
    assert warns == []
    assert "convert_element_type" in traced.graph and "bf16" in traced.graph
    assert traced(X, w).dtype == jnp.bfloat16
    chex.assert_trees_all_close(traced(X, w), mixed(X, w))


# --- check 4: PRNG keys ---

@pytest.mark.parametrize("make_key", [jax.random.key, jax.random.PRNGKey],
                         ids=["typed key", "raw uint32 key data"])
def test_captured_key_warns_that_every_call_draws_the_same_numbers(make_key):
    key = make_key(0)

    def dropout(x):
        keep = jax.random.bernoulli(key, 0.5, x.shape)
        return jnp.where(keep, x * 2, 0.0)

    _, warns = recorded_tracer_warnings(lambda: tracing.trace(dropout, (X,)))
    assert len(warns) == 1
    assert "PRNG key" in warns[0] and "draws the same random numbers" in warns[0]
    assert "test_tracing.py" in warns[0]  # the user's line, not jax.random's


def test_key_made_from_a_fixed_seed_inside_warns_too():
    _, warns = recorded_tracer_warnings(lambda: tracing.trace(
        lambda x: x + jax.random.normal(jax.random.key(3), x.shape), (X,)))
    assert len(warns) == 1 and "fixed seed" in warns[0]


def test_keys_passed_as_inputs_do_not_warn_and_draws_inside_control_flow_are_followed():
    def scan_noise(key, x):
        def step(k, row):
            k, sub = jax.random.split(k)
            return k, row + jax.random.normal(sub, row.shape)
        return jax.lax.scan(step, key, x)[1]

    for key in (jax.random.key(0), jax.random.PRNGKey(0)):
        traced, warns = recorded_tracer_warnings(lambda: tracing.trace(scan_noise, (key, X)))
        assert warns == []
        assert traced(key, X).shape == X.shape
    captured = jax.random.key(1)
    _, warns = recorded_tracer_warnings(
        lambda: tracing.trace(lambda x: scan_noise(captured, x), (X,)))
    assert len(warns) == 1
    folded = jax.random.key(2)
    _, warns = recorded_tracer_warnings(lambda: tracing.trace(
        lambda step, x: x + jax.random.normal(jax.random.fold_in(folded, step), x.shape),
        (jnp.int32(0), X)))
    assert warns == []  # fold_in with an input step: a new stream per call


# --- check 5: tracing errors ---

@pytest.mark.parametrize("body", [
    lambda x: x if x.sum() > 0 else -x,
    lambda x: x * int(x[0, 0]),
    lambda x: x + float(x.sum()),
    lambda x: jnp.asarray(np.asarray(x)),
], ids=["python if", "int()", "float()", "np.asarray"])
def test_concretization_errors_become_check_errors_with_hints(body):
    with pytest.raises(tracing.TracingCheckError, match="needs the concrete value") as err:
        tracing.trace(body, (X,))
    assert isinstance(err.value.__cause__, jax.errors.JAXTypeError) or \
        isinstance(err.value.__cause__, jax.errors.ConcretizationTypeError)
    assert "lax.cond" in str(err.value) and "functools.partial" in str(err.value)


def test_leaked_tracer_is_a_check_error():
    stash = []

    def leaks(x):
        stash.append(x * 2)
        return x

    with pytest.raises(tracing.TracingCheckError, match="leaked out of the trace") as err:
        tracing.trace(leaks, (X,))
    assert "`stash[0]` (closed over by" in str(err.value)


def test_leak_from_code_run_under_an_unimported_module_name_is_found():
    """Code exec'd under a ``__name__`` no import registered (a notebook cell, a docs page) is
    the user's: its globals are searched like any other function's."""
    namespace = {"__name__": "docs:page.md", "jnp": jnp}
    exec("stash = []\ndef leaks(x):\n    stash.append(x * 2)\n    return x\n", namespace)
    with pytest.raises(tracing.TracingCheckError, match="leaked out of the trace") as err:
        tracing.trace(namespace["leaks"], (X,))
    assert "stash" in str(err.value)


def test_check_inputs_must_be_a_list_of_input_tuples():
    with pytest.raises(TypeError, match="check_inputs must be a list"):
        tracing.check_trace(lambda x: x, (X,), check_inputs=X)


# --- Flax ---

# fast twins: test_seed_tracer.py::test_trace_export_of_a_flax_module_with_nested_outputs,
# test_a_linen_module_passed_whole_names_its_apply
@pytest.mark.slow
def test_linen_apply_traces_with_variables_as_inputs():
    from flax import linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Conv(4, (3, 3))(x)
            x = nn.BatchNorm(use_running_average=True)(x)
            return nn.Dense(3)(jax.nn.relu(x).mean((1, 2)))

    x = jnp.ones((2, 8, 8, 3))
    model = Net()
    variables = model.init(jax.random.key(0), x)
    traced = tracing.trace(model.apply, (variables, x),
                           check_inputs=[(variables, jnp.ones((5, 8, 8, 3)))])
    new_vars = jax.tree.map(lambda v: v * 1.5, variables)
    chex.assert_trees_all_close(traced(new_vars, x), model.apply(new_vars, x), atol=1e-5)
    loaded = tracing.load(traced.export())
    chex.assert_trees_all_close(loaded(new_vars, x), model.apply(new_vars, x), atol=1e-5)
    with pytest.raises(TypeError, match=r"Net\(...\)\.apply, \(variables, x\)"):
        tracing.trace(model, (x,))


def test_a_linen_module_passed_whole_names_its_apply():
    from flax import linen as nn

    with pytest.raises(TypeError, match=r"Dense\(...\)\.apply, \(variables, x\)"):
        tracing.trace(nn.Dense(3), (X,))


def test_nnx_module_traces_with_its_state_captured():
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(4, 3, rngs=rngs)
            self.norm = nnx.BatchNorm(3, rngs=rngs)

        def __call__(self, x):
            return self.norm(self.linear(x))

    net = Net(nnx.Rngs(0))
    net.eval()
    traced = tracing.trace(net, (X,), check_inputs=[(jnp.ones((7, 4)),)])
    chex.assert_trees_all_close(traced(X), net(X), atol=1e-5)
    assert len(trace_once(lambda x: net(x), (X,), "net").closed.consts) >= 2  # state captured


def test_nnx_dropout_with_its_own_rngs_warns_about_the_captured_key():
    from flax import nnx

    class Noisy(nnx.Module):
        def __init__(self, rngs):
            self.drop = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.drop(x)

    _, warns = recorded_tracer_warnings(lambda: tracing.trace(Noisy(nnx.Rngs(0)), (X,)))
    assert len(warns) == 1 and "PRNG key" in warns[0]


# --- tolerance: the precision each output was computed in ---

def test_bfloat16_outputs_are_compared_as_floats_within_a_few_ulps():
    from tracing import tolerance
    one = jnp.ones(4, jnp.bfloat16)
    next_up = jnp.nextafter(one, jnp.bfloat16(2))
    tol = tolerance.tolerance(jnp.dtype(jnp.bfloat16), 1e-5)
    assert tol == 4 * float(jnp.finfo(jnp.bfloat16).eps)
    assert tolerance.mismatch(next_up, one, tol, 1e-5) == ""
    assert "Largest absolute error" in tolerance.mismatch(one * 2, one, tol, 1e-5)


def test_the_tolerance_follows_the_narrowest_dtype_on_each_outputs_path():
    from tracing import tolerance

    def f(x, w):
        h = (x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)).astype(jnp.float32)
        normed = (h - h.mean(-1, keepdims=True)) / (h.std(-1, keepdims=True) + 1e-6)
        inner = jax.lax.cond(True, lambda v: v.astype(jnp.float16).astype(jnp.float32) * 2,
                             lambda v: v, x)
        return normed, x * 2.0, inner

    closed = jax.make_jaxpr(f)(jnp.ones((2, 3)), jnp.ones((3, 4)))
    assert tolerance.path_dtypes(closed) == [jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32),
                                             jnp.dtype(jnp.float16)]


def test_float32_through_bfloat16_intermediates_does_not_warn():
    def layer(x, w):
        h = (x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)).astype(jnp.float32)
        return jax.nn.log_softmax(h - h.mean(-1, keepdims=True))

    x = jax.device_put(np.random.default_rng(1).standard_normal((16, 64), np.float32))
    w = jax.device_put(np.random.default_rng(2).standard_normal((64, 32), np.float32))
    _, warns = recorded_tracer_warnings(lambda: tracing.check_trace(layer, (x, w)))
    assert warns == []


def test_large_float32_accumulations_scale_the_tolerance_by_their_magnitude():
    from tracing import tolerance

    def variance(x):
        return jnp.mean(x * x, axis=0) - jnp.mean(x, axis=0) ** 2  # Haiku BatchNorm's formula

    x = jax.device_put(1000.0 + np.random.default_rng(0).standard_normal((64, 3), np.float32))
    closed = jax.make_jaxpr(variance)(x)
    involved, = tolerance.accumulation_magnitudes(closed, [x])
    assert involved >= float(jnp.max(jnp.mean(x * x, axis=0)))  # the sums behind E[x^2]
    exact = np.var(np.asarray(x, np.float64), axis=0).astype(np.float32)
    rounded = exact + np.float32(1e6 * 2 ** -23)  # one float32 ulp of E[x^2]
    assert tolerance.mismatch(rounded, exact, 1e-5, 1e-5) != ""
    assert tolerance.mismatch(rounded, exact, 1e-5, 1e-5, involved) == ""


# --- leaks: JAX's own caches are not leaks ---

def test_checkpoint_with_static_argnums_over_a_closure_is_not_a_leak():
    def net(x):
        h = jnp.tanh(x)

        def block(y, n):
            return jnp.sin(y * h) * n
        return jax.checkpoint(block, static_argnums=(1,))(x, 2)

    traced = tracing.trace(net, (X,), check_inputs=[(jnp.ones((5, 4)),)])
    # compiled vs op by op: sin and tanh may round differently in the last few bits
    chex.assert_trees_all_close(traced(X), net(X), rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # fast twin: test_checkpoint_with_static_argnums_over_a_closure_is_not_a_leak
def test_flax_remat_with_static_argnums_is_not_a_leak():
    from flax import linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, scale):
            return nn.Dense(4)(x) * scale

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(2):
                x = nn.remat(Block, static_argnums=(2,))()(x, 2.0)
            return x

    variables = Net().init(jax.random.key(0), X)
    for _ in range(2):  # the remat cache is warm the second time
        tracing.trace(Net().apply, (variables, X), check_inputs=[(variables, X[:1])])


LEAKED = []


def test_a_tracer_stored_in_a_global_or_on_an_object_is_still_reported():
    def into_global(x):
        LEAKED.append(x + 1)
        return x

    class Cache:
        def __call__(self, x):
            self.last = x * 2
            return x

    with pytest.raises(tracing.TracingCheckError, match=r"`LEAKED\[0\]` \(a global of "):
        tracing.trace(into_global, (X,))
    LEAKED.clear()
    with pytest.raises(tracing.TracingCheckError, match=r"`Cache.last`"):
        tracing.trace(Cache(), (X,))


# --- validated inputs ---

def two_args(x, w):
    return x @ w


W = jnp.ones((4, 2))


@pytest.mark.parametrize("check_inputs, message", [
    ([(X, {"w": W})], r"check_inputs\[0\] differs from example_inputs in pytree structure.*"
                      r"inputs\[1\]"),
    ([(X, W), (X,)], r"check_inputs\[1\] has 1 positional argument\(s\) \(a tuple\), "
                     r"example_inputs 2"),
    ((X, W), r"check_inputs\[0\] has 1 positional argument\(s\) \(not a tuple.*"
             r"check_inputs=\[\(x2, w\)"),
    ([[X, W]], r"check_inputs\[0\] has 1 positional argument\(s\) \(a list, which stands for "
               r"one argument\)"),
    ([(X, "w")], r"check_inputs\[0\]: inputs\[1\] is a str"),
    # another dtype or rank was reported as "Graphs differed" (the program takes neither)
    ([(X, W.astype(jnp.bfloat16))], r"check_inputs\[0\]: inputs\[1\] is bfloat16\[4,2\] "
                                    r"where example_inputs have float32\[4,2\]"),
    ([(X[None], W)], r"check_inputs\[0\]: inputs\[0\] is float32\[1,3,4\] where"),
])
def test_check_inputs_entries_are_validated_with_their_index(check_inputs, message):
    with pytest.raises(TypeError, match=message):
        tracing.check_trace(two_args, (X, W), check_inputs=check_inputs)


def test_example_inputs_as_a_list_is_one_argument_with_a_clear_error():
    with pytest.raises(TypeError, match=r"example_inputs is a list, which stands for one "
                                        r"argument.*as a tuple: \(a0, a1,\)"):
        tracing.trace(two_args, [X, W])
    with pytest.raises(TypeError, match=r"example_inputs gives two_args\(x, w\) 3 positional"):
        tracing.trace(two_args, (X, W, W))
    assert tracing.trace(lambda xs: xs[0] @ xs[1], [X, W])(list((X, W))).shape == (3, 2)


def test_trace_inside_jit_is_a_clear_error():
    @jax.jit
    def outer(x):
        return tracing.trace(jnp.sin, (x,))(x)

    with pytest.raises(TypeError, match=r"example_inputs\[0\] is a traced value.*inside "
                                        r"jax.jit"):
        outer(X)

    @jax.jit
    def outer_with_concrete_examples(x):
        return tracing.trace(jnp.sin, (np.ones((3, 4), np.float32),))(x)

    with pytest.raises(TypeError, match=r"JAX is tracing.*cannot run inside jax.jit"):
        outer_with_concrete_examples(X)
    with pytest.raises(TypeError, match=r"JAX is tracing"):
        jax.vmap(lambda x: tracing.check_trace(jnp.sin, (np.ones(4, np.float32),)) or x)(X)


@pytest.fixture
def no_persistent_compilation_cache():
    """JAX's persistent compilation cache off for the test (tests/conftest.py turns it on): XLA
    writes an executable's source file names into a cache entry as protobuf strings, so a blob
    whose damage lands in a file name, which loads and runs, prints protobuf's invalid-UTF-8
    errors to stderr as its entry is written and read (jaxlib 0.10 and 0.12), noise that is
    JAX's, not the loader's."""
    with compilation_cache_options(jax_enable_compilation_cache=False):
        yield


def test_damaged_blob_is_a_clear_value_error_without_mlir_noise(capfd,
                                                                no_persistent_compilation_cache):
    blob = bytearray(tracing.trace(lambda x: jnp.sin(x) @ x.T, (X,)).export())
    capfd.readouterr()
    failures = 0
    for start in range(0, len(blob) - 16, len(blob) // 12):
        damaged = bytearray(blob)
        damaged[start:start + 16] = bytes(b ^ 0xFF for b in damaged[start:start + 16])
        try:
            tracing.load(bytes(damaged))(X)
        except ValueError as err:
            assert "not an intact jax.export serialization" in str(err)
            failures += 1
    assert failures >= 3
    captured = capfd.readouterr()
    assert captured.err == "" and captured.out == ""


def test_a_jitted_function_with_static_arguments_traced_whole_says_to_bind_them():
    """Every example input is traced: a ``static_argnums`` argument reached ``jax.jit`` as a
    tracer, and JAX's "Non-hashable static arguments" came out as it was."""
    scaled = jax.jit(lambda x, n: x * n, static_argnums=1)
    with pytest.raises(tracing.TracingCheckError,
                       match=r"(?s)static arguments.*functools\.partial.*Non-hashable") as info:
        tracing.trace(scaled, (X, 2))
    assert isinstance(info.value.__cause__, ValueError)
    bound = tracing.trace(functools.partial(scaled, n=2), (X,))
    chex.assert_trees_all_close(bound(X), X * 2)
    with pytest.raises(ValueError, match="not this"):  # a ValueError of the function's own
        tracing.trace(lambda x: (_ for _ in ()).throw(ValueError("not this")), (X,))


def test_a_check_inputs_entry_the_function_cannot_be_traced_at_is_named_by_its_index():
    w = jnp.ones((4, 2))
    with pytest.raises(tracing.TracingCheckError,
                       match=r"Tracing two_args at check_inputs\[1\] \(float32\[3,5\], "
                             r"float32\[4,2\]\) failed, though it traced at the example inputs: "
                             r"TypeError: dot_general requires contracting dimensions"):
        tracing.check_trace(two_args, (X, w), check_inputs=[(X, w), (jnp.ones((3, 5)), w)])

    def unrolled(x):
        return sum(x[i] for i in range(int(x.sum()) if x.shape[0] > 3 else 1))

    with pytest.raises(tracing.TracingCheckError,
                       match=r"Tracing .*unrolled at check_inputs\[0\] \(float32\[5,4\]\) failed, "
                             r"though it traced at the example inputs: .*concrete value") as info:
        tracing.trace(unrolled, (X,), check_inputs=[(jnp.ones((5, 4)),)])
    assert isinstance(info.value.__cause__, tracing.TracingCheckError)


def test_a_blob_from_a_newer_jax_is_named_as_such_not_as_damaged():
    """tests/data/jax0120_polymorphic_double.export: ``x * 2`` exported by jax 0.12.0.1 with
    ``polymorphic_shapes="b, ..."``; its shape assertions use a StableHLO operation jax 0.10's
    cannot read. jax 0.10 said the (intact) bytes were "not an intact jax.export serialization"."""
    import pathlib

    blob = (pathlib.Path(__file__).parent / "data" / "jax0120_polymorphic_double.export").read_bytes()
    try:
        loaded = tracing.load(blob)
    except ValueError as err:  # jax 0.10
        assert "exported by a newer jax" in str(err) and "not an intact" not in str(err)
        assert jax.__version__ in str(err)
    else:  # jax 0.12 (and newer): jax.export loads older exports
        chex.assert_trees_all_close(loaded(jnp.ones((3, 4))), jnp.full((3, 4), 2.0))


def test_a_mismatch_against_zeros_reports_no_relative_error_and_a_real_one_elsewhere():
    """Relative to a Python value of 0 an error is no number: the message said 2.15e+304."""
    from tracing.tolerance import mismatch

    against_zeros = mismatch(np.array([1e-3, 0.0]), np.array([0.0, 0.0]), 1e-5, 1e-5)
    assert "largest relative error: none (the Python values are 0)" in against_zeros
    mixed = mismatch(np.array([1.5, 1e-3]), np.array([1.0, 0.0]), 1e-5, 1e-5)
    assert "largest relative error: 0.5 " in mixed and "e+30" not in mixed


def test_a_numpy_float64_input_is_compared_in_the_dtype_jax_traced_it_in():
    """Run op by op, ``a + 1`` of a NumPy float64 input stays float64; traced, JAX made the input
    float32. The output check warned "traced float32[3] against Python float64[3]"."""
    _, warned = recorded_tracer_warnings(lambda: tracing.trace(lambda a: a + 1, (np.ones(3),)))
    assert warned == [], warned
    _, wrong = recorded_tracer_warnings(lambda: tracing.check_trace(
        lambda a: a + 1 if isinstance(a, np.ndarray) else a + 2, (np.ones(3),)))
    assert len(wrong) == 1 and "does not match" in wrong[0], wrong  # values still compared
