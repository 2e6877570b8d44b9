"""tracing.freeze(weights=...): weight-only int8 / int4 / float8 kernels, and jamp.tune_weights.

What is checked: the stored dtypes and scales in the frozen program, export bytes per format,
outputs within the stated error of float32, exact round trips of representable kernels (int4
packing, padding and grouping; a convolution's layout), BatchNorm folding then quantization,
a polymorphic export loaded in a fresh process, per-scope rules and their warnings, the tune
path, a float8 policy's kernels stored in float8, and that the caller's variables never change.
"""
from __future__ import annotations

import importlib
import os
import pathlib
import subprocess
import sys
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jamp
import tracing
from jamp import _compat as compat
from tests.host_data import normal

qw = importlib.import_module("tracing.passes.quantize_weights")
ROOT = pathlib.Path(__file__).resolve().parents[1]
INT8_ERROR = 2e-2  # per-channel int8 of randomly initialised kernels measures ~1e-2
FLOAT8_ERROR = 8e-2  # e4m3 keeps 3 mantissa bits: ~5e-2 here
INT4_ERROR = 0.3  # round-to-nearest int4 of random kernels, groups of <= 128: ~0.2 here


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(256, name="body")(x))
        x = nn.relu(nn.Dense(256, name="mid")(x))
        return nn.Dense(10, name="head")(x)


@pytest.fixture(scope="module")
def mlp():
    model = MLP()
    x = normal(1, (4, 300))
    return model, model.init(jax.random.key(0), x), x


def rel_error(y, ref):
    y, ref = np.asarray(y, np.float32), np.asarray(ref, np.float32)
    return float(np.linalg.norm(y - ref) / np.linalg.norm(ref))


def const_dtypes(frozen):
    return sorted(np.dtype(compat.aval_of(c).dtype).name for c in frozen.jaxpr.consts)


def test_export_bytes_and_error_per_format(mlp):
    model, variables, x = mlp
    ref = model.apply(variables, x)
    frozen = {
        "float32": tracing.freeze(model, variables, x),
        "bfloat16": tracing.freeze(model, variables, x, policy=jamp.Policy()),
        "int8": tracing.freeze(model, variables, x, weights=jnp.int8),
        "int4": tracing.freeze(model, variables, x, weights=jnp.int4),
        "float8": tracing.freeze(model, variables, x, weights=jnp.float8_e4m3fn),
    }
    size = {name: len(f.export()) for name, f in frozen.items()}
    assert size["bfloat16"] < 0.55 * size["float32"]
    assert size["int8"] <= 0.3 * size["float32"]
    assert size["float8"] <= 0.3 * size["float32"]
    assert size["int4"] < 0.65 * size["int8"]
    assert rel_error(frozen["int8"](x), ref) <= INT8_ERROR
    assert rel_error(frozen["float8"](x), ref) <= FLOAT8_ERROR
    assert rel_error(frozen["int4"](x), ref) <= INT4_ERROR
    # Stored: three kernels in the narrow format, scales and biases in float32.
    assert const_dtypes(frozen["int8"]).count("int8") == 3
    assert const_dtypes(frozen["float8"]).count("float8_e4m3fn") == 3
    assert const_dtypes(frozen["int4"]).count("int8") == 3  # packed two a byte
    kernels = {k.scope: k for k in frozen["int4"].kernels}
    assert kernels["MLP/body"].shape == (300, 256) and kernels["MLP/body"].stored == "int4"
    # 300 rows: 3 groups of 100, 150 packed rows, 3 float32 scales a column.
    assert kernels["MLP/body"].nbytes == 150 * 256 + 3 * 256 * 4
    assert kernels["MLP/body"].frozen_nbytes == 300 * 256 * 4
    assert {k.stored for k in frozen["float32"].kernels} == {"float32"}  # as frozen


