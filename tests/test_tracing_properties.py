"""Property-based tests of ``tracing``: random pytrees and random shape-generic programs.

(1) For random nested input pytrees (dicts with arbitrary keys in arbitrary order, lists, tuples,
namedtuples, None leaves, mixed dtypes), a function returning a restructured pytree traces,
checks without complaint, runs, exports and loads back with equal values and structure, and its
output dicts keep the function's key order. (2) A random chain of row-wise ops traced at one
batch size passes ``check_trace`` at any other batch size, and the traced program agrees with
the function. (3) The same chain with a Python loop over the batch size fails the graph check
whenever the check batch differs.
"""
from __future__ import annotations

import collections
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tracing
from tests.hypothesis_profiles import examples

Pair = collections.namedtuple("Pair", "left right")
DTYPES = (np.float32, np.int32, jnp.bfloat16)
KEYS = st.text(alphabet="abcdxyz", min_size=1, max_size=3)


def leaves_strategy():
    shape = st.lists(st.integers(1, 3), min_size=0, max_size=2).map(tuple)
    return st.builds(lambda s, d, seed: np.asarray(
        np.random.default_rng(seed).normal(size=s) * 3).astype(d), shape, st.sampled_from(DTYPES),
        st.integers(0, 2**16))


def trees():
    return st.recursive(
        st.one_of(leaves_strategy(), st.none()),
        lambda children: st.one_of(
            st.lists(children, max_size=3),
            st.lists(children, max_size=3).map(tuple),
            st.builds(Pair, children, children),
            st.dictionaries(KEYS, children, max_size=3)),
        max_leaves=6)


def restructure(tree):
    """A function of ``tree``: every leaf changed, containers reshaped, dict order reversed."""
    if isinstance(tree, dict):
        return {key: restructure(tree[key]) for key in reversed(list(tree))}
    if isinstance(tree, Pair):
        return Pair(restructure(tree.right), restructure(tree.left))
    if isinstance(tree, (list, tuple)):
        return type(tree)(restructure(x) for x in tree)
    return None if tree is None else tree * 2 + 1


def dict_orders(tree):
    if isinstance(tree, dict):
        return [list(tree)] + [o for v in tree.values() for o in dict_orders(v)]
    if isinstance(tree, (list, tuple)):
        return [o for v in tree for o in dict_orders(v)]
    return []


@settings(max_examples=examples(10), deadline=None)
@given(trees(), trees())
def test_random_pytrees_trace_export_and_load(first, second):
    def fn(a, b):
        return {"b": restructure(b), "a": [restructure(a)]}

    with warnings.catch_warnings():
        warnings.simplefilter("error", tracing.TracerWarning)
        traced = tracing.trace(fn, (first, second))
    want = jax.tree.map(jnp.asarray, fn(first, second))
    got = traced(first, second)
    chex.assert_trees_all_equal(got, want)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    assert dict_orders(got) == dict_orders(fn(first, second))
    loaded = tracing.load(traced.export())(first, second)
    chex.assert_trees_all_equal(loaded, want)
    assert jax.tree.structure(loaded) == jax.tree.structure(want)


ROW_OPS = {
    "tanh": jnp.tanh,
    "softmax": lambda h: jax.nn.softmax(h, axis=-1),
    "center": lambda h: h - jnp.mean(h, axis=-1, keepdims=True),
    "matmul": lambda h: h @ jnp.linspace(-1.0, 1.0, 16).reshape(4, 4),
    "batch_norm": lambda h: (h - jnp.mean(h, axis=0)) / (jnp.std(h, axis=0) + 1.0),
    "cumsum": lambda h: jnp.cumsum(h, axis=0) / h.shape[0],
    "pad_slice": lambda h: jnp.pad(h, ((1, 1), (0, 0)))[1:-1] * 2.0,
    "scan": lambda h: jax.lax.scan(lambda c, r: (c + r, c * r), jnp.zeros(4), h)[1],
}


def chain(ops):
    def fn(x):
        for op in ops:
            x = ROW_OPS[op](x)
        return x
    return fn


@settings(max_examples=examples(8), deadline=None)
@given(st.lists(st.sampled_from(sorted(ROW_OPS)), min_size=1, max_size=5),
       st.integers(1, 6), st.integers(1, 6))
def test_shape_generic_chains_pass_at_any_batch_size(ops, batch, check_batch):
    fn = chain(ops)
    x = jnp.linspace(-2.0, 2.0, batch * 4).reshape(batch, 4)
    other = jnp.linspace(-1.0, 3.0, check_batch * 4).reshape(check_batch, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tracing.TracerWarning)
        traced = tracing.trace(fn, (x,), check_inputs=[(other,)])
    chex.assert_trees_all_close(traced(x), fn(x), rtol=1e-5, atol=1e-5)


@settings(max_examples=examples(6), deadline=None)
@given(st.lists(st.sampled_from(sorted(ROW_OPS)), min_size=1, max_size=4),
       st.integers(1, 5), st.integers(1, 5))
def test_loops_over_the_batch_size_fail_when_the_size_changes(ops, batch, check_batch):
    body = chain(ops)

    def fn(x):
        for _ in range(x.shape[0]):
            x = body(x)
        return x

    x = jnp.linspace(-2.0, 2.0, batch * 4).reshape(batch, 4) / 10
    other = jnp.ones((check_batch, 4)) / 10
    if batch == check_batch:
        tracing.check_trace(fn, (x,), check_inputs=[(other,)])
    else:
        with pytest.raises(tracing.TracingCheckError, match="Graphs differed"):
            tracing.check_trace(fn, (x,), check_inputs=[(other,)])


# (4) The auxiliary data of custom pytree nodes (what Flax's boxes and NNX Variables carry)
# survives export's plain-data encoding exactly, tuples and lists told apart.
PLAIN = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.tuples(inner, inner) | st.lists(inner, max_size=3)
    | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=12)


@settings(max_examples=60, deadline=None)
@given(PLAIN)
def test_plain_auxiliary_data_round_trips_through_the_export_encoding(aux):
    from tracing import serialization

    decoded = serialization.decode_aux(serialization.encode_aux(Pair, aux))
    assert decoded == aux and repr(decoded) == repr(aux)  # repr: tuple stays tuple, True stays True
