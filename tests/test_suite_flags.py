"""The XLA flags tests/conftest.py sets to compile faster must not change what programs compute.

jaxlib 0.10.2 with both ``--xla_backend_optimization_level=0`` and
``--xla_cpu_use_fusion_emitters=false`` miscompiles the backward pass of a bfloat16 convolution
followed by a maximum, when it is compiled as its own program (``jax.grad`` of a ``jax.jit``
function): the gradient came out 60% off (found by the region-vs-transform property of
tests/test_properties.py). The suite uses one of the two switches; this program is the check.
"""
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def conv_then_maximum(x, w):
    kernel = (w.reshape(-1)[:48].reshape(4, 4, 3) * 0.5).astype(jnp.bfloat16)
    h = lax.conv_general_dilated(x[None].astype(jnp.bfloat16), kernel, (1,), "SAME",
                                 dimension_numbers=("NCH", "OIH", "NCH"))[0]
    h = h.astype(jnp.float32)
    h = h + 0.1 * jnp.sum(h, axis=0, keepdims=True)
    return jnp.maximum(h, x)


def test_the_suites_compile_flags_compute_a_bf16_conv_backward_pass_correctly():
    x = jax.random.normal(jax.random.PRNGKey(0), (4, 8)) * 0.5
    w = jax.random.normal(jax.random.PRNGKey(1), (8, 8)) * 0.5
    backward_alone = jax.grad(lambda w: jnp.sum(jax.jit(conv_then_maximum)(x, w)))(w)
    in_one_program = jax.jit(jax.grad(lambda w: jnp.sum(conv_then_maximum(x, w))))(w)
    np.testing.assert_allclose(backward_alone, in_one_program, rtol=1e-6, atol=1e-6,
                               err_msg=f"XLA_FLAGS={os.environ.get('XLA_FLAGS')!r}")