def test_dequantizes_in_the_policys_compute_dtype(mlp):
    model, variables, x = mlp
    frozen = tracing.freeze(model, variables, x, policy=jamp.Policy(), weights=jnp.int8)
    dots = [e for e in frozen.jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
    assert [str(e.invars[1].aval.dtype) for e in dots] == ["bfloat16"] * 3
    scales = [c for c in frozen.jaxpr.consts if compat.aval_of(c).shape == (1, 256)]
    assert {str(compat.aval_of(c).dtype) for c in scales} == {"bfloat16"}  # and bf16 biases
    ref = model.apply(variables, x)
    assert rel_error(frozen(x), ref) <= INT8_ERROR + 1e-2
    # XLA's constant folding does not widen the kernels back: the executable holds int8.
    compiled = jax.jit(frozen.flat_fn).lower(x).compile().as_text()
    assert compiled.count("s8[300,256]") and "bf16[300,256]{1,0} constant" not in compiled
    loaded = tracing.load(frozen.export())
    np.testing.assert_array_equal(np.asarray(loaded(x), np.float32), np.asarray(frozen(x), np.float32))


def _representable(rng, levels, shape, powers_only):
    """Integers in [-levels, levels] (float8: 0 and powers of two, which e4m3 holds exactly
    after the scale ``amax / 448``), each column reaching ``levels``."""
    if powers_only:
        ints = rng.choice([-8, -4, -2, -1, 0, 1, 2, 4, 8], size=shape).astype(np.float32)
    else:
        ints = rng.integers(-levels, levels + 1, size=shape).astype(np.float32)
    ints[..., 0, :] = levels
    return ints


@pytest.mark.parametrize("dtype, levels", [(jnp.int8, 127), (jnp.int4, 7), (jnp.float8_e4m3fn, 8)])
def test_representable_kernels_round_trip_exactly(dtype, levels):
    """Kernels whose columns (int4: groups of 128 rows) are integers times a power of two come
    back exactly: the packing, padding (301 rows: 3 groups of 102), grouping and transposes are
    lossless."""
    rng = np.random.default_rng(0)
    if dtype is jnp.int4:  # a scale per group of 102 rows and column
        steps = 2.0 ** rng.integers(-3, 3, size=(3, 1, 5))
        w = (_representable(rng, levels, (3, 102, 5), False) * steps).reshape(306, 5)[:301]
    else:  # a scale per column
        steps = 2.0 ** rng.integers(-3, 3, size=(1, 5))
        w = _representable(rng, levels, (301, 5), dtype is not jnp.int8) * steps
    x = normal(0, (2, 301))
    fn = lambda v, x: x @ v["w"]
    frozen = tracing.freeze(fn, {"w": w}, x, weights=dtype)
    np.testing.assert_allclose(frozen(x), x @ w, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.int4, jnp.float8_e4m3fn])
@pytest.mark.parametrize("tiny", [1e-5, 2.0**-23])
def test_tiny_channel_of_a_float16_kernel_keeps_its_value(dtype, tiny):
    """A float16 kernel's channel whose scale (amax / 448, / 127, / 7) is below float16's
    smallest value: the scale is rounded up, not to 0 (0/0 made the channel NaN or 0)."""
    w = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
    w[:, 1] = 0.0
    w[3, 1] = tiny
    fn = lambda v, x: x @ v["w"]
    x16, x32 = jnp.ones((2, 16), jnp.float16), jnp.ones((2, 16), jnp.float32)
    ref = np.asarray(fn({"w": w}, x32))
    float16_kernel = tracing.freeze(fn, {"w": jnp.asarray(w, jnp.float16)}, x16, weights=dtype)
    float16_policy = tracing.freeze(fn, {"w": w}, x32, policy=jamp.Policy(jnp.float16),
                                    weights=dtype)
    for out in (float16_kernel(x16), float16_policy(x32)):
        out = np.asarray(out, np.float32)
        assert np.all(np.isfinite(out))
        np.testing.assert_allclose(out[:, 1], ref[:, 1], rtol=0.1)


