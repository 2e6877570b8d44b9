"""autocast_transform's call boundary: errors in the user's terms, what a policy may be, outputs."""
import dataclasses
import inspect

import jax
import jax.extend.core as jax_core
import jax.numpy as jnp
import numpy as np
import pytest

import jamp
from tests.host_data import linspace, ones

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
# Test data is built on the host and transferred (tests/host_data.py): jnp.linspace and jnp.ones
# compile per shape.
X = linspace(-1.0, 1.0, 3, 4)
ONES = ones(3, 3)


def _line_of(fn):
    return inspect.getsourcelines(fn)[1]


def branchy_loss(params, batch):
    if batch["x"].sum() > 0:  # Python control flow on a traced value
        return params @ params
    return params


def test_tracer_error_names_the_users_function_file_line_and_parameter():
    with pytest.raises(jax.errors.ConcretizationTypeError) as info:
        jamp.autocast_transform(branchy_loss)(X, {"x": X})
    message = str(info.value)
    assert f"branchy_loss at {__file__}:{_line_of(branchy_loss)}" in message
    assert "argument batch['x']" in message
    assert "flat_fn" not in message and "traced_leaves" not in message
    assert "transform.py" not in message


def test_tracer_error_names_a_keyword_argument_and_skips_static_ones():
    def step(x, *, threshold, mode="train"):
        return x if threshold > 0 else -x

    with pytest.raises(jax.errors.ConcretizationTypeError, match=r"step at .*argument threshold"):
        jamp.autocast_transform(step)(X, threshold=jnp.ones(()), mode="eval")


def test_tracer_errors_name_each_functions_own_parameters_for_one_argument_structure():
    """The leaves' names are made once per signature and argument structure (issue 33): two
    functions called with the same structure, and one called with another, each name theirs."""

    def first(params, batch):
        return params if batch["x"].sum() > 0 else -params

    def second(weights, data):
        return weights if data["x"].sum() > 0 else -weights

    def third(params, batch):
        return params if batch["y"].sum() > 0 else -params

    for fn, args, name in [
        (first, (X, {"x": X}), "argument batch['x']"),
        (second, (X, {"x": X}), "argument data['x']"),
        (first, (X, {"x": X}), "argument batch['x']"),
        (third, (X, {"y": X}), "argument batch['y']"),
        (first, ({"w": X}, {"x": X}), "argument batch['x']"),
    ]:
        with pytest.raises(jax.errors.ConcretizationTypeError) as info:
            jamp.autocast_transform(fn)(*args)
        assert f"{fn.__name__} at {__file__}:{_line_of(fn)}" in str(info.value)
        assert name in str(info.value)


def test_tracer_error_names_the_parameter_where_a_default_cannot_be_hashed():
    def scaled(x, factors=[1.0]):  # noqa: B006 (an unhashable default, the signature too)
        return x if x.sum() > factors[0] else -x

    with pytest.raises(jax.errors.ConcretizationTypeError, match=r"scaled at .*argument x"):
        jamp.autocast_transform(scaled)(X)


def test_tracer_error_under_jit_names_the_users_function():
    def gate(x):
        if x[0, 0] > 0:
            return x
        return -x

    with pytest.raises(jax.errors.ConcretizationTypeError,
                       match=r"gate at .*for autocast_transform.*argument x"):
        jax.jit(jamp.autocast_transform(gate))(X)


def test_tracer_error_with_an_nnx_module_names_the_users_function():
    nnx = pytest.importorskip("flax.nnx")
    model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))

    def forward(m, x):
        y = m(x)
        return y if y.sum() > 0 else -y

    with pytest.raises(jax.errors.ConcretizationTypeError, match=r"forward at .*for autocast"):
        jamp.autocast_transform(forward)(model, X)


# ------------------------------------------------------------------------------------------------
# What may be passed as the policy

@pytest.mark.parametrize("policy", [F16, np.float16, np.dtype("float16"), "float16"])
def test_a_dtype_where_a_policy_is_expected_means_policy_of_that_dtype(policy):
    f = jamp.autocast_transform(lambda a: a @ a, policy)
    assert f.policy == jamp.Policy(F16)
    assert f(X[:, :3] if False else ONES).dtype == F16


def test_dtype_overrides_the_policys_compute_dtype_and_keeps_the_rest():
    f = jamp.autocast_transform(lambda a: (a @ a, a), jamp.Policy(output_dtype=F32), dtype=F16)
    assert f.policy == jamp.Policy(F16, output_dtype=F32)
    assert [o.dtype for o in f(ONES)] == [F32, F32]


