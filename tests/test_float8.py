"""float8 autocast: ``Policy(jnp.float8_e4m3fn)`` (jamp/rules/float8.py), issue 16.

The reference is written independently of jamp's QDQ form: a float8 ``dot_general`` on the
quantized operands accumulating in float32, rescaled by the product of the two scales.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jamp
from tests.host_data import normal
from tests.hypothesis_profiles import examples
from tests.jaxpr_utils import eqns_named, iter_eqns

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
# The tests' matmuls are tiny: min_float8_flops=0 puts them in float8 (the default keeps
# matmuls below 2 * 4096**3 FLOPs in bfloat16, tested at the end).
FP8 = jamp.Policy(E4M3, min_float8_flops=0)
DOT = (((1,), (0,)), ((), ()))


def ref_quantize(x, fmt):
    """numpy/ml_dtypes per-tensor scaling: scale = amax / fmax, q = clip(x / scale)."""
    x = np.asarray(x, np.float32)
    fmax = float(jnp.finfo(fmt).max)
    amax = float(np.max(np.abs(x)))
    scale = np.float32(1.0 if amax == 0 else amax / fmax)
    return np.clip(x / scale, -fmax, fmax).astype(fmt), scale


def ref_fp8_matmul(x, w, x_fmt=E4M3, w_fmt=E4M3):
    qx, sx = ref_quantize(x, x_fmt)
    qw, sw = ref_quantize(w, w_fmt)
    acc = jax.lax.dot_general(jax.device_put(qx), jax.device_put(qw), DOT,
                              preferred_element_type=jnp.float32)
    return np.asarray(acc) * (sx * sw)


def converts_to(jaxpr, dtype):
    return [e for e in eqns_named(jaxpr, "convert_element_type")
            if e.params["new_dtype"] == np.dtype(dtype)]


def cosine(a, b):
    a, b = np.ravel(np.asarray(a, np.float64)), np.ravel(np.asarray(b, np.float64))
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


# --- the policy -------------------------------------------------------------------------------

def test_policy_float8_values_are_bfloat16():
    assert FP8.compute_dtype == np.dtype(E4M3)
    assert FP8.value_dtype == np.dtype(jnp.bfloat16)
    assert jamp.Policy(jnp.float16).value_dtype == np.dtype(jnp.float16)
    assert repr(jamp.Policy(E4M3)) == "Policy(jnp.float8_e4m3fn)"
    assert repr(FP8) == "Policy(jnp.float8_e4m3fn, min_float8_flops=0)"


@pytest.mark.parametrize("kwargs, field", [
    ({"compute_dtype": E5M2}, "compute_dtype"),
    ({"compute_dtype": E4M3, "output_dtype": E4M3}, "output_dtype"),
    ({"compute_dtype": E4M3, "accumulate_dtype": E5M2}, "accumulate_dtype"),
    ({"compute_dtype": E4M3, "rules": (("head", E5M2),)}, "rules[0][1]"),
])
def test_policy_rejects_other_float8_uses(kwargs, field):
    with pytest.raises(ValueError, match=re.escape(field) + ".*float8"):
        jamp.Policy(**kwargs)


# --- forward ----------------------------------------------------------------------------------

def test_forward_program_quantizes_both_operands_to_e4m3():
    x, w = normal(0, (8, 32)), normal(1, (32, 16))
    fn = jamp.autocast_transform(lambda x, w: jnp.tanh(x @ w), FP8)
    jaxpr = jax.make_jaxpr(fn)(x, w)
    assert len(converts_to(jaxpr, E4M3)) == 2 and not converts_to(jaxpr, E5M2)
    (dot,) = eqns_named(jaxpr, "dot_general")
    # the dot reads the float8 operands and accumulates into bfloat16
    assert [v.aval.dtype for v in dot.invars] == [np.dtype(E4M3)] * 2
    assert dot.outvars[0].aval.dtype == np.dtype(jnp.bfloat16)
    # every other op follows the bfloat16 tables: tanh bfloat16, the amax reductions float32
    assert {e.outvars[0].aval.dtype for e in eqns_named(jaxpr, "tanh")} == {np.dtype(jnp.bfloat16)}
    assert {e.outvars[0].aval.dtype for e in eqns_named(jaxpr, "reduce_max")} == {np.dtype(np.float32)}


def test_forward_matches_hand_written_scaled_reference():
    x, w = normal(0, (16, 64)), normal(1, (64, 32), scale=0.05)
    got = jamp.autocast_transform(lambda x, w: x @ w, FP8)(x, w)
    want = ref_fp8_matmul(x, w)
    # jamp dequantizes into bfloat16 before a bfloat16 dot: each operand and the output are
    # rounded to bfloat16 once more (relative 2**-8 each) on top of the shared float8 values.
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2e-2,
                               atol=2e-2 * float(np.abs(want).max()))
    # and float8 really lost precision against float32 (the test can tell the two apart)
    assert float(np.abs(np.asarray(x @ w) - want).max()) > 1e-3


def test_accumulate_dtype_float32_output():
    x, w = normal(0, (4, 8)), normal(1, (8, 4))
    out = jamp.autocast_transform(lambda x, w: x @ w, FP8.replace(accumulate_dtype=jnp.float32))(x, w)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, ref_fp8_matmul(x, w), rtol=1e-2, atol=1e-2)


def test_outlier_saturates_nothing_to_inf():
    x = normal(0, (8, 64)).at[3, 5].set(1e6)   # far beyond float8_e4m3fn's 448
    w = normal(1, (64, 8))
    out = jamp.autocast_transform(lambda x, w: x @ w, FP8)(x, w)
    assert bool(jnp.all(jnp.isfinite(out)))
    # the outlier's row is dominated by it and keeps its magnitude
    np.testing.assert_allclose(np.asarray(out[3], np.float32), 1e6 * np.asarray(w[5]), rtol=0.1)


def test_zero_tensor_and_nonfinite_input():
    fn = jamp.autocast_transform(lambda x, w: x @ w, FP8)
    w = normal(1, (8, 4))
    assert bool(jnp.all(fn(jnp.zeros((2, 8)), w) == 0))      # amax 0: scale 1, no 0/0
    out = fn(jnp.ones((2, 8)).at[0, 0].set(jnp.inf), w)
    assert not bool(jnp.all(jnp.isfinite(out)))                 # an inf is not clamped away


def test_convolution_matches_reference():
    x = normal(0, (2, 9, 9, 3))
    k = normal(1, (3, 3, 3, 8), scale=0.3)
    dims = ("NHWC", "HWIO", "NHWC")
    conv = lambda x, k, **kw: jax.lax.conv_general_dilated(x, k, (1, 1), "SAME",
                                                            dimension_numbers=dims, **kw)
    got = jamp.autocast_transform(conv, FP8)(x, k)
    (qx, sx), (qk, sk) = ref_quantize(x, E4M3), ref_quantize(k, E4M3)
    want = np.asarray(conv(jax.device_put(qx), jax.device_put(qk),
                           preferred_element_type=jnp.float32)) * (sx * sk)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2e-2,
                               atol=2e-2 * float(np.abs(want).max()))


def test_integer_operand_runs_in_bfloat16():
    mask = jnp.ones((4, 8), jnp.int32)
    fn = jamp.autocast_transform(lambda m, w: jnp.einsum("ij,jk->ik", m, w), FP8)
    jaxpr = jax.make_jaxpr(fn)(mask, normal(1, (8, 4)))
    assert not converts_to(jaxpr, E4M3)
    assert fn(mask, normal(1, (8, 4))).dtype == jnp.bfloat16


def test_rule_keeps_a_scope_in_bfloat16():
    def f(x, w1, w2):
        with jax.named_scope("head"):
            return (x @ w1) @ w2
    x, w1, w2 = normal(0, (4, 8)), normal(1, (8, 8)), normal(2, (8, 4))
    fn = jamp.autocast_transform(lambda x, w1, w2: f(jnp.tanh(x @ w1), w1, w2),
                                 FP8.replace(rules=(("head", jnp.bfloat16),)))
    jaxpr = jax.make_jaxpr(fn)(x, w1, w2)
    assert len(eqns_named(jaxpr, "dot_general")) == 3
    assert len(converts_to(jaxpr, E4M3)) == 2     # only the dot outside the scope


# --- backward ---------------------------------------------------------------------------------

def loss(w, x):
    return jnp.sum(jnp.tanh(x @ w) ** 2)


@pytest.mark.parametrize("order", ["grad_outside", "grad_inside"])
def test_backward_uses_e5m2_cotangents_and_f32_gradients(order):
    x, w = normal(0, (16, 32)), normal(1, (32, 8), scale=0.2)
    if order == "grad_outside":
        grad = jax.grad(jamp.autocast_transform(loss, FP8))
    else:
        grad = jamp.autocast_transform(jax.grad(loss), FP8)
    jaxpr = jax.make_jaxpr(grad)(w, x)
    assert converts_to(jaxpr, E5M2), "the cotangent was not scaled to e5m2"
    g = grad(w, x)
    if order == "grad_outside":
        assert g.dtype == jnp.float32    # the parameter's dtype
    assert bool(jnp.all(jnp.isfinite(g)))
    assert cosine(g, jax.grad(loss)(w, x)) > 0.99


def test_both_orders_agree():
    x, w = normal(0, (16, 32)), normal(1, (32, 8), scale=0.2)
    outside = jax.grad(jamp.autocast_transform(loss, FP8))(w, x)
    inside = jamp.autocast_transform(jax.grad(loss), FP8)(w, x)
    np.testing.assert_allclose(np.asarray(outside), np.asarray(inside, np.float32),
                               rtol=2e-2, atol=1e-2 * float(jnp.abs(outside).max()))


def test_backward_matches_hand_written_reference():
    """dL/dw of sum((x @ w) * c) is x^T (c in e5m2): the reference quantizes x to e4m3 and the
    cotangent c to e5m2, each per tensor, and multiplies them in float32."""
    x, w = normal(0, (16, 32)), normal(1, (32, 8))
    c = normal(2, (16, 8), scale=1e-3)      # small cotangents: e5m2's range matters here
    g = jax.grad(jamp.autocast_transform(lambda w: jnp.sum((x @ w) * c), FP8))(w)
    (qx, sx), (qc, sc) = ref_quantize(x, E4M3), ref_quantize(c, E5M2)
    want = np.asarray(jax.lax.dot_general(jax.device_put(qx), jax.device_put(qc),
                                          (((0,), (0,)), ((), ())),
                                          preferred_element_type=jnp.float32)) * (sx * sc)
    np.testing.assert_allclose(np.asarray(g), want, rtol=3e-2, atol=3e-2 * float(np.abs(want).max()))


def test_composes_with_jit_and_vmap():
    x, w = normal(0, (3, 4, 8)), normal(1, (8, 4))
    fn = jamp.autocast_transform(lambda x, w: x @ w, FP8)
    eager = fn(x[0], w)
    np.testing.assert_array_equal(np.asarray(jax.jit(fn)(x[0], w)), np.asarray(eager))
    batched = jax.vmap(fn, in_axes=(0, None))(x, w)
    # under vmap a tensor is one example's slice: each is scaled by its own amax
    for i in range(3):
        np.testing.assert_allclose(np.asarray(batched[i], np.float32),
                                   ref_fp8_matmul(x[i], w), rtol=2e-2, atol=5e-2)


def test_explain_reports_float8_share():
    x, w = normal(0, (4, 8)), normal(1, (8, 4))
    report = jamp.explain(lambda x, w: jnp.tanh(x @ w) @ w.T, x, w, policy=FP8)
    assert report.float8_flop_share == 1.0
    assert set(report.flops) == {"float8_e4m3fn"}
    assert "float8: 100.0%" in str(report)
    assert jamp.explain(lambda x, w: x @ w, x, w, policy=jamp.Policy()).float8_flop_share == 0.0
    backward = jamp.explain(jax.grad(loss), w, x, policy=FP8)
    assert set(backward.flops) == {"float8_e4m3fn", "float8_e5m2"}


# --- the HLO pattern XLA's GPU GEMM rewriter folds into a float8 GEMM -------------------------

def test_stablehlo_has_the_float8_gemm_pattern():
    """What XLA's GPU GEMM rewriter folds into one cuBLASLt float8 GEMM (Flax's
    Fp8DirectDotGeneralOp emits the same): each operand divided by its scale, clamped and
    converted to f8E4M3FN; a dot_general of the two f8 tensors into bf16; the product multiplied
    by the (broadcast) product of the scales."""
    x, w = normal(0, (16, 32)), normal(1, (32, 8))
    text = jax.jit(jamp.autocast_transform(lambda x, w: x @ w, FP8)).lower(x, w).as_text()
    to_fp8 = re.findall(r"(%\S+) = stablehlo\.convert (%\S+) : \(tensor<[\dx]+xf32>\) -> "
                        r"tensor<[\dx]+xf8E4M3FN>", text)
    assert len(to_fp8) == 2
    clamped = set(re.findall(r"(%\S+) = stablehlo\.clamp", text))
    assert {src for _, src in to_fp8} <= clamped
    ((dot, lhs, rhs, types),) = re.findall(
        r"(%\S+) = stablehlo\.dot_general (%\S+), (%\S+), .*: \((.*)\) -> tensor<16x8xbf16>", text)
    assert {lhs, rhs} == {q for q, _ in to_fp8}
    assert types.count("f8E4M3FN") == 2
    (scaled,) = re.findall(rf"%\S+ = stablehlo\.multiply {re.escape(dot)}, (%\S+)", text)
    assert re.search(rf"{re.escape(scaled)} = stablehlo\.broadcast_in_dim %\S+, dims = \[\]", text)


def test_backward_dots_read_e5m2_and_e4m3_operands():
    x, w = normal(0, (16, 32)), normal(1, (32, 8))
    text = jax.jit(jax.grad(jamp.autocast_transform(loss, FP8), argnums=(0, 1))).lower(w, x).as_text()
    dots = re.findall(r"stablehlo\.dot_general .*: \((.*)\) -> tensor<\S+>", text)
    assert len(dots) == 3
    assert sum("f8E5M2" in t and "f8E4M3FN" in t for t in dots) == 2   # dgrad and wgrad


# --- property ---------------------------------------------------------------------------------

@settings(max_examples=examples(12), deadline=None)
@given(m=st.integers(1, 6), k=st.integers(1, 40), n=st.integers(1, 6),
       log_scale=st.floats(-6, 6), seed=st.integers(0, 2**16))
def test_property_finite_and_close_to_reference(m, k, n, log_scale, seed):
    x = normal(seed, (m, k), scale=10.0 ** log_scale)
    w = normal(seed + 1, (k, n))
    out = np.asarray(jamp.autocast_transform(lambda x, w: x @ w, FP8)(x, w), np.float32)
    assert np.all(np.isfinite(out))
    want = ref_fp8_matmul(x, w)
    bound = 2e-2 * (np.abs(np.asarray(x)) @ np.abs(np.asarray(w))) + 1e-30
    assert np.all(np.abs(out - want) <= bound + 2e-2 * np.abs(want))


def test_no_fp8_ops_without_float8_policy():
    x, w = normal(0, (4, 8)), normal(1, (8, 4))
    jaxpr = jax.make_jaxpr(jamp.autocast_transform(jax.grad(loss)))(w, x)
    assert not any(e.primitive.name == "custom_vjp_call" for e in iter_eqns(jaxpr))
    assert not converts_to(jaxpr, E4M3) and not converts_to(jaxpr, E5M2)


# --- which products run in float8 -------------------------------------------------------------

def attention_loss(params, x):
    wq, wk, wv, w2 = params
    q, k, v = x @ wq, x @ wk, x @ wv
    scores = jax.nn.softmax(q @ k.T)          # two activations: stays bfloat16
    return jnp.sum(jnp.tanh((scores @ v) @ w2))


def dot_operand_dtypes(jaxpr):
    return sorted(tuple(v.aval.dtype.name for v in e.invars) for e in eqns_named(jaxpr, "dot_general"))


# The eager attention gradient under grad_outside compiles ~100 ops; fast twins for that order:
# test_backward_uses_e5m2_cotangents_and_f32_gradients[grad_outside], test_both_orders_agree.
@pytest.mark.parametrize("order", [pytest.param("grad_outside", marks=pytest.mark.slow),
                                   "grad_inside"])
def test_only_products_with_a_weight_run_in_float8(order):
    x = normal(0, (8, 16))
    params = tuple(normal(i, shape, scale=0.25) for i, shape in
                   enumerate([(16, 16), (16, 16), (16, 16), (16, 4)], start=1))
    grad = (jax.grad(jamp.autocast_transform(attention_loss, FP8)) if order == "grad_outside"
            else jamp.autocast_transform(jax.grad(attention_loss), FP8))
    dtypes = dot_operand_dtypes(jax.make_jaxpr(grad)(params, x))
    fp8 = [d for d in dtypes if any(n.startswith("float8") for n in d)]
    bf16 = [d for d in dtypes if d == ("bfloat16", "bfloat16")]
    # forward: q, k, v and the head in float8, q @ k.T and scores @ v in bfloat16; backward: the
    # transposes of the float8 dots read an e5m2 cotangent, the attention products' transposes
    # (two each) stay bfloat16.
    assert dtypes.count(("float8_e4m3fn", "float8_e4m3fn")) == 4
    assert all("float8_e5m2" in d for d in fp8 if d != ("float8_e4m3fn", "float8_e4m3fn"))
    assert len(fp8) > 4
    assert len(bf16) == 2 + 4 and len(fp8) + len(bf16) == len(dtypes)
    g = grad(params, x)
    want = jax.jit(jax.grad(attention_loss))(params, x)  # one program, not one an op
    assert all(cosine(a, b) > 0.99 for a, b in zip(g, want))


def test_mlp_weight_gradient_in_grad_program_is_float8():
    """In ``autocast_transform(jax.grad(f))`` the weight-gradient dot (hidden activations times
    the cotangent, no weight among its operands) follows its forward dot into float8."""
    def mlp_loss(w1, w2, x):
        return jnp.sum(jnp.tanh(jnp.tanh(x @ w1) @ w2))
    x, w1, w2 = normal(0, (8, 16)), normal(1, (16, 16)), normal(2, (16, 4))
    grad = jamp.autocast_transform(jax.grad(mlp_loss, argnums=(0, 1)), FP8)
    dtypes = dot_operand_dtypes(jax.make_jaxpr(grad)(w1, w2, x))
    assert all(any(n.startswith("float8") for n in d) for d in dtypes), dtypes


def matmul(a, b):
    return a @ b          # one source line for every product below


@pytest.mark.parametrize("helper", [matmul, jax.jit(matmul)], ids=["inline", "jitted"])
@pytest.mark.parametrize("order", ["weight_first", "activations_first"])
def test_products_sharing_a_line_keep_their_own_decisions(order, helper):
    """A helper puts a weight product and an activation product on one source line, with equal
    operand shapes (h and y are both (8, 32)): in ``autocast_transform(jax.grad(f))`` the weight
    gradient (h.T times a cotangent) follows its forward dot into float8 and the activation
    product's two transposes stay bfloat16, in either order (the first product at the line
    decided for all of them, either way)."""
    def loss(w, x):
        h = jnp.tanh(x * 2.0)                     # an activation that needs no gradient
        if order == "weight_first":
            y = helper(h, w)
            z = helper(y, y.T)
        else:
            s = helper(h, h.T)                    # no transposes: h needs no gradient
            y = helper(h, w)
            z = s + helper(y, y.T)
        return jnp.sum(z ** 2)
    w, x = normal(1, (32, 32), scale=0.2), normal(0, (8, 32))
    grad = jamp.autocast_transform(jax.grad(loss), FP8)
    dtypes = dot_operand_dtypes(jax.make_jaxpr(grad)(w, x))
    bf16 = {"weight_first": 1 + 2, "activations_first": 2 + 2}[order]
    assert dtypes.count(("bfloat16", "bfloat16")) == bf16, dtypes
    assert dtypes.count(("float8_e4m3fn", "float8_e4m3fn")) == 1, dtypes   # y = h @ w
    assert [d for d in dtypes if "float8_e5m2" in d] == [("float8_e5m2", "float8_e4m3fn")]
    assert len(dtypes) == bf16 + 2
    assert cosine(grad(w, x), jax.jit(jax.grad(loss))(w, x)) > 0.99


def test_transposed_product_follows_the_forward_operand_it_reads():
    """Two products on one line alike in every shape, one with a weight: the weight gradient
    (h1.T times its cotangent) is float8, the activation product's (h2.T times its cotangent)
    bfloat16; told apart by the forward operand each reads."""
    def loss(w, v, x):
        h1, h2 = jnp.tanh(x), jnp.sin(x)
        return jnp.sum(matmul(h1, w) * matmul(h2, jnp.tanh(v)))
    w, v, x = normal(1, (32, 32), scale=0.2), normal(2, (32, 32)), normal(0, (8, 32))
    grad = jamp.autocast_transform(jax.grad(loss, argnums=(0, 1)), FP8)
    dtypes = dot_operand_dtypes(jax.make_jaxpr(grad)(w, v, x))
    # forward: h1 @ w in float8, h2 @ tanh(v) in bfloat16; backward: one transpose each
    assert dtypes == sorted([("float8_e4m3fn", "float8_e4m3fn"), ("bfloat16", "bfloat16"),
                             ("float8_e5m2", "float8_e4m3fn"), ("bfloat16", "bfloat16")]), dtypes


# --- Policy.min_float8_flops: small matmuls stay bfloat16 -------------------------------------

def spec(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.float32)   # traced only: nothing is allocated


def two_layers(x, w_small, w_big):
    return jnp.tanh(x @ w_big) @ w_small


# x @ w_big: 2 * 4096 * 4096 * 4096 FLOPs (the default threshold, kept in float8);
# tanh(...) @ w_small: 2 * 4096 * 4096 * 8 FLOPs, far below it.
SIZED = (spec(4096, 4096), spec(4096, 8), spec(4096, 4096))
SIZED_ARRAYS = tuple(jnp.zeros(s.shape) for s in SIZED)   # explain takes arrays (only traced)


@pytest.mark.parametrize("order", ["forward", "grad_outside", "grad_inside"])
def test_default_threshold_keeps_the_small_dot_in_bfloat16(order):
    policy = jamp.Policy(E4M3)          # default min_float8_flops = 2 * 4096**3
    assert policy.min_float8_flops == 2 * 4096**3
    loss = lambda x, ws, wb: jnp.sum(two_layers(x, ws, wb))
    fn = {"forward": jamp.autocast_transform(two_layers, policy),
          "grad_outside": jax.grad(jamp.autocast_transform(loss, policy), argnums=(1, 2)),
          "grad_inside": jamp.autocast_transform(jax.grad(loss, argnums=(1, 2)), policy)}[order]
    dtypes = dot_operand_dtypes(jax.make_jaxpr(fn)(*SIZED))
    fp8 = [d for d in dtypes if all(n.startswith("float8") for n in d)]
    bf16 = [d for d in dtypes if d == ("bfloat16", "bfloat16")]
    # The big product in float8, the small one in bfloat16; under grad their transposes follow
    # them. The small product has two (the cotangents of tanh(...) and of w_small); the big
    # one's custom_vjp computes both of its transposes, of which jax.grad(f) inside the
    # transform keeps only w_big's (x's is not asked for).
    want_fp8 = {"forward": 1, "grad_outside": 3, "grad_inside": 2}[order]
    assert len(fp8) == want_fp8 and len(bf16) == (1 if order == "forward" else 3)
    assert len(fp8) + len(bf16) == len(dtypes)
    assert all(d[0] == "float8_e5m2" for d in fp8[1:])   # the transposes read e5m2 cotangents


def test_threshold_is_compared_with_each_products_flops():
    x, w = spec(64, 128), spec(128, 32)
    flops = 2 * 64 * 128 * 32
    fn = lambda x, w: x @ w
    at = jax.make_jaxpr(jamp.autocast_transform(fn, jamp.Policy(E4M3, min_float8_flops=flops)))
    above = jax.make_jaxpr(jamp.autocast_transform(fn, jamp.Policy(E4M3,
                                                                   min_float8_flops=flops + 1)))
    assert dot_operand_dtypes(at(x, w)) == [("float8_e4m3fn", "float8_e4m3fn")]
    assert dot_operand_dtypes(above(x, w)) == [("bfloat16", "bfloat16")]


def test_default_threshold_exports_with_a_symbolic_batch():
    # FLOPs with a symbolic batch count at its generic value (2**16), so comparing them with
    # the threshold is not inconclusive: x @ w_big's 2 * b * 1024 * 1024 is 2 * 4096**3 there.
    (b,) = jax.export.symbolic_shape("b")
    specs = (jax.ShapeDtypeStruct((b, 1024), jnp.float32), spec(1024, 8), spec(1024, 1024))
    fn = jamp.autocast_transform(two_layers, jamp.Policy(E4M3))
    assert dot_operand_dtypes(jax.make_jaxpr(fn)(*specs)) == [
        ("bfloat16", "bfloat16"), ("float8_e4m3fn", "float8_e4m3fn")]
    exported = jax.export.export(jax.jit(fn))(*specs)
    x, ws, wb = normal(0, (3, 1024)), normal(1, (1024, 8)), normal(2, (1024, 1024), 0.03)
    same_split = jamp.Policy(E4M3, min_float8_flops=2 * 3 * 1024 * 1024)  # at batch 3
    want = jamp.autocast_transform(two_layers, same_split)(x, ws, wb)
    np.testing.assert_allclose(exported.call(x, ws, wb), want, rtol=2e-2, atol=2e-2)


def test_explain_lists_the_dots_kept_in_bfloat16():
    report = jamp.explain(two_layers, *SIZED_ARRAYS, policy=jamp.Policy(E4M3))
    (kept,) = report.float8_kept
    assert kept.primitive == "dot_general" and kept.reason == "min_float8_flops"
    assert kept.shapes == ((4096, 4096), (4096, 8)) and kept.flops == 2 * 4096 * 4096 * 8
    assert "two_layers" in kept.where
    assert report.flops == {"float8_e4m3fn": 2 * 4096**3, "bfloat16": 2 * 4096 * 4096 * 8}
    text = str(report)
    assert "kept in bfloat16, below min_float8_flops=137,438,953,472:" in text
    assert "[4096, 4096] x [4096, 8]" in text
    # a policy with no threshold keeps nothing back; bfloat16 policies never list any
    assert jamp.explain(two_layers, *SIZED_ARRAYS, policy=FP8).float8_kept == ()
    assert jamp.explain(two_layers, *SIZED_ARRAYS, policy=jamp.Policy()).float8_kept == ()


def test_threshold_in_a_rule_scope_and_repr():
    policy = jamp.Policy(jnp.bfloat16, rules=(("fp8", E4M3),), min_float8_flops=10**9)
    assert repr(policy) == ("Policy(rules=(('fp8', jnp.float8_e4m3fn),), "
                            "min_float8_flops=1000000000)")
    assert policy.replace(min_float8_flops=1e3).min_float8_flops == 1000

    def f(x, w_small, w_big):
        with jax.named_scope("fp8"):
            return two_layers(x, w_small, w_big)
    report = jamp.explain(f, *SIZED_ARRAYS, policy=policy)
    assert [k.scope for k in report.float8_kept] == ["fp8"]
    assert set(report.flops) == {"float8_e4m3fn", "bfloat16"}


@pytest.mark.parametrize("value, error, match", [
    (-1, ValueError, r"min_float8_flops must be >= 0 .*got -1"),
    (1.5, ValueError, r"min_float8_flops must be a whole, finite number of FLOPs, got 1.5"),
    (float("inf"), ValueError, r"whole, finite"),
    (True, TypeError, r"min_float8_flops must be a number of FLOPs .*got bool True"),
    ("1e9", TypeError, r"got str '1e9'"),
    (None, TypeError, r"got NoneType None"),
])
def test_min_float8_flops_validation(value, error, match):
    with pytest.raises(error, match=match):
        jamp.Policy(E4M3, min_float8_flops=value)
    with pytest.raises(error, match=match):
        FP8.replace(min_float8_flops=value)
