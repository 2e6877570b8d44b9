"""Dict order through freeze, export and load: the function sees its input and variable dicts in
the caller's order and its output dicts come back in its own order, as from ``tracing.trace``
(pytrees sort dict keys, and ``jax.export`` writes them sorted)."""
import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tracing
from tests.host_data import ones

TOL = dict(atol=1e-5, rtol=1e-5)


def dict_orders(tree):
    """The key order of every builtin dict in ``tree``, depth first."""
    if type(tree) is dict:
        return [list(tree)] + [o for v in tree.values() for o in dict_orders(v)]
    if isinstance(tree, (list, tuple)):
        return [o for v in tree for o in dict_orders(v)]
    return []


def ordered_fn(variables, feats):
    """Reads both dicts in their own order: sorted, the answer differs."""
    x = jnp.concatenate(list(feats.values()), -1)
    for layer in variables.values():
        x = jnp.tanh(x @ layer)
    return {"z": x, "a": [x * 2, {"y": x + 1, "b": x - 1}]}


# Built on the host and transferred: jnp.array and eager operations compile programs of their own.
VARIABLES = {
    "second": jax.device_put(np.array([[1.0, 2.0], [3.0, 4.0]], np.float32) / np.float32(5)),
    "first": jax.device_put(np.array([[1.0, -1.0], [0.5, 2.0]], np.float32)),
}
FEATS = {"z": jax.device_put(np.array([[1.0]], np.float32)),
         "a": jax.device_put(np.array([[3.0]], np.float32))}


def test_freeze_sees_input_and_variable_dicts_in_the_callers_order():
    want = ordered_fn(VARIABLES, FEATS)
    sorted_keys = lambda d: dict(sorted(d.items()))
    differs = ordered_fn(sorted_keys(VARIABLES), sorted_keys(FEATS))
    assert not jnp.allclose(want["z"], differs["z"])  # the test can tell the orders apart
    frozen = tracing.freeze(ordered_fn, VARIABLES, FEATS)
    got = frozen(FEATS)
    chex.assert_trees_all_close(got, want, **TOL)
    assert dict_orders(got) == dict_orders(want)
    # a call with the same keys in another order flattens the same
    chex.assert_trees_all_close(frozen(sorted_keys(FEATS)), want, **TOL)


@pytest.mark.parametrize("polymorphic", [None, "b, ..."])
@pytest.mark.parametrize("make", ["trace", "freeze"])
def test_export_and_load_keep_the_output_dicts_order(make, polymorphic):
    if make == "trace":
        program = tracing.trace(ordered_fn, (VARIABLES, FEATS))
        args = (VARIABLES, FEATS)
    else:
        program = tracing.freeze(ordered_fn, VARIABLES, FEATS)
        args = (FEATS,)
    shapes = polymorphic if make == "freeze" or polymorphic is None else (None, polymorphic)
    loaded = tracing.load(program.export(polymorphic_shapes=shapes))
    want = ordered_fn(VARIABLES, FEATS)
    got = loaded(*args)
    chex.assert_trees_all_close(got, want, **TOL)
    assert dict_orders(got) == dict_orders(want) == [["z", "a"], ["y", "b"]]


def test_linen_model_outputs_keep_their_order_frozen_and_loaded():
    class Heads(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(2)(x)
            return {"z": h, "a": h * 2, "m": {"y": h, "b": h}}

    model, x = Heads(), ones(2, 3)
    variables = jax.jit(model.init)(jax.random.key(0), x)  # (eagerly: a program per operation)
    want = model.apply(variables, x)
    frozen = tracing.freeze(model, variables, x)
    for got in (frozen(x), tracing.load(frozen.export())(x)):
        chex.assert_trees_all_close(got, want, **TOL)
        assert dict_orders(got) == dict_orders(want)


def test_a_blob_stays_a_jax_export_and_blobs_without_the_order_still_load():
    """The order is kept by the pytree nodes jax.export stores (``jax.export.deserialize`` calls
    it); a blob that does not record it (made before it was kept) loads with the values right."""
    program = tracing.trace(ordered_fn, (VARIABLES, FEATS))
    want = ordered_fn(VARIABLES, FEATS)
    exported = jax.export.deserialize(bytearray(program.export()))
    chex.assert_trees_all_close(
        jax.tree.leaves(exported.call(VARIABLES, FEATS)), jax.tree.leaves(
            [want["z"], want["a"][0], want["a"][1]["y"], want["a"][1]["b"]]), **TOL)
    unordered = tracing.export.export_program(
        program.jaxpr, program.signature.specs(), program.out_tree, "ordered_fn"
    )
    got = tracing.load(unordered)(VARIABLES, FEATS)
    chex.assert_trees_all_close(got, want, **TOL)
    assert dict_orders(got) == [["a", "z"], ["b", "y"]]