def test_convolution_kernel_layout_round_trips():
    rng = np.random.default_rng(1)
    ints = rng.integers(-127, 128, size=(3, 3, 4, 6)).astype(np.float32)
    ints[0, 0, 0, :] = 127
    k = ints * 2.0 ** rng.integers(-2, 2, size=(1, 1, 1, 6))  # a scale per output channel
    x = normal(0, (2, 8, 8, 4))
    conv = lambda v, x: jax.lax.conv_general_dilated(
        x, v["k"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    frozen = tracing.freeze(conv, {"k": k}, x, weights=jnp.int8)
    assert "int8" in const_dtypes(frozen)
    np.testing.assert_allclose(frozen(x), conv({"k": k}, x), rtol=1e-5, atol=1e-4)


class ConvBN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Conv(16, (3, 3), use_bias=False)(x)
        x = nn.relu(nn.BatchNorm(use_running_average=True)(x))
        return nn.Dense(4)(x.mean(axis=(1, 2)))


def test_batchnorm_folded_then_quantized():
    model = ConvBN()
    x = normal(0, (2, 8, 8, 3))
    variables = model.init(jax.random.key(1), x)
    stats = variables["batch_stats"]["BatchNorm_0"]
    # statistics that differ by channel: a fold scaling every channel alike is off by up to 3x
    spread = jax.device_put(np.linspace(0.5, 4.0, stats["var"].shape[-1], dtype=np.float32))
    variables = {**variables, "batch_stats": {"BatchNorm_0": {
        "mean": stats["mean"] + 0.3 * spread, "var": stats["var"] * spread}}}
    frozen = tracing.freeze(model, variables, x, weights=jnp.int8)
    names = [e.primitive.name for e in frozen.jaxpr.jaxpr.eqns]
    assert "rsqrt" not in names and names.count("conv_general_dilated") == 1
    conv = next(k for k in frozen.kernels if len(k.shape) == 4)
    assert conv.stored == "int8" and conv.granularity == "per output channel"
    assert rel_error(frozen(x), model.apply(variables, x)) <= INT8_ERROR


def test_nnx_module_kernels_by_source_line():
    model = nnx.Sequential(nnx.Linear(64, 64, rngs=nnx.Rngs(0)), nnx.relu,
                           nnx.Linear(64, 8, rngs=nnx.Rngs(1)))
    model.eval()
    x = normal(0, (3, 64))
    before = jax.tree.map(np.array, nnx.state(model))
    frozen = tracing.freeze(model, None, x, weights=jnp.int8)
    assert [k.stored for k in frozen.kernels] == ["int8", "int8"]
    assert rel_error(frozen(x), model(x)) <= INT8_ERROR
    after = nnx.state(model)
    jax.tree.map(lambda a, b: (np.testing.assert_array_equal(a, b), a.dtype == b.dtype), before,
                 jax.tree.map(np.asarray, after))


class TwoLinears(nnx.Module):
    def __init__(self, rngs):
        self.body = nnx.Linear(64, 64, rngs=rngs)
        self.head = nnx.Linear(64, 4, rngs=rngs)

    def __call__(self, x):
        h = nnx.relu(self.body(x))
        return self.head(h)


def test_nnx_kernels_are_named_by_the_users_lines():
    """NNX pushes no scope: each kernel is named by the line of the user's code that calls its
    layer (not Flax's own line, shared by every nnx.Linear), so rules and tune_weights can tell
    the layers apart."""
    model = TwoLinears(nnx.Rngs(0))
    model.eval()
    x = normal(1, (8, 64))
    body = TwoLinears.__call__.__code__.co_firstlineno + 1
    lines = [f"@test_freeze_weights.py:{body}", f"@test_freeze_weights.py:{body + 1}"]
    frozen = tracing.freeze(model, None, x)
    assert [k.scope for k in frozen.kernels] == lines
    chosen = jamp.tune_weights(frozen, x, tolerance=5e-2)
    assert [s.scope for s in chosen.scopes] == lines
    head_kept = tracing.freeze(model, None, x, weights=((lines[1], None), ("*", jnp.int8)))
    assert [k.stored for k in head_kept.kernels] == ["int8", "float32"]
    assert "test_freeze_weights.py" in head_kept.report()


class TwoEinsums(nnx.Module):
    def __init__(self, rngs):
        self.first = nnx.Einsum("bd,dk->bk", (16, 16), (16,), rngs=rngs)
        self.second = nnx.Einsum("bd,dk->bk", (16, 16), (16,), rngs=rngs)

    def __call__(self, x):
        h = self.first(x)
        return self.second(h)


class LinenEinsum(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Einsum((16, 8), "bd,dk->bk", name="proj")(x)


def test_einsum_kernels_are_named_by_the_users_scopes_and_lines():
    """jnp.einsum opens a scope named by its subscripts: both nnx.Einsum kernels were named
    'bd,dk->bk', a line rule for one of them matched nothing while '*' matched that scope, and
    a Linen Einsum was 'LinenEinsum/proj/bd,dk->bk'. That scope is JAX's, not the user's."""
    model = TwoEinsums(nnx.Rngs(0))
    x = normal(1, (4, 16))
    first = TwoEinsums.__call__.__code__.co_firstlineno + 1
    lines = [f"@test_freeze_weights.py:{first}", f"@test_freeze_weights.py:{first + 1}"]
    assert [k.scope for k in tracing.freeze(model, None, x).kernels] == lines
    with warnings.catch_warnings():
        warnings.simplefilter("error", jamp.UnmatchedRuleWarning)
        kept = tracing.freeze(model, None, x, weights=((lines[1], None), ("*", jnp.int8)))
    assert [k.stored for k in kept.kernels] == ["int8", "float32"]
    assert rel_error(kept(x), model(x)) <= INT8_ERROR
    linen = LinenEinsum()
    variables = linen.init(jax.random.key(0), x)
    frozen = tracing.freeze(linen, variables, x, weights=(("*/proj", jnp.int4),))
    assert [(k.scope, k.stored) for k in frozen.kernels] == [("LinenEinsum/proj", "int4")]


def test_polymorphic_export_loads_in_a_fresh_process(mlp, tmp_path):
    model, variables, x = mlp
    frozen = tracing.freeze(model, variables, x, weights=jnp.int4)
    blob = frozen.export(polymorphic_shapes="b, ...")
    assert len(blob) < 0.2 * len(tracing.freeze(model, variables, x).export())
    (tmp_path / "int4.bin").write_bytes(blob)
    x7 = np.random.default_rng(5).standard_normal((7, 300), np.float32)
    np.save(tmp_path / "x.npy", x7)
    script = (
        "import sys, numpy as np, tracing\n"
        "f = tracing.load(open(sys.argv[1], 'rb').read())\n"
        "np.save(sys.argv[3], np.asarray(f(np.load(sys.argv[2]))))\n"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "int4.bin"),
                    str(tmp_path / "x.npy"), str(tmp_path / "y.npy")], env=env, check=True,
                   timeout=120)
    served = np.load(tmp_path / "y.npy")
    refrozen = tracing.freeze(model, variables, x7, weights=jnp.int4)
    np.testing.assert_allclose(served, refrozen(x7), rtol=1e-5, atol=1e-5)


def test_per_scope_rules(mlp):
    model, variables, x = mlp
    frozen = tracing.freeze(model, variables, x, weights=(("*head*", None), ("*", jnp.int8)))
    assert {k.scope: k.stored for k in frozen.kernels} == {
        "MLP/body": "int8", "MLP/mid": "int8", "MLP/head": "float32"}
    frozen = tracing.freeze(model, variables, x, weights=(("*", jnp.int8), ("MLP/mid", jnp.int4)))
    assert [k.stored for k in frozen.kernels] == ["int8", "int4", "int8"]
    with pytest.warns(jamp.UnmatchedRuleWarning, match=r"rule 0 \('\*hed\*', None\) matched no "
                      r"kernel; the kernels' scopes are 'MLP/body', 'MLP/mid', 'MLP/head'"):
        frozen = tracing.freeze(model, variables, x, weights=(("*hed*", None), ("*", jnp.int8)))
    assert [k.stored for k in frozen.kernels] == ["int8"] * 3


def test_line_rules_for_code_outside_scopes():
    w1 = np.ones((16, 16), np.float32)
    w2 = np.full((16, 4), 0.5, np.float32)

    def fn(v, x):
        h = x @ v["w1"]
        return h @ v["w2"]

    x = jnp.ones((2, 16))
    line = fn.__code__.co_firstlineno + 2  # h @ v["w2"]
    rules = ((f"@test_freeze_weights.py:{line}", jnp.int4), ("*", jnp.int8))
    frozen = tracing.freeze(fn, {"w1": w1, "w2": w2}, x, weights=rules)
    assert [k.stored for k in frozen.kernels] == ["int8", "int4"]
    assert frozen.kernels[1].scope == f"@test_freeze_weights.py:{line}"


@pytest.mark.parametrize("weights, error, match", [
    (jnp.int16, ValueError, r"cannot store weights as 'int16'; weight formats are jnp.int8, "
     r"jnp.int4, jnp.float8_e4m3fn"),
    (jnp.float8_e5m2, ValueError, "e5m2 is a gradient format"),
    ("fp8", ValueError, "cannot store weights as 'fp8'"),
    ((("*", jnp.bfloat16),), ValueError, r"weights\[0\]\[1\]: cannot store weights as 'bfloat16'"),
    ((("*",),), TypeError, r"weights\[0\] must be a \(glob, dtype or None\) pair"),
    ((("@model.py", jnp.int8),), ValueError, "names a source line as '@<file>:<line>'"),
])
def test_bad_weights_name_what_was_wrong(mlp, weights, error, match):
    model, variables, x = mlp
    with pytest.raises(error, match=match):
        tracing.freeze(model, variables, x, weights=weights)


def test_no_kernel_to_quantize_says_so():
    with pytest.raises(ValueError, match="weights= found no kernel to quantize"):
        tracing.freeze(lambda v, x: x * v["s"] + 1, {"s": jnp.ones(4)}, jnp.ones(4),
                       weights=jnp.int8)


def test_no_kernel_left_names_the_kernels_kept_for_another_use():
    """A kernel also returned (or read otherwise) stays unquantized; when no other is left the
    error named no kernel and said to check for Dense/Conv layers."""
    fn = lambda p, x: (x @ p["w"], p["w"])
    p = {"w": jnp.ones((4, 3))}
    with pytest.raises(ValueError, match=r"no kernel to quantize: .*also used otherwise.*"
                                         r"\(float32\[4, 3\]\): it is also an output") as info:
        tracing.freeze(fn, p, jnp.ones((2, 4)), weights=jnp.int8)
    assert "Dense/Conv" not in str(info.value)
    gathered = lambda p, t: p["w"][t] @ p["w"]  # a gather reads the kernel too
    with pytest.raises(ValueError, match=r"\(float32\[3, 3\]\): a \w+ also reads it"):
        tracing.freeze(gathered, {"w": jnp.ones((3, 3))}, jnp.array([0, 1]), weights=jnp.int8)


def test_embeddings_biases_and_tied_kernels_stay():
    """A table read by a gather stays as frozen, also when the same constant is the output
    projection's kernel (tied); the other kernel is quantized; biases stay float32."""
    table = normal(0, (50, 32))
    w = normal(1, (32, 32))
    v = {"table": table, "w": w, "b": jnp.ones(32)}
    tokens = jnp.array([[1, 2, 3]])
    contract_features = (((2,), (1,)), ((), ()))
    fn = lambda v, t: jax.lax.dot_general(v["table"][t] @ v["w"] + v["b"], v["table"],
                                          contract_features)
    frozen = tracing.freeze(fn, v, tokens, weights=jnp.int8)
    assert [(k.shape, k.stored) for k in frozen.kernels] == [((32, 32), "int8")]
    assert sorted(compat.aval_of(c).shape for c in frozen.jaxpr.consts
                  if compat.aval_of(c).dtype == jnp.float32)[-1] == (50, 32)
    assert rel_error(frozen(tokens), fn(v, tokens)) <= INT8_ERROR


class TiedLM(nn.Module):
    @nn.compact
    def __call__(self, ids):
        embed = nn.Embed(1000, 64)
        return embed.attend(nn.Dense(64)(embed(ids)))


class TiedNNXLM(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(1000, 64, rngs=rngs)
        self.dense = nnx.Linear(64, 64, rngs=rngs)

    def __call__(self, ids):
        return self.embed.attend(self.dense(self.embed(ids)))


@pytest.mark.parametrize("weights", [None, jnp.int8])
@pytest.mark.parametrize("nnx_model", [False, True])
def test_flax_tied_embedding_is_stored_once(weights, nnx_model):
    """Flax's Embed.attend reads embedding.T: the table is stored once, as it was (not also as a
    folded, transposed copy, which weights= then quantized); the Dense kernel is quantized."""
    ids = jnp.array([[1, 5, 999], [0, 7, 42]])
    if nnx_model:
        model = TiedNNXLM(nnx.Rngs(0))
        model.eval()
        frozen, ref = tracing.freeze(model, None, ids, weights=weights), model(ids)
    else:
        model = TiedLM()
        variables = model.init(jax.random.key(0), ids)
        frozen = tracing.freeze(model, variables, ids, weights=weights)
        ref = model.apply(variables, ids)
    big = [(compat.aval_of(c).shape, str(compat.aval_of(c).dtype)) for c in frozen.jaxpr.consts
           if compat.aval_of(c).size >= 64 * 64]
    kernel = "float32" if weights is None else "int8"
    assert sorted(big) == [((64, 64), kernel), ((1000, 64), "float32")]
    assert [(k.shape, k.stored) for k in frozen.kernels] == [((64, 64), kernel)]
    assert rel_error(frozen(ids), ref) <= (1e-6 if weights is None else INT8_ERROR)


def test_hand_written_dequantization_is_not_folded_back():
    q = jnp.asarray(np.random.default_rng(0).integers(-127, 128, (64, 64)), jnp.int8)
    v = {"q": q, "scale": jnp.full((1, 64), 0.01, jnp.float32)}
    fn = lambda v, x: x @ (v["q"].astype(jnp.float32) * v["scale"])
    frozen = tracing.freeze(fn, v, jnp.ones((2, 64)))
    assert ((64, 64), "int8") in [(compat.aval_of(c).shape, str(compat.aval_of(c).dtype))
                                  for c in frozen.jaxpr.consts]
    np.testing.assert_allclose(frozen(jnp.ones((2, 64))), fn(v, jnp.ones((2, 64))), rtol=1e-6)


def test_float8_policy_stores_float8_kernels(mlp):
    model, variables, x = mlp
    f8 = tracing.freeze(model, variables, x,
                        policy=jamp.Policy(jnp.float8_e4m3fn, min_float8_flops=0))
    bf16 = tracing.freeze(model, variables, x, policy=jamp.Policy())
    assert const_dtypes(f8).count("float8_e4m3fn") == 3
    assert "float32" not in {str(compat.aval_of(c).dtype) for c in f8.jaxpr.consts
                             if compat.aval_of(c).size > 1}
    assert len(f8.export()) < 0.6 * len(bf16.export())
    assert rel_error(f8(x), model.apply(variables, x)) <= FLOAT8_ERROR


def test_float8_policy_kernels_are_listed_in_float8(mlp):
    """A float8 policy's kernels are 8-bit already: frozen.kernels listed none of them and
    report() said the program had no kernel. weights= leaves them as they are (a rule naming
    one matches it) and quantizes the kernels a size threshold kept in bfloat16."""
    model, variables, x = mlp
    f8 = tracing.freeze(model, variables, x,
                        policy=jamp.Policy(jnp.float8_e4m3fn, min_float8_flops=0))
    assert [(k.scope, k.shape, k.stored) for k in f8.kernels] == [  # (module paths, not lines)
        ("MLP/body", (300, 256), "float8_e4m3fn"), ("MLP/mid", (256, 256), "float8_e4m3fn"),
        ("MLP/head", (256, 10), "float8_e4m3fn")]
    size = 300 * 256 + 256 * 256 + 256 * 10
    assert f8.report().splitlines()[-1].startswith(f"3 kernels: {size:,} bytes stored, 0.250x")
    with pytest.raises(ValueError, match="a float8 policy stores its kernels in float8 already"):
        tracing.freeze(model, variables, x, weights=jnp.int8,
                       policy=jamp.Policy(jnp.float8_e4m3fn, min_float8_flops=0))
    # Only the body's product (2 * 4 * 300 * 256 FLOPs) reaches the threshold: mid and head
    # stay bfloat16, and weights= stores those two in int8.
    mixed = jamp.Policy(jnp.float8_e4m3fn, min_float8_flops=2 * 4 * 300 * 256)
    plain = tracing.freeze(model, variables, x, policy=mixed)
    assert [k.stored for k in plain.kernels] == ["float8_e4m3fn", "bfloat16", "bfloat16"]
    body = plain.kernels[0].scope
    with warnings.catch_warnings():
        warnings.simplefilter("error", jamp.UnmatchedRuleWarning)
        served = tracing.freeze(model, variables, x, policy=mixed,
                                weights=((body, jnp.int4), ("*", jnp.int8)))
    assert [k.stored for k in served.kernels] == ["float8_e4m3fn", "int8", "int8"]
    assert rel_error(served(x), model.apply(variables, x)) <= FLOAT8_ERROR


def test_caller_variables_unchanged(mlp):
    model, variables, x = mlp
    before = jax.tree.map(np.array, variables)
    for weights in (jnp.int8, jnp.int4, jnp.float8_e4m3fn):
        tracing.freeze(model, variables, x, weights=weights, policy=jamp.Policy()).export()
    jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, variables))
    assert jax.tree.map(lambda a: a.dtype, variables) == jax.tree.map(lambda a: a.dtype, before)


