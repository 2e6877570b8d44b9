"""jamp.tune: per-scope precision chosen from measured sensitivity and modelled cost."""
import math
import sys

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jamp

F16, BF16, F8 = np.dtype(jnp.float16), np.dtype(jnp.bfloat16), np.dtype(jnp.float8_e4m3fn)


def hostile(params, x):
    """Three scopes; "big" makes activations of about 1e6, past float16's 65504."""
    with jax.named_scope("a"):
        h = jnp.tanh(x @ params["a"])
    with jax.named_scope("big"):
        g = (1e3 * h) @ (1e3 * params["big"])
    with jax.named_scope("c"):
        y = (g * 1e-6) @ params["c"]
    return jnp.mean(y**2)


def benign(params, x):
    with jax.named_scope("a"):
        h = jnp.tanh(x @ params["a"])
    with jax.named_scope("b"):
        h = jnp.tanh(h @ params["big"])
    with jax.named_scope("c"):
        y = h @ params["c"]
    return jnp.mean(y**2)


def make_params(width=16, batch=8, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    params = {n: jax.random.normal(k, (width, width)) / 4 for n, k in zip(("a", "big", "c"), keys)}
    return params, jax.random.normal(keys[3], (batch, width))


def relative(values, refs):
    values, refs = jax.tree.leaves(values), jax.tree.leaves(refs)
    num = sum(float(np.sum((np.float64(v) - np.float64(r)) ** 2)) for v, r in zip(values, refs))
    den = sum(float(np.sum(np.float64(r) ** 2)) for r in refs)
    return math.sqrt(num / den)


def finite_step(fn, policy, *args):
    """Whether the loss and gradients of ``fn`` under ``policy`` are all finite."""
    step = jax.jit(jax.value_and_grad(jamp.autocast_transform(fn, policy)))(*args)
    return all(bool(jnp.all(jnp.isfinite(leaf))) for leaf in jax.tree.leaves(step))


def measured_error(fn, policy, *args):
    """max(relative error of the loss, of its gradient) against float32: what tune measures."""
    reference = jax.jit(jax.value_and_grad(jamp.autocast_transform(fn, jnp.float32)))(*args)
    tuned = jax.jit(jax.value_and_grad(jamp.autocast_transform(fn, policy)))(*args)
    return max(relative(tuned[0], reference[0]), relative(tuned[1], reference[1]))


@pytest.fixture(scope="module")
def float16_result():
    params, x = make_params()
    return jamp.tune(hostile, params, x, candidates=(jnp.float16,), tolerance=1e-2), (params, x)


def chosen(result):
    return {row.scope: row.chosen for row in result.scopes}


# --- the goals of issue 22 -----------------------------------------------------------------------


def test_the_scope_that_overflows_float16_alone_stays_float32(float16_result):
    result, (params, x) = float16_result
    assert chosen(result) == {"a": "float16", "big": "float32", "c": "float16"}
    assert result.policy.rules == (("a", F16), ("c", F16))
    assert result.policy.compute_dtype == np.float32
    big = next(row for row in result.scopes if row.scope == "big")
    assert big.sensitivity["float16"] == math.inf  # inf/NaN: infeasible, whatever the budget
    assert "inf/NaN" in big.why
    assert 0 < result.error <= 1e-2
    # The tuned policy runs finite where float16 everywhere does not.
    assert not finite_step(hostile, jamp.Policy(jnp.float16), params, x)
    assert finite_step(hostile, result.policy, params, x)


def test_applying_the_policy_reproduces_its_error(float16_result):
    result, (params, x) = float16_result
    np.testing.assert_allclose(measured_error(hostile, result.policy, params, x), result.error,
                               rtol=1e-4)


def test_tolerance_zero_keeps_every_scope_float32():
    params, x = make_params()
    result = jamp.tune(benign, params, x, candidates=(jnp.bfloat16, jnp.float16), tolerance=0)
    assert set(chosen(result).values()) == {"float32"}
    assert result.policy == jamp.Policy(jnp.float32)
    assert result.error == 0 and result.low_precision_flop_share == 0
    assert result.speedup_over_float32 == pytest.approx(1.0)
    assert all(row.sensitivity["bfloat16"] > 0 for row in result.scopes)


def test_infinite_tolerance_gives_every_scope_the_cheapest_candidate():
    params, x = make_params()
    base = jamp.Policy(min_float8_flops=0)  # these matmuls are tiny; float8 them anyway
    result = jamp.tune(benign, params, x, candidates=(jnp.bfloat16, jnp.float8_e4m3fn),
                       tolerance=math.inf, policy=base)
    assert set(chosen(result).values()) == {"float8_e4m3fn"}
    assert result.float8_flop_share == 1.0
    assert math.isfinite(result.error) and result.error > 0
    # float8 has twice bfloat16's peak on the H100 table (these tiny products are bound by
    # memory, so less): the base policy is bfloat16.
    assert 1 < result.estimated_speedup <= 2
    assert result.policy.min_float8_flops == 0  # the base policy's other fields are kept
    np.testing.assert_allclose(measured_error(benign, result.policy, params, x), result.error,
                               rtol=1e-4)


def test_float8_below_min_float8_flops_runs_as_bfloat16_and_is_not_run_again():
    params, x = make_params()
    result = jamp.tune(benign, params, x, candidates=(jnp.float8_e4m3fn, jnp.bfloat16),
                       tolerance=math.inf)
    for row in result.scopes:
        assert row.runs_as == {"float8_e4m3fn": "bfloat16"}
        assert row.sensitivity["float8_e4m3fn"] == row.sensitivity["bfloat16"]
        assert row.chosen == "bfloat16"
    assert result.runs == 1 + 3 + 1  # reference, one sensitivity per scope, one verification
    assert "=bf16" in str(result)


# --- scopes: Flax linen paths, NNX source lines ----------------------------------------------------


class Inner(nn.Module):
    scale: float = 1.0

    @nn.compact
    def __call__(self, x):
        return nn.Dense(x.shape[-1], name="proj")(x * self.scale)


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.normal(0.3), (x.shape[-1], x.shape[-1]))
        h = jnp.tanh(x @ w)                      # a matmul of the block itself
        h = Inner(scale=1e3, name="hot")(h)      # activations of about 1e3 * 1e3
        return Inner(name="cool")(h * 1e-6)


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = Block(name="block")(x)
        return nn.Dense(4, name="head")(x)


