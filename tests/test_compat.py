"""jamp._compat: the version-dependent pieces behave alike on every supported JAX."""
import jax
import jax.numpy as jnp
import numpy as np

from jamp import _compat as compat

F32 = jnp.float32


def _aval(shape, dtype=F32, weak_type=False):
    return compat.ShapedArray(shape, jnp.dtype(dtype), weak_type=weak_type)


def test_trace_to_closed_matches_make_jaxpr_and_keeps_weak_types():
    fn = lambda x, s: [jnp.sin(x) * s, s + 1.0]
    avals = [_aval((3,)), _aval((), weak_type=True)]
    closed = compat.trace_to_closed(fn, avals)
    reference = jax.make_jaxpr(fn)(*avals)
    assert closed.in_avals == reference.in_avals
    assert closed.out_avals == reference.out_avals
    assert closed.in_avals[1].weak_type and closed.out_avals[1].weak_type
    compat.check_closed_jaxpr(closed)
    x = jnp.arange(3.0)
    jaxpr, consts = compat.open_and_consts(closed)
    np.testing.assert_allclose(compat.eval_jaxpr(jaxpr, consts, [x, 2.0])[0], jnp.sin(x) * 2.0)


def test_trace_to_closed_flattens_pytree_outputs():
    closed = compat.trace_to_closed(lambda x: (x, {"b": [x * 2.0], "a": None}), [_aval((2,))])
    assert len(closed.out_avals) == 2
    jaxpr, consts = compat.open_and_consts(closed)
    outs = compat.eval_jaxpr(jaxpr, consts, [jnp.ones(2)])
    np.testing.assert_array_equal(outs[1], 2.0 * jnp.ones(2))


def test_trace_to_closed_turns_captured_values_into_constants():
    table = np.arange(4.0, dtype=np.float32)
    closed = compat.trace_to_closed(lambda x: [x + table], [_aval((4,))])
    jaxpr, consts = compat.open_and_consts(closed)
    assert len(jaxpr.constvars) == len(consts) == 1
    np.testing.assert_array_equal(compat.eval_jaxpr(jaxpr, consts, [jnp.ones(4)])[0], table + 1)

    # A tracer of an enclosing trace is a constant too (as with make_jaxpr); evaluated in that
    # trace, the closed jaxpr computes with it.
    def outer(y):
        inner = compat.trace_to_closed(lambda x: [x * y], [_aval((4,))])
        jaxpr, consts = compat.open_and_consts(inner)
        assert len(consts) == 1 and compat.is_tracer(consts[0])
        return compat.eval_jaxpr(jaxpr, consts, [jnp.ones(4)])[0]

    np.testing.assert_array_equal(jax.jit(outer)(jnp.full(4, 3.0)), jnp.full(4, 3.0))


def test_jvp_keeping_zeros_gives_none_where_jax_knows_the_tangent_is_zero():
    def fn(x, y):
        return [x * y, jnp.ones(3), jax.lax.stop_gradient(x) + 1.0, y]

    x, y = jnp.arange(3.0), jnp.full(3, 2.0)
    outs, tangents = compat.jvp_keeping_zeros(fn, [x, y], [jnp.ones(3), jnp.zeros(3)])
    np.testing.assert_array_equal(outs[0], x * y)
    np.testing.assert_array_equal(tangents[0], y)  # a zero *array* tangent is no symbolic zero
    assert tangents[1] is None and tangents[2] is None
    np.testing.assert_array_equal(tangents[3], jnp.zeros(3))
