"""Test data drawn with numpy on the host and handed over with ``jax.device_put``, which compiles
nothing, where ``jax.random``, eager ``jnp`` operations and ``jnp.asarray`` of a numpy array
compile a program for each shape (docs/development.md). Each returns a jax.Array (float32
unless a dtype is given)."""
import jax
import numpy as np


def normal(seed, shape, scale=1.0, mean=0.0):
    draw = np.random.default_rng(seed).standard_normal(shape, np.float32)
    return jax.device_put((scale * draw + mean).astype(np.float32))


def uniform(seed, shape, low=0.0, high=1.0):
    return jax.device_put(np.random.default_rng(seed).uniform(low, high, shape).astype(np.float32))


def ones(*shape, dtype=np.float32):
    return jax.device_put(np.ones(shape, dtype))


def linspace(start, stop, *shape):
    """``start`` to ``stop`` evenly over the elements of ``shape``, in row-major order."""
    return jax.device_put(np.linspace(start, stop, np.prod(shape), dtype=np.float32).reshape(shape))
