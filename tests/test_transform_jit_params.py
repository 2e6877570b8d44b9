"""A ``jax.jit``-wrapped function through ``autocast_transform`` (or the ``@jamp.autocast()``
decorator) called eagerly keeps what its jit asks of the call: donated inputs are donated and
outputs land where ``out_shardings`` puts them, as calling the jitted function does."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jamp

X = np.ones((4, 4), np.float32)


def step(w, x):
    return w - 0.1 * (x @ w)


DONATING = jax.jit(step, donate_argnums=0)
FORMS = {
    "transform": jamp.autocast_transform,
    "decorator": lambda fn: jamp.autocast()(fn),
}


@pytest.mark.parametrize("form", FORMS)
def test_a_donated_input_is_donated_as_by_the_jitted_function(form):
    w = jnp.ones((4, 4))
    out = FORMS[form](DONATING)(w, X)
    assert w.is_deleted()
    np.testing.assert_allclose(out, step(np.ones((4, 4), np.float32), X), rtol=1e-2)


def test_an_input_read_beside_the_donating_call_is_kept():
    """Donating it to the whole program would be wrong: the sum reads it too."""
    w = jnp.ones((4, 4))
    new, total = jamp.autocast_transform(lambda w, x: (DONATING(w, x), w.sum()))(w, X)
    assert not w.is_deleted() and float(total) == 16.0


def test_grad_of_it_donates_as_grad_of_the_jitted_function():
    expected_w, w = jnp.ones((4, 4)), jnp.ones((4, 4))
    jax.grad(lambda w: DONATING(w, X).sum())(expected_w)
    grads = jax.grad(lambda w: jamp.autocast_transform(DONATING)(w, X).sum())(w)
    assert w.is_deleted() == expected_w.is_deleted() and grads.dtype == jnp.float32


def test_output_memory_kind_is_the_jits():
    host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    to_host = jax.jit(lambda a: a @ a, out_shardings=host)
    assert to_host(X).sharding.memory_kind == "pinned_host"  # the CPU has host memory
    out = jamp.autocast_transform(to_host)(X)
    assert out.sharding.memory_kind == "pinned_host" and out.dtype == jnp.bfloat16  # (a matmul)


def test_an_array_passed_twice_is_not_donated_from_under_the_other_read():
    """Tied weights, an EMA sharing the parameters' arrays: the same array passed as the donated
    argument and as another one is read after the donating call, as plain JAX allows."""
    w = jnp.ones((4, 4))
    total, _ = jamp.autocast_transform(lambda a, b: (b.sum(), DONATING(a, X)))(w, w)
    assert float(total) == 16.0 and not w.is_deleted()
    other = jnp.ones((4, 4))
    jamp.autocast_transform(lambda a, b: (b.sum(), DONATING(a, X)))(other, w)
    assert other.is_deleted()  # passed once: donated as before
