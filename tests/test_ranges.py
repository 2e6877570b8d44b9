"""jamp.value_ranges: per 16-bit equation, how close its values came to overflow and underflow."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jamp
from tests.host_data import ones as _ones
from tests.unchanged import assert_unchanged, snapshot

F16 = jamp.Policy(jnp.float16)
F16_MAX = 65504.0


# Inputs are built on the host and transferred: jnp.eye, jnp.ones and jnp.array compile
# programs of their own.
def _array(values):
    return jax.device_put(np.asarray(values, np.float32))


def _eye(n):
    return _array(np.eye(n))


def layer(w, x):
    with jax.named_scope("layer"):
        return x @ w


def test_largest_magnitude_is_reported_as_a_fraction_of_the_dtype_max():
    w = _eye(4)
    x = _array([[1000.0, -32752.0, 3.0, 0.0]])        # exact in float16
    ranges = jamp.value_ranges(layer, w, x, policy=F16)
    assert ranges.entries[0].max_abs == 32752.0       # the input's cast ties with the matmul
    top = next(e for e in ranges.entries if e.primitive == "dot_general")
    assert (top.dtype, top.scope) == ("float16", "layer")
    assert top.max_abs == 32752.0
    assert top.max_fraction == pytest.approx(32752.0 / F16_MAX)
    assert top.float16_fraction == top.max_fraction
    assert ranges.overflows == []


def test_overflows_come_first_and_count_as_infinite():
    w = _eye(2)
    def f(w, x):
        small = jnp.tanh(x @ w)
        with jax.named_scope("big"):
            big = (x * 1e3) @ w                               # 7e4 overflows float16
        return small, big
    ranges = jamp.value_ranges(f, w, jnp.full((1, 2), 70.0), policy=F16)
    assert ranges.entries[0].scope == "big" and ranges.entries[0].max_fraction == np.inf
    assert [e.scope for e in ranges.overflows] == ["big"]
    assert "big" in str(ranges).splitlines()[3]


def test_flush_to_zero_and_subnormal_shares_in_float16():
    w = _eye(4)
    x = _array([[1e-9, 2e-9, 1e-6, 1.0]])   # two flush to zero in float16, one is subnormal
    ranges = jamp.value_ranges(layer, w, x)          # bfloat16 keeps all of them
    dot = next(e for e in ranges.entries if e.primitive == "dot_general")
    assert dot.dtype == "bfloat16"
    assert dot.flush_share == pytest.approx(2 / 4)
    assert dot.subnormal_share == pytest.approx(3 / 4)
    assert dot in ranges.underflows


def test_backward_underflow_says_a_loss_scale_matters():
    def loss(w, x):
        return 1e-9 * jnp.sum(jnp.tanh(x @ w))
    ranges = jamp.value_ranges(loss, _eye(3), _ones(2, 3), grad=True)
    backward = [e for e in ranges.underflows if e.backward_of]
    assert backward and backward[0].flush_share == 1.0
    assert "loss scale" in str(ranges)
    forward_only = jamp.value_ranges(loss, _eye(3), _ones(2, 3))
    assert not any(e.backward_of for e in forward_only.entries)


def test_loop_iterations_accumulate():
    def f(w, xs):
        def step(c, x):
            return c, x @ w
        return jax.lax.scan(step, 0.0, xs)[1]
    xs = _array(np.arange(1.0, 6.0).reshape(5, 1, 1) * np.ones((5, 1, 2)))
    dot = next(e for e in jamp.value_ranges(f, _eye(2), xs, policy=F16).entries
               if e.primitive == "dot_general")
    assert dot.max_abs == 5.0 and dot.nonzero == 10


def test_no_16_bit_equations_under_a_float32_policy():
    ranges = jamp.value_ranges(layer, _eye(2), _ones(1, 2),
                               policy=jamp.Policy(jnp.float32))
    assert ranges.entries == () and "none" in str(ranges)


def test_a_checked_program_is_traced_again_under_another_jax_trace_context():
    """The checked program is kept per function, policy and argument types, and per JAX trace
    context (matmul precision, x64, an enclosing region's state): a call under another context
    traces the function again instead of measuring the program traced under the first."""
    traced = []

    def f(w, x):
        traced.append(jax.config.jax_default_matmul_precision)
        return x @ w

    w, x = _eye(4), _ones(2, 4)
    jamp.value_ranges(f, w, x, policy=F16)
    jamp.value_ranges(f, w, x, policy=F16)
    assert len(traced) == 1  # kept
    with jax.default_matmul_precision("highest"):
        jamp.value_ranges(f, w, x, policy=F16)
    assert traced[1:] == ["highest"]


def test_a_program_with_a_prng_key_and_an_nnx_module_with_rng_state():
    """A typed key's outputs (``key<fry>``) have no numpy dtype: value_ranges raised "Cannot
    interpret 'key<fry>' as a data type" on any program with dropout; and with grad=True an NNX
    module's RNG counters (uint32) were handed to jax.grad, which refused them."""
    from flax import nnx

    def loss(w, x, key):
        keep = jax.random.bernoulli(jax.random.fold_in(key, 1), 0.9, x.shape)
        return jnp.mean((jnp.where(keep, x, 0) @ w) ** 2)

    w, x = _ones(8, 4), _ones(4, 8)
    ranges = jamp.value_ranges(loss, w, x, jax.random.key(0), grad=True)
    assert "dot_general" in {entry.primitive for entry in ranges.entries}

    class Dropped(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(3, 4, rngs=rngs)
            self.dropout = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.dropout(self.linear(x))

    model = Dropped(nnx.Rngs(0, dropout=1))
    before = snapshot(nnx.state(model))

    def mean_out(m, x):
        return jnp.mean(m(x))

    assert jamp.find_nonfinite(mean_out, model, _ones(4, 3), grad=True) is None
    ranges = jamp.value_ranges(mean_out, model, _ones(4, 3), grad=True)
    assert any(entry.backward_of for entry in ranges.entries)  # the backward pass, checked
    assert_unchanged(before, nnx.state(model))  # left as it was
    with pytest.raises(TypeError, match=r"got DiffState.*RNG counters get no gradient"):
        jamp.value_ranges(mean_out, model, _ones(4, 3), grad=nnx.DiffState(0, nnx.Param))


def test_equations_that_only_move_values_are_not_listed_with_a_range_of_zero():
    """transpose/squeeze/broadcast were listed with max_abs 0 and no nonzero values: they are
    never measured (their values are their operand's, listed under its own equation)."""
    def f(w, x):
        h = (x @ w).T                       # a bfloat16 transpose
        return jnp.sum(h[0] * 2.0)          # a slice, then a squeeze
    ranges = jamp.value_ranges(f, jnp.full((4, 4), 3.0), jnp.full((2, 4), 5.0))
    primitives = {e.primitive for e in ranges.entries}
    assert "dot_general" in primitives and "slice" in primitives
    assert not primitives & {"transpose", "squeeze", "broadcast_in_dim", "reshape"}
    assert all(e.max_abs > 0 and e.nonzero > 0 for e in ranges.entries)    # all values nonzero
