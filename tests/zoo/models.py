"""The zoo: one small adapter per model, written as each library's users write their code.

Each adapter builds a :class:`~tests.zoo.harness.ZooCase`: the user's forward function with its
arguments (modules, variables, inputs), and the function to differentiate with respect to the
parameters. Configurations are shrunk to run on a CPU in seconds; the layer structure is the
library's own.
"""
from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "jax")  # Keras reads it once, at import

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .harness import FreezeCase, ZooCase, ZooModel

KEY = jax.random.key(0)


def _keys(n):
    return jax.random.split(jax.random.key(42), n)


# ----------------------------------------------------------------------------------- Flax linen

def flax_resnet() -> ZooCase:
    """examples/imagenet ResNet V1.5 with two stages of one block (the second strided, with its
    projection) at 8 filters, in training mode (batch statistics). Its BatchNorm names the
    ``batch`` axis, as the example's pmapped train step does; a vmap over a one-device axis
    provides it."""
    from .flax_examples import imagenet_models as m
    model = m.ResNet(stage_sizes=[1, 1], block_cls=m.ResNetBlock, num_classes=10, num_filters=8)
    x = jax.random.normal(_keys(1)[0], (1, 4, 16, 16, 3))  # (devices, batch, H, W, C)
    variables = model.init(KEY, x[0], train=False)

    def step(variables, x):
        return model.apply(variables, x, train=True, mutable=["batch_stats"])
    forward = jax.vmap(step, in_axes=(None, 0), axis_name="batch")

    def loss_fn(params, batch_stats, x):
        logits, _ = forward({"params": params, "batch_stats": batch_stats}, x)
        return logits
    inference = FreezeCase(model, variables, (x[0],), (0,), {"train": False})
    return ZooCase(forward, (variables, x), loss_fn,
                   (variables["params"], variables["batch_stats"], x), depth=2 * 6,
                   inference=inference)


def flax_lm1b() -> ZooCase:
    """examples/lm1b TransformerLM, 2 layers, width 32, dropout on (training)."""
    import flax.linen as nn
    from .flax_examples import lm1b_models as m
    config = m.TransformerConfig(vocab_size=64, output_vocab_size=64, emb_dim=32, num_heads=4,
                                 num_layers=2, qkv_dim=32, mlp_dim=64, max_len=32,
                                 dropout_rate=0.1, attention_dropout_rate=0.1, deterministic=False)
    model = m.TransformerLM(config)
    tokens = jax.random.randint(_keys(1)[0], (2, 16), 1, 64).at[1, 12:].set(0)  # padded row
    params = nn.unbox(model.init(KEY, tokens)["params"])
    rngs = {"dropout": jax.random.key(7)}

    def forward(params, tokens, rngs):
        return model.apply({"params": params}, tokens, rngs=rngs)
    serving = m.TransformerLM(config.replace(deterministic=True))  # dropout off
    inference = FreezeCase(serving, {"params": params}, (tokens,), (0,))
    return ZooCase(forward, (params, tokens, rngs), forward, (params, tokens, rngs),
                   depth=2 * 2 * 3, inference=inference)


def flax_sst2() -> ZooCase:
    """examples/sst2 TextClassifier: embedding, BiLSTM (``nn.scan``), MLP attention, dropout on."""
    from .flax_examples import sst2_models as m
    model = m.TextClassifier(embedding_size=16, hidden_size=16, vocab_size=50, output_size=2,
                             dropout_rate=0.1, word_dropout_rate=0.1)
    tokens = jax.random.randint(_keys(1)[0], (3, 10), 2, 50)
    lengths = jnp.array([10, 7, 4])
    variables = model.init(KEY, tokens, lengths, deterministic=True)
    rngs = {"dropout": jax.random.key(7)}

    def forward(params, tokens, lengths, rngs):
        return model.apply({"params": params}, tokens, lengths, deterministic=False, rngs=rngs)
    inference = FreezeCase(model, variables, (tokens, lengths), (0, 0), {"deterministic": True})
    return ZooCase(forward, (variables["params"], tokens, lengths, rngs), forward,
                   (variables["params"], tokens, lengths, rngs), depth=2 * 10 + 4,
                   inference=inference)