def test_tune_weights_picks_the_cheapest_within_tolerance(mlp):
    model, variables, x = mlp
    frozen = tracing.freeze(model, variables, x)
    held_out = (normal(9, x.shape),)
    # int8 errors are ~5e-3 a scope, int4's ~0.1: 5e-2 affords int8 everywhere, no int4.
    result = jamp.tune_weights(frozen, x, tolerance=5e-2, check_inputs=held_out)
    assert [s.chosen for s in result.scopes] == ["int8"] * 3
    assert all(s.sensitivity["int4"] > s.sensitivity["int8"] for s in result.scopes)
    served = tracing.freeze(model, variables, x, weights=result)
    assert [k.stored for k in served.kernels] == ["int8"] * 3
    assert result.error <= 5e-2 and result.check_error <= 5e-2
    assert rel_error(served(held_out[0]), frozen(held_out[0])) <= 5e-2
    assert result.nbytes == sum(k.nbytes for k in served.kernels)
    assert "MLP/mid" in str(result)
    # No budget: every kernel as frozen; any budget: every kernel in int4, the cheapest.
    assert {s.chosen for s in jamp.tune_weights(frozen, x, tolerance=0).scopes} == {"frozen"}
    cheapest = jamp.tune_weights(frozen, x, candidates=jnp.int4, tolerance=float("inf"))
    assert {s.chosen for s in cheapest.scopes} == {"int4"}