def test_the_compute_dtype_given_twice_is_an_error():
    with pytest.raises(ValueError, match=r"compute dtype was given twice.*pass one of them"):
        jamp.autocast_transform(lambda a: a, F16, dtype=BF16)


@pytest.mark.parametrize("policy, error, message", [
    ({"compute_dtype": BF16}, TypeError, r"got dict \{'compute_dtype'"),
    (ones(3), TypeError, r"got ArrayImpl"),
    (3, TypeError, r"got int 3"),
    (jnp.int32, ValueError, r"compute_dtype must be a floating dtype"),
    (jnp.float64, ValueError, r"compute_dtype must be bfloat16, float16, float32 or float8_e4m3fn"),
])
def test_anything_else_is_rejected_saying_what_is_accepted(policy, error, message):
    with pytest.raises(error, match=message) as info:
        jamp.autocast_transform(lambda a: a, policy)
    if error is TypeError:
        assert "a jamp.Policy, a floating dtype such as jnp.bfloat16" in str(info.value)


def test_autocast_jaxpr_and_explain_accept_a_dtype_too():
    closed = jax.make_jaxpr(lambda a: a @ a)(ONES)
    assert jamp.autocast_jaxpr(closed, F16).out_avals[0].dtype == F16
    with pytest.raises(TypeError, match=r"autocast_jaxpr: policy must be a jamp.Policy"):
        jamp.autocast_jaxpr(closed, [F16])
    report = jamp.explain(lambda a: a @ a, ONES, policy=F16)
    assert report.policy == jamp.Policy(F16)


# ------------------------------------------------------------------------------------------------
# Outputs: non-array leaves pass through (as equinox.filter_jit), arrays are what jax.jit returns

@jax.tree_util.register_dataclass
@dataclasses.dataclass
class _ModuleLike:
    """Like an Equinox module: array fields and non-array fields (an activation, a name)."""
    weight: jax.Array
    activation: object
    name: str


def test_non_array_outputs_pass_through_as_they_came():
    def f(x):
        return {"y": x @ x.T, "label": "logits", "nothing": None, "act": jnp.tanh,
                "module": _ModuleLike(x, jax.nn.relu, "head")}

    g = jamp.autocast_transform(f)
    for _ in range(2):  # the traced call and a cached call
        out = g(X)
        assert out["y"].dtype == BF16
        assert out["label"] == "logits" and out["nothing"] is None and out["act"] is jnp.tanh
        assert out["module"].activation is jax.nn.relu and out["module"].name == "head"
        assert out["module"].weight.dtype == F32


def test_python_numbers_in_outputs_come_back_as_they_came():
    """As equinox.filter_jit returns them (numbers inside pytree arguments are static on the way
    in): they came back as Arrays, so a module's ``inference`` flag returned by a step was an
    Array the next call could not branch on."""
    def f(x, config):
        return {"y": x @ x.T, "rate": config["rate"], "train": config["train"], "n": 3}

    g = jamp.autocast_transform(f)
    for _ in range(2):  # the traced call and a cached call
        out = g(X, {"rate": 0.1, "train": False})
        assert (type(out["rate"]), type(out["train"]), type(out["n"])) == (float, bool, int)
        assert (out["rate"], out["train"], out["n"]) == (0.1, False, 3)
        assert out["y"].dtype == BF16
    again = g(X, {"rate": out["rate"], "train": out["train"]})  # fed back: static as before
    assert again["train"] is False


def test_a_function_returning_only_a_string():
    assert jamp.autocast_transform(lambda x: "done")(X) == "done"


def test_non_array_outputs_under_grad_with_aux():
    def loss(x):
        return jnp.sum(x @ x.T).astype(F32), {"tag": "ok", "n": 3}

    grads, aux = jax.grad(jamp.autocast_transform(loss), has_aux=True)(X)
    assert grads.dtype == F32 and aux["tag"] == "ok"


@pytest.mark.parametrize("output_dtype", [F32, None])
@pytest.mark.parametrize("value", [np.ones([]), np.ones(3, np.float64), 2.0, 3, np.float32(1.5),
                                   np.ones(2, np.int64)])
def test_eager_outputs_of_passthrough_values_are_what_jit_returns(value, output_dtype):
    f = jamp.autocast_transform(lambda t: t, jamp.Policy(F32, output_dtype=output_dtype))
    expected = [jax.jit(f)(value)]
    if output_dtype is None:  # an identity policy: also what jit of the plain function returns
        expected.append(jax.jit(lambda t: t)(value))
    eager = f(value)
    with jax.disable_jit():
        op_by_op = f(value)
    for jitted in expected:
        for out in (eager, op_by_op):
            assert isinstance(out, jax.Array)
            assert (out.dtype, out.weak_type) == (jitted.dtype, jitted.weak_type)
            np.testing.assert_array_equal(out, jitted)


