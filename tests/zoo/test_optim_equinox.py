"""jamp.optim with an Equinox model (the zoo extra has Equinox; tests/test_optim.py covers Flax)."""
import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import jamp

BF16 = jnp.dtype(jnp.bfloat16)


def test_equinox_mlp_with_bf16_parameters_learns_with_stochastic_rounding_and_masters():
    x = jax.random.normal(jax.random.key(0), (64, 4))
    y = jnp.sin(x).sum(axis=1, keepdims=True)
    model = eqx.nn.MLP(4, 1, 16, 2, key=jax.random.key(1))
    model = jax.tree.map(lambda a: a.astype(jnp.bfloat16) if eqx.is_inexact_array(a) else a,
                         model)

    def loss(m):
        return jnp.mean((jax.vmap(m)(x).astype(jnp.float32) - y) ** 2)

    for tx in (jamp.optim.stochastic_rounding(jamp.optim.state_dtype(optax.adam(1e-2))),
               jamp.optim.master_weights(optax.adam(1e-2))):
        m = model
        state = tx.init(eqx.filter(m, eqx.is_inexact_array))

        @eqx.filter_jit
        def step(m, state):
            grads = eqx.filter_grad(loss)(m)
            updates, state = tx.update(grads, state, eqx.filter(m, eqx.is_inexact_array))
            return eqx.apply_updates(m, updates), state

        first = float(loss(m))
        for _ in range(30):
            m, state = step(m, state)
        assert {a.dtype for a in jax.tree.leaves(eqx.filter(m, eqx.is_inexact_array))} == {BF16}
        assert float(loss(m)) < 0.5 * first
