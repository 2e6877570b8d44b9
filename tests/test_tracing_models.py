"""tracing on real mixed-precision models: no false alarms, real divergences reported, exports of
Flax's own pytree nodes (``LogicallyPartitioned`` boxes, NNX states) round-trip."""
import functools
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

import jamp
import tracing
from tests.host_data import normal
from tests.test_tracing import recorded_tracer_warnings

KEY = jax.random.key(0)


class ResBlock(nn.Module):
    filters: int
    strides: tuple = (1, 1)

    @nn.compact
    def __call__(self, x):
        norm = functools.partial(nn.BatchNorm, use_running_average=True)
        y = nn.relu(norm()(nn.Conv(self.filters, (3, 3), self.strides, use_bias=False)(x)))
        y = norm()(nn.Conv(self.filters, (3, 3), use_bias=False)(y))
        if y.shape != x.shape:
            x = norm()(nn.Conv(self.filters, (1, 1), self.strides, use_bias=False)(x))
        return nn.relu(x + y)


class ResNet(nn.Module):
    """The Flax ImageNet example's ResNet, two blocks deep."""
    shape_branch: bool = False

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.BatchNorm(use_running_average=True)(nn.Conv(8, (3, 3))(x)))
        x = ResBlock(8)(x)
        if self.shape_branch and x.shape[0] > 2:  # a real divergence: structure follows a size
            x = x * 2
        x = ResBlock(16, (2, 2))(x)
        return nn.Dense(10)(jnp.mean(x, axis=(1, 2)))


class DecoderBlock(nn.Module):
    @nn.compact
    def __call__(self, x, mask):
        partitioned = functools.partial(nn.with_logical_partitioning,
                                        nn.initializers.xavier_uniform())
        y = nn.LayerNorm()(x)
        y = nn.MultiHeadDotProductAttention(2, kernel_init=partitioned(("embed", "kv")))(
            y, y, mask=mask)
        x = x + y
        y = nn.Dense(4 * x.shape[-1], kernel_init=partitioned(("embed", "mlp")))(nn.LayerNorm()(x))
        return x + nn.Dense(x.shape[-1], kernel_init=partitioned(("mlp", "embed")))(nn.gelu(y))


class TransformerLM(nn.Module):
    """A decoder-only LM like the lm1b example, params boxed with ``with_logical_partitioning``."""
    python_noise: bool = False

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(50, 16, embedding_init=nn.with_logical_partitioning(
            nn.initializers.normal(1.0), ("vocab", "embed")))
        x = embed(tokens) + self.param("pos", nn.initializers.normal(0.02), (32, 16))[
            :tokens.shape[1]]
        if self.python_noise:  # a real divergence: a number drawn in Python at trace time
            x = x * np.float32(np.random.uniform(1, 2))
        mask = nn.make_causal_mask(tokens)
        x = DecoderBlock()(x, mask)
        return jax.nn.log_softmax(embed.attend(nn.LayerNorm()(x)), axis=-1)