def test_nested_linen_scopes_get_rules_and_a_lowered_parent_keeps_a_hot_child_float32():
    model = Net()
    x = jax.random.normal(jax.random.key(1), (8, 16))
    variables = jax.jit(model.init)(jax.random.key(0), x)  # (eagerly: a program per operation)
    loss = lambda variables, x: jnp.mean(model.apply(variables, x) ** 2)
    kernel = variables["params"]["block"]["hot"]["proj"]["kernel"]
    variables["params"]["block"]["hot"]["proj"]["kernel"] = kernel * 1e3
    result = jamp.tune(loss, variables, x, candidates=(jnp.float16,), tolerance=5e-2)
    assert chosen(result) == {"Net/block": "float16", "Net/block/hot/proj": "float32",
                              "Net/block/cool/proj": "float16", "Net/head": "float16"}
    # The block's rule would lower its children: the hot one gets a float32 rule of its own.
    assert ("Net/block/hot/proj", np.dtype(np.float32)) in result.policy.rules
    np.testing.assert_allclose(measured_error(loss, result.policy, variables, x), result.error,
                               rtol=1e-4)


class TwoLayers(nnx.Module):
    def __init__(self, rngs):
        self.first = nnx.Linear(16, 16, rngs=rngs)
        self.second = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        h = self.first(x * 100.0) * 1e-6    # NNX_FIRST: about 1e6 before scaling, past float16
        return self.second(jnp.tanh(h))     # NNX_SECOND


def _line_of(marker):
    source = open(__file__).read().splitlines()
    return next(i for i, line in enumerate(source, 1) if f"# {marker}" in line)


