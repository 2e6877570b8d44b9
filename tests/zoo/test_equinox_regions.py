"""Equinox programs in a region and under the transform, where Equinox is installed (the zoo
job): what its own loops and modules do with the values a region makes."""
import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import jamp

LINEAR = eqx.nn.Linear(4, 4, key=jax.random.key(0))
X = jnp.ones((3, 4))


def loop_of(kind):
    def run(x):
        h = jax.vmap(LINEAR)(x)  # bfloat16 in a region

        def body(carry):
            i, h = carry
            return i + 1, jnp.tanh(jax.vmap(LINEAR)(h))

        return eqx.internal.while_loop(lambda c: c[0] < 3, body, (0, h), max_steps=3,
                                       kind=kind)[1]
    return run


@pytest.mark.parametrize("kind", ["checkpointed", "bounded", "lax"])
def test_equinox_while_loop_refusing_a_16_bit_carry_gets_the_region_note(kind):
    """diffrax's and optimistix's loop: Equinox refuses the carry with a ValueError of its own
    wording (types as ``bf16[3,4]``), which got no word on the region that made it."""
    run = loop_of(kind)
    with pytest.raises(ValueError, match="same input and output structure") as refused:
        with jamp.autocast():
            run(X)
    assert any("initial carry is bfloat16 because the region computed it" in note
               for note in getattr(refused.value, "__notes__", []))
    assert jamp.autocast_transform(run)(X).dtype == jnp.float32  # (the documented remedy)


class _Net(eqx.Module):
    linear: eqx.nn.Linear
    dropout: eqx.nn.Dropout

    def __call__(self, x, key):
        return self.dropout(self.linear(x), key=key)


def _train_step(net, x, key):
    grads = eqx.filter_grad(lambda n: jnp.sum(n(x, key)))(net)
    return eqx.apply_updates(net, jax.tree.map(lambda g: -0.1 * g, grads))


@pytest.mark.parametrize("form", ["transform", "decorator"])
def test_a_step_returning_its_equinox_module_takes_it_again(form):
    """The module came back with ``Dropout.p`` and ``inference`` as Arrays, and the next step on
    it failed on Equinox's ``if inference:`` (a traced bool), where eqx.filter_jit round-trips."""
    step = (jamp.autocast_transform(_train_step) if form == "transform"
            else jamp.autocast()(_train_step))
    net = _Net(eqx.nn.Linear(3, 3, key=jax.random.key(0)), eqx.nn.Dropout(0.2))
    once = step(net, jnp.ones(3), jax.random.key(1))
    assert (once.dropout.p, once.dropout.inference) == (0.2, False)
    assert (type(once.dropout.p), type(once.dropout.inference)) == (float, bool)
    twice = step(once, jnp.ones(3), jax.random.key(2))
    assert twice.linear.weight.dtype == jnp.float32
    through_filter_jit = eqx.filter_jit(jamp.autocast_transform(lambda n, x: (n, x * 2)))
    assert type(through_filter_jit(net, jnp.ones(3))[0].dropout.p) is float
