"""scan / while / cond / remat bodies are rewritten; carries and branches keep consistent dtypes."""
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.ad_checkpoint import checkpoint_name

import jamp
from tests.jaxpr_utils import eqns_named, in_region, operand_dtypes

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
# Test data made on the host: jax.device_put hands it over as a device array without compiling
# (jnp.asarray of a numpy array, or a jax.random call, compiles a program per shape).
_RNG = np.random.default_rng(0)
W = jax.device_put(_RNG.standard_normal((8, 8), dtype=np.float32) * np.float32(0.3))
XS = jax.device_put(_RNG.standard_normal((6, 8), dtype=np.float32))


def rnn(w, xs):
    def cell(h, x):
        h = jnp.tanh(h @ w + x)
        return h, h.sum()
    return lax.scan(cell, jnp.zeros(8), xs)


def test_scan_rnn_matmuls_in_compute_dtype_carry_stays_float32():
    f = jamp.autocast_transform(rnn)
    (h, ys) = f(W, XS)
    assert h.dtype == F32 and ys.dtype == F32
    jaxpr = jax.make_jaxpr(f)(W, XS)
    assert operand_dtypes(jaxpr, "dot_general") == [("bfloat16", "bfloat16")]
    scan = eqns_named(jaxpr, "scan")[0]
    assert [v.aval.dtype for v in scan.outvars] == [F32, F32]
    np.testing.assert_allclose(h, rnn(W, XS)[0], atol=3e-2)


def test_scan_rnn_gradient_is_finite_float32_with_bf16_backward_dots():
    loss = lambda w: jamp.autocast_transform(rnn)(w, XS)[0].sum()
    g = jax.grad(loss)(W)
    assert g.dtype == F32 and jnp.all(jnp.isfinite(g))
    np.testing.assert_allclose(g, jax.jit(jax.grad(lambda w: rnn(w, XS)[0].sum()))(W), atol=5e-2)
    assert set(operand_dtypes(jax.make_jaxpr(jax.grad(loss))(W), "dot_general")) == {("bfloat16",) * 2}


def test_while_loop_body_rewritten_and_carry_keeps_dtype():
    def f(w, x):
        return lax.while_loop(lambda c: c[1] < 3, lambda c: (jnp.tanh(c[0] @ w), c[1] + 1), (x, 0))
    out, n = jamp.autocast_transform(f)(W, XS)
    assert out.dtype == F32 and int(n) == 3
    assert operand_dtypes(jax.make_jaxpr(jamp.autocast_transform(f))(W, XS), "dot_general") == [
        ("bfloat16", "bfloat16")]


@pytest.mark.parametrize("pred", [True, False])
def test_cond_branches_with_divergent_dtypes_typecheck(pred):
    def f(w, x, p):
        return lax.cond(p, lambda v: v @ w, lambda v: v * 2.0, x)
    out = jamp.autocast_transform(f)(W, XS, pred)
    assert out.dtype == F32  # branches disagree (bf16 vs f32): the traced dtype
    expected = np.asarray(XS) @ np.asarray(W) if pred else np.asarray(XS) * 2.0
    np.testing.assert_allclose(out, expected, atol=5e-2)


def test_cond_branches_that_agree_keep_the_rewritten_dtype():
    f = jamp.autocast_transform(lambda w, x, i: lax.switch(i, [lambda v: v @ w, lambda v: v @ w.T,
                                                               lambda v: (v * 2) @ w], x))
    assert f(W, XS, 2).dtype == BF16


def test_remat_body_rewritten_and_recomputation_uses_the_policy():
    def block(w, x):
        return jnp.sin(x @ w) @ w
    loss = lambda w: jamp.autocast_transform(jax.checkpoint(block))(w, XS).astype(F32).sum()
    jaxpr = jax.make_jaxpr(jax.grad(loss))(W)
    assert eqns_named(jaxpr, "checkpoint") or eqns_named(jaxpr, "remat2") or \
        eqns_named(jaxpr, "remat")
    assert set(operand_dtypes(jaxpr, "dot_general")) == {("bfloat16", "bfloat16")}
    assert jax.grad(loss)(W).dtype == F32


