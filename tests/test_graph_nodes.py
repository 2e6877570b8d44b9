"""NNX modules as arguments: what the caller owns keeps its dtypes and values (issue 11, item 1)."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jamp
from tests.host_data import normal
from tests.host_data import ones as _ones
from tests.unchanged import assert_unchanged, snapshot

nnx = pytest.importorskip("flax.nnx")

F32, BF16 = np.dtype(jnp.float32), np.dtype(jnp.bfloat16)
CAST_INPUTS = [jamp.Policy(cast_inputs=True), jamp.Policy(jnp.float16, cast_inputs=True)]


def _name(policy):
    return f"{policy.compute_dtype.name}{'-cast_inputs' if policy.cast_inputs else ''}"


@pytest.mark.parametrize("policy", CAST_INPUTS, ids=_name)
def test_cast_inputs_leaves_the_callers_module_alone(policy):
    model = nnx.Linear(8, 8, rngs=nnx.Rngs(0))
    before = snapshot(nnx.state(model))
    out = jamp.autocast_transform(lambda m, x: m(x), policy)(model, _ones(2, 8))
    assert out.dtype == policy.compute_dtype
    assert model.kernel.get_value().dtype == F32
    assert_unchanged(before, nnx.state(model))


@pytest.mark.parametrize("policy", CAST_INPUTS, ids=_name)
def test_cast_inputs_leaves_a_split_state_alone(policy):
    model = nnx.Linear(8, 8, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    before = snapshot(state)
    fwd = jamp.autocast_transform(lambda s, x: nnx.merge(graphdef, s)(x), policy)
    fwd(state, _ones(2, 8))
    assert_unchanged(before, state)
    assert_unchanged(before, nnx.state(model))


class _Net(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(4, 4, rngs=rngs)
        self.bn = nnx.BatchNorm(4, rngs=rngs)

    def __call__(self, x):
        return self.bn(self.linear(x))


@pytest.mark.parametrize("policy", [jamp.Policy(), *CAST_INPUTS], ids=_name)
def test_updated_batch_stats_come_back_in_their_dtype_and_params_stay(policy):
    model = _Net(nnx.Rngs(0))
    params_before = snapshot(nnx.state(model, nnx.Param))
    mean_before = np.asarray(model.bn.mean.get_value())
    x = normal(1, (16, 4), mean=3.0)
    jamp.autocast_transform(lambda m, x: m(x), policy)(model, x)
    assert model.bn.mean.get_value().dtype == F32
    assert model.bn.var.get_value().dtype == F32
    assert not np.allclose(model.bn.mean.get_value(), mean_before)  # the update came back
    assert_unchanged(params_before, nnx.state(model, nnx.Param))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_split_states_differentiated_through_a_transformed_function(jit):
    # nnx.split's states hold Variables: under jax.grad jamp must not write them back when the
    # function assigned nothing (NNX refuses to mutate a Variable of an outer trace).
    model = _Net(nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    x = normal(1, (16, 4))

    def loss(params, rest, x):
        net = nnx.merge(graphdef, params, rest, copy=True)
        return jnp.mean(net(x) ** 2), nnx.state(net, nnx.BatchStat)

    grad_fn = jax.value_and_grad(jamp.autocast_transform(loss), has_aux=True)
    (value, stats), grads = (jax.jit(grad_fn) if jit else grad_fn)(params, rest, x)
    # (the reference in one compiled program: run eagerly, it compiles each of its operations)
    (want, want_stats), want_grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(
        params, rest, x)
    assert value.dtype == F32
    np.testing.assert_allclose(value, want, rtol=2e-2)
    for got, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        assert got.dtype == ref.dtype == F32
        np.testing.assert_allclose(got, ref, rtol=5e-2, atol=5e-3)
    assert not np.allclose(stats["bn"]["mean"].get_value(), 0.0)  # the statistics moved


class _Sowing(nnx.Module):
    """Creates a Variable during the call (``sow``), as ``nnx.MultiHeadAttention(...,
    sow_weights=True)`` does, and assigns a float32 one with ``[...] =``."""

    def __init__(self, rngs):
        self.linear = nnx.Linear(4, 4, rngs=rngs)
        self.bn = nnx.BatchNorm(4, rngs=rngs)
        self.last = nnx.Variable(jnp.zeros((2, 4)))

    def __call__(self, x):
        h = self.linear(x)  # 16-bit under any policy here
        self.last[...] = h
        y = self.bn(h)
        self.sow(nnx.Intermediate, "y", y)
        return y


@pytest.mark.parametrize("policy", [jamp.Policy(), *CAST_INPUTS], ids=_name)
def test_a_call_creating_a_variable_writes_back_in_the_callers_dtypes(policy):
    """A call that changed the state's structure wrote the program's whole state back: under
    cast_inputs the caller's float32 weights came back bfloat16-rounded (and training ran in
    pure bfloat16 from the first step), and under any policy an assigned float32 Variable came
    back 16-bit."""
    model = _Sowing(nnx.Rngs(0))
    kernel = np.asarray(model.linear.kernel.get_value())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # (flax 0.12: sow outside capture)
        out = jamp.autocast_transform(lambda m, x: m(x), policy)(model, _ones(2, 4))
    np.testing.assert_array_equal(model.linear.kernel.get_value(), kernel)  # not assigned
    assert model.linear.kernel.get_value().dtype == F32
    assert model.bn.mean.get_value().dtype == F32  # assigned: in the caller's dtype
    assert model.last.get_value().dtype == F32
    (sown,) = model.y.get_value()  # created: as the function made it
    assert sown.dtype == out.dtype


class _Cell(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(4, 4, rngs=rngs)
        self.h = nnx.Variable(jnp.zeros((2, 4)))  # float32 state the user made

    def __call__(self, x):
        self.h[...] = jnp.tanh(self.linear(x + self.h[...]))
        return self.h[...]


def _region_inside(cell, x):
    with jamp.autocast():
        return cell(x)


@pytest.mark.parametrize("form", ["region around nnx.jit", "region inside nnx.jit", "transform"])
def test_an_assigned_variables_dtype_by_where_the_region_is(form):
    """docs/reference/dtypes.md's Regions row: a region around an ``nnx.jit`` call rewrites the
    jitted callee whole, whose outputs include the state, so an assigned Variable comes back
    16-bit; a region inside the function, or the transform, keeps the Variable's dtype."""
    cell, x = _Cell(nnx.Rngs(0)), _ones(2, 4)
    if form == "region around nnx.jit":
        with jamp.autocast():
            nnx.jit(lambda m, x: m(x))(cell, x)
    elif form == "region inside nnx.jit":
        nnx.jit(_region_inside)(cell, x)
    else:
        jamp.autocast_transform(lambda m, x: m(x))(cell, x)
    expected = BF16 if form == "region around nnx.jit" else F32
    assert cell.h.get_value().dtype == expected