def flax_vae() -> ZooCase:
    """examples/vae VAE (784-500-latents), reparameterised sample; latents shrunk to 8."""
    from .flax_examples import vae_models as m
    model = m.model(8)
    x = jax.random.uniform(_keys(1)[0], (4, 784))
    params = model.init(KEY, x, jax.random.key(1))["params"]

    def forward(params, x, z_rng):
        return model.apply({"params": params}, x, z_rng)
    z_rng = jax.random.key(3)
    inference = FreezeCase(forward, params, (x, z_rng), (0, None))  # the key stays an input
    return ZooCase(forward, (params, x, z_rng), forward, (params, x, z_rng), depth=2 * 4,
                   inference=inference)


# ------------------------------------------------------------------------------------- Flax NNX

def nnx_scan_mlp() -> ZooCase:
    """A residual MLP whose blocks (Linear, BatchNorm, Dropout) are stacked with ``nnx.vmap``
    and applied with ``nnx.scan``, as in Flax's "scan over layers" guide. The module itself is
    the argument (training mode: BatchNorm statistics and RNG counters update in place)."""
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, dim, rngs):
            self.linear = nnx.Linear(dim, dim, rngs=rngs)
            self.bn = nnx.BatchNorm(dim, rngs=rngs)
            self.dropout = nnx.Dropout(0.1, rngs=rngs)

        def __call__(self, x):
            return x + self.dropout(nnx.gelu(self.bn(self.linear(x))))

    class ScanMLP(nnx.Module):
        def __init__(self, din, dim, dout, layers, rngs):
            self.embed = nnx.Linear(din, dim, rngs=rngs)

            @nnx.split_rngs(splits=layers)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def blocks(rngs):
                return Block(dim, rngs)
            self.blocks = blocks(rngs)
            self.head = nnx.Linear(dim, dout, rngs=rngs)

        def __call__(self, x):
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def apply_block(x, block):
                return block(x)
            return self.head(apply_block(self.embed(x), self.blocks))

    model = ScanMLP(12, 32, 5, 3, nnx.Rngs(0, dropout=1))
    x = jax.random.normal(_keys(1)[0], (8, 12))

    def forward(model, x):
        return model(x), nnx.state(model, nnx.BatchStat)

    def loss_fn(model, x):
        return model(x)
    serving = nnx.clone(model)
    serving.eval()  # BatchNorm running averages, Dropout off
    inference = FreezeCase(serving, None, (x,), (0,))
    # NNX's own transforms: nnx.jit and nnx.grad (w.r.t. the nnx.Param state) propagate the
    # BatchNorm/RNG updates; jax.grad cannot differentiate through nnx.scan on a merged module.
    return ZooCase(forward, (model, x), loss_fn, (model, x), depth=2 * 5, jit=nnx.jit,
                   grad=nnx.grad, params_of=lambda model: nnx.state(model, nnx.Param),
                   inference=inference)


# ------------------------------------------------------------------------------------- Equinox

def _eqx_split(model):
    import equinox as eqx
    return eqx.partition(model, eqx.is_inexact_array)


def eqx_mlp() -> ZooCase:
    import equinox as eqx
    model = eqx.nn.MLP(10, 4, width_size=32, depth=3, activation=jax.nn.silu, key=_keys(1)[0])
    x = jax.random.normal(_keys(2)[1], (8, 10))

    def forward(model, x):
        return jax.vmap(model)(x)
    params, static = _eqx_split(model)

    def loss_fn(params, x):
        return forward(eqx.combine(params, static), x)
    return ZooCase(forward, (model, x), loss_fn, (params, x), depth=2 * 4, jit=eqx.filter_jit,
                   inference=FreezeCase(loss_fn, params, (x,), (0,)))


