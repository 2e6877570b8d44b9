"""custom_jvp / custom_vjp under autocast: primal and derivative rules under the same policy."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.custom_derivatives import SymbolicZero, zero_from_primal

import jamp
from jamp import _compat as compat
from tests.host_data import normal as _normal
from tests.jaxpr_utils import eqns_named, in_region, operand_dtypes

BF16, F32 = jnp.bfloat16, jnp.float32


W = _normal(0, (8, 8), 0.3)
X = _normal(1, (4, 8))


def _rand(*shape, key=0):
    return _normal(key, shape, 0.5)


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
    expected = jax.jit(jax.grad(lambda w: ((X @ w) @ w).sum()))(W)
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


# --- Policy(cast_inputs=True): custom-derivative calls return the compute dtype ------------------

T, D = 16, 8  # an attention matrix [T, T] is told apart from the [T, D] activations by shape
Q, K, V = (_normal(key, (T, D)) for key in (2, 3, 4))
CAST_INPUTS = jamp.Policy(cast_inputs=True)


def attention(q, k, v):
    return jax.nn.softmax(q @ k.T, axis=-1) @ v


def _residuals(fn, *args):
    """Dtype names of the [T, T] leaves ``jax.vjp`` keeps for the backward pass, eager and jit."""
    out = {}
    for jit in (False, True):
        _, vjp_fn = jax.vjp(jax.jit(fn) if jit else fn, *args)
        out[jit] = sorted(x.dtype.name for x in jax.tree.leaves(vjp_fn) if x.shape == (T, T))
    return out


def test_cast_inputs_attention_keeps_no_float32_attention_matrix_for_backward():
    f = jamp.autocast_transform(attention, CAST_INPUTS)
    residuals = _residuals(f, Q, K, V)
    assert residuals[False] and residuals[True]
    assert "float32" not in residuals[False] + residuals[True], residuals
    # The softmax still exponentiates and sums in float32 inside; only its output is bfloat16.
    jaxpr = jax.make_jaxpr(f)(Q, K, V)
    for name in ("exp", "reduce_sum"):
        eqns = eqns_named(jaxpr, name)
        assert [e.invars[0].aval.shape for e in eqns] == [(T, T)]
        assert all(v.aval.dtype == F32 for e in eqns for v in (*e.invars, *e.outvars))
    softmax = eqns_named(jaxpr, "custom_jvp_call")
    assert [e.outvars[0].aval.dtype for e in softmax] == [BF16]


def test_cast_inputs_attention_gradients_are_float32_close_and_type_check():
    f = jamp.autocast_transform(attention, CAST_INPUTS)
    loss = lambda q, k, v: f(q, k, v).astype(F32).sum()
    reference = jax.jit(jax.grad(lambda q, k, v: attention(q, k, v).sum(), argnums=(0, 1, 2)))(
        Q, K, V)
    for grad_fn in (jax.grad(loss, argnums=(0, 1, 2)), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))):
        grads = grad_fn(Q, K, V)
        for g, r in zip(grads, reference):
            assert g.dtype == F32 and jnp.all(jnp.isfinite(g))
            np.testing.assert_allclose(g, r, rtol=0.1, atol=0.1)
    compat.check_closed_jaxpr(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(Q, K, V))
    compat.check_closed_jaxpr(jax.make_jaxpr(jax.hessian(lambda q: loss(q, K, V)))(Q))
    # The JVP's tangent has the primal output's dtype.
    out, tangent = jax.jvp(lambda q: f(q, K, V), (Q,), (jnp.ones_like(Q),))
    assert out.dtype == tangent.dtype == BF16


def test_cast_inputs_vmapped_and_masked_softmax_under_enable_checks():
    """cast_inputs traces jax.nn.softmax as JAX's custom-JVP ``_softmax``, whose debug info
    fails JAX's own ``jax_enable_checks`` self-check when vmapped (Equinox's
    MultiheadAttention) or masked (``where=``); the zoo's Flax lm1b/sst2 and Equinox attention
    raised an AssertionError from inside JAX under ``jax.grad`` with the checks on."""
    heads = jnp.stack([Q, Q * 0.5])
    projection = _normal(5, (2, T, T))
    programs = {
        "vmapped": lambda q, k: jax.vmap(lambda h: jax.nn.softmax(h @ k.T, axis=-1))(q),
        "masked": lambda q, k: jax.nn.softmax(q @ k.T, axis=-1, where=jnp.tril(
            jnp.ones((T, T), bool))),
    }
    for name, program in programs.items():
        f = jamp.autocast_transform(program, CAST_INPUTS)
        loss = lambda q, k: jnp.sum(f(q, k).astype(F32) * projection)
        reference = jax.jit(jax.grad(lambda q, k: jnp.sum(program(q, k) * projection)))(heads, K)
        with jax.enable_checks(True):
            out, grads = f(heads, K), jax.grad(loss)(heads, K)
            jitted = jax.jit(jax.grad(loss))(heads, K)
        assert out.dtype == BF16, name
        for g in (grads, jitted):
            assert g.dtype == F32, name
            np.testing.assert_allclose(g, reference, rtol=0.1, atol=0.05, err_msg=name)


def test_default_policy_keeps_the_softmax_output_in_float32():
    softmax = lambda q, k: jax.nn.softmax(q @ k.T, axis=-1)
    assert jamp.autocast_transform(softmax)(Q, K).dtype == F32          # torch semantics
    assert jamp.autocast_transform(softmax, CAST_INPUTS)(Q, K).dtype == BF16
    assert "float32" in _residuals(jamp.autocast_transform(attention), Q, K, V)[True]
    # Also when the user traces softmax as its custom-JVP call.
    with jax.softmax_custom_jvp(True):
        f = jamp.autocast_transform(softmax)
        assert [e.outvars[0].aval.dtype for e in eqns_named(jax.make_jaxpr(f)(Q, K),
                                                              "custom_jvp_call")] == [F32]
        assert f(Q, K).dtype == F32


def test_cast_inputs_keeps_float32_for_reductions_and_float32_operands():
    @jax.custom_jvp
    def sq_norm(x):
        return jnp.sum(x * x)

    @sq_norm.defjvp
    def sq_norm_jvp(primals, tangents):
        (x,), (tx,) = primals, tangents
        return sq_norm(x), 2 * jnp.sum(x * tx)

    reduced = jamp.autocast_transform(lambda w, x: sq_norm(x @ w), CAST_INPUTS)
    assert reduced(W, X).dtype == F32 and jax.grad(reduced)(W, X).dtype == F32
    # An operand that arrives in float32 (here from the fp32 table) keeps the output float32.
    mixed = jamp.autocast_transform(lambda w, x: jax.nn.softmax(jnp.exp(x @ w)), CAST_INPUTS)
    assert mixed(W, X).dtype == F32


def test_cast_inputs_losses_stay_float32():
    import optax
    labels = jnp.arange(4) % 8
    for loss in (lambda w, x: optax.softmax_cross_entropy_with_integer_labels(x @ w, labels).mean(),
                 lambda w, x: -jnp.mean(jax.nn.log_softmax(x @ w)[jnp.arange(4), labels]),
                 lambda w, x: jnp.mean(jax.scipy.special.xlogy(jax.nn.softmax(x @ w), 2.0))):
        f = jamp.autocast_transform(loss, CAST_INPUTS)
        value, grad = jax.value_and_grad(f)(W, X)
        assert value.dtype == F32 and grad.dtype == F32 and jnp.isfinite(grad).all()


def test_cast_inputs_custom_vjp_returns_compute_dtype_and_saves_it_as_residual():
    @jax.custom_vjp
    def sigmoid(x):
        return 1 / (1 + jnp.exp(-x))

    def fwd(x):
        y = sigmoid(x)
        return y, (y,)

    def bwd(res, g):
        (y,) = res
        return (g * y * (1 - y),)

    sigmoid.defvjp(fwd, bwd)
    f = jamp.autocast_transform(lambda w, x: sigmoid(x @ w), CAST_INPUTS)
    assert f(W, X).dtype == BF16
    assert jamp.autocast_transform(lambda w, x: sigmoid(x @ w))(W, X).dtype == F32
    _, vjp_fn = jax.vjp(f, W, X)
    assert {x.dtype.name for x in jax.tree.leaves(vjp_fn) if x.shape == (4, 8)} == {"bfloat16"}
    g = jax.grad(lambda w: f(w, X).astype(F32).sum())(W)
    expected = jax.jit(jax.grad(lambda w: jax.nn.sigmoid(X @ w).sum()))(W)
    assert g.dtype == F32
    np.testing.assert_allclose(g, expected, rtol=5e-2, atol=5e-2)


# --- issue 11 item 3: symbolic zeros (equinox.filter_custom_vjp, diffrax) and closures ----------

def _scaled_product():
    """A custom_vjp with symbolic_zeros whose fwd checks what JAX says is perturbed."""
    seen = []

    @jax.custom_vjp
    def product(x, y):
        return x @ y

    def fwd(x, y):
        seen.append((x.perturbed, y.perturbed))
        return product(x.value, y.value), (x.value, y.value)

    def bwd(res, g):
        x, y = res
        return g @ y.T, None if isinstance(g, SymbolicZero) else x.T @ g

    product.defvjp(fwd, bwd, symbolic_zeros=True)
    return product, seen


@pytest.mark.parametrize("wrap", [lambda f: f, jax.jit], ids=["eager", "jit"])
def test_custom_vjp_with_symbolic_zeros_sees_the_perturbed_flags_jax_gives(wrap):
    product, seen = _scaled_product()

    def loss(x, y):
        return jnp.sum(jnp.tanh(product(x, lax.stop_gradient(y))))

    x, y = _rand(4, 4), _rand(4, 4, key=1)
    got = wrap(jax.grad(jamp.autocast_transform(loss)))(x, y)
    assert seen and set(seen) == {(True, False)}, seen
    seen.clear()
    want = jax.grad(loss)(x, y)
    assert seen == [(True, False)]
    assert got.dtype == F32
    np.testing.assert_allclose(got, want, rtol=5e-2, atol=5e-2)


def test_custom_vjp_with_symbolic_zeros_and_an_unused_output():
    @jax.custom_vjp
    def two(x):
        return x @ x, jnp.sin(x)

    def fwd(x):
        assert x.perturbed
        return two(x.value), x.value

    def bwd(x, gs):
        g_mat, g_sin = gs
        g_mat = jnp.zeros_like(x) if isinstance(g_mat, SymbolicZero) else g_mat
        g_sin = jnp.zeros_like(x) if isinstance(g_sin, SymbolicZero) else g_sin
        return (g_mat @ x.T + x.T @ g_mat + g_sin * jnp.cos(x),)

    two.defvjp(fwd, bwd, symbolic_zeros=True)
    loss = lambda x: jnp.sum(two(x)[0])  # the second output gets a symbolic zero cotangent
    x = _rand(4, 4)
    np.testing.assert_allclose(jax.grad(jamp.autocast_transform(loss))(x), jax.grad(loss)(x),
                               rtol=5e-2, atol=5e-2)


def test_custom_vjp_with_symbolic_zeros_gets_the_symbolic_zero_cotangent_jax_gives():
    """JAX hands a ``symbolic_zeros=True`` bwd a ``SymbolicZero`` for an output the
    differentiated function does not use; under jamp it gets the same, also where the bwd
    refuses anything else (JAX's own tests assert on the type), in both forms."""
    seen = []

    @jax.custom_vjp
    def pair(s, d):
        return s * 2.0, s * d

    def fwd(s, d):
        return pair(s.value, d.value), (s.value, d.value)

    def bwd(res, gs):
        s, d = res
        assert isinstance(gs[0], SymbolicZero), "the unused output's cotangent"
        seen.append(tuple(isinstance(g, SymbolicZero) for g in gs))
        return gs[1] * d, gs[1] * s

    pair.defvjp(fwd, bwd, symbolic_zeros=True)
    loss = lambda s, d: jnp.sum(pair(s, d)[1] @ d.T)  # the first output is unused
    s, d = _rand(4, 4), _rand(4, 4)
    expected = jax.grad(loss, argnums=(0, 1))(s, d)
    with jamp.autocast():
        in_region = jax.grad(loss, argnums=(0, 1))(s, d)
    transformed = jax.grad(jamp.autocast_transform(loss), argnums=(0, 1))(s, d)
    for got in (in_region, transformed):
        np.testing.assert_allclose(got[0], expected[0], rtol=5e-2, atol=5e-2)
        np.testing.assert_allclose(got[1], expected[1], rtol=5e-2, atol=5e-2)
    assert set(seen) == {(True, False)}


def test_custom_jvp_with_symbolic_zeros_sees_the_zero_tangents_jax_gives():
    """``equinox.filter_custom_jvp`` (diffrax's solver state): a rule with ``symbolic_zeros``
    sees a symbolic zero for an input JAX does not perturb, under jamp as without it."""
    seen = []

    @jax.custom_jvp
    def scale(x, y):
        return x @ y

    def scale_jvp(primals, tangents):
        (x, y), (tx, ty) = primals, tangents
        seen.append((isinstance(tx, SymbolicZero), isinstance(ty, SymbolicZero)))
        out = x @ y
        tangent = jnp.zeros_like(out) if isinstance(tx, SymbolicZero) else tx @ y
        if not isinstance(ty, SymbolicZero):
            tangent = tangent + x @ ty
        return out, tangent

    scale.defjvp(scale_jvp, symbolic_zeros=True)

    def loss(x, y):
        return jnp.sum(jnp.tanh(scale(x, lax.stop_gradient(y))))

    x, y = _rand(4, 4), _rand(4, 4, key=1)
    got = jax.grad(jamp.autocast_transform(loss))(x, y)
    assert seen and set(seen) == {(False, True)}, seen
    seen.clear()
    want = jax.grad(loss)(x, y)
    assert set(seen) == {(False, True)}
    assert got.dtype == F32
    np.testing.assert_allclose(got, want, rtol=5e-2, atol=5e-2)


def _passing_on(seen):
    """A ``custom_jvp`` with ``symbolic_zeros`` whose rule hands its second input's tangent on
    as is (JAX's ``test_symbolic_zero_custom_jvp_vmap_doesnt_instantiate``), noting whether it
    was a ``SymbolicZero``."""

    @jax.custom_jvp
    def second(x, y):
        return y

    def second_jvp(primals, tangents):
        seen.append(isinstance(tangents[1], SymbolicZero))
        return primals[1], tangents[1]

    second.defjvp(second_jvp, symbolic_zeros=True)
    return second


@jax.custom_jvp
def _offset(x):
    return x


@_offset.defjvp
def _offset_jvp(primals, tangents):
    # A tangent that is no linear function of the input's (JAX's test_symbolic_zero_custom_jvp).
    return primals[0], jnp.full_like(primals[0], 90.0)


@pytest.mark.parametrize("batched", [False, True], ids=["jvp", "jvp_of_vmap"])
@pytest.mark.parametrize("form", ["transform", "region"])
def test_a_symbolic_zero_tangent_a_custom_jvp_returns_reaches_the_next_rule_as_one(form, batched):
    """A rule with ``symbolic_zeros`` that returns a symbolic zero tangent: the next rule is
    handed a ``SymbolicZero`` under jamp as without it (jamp's rewritten rule used to hand it
    an array of zeros), and a tangent a rule makes from nothing is no symbolic zero."""
    zero_seen, offset_seen = [], []
    chained, after_offset = _passing_on(zero_seen), _passing_on(offset_seen)

    def g(x):
        return chained(x, chained(x, 1.0)), after_offset(x, _offset(2.0 * x))

    if form == "transform":
        wrapped = jamp.autocast_transform(g, jamp.Policy(F32))
    else:
        wrapped = in_region(g, dtype=jamp.Policy(F32))

    x, t = jnp.arange(3.0), jnp.ones(3)
    got = jax.jvp(jax.vmap(wrapped) if batched else wrapped, (x,), (t,))
    assert zero_seen and all(zero_seen), zero_seen
    assert offset_seen and not any(offset_seen), offset_seen
    want = jax.jvp(jax.vmap(g) if batched else g, (x,), (t,))
    chex.assert_trees_all_close(got, want)
    np.testing.assert_array_equal(got[1][1], np.full(3, 90.0))  # the offset's tangent



def _shared_output_vjp():
    """A custom_vjp returning its weight unchanged beside the product: under ``vmap`` over ``x``
    the second output is shared across the batch (unbatched), as diffrax's solver state is."""

    @jax.custom_vjp
    def apply(x, w):
        return x @ w, w

    def fwd(x, w):
        return apply(x.value, w.value), (x.value, w.value)

    def bwd(res, gs):
        x, w = res
        g, g_w = gs
        g = jnp.zeros((x.shape[0], w.shape[1])) if isinstance(g, SymbolicZero) else g
        g_w = 0 if isinstance(g_w, SymbolicZero) else g_w
        return g @ w.T, x.T @ g + g_w

    apply.defvjp(fwd, bwd, symbolic_zeros=True)
    return apply


@pytest.mark.parametrize("wrap", [lambda f: f, jax.jit], ids=["eager", "jit"])
def test_vmapped_custom_vjp_with_an_output_shared_across_the_batch(wrap):
    """jax >= 0.12 refuses a nonzero cotangent for a vmapped custom_vjp's unbatched output;
    JAX passes a symbolic zero there when the output is unused, and so must jamp (a diffrax
    neural ODE under vmap failed with "shared across the batch" in jamp's own custom_vjp)."""
    apply = _shared_output_vjp()

    def loss(w, xs):
        out, _ = jax.vmap(apply, in_axes=(0, None))(xs, w)
        return jnp.sum(jnp.tanh(out))

    w, xs = _rand(4, 4), _rand(3, 2, 4, key=1)
    for policy in (jamp.Policy(F32), jamp.Policy()):
        got = wrap(jax.grad(jamp.autocast_transform(loss, policy)))(w, xs)
        assert got.dtype == F32
        np.testing.assert_allclose(got, jax.grad(loss)(w, xs), rtol=5e-2, atol=5e-2)


def test_custom_vjp_bwd_returning_float32_for_a_bfloat16_input_keeps_it_as_jax_does():
    """JAX lets a bwd return a float32 cotangent for a bfloat16 input ("excess precision": JAX's
    ``test_excess_precision_hell``); jamp keeps it where it did not cast that input, so an
    identity policy changes no gradient dtype."""

    @jax.custom_vjp
    def f(x, w):
        return jnp.sin(x) * w

    def bwd(res, g):
        x, w = res
        g32 = g.astype(F32)
        return jnp.cos(x.astype(F32)) * g32 * w.astype(F32), jnp.sin(x.astype(F32)) * g32

    f.defvjp(lambda x, w: (f(x, w), (x, w)), bwd)

    def loss(x, w):
        return jnp.sum(f(x, w).astype(F32))

    x, w = jnp.ones(4, BF16), jnp.full(4, 0.5, BF16)
    want = jax.grad(loss, argnums=(0, 1))(x, w)
    assert [g.dtype for g in want] == [F32, F32]
    for policy in (jamp.Policy(F32), jamp.Policy()):
        got = jax.grad(jamp.autocast_transform(loss, policy), argnums=(0, 1))(x, w)
        assert [g.dtype for g in got] == [F32, F32], policy
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                   rtol=1e-2)


