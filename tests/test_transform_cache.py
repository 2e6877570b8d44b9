"""The rewrite cache keys on what jax.jit keys on, and eager calls run a compiled program once
compiled (counted with jax.monitoring's backend-compile events, no timings)."""
import os
import pathlib
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jamp
from tests.jaxpr_utils import count_compiles

BF16, F32 = jnp.bfloat16, jnp.float32
X = jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)
W = jnp.linspace(0.5, 1.5, 16).reshape(4, 4)


def test_named_axis_size_is_part_of_the_key():
    f = jamp.autocast_transform(lambda x: x * lax.psum(1, "i"))
    np.testing.assert_array_equal(jax.vmap(f, axis_name="i")(jnp.ones(2)), [2.0, 2.0])
    np.testing.assert_array_equal(jax.vmap(f, axis_name="i")(jnp.ones(3)), [3.0, 3.0, 3.0])
    np.testing.assert_array_equal(jax.vmap(f, axis_name="i")(jnp.ones(2)), [2.0, 2.0])


def test_an_axis_name_bound_only_by_the_caller_is_found():
    f = jamp.autocast_transform(lambda x: x / lax.psum(x, "batch"))
    np.testing.assert_allclose(jax.vmap(f, axis_name="batch")(jnp.ones(4)), np.full(4, 0.25))
    with pytest.raises(NameError, match="batch"):
        f(jnp.ones(4))  # eagerly the axis is unbound, whatever was cached under vmap


def test_matmul_precision_context_retraces_as_jit_does():
    traces = []

    def f(x, w):
        traces.append(1)
        return x @ w

    g = jamp.autocast_transform(f)
    g(X, W)
    g(X, W)
    with jax.default_matmul_precision("highest"):
        g(X, W)
        dots = [e for e in jax.make_jaxpr(g)(X, W).eqns if e.primitive.name == "dot_general"]
    assert len(traces) == 2  # the default context and "highest" (make_jaxpr reuses the latter)
    assert dots and all(str(e.params["precision"]) != "None" for e in dots), dots
    g(X, W)  # back in the default context: the first entry again
    assert len(traces) == 2


def test_rank_promotion_raise_applies_after_a_cached_call():
    g = jamp.autocast_transform(lambda a, b: a + b)
    assert g(jnp.ones(4), jnp.ones((3, 4))).shape == (3, 4)
    with jax.numpy_rank_promotion("raise"):
        with pytest.raises(ValueError, match="jax_numpy_rank_promotion='raise'"):
            g(jnp.ones(4), jnp.ones((3, 4)))


def test_enable_x64_applies_after_a_cached_call():
    g = jamp.autocast_transform(lambda a: a + jnp.arange(3.0))  # float64 constants under x64
    value = jnp.ones(3, F32)  # the same aval in both contexts
    assert g(value).dtype == F32
    with jax.enable_x64(True):
        expected = jax.jit(lambda a: a + jnp.arange(3.0))(value).dtype
        assert expected == jnp.float64
        assert g(value).dtype == expected
    assert g(value).dtype == F32


def test_second_eager_call_reuses_the_compiled_executable():
    traces = []

    def mlp(x, w):
        traces.append(1)
        return jnp.tanh(x @ w) @ w

    g = jamp.autocast_transform(mlp)
    with count_compiles() as first:
        out = g(X, W)
    with count_compiles() as later:
        for _ in range(3):
            again = g(X, W)
    assert first[0] >= 1 and later[0] == 0 and len(traces) == 1
    np.testing.assert_array_equal(out, again)
    assert out.dtype == BF16


def test_eager_grad_with_a_jit_inside_does_not_recompile_every_call():
    inner = jax.jit(lambda w, x: jnp.sum(jnp.tanh(x @ w).astype(F32)))
    g = jamp.autocast_transform(lambda w, x: inner(w, x))
    grad = jax.grad(g)
    expected = grad(W, X)
    with count_compiles() as steady:
        for _ in range(3):
            np.testing.assert_array_equal(grad(W, X), expected)
    assert steady[0] == 0
    assert expected.dtype == F32