def test_eager_outputs_equal_jit_outputs_in_type_and_dtype():
    f = jamp.autocast_transform(lambda a, s: {"mm": a @ a.T, "same": a, "scaled": a * s, "s": s})
    eager, jitted = f(X, 2.0), jax.jit(f)(X, 2.0)
    for key in eager:
        assert type(eager[key]) is type(jitted[key]), key
        assert eager[key].dtype == jitted[key].dtype, key


def _thread_token(x, token):
    """A function taking and returning an effect token, as ``jax.jit`` allows."""
    return x @ x.T, jax.lax.after_all(token, token)


@pytest.mark.parametrize("policy", [jamp.Policy(F32), jamp.Policy(BF16, cast_inputs=True,
                                                                  output_dtype=F32)])
def test_effect_tokens_are_arguments_and_outputs_as_under_jit(policy):
    g = jamp.autocast_transform(_thread_token, policy)
    token = jax.lax.create_token()
    calls = {"jit": jax.jit(g), "eager": g}
    for name, call in calls.items():
        for _ in range(2):  # the traced call and a cached one
            out, out_token = call(X, token)
            assert isinstance(out_token, jax_core.Token) and out_token is not token, name
            assert out.dtype == F32, name
    with jax.disable_jit():
        assert isinstance(g(X, token)[1], jax_core.Token)
    # A token made inside the function comes back as a token (not a leaked tracer).
    made = jamp.autocast_transform(lambda x: (x, jax.lax.create_token()), policy)
    assert isinstance(made(X)[1], jax_core.Token)
    assert isinstance(jax.jit(made)(X)[1], jax_core.Token)
    grads = jax.grad(lambda x: jnp.sum(g(x, token)[0]))(X)
    assert grads.dtype == F32


def test_transform_a_function_snippet_runs():
    import pathlib
    import re
    page = (pathlib.Path(__file__).parents[1] / "docs" / "reference" / "transforming.md")
    text = page.read_text()
    section = text[text.index("## Transform a function"):text.index("## Regions")]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace: dict = {}
    exec(compile(code, f"{page} (Transform a function)", "exec"), namespace)
    assert namespace["x"].dtype == BF16 and namespace["s"].dtype == F32
    assert namespace["f16"].policy == jamp.Policy(F16)
    assert namespace["step"](jnp.ones((4, 4)), 2).dtype == BF16


def test_freeze_accepts_a_dtype_as_its_policy_and_rejects_nonsense():
    tracing = pytest.importorskip("tracing")
    w = linspace(-1.0, 1.0, 4, 4)

    def apply(variables, x):
        return x @ variables["w"]

    frozen = tracing.freeze(apply, {"w": w}, X, policy=BF16)
    assert frozen(X).dtype == BF16
    np.testing.assert_allclose(frozen(X).astype(F32), X @ w, rtol=2e-2, atol=2e-2)
    with pytest.raises(TypeError, match=r"freeze: policy must be a jamp.Policy, a floating dtype"):
        tracing.freeze(apply, {"w": w}, X, policy="fast")


def test_a_reference_view_argument_is_written_through_as_under_jax_jit():
    # autocast_transform flattened its arguments with JAX's public pytree registry, where a view
    # of a reference (ref.at[...]) is a leaf: it refused it as "neither an array nor a hashable
    # static value", where jax.jit accepts it (JAX's state_test, transform form).
    w = linspace(-0.5, 0.5, 4, 4)

    def write_rows(view, x):
        view[...] = jnp.tanh(x @ w)

    transformed = jamp.autocast_transform(write_rows)

    def filled(write):
        ref = jax.new_ref(jnp.zeros((3, 4)))
        write(ref.at[1:3], X[1:3])
        return ref[...]

    # (under jax.jit: jax 0.10 has no views of a concrete reference)
    want = jax.jit(lambda: filled(jax.jit(write_rows)))()
    out = jax.jit(lambda: filled(transformed))()
    assert out.dtype == jnp.float32  # (the reference's)
    np.testing.assert_array_equal(out[0], 0.0)
    np.testing.assert_allclose(out, want, rtol=2e-2, atol=2e-2)
    dots = [e for e in jax.make_jaxpr(lambda: filled(transformed))().jaxpr.eqns
            if e.primitive.name == "dot_general"]
    assert [str(v.aval.dtype) for v in dots[0].invars] == ["bfloat16", "bfloat16"]