def test_an_nnx_module_is_tuned_per_source_line_of_your_code():
    model = TwoLayers(nnx.Rngs(0))
    model.first.kernel[...] = model.first.kernel[...] * 1e3
    x = jax.random.normal(jax.random.key(1), (8, 16))
    loss = lambda model, x: jnp.mean(model(x) ** 2)
    result = jamp.tune(loss, model, x, candidates=(jnp.float16,), tolerance=1e-2)
    first, second = (f"@test_tune.py:{_line_of(m)}" for m in ("NNX_FIRST", "NNX_SECOND"))
    assert chosen(result) == {first: "float32", second: "float16"}
    assert result.policy.rules == ((second, F16),)
    before = jax.tree.map(lambda a: a.copy(), nnx.state(model))
    tuned = jamp.autocast_transform(lambda m, x: m(x), result.policy)(model, x)
    assert tuned.dtype == jnp.float16            # the second layer ran in float16
    assert bool(jnp.all(jnp.isfinite(tuned)))
    chex.assert_trees_all_equal(nnx.state(model), before)   # tune changed nothing of the module
    np.testing.assert_allclose(measured_error(loss, result.policy, model, x), result.error,
                               rtol=1e-4)


# --- verification on held-out inputs, and what the result shows -------------------------------------


def test_check_args_back_off_a_scope_that_overflows_only_on_held_out_inputs():
    params, x = make_params()
    held_out = (params, x * 1e5)   # scope "a"'s matmul overflows float16 on these only
    result = jamp.tune(benign, params, x, candidates=(jnp.float16,), tolerance=1e-2,
                       check_args=held_out)
    assert chosen(result)["a"] == "float32"
    assert "backed off from float16" in next(r.why for r in result.scopes if r.scope == "a")
    assert result.verifications >= 2
    assert result.check_error is not None and result.check_error <= 1e-2
    assert finite_step(benign, result.policy, *held_out)


def test_grad_false_measures_the_outputs_only_and_a_device_table_of_your_own():
    params, x = make_params()
    logits = lambda params, x: benign(params, x) * jnp.ones(3)  # not a scalar: fine without grad
    mine = jamp.DeviceSpeeds("mine", {"float32": 1e12, "float16": 4e12}, 1e15)
    result = jamp.tune(logits, params, x, candidates=(jnp.float16,), tolerance=math.inf,
                       grad=False, device=mine)
    out32 = jamp.autocast_transform(logits, jnp.float32)(params, x)
    out = jamp.autocast_transform(logits, result.policy)(params, x)
    np.testing.assert_allclose(relative(out, out32), result.error, rtol=1e-4)
    assert result.speedup_over_float32 == pytest.approx(4.0)   # bound by FLOPs on "mine"
    assert "mine speeds (given)" in str(result)


def test_the_table_and_the_plot(float16_result, monkeypatch):
    result, _ = float16_result
    text = str(result)
    for needle in ("scope", "FLOPs", "sens f16", "chosen", "why", "inf/NaN", "big", "33.3%",
                   "speedup", "H100"):
        assert needle in text
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    ax = result.plot()
    assert [t.get_text() for t in ax.get_yticklabels()] == [
        "a -> float16", "big -> float32", "c -> float16"]
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        result.plot()


def test_scopes_restricts_what_is_tuned_and_policy_rules_are_kept():
    params, x = make_params()
    base = jamp.Policy(rules=(("c", None),))   # yours: "c" stays as you said
    result = jamp.tune(benign, params, x, candidates=(jnp.bfloat16,), tolerance=1.0,
                       scopes=["a"], policy=base)
    rows = {r.scope: r for r in result.scopes}
    assert rows["a"].chosen == "bfloat16"
    assert rows["b"].chosen == "float32" and rows["b"].why == "not in scopes="
    assert rows["c"].chosen == "float32" and "rule 'c'" in rows["c"].why
    assert result.policy.rules == (("c", None), ("a", BF16))


def test_device_tables():
    from jamp.tune import DEVICE_SPEEDS

    h100, a100 = DEVICE_SPEEDS["h100"], DEVICE_SPEEDS["a100"]
    big = 2 * 8192**3   # a compute-bound GEMM: FLOPs over peak decide
    assert h100.seconds(big, 0, BF16) == pytest.approx(h100.seconds(big, 0, np.float32) / 2)
    assert h100.seconds(big, 0, F8) == pytest.approx(h100.seconds(big, 0, BF16) / 2, rel=1e-3)
    # No float8 tensor cores on an A100: float8 products run at bfloat16's speed.
    assert a100.seconds(big, 0, F8) == a100.seconds(big, 0, BF16)
    assert h100.seconds(2, 3.35e12, jnp.float32) == 1.0  # bound by memory: bytes over bandwidth