def eqx_cnn_batchnorm() -> ZooCase:
    """Conv2d + ``eqx.nn.BatchNorm`` (batch mode) with ``eqx.nn.State``, vmapped over the batch."""
    import equinox as eqx

    class CNN(eqx.Module):
        conv1: eqx.nn.Conv2d
        bn1: eqx.nn.BatchNorm
        conv2: eqx.nn.Conv2d
        bn2: eqx.nn.BatchNorm
        pool: eqx.nn.MaxPool2d
        head: eqx.nn.Linear

        def __init__(self, key):
            k1, k2, k3 = jax.random.split(key, 3)
            self.conv1 = eqx.nn.Conv2d(3, 8, 3, padding=1, key=k1)
            self.bn1 = eqx.nn.BatchNorm(8, axis_name="batch", mode="batch")
            self.conv2 = eqx.nn.Conv2d(8, 16, 3, padding=1, key=k2)
            self.bn2 = eqx.nn.BatchNorm(16, axis_name="batch", mode="batch")
            self.pool = eqx.nn.MaxPool2d(2, 2)
            self.head = eqx.nn.Linear(16 * 4 * 4, 10, key=k3)

        def __call__(self, x, state):
            x, state = self.bn1(self.conv1(x), state)
            x = self.pool(jax.nn.relu(x))
            x, state = self.bn2(self.conv2(x), state)
            x = self.pool(jax.nn.relu(x))
            return self.head(x.reshape(-1)), state

    model, state = eqx.nn.make_with_state(CNN)(_keys(1)[0])
    x = jax.random.normal(_keys(2)[1], (6, 3, 16, 16))

    def forward(model, state, x):
        return jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(x, state)
    params, static = _eqx_split(model)

    def loss_fn(params, state, x):
        return forward(eqx.combine(params, static), state, x)[0]
    # Inference: BatchNorm on its running statistics (eqx.nn.inference_mode), state unchanged.
    serving_params, serving_static = _eqx_split(eqx.nn.inference_mode(model))

    def serve(variables, x):
        params, state = variables
        return forward(eqx.combine(params, serving_static), state, x)[0]
    inference = FreezeCase(serve, (serving_params, state), (x,), (0,))
    return ZooCase(forward, (model, state, x), loss_fn, (params, state, x), depth=2 * 3, jit=eqx.filter_jit,
                   inference=inference)


def eqx_attention() -> ZooCase:
    """``eqx.nn.MultiheadAttention`` (self-attention with a causal mask) and a LayerNorm."""
    import equinox as eqx

    class Attention(eqx.Module):
        norm: eqx.nn.LayerNorm
        attention: eqx.nn.MultiheadAttention

        def __init__(self, key):
            self.norm = eqx.nn.LayerNorm(32)
            self.attention = eqx.nn.MultiheadAttention(4, 32, key=key)

        def __call__(self, x):
            h = jax.vmap(self.norm)(x)
            mask = jnp.tril(jnp.ones((x.shape[0], x.shape[0]), bool))
            return x + self.attention(h, h, h, mask=mask)

    model = Attention(_keys(1)[0])
    x = jax.random.normal(_keys(2)[1], (4, 12, 32))

    def forward(model, x):
        return jax.vmap(model)(x)
    params, static = _eqx_split(model)

    def loss_fn(params, x):
        return forward(eqx.combine(params, static), x)
    return ZooCase(forward, (model, x), loss_fn, (params, x), depth=2 * 3, jit=eqx.filter_jit,
                   inference=FreezeCase(loss_fn, params, (x,), (0,)))


def eqx_lstm_scan() -> ZooCase:
    """``eqx.nn.LSTMCell`` under ``lax.scan`` over 12 time steps, then a Linear readout."""
    import equinox as eqx

    class RNN(eqx.Module):
        cell: eqx.nn.LSTMCell
        head: eqx.nn.Linear

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.cell = eqx.nn.LSTMCell(6, 24, key=k1)
            self.head = eqx.nn.Linear(24, 3, key=k2)

        def __call__(self, xs):
            init = (jnp.zeros(24), jnp.zeros(24))

            def step(carry, x):
                carry = self.cell(x, carry)
                return carry, carry[0]
            (h, _), hs = lax.scan(step, init, xs)
            return self.head(h), hs

    model = RNN(_keys(1)[0])
    xs = jax.random.normal(_keys(2)[1], (4, 12, 6))

    def forward(model, xs):
        return jax.vmap(model)(xs)
    params, static = _eqx_split(model)

    def loss_fn(params, xs):
        return forward(eqx.combine(params, static), xs)
    return ZooCase(forward, (model, xs), loss_fn, (params, xs), depth=2 * 12 + 2, jit=eqx.filter_jit,
                   inference=FreezeCase(loss_fn, params, (xs,), (0,)))


