"""Misuse of the public API that used to fail obscurely or pass silently (issue 24).

Each mistake raises an error of the documented type whose message names the culprit in the
user's terms (their argument, pytree path, primitive name) and the way out; or, where the
intent is clear, it now does what the user meant.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Primitive

import jamp
import tracing
from jamp import interpreter
from tests.user_frames import assert_only_user_frames

BF16 = jnp.bfloat16


# --- Policy(rules=...) ---------------------------------------------------------------------


@pytest.mark.parametrize("rules, fix", [
    ({"*/head": None}, "rules=(('*/head', None),)"),
    ({"*/head": jnp.float32, "*/norm": None},
     "rules=(('*/head', jnp.float32), ('*/norm', None))"),
])
def test_policy_rules_given_a_dict_says_to_write_the_pairs(rules, fix):
    with pytest.raises(TypeError, match="got a dict") as info:
        jamp.Policy(rules=rules)
    assert fix in str(info.value)
    # The suggested form builds the policy the dict meant, in the dict's order.
    assert jamp.Policy(rules=tuple(rules.items())).rules == tuple(
        (glob, None if dtype is None else np.dtype(dtype)) for glob, dtype in rules.items()
    )


def test_policy_rules_given_a_string_or_none_names_the_form():
    with pytest.raises(TypeError, match=r"got the string '\*/head'.*rules=\(\('\*/head', None\),\)"):
        jamp.Policy(rules="*/head")
    with pytest.raises(TypeError, match=r"got NoneType None; use rules=\(\) for no rules"):
        jamp.Policy(rules=None)
    with pytest.raises(TypeError, match="got a dict"):
        jamp.Policy().replace(rules={"*/head": None})


# --- all_finite, scale/unscale, select_tree, adjust ------------------------------------------


def test_all_finite_names_a_leaf_that_is_not_an_array():
    with pytest.raises(TypeError, match=r"all_finite: tree is a str \('a string'\), not an array"):
        jamp.all_finite("a string")
    with pytest.raises(TypeError, match=re.escape("all_finite: tree['grads']['b'] is a str")):
        jamp.all_finite({"grads": {"a": jnp.ones(2), "b": "x"}})
    with pytest.raises(TypeError, match=re.escape("tree[1] is an object")):
        jamp.all_finite([jnp.ones(2), object()])


def test_all_finite_still_takes_numbers_integers_and_tracers():
    assert bool(jamp.all_finite({"a": [1.0, 2.0], "step": jnp.int32(3), "none": None}))
    assert not bool(jamp.all_finite({"a": 1.0, "b": float("nan")}))
    assert not bool(jax.jit(jamp.all_finite)({"a": jnp.array([1.0, jnp.inf])}))


def test_scale_and_unscale_name_the_leaf_that_is_not_an_array():
    scale = jamp.StaticLossScale(8.0)
    with pytest.raises(TypeError, match=r"StaticLossScale.scale: tree is a str \('loss'\)"):
        scale.scale("loss")
    with pytest.raises(TypeError, match=re.escape("DynamicLossScale.unscale: tree['name'] is a str")):
        jamp.DynamicLossScale().unscale({"w": jnp.ones(2), "name": "layer"})


def test_select_tree_names_the_leaf_whose_shape_or_dtype_differs():
    a = {"w": jnp.ones(2), "b": jnp.ones(3)}
    with pytest.raises(TypeError, match=re.escape("a['w'] is float32[2] but b['w'] is float16[2]")):
        jamp.select_tree(True, a, {"w": jnp.ones(2, jnp.float16), "b": jnp.ones(3)})
    with pytest.raises(TypeError, match=re.escape("a['b'] is float32[3] but b['b'] is float32[4]")):
        jamp.select_tree(True, a, {"w": jnp.ones(2), "b": jnp.ones(4)})
    with pytest.raises(TypeError, match=re.escape("select_tree: b['name'] is a str")):
        jamp.select_tree(True, {"name": jnp.ones(1)}, {"name": "x"})
    picked = jamp.select_tree(jnp.asarray(False), a, {"w": jnp.zeros(2), "b": jnp.zeros(3)})
    assert float(picked["w"].sum()) == 0.0


def test_adjust_given_the_gradients_instead_of_the_flag():
    grads = {"w": jnp.ones(2)}
    with pytest.raises(TypeError, match=r"got dict: pass jamp.all_finite\(grads\), not the grad"):
        jamp.DynamicLossScale().adjust(grads)
    with pytest.raises(TypeError, match="got dict"):
        jamp.StaticLossScale(2.0).adjust(grads)


def test_an_integer_loss_scale_is_stored_as_float32_as_documented():
    # docs/migration/from-jmp.md lists this among the deliberate differences from jmp.
    static = jamp.StaticLossScale(2**12)
    assert static.loss_scale.dtype == jnp.float32 and float(static.loss_scale) == 4096.0
    dynamic = jamp.DynamicLossScale(2**15, period=10)
    assert dynamic.loss_scale.dtype == jnp.float32 and dynamic.period.dtype == jnp.int32
    assert static.unscale(jnp.float16(8192.0)).dtype == jnp.float32


# --- tracing.trace inputs and options --------------------------------------------------------


def test_trace_refuses_a_python_list_of_numbers_naming_the_input():
    with pytest.raises(TypeError) as info:
        tracing.trace(lambda x: x * 2, ([1.0, 2.0],))
    message = str(info.value)
    assert message.startswith("example_inputs[0] is a Python list of numbers, [1.0, 2.0]")
    assert "2 separate scalar inputs" in message and "jnp.asarray([1.0, 2.0])" in message
    with pytest.raises(TypeError, match=re.escape("example_inputs[0]['a'] is a Python list")):
        tracing.trace(lambda d: d["a"], ({"a": [[1, 2], [3, 4]]},))
    with pytest.raises(TypeError, match=r"^example_inputs is a Python list of numbers"):
        tracing.trace(lambda x: x, [1.0, 2.0])  # a list stands for the one argument


def test_trace_check_inputs_with_a_number_list_is_named_too():
    with pytest.raises(TypeError, match=re.escape("check_inputs[0][0] is a Python list")):
        tracing.trace(lambda x: x * 2, (jnp.ones(2),), check_inputs=[([1.0, 2.0],)])


def test_trace_list_for_several_arguments_still_gets_the_tuple_hint():
    with pytest.raises(TypeError, match=r"give the positional arguments as a tuple"):
        tracing.trace(lambda x, y: x + y, [1.0, 2.0])


def test_trace_takes_what_the_error_suggests():
    as_array = tracing.trace(lambda x: x * 2, (jnp.asarray([1.0, 2.0]),))
    np.testing.assert_allclose(as_array(jnp.asarray([3.0, 4.0])), [6.0, 8.0])
    scalars = tracing.trace(lambda xs: xs[0] * xs[1], ([jnp.float32(1.0), jnp.float32(2.0)],))
    assert float(scalars([jnp.float32(3.0), jnp.float32(4.0)])) == 12.0


@pytest.mark.parametrize("options, error, message", [
    ({"check_tolerance": "1e-5"}, TypeError, r"check_tolerance must be a number.*got str"),
    ({"check_tolerance": -1.0}, ValueError, r"check_tolerance must be finite and >= 0, got -1.0"),
    ({"check_tolerance": float("nan")}, ValueError, r"check_tolerance must be finite"),
    ({"check_trace": "no"}, TypeError, r"check_trace must be True or False, got str 'no'"),
])
def test_trace_options_of_the_wrong_kind_are_refused(options, error, message):
    with pytest.raises(error, match=message):
        tracing.trace(lambda x: x * 2, (jnp.ones(2),), **options)


# --- autocast_transform of a jax.jit function with static arguments --------------------------


def _power(x, n, *, scale=1.0):
    for _ in range(n):
        x = x @ x * scale
    return x


@pytest.mark.parametrize("jitted", [
    jax.jit(_power, static_argnums=1),
    jax.jit(_power, static_argnames="n"),
    jax.jit(_power, static_argnums=-1),
], ids=["argnums", "argnames", "negative"])
def test_autocast_transform_of_a_jit_with_static_args_rewrites_it(jitted):
    x = jnp.full((2, 2), 0.5)
    mixed = jamp.autocast_transform(jitted)
    reference = jamp.autocast_transform(_power, static_argnums=1)
    for n in (1, 2):  # each value of the static argument traces again
        out = mixed(x, n)
        assert out.dtype == BF16
        np.testing.assert_array_equal(np.asarray(out, np.float32),
                                      np.asarray(reference(x, n), np.float32))
    assert "bf16" in str(jax.make_jaxpr(mixed, static_argnums=1)(x, 2))


def test_jit_static_args_of_methods_partials_and_keywords():
    x = jnp.full((2, 2), 0.5)

    class Model:
        @functools.partial(jax.jit, static_argnums=(0, 2))
        def power(self, x, n):
            return _power(x, n)

    assert jamp.autocast_transform(Model().power)(x, 2).dtype == BF16
    bound = functools.partial(jax.jit(_power, static_argnums=1), x)
    assert jamp.autocast_transform(bound)(2).dtype == BF16
    with_scale = jax.jit(_power, static_argnames=("n", "scale"))
    assert float(jamp.autocast_transform(with_scale)(x, 1, scale=2.0)[0, 0]) == 1.0


@pytest.mark.parametrize("static", [{"static_argnames": "n"}, {"static_argnums": 1}],
                         ids=["argnames", "argnums"])
def test_partial_binding_a_jit_static_keyword(static):
    x = jnp.full((2, 2), 0.5)
    bound = functools.partial(jax.jit(_power, **static), n=2)
    out = jamp.autocast_transform(bound)(x)
    assert out.dtype == BF16
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(
        jamp.autocast_transform(_power, static_argnums=1)(x, 2), np.float32))
    assert jamp.explain(bound, x).ops["dot_general"] == {"bfloat16": 2}
    # scale, still the caller's, stays static as jit made it
    both = functools.partial(jax.jit(_power, static_argnames=("n", "scale")), n=1)
    assert float(jamp.autocast_transform(both)(x, scale=2.0)[0, 0]) == 1.0


@pytest.mark.parametrize("entry, name", [
    (lambda f, x: jamp.autocast_transform(f)(x, [1, 2]), "autocast_transform"),
    (lambda f, x: jamp.explain(f, x, [1, 2]), "explain"),
    (lambda f, x: jamp.find_nonfinite(f, x, [1, 2]), "find_nonfinite"),
    (lambda f, x: jamp.value_ranges(f, x, [1, 2]), "value_ranges"),
])
def test_unhashable_jit_static_argument_names_the_callers_entry_point(entry, name):
    jitted = jax.jit(_power, static_argnums=1)
    with pytest.raises(TypeError, match=rf"^{name}\(_power\): static argument 'n' \(static "
                                        r"in your jax.jit\) must be hashable.*got list \[1, 2\]"):
        entry(jitted, jnp.ones(2))


def _string_array() -> jax.Array:
    """A jax.Array of numpy's StringDType, which JAX stores (on CPU) but no program takes."""
    return jax.device_put(np.array(["a", "bc"], dtype=np.dtypes.StringDType()),
                          jax.devices("cpu")[0])