@jax.custom_vjp
def _sine(x):
    return jnp.sin(x)


_sine.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda cos, g: (cos * g,))
_INNER = jax.jit(lambda w, x: jnp.tanh(x @ w))
_WITH_CUSTOM_RULES = {  # programs with custom_jvp/custom_vjp calls and a jax.jit inside
    "relu_custom_jvp": (lambda w, x: jnp.sum(jax.nn.relu(_INNER(w, x)))),
    "custom_vjp": (lambda w, x: jnp.sum(_sine(_INNER(w, x)))),
    "remat": (lambda w, x: jnp.sum(jax.checkpoint(lambda w: jax.nn.relu(_INNER(w, x)))(w))),
    "scan": (lambda w, x: jnp.sum(lax.scan(lambda c, r: (c + jax.nn.relu(_INNER(w, r)), None),
                                           jnp.zeros(4), x)[0])),
    "cond": (lambda w, x: jnp.sum(lax.cond(x[0, 0] > 0, lambda: jax.nn.relu(x @ w),
                                           lambda: _sine(x @ w)))),
    "while": (lambda w, x: jnp.sum(lax.fori_loop(0, 2, lambda i, c: jax.nn.relu(c @ w), x))),
    "rule_closing_over_a_value": (lambda w, x: _closing_rule(x, _INNER(w, x))),
}


def _closing_rule(x, y):
    scale = jnp.sum(jnp.cos(x))  # computed by the function (not differentiated), closed over

    @jax.custom_vjp
    def scaled(y):
        return y * scale

    scaled.defvjp(lambda y: (y * scale, None), lambda _, g: (g * scale,))
    return jnp.sum(scaled(y))


@pytest.mark.parametrize("policy", [jamp.Policy(F32), jamp.Policy(BF16, cast_inputs=True)],
                         ids=["identity", "cast_inputs"])
@pytest.mark.parametrize("name", sorted(_WITH_CUSTOM_RULES))
@pytest.mark.parametrize("outer", ["grad", "vmap"])
def test_eager_grad_and_vmap_with_custom_rules_reuse_compiled_work(outer, name, policy):
    """Custom rules make eager grad/vmap rewrite the program on every call; the rewritten inner
    jit must still be the same program each time, so JAX compiles it once."""
    fn = _WITH_CUSTOM_RULES[name]
    g = jamp.autocast_transform(fn, policy)
    call = (jax.grad(g) if outer == "grad"
            else jax.vmap(g, in_axes=(None, 0)))
    x = X if outer == "grad" else jnp.stack([X, -X])
    expected = call(W, x)
    with count_compiles() as steady:
        for _ in range(3):
            np.testing.assert_array_equal(call(W, x), expected)
    assert steady[0] == 0
    plain = jax.grad(fn) if outer == "grad" else jax.vmap(fn, in_axes=(None, 0))
    np.testing.assert_allclose(expected.astype(F32), plain(W, x), rtol=5e-2, atol=5e-2)


def test_eager_grad_of_rules_closing_over_values_falls_back_to_the_direct_rewrite():
    """Such a rule cannot run inside the compiled program (its value is gone by the time JAX
    differentiates it); the call is bound directly instead, once found out."""
    traces = []

    def f(w, x):
        traces.append(1)
        return _closing_rule(x, jnp.tanh(x @ w))

    g = jax.grad(jamp.autocast_transform(f, jamp.Policy(F32)))
    want = jax.grad(f)(W, X)
    for _ in range(3):
        np.testing.assert_allclose(g(W, X), want, rtol=1e-6)
    assert len(traces) == 2  # the plain grad, and jamp's one trace


def test_grad_of_jit_of_a_rule_closing_over_a_value_says_why_it_fails():
    """As in plain JAX (grad of jit of such a function fails), with a message saying so."""
    g = jax.grad(jax.jit(jamp.autocast_transform(lambda w, x: _closing_rule(x, x @ w))))
    with pytest.raises(jamp.interpreter.RewriteError, match=r"jax.grad\(jax.jit\(f\)\)"):
        g(W, X)


