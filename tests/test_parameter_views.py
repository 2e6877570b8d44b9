"""A bias reshaped for its add is cast as hand-written bfloat16 casts it: the parameter first,
then the reshape (``interpreter.ParameterView``, issue 33). The same numbers; the compiled train
step is the hand-written model's, since XLA then folds the backward pass's convert pair."""

import collections

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jamp
from jamp import _compat as compat
from jamp import hlo

BF16, F16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32)
X = jax.random.normal(jax.random.key(1), (2, 8, 16), jnp.float32)
LABELS = jax.random.randint(jax.random.key(2), (2, 8), 0, 16)


class Mlp(nn.Module):
    """Two biased Dense layers (Flax reshapes each bias before its add) and a qkv-style
    DenseGeneral (a [heads, features] bias)."""

    dtype: object = None

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(32, dtype=self.dtype)(x))
        h = nn.DenseGeneral((2, 8), dtype=self.dtype)(h).reshape(h.shape[:-1] + (16,))
        return nn.Dense(16, dtype=self.dtype)(h)


MODEL, HAND = Mlp(), Mlp(dtype=jnp.bfloat16)
PARAMS = MODEL.init(jax.random.key(0), X)


def in_region(fn, dtype=jnp.bfloat16):
    def region_fn(*args):
        with jamp.autocast(dtype):
            return fn(*args)

    return region_fn


FORMS = {
    "region": lambda fn: in_region(fn),
    "transform": lambda fn: jamp.autocast_transform(fn),
}


def loss_of(forward):
    return lambda p: optax.softmax_cross_entropy_with_integer_labels(
        forward(p, X).astype(jnp.float32), LABELS
    ).mean()


def train_step(forward):
    tx = optax.sgd(1e-2, momentum=0.9)

    def step(p, opt_state):
        value, grads = jax.value_and_grad(loss_of(forward))(p)
        updates, opt_state = tx.update(grads, opt_state, p)
        return optax.apply_updates(p, updates), opt_state, value

    return step, (PARAMS, tx.init(PARAMS))


def instructions(compiled_text):
    """The optimized program's instructions, by opcode and type, over every computation."""
    module = hlo.parse(compiled_text)
    return collections.Counter(
        (i.opcode, i.type) for comp in module.computations.values() for i in comp.values()
    )


def bias_casts(closed):
    """Per convert to a 16-bit dtype of a 1-D or 2-D float32 value in the program (the biases
    and their views): whether it reads a function input directly."""
    jaxpr = compat.open_and_consts(closed)[0]
    inputs = set(jaxpr.invars)
    return [
        eqn.invars[0] in inputs
        for eqn in jaxpr.eqns
        if eqn.primitive.name == "convert_element_type"
        and np.dtype(eqn.params["new_dtype"]).itemsize == 2
        and eqn.invars[0].aval.dtype == F32
        and eqn.invars[0].aval.ndim > 0
        and eqn.invars[0].aval.ndim < 3
        and eqn.invars[0].aval.size <= 32
    ]


@pytest.mark.parametrize("form", sorted(FORMS))
def test_a_reshaped_bias_is_cast_before_its_reshape(form):
    forward = FORMS[form](lambda p, x: MODEL.apply(p, x))
    # (twice: the second trace replays the decisions the first made)
    for _ in range(2):
        closed = jax.make_jaxpr(lambda p, x: forward(p, x))(PARAMS, X)
        casts = bias_casts(closed)
        # three biases (and the kernels, 2-D, read directly too): each cast from the parameter
        assert len(casts) >= 3 and all(casts), casts
    out = forward(PARAMS, X)
    hand = HAND.apply(PARAMS, X)
    assert out.dtype == hand.dtype == BF16
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(hand, np.float32))


@pytest.mark.parametrize("form", sorted(FORMS))
def test_the_train_step_compiles_to_the_hand_written_models_program(form):
    """With the bias cast first, the backward pass's cast of the bias gradient follows jnp's
    rounding of its sum with no reshape between them; XLA folds that pair as it does in Flax's
    bf16 model (the gradient summed in float32), so the optimized programs are the same.
    ``autocast_transform`` is called under ``jax.grad`` here, where its rewrite binds into
    JAX's linearize trace (``_compat.bind_to_linearize``) and casts the view so too."""
    ours, args = train_step(FORMS[form](lambda p, x: MODEL.apply(p, x)))
    hand, _ = train_step(lambda p, x: HAND.apply(p, x))
    ours_program = instructions(jax.jit(ours).lower(*args).compile().as_text())
    hand_program = instructions(jax.jit(hand).lower(*args).compile().as_text())
    assert ours_program == hand_program
    new_ours, new_hand = jax.jit(ours)(*args), jax.jit(hand)(*args)
    jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), new_ours, new_hand
    )