def _string_leaves() -> list:
    """Leaves JAX has no program type for, made when the test runs (not at collection, which
    would start JAX's backend before the suite has set its flags)."""
    return [pytest.param(lambda: np.array(["a", "bc"]), r"a numpy\.ndarray of dtype <U2",
                         id="numpy-str"),
            pytest.param(lambda: np.array([object()], dtype=object),
                         r"a numpy\.ndarray of dtype object", id="numpy-object"),
            pytest.param(_string_array, r"a jax\.Array of dtype StringDType\(\)",
                         id="jax-string")]


def _tokens_then_scale(batch, x):
    return x * 2.0


@pytest.mark.parametrize("entry, name", [
    (lambda f, *a: jamp.autocast_transform(f)(*a), "autocast_transform"),
    (lambda f, *a: jax.vmap(jamp.autocast_transform(f), in_axes=(None, 0))(*a),
     "autocast_transform"),
    (jamp.explain, "explain"),
    (jamp.find_nonfinite, "find_nonfinite"),
    (jamp.value_ranges, "value_ranges"),
    (jamp.tune, "tune"),
])
@pytest.mark.parametrize("make_leaf, what", _string_leaves())
def test_an_array_jax_cannot_trace_is_named_by_its_argument_path(entry, name, make_leaf, what):
    # jax.jit's own message names neither the function nor, for a string jax.Array, the argument
    with pytest.raises(TypeError, match=rf"^{name}\(_tokens_then_scale\): argument "
                                        rf"batch\['tokens'\] is {what}, which JAX cannot trace "
                                        r"\(jax\.jit refuses it too\)"):
        entry(_tokens_then_scale, {"tokens": make_leaf()}, jnp.ones(2))