def test_a_wider_cotangent_reaching_a_custom_vjp_comes_back_as_wide():
    """JAX's ``test_excess_precision_hell``: a float32 cotangent from one custom bwd reaches a
    second custom_vjp whose bwd passes it on, for a bfloat16 input: JAX returns float32."""

    @jax.custom_vjp
    def square(x):
        return x @ x

    square.defvjp(lambda x: (square(x), None), lambda _, g: (g,))

    @jax.custom_vjp
    def widen(x):
        return x.astype(F32)

    widen.defvjp(lambda x: (widen(x), x), lambda x, _: (x.astype(F32),))

    def f(x):
        return widen(square(x))

    x = (jnp.bfloat16(1) + jnp.finfo(BF16).eps) * jnp.eye(2, dtype=BF16)
    y, vjp = jax.vjp(f, x)
    assert vjp(jnp.ones_like(y))[0].dtype == F32
    for wrap in (lambda g: g, jax.jit):
        y, vjp = jax.vjp(wrap(jamp.autocast_transform(f, jamp.Policy(F32))), x)
        (got,) = vjp(jnp.ones_like(y))
        # the cotangent is widen's float32 residual, passed through: y itself, not a rounding
        assert got.dtype == F32
        np.testing.assert_array_equal(got, y)


def _closing_vjp(a, x):
    b = jnp.sin(a)  # a computed value of the traced function, closed over by fwd and bwd

    @jax.custom_vjp
    def f(x):
        return (x @ x) * b

    f.defvjp(lambda x: (f(x), x), lambda x, g: ((g @ x.T + x.T @ g) * b,))
    return jnp.sum(f(x))


