"""custom_jvp / custom_vjp under autocast: primal and derivative rules under the same policy."""
import jax
import jax.numpy as jnp
import numpy as np

import jamp
from tests.jaxpr_utils import operand_dtypes

BF16, F32 = jnp.bfloat16, jnp.float32
W = jax.random.normal(jax.random.PRNGKey(0), (8, 8)) * 0.3
X = jax.random.normal(jax.random.PRNGKey(1), (4, 8))


def test_custom_jvp_activations_keep_compute_dtype_and_differentiate_to_float32():
    for act in (jax.nn.relu, jax.nn.gelu, jax.nn.silu, jax.nn.softplus):
        f = jamp.autocast_transform(lambda w, x: act(x @ w))
        assert f(W, X).dtype in (BF16, F32)
        g = jax.grad(lambda w: f(w, X).astype(F32).sum())(W)
        assert g.dtype == F32 and jnp.all(jnp.isfinite(g))
    relu = jamp.autocast_transform(lambda w, x: jax.nn.relu(x @ w))
    assert relu(W, X).dtype == BF16


def test_custom_jvp_rule_runs_under_the_policy():
    @jax.custom_jvp
    def f(x, w):
        return x @ w

    @f.defjvp
    def f_jvp(primals, tangents):
        x, w = primals
        tx, tw = tangents
        return x @ w, tx @ w + x @ tw

    g = jamp.autocast_transform(lambda w, x: f(x, w))
    out, tangent = jax.jvp(lambda w: g(w, X), (W,), (jnp.ones_like(W),))
    assert out.dtype == BF16 and tangent.dtype == BF16
    jaxpr = jax.make_jaxpr(lambda w: jax.jvp(lambda w: g(w, X), (w,), (jnp.ones_like(w),)))(W)
    assert set(operand_dtypes(jaxpr, "dot_general")) == {("bfloat16", "bfloat16")}


def test_custom_vjp_fwd_and_bwd_under_forward_policy_and_cotangents_match_inputs():
    seen = {}

    @jax.custom_vjp
    def scaled_matmul(x, w):
        return x @ w

    def fwd(x, w):
        return x @ w, (x, w)

    def bwd(res, g):
        x, w = res
        seen["bwd"] = True
        # A user bwd returning float32 for bf16 inputs: jamp casts to the primal input dtypes.
        return ((g @ w.T).astype(F32), (x.T @ g).astype(F32))

    scaled_matmul.defvjp(fwd, bwd)
    f = jamp.autocast_transform(lambda w, x: scaled_matmul(x @ w, w))
    loss = lambda w: f(w, X).astype(F32).sum()
    g = jax.grad(loss)(W)
    assert seen and g.dtype == F32
    expected = jax.grad(lambda w: ((X @ w) @ w).sum())(W)
    np.testing.assert_allclose(g, expected, rtol=5e-2, atol=5e-2)
    dots = operand_dtypes(jax.make_jaxpr(jax.grad(loss))(W), "dot_general")
    assert dots and all(d == ("bfloat16", "bfloat16") for d in dots)


def test_custom_vjp_with_cast_inputs_decorator_runs_in_float32():
    @jamp.autocast(enabled=False, cast_inputs=F32)
    @jax.custom_vjp
    def stable(x):
        return jnp.exp(x) / jnp.sum(jnp.exp(x))

    stable.__wrapped__.defvjp(lambda x: (stable.__wrapped__(x), x),
                              lambda x, g: (g * jax.nn.softmax(x),))
    f = jamp.autocast_transform(lambda w, x: stable(x @ w))
    assert f(W, X).dtype == F32
    g = jax.grad(lambda w: f(w, X).sum())(W)
    assert g.dtype == F32 and jnp.all(jnp.isfinite(g))