@pytest.mark.parametrize("form", [
    lambda f: f, jax.jit, jamp.autocast_transform, lambda f: jax.jit(jamp.autocast_transform(f)),
    lambda f: jax.vmap(jamp.autocast_transform(f), in_axes=(None, 0)),
], ids=["plain", "jit", "transform", "jit-transform", "vmap-transform"])
def test_a_string_array_the_function_uses_fails_as_under_jax_jit(form):
    # jax.jit traces a string jax.Array and runs the function on it: an operation of the
    # function refuses it with jnp's ValueError, which the transform leaves as it is
    def add_positions(batch, x):
        return batch["tokens"] + jnp.arange(2)

    with pytest.raises(ValueError, match=r"StringDType\(\) is not a valid dtype"):
        form(add_positions)({"tokens": _string_array()}, jnp.ones(2))


def test_a_string_array_the_function_only_passes_through_is_refused_by_jit_as_it_runs():
    # Under an outer jax.jit the transform is part of jit's program: jit refuses the argument
    # when it runs it, with its own TypeError, as without jamp
    def passes_through(batch, x):
        return batch["tokens"], x * 2.0

    for form in (jax.jit, lambda f: jax.jit(jamp.autocast_transform(f))):
        with pytest.raises(TypeError, match=r"is not a valid JAX type"):
            form(passes_through)({"tokens": _string_array()}, jnp.ones(2))