def test_an_eager_region_casts_the_view_itself_with_the_same_numbers():
    """Eagerly a cast from the parameter would be one more dispatch: the view is cast as it
    comes, with the same numbers as the traced region's (the cast commutes with the reshape)."""
    forward = in_region(lambda p, x: MODEL.apply(p, x))
    eager = forward(PARAMS, X)
    traced = jax.jit(forward)(PARAMS, X)
    np.testing.assert_array_equal(np.asarray(eager, np.float32), np.asarray(traced, np.float32))
    grads = jax.grad(loss_of(forward))(PARAMS)
    traced_grads = jax.jit(jax.grad(loss_of(forward)))(PARAMS)
    # (bfloat16 gradients: op by op and compiled, XLA rounds the products differently)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(
            np.asarray(a), np.asarray(b), atol=0.03 * float(np.abs(np.asarray(b)).max())
        ),
        grads,
        traced_grads,
    )


@pytest.mark.parametrize("form", sorted(FORMS))
def test_a_float16_bias_keeps_its_saturating_cast(form):
    """float16's range is smaller than float32's: a bias is cast clipping its finite values
    (``with_adapting_cast``), from the view as before: a view is cast through its parameter only
    where the cast is a plain convert."""
    big = jax.tree.map(lambda a: a, PARAMS)
    big["params"]["Dense_0"]["bias"] = big["params"]["Dense_0"]["bias"].at[0].set(1e6)
    wrap = (
        (lambda fn: in_region(fn, jnp.float16))
        if form == "region"
        else (lambda fn: jamp.autocast_transform(fn, jamp.Policy(jnp.float16)))
    )
    out = wrap(lambda p, x: MODEL.apply(p, x))(big, X)
    assert out.dtype == F16
    assert np.isfinite(np.asarray(out, np.float32)).all()


def test_a_view_read_by_two_calls_is_cast_from_the_parameter_by_each():
    """Two adds reading one reshaped bias: each call casts the parameter itself (inside the call,
    as it cast the view before; XLA computes the cast once), never the float32 view."""

    def forward(x, w, b):
        with jamp.autocast():
            h = x @ w
            bias = b.reshape(1, 1, -1)
            return (h + bias) * (h + bias)

    w = jnp.ones((16, 16), jnp.float32)
    b = jnp.arange(16, dtype=jnp.float32)
    closed = jax.make_jaxpr(forward)(X, w, b)
    jaxpr = compat.open_and_consts(closed)[0]
    b_var = jaxpr.invars[2]
    views = [
        e.outvars[0] for e in jaxpr.eqns if e.primitive.name == "reshape" and e.invars[0] is b_var
    ]
    casts = [e for e in jaxpr.eqns if e.primitive.name == "convert_element_type"]
    assert views and not any(e.invars[0] in views for e in casts)
    assert sum(e.invars[0] is b_var for e in casts) == 2
    np.testing.assert_array_equal(
        np.asarray(forward(X, w, b), np.float32),
        np.asarray(jax.jit(forward)(X, w, b), np.float32),
    )


def test_views_alike_of_parameters_of_other_shapes_each_get_their_own_cast():
    """Two biases of different shapes reshaped alike (``(1, 1, 16)`` from ``[16]`` and from
    ``[1, 16]``) into the same add: each call casts its own parameter, with its own type."""

    def forward(x, w, b1, b2):
        with jamp.autocast():
            h = x @ w
            return (h + b1.reshape(1, 1, 16)) * (h + b2.reshape(1, 1, 16))

    w = jnp.ones((16, 16), jnp.float32)
    b1 = jnp.arange(16, dtype=jnp.float32)
    b2 = jnp.arange(16, dtype=jnp.float32).reshape(1, 16) * 2
    closed = jax.make_jaxpr(forward)(X, w, b1, b2)
    jaxpr = compat.open_and_consts(closed)[0]
    cast_inputs = [e.invars[0] for e in jaxpr.eqns if e.primitive.name == "convert_element_type"]
    assert jaxpr.invars[2] in cast_inputs and jaxpr.invars[3] in cast_inputs
    # (eagerly the views are cast as they come: the same numbers, the cast commutes)
    np.testing.assert_array_equal(
        np.asarray(jax.jit(forward)(X, w, b1, b2), np.float32),
        np.asarray(forward(X, w, b1, b2), np.float32),
    )
