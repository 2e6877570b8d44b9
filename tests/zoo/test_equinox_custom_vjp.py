"""A regression test of jamp's custom_vjp rule that needs Equinox (the zoo extra)."""
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import jamp

F32 = jnp.float32


def _rand(*shape, key=0):
    return jax.random.normal(jax.random.PRNGKey(key), shape) * 0.5


def test_equinox_filter_custom_vjp_under_grad():
    """Equinox's filter_custom_vjp (diffrax, optimistix) asserts in its fwd what is perturbed
    (issue 11 item 3); in the zoo job, where Equinox is installed."""
    @eqx.filter_custom_vjp
    def layer(w, x, scale):
        return jnp.tanh(x @ w) * scale

    @layer.def_fwd
    def layer_fwd(perturbed, w, x, scale):
        assert jax.tree.leaves(perturbed) == [True], perturbed
        y = layer(w, x, scale)
        return y, y

    @layer.def_bwd
    def layer_bwd(y, g, perturbed, w, x, scale):
        return x.T @ ((1 - (y / scale) ** 2) * g * scale)

    w, x = _rand(4, 4), _rand(3, 4, key=1)
    loss = lambda w, x: jnp.sum(layer(w, x, 2.0))
    want = jax.grad(loss)(w, x)
    for grad in (jax.grad(jamp.autocast_transform(loss)),
                 jax.jit(jax.grad(jamp.autocast_transform(loss)))):
        got = grad(w, x)
        assert got.dtype == F32
        np.testing.assert_allclose(got, want, rtol=5e-2, atol=5e-2)
