"""A jamp call never changes anything the caller owns (DESIGN.md conventions; issue 11).

Property: under every policy, eager and jitted, the dtypes and values of every input leaf, numpy
or JAX, and of every NNX Variable are what they were before the call. The only exception is state
the function legitimately updates (BatchNorm statistics in training mode), which keeps its dtype.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jamp
from tests.hypothesis_profiles import examples
from tests.unchanged import assert_unchanged, snapshot

nnx = pytest.importorskip("flax.nnx")

POLICIES = {
    "bf16": jamp.Policy(),
    "f16": jamp.Policy(jnp.float16),
    "f32": jamp.Policy(jnp.float32),
    "bf16-cast_inputs": jamp.Policy(cast_inputs=True),
    "f16-cast_inputs": jamp.Policy(jnp.float16, cast_inputs=True),
    "output_f32": jamp.Policy(output_dtype=jnp.float32),
    "accumulate_f32": jamp.Policy(accumulate_dtype=jnp.float32, cast_inputs=True),
}
DTYPES = [np.float32, jnp.bfloat16, np.float16, np.int32, np.bool_]


def _program(tree):
    """Matmuls, fp32-table ops and passthroughs over whatever the tree holds."""
    outs = {}
    for name, x in tree.items():
        if jnp.issubdtype(x.dtype, jnp.floating):
            outs[name] = (jnp.tanh(x @ x.T), jnp.sum(jnp.exp(x) ** 2), x)
        elif jnp.issubdtype(x.dtype, jnp.integer):
            outs[name] = (x * 2, x)
        else:
            outs[name] = (jnp.logical_not(x), x)
    return outs


def _leaf(draw, i):
    dtype = draw(st.sampled_from(DTYPES))
    values = np.random.default_rng(i).normal(size=(3, 3)) * 4
    array = (values > 0) if dtype is np.bool_ else values.astype(dtype)
    return np.asarray(array) if draw(st.booleans()) else jnp.asarray(array)


@st.composite
def _trees(draw):
    return {f"x{i}": _leaf(draw, i) for i in range(draw(st.integers(1, 4)))}


@settings(max_examples=examples(15), deadline=None)
@given(tree=_trees(), policy=st.sampled_from(sorted(POLICIES)), jit=st.booleans())
def test_input_pytrees_keep_their_dtypes_and_values(tree, policy, jit):
    fn = jamp.autocast_transform(_program, POLICIES[policy])
    before = snapshot(tree)
    (jax.jit(fn) if jit else fn)(tree)
    assert_unchanged(before, tree)
    floats = {k: v for k, v in tree.items() if jnp.issubdtype(v.dtype, jnp.floating)}
    if floats:  # and through differentiation
        loss = lambda t: sum(jnp.sum(o[1]).astype(jnp.float32) for o in fn(t).values())
        jax.grad(loss)(floats)
        assert_unchanged(before, tree)


class _Net(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(4, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)
        self.head = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        return self.head(self.dropout(nnx.relu(self.bn(self.linear(x)))))


# (numpy + device_put: no compile at import, in every test process)
X = jax.device_put(np.random.default_rng(3).standard_normal((6, 4), np.float32) + 2.0)


def _nnx_call(model, policy, how):
    fn = jamp.autocast_transform(lambda m, x: m(x), POLICIES[policy])
    if how == "eager":
        return fn(model, X)
    if how == "nnx.jit":
        return nnx.jit(fn)(model, X)
    graphdef, state = nnx.split(model)  # the split state passed as a pytree
    return jamp.autocast_transform(lambda s, x: nnx.merge(graphdef, s)(x),
                                   POLICIES[policy])(state, X)


@pytest.mark.parametrize("how", ["eager", "nnx.jit", "split"])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_nnx_modules_keep_their_parameters(policy, how):
    model = _Net(nnx.Rngs(0))
    params = snapshot(nnx.state(model, nnx.Param))
    stats = nnx.state(model, nnx.BatchStat)
    stat_dtypes = [str(x.dtype) for x in jax.tree.leaves(stats)]
    _nnx_call(model, policy, how)
    assert_unchanged(params, nnx.state(model, nnx.Param))
    # Statistics are legitimately updated in training mode, in their own dtype.
    assert [str(x.dtype) for x in jax.tree.leaves(nnx.state(model, nnx.BatchStat))] == stat_dtypes
    model.eval()  # in evaluation mode nothing at all changes
    everything = snapshot(nnx.state(model))
    _nnx_call(model, policy, how)
    assert_unchanged(everything, nnx.state(model))