def _closing_jvp(a, x):
    b = jnp.sin(a)

    @jax.custom_jvp
    def f(x):
        return jnp.tanh(x @ x) * b

    @f.defjvp
    def f_jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        y = jnp.tanh(x @ x)
        return y * b, (1 - y ** 2) * (t @ x + x @ t) * b

    return jnp.sum(f(x))


@pytest.mark.parametrize("fn", [_closing_vjp, _closing_jvp], ids=["custom_vjp", "custom_jvp"])
@pytest.mark.parametrize("wrap", [lambda f: f, jax.jit], ids=["eager", "jit"])
def test_custom_rules_closing_over_values_of_the_traced_function(fn, wrap):
    """jax.grad of a function defining a custom rule over a value it computed: plain JAX (eager)
    differentiates it; so must autocast_transform, whose trace has ended when the rule runs."""
    a, x = jnp.float32(0.7), _rand(4, 4)
    got = wrap(jax.grad(jamp.autocast_transform(fn), argnums=1))(a, x)
    want = jax.grad(fn, argnums=1)(a, x)
    assert got.dtype == F32
    np.testing.assert_allclose(got, want, rtol=5e-2, atol=5e-2)


@pytest.mark.skipif(not hasattr(jax.custom_vjp, "defvjp_with_logs"),
                    reason="backward-pass logs (defvjp_with_logs) are new in jax 0.12")