def test_jit_under_scan_and_region_inside_loop_body():
    inner = jax.jit(lambda h, w: h @ w)

    def f(w, xs):
        def cell(h, x):
            with jamp.autocast(enabled=False):
                full = inner(h, w)
            return jnp.tanh(inner(h, w) + full + x), full
        return lax.scan(cell, jnp.zeros(8), xs)
    h, fulls = jamp.autocast_transform(f)(W, XS)
    assert h.dtype == F32 and fulls.dtype == F32
    dots = operand_dtypes(jax.make_jaxpr(jamp.autocast_transform(f))(W, XS), "dot_general")
    assert sorted(dots) == [("bfloat16", "bfloat16"), ("float32", "float32")]


def test_remat_saves_matmul_residuals_in_compute_dtype():
    rng = np.random.default_rng(1)
    w1 = jax.device_put(rng.standard_normal((8, 16), dtype=np.float32) * np.float32(0.3))
    w2 = jax.device_put(rng.standard_normal((16, 16), dtype=np.float32) * np.float32(0.3))

    def block(w1, w2, x):
        return jnp.sin(jnp.sin(x @ w1) @ w2)

    f = jamp.autocast_transform(jax.checkpoint(block, policy=jax.checkpoint_policies.checkpoint_dots))
    _, vjp = jax.vjp(lambda w1, w2: f(w1, w2, XS), w1, w2)
    saved_dots = [leaf for leaf in jax.tree.leaves(vjp) if leaf.shape == (6, 16)]
    assert len(saved_dots) == 2 and all(leaf.dtype == BF16 for leaf in saved_dots)


@pytest.mark.parametrize("form", ["transform", "transform inside the checkpoint", "region",
                                  "region inside the checkpoint"])
def test_a_remat_policy_by_name_saves_the_named_value_in_compute_dtype(form):
    """``save_only_these_names`` with ``checkpoint_name`` (how LLM training code picks what a
    checkpointed block keeps): the named activation is still saved, in the dtype the policy ran
    it in, and an unnamed one is still recomputed, in both forms."""
    rng = np.random.default_rng(2)
    w1 = jax.device_put(rng.standard_normal((8, 16), dtype=np.float32) * np.float32(0.3))
    w2 = jax.device_put(rng.standard_normal((16, 12), dtype=np.float32) * np.float32(0.3))

    def block(w1, w2, x):
        h = checkpoint_name(jnp.tanh(x @ w1), "h")  # (6, 16): saved
        g = checkpoint_name(h @ w2, "g")  # (6, 12): recomputed
        return jnp.sum(jnp.sin(g) ** 2)

    policy = jax.checkpoint_policies.save_only_these_names("h")
    checkpointed = {
        "transform": jamp.autocast_transform(jax.checkpoint(block, policy=policy)),
        "transform inside the checkpoint": jax.checkpoint(
            jamp.autocast_transform(block), policy=policy
        ),
        "region": in_region(jax.checkpoint(block, policy=policy)),
        "region inside the checkpoint": jax.checkpoint(in_region(block), policy=policy),
    }[form]
    _, vjp = jax.vjp(lambda w1, w2: checkpointed(w1, w2, XS), w1, w2)
    saved = [leaf for leaf in jax.tree.leaves(vjp) if leaf.shape in ((6, 16), (6, 12))]
    assert [(leaf.shape, leaf.dtype) for leaf in saved] == [((6, 16), BF16)]