class NnxNet(nnx.Module):
    def __init__(self, rngs):
        self.conv = nnx.Conv(3, 8, (3, 3), rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.linear = nnx.Linear(8, 16, rngs=rngs)
        self.norm = nnx.LayerNorm(16, rngs=rngs)
        self.out = nnx.Linear(16, 10, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.bn(self.conv(x)))
        x = self.norm(self.linear(x.mean((1, 2))))
        return jax.nn.log_softmax(self.out(nnx.gelu(x)))


def bf16_mlp(params, x):
    """Hand-written bfloat16: bf16 weights and matmuls, float32 LayerNorm statistics and loss."""
    h = x.astype(jnp.bfloat16)
    for w, b in params["layers"]:
        h = jax.nn.gelu(h @ w + b).astype(jnp.float32)
        h = ((h - h.mean(-1, keepdims=True)) * jax.lax.rsqrt(h.var(-1, keepdims=True) + 1e-6))
        h = h.astype(jnp.bfloat16)
    logits = (h @ params["head"]).astype(jnp.float32)
    return jax.nn.log_softmax(logits), jnp.sum(logits ** 2)


def bf16_params(width=32, depth=3):
    keys = jax.random.split(KEY, depth + 1)
    return {"layers": [(jax.random.normal(k, (width, width), jnp.bfloat16) / width ** 0.5,
                        jnp.zeros((width,), jnp.bfloat16)) for k in keys[:-1]],
            "head": jax.random.normal(keys[-1], (width, 10), jnp.bfloat16)}


def images(batch):
    return normal(batch, (batch, 8, 8, 3))  # (tests/host_data.py: jax.random compiles per shape)


def tokens(batch, length):
    return jax.random.randint(jax.random.key(batch), (batch, length), 0, 50)


def resnet_case(**kw):
    model = ResNet(**kw)
    variables = model.init(KEY, images(2))
    return (jamp.autocast_transform(model.apply), (variables, images(4)),
            [(variables, images(2))])


def lm_case(**kw):
    model = TransformerLM(**kw)
    variables = model.init(KEY, tokens(2, 8))
    return (jamp.autocast_transform(model.apply), (variables, tokens(2, 8)),
            [(variables, tokens(3, 5))])


def nnx_case():
    net = NnxNet(nnx.Rngs(0))
    net.eval()
    return jamp.autocast_transform(lambda x: net(x)), (images(4),), [(images(2),)]


def bf16_case():
    params = bf16_params()
    return (bf16_mlp, (params, jax.random.normal(KEY, (8, 32))),
            [(params, jax.random.normal(KEY, (3, 32)))])


# Each model compiles dozens of eager ops at three batch sizes (5-15 s). Fast twins in
# test_tracing.py: test_autocast_functions_trace_check_and_show_their_casts (autocast) and
# test_float32_through_bfloat16_intermediates_does_not_warn (hand-written bfloat16).
@pytest.mark.parametrize("case", [pytest.param(case, marks=pytest.mark.slow)
                                  for case in (resnet_case, lm_case, nnx_case, bf16_case)],
                         ids=["autocast-resnet", "autocast-lm", "autocast-nnx", "bf16-mlp"])
def test_mixed_precision_models_trace_and_check_without_warnings(case):
    fn, example, checks = case()
    traced, warns = recorded_tracer_warnings(
        lambda: tracing.trace(fn, example, check_inputs=checks))
    assert warns == []
    chex.assert_trees_all_close(traced(*example), fn(*example), atol=0.1, rtol=0.05)


# fast twin: test_tracing.py::test_unrolled_python_loop_over_a_size_differs_and_points_at_the_line
@pytest.mark.slow
def test_a_shape_dependent_branch_in_the_resnet_is_still_reported():
    fn, example, checks = resnet_case(shape_branch=True)
    with pytest.raises(tracing.TracingCheckError, match="Graphs differed"):
        tracing.check_trace(fn, example, check_inputs=checks)


# fast twin: test_tracing.py::test_numpy_randomness_at_trace_time_is_a_differing_constant
@pytest.mark.slow
def test_a_python_random_number_in_the_lm_is_still_reported():
    # Without autocast: jamp.autocast_transform caches the trace of model.apply, so a number
    # drawn in Python inside it is drawn once (like a jax.jit-ed callee's), for every call.
    model = TransformerLM(python_noise=True)
    variables = model.init(KEY, tokens(2, 8))
    fn, example, checks = model.apply, (variables, tokens(2, 8)), [(variables, tokens(3, 5))]
    with pytest.raises(tracing.TracingCheckError, match="Constants differed"):
        tracing.check_trace(fn, example, check_inputs=checks)


@pytest.mark.slow  # fast twin: test_tracing.py::test_nondeterministic_callback_output_warns
def test_outputs_that_really_diverge_in_a_bf16_model_still_warn():
    params = bf16_params()
    noise = iter(np.random.default_rng(0).uniform(0.5, 1.5, 100).astype(np.float32))

    def noisy(params, x):  # a host callback returning a new number each call
        scale = jax.pure_callback(lambda: next(noise), jax.ShapeDtypeStruct((), jnp.float32))
        log_probs, loss = bf16_mlp(params, x)
        return log_probs, loss * scale

    _, warns = recorded_tracer_warnings(lambda: tracing.check_trace(
        noisy, (params, jax.random.normal(KEY, (8, 32)))))
    assert warns and all("Output nr 2." in w for w in warns)


# --- export of Flax's own pytree nodes ---

def lm_and_variables():
    model = TransformerLM()
    return model, model.init(KEY, tokens(2, 8))


@pytest.mark.slow  # fast twin: test_export_round_trips_a_logically_partitioned_dense_layer
def test_export_round_trips_logically_partitioned_params():
    model, variables = lm_and_variables()
    assert any(isinstance(leaf, nn.LogicallyPartitioned) for leaf in jax.tree.leaves(
        variables, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned)))
    loaded = tracing.load(tracing.trace(model.apply, (variables, tokens(2, 8)),
                                        check_trace=False).export())
    new = jax.tree.map(lambda v: v * 0.5, variables)
    chex.assert_trees_all_close(loaded(new, tokens(2, 8)), model.apply(new, tokens(2, 8)),
                                atol=1e-5)
    frozen = tracing.load(tracing.freeze(model, variables, tokens(2, 8)).export())
    chex.assert_trees_all_close(frozen(tokens(2, 8)), model.apply(variables, tokens(2, 8)),
                                atol=1e-5)