@pytest.mark.parametrize("policy", [jamp.Policy(F32), jamp.Policy(BF16)], ids=["f32", "bf16"])
def test_custom_vjp_backward_pass_logs_come_through(policy):
    """JAX's test_defvjp_with_logs under jamp: the logs of a custom_vjp's bwd reach
    ``f_vjp.with_logs``, eagerly, through jax.jit and in a scan, in the dtypes bwd made them."""
    @jax.custom_vjp
    def f(x, y):
        return jnp.sin(x) * y

    def f_fwd(x, y):
        return f(x, y), (jnp.cos(x), jnp.sin(x), y)

    def f_bwd(res, g):
        cos_x, sin_x, y = res
        return (cos_x * g * y, sin_x * g), {"f": {"ct_out": g, "y": y, "yy": jnp.dot(y, y.T)}}

    f.defvjp_with_logs(f_fwd, f_bwd)
    g = jamp.autocast_transform(f, policy)
    x, y = _rand(3, 3), _rand(3, 3, key=1)
    (want_cts, want_logs) = jax.vjp(f, x, y)[1].with_logs(jnp.ones((3, 3)))
    for call in (g, jax.jit(g)):
        cts, logs = jax.vjp(call, x, y)[1].with_logs(jnp.ones((3, 3)))
        assert jax.tree.structure(logs) == jax.tree.structure(want_logs)
        for got, want in zip(jax.tree.leaves((cts, logs)), jax.tree.leaves((want_cts, want_logs))):
            assert got.dtype == want.dtype
            np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)
        x_ct, _ = jax.vjp(call, x, y)[1](jnp.ones((3, 3)))  # a plain call drops the logs
        np.testing.assert_allclose(x_ct, want_cts[0], rtol=2e-2, atol=2e-2)

    def f_scan(xs):
        return lax.scan(lambda c, x: (c + f(x, 2.0), None), 0.0, xs)[0]

    xs = jnp.arange(1.0, 4.0)
    cts, logs = jax.vjp(jamp.autocast_transform(f_scan, policy), xs)[1].with_logs(1.0)
    np.testing.assert_allclose(cts[0], 2.0 * jnp.cos(xs), rtol=1e-5)
    assert logs["f"]["ct_out"].shape == (3,)