def test_grad_of_checkpointed_vmapped_scan_is_rewritten_on_every_jax_version():
    """recurrentgemma's Griffin: ``grad`` of ``checkpoint(vmap(scan))``. jax 0.12 binds part of it
    as the pure-call primitive ``eval_jaxpr``; jax 0.10 does not; on both the whole program is
    rewritten (no unsupported-primitive warning, every matmul in the compute dtype)."""
    def loss(w, xs):
        def run(x):
            return rnn(w, x)[0]
        return jnp.sum(jax.checkpoint(jax.vmap(run))(xs) ** 2)

    xs = jax.device_put(np.stack([np.asarray(XS), np.asarray(XS)[::-1]]))
    grad = jamp.autocast_transform(jax.grad(loss))
    with warnings.catch_warnings():
        warnings.simplefilter("error", jamp.UnsupportedPrimitiveWarning)
        jaxpr = jax.make_jaxpr(grad)(W, xs)
        g = grad(W, xs)
    dots = operand_dtypes(jaxpr, "dot_general")
    assert dots and set(dots) == {("bfloat16", "bfloat16")}, dots
    assert g.dtype == F32
    g, want = np.asarray(g), np.asarray(jax.jit(jax.grad(loss))(W, xs))
    cosine = np.vdot(g, want) / (np.linalg.norm(g) * np.linalg.norm(want))
    assert cosine > 0.99
    assert 0.9 < np.linalg.norm(g) / np.linalg.norm(want) < 1.1  # (a cosine misses a scaling)


# --- found by running JAX's own tests under an identity policy (benchmarks/identity_policy.py) ---

def _tpu_only_primitive():
    """An identity primitive with a TPU lowering only: lowering it for the CPU fails."""
    from jax.extend.core import Primitive
    from jax.interpreters import mlir
    prim = Primitive("jamp_test_tpu_only")
    prim.def_abstract_eval(lambda x: x)
    mlir.register_lowering(prim, lambda ctx, x: [x], platform="tpu")
    return prim


TPU_ONLY = _tpu_only_primitive()


def per_platform(x, w):
    return lax.platform_dependent(
        x, w, cpu=lambda x, w: jnp.tanh(x @ w), tpu=lambda x, w: TPU_ONLY.bind(x @ w),
        default=lambda x, w: x @ w)


@pytest.mark.parametrize("policy", [jamp.Policy(F32), jamp.Policy()], ids=["f32", "bf16"])
def test_platform_dependent_lowers_only_the_running_platforms_branch(policy):
    f = jamp.autocast_transform(per_platform, policy)
    ref = np.tanh(np.asarray(XS) @ np.asarray(W))
    for run in (f, jax.jit(f)):  # the TPU-only branch must not be lowered for the CPU
        out = run(XS, W)
        assert out.dtype == policy.compute_dtype  # tanh runs in the dtype it gets
        np.testing.assert_allclose(out, ref, rtol=2e-2 if policy.compute_dtype != F32 else 1e-6,
                                   atol=1e-2)
    cond = eqns_named(jax.make_jaxpr(f)(XS, W), "cond")[0]
    assert cond.params["branches_platforms"] == (("cpu",), ("tpu",), None)
    # The branches were rewritten: the matmuls run in the compute dtype.
    dtype = np.dtype(policy.compute_dtype).name
    assert operand_dtypes(cond.params["branches"][0], "dot_general") == [(dtype, dtype)]


def count_up(x, w):
    """A while loop whose predicate depends on the (batched) carry."""
    def body(c):
        return c[0] + 1.0, c[1] + jnp.tanh(c[1] @ w)
    return lax.while_loop(lambda c: c[0] < 3.0, body, (x, jnp.full((2, 8), 0.1)))[1]


STARTS = np.array([-2.0, 0.0, 2.5], np.float32)  # 5, 3 and 1 steps


@functools.cache
def _batched_count_up_and_tangent():
    """Plain JAX's answer for STARTS and its jvp along W, in one program, for every policy."""
    batched = jax.vmap(count_up, in_axes=(0, None))

    @jax.jit
    def reference(xs, w):
        return jax.jvp(lambda v: batched(xs, v), (w,), (w,))

    return reference(jax.device_put(STARTS), W)


