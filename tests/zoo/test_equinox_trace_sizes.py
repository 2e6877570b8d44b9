"""tracing's graph comparison with Equinox's primitives, at two batch sizes (issue 25); in the zoo
job, where Equinox is installed. The diffrax model itself: ``trace_batch`` in test_zoo.py."""
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import tracing
from tests.jaxpr_utils import eqns_named

SMALL = jax.random.normal(jax.random.key(0), (3, 4))
LARGE = jax.random.normal(jax.random.key(1), (5, 4))


def check_at_both(fn):
    with warnings.catch_warnings():
        warnings.simplefilter("error", tracing.TracerWarning)
        tracing.check_trace(fn, (SMALL,), check_inputs=[(LARGE,)])


def error_checked(x):
    return jnp.tanh(eqx.error_if(x, jnp.abs(x) > 100, "diverged"))


def test_error_if_passes_at_another_batch_size():
    """``eqx.error_if`` binds a ``pure_callback`` whose ``result_avals`` hold the batch size."""
    avals = [e.params["result_avals"] for e in
             eqns_named(jax.make_jaxpr(error_checked)(SMALL), "pure_callback")]
    assert avals and all(a[0].shape == SMALL.shape for a in avals)
    check_at_both(error_checked)
    check_at_both(eqx.filter_jit(error_checked))


def test_error_if_of_another_dtype_is_still_reported():
    def checked(x):
        value = x if x.shape[0] == SMALL.shape[0] else x.astype(jnp.float16)
        return eqx.error_if(value, jnp.abs(value) > 100, "diverged").astype(jnp.float32)

    with pytest.raises(tracing.TracingCheckError, match="Graphs differed across invocations!"):
        tracing.check_trace(checked, (SMALL,), check_inputs=[(LARGE,)])


def loop_with_buffer(x):
    """A checkpointed Equinox loop writing a buffer (what diffrax's saving does)."""
    def body(carry):
        i, y, saved = carry
        return i + 1, 0.5 * y, saved.at[i].set(y)

    init = (0, x, jnp.zeros((4,) + x.shape))
    return eqx.internal.while_loop(lambda carry: carry[0] < 3, body, init, max_steps=4,
                                   kind="checkpointed", buffers=lambda carry: carry[2])[2]


def test_vmapped_checkpointed_loop_passes_at_another_batch_size():
    """Under vmap the buffer write is Equinox's ``vprim``, whose ``__axis_size`` is the batch."""
    fn = jax.vmap(loop_with_buffer)
    sizes = [e.params["__axis_size"] for e in eqns_named(jax.make_jaxpr(fn)(SMALL), "vprim")]
    assert sizes and set(sizes) == {SMALL.shape[0]}
    check_at_both(fn)
