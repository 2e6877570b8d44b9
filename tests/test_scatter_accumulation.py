"""A scatter-add into a 16-bit buffer (``jax.ops.segment_sum`` of a GNN's messages, ``.at[i].add``)
accumulates repeated indices in float32 and rounds once: the buffer keeps its dtype, the sum
keeps its value. Summed in 16 bits, 4096 messages into one node stalled at 256."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jamp

RNG = np.random.default_rng(0)
MESSAGES = jnp.asarray(RNG.uniform(0.0, 1.0, (4096, 8)), jnp.float32)
W = jnp.asarray(RNG.uniform(0.0, 1.0, (8, 1)) / 2, jnp.float32)
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
    expected = jax.grad(lambda w: into_16_bit_buffer(MESSAGES, w).sum())(W)
    assert grad.dtype == jnp.float32
    np.testing.assert_allclose(grad, expected, rtol=2e-2)