@pytest.mark.parametrize("policy", [jamp.Policy(F32), jamp.Policy()], ids=["f32", "bf16"])
def test_while_with_batched_predicate_from_vmap(policy):
    # vmap turns the predicate into bool[batch]: the loop runs while any element holds and steps
    # only those. lax.while_loop cannot rebuild such a loop.
    xs = jax.device_put(STARTS)
    batched = jax.vmap(count_up, in_axes=(0, None))
    ref, ref_tangent = _batched_count_up_and_tangent()
    for f in (jamp.autocast_transform(batched, policy),
              jax.jit(jamp.autocast_transform(batched, policy)),
              jax.vmap(jamp.autocast_transform(count_up, policy), in_axes=(0, None))):
        out = f(xs, W)
        assert out.dtype == F32  # a carry keeps its traced dtype
        np.testing.assert_allclose(out, ref, rtol=3e-2, atol=3e-2)
    closed = jax.make_jaxpr(jamp.autocast_transform(batched, policy))(xs, W)
    loop = eqns_named(closed, "while")[0]
    dtype = np.dtype(policy.compute_dtype).name
    assert operand_dtypes(loop.params["body_jaxpr"], "dot_general") == [(dtype, dtype)]
    # jvp through the batched loop works too
    _, tangent = jax.jvp(lambda w: jamp.autocast_transform(batched, policy)(xs, w), (W,), (W,))
    np.testing.assert_allclose(tangent, ref_tangent, rtol=5e-2, atol=5e-2)


@jax.custom_batching.custom_vmap
def custom_batched_layer(x, w):
    return jnp.tanh(x @ w)


@custom_batched_layer.def_vmap
def _custom_batched_layer_rule(axis_size, in_batched, x, w):
    assert not in_batched[1]
    RULE_CALLS.append(x.dtype)
    return jnp.tanh(jnp.einsum("bij,jk->bik", x, w)), True


RULE_CALLS = []


@pytest.mark.parametrize("policy", [jamp.Policy(F32), jamp.Policy()], ids=["f32", "bf16"])
def test_custom_vmap_function_is_rewritten_and_its_rule_still_batches(policy):
    # custom_vmap_call had no rule: it warned and ran unchanged. Its body is rewritten now; the
    # user's vmap rule runs in the traced dtypes, so the call returns those.
    f = jamp.autocast_transform(custom_batched_layer, policy)
    dtype = np.dtype(policy.compute_dtype).name
    call = eqns_named(jax.make_jaxpr(f)(XS, W), "custom_vmap_call")[0]
    assert operand_dtypes(call.params["call"], "dot_general") == [(dtype, dtype)]
    out = jax.jit(f)(XS, W)
    assert out.dtype == F32
    xs, w = np.asarray(XS), np.asarray(W)  # (the references computed on the host)
    np.testing.assert_allclose(out, np.tanh(xs @ w), rtol=2e-2, atol=2e-2)
    RULE_CALLS.clear()
    batch = np.stack([xs, 2 * xs])
    out = jax.vmap(f, in_axes=(0, None))(jax.device_put(batch), W)
    assert RULE_CALLS == [F32] and out.dtype == F32  # the user's rule, in the traced dtype
    np.testing.assert_allclose(out, np.tanh(batch @ w), rtol=2e-2, atol=2e-2)
    _, tangent = jax.jvp(lambda w: f(XS, w), (W,), (W,))
    np.testing.assert_allclose(tangent, (1 - np.tanh(xs @ w) ** 2) * (xs @ w), rtol=5e-2,
                               atol=5e-2)


def tanh_layer(xs, w):
    return lax.composite(lambda x, w: jnp.tanh(x @ w), name="test.tanh_layer", version=2)(xs, w)


def in_a_region(xs, w):
    with jamp.autocast():
        return tanh_layer(xs, w)


def jit_in_a_region(xs, w):
    with jamp.autocast():
        return jax.jit(tanh_layer)(xs, w)


