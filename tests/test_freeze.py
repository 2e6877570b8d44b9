"""tracing.freeze: the guarantees of the freezing issue, and ports of inductor's freezing tests.

Ported from pytorch test/inductor/test_inductor_freezing.py (in JAX terms): test_mutation,
test_aliased_param_return, test_rng_op, test_folded_conv_bn (with/without bias, f32/bf16),
test_folded_conv_bn_with_module_sharing, test_folded_conv_functional_bn_with_module_sharing,
test_conv_bn_with_multi_bn_share_conv, test_conv_functional_bn_with_multi_bn_share_conv,
test_conv_multiple_uses, test_dont_change_dtype_folding, test_param_deallocated,
test_unfolded_bn.
"""
from __future__ import annotations

import collections
import gc
import pathlib
import re
import warnings
import weakref

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jamp
import tracing
from jamp import _compat as compat
from tests.host_data import normal, uniform
from tests.jaxpr_utils import iter_eqns
from tracing.passes import RANDOM_PRIMITIVES

F32_TOL = dict(atol=1e-4, rtol=1e-4)
BF16_TOL = dict(atol=5e-2, rtol=5e-2)
BN_OPS = ("rsqrt", "sub", "mul")


def counts(closed) -> collections.Counter:
    """Primitive counts, recursing into sub-jaxprs."""
    return collections.Counter(e.primitive.name for e in iter_eqns(closed))


def checked(frozen: tracing.FrozenFunction) -> tracing.FrozenFunction:
    """The frozen program type-checks (JAX's own checker) and is a Program."""
    assert isinstance(frozen, tracing.program.Program)
    compat.check_closed_jaxpr(frozen.jaxpr)
    return frozen


def as_f32(tree):
    return jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), tree)


def randomize_batchnorm(variables, seed):
    """Non-trivial statistics and affine parameters (init gives mean 0, var 1, scale 1, bias 0)."""
    rng = np.random.default_rng(seed)

    def randomize(path, leaf):
        name = jax.tree_util.keystr(path)
        noise = rng.random(leaf.shape, np.float32)
        if "var" in name:
            return jax.device_put((0.5 + noise).astype(leaf.dtype))
        if any(s in name for s in ("mean", "scale", "bias")):
            return jax.device_put((2 * noise - 1).astype(leaf.dtype))
        return leaf

    return jax.tree_util.tree_map_with_path(randomize, variables)


class ConvBN(nn.Module):
    features: int = 8
    use_bias: bool = False
    dtype: object = jnp.float32

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(self.features, (3, 3), strides=2, use_bias=self.use_bias, dtype=self.dtype,
                    param_dtype=self.dtype, name="conv")(x)
        return nn.BatchNorm(use_running_average=True, epsilon=1e-3, dtype=self.dtype,
                            param_dtype=self.dtype, name="bn")(x)


def init(module, *inputs, key=0):
    variables = module.init(jax.random.key(key), *inputs)
    return randomize_batchnorm(variables, key + 100)


X = uniform(7, (3, 16, 16, 3))


# --- 3. BatchNorm folding (test_folded_conv_bn) ---------------------------------------------

@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("use_bias", [True, False], ids=["bias", "no_bias"])
def test_folded_conv_bn(use_bias, dtype):
    model = ConvBN(use_bias=use_bias, dtype=dtype)
    x = X.astype(dtype)
    variables = init(model, x)
    frozen = checked(tracing.freeze(model, variables, x))
    c = counts(frozen.jaxpr)
    assert c["conv_general_dilated"] == 1
    assert not any(c[op] for op in BN_OPS), c
    expected = model.apply(variables, x)
    got = frozen(x)
    assert got.dtype == expected.dtype == dtype  # 2. a bf16 module stays bf16
    (kernel,) = [e.invars[1].aval.dtype for e in iter_eqns(frozen.jaxpr)
                 if e.primitive.name == "conv_general_dilated"]
    assert kernel == dtype
    chex.assert_trees_all_close(as_f32(got), as_f32(expected),
                                **(F32_TOL if dtype == jnp.float32 else BF16_TOL))