def test_eager_grad_compiles_nothing_from_the_second_call_in_a_fresh_process():
    """The trace context must not change after the first call (a lazily imported JAX module
    defining config states would key the second call anew)."""
    script = textwrap.dedent("""
        import jax, jax.numpy as jnp
        import jamp
        compiles = []
        jax.monitoring.register_event_duration_secs_listener(
            lambda event, secs, **kw: compiles.append(event)
            if event == "/jax/core/compile/backend_compile_duration" else None)
        inner = jax.jit(lambda w, x: jnp.tanh(x @ w))
        g = jax.grad(jamp.autocast_transform(lambda w, x: jnp.sum(jax.nn.relu(inner(w, x)))))
        w, x = jnp.ones((4, 4)), jnp.ones((3, 4))
        g(w, x)
        first = len(compiles)
        g(w, x); g(w, x)
        print(len(compiles) - first)
    """)
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(pathlib.Path(jamp.__file__).parents[1]),
                                          os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, check=True)
    assert out.stdout.split()[-1] == "0", out.stdout + out.stderr


def test_eager_vmap_does_not_recompile_every_call():
    g = jax.vmap(jamp.autocast_transform(lambda x, w: x @ w), in_axes=(0, None))
    g(X, W)
    with count_compiles() as steady:
        g(X, W)
        g(X, W)
    assert steady[0] == 0


def test_disable_jit_runs_the_rewrite_op_by_op_with_the_same_results():
    g = jamp.autocast_transform(lambda x, w: (jnp.tanh(x @ w) @ w, jnp.sum(x)))
    compiled = g(X, W)
    with jax.disable_jit():
        op_by_op = g(X, W)
    for a, b in zip(op_by_op, compiled):
        assert isinstance(a, jax.Array) and a.dtype == b.dtype
        np.testing.assert_allclose(a.astype(F32), b.astype(F32), rtol=1e-2)
    assert compiled[0].dtype == BF16


def test_under_disable_jit_the_functions_python_runs_on_every_call():
    """As jax.jit's function does under jax.disable_jit() (JAX's ``test_disable_jit``): a
    counter, a print or a breakpoint in the function fires on every call, not only the first."""
    calls = []

    def f(x, w):
        calls.append(1)
        return x @ w

    for g in (jamp.autocast_transform(f), jax.jit(jamp.autocast_transform(f))):
        calls.clear()
        with jax.disable_jit():
            g(X, W), g(X, W)
        assert len(calls) == 2
        g(X, W), g(X, W)  # compiled: traced once more, then cached
        assert len(calls) == 3


def test_closure_over_an_outer_tracer_is_not_cached_under_jit():
    """Two traces of a function that transforms a closure over its own tracer: the second must
    not reuse the first's program (which would leak the first trace's tracer)."""

    def outer(w):
        return jamp.autocast_transform(lambda x: jnp.sum(x @ w))(X)

    # (new jit objects of new functions: JAX's trace cache would answer the second trace)
    first = jax.jit(lambda w: outer(w))(W)
    second = jax.jit(lambda w: outer(w))(W * 2)
    np.testing.assert_allclose(first, second / 2, rtol=1e-2)


def test_a_transformed_function_pickles_after_its_calls_and_its_copy_runs():
    # cloudpickle (Ray, multiprocessing) pickles a function's closure by value; after a call,
    # the transform's cache held traced programs with JAX tracebacks, which cannot be pickled
    # (found with JAX's pickle_test under the identity harness). jax.jit's functions pickle.
    import pickle

    import cloudpickle

    traces = []

    def layer(x, w):
        traces.append(1)  # (runs at trace time only)
        return jnp.tanh(x @ w)

    transformed = jamp.autocast_transform(layer)
    want = transformed(X, W)
    jax.jit(transformed)(X, W)
    restored = pickle.loads(cloudpickle.dumps(transformed))
    assert restored.policy == transformed.policy
    n = len(traces)
    transformed(X, W)
    assert len(traces) == n  # pickling left the original's cache as it was
    got = restored(X, W)
    assert got.dtype == BF16
    np.testing.assert_array_equal(got, want)