def test_jit_static_args_compose_with_an_outer_jit_and_grad():
    x = jnp.full((2, 2), 0.5)
    mixed = jamp.autocast_transform(jax.jit(_power, static_argnums=1))
    assert jax.jit(mixed, static_argnums=1)(x, 2).dtype == BF16
    assert jax.grad(lambda x: mixed(x, 2).astype(jnp.float32).sum())(x).dtype == jnp.float32
    # An outer jit that traces the static argument is named, with the fix.
    with pytest.raises(TypeError, match=r"_power\): static argument 'n' .* is a traced value.*"
                                        r"static_argnames='n'"):
        jax.jit(mixed)(x, 2)


def test_jit_static_args_in_explain_find_nonfinite_and_value_ranges():
    def loss(x, n):
        return _power(x, n).sum()

    jitted, x = jax.jit(loss, static_argnums=1), jnp.full((2, 2), 0.5)
    assert jamp.explain(jitted, x, 2).ops["dot_general"] == {"bfloat16": 2}
    assert jamp.find_nonfinite(jitted, x, 2, grad=0) is None
    ranges = jamp.value_ranges(jitted, x, 2, grad=True)
    assert {e.dtype for e in ranges.entries} == {"bfloat16"}


# --- jamp.interpreter.register* --------------------------------------------------------------


@pytest.mark.parametrize("register, suggestion", [
    (lambda: interpreter.register("dot_genral")(lambda step: None), "'dot_general'"),
    (lambda: interpreter.register_walk("scna", bodies=lambda eqn: [])(lambda *a: None), "'scan'"),
    (lambda: interpreter.register_opaque("shardmap"), "'shard_map'"),
], ids=["register", "register_walk", "register_opaque"])
def test_registering_a_name_that_is_no_primitive_names_it_and_close_matches(register, suggestion):
    before = {name: (e.rewrite, e.walk, e.opaque) for name, e in interpreter.RULES.items()}
    with pytest.raises(ValueError, match="is not a primitive of this JAX") as info:
        register()
    assert f"did you mean {suggestion}" in str(info.value)
    after = {name: (e.rewrite, e.walk, e.opaque) for name, e in interpreter.RULES.items()}
    assert after == before  # nothing registered