@pytest.mark.parametrize(
    "fn",
    [jamp.autocast_transform(tanh_layer), in_a_region, jit_in_a_region],
    ids=["transform", "region", "jit in a region"],
)
def test_a_composite_keeps_its_name_and_its_decomposition_runs_under_the_policy(fn):
    # composite had no rule: it warned and ran in its traced dtypes (found with JAX's lax_test.py
    # under an identity region). Its decomposition is rewritten now, as a jit's body is, and the
    # operation keeps its name and version.
    composite = eqns_named(jax.make_jaxpr(fn)(XS, W), "composite")
    assert [(c.params["name"], c.params["version"]) for c in composite] == [("test.tanh_layer", 2)]
    body = composite[0].params.get("jaxpr") or composite[0].params["call_jaxpr"]
    assert operand_dtypes(body, "dot_general") == [("bfloat16", "bfloat16")]
    assert 'stablehlo.composite "test.tanh_layer"' in jax.jit(fn).lower(XS, W).as_text()
    for out in (fn(XS, W), jax.jit(fn)(XS, W)):
        assert out.dtype == BF16
        np.testing.assert_allclose(out, np.tanh(np.asarray(XS) @ np.asarray(W)), rtol=2e-2,
                                   atol=2e-2)


def _scheduled(xs, w):
    # (imported here: jax.experimental.scheduling_groups is recent; both CI versions have it)
    from jax.experimental.scheduling_groups import xla_metadata_call

    scale = jnp.sum(w)  # closed over by the call: traced, so it becomes an operand
    return xla_metadata_call(lambda a: jnp.tanh(a @ w) * scale, inlineable="false")(xs)


def _on_host(xs, w):
    from jax.experimental import compute_on as compute_on_module

    # compute_on2 on jax 0.10, compute_on with the same signature on 0.12
    compute_on = getattr(compute_on_module, "compute_on2", compute_on_module.compute_on)
    run_on_host = compute_on(compute_type="device_host", out_memory_spaces=jax.memory.Space.Device)
    return run_on_host(lambda a, b: jnp.tanh(a @ b))(xs, w)


@functools.cache
def _without_jamp(call):
    """What ``call`` computes and its gradient, as plain JAX runs them: once for the forms."""
    return call(XS, W), jax.grad(lambda w: call(XS, w).sum())(W)


@pytest.mark.parametrize("form", ["transform", "region", "jit in a region"])
@pytest.mark.parametrize(
    "call, name, lowered",
    [
        (_scheduled, "xla_metadata_call", 'inlineable = "false"'),
        (_on_host, "compute_on", "_xla_compute_type"),
    ],
    ids=["xla_metadata_call", "compute_on"],
)
def test_a_call_telling_xla_how_to_run_its_body_keeps_that_and_its_body_runs_under_the_policy(
    call, name, lowered, form
):
    # xla_metadata_call and compute_on had no rule: they warned and ran in their traced dtypes
    # (found with JAX's xla_metadata_test and memories_test under an identity region).
    fn = {"transform": jamp.autocast_transform(call), "region": in_region(call),
          "jit in a region": in_region(jax.jit(call))}[form]
    with warnings.catch_warnings():
        warnings.simplefilter("error", jamp.UnsupportedPrimitiveWarning)
        jaxpr = jax.make_jaxpr(fn)(XS, W)
        traced = eqns_named(jax.make_jaxpr(call)(XS, W), name)[0]
        (kept,) = eqns_named(jaxpr, name)
        assert {k: v for k, v in kept.params.items() if k != "jaxpr"} == {
            k: v for k, v in traced.params.items() if k != "jaxpr"
        }
        assert operand_dtypes(kept.params["jaxpr"], "dot_general") == [("bfloat16", "bfloat16")]
        assert lowered in jax.jit(fn).lower(XS, W).as_text()
        want, want_grad = _without_jamp(call)
        for out in (fn(XS, W), jax.jit(fn)(XS, W)):
            assert out.dtype == BF16
            np.testing.assert_allclose(out.astype(F32), want, rtol=3e-2, atol=3e-2)
        grad = jax.jit(jax.grad(lambda w: fn(XS, w).astype(F32).sum()))(W)
        assert grad.dtype == F32
        np.testing.assert_allclose(grad, want_grad, rtol=5e-2, atol=0.1)