def test_export_round_trips_a_logically_partitioned_dense_layer():
    dense = nn.Dense(3, kernel_init=nn.with_logical_partitioning(
        nn.initializers.lecun_normal(), ("embed", "mlp")))
    x = jax.device_put(np.ones((2, 4), np.float32))  # (jnp.ones compiles)
    variables = jax.jit(dense.init)(KEY, x)  # one program: eagerly, one per operation
    assert isinstance(variables["params"]["kernel"], nn.LogicallyPartitioned)
    loaded = tracing.load(tracing.trace(dense.apply, (variables, x), check_trace=False).export())
    new = jax.tree.map(lambda v: v * 0.5, variables)
    chex.assert_trees_all_close(loaded(new, x), dense.apply(new, x), atol=1e-5)
    frozen = tracing.load(tracing.freeze(dense, variables, x).export())
    chex.assert_trees_all_close(frozen(x), dense.apply(variables, x), atol=1e-5)


def test_export_round_trips_nnx_states_and_frozen_nnx_models():
    net = NnxNet(nnx.Rngs(0))
    net.eval()
    graphdef, params, stats = nnx.split(net, nnx.Param, nnx.BatchStat)
    x = images(2)

    def call(params, stats, x):
        return nnx.merge(graphdef, params, stats)(x)

    loaded = tracing.load(tracing.trace(call, (params, stats, x), check_trace=False).export())
    scaled = jax.tree.map(lambda v: v * 0.9, params)
    chex.assert_trees_all_close(loaded(scaled, stats, x), call(scaled, stats, x), atol=1e-5)
    with pytest.raises(TypeError, match="structure"):
        loaded(stats, params, x)  # the Variable types are part of the structure
    frozen = tracing.load(tracing.freeze(net, None, x).export())
    chex.assert_trees_all_close(frozen(x), net(x), atol=1e-5)


def test_exports_with_flax_nodes_load_in_a_fresh_process(tmp_path):
    net = NnxNet(nnx.Rngs(0))
    net.eval()
    graphdef, state = nnx.split(net)
    blob = tracing.trace(lambda s, x: nnx.merge(graphdef, s)(x), (state, images(2)),
                         check_trace=False).export()
    (tmp_path / "nnx.bin").write_bytes(blob)
    script = (
        "import sys, tracing\n"
        f"blob = open({str(tmp_path / 'nnx.bin')!r}, 'rb').read()\n"
        "try:\n    tracing.load(blob)\nexcept ValueError as err:\n    print('refused:', err)\n"
        "from flax import nnx\n"
        "print(tracing.load(blob).exported.in_tree)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True).stdout
    assert "refused:" in out and "flax.nnx" in out  # flax not imported yet: nothing imported
    assert "Param" in out.splitlines()[-1]


def test_polymorphic_export_of_an_nnx_state_input_runs_in_a_fresh_process(tmp_path):
    """On jax 0.12 the call failed with a bare AssertionError: jax.export's shape solving
    rebuilt the inputs' pytree, whose Flax Variables cannot be rebuilt outside a trace."""
    model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    traced = tracing.trace(lambda s, x: nnx.merge(graphdef, s)(x), (state, jnp.ones((2, 4))))
    (tmp_path / "poly.bin").write_bytes(traced.export(polymorphic_shapes=(None, "b, 4")))
    script = (
        "import jax.numpy as jnp, numpy as np, tracing\n"
        "from flax import nnx\n"
        "model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))\n"
        f"served = tracing.load(open({str(tmp_path / 'poly.bin')!r}, 'rb').read())\n"
        "x = jnp.arange(12.0).reshape(3, 4)\n"
        "np.testing.assert_allclose(served(nnx.state(model), x), model(x), atol=1e-5)\n"
        "try:\n    served(nnx.state(model), jnp.ones((3, 5)))\n"
        "except ValueError as err:\n    print(err)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "inputs[1] has shape (3, 5)" in out.stdout