def test_register_used_without_a_name_says_how():
    def rule(step):
        return []

    with pytest.raises(TypeError, match=r"not @jamp.interpreter.register\b"):
        interpreter.register(rule)


def test_names_of_other_jax_versions_and_primitive_objects_register():
    # jamp's own modules register the pre-0.10 name "pjit" beside "jit".
    assert interpreter.primitive_names(["jit", "pjit"], "register") == ["jit", "pjit"]
    assert interpreter.RULES["pjit"].rewrite is interpreter.RULES["jit"].rewrite
    prim = Primitive("jamp_test_misuse_prim")  # no lowering: not known by name
    with pytest.raises(ValueError, match="pass the Primitive object itself"):
        interpreter.register("jamp_test_misuse_prim")
    try:
        rule = interpreter.register(prim)(lambda step: [])
        assert interpreter.rewrite_rule("jamp_test_misuse_prim") is rule
    finally:
        interpreter.RULES.pop("jamp_test_misuse_prim", None)


# --- dtypes and policies of the other entry points -------------------------------------------


def test_autocast_region_dtype_that_is_no_dtype_is_named():
    with pytest.raises(TypeError, match=r"jamp.autocast\(dtype='bf16'\): not a dtype.*jnp.bfloat16"):
        jamp.autocast(dtype="bf16")
    with pytest.raises(TypeError, match=r"jamp.autocast\(cast_inputs='yes'\): not a dtype"):
        jamp.autocast(cast_inputs="yes")


def test_autocast_transform_dtype_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"autocast_transform: dtype=jnp.int32: .*floating dtype"):
        jamp.autocast_transform(lambda a: a, dtype=jnp.int32)
    with pytest.raises(ValueError, match=r"autocast_transform: dtype='bf16': "):
        jamp.autocast_transform(lambda a: a, dtype="bf16")


@pytest.mark.parametrize("entry", [jamp.explain, jamp.find_nonfinite, jamp.value_ranges],
                         ids=lambda f: f.__name__)
def test_a_bad_policy_is_reported_by_the_function_called(entry):
    with pytest.raises(TypeError, match=rf"^{entry.__name__}: policy must be a jamp.Policy"):
        entry(lambda a: a @ a, jnp.ones((2, 2)), policy="bf16")


def test_autocast_bare_decorator_says_to_add_parentheses():
    def layer(x):
        return x

    with pytest.raises(TypeError, match=r"got the function .*layer: as a decorator it takes "
                                        r"parentheses, @jamp.autocast\(\)"):
        jamp.autocast(layer)
    assert jamp.autocast()(layer)(jnp.ones(2)).dtype == jnp.float32  # the form it suggests


def test_autocast_given_the_policy_class_asks_for_an_instance():
    with pytest.raises(TypeError, match=r"jamp.autocast\(dtype=jamp.Policy\): the Policy class, "
                                        r"not a policy; pass an instance"):
        jamp.autocast(jamp.Policy)


@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize("dtype, hint", [
    (jnp.float64, "float64 values are never cast"),
    (jnp.float8_e5m2, "float8_e5m2 is the cotangents' format"),
], ids=["float64", "e5m2"])
def test_autocast_region_dtype_no_policy_computes_in_is_refused_when_made(dtype, hint, enabled):
    """jamp.autocast(jnp.float64) was made, and refused only on entering it; disabled, it was
    entered and a region nested in it computed in float64."""
    with pytest.raises(ValueError, match=rf"jamp.autocast\(dtype=jnp.{np.dtype(dtype).name}\): "
                                         rf"a region computes in bfloat16, float16, float32 or "
                                         rf"float8_e4m3fn; {hint}"):
        jamp.autocast(dtype, enabled=enabled)


async def _async_layer(x):
    return x * 2


