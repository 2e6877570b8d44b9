"""A scatter-add into a 16-bit buffer (``jax.ops.segment_sum`` of a GNN's messages, ``.at[i].add``)
accumulates repeated indices in float32 and rounds once: the buffer keeps its dtype, the sum
keeps its value. Summed in 16 bits, 4096 messages into one node stalled at 256."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jamp
from tests.hypothesis_profiles import examples

# Test data is cast on the host and transferred: an eager cast compiles a program per shape.
RNG = np.random.default_rng(0)
MESSAGES = jax.device_put(RNG.uniform(0.0, 1.0, (4096, 8)).astype(np.float32))
W = jax.device_put((RNG.uniform(0.0, 1.0, (8, 1)) / 2).astype(np.float32))
INTO_NODE_0 = np.zeros(4096, np.int32)


def segment(m, w):
    return jax.ops.segment_sum(m @ w, INTO_NODE_0, num_segments=2)


def into_16_bit_buffer(m, w):  # the buffer made 16-bit by the policy (a matmul's output)
    return (m[:2] @ w).at[INTO_NODE_0].add(m @ w)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("form", ["transform", "region", "jitted region"])
@pytest.mark.parametrize("fn", [segment, into_16_bit_buffer], ids=lambda f: f.__name__)
def test_repeated_indices_sum_to_the_float32_value(fn, form, dtype):
    if form == "transform":
        out = jamp.autocast_transform(fn, dtype)(MESSAGES, W)
    else:
        with jamp.autocast(dtype=dtype):
            out = (jax.jit(fn) if form == "jitted region" else fn)(MESSAGES, W)
    expected = jax.jit(fn)(MESSAGES, W)  # float32
    np.testing.assert_allclose(np.asarray(out, np.float32), expected, rtol=1e-2)
    if fn is into_16_bit_buffer or form == "region":
        assert out.dtype == dtype  # the buffer keeps its dtype


def test_an_accumulated_scatter_add_is_differentiable():
    grad = jax.grad(lambda w: jamp.autocast_transform(into_16_bit_buffer)(MESSAGES, w).sum()
                    .astype(jnp.float32))(W)
    expected = jax.jit(jax.grad(lambda w: into_16_bit_buffer(MESSAGES, w).sum()))(W)
    assert grad.dtype == jnp.float32
    np.testing.assert_allclose(grad, expected, rtol=2e-2)


@settings(max_examples=examples(12), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 300), segments=st.integers(1, 6), seed=st.integers(0, 2**16),
       dtype=st.sampled_from([jnp.bfloat16, jnp.float16]), form=st.sampled_from(["transform", "region"]))
def test_property_a_16_bit_scatter_add_rounds_once(n, segments, seed, dtype, form):
    """For any indices, a scatter-add into a 16-bit buffer equals the float32 sum of the same
    16-bit updates, rounded once into the buffer's dtype: repeated indices round no more."""
    rng = np.random.default_rng(seed)
    host_updates = rng.uniform(0.0, 1.0, (n,)).astype(dtype)
    updates = jax.device_put(host_updates)
    indices = jax.device_put(rng.integers(0, segments, n).astype(np.int32))

    def scatter(u, idx):
        return jnp.zeros(segments, u.dtype).at[idx].add(u)

    if form == "transform":
        out = jamp.autocast_transform(scatter, dtype)(updates, indices)
    else:
        with jamp.autocast(dtype=dtype):
            out = scatter(updates, indices)
    expected = scatter(jax.device_put(host_updates.astype(np.float32)), indices).astype(dtype)
    assert out.dtype == dtype
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(expected, np.float32))


def test_a_disabled_region_or_a_policy_without_the_rule_adds_as_traced():
    buffer_dtype_sum = (jnp.zeros(1, jnp.bfloat16).at[INTO_NODE_0[:300]]
                        .add(jnp.ones(300, jnp.bfloat16)))  # 256: bfloat16 stalls there

    def disabled(u):
        with jamp.autocast(enabled=False):
            return jnp.zeros(1, jnp.bfloat16).at[INTO_NODE_0[:300]].add(u)

    u = jnp.ones(300, jnp.bfloat16)
    assert float(jamp.autocast_transform(disabled)(u)[0]) == float(buffer_dtype_sum[0]) == 256.0
    not_promoted = jamp.Policy(promote=jamp.policy.PROMOTE - {"scatter-add"})
    added = jamp.autocast_transform(lambda u: jnp.zeros(1, u.dtype).at[INTO_NODE_0[:300]].add(u),
                                    not_promoted)(u)
    assert float(added[0]) == 256.0
    assert float(jamp.autocast_transform(lambda u: jnp.zeros(1, u.dtype).at[
        INTO_NODE_0[:300]].add(u))(u)[0]) == 300.0  # (the default: accumulated in float32)