def _remat_optimized_layer():
    """A custom_vjp with ``optimize_remat=True`` whose fwd's primal output is twice the primal
    function's, so a test can tell which of the two JAX ran."""
    @jax.custom_vjp
    def layer(x, w):
        return jnp.tanh(x @ w)

    def fwd(x, w):
        y = jnp.tanh(x @ w)
        return 2 * y, (x, w, y)

    def bwd(res, g):
        x, w, y = res
        gy = g * (1 - y * y)
        return gy @ w.T, x.T @ gy

    layer.defvjp(fwd, bwd, optimize_remat=True)
    return layer


@pytest.mark.parametrize("policy", [jamp.Policy(F32), jamp.Policy(BF16)], ids=["f32", "bf16"])
def test_custom_vjp_with_optimize_remat_is_rewritten(policy, recwarn):
    """``jax.grad`` of such a function binds ``remat_opt``: its fwd runs under the policy, and so
    does the primal function JAX substitutes where the residuals are unused."""
    layer = _remat_optimized_layer()
    loss = lambda w, x: jnp.sum(layer(x, w) ** 2)
    w, x = _rand(8, 8), _rand(4, 8, key=1)
    grad = jamp.autocast_transform(jax.grad(loss), policy)
    closed = jax.make_jaxpr(grad)(w, x)
    assert eqns_named(closed, "remat_opt")
    assert set(operand_dtypes(closed, "dot_general")) == {(policy.compute_dtype.name,) * 2}
    for call in (grad, jax.jit(grad)):
        np.testing.assert_allclose(call(w, x).astype(F32), jax.grad(loss)(w, x),
                                   rtol=5e-2, atol=5e-2)
    # Only the primal output used: under jit, JAX drops fwd and runs the primal function.
    primal = lambda w, x: jax.vjp(lambda w: layer(x, w), w)[0]
    out = jax.jit(jamp.autocast_transform(primal, policy))(w, x)
    assert out.dtype == policy.compute_dtype
    np.testing.assert_allclose(out.astype(F32), jnp.tanh(x @ w), rtol=2e-2, atol=2e-2)
    assert not [r for r in recwarn if r.category.__module__.startswith("jamp")]