def test_dense_bn_folds_into_one_dot():
    class DenseBN(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.relu(nn.BatchNorm(use_running_average=True)(nn.Dense(6)(x)))

    x = normal(1, (4, 5))
    model = DenseBN()
    variables = init(model, x)
    frozen = checked(tracing.freeze(model, variables, x))
    c = counts(frozen.jaxpr)
    assert c["dot_general"] == 1 and not any(c[op] for op in BN_OPS), c
    chex.assert_trees_all_close(frozen(x), model.apply(variables, x), **F32_TOL)


def test_nnx_conv_bn_in_eval_mode_folds():
    class Block(nnx.Module):
        def __init__(self, rngs):
            self.conv = nnx.Conv(3, 8, (3, 3), use_bias=False, rngs=rngs)
            self.bn = nnx.BatchNorm(8, rngs=rngs)

        def __call__(self, x):
            return nnx.relu(self.bn(self.conv(x)))

    model = Block(nnx.Rngs(0))
    model.bn.mean = nnx.BatchStat(jnp.linspace(-1, 1, 8))
    model.bn.var = nnx.BatchStat(jnp.linspace(0.5, 2, 8))
    model.bn.scale = nnx.Param(jnp.linspace(-2, 2, 8))
    model.eval()
    frozen = checked(tracing.freeze(model, None, X))
    c = counts(frozen.jaxpr)
    assert c["conv_general_dilated"] == 1 and not any(c[op] for op in BN_OPS), c
    chex.assert_trees_all_close(frozen(X), model(X), **F32_TOL)


def functional_bn(y, mean, var, weight, bias, eps=1e-5):
    return (y - mean) * jax.lax.rsqrt(var + eps) * weight + bias


def conv_nchw(x, kernel, stride=2):
    return jax.lax.conv_general_dilated(x, kernel, (stride, stride), "VALID",
                                        dimension_numbers=("NCHW", "OIHW", "NCHW"))


def functional_variables(channels=8):
    per_channel = lambda seed, lo, hi: uniform(seed, (1, channels, 1, 1), lo, hi)
    return {"kernel": normal(0, (channels, 4, 3, 3), 0.3),
            "conv_bias": per_channel(1, -1, 1), "mean": per_channel(2, -1, 1),
            "var": per_channel(3, 0.5, 2), "weight": per_channel(4, -2, 2),
            "bias": per_channel(5, -1, 1)}


XN = uniform(3, (3, 4, 16, 16))  # NCHW


def test_folded_conv_functional_bn_with_module_sharing():
    """The functional BN pattern, NCHW layout, called twice (the first result is dead)."""
    def foo(v, x):
        def mod(x):
            y = conv_nchw(x, v["kernel"]) + v["conv_bias"]
            return functional_bn(y, v["mean"], v["var"], v["weight"], v["bias"])
        mod(x)
        return mod(x)

    v = functional_variables()
    frozen = checked(tracing.freeze(foo, v, XN))
    c = counts(frozen.jaxpr)
    assert c["conv_general_dilated"] == 1 and not any(c[op] for op in BN_OPS), c
    chex.assert_trees_all_close(frozen(XN), foo(v, XN), **F32_TOL)


def test_folded_conv_bn_with_module_sharing():
    class Twice(nn.Module):
        @nn.compact
        def __call__(self, x):
            mod = ConvBN(use_bias=True)
            mod(x)
            return mod(x)

    model = Twice()
    variables = init(model, X)
    frozen = checked(tracing.freeze(model, variables, X))
    c = counts(frozen.jaxpr)
    assert c["conv_general_dilated"] == 1 and not any(c[op] for op in BN_OPS), c
    chex.assert_trees_all_close(frozen(X), model.apply(variables, X), **F32_TOL)


def test_conv_bn_with_multi_bn_share_conv():
    """One conv module called twice, each result into its own BN: both calls fold."""
    class ConvMultiBN(nn.Module):
        @nn.compact
        def __call__(self, x):
            conv = nn.Conv(8, (3, 3), strides=2, use_bias=True)
            bn = nn.BatchNorm(use_running_average=True, epsilon=1e-3)
            bn2 = nn.BatchNorm(use_running_average=True, epsilon=0.1)
            return bn(conv(x)) + bn2(conv(x))

    model = ConvMultiBN()
    variables = init(model, X)
    frozen = checked(tracing.freeze(model, variables, X))
    c = counts(frozen.jaxpr)
    assert c["conv_general_dilated"] == 2 and not any(c[op] for op in BN_OPS), c
    chex.assert_trees_all_close(frozen(X), model.apply(variables, X), **F32_TOL)


def test_conv_functional_bn_with_multi_bn_share_conv():
    """One conv value feeding two BNs is not folded into either; outputs stay right."""
    def foo(v, x):
        y = conv_nchw(x, v["kernel"]) + v["conv_bias"]
        return (functional_bn(y, v["mean"], v["var"], v["weight"], v["bias"])
                + functional_bn(y, v["mean2"], v["var"], v["weight"], v["bias"]))

    v = functional_variables()
    v["mean2"] = v["mean"] * 0.5 + 0.25
    frozen = checked(tracing.freeze(foo, v, XN))
    assert counts(frozen.jaxpr)["conv_general_dilated"] == 1
    assert counts(frozen.jaxpr)["rsqrt"] == 0  # the statistics are still folded
    chex.assert_trees_all_close(frozen(XN), foo(v, XN), **F32_TOL)


def test_conv_output_with_other_uses_is_not_folded():
    def foo(v, x):
        y = conv_nchw(x, v["kernel"])
        return functional_bn(y, v["mean"], v["var"], v["weight"], v["bias"]), y

    v = functional_variables()
    frozen = checked(tracing.freeze(foo, v, XN))
    bn_out, conv_out = frozen(XN)
    expected_bn, expected_conv = foo(v, XN)
    chex.assert_trees_all_close(conv_out, expected_conv, **F32_TOL)  # not scaled by the BN
    chex.assert_trees_all_close(bn_out, expected_bn, **F32_TOL)
    c = counts(frozen.jaxpr)
    assert c["sub"] == 1 and c["rsqrt"] == 0  # the BN stays, its statistics folded


def test_conv_multiple_uses():
    """conv1(x) + bn1(conv1(y)): the same kernel used twice, only the second use folded."""
    class ToyModel(nn.Module):
        @nn.compact
        def __call__(self, x, y):
            conv1 = nn.Conv(1, (1, 1))
            return conv1(x) + nn.BatchNorm(use_running_average=True)(conv1(y))

    a = uniform(1, (4, 8, 8, 1))
    b = uniform(2, (4, 8, 8, 1))
    model = ToyModel()
    variables = init(model, a, b)
    frozen = checked(tracing.freeze(model, variables, a, b))
    assert counts(frozen.jaxpr)["conv_general_dilated"] == 2
    assert not any(counts(frozen.jaxpr)[op] for op in BN_OPS)
    chex.assert_trees_all_close(frozen(a, b), model.apply(variables, a, b), **F32_TOL)


def test_grouped_conv_and_left_hand_dense_fold():
    """Depthwise convs scale the kernel's output-feature axis; a constant lhs of a dot folds too."""
    class Depthwise(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Conv(6, (3, 3), feature_group_count=3, use_bias=False)(x)
            return nn.BatchNorm(use_running_average=True)(x)

    model = Depthwise()
    variables = init(model, X)
    frozen = checked(tracing.freeze(model, variables, X))
    assert not any(counts(frozen.jaxpr)[op] for op in BN_OPS)
    chex.assert_trees_all_close(frozen(X), model.apply(variables, X), **F32_TOL)

    def rows(v, x):  # (out, in) @ (in, batch): features on axis 0 of the output
        y = jnp.einsum("oi,ib->ob", v["w"], x)
        return (y - v["mean"][:, None]) * v["scale"][:, None] + v["shift"][:, None]

    v = {"w": normal(1, (5, 3)), "mean": normal(2, (5,)), "scale": normal(3, (5,)),
         "shift": normal(4, (5,))}
    xs = normal(6, (3, 4))
    frozen = checked(tracing.freeze(rows, v, xs))
    c = counts(frozen.jaxpr)
    assert c["dot_general"] == 1 and not c["sub"] and not c["mul"], c
    chex.assert_trees_all_close(frozen(xs), rows(v, xs), **F32_TOL)


def test_fold_batchnorm_false_keeps_the_batchnorm():
    """test_unfolded_bn: a BN with nothing to fold into, and fold_batchnorm=False."""
    model = ConvBN()
    variables = init(model, X)
    frozen = checked(tracing.freeze(model, variables, X, fold_batchnorm=False))
    c = counts(frozen.jaxpr)
    assert c["sub"] == 1 and c["mul"] == 1 and c["rsqrt"] == 0  # statistics still folded
    chex.assert_trees_all_close(frozen(X), model.apply(variables, X), **F32_TOL)

    bn = nn.BatchNorm(use_running_average=True, epsilon=1e-3)
    bn_vars = randomize_batchnorm(bn.init(jax.random.key(0), X), 1)
    frozen = checked(tracing.freeze(lambda v, x: bn.apply(v, x) + 10, bn_vars, X))
    chex.assert_trees_all_close(frozen(X), bn.apply(bn_vars, X) + 10, **F32_TOL)


# --- 1. constant folding, rng never folded ---------------------------------------------------

def test_everything_depending_only_on_variables_is_folded():
    def f(v, x):
        w = jnp.sin(v["w"]) * 2 + v["b"].sum()
        return x @ w.T

    v = {"w": normal(0, (4, 3)), "b": jnp.arange(3.0)}
    x = jnp.ones((2, 3))
    frozen = checked(tracing.freeze(f, v, x))
    assert counts(frozen.jaxpr) == collections.Counter({"dot_general": 1}), frozen.graph
    chex.assert_trees_all_close(frozen(x), f(v, x), **F32_TOL)


def test_folding_reaches_into_jit_calls():
    @jax.jit
    def layer(w, x):
        scale = jnp.exp(w).sum()   # depends only on w: folded inside the call
        return jnp.tanh(x * scale)

    def f(v, x):
        return layer(v["w"], x)

    v = {"w": jnp.linspace(-1, 1, 5)}
    x = jnp.linspace(0, 0.1, 5)
    frozen = checked(tracing.freeze(f, v, x))
    c = counts(frozen.jaxpr)
    assert c["exp"] == 0 and c["reduce_sum"] == 0 and c["tanh"] == 1, frozen.graph
    assert c["jit"] == 0 and c["pjit"] == 0  # inlined
    chex.assert_trees_all_close(frozen(x), f(v, x), **F32_TOL)


def random_counts(closed) -> collections.Counter:
    c = counts(closed)
    return collections.Counter({p: n for p, n in c.items() if p in RANDOM_PRIMITIVES})


def test_rng_op_not_folded():
    """test_rng_op: draws are never folded, nor anything downstream of them."""
    def f(v, x):
        noise = jax.random.uniform(jax.random.key(0), (4, 4))      # constant key
        bits = jax.lax.rng_bit_generator(jnp.zeros(4, jnp.uint32), (4, 4))[1]
        return x + noise * v["w"].sum() + bits.astype(jnp.float32) * 0 + 1

    v = {"w": jnp.ones(3)}
    x = jnp.ones((4, 4))
    original = jax.make_jaxpr(f)(v, x)
    frozen = checked(tracing.freeze(f, v, x))
    assert random_counts(frozen.jaxpr) == random_counts(original)
    assert random_counts(frozen.jaxpr)["random_bits"] >= 1
    assert random_counts(frozen.jaxpr)["rng_bit_generator"] == 1
    assert counts(frozen.jaxpr)["reduce_sum"] == 0  # the variables' part is folded
    chex.assert_trees_all_close(frozen(x), f(v, x), **F32_TOL)


def test_rngs_stay_an_input():
    class Drop(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dropout(0.5, deterministic=False)(nn.Dense(16)(x))

    x = jnp.ones((4, 8))
    model = Drop()
    variables = model.init(jax.random.key(0), x)
    key1, key2 = jax.random.key(1), jax.random.key(2)
    frozen = checked(tracing.freeze(model, variables, x, rngs={"dropout": key1}))
    assert frozen.takes_rngs
    o1, o2 = frozen(x), frozen(x, rngs={"dropout": key2})
    assert not np.allclose(o1, o2)  # a new key draws a new mask
    chex.assert_trees_all_close(o1, model.apply(variables, x, rngs={"dropout": key1}), **F32_TOL)
    chex.assert_trees_all_close(o2, model.apply(variables, x, rngs={"dropout": key2}), **F32_TOL)
    loaded = tracing.load(frozen.export())  # rngs are the last positional input
    chex.assert_trees_all_close(loaded(x, {"dropout": key2}), o2, **F32_TOL)


# --- 2. dtypes kept --------------------------------------------------------------------------

def test_dont_change_dtype_folding():
    class Conv(nn.Module):
        @nn.compact
        def __call__(self, x):
            conv = nn.Conv(8, (3, 3), strides=2, use_bias=False, dtype=jnp.bfloat16,
                           param_dtype=jnp.bfloat16)
            return conv(x) * jnp.full([1], 2.0)

    x = X.astype(jnp.bfloat16)
    model = Conv()
    variables = model.init(jax.random.key(0), x)
    frozen = checked(tracing.freeze(model, variables, x))
    expected = model.apply(variables, x)
    assert frozen(x).dtype == expected.dtype
    chex.assert_trees_all_close(as_f32(frozen(x)), as_f32(expected), **BF16_TOL)


def test_folded_values_keep_dtype_and_weak_type():
    def f(v, x):
        return x * (v["s"] * 3), x * v["h"].astype(jnp.float32).sum()

    v = {"s": jnp.asarray(2.0), "h": jnp.ones(3, jnp.float16)}
    assert v["s"].weak_type
    x = jnp.ones(4, jnp.bfloat16)
    frozen = checked(tracing.freeze(f, v, x))
    weak_out, strong_out = frozen(x)
    expected = f(v, x)
    assert weak_out.dtype == expected[0].dtype == jnp.bfloat16  # the folded scalar stayed weak
    assert strong_out.dtype == expected[1].dtype == jnp.float32
    chex.assert_trees_all_close(as_f32((weak_out, strong_out)), as_f32(expected), **F32_TOL)


# --- 4. mutation -----------------------------------------------------------------------------

class Counter(nn.Module):
    """test_mutation: a forward pass that updates a variable."""

    @nn.compact
    def __call__(self, x):
        count = self.variable("counter", "count", lambda: jnp.zeros((), jnp.int32))
        count.value += 1
        return x + count.value


def test_mutation_raises_naming_the_collection():
    x = jnp.ones(3)
    variables = Counter().init(jax.random.key(0), x)
    with pytest.raises(ValueError, match=r"counter.*inference mode"):
        tracing.freeze(Counter(), variables, x, mutable=["counter"])
    with pytest.raises(ValueError, match=r"collection 'counter'.*inference mode"):
        tracing.freeze(Counter(), variables, x)


def test_batchnorm_in_training_mode_raises():
    class Train(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool):
            return nn.BatchNorm(use_running_average=not train)(nn.Conv(4, (3, 3))(x))

    variables = Train().init(jax.random.key(0), X, False)
    with pytest.raises(ValueError, match=r"batch_stats.*use_running_average=True"):
        tracing.freeze(Train(), variables, X, train=True)
    with pytest.raises(ValueError, match=r"batch_stats.*use_running_average=True"):
        tracing.freeze(Train(), variables, X, train=False, mutable=["batch_stats"])
    tracing.freeze(Train(), variables, X, train=False)  # the inference mode freezes


def test_nnx_training_mode_raises():
    class Block(nnx.Module):
        def __init__(self, rngs):
            self.conv = nnx.Conv(3, 4, (3, 3), rngs=rngs)
            self.bn = nnx.BatchNorm(4, rngs=rngs)

        def __call__(self, x):
            return self.bn(self.conv(x))

    model = Block(nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"BatchStat bn\.mean.*model\.eval\(\)"):
        tracing.freeze(model, None, X)
    model.eval()
    checked(tracing.freeze(model, None, X))


def test_nnx_sow_or_assignment_is_named_with_its_own_remedy():
    """Only the training mode's state (BatchNorm statistics, Dropout's rng count) is fixed by
    model.eval(): a sown intermediate is named as one (not 'state features.value.0') and gets
    the sow remedy, which works; any other Variable gets neither eval() nor sow advice."""
    class Sows(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(4, 4, rngs=rngs)

        def __call__(self, x):
            h = self.linear(x)
            self.sow(nnx.Intermediate, "features", h)
            return h * 2

    class Counts(nnx.Module):
        def __init__(self):
            self.calls = nnx.Variable(jnp.zeros(()))

        def __call__(self, x):
            self.calls.value = self.calls.value + 1
            return x

    x = jnp.ones((2, 4))
    model = Sows(nnx.Rngs(0))
    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # sow outside nnx.capture
        with pytest.raises(ValueError, match=r"updates its state \(Intermediate features\)") as info:
            tracing.freeze(model, None, x)
        assert "eval()" not in str(info.value) and "method=popped" in str(info.value)

        def popped(model, x):  # the error's remedy
            y = model(x)
            nnx.pop(model, nnx.Intermediate)
            return y

        frozen = checked(tracing.freeze(model, None, x, method=popped))
    chex.assert_trees_all_close(frozen(x), model.linear(x) * 2, **F32_TOL)
    with pytest.raises(ValueError, match=r"\(Variable calls\).*leaves the model's variables") as info:
        tracing.freeze(Counts(), None, x)
    assert "eval()" not in str(info.value) and "sow" not in str(info.value)


class Wrapped(nnx.Module):
    """A Linear and a BatchNorm called through an NNX transform (nnx.jit, nnx.remat, ...),
    which hands every Variable back as a new value, updated or not."""

    def __init__(self, wrap, rngs):
        self.linear = nnx.Linear(4, 4, rngs=rngs)
        self.bn = nnx.BatchNorm(4, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.wrap = wrap

    def __call__(self, x):
        return self.wrap(lambda model, x: model.drop(model.bn(model.linear(x))))(self, x)


def scanned_remat(fn):
    """fn(model, x) run twice by nnx.scan under nnx.remat, the model in the carry (a
    broadcast model's updates are dropped by nnx.scan, so it would not show an update)."""
    body = nnx.remat(lambda carry: ((carry[0], fn(*carry)), None))
    scan = nnx.scan(body, in_axes=(nnx.Carry,), out_axes=(nnx.Carry, 0), length=2)
    return lambda model, x: scan((model, x))[0][1]


NNX_WRAPS = {
    "jit": nnx.jit,
    "remat": nnx.remat,
    "scan+remat": scanned_remat,
    "cond": lambda fn: lambda model, x: nnx.cond(x.sum() > 0, fn, fn, model, x),
}


@pytest.mark.parametrize("wrap", NNX_WRAPS.values(), ids=NNX_WRAPS.keys())
def test_nnx_transforms_that_hand_state_back_unchanged_freeze(wrap):
    """nnx.jit / nnx.remat write each Variable back as a new tracer: freeze said the eval-mode
    call 'updates its state (Param linear.bias, ...)' and refused it; a Variable handed back
    as it came in is not an update."""
    model = Wrapped(wrap, nnx.Rngs(0))
    model.bn.mean = nnx.BatchStat(jnp.linspace(-1.0, 1.0, 4))
    model.eval()
    x = jnp.linspace(-2.0, 2.0, 8).reshape(2, 4)
    want = model(x)
    frozen = checked(tracing.freeze(model, None, x))
    chex.assert_trees_all_close(frozen(x), want, **F32_TOL)


@pytest.mark.parametrize("wrap", NNX_WRAPS.values(), ids=NNX_WRAPS.keys())
def test_nnx_transforms_that_update_state_are_refused(wrap):
    """Through the same transforms, the training mode's updates (BatchNorm statistics,
    Dropout's rng count) and an assignment are still refused, with their remedies."""
    model = Wrapped(wrap, nnx.Rngs(0))  # training mode
    x = jnp.ones((2, 4))
    with pytest.raises(ValueError, match=r"updates its state \(.*BatchStat bn\.mean.*model\.eval"):
        tracing.freeze(model, None, x)

    class Counts(nnx.Module):
        def __init__(self):
            self.calls = nnx.Variable(jnp.zeros(()))
            self.kept = nnx.Variable(jnp.ones(()))

        def __call__(self, x):
            def count(model, x):
                model.calls[...] = model.calls[...] + 1
                return x * model.kept[...]

            return wrap(count)(self, x)

    with pytest.raises(ValueError, match=r"updates its state \(Variable calls\); ") as info:
        tracing.freeze(Counts(), None, x)
    assert "eval()" not in str(info.value)


def test_nnx_state_of_another_model_names_the_first_difference():
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(3, 4, rngs=rngs)
            self.b = nnx.Linear(4, 2, rngs=rngs)

        def __call__(self, x):
            return self.b(self.a(x))

    other = nnx.state(nnx.Linear(3, 4, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match=r"variables is not the state of Net: Net has a\.bias, "
                                         r"which variables lacks; variables has bias"):
        tracing.freeze(Net(nnx.Rngs(0)), other, jnp.ones((2, 3)))
    net = Net(nnx.Rngs(0))
    frozen = checked(tracing.freeze(Net(nnx.Rngs(1)), nnx.state(net), jnp.ones((2, 3))))
    chex.assert_trees_all_close(frozen(jnp.ones((2, 3))), net(jnp.ones((2, 3))), **F32_TOL)


# --- 5. variables as outputs -----------------------------------------------------------------

def test_aliased_param_return():
    class Mod(nn.Module):
        @nn.compact
        def __call__(self):
            p = self.param("aliased_param", lambda key: jnp.arange(100.0).reshape(10, 10))
            return p[1:], p

    variables = Mod().init(jax.random.key(0))
    frozen = checked(tracing.freeze(Mod(), variables))
    chex.assert_trees_all_equal(frozen(), Mod().apply(variables))


def test_nnx_state_returned():
    class Mod(nnx.Module):
        def __init__(self):
            self.p = nnx.Param(jnp.arange(12.0).reshape(3, 4))

        def __call__(self, x):
            return self.p[...][:, 1], self.p[...] * x

    model = Mod()
    frozen = checked(tracing.freeze(model, None, jnp.ones(4)))
    chex.assert_trees_all_equal(frozen(jnp.ones(4)), model(jnp.ones(4)))


# --- 6. parameters released ------------------------------------------------------------------

def test_param_deallocated():
    class Mod(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Conv(4, (3, 3))(x) + self.param("param", nn.initializers.zeros, (4,)) + 10

    model = Mod()
    variables = model.init(jax.random.key(0), X)
    expected = model.apply(variables, X)
    kernel_ref = weakref.ref(variables["params"]["Conv_0"]["kernel"])  # used as is, unfolded
    param_ref = weakref.ref(variables["params"]["param"])
    frozen = checked(tracing.freeze(model, variables, X))
    del variables
    gc.collect()
    assert kernel_ref() is None and param_ref() is None
    chex.assert_trees_all_close(frozen(X), expected, **F32_TOL)


def test_variable_read_as_is_deallocated():
    """A variable the program reads unchanged is a constant of it: a copy, not the caller's."""
    variables = {"w": normal(0, (3, 4))}
    ref = weakref.ref(variables["w"])
    x = jnp.ones((2, 3))
    expected = x @ variables["w"]
    frozen = checked(tracing.freeze(lambda v, x: x @ v["w"], variables, x))
    del variables
    gc.collect()
    assert ref() is None
    chex.assert_trees_all_close(frozen(x), expected, **F32_TOL)


def test_folded_kernel_deallocated():
    model = ConvBN()
    variables = init(model, X)
    expected = model.apply(variables, X)
    refs = [weakref.ref(leaf) for leaf in jax.tree.leaves(variables)]
    frozen = checked(tracing.freeze(model, variables, X))
    del variables
    gc.collect()
    assert all(ref() is None for ref in refs)
    chex.assert_trees_all_close(frozen(X), expected, **F32_TOL)


def test_nnx_state_deallocated():
    model = nnx.Linear(3, 4, rngs=nnx.Rngs(0))
    x = jnp.ones((2, 3))
    expected = model(x)
    refs = [weakref.ref(leaf) for leaf in jax.tree.leaves(nnx.state(model))]
    assert len(refs) == 2 and refs[1]() is model.kernel.get_value()
    frozen = checked(tracing.freeze(model, None, x))
    del model
    gc.collect()
    assert all(ref() is None for ref in refs)
    chex.assert_trees_all_close(frozen(x), expected, **F32_TOL)


# --- 7. autocast policy ----------------------------------------------------------------------

def test_policy_stores_weights_already_cast():
    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3)(nn.relu(nn.Dense(8)(x)))

    x = normal(1, (4, 5))
    model = MLP()
    variables = model.init(jax.random.key(0), x)
    frozen = checked(tracing.freeze(model, variables, x, policy=jamp.Policy()))
    jaxpr, _ = compat.open_and_consts(frozen.jaxpr)
    constants = set(jaxpr.constvars)
    for eqn in iter_eqns(frozen.jaxpr):
        if eqn.primitive.name == "convert_element_type":
            assert not (isinstance(eqn.invars[0], compat.Literal) or eqn.invars[0] in constants)
    dots = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 2
    for dot in dots:
        weight = dot.invars[1]
        assert weight in constants and weight.aval.dtype == jnp.bfloat16
    expected = jamp.autocast_transform(model.apply)(variables, x)
    chex.assert_trees_all_close(as_f32(frozen(x)), as_f32(expected), **BF16_TOL)


def test_policy_with_conv_bn_folds_and_keeps_bf16_kernels():
    model = ConvBN(use_bias=True)
    variables = init(model, X)
    frozen = checked(tracing.freeze(model, variables, X, policy=jamp.Policy()))
    c = counts(frozen.jaxpr)
    assert c["conv_general_dilated"] == 1 and not any(c[op] for op in BN_OPS), frozen.graph
    (conv,) = [e for e in iter_eqns(frozen.jaxpr) if e.primitive.name == "conv_general_dilated"]
    assert conv.invars[1].aval.dtype == jnp.bfloat16
    expected = jamp.autocast_transform(model.apply)(variables, X)
    chex.assert_trees_all_close(as_f32(frozen(X)), as_f32(expected), **BF16_TOL)


# --- 8. dead code, agreement on a ResNet-style network ---------------------------------------

def test_dead_code_removed():
    def f(v, x):
        jnp.sin(x) * v["w"]          # dead
        v["w"] * 3                   # dead, and foldable
        return jnp.cos(x) + v["w"]

    v = {"w": jnp.ones(3)}
    frozen = checked(tracing.freeze(f, v, jnp.ones(3)))
    assert counts(frozen.jaxpr) == collections.Counter({"cos": 1, "add": 1}), frozen.graph


class Block(nn.Module):
    features: int
    strides: int = 1

    @nn.compact
    def __call__(self, x):
        y = nn.Conv(self.features, (3, 3), self.strides, use_bias=False)(x)
        y = nn.relu(nn.BatchNorm(use_running_average=True)(y))
        y = nn.Conv(self.features, (3, 3), use_bias=False)(y)
        y = nn.BatchNorm(use_running_average=True)(y)
        if x.shape != y.shape:
            x = nn.BatchNorm(use_running_average=True)(
                nn.Conv(self.features, (1, 1), self.strides, use_bias=False)(x))
        return nn.relu(x + y)


class SmallResNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.BatchNorm(use_running_average=True)(nn.Conv(8, (3, 3), use_bias=False)(x)))
        x = Block(8)(x)
        x = Block(16, strides=2)(x)
        return nn.Dense(10)(x.mean(axis=(1, 2)))


# fast twins: test_folded_conv_bn, test_conv_bn_with_multi_bn_share_conv, test_dead_code_removed
@pytest.mark.slow
def test_resnet_frozen_matches_unfrozen():
    model = SmallResNet()
    variables = init(model, X)
    frozen = checked(tracing.freeze(model, variables, X))
    c = counts(frozen.jaxpr)
    assert c["conv_general_dilated"] == 6 and not any(c[op] for op in BN_OPS), c
    x2 = normal(11, X.shape)
    for x in (X, x2):
        chex.assert_trees_all_close(frozen(x), jax.jit(model.apply)(variables, x), **F32_TOL)


# --- API: export/load, errors ----------------------------------------------------------------

# fast twin: test_tracing_models.py::test_export_round_trips_a_logically_partitioned_dense_layer
@pytest.mark.slow
def test_export_load_round_trip():
    model = SmallResNet()
    variables = init(model, X)
    frozen = tracing.freeze(model, variables, X)
    loaded = tracing.load(frozen.export())
    chex.assert_trees_all_close(loaded(X), frozen(X), **F32_TOL)
    assert "stablehlo.convolution" in frozen.hlo


def test_method_and_nnx_method():
    class Two(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(2)(x)

        def double(self, x):
            return 2 * self(x)

    x = jnp.ones((1, 3))
    variables = Two().init(jax.random.key(0), x)
    frozen = checked(tracing.freeze(Two(), variables, x, method=Two.double))
    chex.assert_trees_all_close(frozen(x), Two().apply(variables, x, method=Two.double))

    class Lin(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.full((3,), 2.0))

        def scaled(self, x):
            return x * self.w[...]

    frozen = checked(tracing.freeze(Lin(), None, x, method="scaled"))
    chex.assert_trees_all_close(frozen(x), x * 2)


def test_errors_name_what_was_wrong():
    x = jnp.ones((1, 3))
    with pytest.raises(TypeError, match="linen module, so its variables are needed"):
        tracing.freeze(nn.Dense(2), None, x)
    with pytest.raises(TypeError, match=r"variables=None"):
        tracing.freeze(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), x, x)
    with pytest.raises(TypeError, match="target must be"):
        tracing.freeze(3, {}, x)
    with pytest.raises(TypeError, match="policy must be a jamp.Policy"):
        tracing.freeze(lambda v, x: x, {}, x, policy="bf16")
    with pytest.raises(TypeError, match=r"variables\['w'\] is a str"):
        tracing.freeze(lambda v, x: x, {"w": "no"}, x)
    frozen = tracing.freeze(lambda v, x: x * v, jnp.ones(3), x)
    with pytest.raises(ValueError, match=r"inputs\[0\] has shape \(2, 3\)"):
        frozen(jnp.ones((2, 3)))
    with pytest.raises(TypeError, match="frozen without rngs"):
        frozen(x, rngs={"dropout": jax.random.key(0)})


def test_a_traced_flag_or_count_is_a_tracing_check_error_naming_the_target():
    """An example input is traced: a Python branch on it was JAX's raw error naming freeze's
    own wrapper (``flat_fn``, ``flat[9]``); it is trace's error, with freeze's hint."""
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train):
            return nn.Dropout(0.5, deterministic=not train)(nn.Dense(4)(x))

    x = jnp.ones((2, 3))
    variables = Net().init(jax.random.key(0), x, False)
    with pytest.raises(tracing.TracingCheckError,
                       match=r"(?s)Tracing freeze\(Net\) failed: it needs the concrete value.*"
                             r"keyword of freeze.*TracerBoolConversionError") as info:
        tracing.freeze(Net(), variables, x, False)
    assert "flat_fn" not in str(info.value)
    assert isinstance(info.value.__cause__, jax.errors.TracerBoolConversionError)
    frozen = tracing.freeze(Net(), variables, x, train=False)  # the hint's way
    chex.assert_trees_all_close(frozen(x), Net().apply(variables, x, False), **F32_TOL)

    def repeated(w, x, n):
        return sum(x * w for _ in range(n))

    with pytest.raises(tracing.TracingCheckError, match=r"(?s)freeze\(.*repeated\).*Integer"):
        tracing.freeze(repeated, jnp.ones(3), jnp.ones(3), 3)


def test_a_symbolic_size_needed_as_a_value_is_not_blamed_on_a_train_flag():
    """Freezing again at symbolic shapes: what needs a concrete value is a dimension made
    symbolic (the call froze at the example shapes already), not a flag to pass as a keyword."""
    def checks_channels(w, x):
        fan_in = x.shape[-1] * 1.0  # a traced value only at a symbolic channel count
        return x * w / fan_in if fan_in != 0 else x

    w = jnp.ones(3)  # alive: the export freezes again from it
    frozen = tracing.freeze(checks_channels, w, jnp.ones((2, 3)))
    with pytest.raises(ValueError, match=r"(?s)a dimension that the model's parameters fix.*"
                                         r"Keep it fixed") as info:
        frozen.export(polymorphic_shapes="b, c")
    assert "keyword of freeze" not in str(info.value)
    tracing.load(frozen.export(polymorphic_shapes="b, 3"))

    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Conv(8, (3, 3))(x)

    x = jnp.ones((4, 8, 8, 3))
    variables = CNN().init(jax.random.key(1), x)
    frozen = tracing.freeze(CNN(), variables, x)
    with pytest.raises(ValueError, match="kernel") as info:  # Flax's error, or the hint
        frozen.export(polymorphic_shapes="b, h, w, c")
    assert "train" not in str(info.value)


def test_freezing_guide_example_runs():
    guide = (pathlib.Path(__file__).parents[1] / "docs" / "guides" / "freezing.md").read_text()
    section = guide.split("## Freeze a linen module", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace: dict = {}
    exec(compile(code, "docs/guides/freezing.md (Freeze a linen module)", "exec"), namespace)
    frozen, x = namespace["frozen"], namespace["x"]
    assert counts(frozen.jaxpr)["conv_general_dilated"] == 1
    assert namespace["bf16"](x).shape == frozen(x).shape


def test_cond_with_a_known_predicate_is_resolved():
    def f(v, x):
        y = jax.lax.cond(v["w"].sum() > 0, lambda a: a * v["w"], lambda a: a - v["w"], x)
        return jax.lax.cond(x.sum() > 0, lambda a: a * 2, lambda a: a * 3, y)  # stays

    x = jnp.linspace(-1, 1, 4)
    for w in (jnp.ones(4), -jnp.ones(4)):
        v = {"w": w}
        frozen = checked(tracing.freeze(f, v, x))
        assert counts(frozen.jaxpr)["cond"] == 1
        chex.assert_trees_all_close(frozen(x), f(v, x), **F32_TOL)
        chex.assert_trees_all_close(frozen(-x), f(v, -x), **F32_TOL)


def test_higher_order_primitives_and_gradients_through_the_frozen_function():
    @jax.custom_vjp
    def clip_grad(x):
        return x
    clip_grad.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -1, 1),))

    def f(v, x):
        w = clip_grad(jax.nn.relu(v["w"]))                                   # all known
        s = jax.lax.scan(lambda c, a: (c + a, c * a), 0.0, v["w"])[0]       # all known
        y = jax.lax.scan(lambda c, a: (c * v["w"].sum() + a, c), x[0], x)[1]  # mixed
        return y + jax.nn.relu(x * w) + s + clip_grad(x)

    v = {"w": jnp.linspace(-1, 1, 4)}
    x = jnp.linspace(0.5, 1, 4)
    frozen = checked(tracing.freeze(f, v, x))
    c = counts(frozen.jaxpr)
    assert c["scan"] == 1 and c["custom_vjp_call"] + c["custom_vjp_call_jaxpr"] == 1, c
    chex.assert_trees_all_close(frozen(x), f(v, x), **F32_TOL)
    loss = lambda fn: lambda x: fn(x).sum()
    chex.assert_trees_all_close(jax.grad(loss(frozen))(x), jax.grad(loss(lambda x: f(v, x)))(x),
                                **F32_TOL)


def test_calling_the_frozen_function_with_the_variables_says_they_are_folded_in():
    model = ConvBN()
    variables = init(model, X)
    frozen = tracing.freeze(model, variables, X)
    with pytest.raises(TypeError, match=r"freeze\(ConvBN\) takes the example input only, got 2 "
                                        r"positional arguments: the variables are folded into "
                                        r"the frozen function as constants, so call it without "
                                        r"them, as frozen\(x\), not frozen\(variables, x\)"):
        frozen(variables, X)
    two = tracing.freeze(lambda v, x, y: x @ v["w"] + y, {"w": jnp.ones((3, 2))},
                         jnp.ones((4, 3)), jnp.ones((4, 2)))
    with pytest.raises(TypeError, match=r"takes the 2 example inputs only, got 3 .* "
                                        r"frozen\(x0, x1\), not frozen\(variables, x0, x1\)"):
        two({"w": jnp.ones((3, 2))}, jnp.ones((4, 3)), jnp.ones((4, 2)))
    noisy = tracing.freeze(lambda v, x, rngs: x * v, jnp.ones(3), jnp.ones(3),
                           rngs=jax.random.key(0))
    with pytest.raises(TypeError, match=r"takes the example input only"):
        noisy(jnp.ones(3), jnp.ones(3))  # the rngs are no positional input of the call