def test_tune_weights_errors(mlp):
    model, variables, x = mlp
    with pytest.raises(TypeError, match="frozen must be a tracing.freeze"):
        jamp.tune_weights(model.apply, x)
    quantized = tracing.freeze(model, variables, x, weights=jnp.int8)
    with pytest.raises(ValueError, match="frozen with weights= already"):
        jamp.tune_weights(quantized, x)
    frozen = tracing.freeze(model, variables, x)
    with pytest.raises(ValueError, match="cannot store weights as 'bfloat16'"):
        jamp.tune_weights(frozen, x, candidates=jnp.bfloat16)
    # A calibration batch of another size says what to do; tolerance errors are tune_weights'.
    with pytest.raises(ValueError, match=r"inputs\[0\] has shape \(2, 300\).*\(4, 300\); "
                                         r"tune_weights runs the program as it was frozen"):
        jamp.tune_weights(frozen, x[:2])
    with pytest.raises(ValueError, match=r"check_inputs\): inputs\[0\] .*calibrate at those"):
        jamp.tune_weights(frozen, x, check_inputs=(x[:2],))
    for tolerance in (-1, float("nan")):
        with pytest.raises(ValueError, match=r"^tune_weights: tolerance must be >= 0 \(the "
                                             r"largest relative error of the outputs"):
            jamp.tune_weights(frozen, x, tolerance=tolerance)
    with pytest.raises(TypeError, match=r"^tune_weights: tolerance must be a number"):
        jamp.tune_weights(frozen, x, tolerance="small")