async def _async_steps(x):
    yield x


def _steps(x):
    yield x


@pytest.mark.parametrize("fn, what", [(_async_layer, "an async function"),
                                      (_async_steps, "a generator function"),
                                      (_steps, "a generator function")],
                         ids=["async", "async-generator", "generator"])
@pytest.mark.parametrize("wrap, where", [(jamp.autocast_transform, "autocast_transform"),
                                         (jamp.autocast(), r"jamp.autocast\(...\)")],
                         ids=["autocast_transform", "decorator"])
def test_async_and_generator_functions_are_refused_when_wrapped(fn, what, wrap, where):
    """An async function was accepted: the call returned a coroutine whose body ran when awaited,
    after the trace (or the region), and failed with UnexpectedTracerError."""
    with pytest.raises(TypeError, match=rf"^{where} expects a function, got {what}: {fn.__name__}"):
        wrap(fn)


def test_the_decorator_refuses_a_staticmethod_object_as_autocast_transform_does():
    with pytest.raises(TypeError, match=r"jamp.autocast\(...\): staticmethod arguments are not "
                                        r"supported.*@staticmethod above @jamp.autocast\(...\)"):
        jamp.autocast()(staticmethod(lambda x: x))


_W = jnp.ones((2, 2))


def _head_closure(x):
    h = x @ _W
    return lambda: h * 2


def _head_default(x):
    return lambda h=x @ _W: h


def _nested_closure(x):
    cache = {"h": x @ _W}

    def inner():
        return cache["h"]

    return x @ _W, lambda: inner()


def _generator_of(x):
    return _steps(x @ _W)


def _generator_expression(x):
    return (v for v in [x @ _W])


def _partial_of(x):
    return functools.partial(jnp.add, x @ _W)


@pytest.mark.parametrize("fn, where, kind, captured", [
    (_head_closure, "output", "function", "h: float32[2, 2]"),
    (_head_default, "output", "function", "h: float32[2, 2]"),
    (_nested_closure, "output[1]", "function", "inner.cache['h']: float32[2, 2]"),
    (_generator_of, "output", "generator", "x: float32[2, 2]"),
    (_generator_expression, "output", "generator", "<iterable>[0]: float32[2, 2]"),
    (_partial_of, "output", "functools.partial", "args[0]: float32[2, 2]"),
], ids=["closure", "default", "nested", "generator", "genexpr", "partial"])
@pytest.mark.parametrize("wrap", [jamp.autocast_transform, lambda f: jamp.autocast()(f)],
                         ids=["autocast_transform", "decorator"])
def test_a_returned_closure_or_generator_over_traced_values_is_refused(fn, where, kind, captured,
                                                                      wrap):
    """They came back holding tracers and failed later, where used, with UnexpectedTracerError;
    jax.jit refuses such an output at once."""
    with pytest.raises(TypeError, match=rf"^autocast_transform\({fn.__name__}\): its "
                                        rf"{re.escape(where)} is a {kind} \(.*\) that captured "
                                        r"values computed from the arguments "
                                        rf"\({re.escape(captured)}\)"):
        wrap(fn)(jnp.ones((2, 2)))


def test_a_returned_function_over_constants_or_an_outer_trace_passes_through():
    """Only values of the transformed function's own trace are refused: a function closing over
    a concrete array, or over the enclosing jax.jit's values, is returned as it came."""
    def helpers(x):
        return x @ _W, (lambda: _W), jnp.sum, "tag"

    out, head, summed, tag = jamp.autocast_transform(helpers)(jnp.ones((2, 2)))
    assert out.dtype == BF16 and head() is _W and summed is jnp.sum and tag == "tag"

    @jax.jit
    def outer(y):
        scaled, keep_y = jamp.autocast_transform(lambda x: (x @ _W, lambda: y))(y)
        return scaled.astype(jnp.float32) + keep_y()

    np.testing.assert_array_equal(outer(jnp.ones((2, 2))), jnp.full((2, 2), 3.0))