@pytest.mark.parametrize("form", ["transform", "region", "jit in a region"])
def test_a_fused_call_is_rewritten_at_its_own_input_types_and_keeps_its_output_spaces(form):
    # jax.experimental.fused had no rule (found with JAX's fused_test under an identity
    # region); rewritten at its operands' types, its body then mixed a host and a device
    # operand, which JAX refuses. Its body's inputs may live in any memory space.
    from jax.experimental.fused import fused

    spaces = (jax.memory.Space.Host, jax.memory.Space.Device)

    def call(x, w):
        return fused(out_spaces=spaces)(lambda a, b: (a + 1.0, jnp.tanh(a @ b)))(x, w)

    fn = {"transform": jamp.autocast_transform(call), "region": in_region(call),
          "jit in a region": in_region(jax.jit(call))}[form]
    x_host = jax.device_put(XS, jax.memory.Space.Host)
    with warnings.catch_warnings():
        warnings.simplefilter("error", jamp.UnsupportedPrimitiveWarning)
        (kept,) = eqns_named(jax.make_jaxpr(fn)(x_host, W), "fused_call")
        assert kept.params["out_spaces"] == spaces
        assert operand_dtypes(kept.params["jaxpr"], "dot_general") == [("bfloat16", "bfloat16")]
        assert [v.aval.dtype for v in kept.outvars] == [F32, BF16]
        # (fused lowers for GPUs only; lowering for one runs here)
        lowered = jax.jit(fn).trace(x_host, W).lower(lowering_platforms=("cuda",))
        assert "MUST_FUSE" in lowered.as_text(dialect="hlo")
        grad = jax.jit(jax.grad(lambda x, w: fn(x, w)[1].astype(F32).sum(), argnums=1))
        assert grad.trace(x_host, W).lower(lowering_platforms=("cuda",)) is not None


def _stateful_layer(xs, w):
    # (run_state is JAX's own, with no public home: Pallas-style code reaches it)
    from jax._src.state.discharge import run_state

    def body(refs):
        x_ref, out_ref = refs
        out_ref[...] = jnp.tanh(x_ref[...] @ w)

    return run_state(body)((xs, jnp.zeros((xs.shape[0], w.shape[1]))))[1]


@functools.cache
def _stateful_layer_without_jamp():
    """Plain JAX's value and derivative (along ones) of _stateful_layer, once for the forms."""
    tangent = jax.device_put(np.ones(W.shape, np.float32))
    return _stateful_layer(XS, W), jax.jvp(lambda v: _stateful_layer(XS, v), (W,), (tangent,))[1]


@pytest.mark.parametrize("form", ["transform", "region", "jit in a region"])
def test_run_state_keeps_its_references_types_and_its_body_runs_under_the_policy(form):
    # run_state had no rule: it warned and ran in its traced dtypes (JAX's state_test under
    # the identity harness, both forms).
    fn = {"transform": jamp.autocast_transform(_stateful_layer), "region": in_region(_stateful_layer),
          "jit in a region": in_region(jax.jit(_stateful_layer))}[form]
    with warnings.catch_warnings():
        warnings.simplefilter("error", jamp.UnsupportedPrimitiveWarning)
        (kept,) = eqns_named(jax.make_jaxpr(fn)(XS, W), "run_state")
        assert operand_dtypes(kept.params["jaxpr"], "dot_general") == [("bfloat16", "bfloat16")]
        (traced,) = eqns_named(jax.make_jaxpr(_stateful_layer)(XS, W), "run_state")
        assert [v.aval for v in kept.params["jaxpr"].invars] == [
            v.aval for v in traced.params["jaxpr"].invars
        ]
        want, want_derivative = _stateful_layer_without_jamp()
        for out in (fn(XS, W), jax.jit(fn)(XS, W)):
            assert out.dtype == F32  # (what its reference holds)
            np.testing.assert_allclose(out, want, rtol=3e-2, atol=3e-2)
        # (forward mode: JAX cannot reverse-differentiate this run_state, with or without jamp)
        tangent = jax.device_put(np.ones(W.shape, np.float32))
        _, derivative = jax.jit(lambda w: jax.jvp(lambda v: fn(XS, v), (w,), (tangent,)))(W)
        assert derivative.dtype == F32
        np.testing.assert_allclose(derivative, want_derivative, rtol=5e-2, atol=0.1)