def eqx_custom_vjp() -> ZooCase:
    """A layer with a hand-written backward pass through ``eqx.filter_custom_vjp`` (the
    mechanism of Equinox's checkpointed loops, diffrax and optimistix), inside a small MLP."""
    import equinox as eqx

    @eqx.filter_custom_vjp
    def dense_tanh(weights, x):
        w, b = weights
        return jnp.tanh(x @ w + b)

    @dense_tanh.def_fwd
    def dense_tanh_fwd(perturbed, weights, x):
        out = dense_tanh.fn(weights, x)
        return out, out

    @dense_tanh.def_bwd
    def dense_tanh_bwd(out, g, perturbed, weights, x):
        w, _ = weights
        dz = g * (1 - out**2)
        return (x.T @ dz, jnp.sum(dz, axis=0))

    k1, k2, k3 = _keys(3)
    params = {"w1": jax.random.normal(k1, (8, 32)) / np.sqrt(8), "b1": jnp.zeros(32),
              "w2": jax.random.normal(k2, (32, 4)) / np.sqrt(32)}
    x = jax.random.normal(k3, (16, 8))

    def forward(params, x):
        h = dense_tanh((params["w1"], params["b1"]), x)
        return h @ params["w2"]
    return ZooCase(forward, (params, x), forward, (params, x), depth=2 * 2,
                   inference=FreezeCase(forward, params, (x,), (0,)))


def diffrax_neural_ode() -> ZooCase:
    """A neural ODE: an Equinox MLP vector field solved by ``diffrax.diffeqsolve`` (Tsit5, 8 fixed
    steps), differentiated through diffrax's default ``RecursiveCheckpointAdjoint``.
    ``max_steps=16`` (default 4096) keeps the checkpointed loop it builds small to compile."""
    import diffrax
    import equinox as eqx

    field = eqx.nn.MLP(4, 4, width_size=16, depth=2, activation=jnp.tanh, key=_keys(1)[0])
    y0 = jax.random.normal(_keys(2)[1], (3, 4))

    def forward(field, y0):
        def solve(y0):
            term = diffrax.ODETerm(lambda t, y, args: field(y))
            sol = diffrax.diffeqsolve(term, diffrax.Tsit5(), t0=0.0, t1=1.0, dt0=0.125, y0=y0,
                                      saveat=diffrax.SaveAt(t1=True), max_steps=16)
            return sol.ys
        return jax.vmap(solve)(y0)
    params, static = _eqx_split(field)

    def loss_fn(params, y0):
        return forward(eqx.combine(params, static), y0)
    return ZooCase(forward, (field, y0), loss_fn, (params, y0), depth=2 * 8, jit=eqx.filter_jit)


# --------------------------------------------------------------------------------------- Haiku

def haiku_resnet18() -> ZooCase:
    """Haiku's ResNet18 (``hk.nets.ResNet`` with ``ResNet.CONFIGS[18]``: 4 groups of 2 basic
    blocks, projections in groups 2-4, ``hk.nets.ResNet18``'s own layers) at widths 8-64 on
    32x32 images, in training mode: its BatchNorm computes the variance as E[x^2] - E[x]^2.

    Groups 3-4 see 2x2 and 1x1 feature maps, so their BatchNorm statistics are over few values:
    with 2 images a float32 run whose inputs and weights are merely rounded to bfloat16 moves
    the last groups' running variances by ~100%, so the batch is 8. The logits layer is
    initialised randomly instead of Haiku's zeros, so that every layer's gradient is non-zero
    and compared.

    Gradient cosine bounds: a batch-normalised ResNet in training mode at initialisation
    amplifies perturbations on the way back (the gradient explosion of batch-normalised
    networks at init, Yang et al. 2019), so its float32 gradient is itself ill-conditioned. The
    float32 model run on inputs and weights rounded once to bfloat16 (what every bfloat16
    program starts from) has gradient cosine 0.971 / 0.937 / 0.939 to float32 (key seeds 0, 1,
    2; float16: 0.994 / 0.997 / 0.998), and jamp, rounding every layer, 0.958 / 0.916 / 0.933
    (float16: 0.994 / 0.987 / 0.986). 0.99 is out of reach of a bfloat16 run of this model;
    the bounds sit just below jamp's measurements at these seeds.
    """
    import haiku as hk

    def net(x, is_training=True):
        config = dict(hk.nets.ResNet.CONFIGS[18], channels_per_group=(8, 16, 32, 64))
        return hk.nets.ResNet(**config, num_classes=10,
                              initial_conv_config={"output_channels": 8},
                              logits_config={"w_init": hk.initializers.VarianceScaling()},
                              name="res_net18")(x, is_training=is_training)
    model = hk.transform_with_state(net)
    x = jax.random.normal(jax.random.key(3), (8, 32, 32, 3))
    params, state = model.init(jax.random.key(0), x)

    def forward(params, state, x):
        return model.apply(params, state, None, x)

    def loss_fn(params, state, x):
        return forward(params, state, x)[0]

    def serve(variables, x):  # inference: BatchNorm on its moving averages
        return model.apply(*variables, None, x, is_training=False)[0]
    return ZooCase(forward, (params, state, x), loss_fn, (params, state, x), depth=2 * 18,
                   grad_cosine={"bfloat16": 0.9, "float16": 0.98},
                   inference=FreezeCase(serve, (params, state), (x,), (0,)))