# --- errors in the caller's terms ---------------------------------------------------------------


@pytest.mark.parametrize("tolerance, error, match", [
    (-1e-3, ValueError, "tolerance must be >= 0"),
    (float("nan"), ValueError, "tolerance must be >= 0"),
    (-math.inf, ValueError, "tolerance must be >= 0"),
    ("1e-2", TypeError, "tolerance must be a number"),
    (lambda: jnp.float32(-1e-3), ValueError, "tolerance must be >= 0"),  # read as a number
    (lambda: jnp.ones(2), TypeError, "tolerance must be a number"),
])
def test_bad_tolerance(tolerance, error, match):
    params, x = make_params()
    tolerance = tolerance() if callable(tolerance) else tolerance  # (arrays made in the test)
    with pytest.raises(error, match=match):
        jamp.tune(benign, params, x, tolerance=tolerance)


@pytest.mark.parametrize("candidates, match", [
    ((jnp.int8,), "unknown candidate dtype"),
    ((jnp.float8_e5m2,), "e5m2 is its gradient format"),
    ((jnp.float32,), "float32 is not a candidate"),
    ((), "candidates is empty"),
    (("bf16",), "unknown candidate dtype 'bf16'"),
])
def test_bad_candidates(candidates, match):
    params, x = make_params()
    with pytest.raises(ValueError, match=match):
        jamp.tune(benign, params, x, candidates=candidates)


def test_other_bad_input_is_named():
    params, x = make_params()
    with pytest.raises(TypeError, match="tune expects a callable"):
        jamp.tune("benign", params, x)
    with pytest.raises(ValueError, match=r"scopes glob 'haed' matches no scope.*'a', 'b', 'c'"):
        jamp.tune(benign, params, x, scopes="haed")
    with pytest.raises(ValueError, match="no matmul or convolution"):
        jamp.tune(lambda p, x: jnp.sum(jnp.tanh(x)), params, x)
    with pytest.raises(TypeError, match="check_args must be a tuple"):
        jamp.tune(benign, params, x, check_args=x)
    with pytest.raises(ValueError, match="check_args has 1 positional"):
        jamp.tune(benign, params, x, check_args=(params,))
    with pytest.raises(ValueError, match="grad=2 names argument 2"):
        jamp.tune(benign, params, x, grad=2)
    with pytest.raises(ValueError, match="grad=-3 names argument -3"):  # (was an IndexError)
        jamp.tune(benign, params, x, grad=-3)
    # Integer token ids first: no gradient was measured and any policy passed (jax.grad refuses)
    tokens = jnp.arange(np.size(x)).reshape(np.shape(x)) % 3
    with pytest.raises(ValueError, match=r"grad=True differentiates argument 0, which has no "
                                         r"floating leaf.*grad=1"):
        jamp.tune(lambda t, p: benign(p, t.astype(jnp.float32)), tokens, params)
    with pytest.raises(ValueError, match="device=.*'tpu'"):
        jamp.tune(benign, params, x, device="tpu")
    # the tuned policy computes in float32 where a scope stays so, and measures against float32:
    # a narrower accumulation or gradient reduction would have applied there (reduce_dtype:
    # Policy's own error, about a float32 policy the caller never wrote)
    for field, narrow in (("accumulate_dtype", jnp.bfloat16), ("reduce_dtype", jnp.bfloat16)):
        with pytest.raises(ValueError, match=rf"tune: policy\.{field}=\w+ is narrower than "
                                             rf"float32.*{field}=None"):
            jamp.tune(benign, params, x, policy=jamp.Policy(**{field: narrow}))
    with pytest.raises(ValueError, match="benign's output is not finite in float32 already"):
        jamp.tune(benign, params, x.at[0, 0].set(jnp.nan))

    def root(params, x):
        return jnp.sum(jnp.sqrt(jnp.abs(x @ params["a"])))   # sqrt'(0) is inf

    with pytest.raises(ValueError, match=r"root's gradient of args\[0\]\['a'\] is not finite"):
        jamp.tune(root, params, x.at[0].set(0.0))