def _walked(tree):
    """Whether ``tree`` holds an NNX object, by a walk that stops at each one."""
    types = (nnx.Module, nnx.Object, nnx.Pytree, nnx.Variable)
    return any(
        isinstance(leaf, types)
        for leaf in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, types))
    )


def test_has_graph_nodes_answers_as_a_walk_over_every_node_for_repeated_structures():
    """The check made on every transformed call looks structures up instead of walking every
    node (issue 33): it answers as the walk does, for the same structures seen again, for
    arrays, tracers, modules, variables and an object that is no pytree."""
    from jamp.graph_nodes import has_graph_nodes

    class Plain(nnx.Module, pytree=False):
        def __init__(self):
            self.w = nnx.Param(jnp.ones(2))

    linear = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    trees = [
        ({"w": _ones(2), "b": [_ones(1), 3.0]}, {}),
        ({"w": _ones(2), "b": [_ones(1), 3.0]}, {}),  # (the same structure again)
        ((linear, _ones(2)), {}),
        ((nnx.state(linear), _ones(2)), {}),
        ((nnx.Param(_ones(2)),), {}),
        ((_ones(2),), {}),
        ((Plain(),), {}),  # (a leaf: the structure of the one before)
        (({"w": np.ones(2)}, None), {"k": 1}),
    ]
    for _ in range(2):
        for tree in trees:
            assert has_graph_nodes(tree) == _walked(tree), tree
    assert [has_graph_nodes(t) for t in trees] == [False, False, True, True, True, False, True, False]

    seen = []

    def traced(*leaves):  # tracers of plain arrays among the leaves
        seen.append(has_graph_nodes(((leaves, {"m": linear}), {})))
        seen.append(has_graph_nodes((leaves, {})))
        return leaves[0]

    jax.make_jaxpr(traced)(_ones(2), _ones(3))
    assert seen == [True, False]


def test_has_graph_nodes_with_static_data_that_cannot_be_hashed():
    from jamp.graph_nodes import has_graph_nodes

    @jax.tree_util.register_pytree_node_class
    class Holder:
        def __init__(self, value, meta):
            self.value, self.meta = value, meta

        def tree_flatten(self):
            return (self.value,), self.meta

        @classmethod
        def tree_unflatten(cls, meta, children):
            return cls(children[0], meta)

    unhashable = {"table": [1, 2]}
    assert not has_graph_nodes(((Holder(_ones(2), unhashable),), {}))
    assert has_graph_nodes(((Holder(nnx.Param(_ones(2)), unhashable),), {}))
