"""The XLA flags tests/conftest.py sets for the full suite (and CI) to compile faster must not
change what programs compute.

jaxlib 0.10.2 with both ``--xla_backend_optimization_level=0`` and
``--xla_cpu_use_fusion_emitters=false`` can compute a value XLA duplicates into two fusions
differently in the last bit: below, the mask of ``maximum``'s gradient (``q == max(q, x)``) came
out false where it is true, and the gradient of a bfloat16 convolution followed by a maximum,
as its own program (``jax.grad`` of a ``jax.jit`` function), 60% off (found by
tests/test_properties.py).
The full suite compiles with one of the two switches; this program is the check. Only the fast
loop uses both (speed, no verdict), so this test is marked slow: it checks the full suite's flags.
"""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax


def conv_then_maximum(x, w):
    kernel = (w.reshape(-1)[:48].reshape(4, 4, 3) * 0.5).astype(jnp.bfloat16)
    h = lax.conv_general_dilated(x[None].astype(jnp.bfloat16), kernel, (1,), "SAME",
                                 dimension_numbers=("NCH", "OIH", "NCH"))[0]
    h = h.astype(jnp.float32)
    h = h + 0.1 * jnp.sum(h, axis=0, keepdims=True)
    return jnp.maximum(h, x)


# the full suite's flags only: the fast loop compiles with both switches (tests/conftest.py)
@pytest.mark.slow
def test_the_suites_compile_flags_compute_a_bf16_conv_backward_pass_correctly():
    x = jax.random.normal(jax.random.PRNGKey(0), (4, 8)) * 0.5
    w = jax.random.normal(jax.random.PRNGKey(1), (8, 8)) * 0.5
    backward_alone = jax.grad(lambda w: jnp.sum(jax.jit(conv_then_maximum)(x, w)))(w)
    in_one_program = jax.jit(jax.grad(lambda w: jnp.sum(conv_then_maximum(x, w))))(w)
    np.testing.assert_allclose(backward_alone, in_one_program, rtol=1e-6, atol=1e-6,
                               err_msg=f"XLA_FLAGS={os.environ.get('XLA_FLAGS')!r}")