def test_weight_rules_match_as_policy_rules():
    rules = qw.weight_rules((("*head*", None), ("*", jnp.int8)))
    assert qw.decide(rules, ("M", "head"), ())[1] is None
    assert qw.decide(rules, ("M", "body"), ())[1] == np.int8
    assert qw.decide(rules, (), ())[1] == np.int8  # '*' covers kernels outside scopes
    assert qw.decide(qw.weight_rules((("M/*", jnp.int4),)), ("N", "x"), ())[0] is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert qw.weight_rules(jnp.int4) == (("*", np.dtype(jnp.int4)),)


def test_report_lists_kernels_and_totals(mlp):
    model, variables, x = mlp
    report = tracing.freeze(model, variables, x, weights=(("*head*", None),
                                                          ("*", jnp.int8))).report()
    lines = report.splitlines()
    assert lines[1].split()[:2] == ["MLP/body", "(300,"] and "int8" in lines[1]
    assert "per output channel" in lines[1] and "float32" in lines[3]
    size = 300 * 256 + 256 * 256 + 256 * 10
    stored = 300 * 256 + 256 * 4 + 256 * 256 + 256 * 4 + 256 * 10 * 4
    assert lines[-1] == (f"3 kernels: {stored:,} bytes stored, {stored / (4 * size):.3f}x of "
                         f"float32 ({4 * size:,}), {stored / (2 * size):.3f}x of bfloat16 "
                         f"({2 * size:,})")
    plain = tracing.freeze(model, variables, x)
    assert [k.stored for k in plain.kernels] == ["float32"] * 3 and "1.000x of float32" in \
        plain.report()