@jax.jit
def _layer(x):
    return x + jnp.tanh(x @ W)  # (float32: the second call's operand type is the first's)


def _scheduled_layer(x):
    from jax.experimental.scheduling_groups import xla_metadata_call

    return xla_metadata_call(_layer, inlineable="false")(x)


def _scheduled_doubling(x):  # (JAX's scheduling_groups_test: a linear body, transposed on the
    from jax.experimental.scheduling_groups import xla_metadata_call  # sum's constant cotangent)

    return xla_metadata_call(jax.jit(lambda v: v * 2.0), inlineable="false")(x)


def _in_region(fn, policy=None):
    def region(x):
        with jamp.autocast(policy):
            return fn(x)

    return region


@pytest.mark.parametrize("callee, function", [(_layer, "_layer"),
                                              (_scheduled_layer, "xla_metadata_call"),
                                              (_scheduled_doubling, "xla_metadata_call")])
@pytest.mark.parametrize("form", ["transform", "region", "jit in a region"])
def test_a_jitted_callee_called_twice_is_lowered_as_one_function_as_plain_jax_does(
    callee, function, form
):
    # The rewrite of a callee was cached per what is known of its operands, which differs between
    # a call on a parameter and one on the callee's own output: two equal rewrites, two objects,
    # and JAX lowers each jaxpr object as a function of its own (found with JAX's
    # scheduling_groups_test under an identity region).
    def twice(x):
        return callee(callee(x)).sum()

    def mixed(g, policy=None):
        return {"transform": jamp.autocast_transform(g, policy),
                "region": _in_region(g, policy),
                "jit in a region": _in_region(jax.jit(g), policy)}[form]

    defined = f"func.func private @{function}"
    # The gradient taken outside, and inside: there the transposed calls see the sum's constant
    # cotangent, which a rewrite may read (a bfloat16 policy may then decide the two transposed
    # calls differently: a constant adapts to a 16-bit operand; a float32 one decides alike).
    for plain, fn in ((twice, mixed(twice)), (jax.grad(twice), jax.grad(mixed(twice))),
                      (jax.grad(twice), mixed(jax.grad(twice), jamp.Policy(F32)))):
        count = jax.jit(plain).lower(X).as_text().count(defined)
        assert jax.jit(fn).lower(X).as_text().count(defined) == count >= 1
    np.testing.assert_allclose(mixed(twice)(X), twice(X), rtol=2e-2)


@pytest.mark.parametrize("form", ["transform", "region"])
def test_a_jitted_callee_in_two_scopes_is_one_function_unless_a_rule_tells_them_apart(form):
    def two_scopes(x):
        with jax.named_scope("first"):
            y = _layer(x)
        with jax.named_scope("second"):
            return _layer(y).sum()

    def mixed(policy):
        if form == "transform":
            return jamp.autocast_transform(two_scopes, policy)

        def region(x):
            with jamp.autocast(policy):
                return two_scopes(x)

        return region

    defined = "func.func private @_layer"
    shared = jax.jit(mixed(jamp.Policy())).lower(X).as_text()
    assert shared.count(defined) == 1 and "bf16" in shared
    # A rule for one scope makes the two calls different programs: each runs as decided.
    apart = mixed(jamp.Policy(rules=(("second", jnp.float32),)))
    assert jax.jit(apart).lower(X).as_text().count(defined) == 2
    bodies = [e.params["jaxpr"] for e in jax.make_jaxpr(apart)(X).jaxpr.eqns
              if e.primitive.name in ("jit", "pjit")]
    dots = [[str(v.aval.dtype) for v in e.invars]
            for body in bodies for e in body.jaxpr.eqns if e.primitive.name == "dot_general"]
    assert dots == [["bfloat16", "bfloat16"], ["float32", "float32"]]