def test_a_jax_array_given_as_a_static_argument_is_told_to_stay_traced():
    f = jamp.autocast_transform(lambda x, n: x * 2, static_argnums=1)
    for array in (jnp.ones(2), np.ones(2)):
        with pytest.raises(TypeError, match=r"static argument 'n' \(static_argnums\) must be "
                                            r"hashable.*An array is traced, not static: leave it "
                                            r"out of static_argnums") as info:
            f(jnp.ones(2), array)
        assert "instead of a list" not in str(info.value)
    with pytest.raises(TypeError, match="Pass a tuple instead of a list"):
        f(jnp.ones(2), [1, 2])


def test_static_argnums_out_of_range_lists_positional_parameters_only():
    def f(x, n, *, k):
        return x

    with pytest.raises(ValueError, match=r"static_argnums=\(5,\) but the function takes 2 "
                                         r"positional argument\(s\) \(x, n; k is keyword-only: "
                                         r"name it in static_argnames\)$"):
        jamp.autocast_transform(f, static_argnums=5)
    assert jamp.autocast_transform(f, static_argnames="k")(jnp.ones(2), 1, k=3).shape == (2,)


# --- Tracebacks of errors raised in the user's function ----------------------------------------

def _raising_layer(x, w):
    return jnp.tanh(x @ w) + _fails_here(x)


def _fails_here(x):
    raise ValueError("the user's own error")


def _in_region(x, w):
    with jamp.autocast():
        return _raising_layer(x, w)


def _scaled_step(x, w):
    step = jamp.scaled_value_and_grad(lambda x, w: _raising_layer(x, w).sum(), argnums=1)
    return step(jamp.StaticLossScale(2.0 ** 8), x, w)


@pytest.mark.parametrize("call", [
    jamp.autocast_transform(_raising_layer),
    jax.jit(jamp.autocast_transform(_raising_layer)),
    jax.jit(lambda x, w: jamp.autocast_transform(_raising_layer)(x, w)),
    jax.grad(lambda x, w: jamp.autocast_transform(_raising_layer)(x, w).sum(), argnums=1),
    jamp.autocast()(_raising_layer),
    jax.jit(_in_region),
    _scaled_step,
], ids=["eager transform", "jit of transform", "transform under jit", "grad of transform",
        "decorator", "region under jit", "scaled_value_and_grad"])
def test_an_error_in_the_users_function_shows_the_users_frames_not_jamps_or_jaxs(call, traceback_filtering):
    # jamp's frames were not library frames for JAX's traceback filtering, and an eager transformed
    # function was no API boundary: its traceback showed ten frames of jamp and JAX between the
    # call and the user's function (found with JAX's errors_test under an identity region).
    x, w = jnp.ones((2, 3)), jnp.ones((3, 3))
    with pytest.raises(ValueError, match="the user's own error") as info:
        call(x, w)
    innermost = [("test_misuse_errors.py", "_raising_layer"), ("test_misuse_errors.py", "_fails_here")]
    assert_only_user_frames(info.value, traceback_filtering, innermost)


def test_strict_promotion_in_a_region_says_the_region_made_the_value_16_bit():
    # jnp checks dtypes before the region sees an operation: under strict promotion a bfloat16
    # matmul output plus a float32 bias raised JAX's bare TypePromotionError (JAX's
    # shape_poly_test under an identity region: random_categorical on bfloat16 under vmap).
    x, w, bias = jnp.ones((4, 8)), jnp.ones((8, 8)), jnp.ones((8,))
    def layer(x):
        with jamp.autocast():
            return (x @ w) + bias

    with jax.numpy_dtype_promotion("strict"):
        for call in (layer, jax.jit(layer)):
            with pytest.raises(jax.dtypes.TypePromotionError) as info:
                call(x)
            notes = "\n".join(getattr(info.value, "__notes__", []))
            assert "inside a jamp.autocast region: a value is bfloat16" in notes
            assert "jamp.autocast_transform(fn)" in notes
        # the user's own mix outside a region keeps JAX's message alone
        with pytest.raises(jax.dtypes.TypePromotionError) as info:
            x + x.astype(jnp.bfloat16)
        assert "jamp" not in "\n".join(getattr(info.value, "__notes__", []))