@pytest.mark.parametrize("kind", ["custom_jvp", "custom_vjp"])
def test_rewritten_custom_rules_hold_no_tracer_of_the_call(kind):
    """JAX's test_leak_checker_avoids_false_positive_custom_jvp under jamp: the rules jamp binds
    into a jit's program must not keep the rewrite's operands (tracers of that jit) alive."""
    with jax.checking_leaks():
        if kind == "custom_jvp":
            f = jax.custom_jvp(lambda y: y)
            f.defjvp(lambda p, t: (p[0], t[0]))
        else:
            f = jax.custom_vjp(lambda y: y)
            f.defvjp(lambda y: (y, None), lambda _, g: (g,))
        out = jax.jit(jamp.autocast_transform(lambda y: f(y)))(3.0)
    assert out == 3.0


def _stash_gradient():
    """A custom_vjp whose bwd writes the cotangent it gets into a mutable array reference its
    fwd keeps as a residual (JAX's ``test_custom_vjp_grad_stats_plumbing_basic``; an fp8
    scaling history is kept this way)."""

    @jax.custom_vjp
    def stash(grads_ref, x):
        return x

    def stash_bwd(grads_ref, g):
        grads_ref[...] = g
        return None, g

    stash.defvjp(lambda grads_ref, x: (x, grads_ref), stash_bwd)
    return lambda grads_ref, x: jnp.sin(stash(grads_ref, jnp.sin(x)))


