"""scan / while / cond / remat bodies are rewritten; carries and branches keep consistent dtypes."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jamp
from tests.jaxpr_utils import eqns_named, operand_dtypes

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
W = jax.random.normal(jax.random.PRNGKey(0), (8, 8)) * 0.3
XS = jax.random.normal(jax.random.PRNGKey(1), (6, 8))


def rnn(w, xs):
    def cell(h, x):
        h = jnp.tanh(h @ w + x)
        return h, h.sum()
    return lax.scan(cell, jnp.zeros(8), xs)


def test_scan_rnn_matmuls_in_compute_dtype_carry_stays_float32():
    f = jamp.autocast_transform(rnn)
    (h, ys) = f(W, XS)
    assert h.dtype == F32 and ys.dtype == F32
    jaxpr = jax.make_jaxpr(f)(W, XS)
    assert operand_dtypes(jaxpr, "dot_general") == [("bfloat16", "bfloat16")]
    scan = eqns_named(jaxpr, "scan")[0]
    assert [v.aval.dtype for v in scan.outvars] == [F32, F32]
    np.testing.assert_allclose(h, rnn(W, XS)[0], atol=3e-2)


def test_scan_rnn_gradient_is_finite_float32_with_bf16_backward_dots():
    loss = lambda w: jamp.autocast_transform(rnn)(w, XS)[0].sum()
    g = jax.grad(loss)(W)
    assert g.dtype == F32 and jnp.all(jnp.isfinite(g))
    np.testing.assert_allclose(g, jax.grad(lambda w: rnn(w, XS)[0].sum())(W), atol=5e-2)
    assert set(operand_dtypes(jax.make_jaxpr(jax.grad(loss))(W), "dot_general")) == {("bfloat16",) * 2}


def test_while_loop_body_rewritten_and_carry_keeps_dtype():
    def f(w, x):
        return lax.while_loop(lambda c: c[1] < 3, lambda c: (jnp.tanh(c[0] @ w), c[1] + 1), (x, 0))
    out, n = jamp.autocast_transform(f)(W, XS)
    assert out.dtype == F32 and int(n) == 3
    assert operand_dtypes(jax.make_jaxpr(jamp.autocast_transform(f))(W, XS), "dot_general") == [
        ("bfloat16", "bfloat16")]


@pytest.mark.parametrize("pred", [True, False])
def test_cond_branches_with_divergent_dtypes_typecheck(pred):
    def f(w, x, p):
        return lax.cond(p, lambda v: v @ w, lambda v: v * 2.0, x)
    out = jamp.autocast_transform(f)(W, XS, pred)
    assert out.dtype == F32  # branches disagree (bf16 vs f32): the traced dtype
    expected = XS @ W if pred else XS * 2.0
    np.testing.assert_allclose(out, expected, atol=5e-2)


def test_cond_branches_that_agree_keep_the_rewritten_dtype():
    f = jamp.autocast_transform(lambda w, x, i: lax.switch(i, [lambda v: v @ w, lambda v: v @ w.T,
                                                               lambda v: (v * 2) @ w], x))
    assert f(W, XS, 2).dtype == BF16


def test_remat_body_rewritten_and_recomputation_uses_the_policy():
    def block(w, x):
        return jnp.sin(x @ w) @ w
    loss = lambda w: jamp.autocast_transform(jax.checkpoint(block))(w, XS).astype(F32).sum()
    jaxpr = jax.make_jaxpr(jax.grad(loss))(W)
    assert eqns_named(jaxpr, "checkpoint") or eqns_named(jaxpr, "remat2") or \
        eqns_named(jaxpr, "remat")
    assert set(operand_dtypes(jaxpr, "dot_general")) == {("bfloat16", "bfloat16")}
    assert jax.grad(loss)(W).dtype == F32


def test_jit_under_scan_and_region_inside_loop_body():
    inner = jax.jit(lambda h, w: h @ w)

    def f(w, xs):
        def cell(h, x):
            with jamp.autocast(enabled=False):
                full = inner(h, w)
            return jnp.tanh(inner(h, w) + full + x), full
        return lax.scan(cell, jnp.zeros(8), xs)
    h, fulls = jamp.autocast_transform(f)(W, XS)
    assert h.dtype == F32 and fulls.dtype == F32
    dots = operand_dtypes(jax.make_jaxpr(jamp.autocast_transform(f))(W, XS), "dot_general")
    assert sorted(dots) == [("bfloat16", "bfloat16"), ("float32", "float32")]


def test_remat_saves_matmul_residuals_in_compute_dtype():
    w1 = jax.random.normal(jax.random.PRNGKey(2), (8, 16)) * 0.3
    w2 = jax.random.normal(jax.random.PRNGKey(3), (16, 16)) * 0.3

    def block(w1, w2, x):
        return jnp.sin(jnp.sin(x @ w1) @ w2)

    f = jamp.autocast_transform(jax.checkpoint(block, policy=jax.checkpoint_policies.checkpoint_dots))
    _, vjp = jax.vjp(lambda w1, w2: f(w1, w2, XS), w1, w2)
    saved_dots = [leaf for leaf in jax.tree.leaves(vjp) if leaf.shape == (6, 16)]
    assert len(saved_dots) == 2 and all(leaf.dtype == BF16 for leaf in saved_dots)


def test_grad_of_checkpointed_vmapped_scan_is_rewritten_on_every_jax_version():
    """recurrentgemma's Griffin: ``grad`` of ``checkpoint(vmap(scan))``. jax 0.12 binds part of it
    as the pure-call primitive ``eval_jaxpr``; jax 0.10 does not; on both the whole program is
    rewritten (no unsupported-primitive warning, every matmul in the compute dtype)."""
    def loss(w, xs):
        def run(x):
            return rnn(w, x)[0]
        return jnp.sum(jax.checkpoint(jax.vmap(run))(xs) ** 2)

    xs = jnp.stack([XS, XS[::-1]])
    grad = jamp.autocast_transform(jax.grad(loss))
    with warnings.catch_warnings():
        warnings.simplefilter("error", jamp.UnsupportedPrimitiveWarning)
        jaxpr = jax.make_jaxpr(grad)(W, xs)
        g = grad(W, xs)
    dots = operand_dtypes(jaxpr, "dot_general")
    assert dots and set(dots) == {("bfloat16", "bfloat16")}, dots
    assert g.dtype == F32
    want = jax.grad(loss)(W, xs)
    cosine = jnp.vdot(g, want) / (jnp.linalg.norm(g) * jnp.linalg.norm(want))
    assert cosine > 0.99
