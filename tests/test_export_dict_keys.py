"""Exports of builtin dicts whose keys are not all strings (jax.export writes string keys only):
keys come back exactly, types included; keys that cannot round-trip are refused by path."""
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import tracing
from tests.host_data import ones

# Built on the host and transferred: jnp.arange and jnp.ones compile programs of their own.
X = jax.device_put(np.arange(6, dtype=np.float32).reshape(2, 3))


class Stack(nnx.Module):
    """Layers in an ``nnx.List``, as the Gemma example keeps them: its state holds {0:, 1:}."""

    def __init__(self, rngs):
        self.layers = nnx.List([nnx.Linear(3, 3, rngs=rngs) for _ in range(2)])

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def key_types(tree):
    """(key, type name) of every builtin dict key in ``tree``, depth first."""
    found = []

    def walk(node):
        if type(node) is dict:
            for key, value in node.items():
                found.append((key, type(key).__name__))
                walk(value)
        elif isinstance(node, (list, tuple)):
            for value in node:
                walk(value)
    walk(tree)
    return found


def test_nnx_state_of_an_nnx_list_exports_as_an_input_and_as_an_output():
    model = Stack(nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    assert set(state["layers"]) == {0, 1}

    def run(state, x):
        return nnx.merge(graphdef, state)(x), state

    loaded = tracing.load(tracing.trace(run, (state, X)).export())
    out, state_out = loaded(state, X)
    chex.assert_trees_all_close(out, model(X), atol=1e-6)
    assert jax.tree.structure(state_out) == jax.tree.structure(state)
    assert isinstance(state_out, nnx.State) and set(state_out["layers"]) == {0, 1}
    chex.assert_trees_all_close(jax.tree.leaves(state_out), jax.tree.leaves(state))


def test_freezing_an_nnx_list_model_and_its_polymorphic_export():
    model = Stack(nnx.Rngs(0))
    served = tracing.load(tracing.freeze(model, None, X).export(polymorphic_shapes="b, 3"))
    x5 = ones(5, 3)
    chex.assert_trees_all_close(served(x5), model(x5), atol=1e-6)


@pytest.mark.parametrize("keys", [(0, 1, 10), (-1.5, 2.0), (False, True), (None,)],
                         ids=["int", "float", "bool", "None"])
def test_keys_round_trip_with_their_types(keys):
    tree = {"outer": {key: X + i for i, key in enumerate(keys)}}
    loaded = tracing.load(tracing.trace(lambda t: t, (tree,)).export())
    got = loaded(tree)
    assert key_types(got) == key_types(tree)
    chex.assert_trees_all_close(got, tree)


def test_int_and_string_keys_stay_apart():
    ints = {0: X, 1: X}
    loaded = tracing.load(tracing.trace(lambda d: {"0": d[0], 0: {"1": d[1]}}[0], (ints,))
                          .export())
    assert key_types(loaded(ints)) == [("1", "str")]
    with pytest.raises(TypeError, match=r"inputs\[0\]\['0'\]: expected a leaf at inputs\[0\]\[0\]"):
        loaded({"0": X, "1": X})  # the string "0" is not the int 0


def test_outputs_with_int_keys_come_back_as_dicts():
    def split_rows(x):
        return {i: {"row": x[i], "index": jnp.int32(i)} for i in range(x.shape[0])}

    loaded = tracing.load(tracing.trace(split_rows, (X,)).export())
    got = loaded(X)
    assert type(got) is dict and key_types(got)[0] == (0, "int")
    chex.assert_trees_all_close(got, split_rows(X))


@pytest.mark.parametrize("make, where, key", [
    (lambda x: ({(0, 1): x},), r"inputs\[0\]", r"\(0, 1\) \(a tuple\)"),
    (lambda x: ({"a": [{(0, 1): x}]},), r"inputs\[0\]\['a'\]\[0\]", r"\(0, 1\) \(a tuple\)"),
])
def test_keys_that_cannot_round_trip_are_refused_naming_the_input_dict(make, where, key):
    traced = tracing.trace(lambda tree: jax.tree.leaves(tree)[0] * 2, make(X))
    with pytest.raises(TypeError, match=rf"<lambda>\.export\(\): the dict at {where} has the key "
                                        rf"{key}, which an export cannot store"):
        traced.export()


class Tag:
    """An object key: hashable and ordered, but not plain data."""

    def __init__(self, n):
        self.n = n

    def __hash__(self):
        return self.n

    def __eq__(self, other):
        return isinstance(other, Tag) and other.n == self.n

    def __lt__(self, other):
        return self.n < other.n

    def __repr__(self):
        return f"Tag({self.n})"


def test_an_object_key_in_the_outputs_is_refused_naming_the_output_dict():
    traced = tracing.trace(lambda x: {"out": [{Tag(1): x}]}, (X,))
    with pytest.raises(TypeError, match=r"the dict at outputs\['out'\]\[0\] has the key Tag\(1\) "
                                        r"\(a Tag\)"):
        traced.export()


def test_the_blob_stays_a_jax_export_blob_and_loads_in_a_fresh_process(tmp_path):
    blob = tracing.trace(lambda d: {k: v * 2 for k, v in d.items()}, ({0: X, 7: X},)).export()
    exported = jax.export.deserialize(blob)  # the node is registered when tracing is imported
    assert "KeyedDict" in str(exported.in_tree)
    path = tmp_path / "keys.jaxexport"
    path.write_bytes(blob)
    code = ("import jax.numpy as jnp, tracing;"
            f"g = tracing.load(open({str(path)!r}, 'rb').read());"
            "x = jnp.arange(6.0).reshape(2, 3);"
            "out = g({0: x, 7: x});"
            "assert type(out) is dict and sorted(out) == [0, 7], out;"
            "assert float(out[7].sum()) == 30.0")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
