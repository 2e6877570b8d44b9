"""Snapshots of what a caller owns (arrays, NNX state, PRNG keys), to assert a jamp call left it
as it was: shared by tests/test_inputs_unchanged.py, test_graph_nodes.py and test_ranges.py."""
import jax
import numpy as np


def _record(x):
    """(type, dtype, a copy of the value); PRNG keys (NNX's Rngs) by their key data."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return type(x), str(x.dtype), np.array(jax.random.key_data(x), copy=True)
    return type(x), str(x.dtype), np.array(x, copy=True)


def snapshot(tree):
    return [_record(x) for x in jax.tree.leaves(tree)]


def assert_unchanged(before, tree):
    after = snapshot(tree)
    assert len(after) == len(before)
    for (kind, dtype, value), (kind_now, dtype_now, value_now) in zip(before, after):
        assert (kind_now, dtype_now) == (kind, dtype)
        np.testing.assert_array_equal(value_now, value)