@pytest.mark.parametrize(
    "form",
    ["region", "jit_of_grad_of_region", "jit_of_grad_of_transform"],
)
def test_a_custom_vjp_keeping_a_mutable_array_reference_for_its_bwd(form):
    """The reference is the call's own operand: it reaches the bwd as that operand (a traced
    program cannot return one: jamp's rule raised JAX's ValueError). Under ``jax.grad`` of a
    ``jax.jit`` JAX itself refuses it for any custom_vjp with ``symbolic_zeros=True``, which
    jamp's rule is; see docs/reference/dtypes.md."""
    fn = _stash_gradient()
    wrapped = {  # (the default policy: bfloat16)
        "region": lambda: jax.grad(in_region(fn), 1),
        "jit_of_grad_of_region": lambda: jax.jit(jax.grad(in_region(fn), 1)),
        "jit_of_grad_of_transform": lambda: jax.jit(jax.grad(jamp.autocast_transform(fn), 1)),
    }[form]()
    want_ref = jax.new_ref(jnp.float32(0.0))
    want = jax.grad(fn, 1)(want_ref, jnp.float32(1.0))
    grads_ref = jax.new_ref(jnp.float32(0.0))
    got = wrapped(grads_ref, jnp.float32(1.0))
    np.testing.assert_allclose(got, want, rtol=1e-2)
    np.testing.assert_allclose(grads_ref[...], want_ref[...], rtol=1e-2)
    assert float(grads_ref[...]) != 0.0  # the bwd ran and wrote into the caller's reference


