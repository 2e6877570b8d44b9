"""``Policy(cast_inputs=True)`` and a Flax model's running statistics: linen's ``batch_stats``
collection and NNX ``BatchStat`` variables are read in their own dtype, as Flax's ``dtype=``
layers read them, so BatchNorm's moving average is the float32 program's."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jamp

LEAN = jamp.Policy(cast_inputs=True)
# A running mean of 10.07 met by a batch of mean 10: 0.99 * 10.07 + 0.01 * 10 = 10.0693 in
# float32; read in bfloat16 (10.0625, and 0.99 becomes 0.98828125) it was 10.045.
RUNNING, BATCH = 10.07, np.full((4, 2), 10.0, np.float32)


class LinenNorm(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.BatchNorm(use_running_average=False, momentum=0.99)(x)


def test_linen_batch_stats_update_as_in_float32():
    model = LinenNorm()
    variables = model.init(jax.random.PRNGKey(0), BATCH)
    variables = {**variables, "batch_stats": jax.tree.map(
        lambda s: jnp.full_like(s, RUNNING), variables["batch_stats"])}

    def step(variables, x):
        y, updates = model.apply(variables, x, mutable=["batch_stats"])
        return y, updates["batch_stats"]

    _, stats = jax.jit(jamp.autocast_transform(step, LEAN))(variables, BATCH)
    _, expected = step(variables, BATCH)
    mean = stats["BatchNorm_0"]["mean"]
    assert mean.dtype == jnp.float32
    np.testing.assert_allclose(mean, expected["BatchNorm_0"]["mean"], rtol=1e-6)


def test_linen_parameters_and_inputs_are_still_cast():
    """Only the statistics keep their dtype: the parameters beside them and the batch are
    converted to bfloat16 on entry."""
    model = LinenNorm()
    variables = model.init(jax.random.PRNGKey(0), BATCH)
    step = jamp.autocast_transform(
        lambda v, x: model.apply(v, x, mutable=["batch_stats"]), LEAN)
    closed = jax.make_jaxpr(step)(variables, BATCH)
    inputs = jax.tree_util.tree_flatten_with_path((variables, BATCH))[0]
    names = {var: jax.tree_util.keystr(path) for var, (path, _) in zip(closed.jaxpr.invars, inputs)}
    converted = {names[e.invars[0]] for e in closed.jaxpr.eqns
                 if e.primitive.name == "convert_element_type" and e.invars[0] in names}
    assert converted == {"[0]['params']['BatchNorm_0']['bias']",
                         "[0]['params']['BatchNorm_0']['scale']", "[1]"}


class NNXNorm(nnx.Module):
    def __init__(self):
        self.norm = nnx.BatchNorm(2, momentum=0.99, rngs=nnx.Rngs(0))

    def __call__(self, x):
        return self.norm(x)


@pytest.mark.parametrize("form", ["module", "split state"])
def test_nnx_batch_stats_update_as_in_float32(form):
    model, expected = NNXNorm(), NNXNorm()
    for m in (model, expected):
        m.norm.mean[...] = jnp.full((2,), RUNNING)
    expected(BATCH)
    if form == "module":
        jamp.autocast_transform(lambda m, x: m(x), LEAN)(model, BATCH)
        mean = model.norm.mean[...]
    else:  # the state passed as nnx.split gives it, its Variables' types included
        graphdef, state = nnx.split(model)

        def step(state, x):
            m = nnx.merge(graphdef, state)
            m(x)
            return nnx.state(m, nnx.BatchStat)

        mean = jamp.autocast_transform(step, LEAN)(state, BATCH)["norm"]["mean"][...]
    assert mean.dtype == jnp.float32
    np.testing.assert_allclose(mean, expected.norm.mean[...], rtol=1e-6)


def test_explain_reports_the_statistics_kept_as_the_transform_keeps_them():
    model = LinenNorm()
    variables = model.init(jax.random.PRNGKey(0), BATCH)
    report = jamp.explain(lambda v, x: model.apply(v, x, mutable=["batch_stats"]), variables,
                          BATCH, policy=LEAN)
    assert report.casts == 3  # the scale, the bias and the batch; not the mean and variance
