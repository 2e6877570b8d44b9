"""jax.random's samples come in the dtype the program asked for, under the policy too.

``jax.random.normal(key, shape, jnp.bfloat16)`` computes ``erf_inv`` on a 16-bit uniform sample:
an fp32-table op, which the policy ran in float32, so the sample came back float32, and so did
every Flax parameter initialized with ``param_dtype=jnp.bfloat16`` under the policy (torch's
factory functions give the dtype asked for under autocast). A sampler runs as traced, and what
is computed from samples and constants alone (jax 0.12's initializers compute ``erf_inv`` of a
uniform sample outside the sampler) keeps the sample's dtype; a sample meeting a model value
follows the policy as any value does.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jamp
from tests.jaxpr_utils import in_region

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
KEY = jax.random.key(0)


def forms(fn):
    """``fn`` under the transform and in a region, each called eagerly and jitted, with how
    each runs: compiled, or op by op (an eager region; the transform compiles its program)."""
    for name, form in (("transform", jamp.autocast_transform(fn)), ("region", in_region(fn))):
        yield f"{name} eager", form, "eager" if name == "region" else "jit"
        yield f"{name} jit", jax.jit(form), "jit"


def samplers(key, dtype):
    inits = jax.nn.initializers
    return (
        jax.random.normal(key, (3, 4), dtype),
        jax.random.truncated_normal(key, -2.0, 2.0, (3, 4), dtype),
        jax.random.uniform(key, (3, 4), dtype, minval=-1.0),
        jax.random.laplace(key, (3, 4), dtype),  # (log1p; gumbel, gamma, beta... alike)
        inits.variance_scaling(1.0, "fan_in", "normal", out_axis=0)(key, (3, 4), dtype),
        inits.lecun_normal()(key, (3, 4), dtype),
        inits.glorot_uniform()(key, (3, 4), dtype),
        inits.normal(0.02)(key, (3, 4), dtype),
    )


@pytest.mark.parametrize("dtype", [BF16, pytest.param(F16, marks=pytest.mark.slow)])
def test_a_sample_comes_in_the_dtype_asked_for_as_plain_jax_draws_it(dtype):
    # (op by op as plain JAX runs it op by op: compiled, XLA may reassociate a constant product)
    plain = {"eager": samplers(KEY, dtype), "jit": jax.jit(samplers, static_argnums=1)(KEY, dtype)}
    for name, form, runs in forms(lambda key: samplers(key, dtype)):
        got, expected = form(KEY), plain[runs]
        assert [g.dtype for g in got] == [dtype] * len(expected), name
        for g, e in zip(got, expected):
            np.testing.assert_array_equal(g, e, err_msg=name)


def test_flax_parameters_initialized_under_the_policy_keep_their_param_dtype():
    x, tokens = jnp.ones((2, 3)), jnp.arange(3)

    def init(key):
        dense = nn.Dense(4, param_dtype=BF16).init(key, x)
        embed = nn.Embed(10, 4, param_dtype=BF16).init(key, tokens)
        return dense, embed

    plain = {"eager": init(KEY), "jit": jax.jit(init)(KEY)}
    for name, form, runs in forms(init):
        got, expected = form(KEY), plain[runs]
        assert jax.tree.map(lambda a: a.dtype, got) == jax.tree.map(lambda a: BF16, expected), name
        jax.tree.map(np.testing.assert_array_equal, got, expected)
    with jamp.autocast():
        linear = nnx.Linear(3, 4, param_dtype=BF16, rngs=nnx.Rngs(0))
        embed = nnx.Embed(10, 4, param_dtype=BF16, rngs=nnx.Rngs(0))
    assert (linear.kernel[...].dtype, embed.embedding[...].dtype) == (BF16, BF16)


def test_a_sample_meeting_a_model_value_follows_the_policy():
    x, w = jnp.ones((2, 4)), jnp.full((4, 4), 0.5)

    def f(key, x, w):
        h = x @ w  # the compute dtype under the policy
        noise = jax.random.normal(key, h.shape, BF16)
        return (
            jnp.exp(0.5 * noise),  # a sample's own arithmetic: its dtype
            jnp.exp(h + noise),  # a model value: fp32 table
            noise @ w,  # a matmul: the compute dtype
            jnp.exp(jax.random.normal(key, h.shape)),  # float32, as asked
            jnp.exp(jax.random.uniform(key, h.shape, BF16, h, h + 1)),  # around a model value
        )

    for name, form, _ in forms(f):
        got = form(KEY, x, w)
        assert [g.dtype for g in got] == [BF16, F32, BF16, F32, F32], name


def test_explain_counts_a_draw_as_one_operation_in_the_dtype_it_drew():
    def f(key):
        return jax.random.normal(key, (3,)), jax.random.truncated_normal(key, -2, 2, (3,), BF16)

    report = jamp.explain(f, KEY)
    assert report.ops["jax.random normal"] == {"float32": 1}
    assert report.ops["jax.random truncated_normal"] == {"bfloat16": 1}
    assert report.float32_reasons[("jax.random normal", "drawn as asked")] == 1
    assert "jit" not in report.calls  # (run as traced: no body rewritten)
    assert "jax.random truncated_normal" in str(report)


def test_a_draw_inside_a_jitted_function_takes_the_types_it_was_traced_with():
    """On jax 0.12 a region walks a user's jit op by op: the sampler in it met the matmul's
    16-bit output where it was traced with float32, and bound as traced it was an ill-typed
    program (XLA refused it)."""

    @jax.jit
    def layer(key, x, w):
        h = x @ w
        return jax.random.uniform(key, h.shape, minval=h, maxval=h + 1)

    x, w = jnp.ones((2, 4)), jnp.full((4, 4), 0.5)  # (h = 2 in any dtype)
    for name, form, _ in forms(layer):
        out = form(KEY, x, w)
        assert out.dtype == F32 and bool(((out >= 2) & (out <= 3)).all()), name
