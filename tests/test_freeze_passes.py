"""The freezing passes on their own: fold_constants, fold_batchnorm, dce (tracing/passes/)."""
from __future__ import annotations

import collections

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jamp import _compat as compat
from tests.host_data import ones
from tests.jaxpr_utils import iter_eqns
from tracing.passes import dce, fold_batchnorm, fold_constants


def counts(closed) -> collections.Counter:
    return collections.Counter(e.primitive.name for e in iter_eqns(closed))


def run(closed, *args):
    jaxpr, consts = compat.open_and_consts(closed)
    return compat.eval_jaxpr(jaxpr, consts, args)


# Test data is built on the host and transferred (jax.device_put): jnp.ones, jnp.arange and
# jax.random would each compile a program per shape; references are one jit, not op by op.
def test_fold_constants_binds_the_leading_inputs():
    w, x = jax.device_put(np.arange(6, dtype=np.float32).reshape(3, 2)), ones(4, 3)
    closed = jax.make_jaxpr(lambda w, x: x @ (w * 2))(w, x)
    folded = fold_constants(closed, [w])
    compat.check_closed_jaxpr(folded)
    assert counts(folded) == collections.Counter({"dot_general": 1})
    assert [v.aval.shape for v in compat.open_and_consts(folded)[0].invars] == [(4, 3)]
    chex.assert_trees_all_close(run(folded, x)[0], x @ (w * 2))
    with pytest.raises(ValueError, match="3 known values for a program with 2 inputs"):
        fold_constants(closed, [w, x, x])


def test_values_made_from_scalars_are_not_stored():
    """jnp.zeros / iota are folded but re-emitted, not kept as large constants."""
    def f(s, x):
        return x + jnp.zeros((256, 256)) + jnp.arange(256.0) * s

    x = ones(256, 256)
    closed = jax.make_jaxpr(f)(jnp.asarray(2.0), x)
    folded = fold_constants(closed, [jnp.asarray(2.0)])
    _, consts = compat.open_and_consts(folded)
    assert all(np.size(c) <= 256 for c in consts), [np.shape(c) for c in consts]
    chex.assert_trees_all_close(run(folded, x)[0], jax.jit(f)(2.0, x))


def test_a_mask_or_identity_made_of_iotas_is_re_emitted_and_a_product_of_them_folded():
    """``jnp.eye`` compares two iotas and ``jnp.tril``'s mask compares them too: made from scalars
    alone, they were stored as T x T constants (4 MB of float32 at T = 1024 from a 4-byte
    variable). A matmul of two such values is no cheap equation: it is folded, as before."""
    t = 256

    def f(s, x):
        causal = jnp.where(jnp.tril(jnp.ones((t, t), bool)), x * s, -1e9)
        return causal + jnp.eye(t) * s, jnp.eye(t) @ jnp.eye(t)

    s, x = jnp.asarray(2.0), ones(t, t)
    folded = fold_constants(jax.make_jaxpr(f)(s, x), [s])
    _, consts = compat.open_and_consts(folded)
    stored = [np.shape(c) for c in consts if np.size(c) > 1]
    assert stored == [(t, t)], stored  # the matmul's result only
    chex.assert_trees_all_close(tuple(run(folded, x)), jax.jit(f)(s, x))


@pytest.mark.parametrize("numpy", [False, True])
def test_a_view_of_a_stored_constant_is_re_emitted_not_stored_again(numpy):
    """A table read by a gather and, transposed, by a matmul (a tied embedding) is stored once:
    the transpose (and a reshape of it) stays in the program. A transpose of a constant that
    nothing else reads is folded, as before (a kernel must stay a constant to be quantized)."""
    table = np.random.default_rng(0).standard_normal((50, 8), dtype=np.float32)
    table = table if numpy else jax.device_put(table)

    def f(table, ids, h):
        split = jnp.einsum("bij,ijv->bv", h.reshape(3, 2, 4), table.T.reshape(2, 4, 50))
        return table[ids], h @ table.T, split

    args = (jax.device_put(np.array([1, 3], np.int32)), ones(3, 8))
    folded = fold_constants(jax.make_jaxpr(f)(table, *args), [table])
    _, consts = compat.open_and_consts(folded)
    assert [np.shape(c) for c in consts if np.size(c) > 1] == [(50, 8)]
    chex.assert_trees_all_close(tuple(run(folded, *args)), f(table, *args))

    untied = fold_constants(jax.make_jaxpr(lambda w, h: h @ w.T)(table, args[1]), [table])
    assert [np.shape(c) for c in compat.open_and_consts(untied)[1]] == [(8, 50)]
    assert counts(untied) == collections.Counter({"dot_general": 1})


def test_fold_batchnorm_general_affine_chains():
    """c - y, division and negation fold too; the conv's NCHW feature axis is found."""
    rng = np.random.default_rng(0)
    kernel = jax.device_put(rng.standard_normal((6, 2, 3, 3), dtype=np.float32))
    a = jax.device_put(rng.uniform(0.5, 1.0, (1, 6, 1, 1)).astype(np.float32))
    b = jax.device_put(rng.standard_normal((1, 6, 1, 1), dtype=np.float32))
    x = jax.device_put(rng.standard_normal((2, 2, 8, 8), dtype=np.float32))

    def f(x):
        y = jax.lax.conv_general_dilated(x, kernel, (1, 1), "SAME",
                                         dimension_numbers=("NCHW", "OIHW", "NCHW"))
        return -((b - y) / a) * 3.0

    closed = jax.make_jaxpr(f)(x)
    folded = fold_batchnorm(closed)
    compat.check_closed_jaxpr(folded)
    assert counts(folded) == collections.Counter({"conv_general_dilated": 1, "add": 1})
    chex.assert_trees_all_close(run(folded, x)[0], jax.jit(f)(x), atol=1e-4, rtol=1e-4)


def test_fold_batchnorm_leaves_what_it_cannot_fold():
    kernel = ones(3, 4)
    x = ones(2, 3)

    def casts_only(x):  # a round trip through bfloat16 is not affine: keep it
        return (x @ kernel).astype(jnp.bfloat16).astype(jnp.float32)

    def scale_varies_over_batch(x):
        return (x @ kernel) * jnp.arange(2.0)[:, None]

    for f in (casts_only, scale_varies_over_batch):
        closed = jax.make_jaxpr(f)(x)
        assert fold_batchnorm(closed) is closed


def test_dce_keeps_inputs_and_effects():
    def f(x, unused):
        jnp.sin(x)
        jax.debug.callback(lambda v: None, x)
        return x * 2

    closed = jax.make_jaxpr(f)(ones(3), ones(2))
    out = dce(closed)
    compat.check_closed_jaxpr(out)
    c = counts(out)
    assert c["sin"] == 0 and c["mul"] == 1 and c["debug_callback"] == 1, c
    assert len(compat.open_and_consts(out)[0].invars) == 2