@pytest.mark.parametrize("form", ["transform", "region"])
def test_custom_derivative_functions_returning_a_typed_prng_key(form):
    # A typed key's dtype (key<fry>) is an extended dtype, no numpy dtype: jamp's rules for both
    # custom_vjp and custom_jvp calls failed on one among their outputs (found with JAX's
    # dtypes_test under an identity region, whose extended dtypes failed the same way).
    @jax.custom_vjp
    def scaled(x, key):
        return x * 2.0, jax.random.split(key)[0]

    scaled.defvjp(lambda x, key: (scaled(x, key), None), lambda _, g: (g[0] * 2.0, None))

    @jax.custom_jvp
    def shifted(x, key):
        return x + 1.0, key

    shifted.defjvp(lambda p, t: (shifted(*p), (t[0], zero_from_primal(p[1]))))

    def loss(x, key):
        y, key = shifted(*scaled(x, key))
        return (y @ y.T).sum(), key

    fn = jamp.autocast_transform(loss) if form == "transform" else in_region(loss)
    x, key = jnp.ones((4, 4)), jax.random.key(0)
    _, key_out = fn(x, key)
    assert operand_dtypes(jax.make_jaxpr(fn)(x, key), "dot_general") == [(BF16.dtype.name,) * 2]
    assert jax.dtypes.issubdtype(key_out.dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(jax.random.key_data(key_out), jax.random.key_data(loss(x, key)[1]))
    grad = jax.grad(lambda x: fn(x, key)[0].astype(F32))(x)
    assert grad.dtype == F32
    np.testing.assert_allclose(grad, jax.grad(lambda x: loss(x, key)[0])(x), rtol=1e-2)


def _constant_cotangent_vjp():
    """A custom_vjp whose bwd returns a constant cotangent (a straight-through estimator's
    shape): its backward program's output is a literal."""
    @jax.custom_vjp
    def clipped(x):
        return jnp.clip(x, -1.0, 1.0) * 3.0

    def fwd(x):
        return clipped(x), None

    def bwd(_, g):
        return (2.0,)

    clipped.defvjp(fwd, bwd)
    return clipped


def _under_region(fn):
    def run(x):
        with jamp.autocast():
            return fn(x)
    return run


@pytest.mark.parametrize("form", [
    lambda g: jax.grad(jamp.autocast_transform(g)),
    lambda g: jax.jit(jax.grad(jamp.autocast_transform(g))),
    lambda g: _under_region(jax.grad(g)),
    lambda g: jax.jit(_under_region(jax.grad(g))),
], ids=["transform", "jit-transform", "eager-region", "jit-region"])
def test_a_custom_vjp_bwd_returning_a_constant_cotangent(form):
    # Found with JAX's custom_api_test::test_float0 run in an eager region: jamp read a literal
    # output of the backward program as an equation's (TypeError: unhashable type: 'Literal')
    clipped = _constant_cotangent_vjp()
    x = jnp.float32(1.5)
    assert jax.grad(clipped)(x) == 2.0
    grad = form(clipped)(x)
    assert grad == 2.0 and grad.dtype == jnp.float32


def _branching_custom_derivatives():
    """A custom_jvp and a custom_vjp function whose bodies and rules branch on their operand's
    value, as eager code may (JAX's custom_api_test::test_python_control_flow)."""
    w = jnp.full((3, 3), 0.25)

    @jax.custom_jvp
    def jvp_fn(x):
        return jnp.tanh(x @ w) if jnp.sum(x) > 0 else jnp.cos(x)

    @jvp_fn.defjvp
    def _(primals, tangents):
        (x,), (t,) = primals, tangents
        return jvp_fn(x), (2.0 if jnp.sum(x) > 0 else 3.0) * t

    @jax.custom_vjp
    def vjp_fn(x):
        return jnp.tanh(x @ w) if jnp.sum(x) > 0 else jnp.cos(x)

    def fwd(x):
        return vjp_fn(x), x

    def bwd(x, g):
        return ((2.0 if jnp.sum(x) > 0 else 3.0) * g,)

    vjp_fn.defvjp(fwd, bwd)

    @jax.custom_vjp
    def rules_branch(x):  # (its body does not branch: only its rules do)
        return jnp.tanh(x @ w)

    def fwd_branching(x):
        return (jnp.tanh(x @ w) if jnp.sum(x) > 0 else jnp.tanh(x @ w) + 0.0), x

    rules_branch.defvjp(fwd_branching, bwd)
    return jvp_fn, vjp_fn, rules_branch


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_custom_derivatives_branching_on_values_differentiate_eagerly_in_a_region(sign):
    # An eager jax.jvp or jax.grad in a region staged the call on types alone to rewrite it, so
    # `if jnp.sum(x) > 0:` raised TracerBoolConversionError where plain JAX runs the rule on the
    # values; now bound as without jamp, the rule's operations decided one by one
    jvp_fn, vjp_fn, rules_branch = _branching_custom_derivatives()
    x = sign * jnp.arange(1.0, 4.0)
    loss = lambda f: lambda x: f(x).astype(jnp.float32).sum()  # noqa: E731
    expected = [jax.jvp(jvp_fn, (x,), (jnp.ones(3),))[1], jax.grad(loss(jvp_fn))(x),
                jax.grad(loss(vjp_fn))(x), jax.grad(loss(rules_branch))(x)]
    with jamp.autocast():
        got = [jax.jvp(jvp_fn, (x,), (jnp.ones(3),))[1], jax.grad(loss(jvp_fn))(x),
               jax.grad(loss(vjp_fn))(x), jax.grad(loss(rules_branch))(x)]
    for g, e in zip(got, expected):
        assert g.dtype == jnp.float32
        np.testing.assert_allclose(g, e)


def test_custom_derivatives_branching_on_values_inside_jit_raise_as_without_jamp():
    jvp_fn, _, _ = _branching_custom_derivatives()

    def step(x):
        with jamp.autocast():
            return jax.grad(lambda x: jvp_fn(x).astype(jnp.float32).sum())(x)

    with pytest.raises(jax.errors.TracerBoolConversionError):
        jax.jit(step)(jnp.arange(1.0, 4.0))


def test_derivative_rules_see_the_autocast_state_of_their_call():
    """torch's custom_fwd/custom_bwd pattern (choose a path by the autocast state) under
    jax.grad(autocast_transform(loss)): fwd, bwd and a jvp rule were traced after the function
    and answered the defaults (disabled; bfloat16 under a float16 transform)."""
    seen = []

    @jax.custom_vjp
    def f(x, w):
        return x @ w

    def f_fwd(x, w):
        seen.append(("fwd", jamp.is_autocast_enabled(), jamp.get_autocast_dtype()))
        return x @ w, (x, w)

    def f_bwd(res, g):
        seen.append(("bwd", jamp.is_autocast_enabled(), jamp.get_autocast_dtype()))
        x, w = res
        return g @ w.T, x.T @ g

    f.defvjp(f_fwd, f_bwd)

    @jax.custom_jvp
    def h(x):
        return jnp.sin(x)

    @h.defjvp
    def h_jvp(primals, tangents):
        seen.append(("jvp", jamp.is_autocast_enabled(), jamp.get_autocast_dtype()))
        return h(primals[0]), jnp.cos(primals[0]) * tangents[0]

    def loss(w, x):
        return jnp.sum(h(f(x, w)).astype(jnp.float32))

    x, w = jnp.ones((2, 4)), jnp.ones((4, 4))
    for fn in (jax.grad(jamp.autocast_transform(loss, dtype=jnp.float16)),
               jax.jit(jax.grad(jamp.autocast_transform(loss, dtype=jnp.float16)))):
        seen.clear()
        fn(w, x)
        assert {kind for kind, _, _ in seen} == {"fwd", "bwd", "jvp"}
        assert all(on and dtype == jnp.float16 for _, on, dtype in seen), seen