def haiku_lstm() -> ZooCase:
    """``hk.LSTM`` unrolled with ``hk.dynamic_unroll`` (a scan), time-major, then a Linear."""
    import haiku as hk

    def net(xs):
        core = hk.LSTM(24)
        hs, _ = hk.dynamic_unroll(core, xs, core.initial_state(xs.shape[1]))
        return hk.Linear(3)(hs)
    model = hk.transform(net)
    xs = jax.random.normal(_keys(1)[0], (12, 4, 6))  # (time, batch, features)
    params = model.init(KEY, xs)

    def forward(params, xs):
        return model.apply(params, None, xs)
    return ZooCase(forward, (params, xs), forward, (params, xs), depth=2 * 12 + 2,
                   inference=FreezeCase(forward, params, (xs,), (1,)))  # batch on axis 1


# --------------------------------------------------------------------------------------- Keras

def keras_cnn() -> ZooCase:
    """A Keras 3 functional CNN (Conv2D, BatchNormalization, pooling, Dense, Dropout) on the JAX
    backend, called with ``model.stateless_call`` in training mode."""
    import keras

    keras.utils.set_random_seed(0)
    inputs = keras.Input((16, 16, 3))
    h = keras.layers.Conv2D(8, 3, padding="same")(inputs)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.Activation("relu")(h)
    h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.Conv2D(16, 3, padding="same", activation="relu")(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    h = keras.layers.Dense(32, activation="gelu")(h)
    h = keras.layers.Dropout(0.1)(h)
    outputs = keras.layers.Dense(10)(h)
    model = keras.Model(inputs, outputs)
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    x = jax.random.normal(_keys(1)[0], (6, 16, 16, 3))

    def forward(trainable, non_trainable, x):
        return model.stateless_call(trainable, non_trainable, x, training=True)

    def loss_fn(trainable, non_trainable, x):
        return forward(trainable, non_trainable, x)[0]

    def serve(variables, x):  # inference: BatchNormalization on its moving statistics
        return model.stateless_call(*variables, x, training=False)[0]
    return ZooCase(forward, (trainable, non_trainable, x), loss_fn, (trainable, non_trainable, x),
                   depth=2 * 4, inference=FreezeCase(serve, (trainable, non_trainable), (x,), (0,)))


MODELS = [
    ZooModel("flax_resnet", flax_resnet, slow=True, freezes=True),
    ZooModel("flax_lm1b", flax_lm1b, slow=True, freezes=True),
    ZooModel("flax_sst2", flax_sst2, freezes=True),
    ZooModel("flax_vae", flax_vae, freezes=True),
    ZooModel("nnx_scan_mlp", nnx_scan_mlp, region_carry_limit=True, freezes=True),
    ZooModel("eqx_mlp", eqx_mlp, batch_args=(1,), freezes=True),
    ZooModel("eqx_cnn_batchnorm", eqx_cnn_batchnorm, freezes=True),
    ZooModel("eqx_attention", eqx_attention, freezes=True),
    ZooModel("eqx_lstm_scan", eqx_lstm_scan, freezes=True),
    ZooModel("eqx_custom_vjp", eqx_custom_vjp, freezes=True),
    # Not frozen: its Equinox runtime checks are host callbacks, which jax.export cannot serialize.
    ZooModel("diffrax_neural_ode", diffrax_neural_ode, slow=True, batch_args=(1,)),
    ZooModel("haiku_resnet18", haiku_resnet18, slow=True, freezes=True),
    ZooModel("haiku_lstm", haiku_lstm, freezes=True),
    ZooModel("keras_cnn", keras_cnn, freezes=True),
]
