"""Ports of PyTorch's autocast seed tests into JAX terms.

Sources: ``test/test_jit_autocast.py`` (TorchScript + ``with autocast():``) and
``test/test_autocast.py`` (the CPU op lists, the cast cache, argument errors).

How the torch idioms map onto jamp:
- ``@torch.jit.script`` + ``with autocast():`` around the body -> ``jamp.autocast_transform(fn)``
  (the whole function is inside an enabled region; the default compute dtype is bfloat16 where
  torch's CUDA default is float16, so "fp16" expectations read "compute dtype" here).
- ``with autocast(enabled=False)`` / ``with autocast(dtype=...)`` inside -> the same
  ``jamp.autocast`` regions; scripted callees -> plain helpers and ``jax.jit``-ed helpers.
- ``torch.jit.trace`` -> ``jax.jit``; ``FileCheck`` on the graph -> counting equations in
  ``jax.make_jaxpr`` (recursively, into jit/cond sub-jaxprs).
- Runtime (data-dependent) autocast state -> a ``TypeError`` at trace time.
Each test names the torch test it ports.
"""
from __future__ import annotations

import functools
import warnings
from typing import Any, Callable

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.scipy import special

import jamp
from tests.jaxpr_utils import eqns_named, iter_eqns

BF16, F16, F32, F64 = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32),
                       np.dtype(jnp.float64))
transform = jamp.autocast_transform

# bfloat16 has 8 bits of mantissa: values computed in it agree with float32 to ~1e-2 relative.
LOW_TOL = dict(rtol=5e-2, atol=5e-2)


def _id(value: Any) -> str:
    """Readable parametrize ids: dtypes by their short name."""
    short = {BF16: "bf16", F16: "f16", F32: "f32", F64: "f64"}
    return short.get(value, str(value)) if isinstance(value, np.dtype) else str(value)


# --- helpers ---------------------------------------------------------------------------------

def dtypes(tree: Any) -> Any:
    """The dtype of every leaf, same structure."""
    return jax.tree.map(lambda x: np.dtype(x.dtype), tree)


def converts_to(jaxpr: Any, dtype: Any) -> list[Any]:
    return [e for e in eqns_named(jaxpr, "convert_element_type")
            if np.dtype(e.params["new_dtype"]) == np.dtype(dtype)]


# Test data is drawn and cast on the host and transferred: jax.random and eager casts would each
# compile a program per shape and dtype.
def host_rand(key: int, shape: tuple[int, ...] = (2, 2)) -> np.ndarray:
    """Uniform [0, 1) float32 values."""
    return np.random.default_rng(key).random(shape, dtype=np.float32)


def rand(key: int, shape: tuple[int, ...] = (2, 2), dtype: Any = jnp.float32) -> jax.Array:
    return jax.device_put(host_rand(key, shape).astype(dtype))


def host_cast(tree: Any, dtype: Any) -> Any:
    """Every leaf cast to ``dtype`` on the host (round to nearest even, as XLA casts)."""
    return jax.tree.map(lambda x: jax.device_put(np.asarray(x).astype(dtype)), tree)


def with_first(a: jax.Array, first: float) -> jax.Array:
    """``a.at[0, 0].set(first)``, built on the host."""
    host = np.array(a)
    host[0, 0] = first
    return jax.device_put(host)


@pytest.fixture
def abcd() -> tuple[jax.Array, ...]:
    """torch's setUp: four random 2x2 float32 operands."""
    return tuple(rand(i) for i in range(4))


@pytest.fixture
def abcd_f16(abcd: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    return host_cast(abcd, F16)


# ==============================================================================================
# test_jit_autocast.py :: TestAutocast
# ==============================================================================================

# ports test_jit_generic_autocast: the spellings of "autocast with the default dtype" agree.
def test_generic_autocast_spellings_agree(abcd):
    a, b, *_ = abcd

    def fn(a, b):
        x = a @ b
        return x, jnp.sum(x)

    reference = transform(fn)(a, b)
    for other in (transform(fn, jamp.Policy()), transform(fn, dtype=jnp.bfloat16),
                  jamp.autocast()(fn), jamp.autocast(dtype=jnp.bfloat16)(fn)):
        out = other(a, b)
        assert dtypes(out) == dtypes(reference)
        chex.assert_trees_all_close(out, reference)


# ports test_minimal: mm -> compute dtype, sum -> float32.
def test_minimal(abcd):
    a, b, *_ = abcd

    def fn(a, b):
        x = a @ b
        return x, jnp.sum(x)

    x, y = transform(fn)(a, b)
    assert (x.dtype, y.dtype) == (BF16, F32)
    chex.assert_trees_all_close(x.astype(F32), a @ b, **LOW_TOL)


# ports test_linear_bf16: an explicit region dtype wins over the transform's compute dtype.
@pytest.mark.parametrize("outer, region", [(None, BF16), (F16, BF16), (None, F16)], ids=_id)
def test_linear_region_dtype(abcd, outer, region):
    a, b, *_ = abcd

    def fn(a, b):
        with jamp.autocast(dtype=region):
            x = a @ b
            return x, jnp.sum(x)

    x, y = transform(fn, dtype=outer)(a, b)
    assert (x.dtype, y.dtype) == (region, F32)


# ports test_minimal_cpu: `with autocast():` in a plain function runs its matmul in the compute
# dtype, eagerly and under jax.jit, as torch's region does (no wrapper needed).
def test_region_in_a_plain_function_takes_effect(abcd):
    a, b, *_ = abcd

    def fn(a, b):
        with jamp.autocast():
            return a @ b

    assert fn(a, b).dtype == BF16
    assert jax.jit(fn)(a, b).dtype == BF16
    chex.assert_trees_all_close(fn(a, b), transform(lambda a, b: a @ b)(a, b))


# ports test_minimal_off
def test_minimal_off(abcd):
    a, b, *_ = abcd

    def fn(a, b):
        with jamp.autocast(enabled=False):
            return a @ b

    result = transform(fn)(a, b)
    assert result.dtype == F32
    chex.assert_trees_all_close(result, a @ b)


# ports test_runtime_autocast_state: `enabled` from a runtime value is an error.
def test_runtime_autocast_state(abcd):
    a, b, *_ = abcd

    def fn(a, b, use_amp):
        with jamp.autocast(enabled=use_amp):
            return a @ b

    with pytest.raises(TypeError, match="enabled"):
        transform(fn)(a, b, jnp.asarray(True))
    with pytest.raises(TypeError, match="enabled"):
        jax.jit(transform(fn))(a, b, True)


# ports test_runtime_autocast_state_expr: `enabled` from a data-dependent expression.
def test_runtime_autocast_state_expr(abcd):
    a, b, *_ = abcd

    def fn(a, b):
        with jamp.autocast(enabled=a[0, 0] > 0.5):
            return a @ b

    with pytest.raises(TypeError, match="enabled"):
        transform(fn)(a, b)


# ports test_explicit_casts: user casts are kept as written (float64 needs x64).
def test_explicit_casts(abcd):
    with jax.enable_x64(True):
        a, b, c, d = (jnp.asarray(np.asarray(x), jnp.float32) for x in abcd)

        def fn(a, b, c, d):
            e = (a.astype(jnp.float64) @ b.astype(jnp.float64)).astype(jnp.float32)
            f = (c @ d).astype(jnp.float64)
            with jamp.autocast(enabled=False):
                g = c.astype(jnp.float64) @ f
            return e, f, g

        e, f, g = transform(fn)(a, b, c, d)
        assert (e.dtype, f.dtype, g.dtype) == (F32, F64, F64)
        # e was computed in float64 (never narrowed), so it matches the float32 product closely.
        chex.assert_trees_all_close(e, a @ b, rtol=1e-6)
        # f is the bfloat16 product, widened afterwards exactly as the user wrote.
        ref_f = (c.astype(BF16) @ d.astype(BF16)).astype(jnp.float64)
        chex.assert_trees_all_close(f, ref_f, rtol=1e-2)


# ports test_explicit_casts, the part that needs no x64: a cast to another low dtype is kept.
def test_explicit_cast_to_float16_is_kept(abcd):
    a, b, *_ = abcd

    def fn(a, b):
        return (a.astype(jnp.float16) @ b.astype(jnp.float16)), (a @ b).astype(jnp.float16)

    x, y = transform(fn)(a, b)
    assert (x.dtype, y.dtype) == (BF16, F16)  # the matmul is lowered, the user's final cast kept


# ports test_duplicate_inputs: one value used as both operands.
def test_duplicate_inputs(abcd):
    a, *_ = abcd

    def fn(a):
        e = a @ a
        f = e @ e
        return e, f

    jaxpr = jax.make_jaxpr(transform(fn))(a)
    e, f = transform(fn)(a)
    assert (e.dtype, f.dtype) == (BF16, BF16)
    assert len(converts_to(jaxpr, BF16)) == 1  # `a` is converted once, not once per operand


# ports test_fp32_policy: log of a low-precision input runs in float32.
@pytest.mark.parametrize("in_dtype", [F16, BF16], ids=_id)
def test_fp32_policy(abcd, in_dtype):
    a = host_cast(abcd[0], in_dtype)
    result = transform(jnp.log)(a)
    assert result.dtype == F32
    chex.assert_trees_all_close(result, jnp.log(a.astype(F32)))


# ports test_fp32_policy_with_fp64: float64 is never narrowed.
def test_fp32_policy_with_fp64(abcd):
    with jax.enable_x64(True):
        a = jnp.asarray(np.asarray(abcd[0]), jnp.float64)
        assert transform(jnp.log)(a).dtype == F64


# ports test_promote_policy: `addcmul(e, c, d, value=0.1)` with e from a matmul.
def test_promote_policy(abcd):
    a, b, c, d = abcd

    def fn(a, b, c, d):
        e = a @ b
        f = e + 0.1 * c * d
        return e, f

    with jax.disable_jit():  # exact comparison: op by op (see test_autocast_promote_ops)
        e, f = transform(fn)(a, b, c, d)
    assert (e.dtype, f.dtype) == (BF16, F32)
    chex.assert_trees_all_close(f, e.astype(F32) + 0.1 * c * d, rtol=1e-6)


# ports test_promote_policy_fp64
def test_promote_policy_fp64(abcd):
    with jax.enable_x64(True):
        a, b = (jnp.asarray(np.asarray(x), jnp.float64) for x in abcd[:2])
        result = transform(lambda a, b: a + 0.1 * a * b)(a, b)
        assert result.dtype == F64
        # ...and with a matmul in the middle, f64 operands keep the matmul in f64 too.
        assert transform(lambda a, b: (a @ b) + 0.1 * a * b)(a, b).dtype == F64


# ports test_fp32_set_opt_dtype_policy: softmax of low-precision inputs comes out float32; an
# explicit dtype (torch's `dtype=` argument) is spelled as a cast in JAX and is honoured.
def test_softmax_dtype_policy(abcd_f16):
    a, b, c, d = abcd_f16

    def fn(a, b, c, d):
        x = jax.nn.softmax(a, axis=0)
        y = jax.nn.softmax(b.astype(jnp.bfloat16), axis=0)
        z = jax.nn.softmax(c.astype(jnp.float32), axis=0)
        # The user asks for float16 back. (The cast must change the traced dtype to be visible:
        # JAX drops `x.astype(x.dtype)` at trace time, so there is nothing left to keep.)
        w = jax.nn.softmax(d.astype(jnp.float32), axis=0).astype(jnp.float16)
        return x, y, z, w

    x, y, z, w = transform(fn)(a, b, c, d)
    assert dtypes((x, y, z, w)) == (F32, F32, F32, F16)
    reference = jax.jit(lambda a: jax.nn.softmax(a.astype(F32), axis=0))(a)
    chex.assert_trees_all_close(x, reference, rtol=1e-2, atol=1e-3)


# torch's fp32_append_dtype ops (sum, prod, ...) keep a dtype= given to them under autocast and
# compute in float32 otherwise. jnp.sum, prod and mean take a dtype= too, and reduce in a 16-bit
# one only where it is named: both forms keep it, eager and jitted. A reduction naming no dtype
# (of a value the policy made 16-bit, lax.reduce_sum of a 16-bit value, inside a user's jit too,
# whose decision a region must not share with jnp's; jnp.cumsum) runs in float32, as before.
@pytest.mark.parametrize("form", ["transform", "jitted transform", "region", "jitted region"])
def test_a_reduction_keeps_the_16_bit_dtype_named_for_it(form):
    x = jax.device_put(0.5 + host_rand(7, (4, 8)))  # [0.5, 1.5): products stay in range
    w = jax.device_put(host_rand(8, (8, 8)))
    reduce_in_a_jit = jax.jit(lambda v: lax.reduce_sum(v, (0, 1)))

    def fn(x, w):
        h, x16 = x @ w, x.astype(jnp.bfloat16)
        named = (jnp.sum(x, dtype=BF16), jnp.prod(x, axis=0, dtype=F16),
                 jnp.mean(x, axis=1, dtype=BF16), jnp.nansum(x, axis=0, dtype=F16),
                 jnp.sum(x16, dtype=BF16))
        unnamed = (jnp.sum(h), jnp.cumsum(h, axis=1), lax.reduce_sum(x16, (0, 1)),
                   reduce_in_a_jit(x16))
        return named, unnamed, jnp.sum(x16, dtype=BF16)  # (after the jit's: not its decision)

    def in_region(x, w):
        with jamp.autocast():
            return fn(x, w)

    run = {"transform": transform(fn), "jitted transform": jax.jit(transform(fn)),
           "region": in_region, "jitted region": jax.jit(in_region)}[form]
    named, unnamed, again = run(x, w)
    assert dtypes(named) == (BF16, F16, BF16, F16, BF16)
    assert dtypes(unnamed) == (F32,) * 4 and again.dtype == BF16
    want, _, _ = jax.jit(fn)(x, w)  # plain JAX: the same reductions, in the dtypes named
    chex.assert_trees_all_close(named, want, rtol=1e-2)
    exact = np.sum(np.asarray(x.astype(jnp.bfloat16), np.float32))
    np.testing.assert_allclose(unnamed[2:], [exact, exact], rtol=1e-5)  # summed in float32


# ports test_fp32_set_opt_dtype_policy (the torch.float64 argument) and ..._policy_fp64
def test_softmax_dtype_policy_fp64(abcd):
    with jax.enable_x64(True):
        a, b = (jnp.asarray(np.asarray(x), jnp.float16) for x in abcd[:2])
        c, d = (jnp.asarray(np.asarray(x), jnp.float64) for x in abcd[2:])

        def fn(a, b, c, d):
            return (jax.nn.softmax(a, axis=0), jax.nn.softmax(b.astype(jnp.float64), axis=0),
                    jax.nn.softmax(c, axis=0), jax.nn.log_softmax(d, axis=0))

        assert dtypes(transform(fn)(a, b, c, d)) == (F32, F64, F64, F64)


# ports test_control_flow (skipped in torch for lack of type propagation): the branches of a
# data-dependent `lax.cond` are rewritten like straight-line code.
@pytest.mark.parametrize("first", [0.9, 0.1])
def test_control_flow(abcd, first):
    a, b, c, d = abcd
    a = with_first(a, first)

    def fn(a, b, c, d):
        e, x = lax.cond(a[0, 0] > 0.5, lambda: (a @ b, 1), lambda: (c @ d, 2))
        f = (d @ e) * x
        return e, f

    e, f = transform(fn)(a, b, c, d)
    assert (e.dtype, f.dtype) == (BF16, BF16)
    ref_e = a @ b if first > 0.5 else c @ d
    chex.assert_trees_all_close(e.astype(F32), ref_e, **LOW_TOL)


# ports test_divergent_types: branches disagree about which result is widened; the final matmul
# runs with autocast off on float32 operands.
@pytest.mark.parametrize("first", [0.9, 0.1])
def test_divergent_types(abcd, first):
    a, b, c, d = abcd
    a = with_first(a, first)

    def fn(a, b, c, d):
        def then(ops):
            a, b, c, d = ops
            return a @ b, (a @ b).astype(jnp.float32)

        def otherwise(ops):
            a, b, c, d = ops
            return (c @ d).astype(jnp.float32), a @ b

        e, f = lax.cond(a[0, 0] > 0.5, then, otherwise, (a, b, c, d))
        with jamp.autocast(enabled=False):
            return e.astype(jnp.float32) @ f.astype(jnp.float32)

    result = transform(fn)(a, b, c, d)
    assert result.dtype == F32
    e = a @ b if first > 0.5 else c @ d
    chex.assert_trees_all_close(result, e @ (a @ b), **LOW_TOL)


# ports test_divergent_autocast: one branch in an enabled region, the other in a disabled one.
@pytest.mark.parametrize("first", [0.9, 0.1])
def test_divergent_autocast(abcd, first):
    a, b, c, d = abcd
    a = with_first(a, first)
    autocast_on, autocast_off = jamp.autocast(enabled=True), jamp.autocast(enabled=False)

    def fn(a, b, c, d):
        def then(ops):
            a, b, c, d = ops
            with autocast_on:
                return a @ b

        def otherwise(ops):
            a, b, c, d = ops
            with autocast_off:
                return c @ d

        e = lax.cond(a[0, 0] > 0.5, then, otherwise, (a, b, c, d))
        return e @ e

    result = transform(fn)(a, b, c, d)
    assert result.dtype == BF16
    e = a @ b if first > 0.5 else c @ d
    chex.assert_trees_all_close(result.astype(F32), e @ e, **LOW_TOL)


# ports test_conditional_autocast: choosing the region from data is not supported (JAX refuses
# to turn a traced value into a Python bool, and jamp traces even on eager calls).
def test_conditional_autocast(abcd):
    a, b, *_ = abcd
    autocast_on, autocast_off = jamp.autocast(enabled=True), jamp.autocast(enabled=False)

    def fn(a, b):
        with autocast_on if a[0, 0] > 0.5 else autocast_off:
            return a @ b

    with pytest.raises(jax.errors.ConcretizationTypeError):
        transform(fn)(a, b)


# ports test_nested_autocast
def test_nested_autocast(abcd):
    def fn(a, b, c, d):
        with jamp.autocast(enabled=False):
            e = a @ b
            with jamp.autocast(enabled=True):
                f = e @ c
                with jamp.autocast(enabled=False):
                    g = e @ d
        return e, f, g

    assert dtypes(transform(fn)(*abcd)) == (F32, BF16, F32)


# ports test_implicitly_nested_autocast
def test_implicitly_nested_autocast(abcd):
    a, b, *_ = abcd

    def fn(a, b):
        with jamp.autocast(enabled=False), jamp.autocast(enabled=True):
            return a @ b

    assert transform(fn)(a, b).dtype == BF16


# ports test_reused_autocast
def test_reused_autocast(abcd):
    def fn(a, b, c, d):
        autocast_instance = jamp.autocast(enabled=True)
        with autocast_instance:
            e = a @ b
            with autocast_instance:
                e = c @ d
                f = d @ e
        g = e @ f
        return e, f, g

    assert dtypes(transform(fn)(*abcd)) == (BF16, BF16, BF16)


# ports test_reused_autocast_expr (skipped in torch: `with autocast() as instance`), with a
# disabled instance so that re-entering it is observable.
def test_reused_autocast_expr(abcd):
    def fn(a, b, c, d):
        with jamp.autocast(enabled=False) as autocast_instance:
            e = a @ b
            with autocast_instance:
                f = c @ d
            g = e @ f
        with autocast_instance:
            h = g @ a
        i = h @ a
        return e, f, g, h, i

    assert dtypes(transform(fn)(*abcd)) == (F32, F32, F32, F32, BF16)


def _helper(a, b):
    return a @ b


def _helper_on(a, b):
    with jamp.autocast(enabled=True):
        return a @ b


def _helper_off(a, b):
    with jamp.autocast(enabled=False):
        return a @ b


CALLEE_KINDS = {"plain": lambda f: f, "jitted": jax.jit}


# ports test_callees: helpers (plain and jax.jit-ed) inherit the region of the call site.
@pytest.mark.parametrize("kind", CALLEE_KINDS)
def test_callees(abcd, kind):
    a, b, *_ = abcd
    helper = CALLEE_KINDS[kind](_helper)

    def fn(a, b):
        tmp = helper(a, b)
        tmp = helper(tmp, tmp)
        tmp = helper(tmp, tmp)
        tmp = helper(tmp, tmp)
        return helper(tmp, b)

    assert transform(fn)(a, b).dtype == BF16


# ports test_callees, the region half: the same callee inherits whichever region it is called in.
@pytest.mark.parametrize("kind", CALLEE_KINDS)
def test_callee_inherits_each_call_sites_region(abcd, kind):
    a, b, *_ = abcd
    helper = CALLEE_KINDS[kind](_helper)

    def fn(a, b):
        x = helper(a, b)
        with jamp.autocast(enabled=False):
            y = helper(a, b)
        with jamp.autocast(dtype=jnp.float16):
            z = helper(a, b)
        return x, y, z

    assert dtypes(transform(fn)(a, b)) == (BF16, F32, F16)
    assert dtypes(jax.jit(transform(fn))(a, b)) == (BF16, F32, F16)


# ports test_callees_with_autocast_on: a region inside the callee wins over the caller's.
@pytest.mark.parametrize("kind", CALLEE_KINDS)
def test_callees_with_autocast_on(abcd, kind):
    a, b, *_ = abcd
    helper = CALLEE_KINDS[kind](_helper_on)

    def fn(a, b):
        with jamp.autocast(enabled=False):
            return helper(a, b)

    assert transform(fn)(a, b).dtype == BF16


# ports test_callees_with_autocast_off
@pytest.mark.parametrize("kind", CALLEE_KINDS)
def test_callees_with_autocast_off(abcd, kind):
    a, b, *_ = abcd
    helper = CALLEE_KINDS[kind](_helper_off)

    def fn(a, b):
        with jamp.autocast(enabled=True):
            return helper(a, b)

    result = transform(fn)(a, b)
    assert result.dtype == F32
    chex.assert_trees_all_close(result, a @ b)


# ports test_eager_and_script: one jitted function, called alternately with and without autocast;
# neither call's compilation leaks into the other.
def test_eager_and_script(abcd):
    a, b, *_ = abcd
    fn = jax.jit(lambda a, b: a @ b)
    autocast_fn = transform(fn)
    for i in range(8):
        use_autocast = i % 2 == 0
        result = (autocast_fn if use_autocast else fn)(a, b)
        assert result.dtype == (BF16 if use_autocast else F32)


# ports test_script_and_tracing: a jitted (traced) callee is rewritten, not treated as opaque.
def test_script_and_tracing(abcd):
    a, b, *_ = abcd
    traced = jax.jit(_helper)

    def fn(a, b):
        with jamp.autocast(enabled=True):
            return traced(a, b)

    assert transform(fn)(a, b).dtype == BF16
    assert transform(traced)(a, b).dtype == BF16


# ports test_script_and_tracing_with_autocast (skipped in torch: autocast(False) was ignored
# inside traced functions): a disabled region inside a jitted callee is honoured.
def test_script_and_tracing_with_autocast(abcd):
    a, b, *_ = abcd

    @jax.jit
    def traced(a, b):
        with jamp.autocast(enabled=False):
            return (a @ b) * 2.0

    def fn(a, b):
        with jamp.autocast(enabled=True):
            return traced(a, b)

    result = transform(fn)(a, b)
    assert result.dtype == F32
    chex.assert_trees_all_close(result, (a @ b) * 2.0)


# ports test_tracing_and_script: jit outside the transform.
def test_tracing_and_script(abcd):
    a, b, *_ = abcd
    traced = jax.jit(transform(_helper))
    assert traced(a, b).dtype == BF16


# ports test_tracing_with_autocast_and_script (skipped in torch): jit(decorator(jit(fn))).
def test_tracing_with_autocast_and_script(abcd):
    a, b, *_ = abcd
    scripted = jax.jit(_helper)
    traced = jax.jit(jamp.autocast(enabled=True)(scripted))
    assert traced(a, b).dtype == BF16


class _ScriptModule(nn.Module):
    """torch's TestModule: a raw weight (mv, here batched) followed by a Linear."""
    n: int = 2
    m: int = 3

    @nn.compact
    def __call__(self, x):
        weight = self.param("weight", nn.initializers.uniform(), (self.n, self.m), jnp.float32)
        return nn.Dense(self.m)(x @ weight.T)


# ports test_script_module: a Flax module's apply, transformed, computes in the compute dtype.
def test_script_module():
    model = _ScriptModule()
    x = rand(0, (4, 3))  # a batch: the bias is broadcast over it (README: "Bias adds")
    params = model.init(jax.random.PRNGKey(1), x)
    result = transform(model.apply)(params, x)
    # torch's Linear under autocast returns float16; the Flax layer must return the compute dtype,
    # exactly as nn.Dense(dtype=bfloat16) does.
    assert result.dtype == BF16
    reference = jax.jit(lambda params, x: nn.Dense(3, dtype=jnp.bfloat16).apply(
        {"params": params["params"]["Dense_0"]},
        x.astype(BF16) @ params["params"]["weight"].astype(BF16).T))(params, x)
    chex.assert_trees_all_close(result.astype(F32), reference.astype(F32), **LOW_TOL)


# ports test_autocast_decorator (skipped in torch): the decorator inside a transformed function
# is a region.
def test_autocast_decorator_inside_transform(abcd):
    a, b, *_ = abcd

    @jamp.autocast(dtype=jnp.float16)
    def half(a, b):
        return a @ b

    @jamp.autocast(enabled=False)
    def full(a, b):
        return a @ b

    def fn(a, b):
        return half(a, b), full(a, b), a @ b

    assert dtypes(transform(fn)(a, b)) == (F16, F32, BF16)
    assert dtypes(jax.jit(transform(fn))(a, b)) == (F16, F32, BF16)


# ports test_autocast_decorator_outside_jit: elsewhere the decorator applies the transform itself,
# over a jitted function too, and under jit.
def test_autocast_decorator_outside_transform(abcd):
    a, b, *_ = abcd

    @jamp.autocast(enabled=True)
    @jax.jit
    def fn(a, b):
        return a @ b

    @jamp.autocast(dtype=jnp.float16)
    def half(a, b):
        return a @ b

    assert fn(a, b).dtype == BF16
    assert half(a, b).dtype == F16
    assert jax.jit(half)(a, b).dtype == F16


# ports test_inplace: JAX has no in-place ops; writing a low-precision result into a float32
# buffer (torch's `out=a` / `addmm_`) keeps the buffer's dtype, while the product itself is lowered.
def test_inplace(abcd):
    a, b, c, _ = abcd

    def fn(a, b, c):
        x = b @ c
        y = a.at[:].set(b @ c)
        z = lax.dynamic_update_slice(a, (b @ c)[:1], (1, 0))
        return x, y, z

    with jax.disable_jit():  # exact comparison: op by op (see test_autocast_promote_ops)
        x, y, z = transform(fn)(a, b, c)
    assert dtypes((x, y, z)) == (BF16, F32, F32)
    chex.assert_trees_all_close(y, x.astype(F32))


# ports test_autocast_api: the ways of asking for a compute dtype, each with casts in the program
# and the same dtypes eagerly and under jit (torch's _test_autocast helper).
@pytest.mark.parametrize("spelling, expected", [
    ("transform_dtype_bf16", BF16), ("transform_dtype_f16", F16), ("policy_f16", F16),
    ("region_f16", F16), ("decorator_bf16", BF16),
])
def test_autocast_api(abcd, spelling, expected):
    x, y, *_ = abcd

    def mm(x, y):
        return x @ y

    def region(x, y):
        with jamp.autocast(dtype=jnp.float16):
            return x @ y

    fn = {
        "transform_dtype_bf16": lambda: transform(mm, dtype=jnp.bfloat16),
        "transform_dtype_f16": lambda: transform(mm, dtype=jnp.float16),
        "policy_f16": lambda: transform(mm, jamp.Policy(jnp.float16)),
        "region_f16": lambda: transform(region),
        "decorator_bf16": lambda: jamp.autocast(dtype=jnp.bfloat16)(mm),
    }[spelling]()
    eager, jitted = fn(x, y), jax.jit(fn)(x, y)
    assert eager.dtype == jitted.dtype == expected
    chex.assert_trees_all_close(eager, jitted)
    assert len(converts_to(jax.make_jaxpr(fn)(x, y), expected)) == 2


# ports test_autocast_mixed_dtypes: nested regions with different dtypes, the innermost wins.
def test_autocast_mixed_dtypes(abcd):
    def fn(a, b, c, d):
        with jamp.autocast(dtype=jnp.bfloat16):
            with jamp.autocast(dtype=jnp.float16):
                inner = a @ b
            outer = c @ d
        return inner, outer

    assert dtypes(transform(fn)(*abcd)) == (F16, BF16)


# ports test_jit_executor_under_autocast: a function with no autocast code at all is unchanged
# untransformed and lowered when transformed, eagerly and under jit.
def test_jit_executor_under_autocast(abcd):
    def t(a, b, c, d):
        return a @ b, c @ d

    assert dtypes(t(*abcd)) == (F32, F32)
    assert dtypes(jax.jit(t)(*abcd)) == (F32, F32)
    assert dtypes(transform(t)(*abcd)) == (BF16, BF16)
    assert dtypes(jax.jit(transform(t))(*abcd)) == (BF16, BF16)
    assert dtypes(transform(jax.jit(t))(*abcd)) == (BF16, BF16)
    assert not converts_to(jax.make_jaxpr(t)(*abcd), BF16)


# ports test_autocast_autodiff: gradients come back in the primal dtypes, the backward matmuls run
# in the compute dtype, and eager / jit agree with a hand-written mixed-precision reference.
def test_autocast_autodiff():
    t0, t1 = rand(0, (5, 5)), rand(1, (5, 5))

    def t(t0, t1):
        return jnp.sum(jax.nn.relu(t0 @ t1))

    def reference(t0, t1):
        o = jnp.dot(t0.astype(BF16), t1.astype(BF16), preferred_element_type=BF16)
        return jnp.sum(jax.nn.relu(o).astype(F32))

    grad_fn = jax.value_and_grad(transform(t), argnums=(0, 1))
    eager, jitted = grad_fn(t0, t1), jax.jit(grad_fn)(t0, t1)
    expected = jax.jit(jax.value_and_grad(reference, argnums=(0, 1)))(t0, t1)
    assert dtypes(eager) == dtypes(jitted) == (F32, (F32, F32))
    # XLA may fuse away the bf16 rounding between ops under jit: agreement to bf16 precision.
    chex.assert_trees_all_close(eager, jitted, rtol=1e-2, atol=1e-2)
    chex.assert_trees_all_close(eager, expected, rtol=1e-2, atol=1e-2)

    jaxpr = jax.make_jaxpr(jax.grad(transform(t), argnums=(0, 1)))(t0, t1)
    dots = eqns_named(jaxpr, "dot_general")
    assert len(dots) == 3  # one forward, two backward
    for eqn in dots:
        assert [v.aval.dtype for v in eqn.invars] == [BF16, BF16], eqn
        assert eqn.outvars[0].aval.dtype == BF16, eqn


# ports test_autocast_autodiff for a Flax layer: f32 params give f32 grads.
def test_autocast_autodiff_flax_params():
    model = nn.Sequential([nn.Dense(8), nn.relu, nn.Dense(2)])
    x = rand(0, (4, 3))
    params = model.init(jax.random.PRNGKey(0), x)

    def loss(params, x):
        return jnp.mean(model.apply(params, x) ** 2)

    grads = jax.grad(transform(loss))(params, x)
    assert jax.tree.leaves(dtypes(grads)) == jax.tree.leaves(dtypes(params))
    for eqn in eqns_named(jax.make_jaxpr(jax.grad(transform(loss)))(params, x), "dot_general"):
        assert [v.aval.dtype for v in eqn.invars] == [BF16, BF16], eqn


# ports test_jit_call_method_under_autocast: a jitted callee invoked inside the region on a
# low-precision intermediate computes the right values.
def test_jit_call_method_under_autocast():
    x, y = rand(0), rand(1)
    impl = jax.jit(lambda x, y: x @ y)

    def thing(x, y):
        a = x @ y
        return impl(a, x)

    result = transform(thing)(x, y)
    assert result.dtype == BF16
    chex.assert_trees_all_close(result.astype(F32), (x @ y) @ x, **LOW_TOL)


# ports test_jit_freeze_autocast_basic: mm(x, y) needs exactly two casts.
def test_jit_freeze_autocast_basic():
    x, y = rand(0, (3, 4)), rand(1, (4, 5))
    fn = transform(lambda x, y: x @ y)
    jaxpr = jax.make_jaxpr(fn)(x, y)
    assert len(eqns_named(jaxpr, "convert_element_type")) == 2
    assert len(eqns_named(jax.make_jaxpr(jax.jit(fn))(x, y), "convert_element_type")) == 2


# ports test_jit_freeze_autocast_constants: a constant weight is cast at rewrite time, so the
# program only converts the input.
@pytest.mark.parametrize("const_kind", ["numpy", "jax"])
def test_jit_freeze_autocast_constants(const_kind):
    weight = rand(0, (3, 4))
    weight = np.asarray(weight) if const_kind == "numpy" else weight
    y = rand(1, (4, 5))

    def forward(y):
        return jnp.asarray(weight) @ y

    fn = transform(forward)
    jaxpr = jax.make_jaxpr(fn)(y)
    assert [e.params["new_dtype"] for e in eqns_named(jaxpr, "convert_element_type")] == [BF16]
    assert fn(y).dtype == BF16
    chex.assert_trees_all_close(fn(y).astype(F32), np.asarray(weight) @ y, **LOW_TOL)


# ports test_jit_autocast_softmax_cpu / _gpu: softmax of a low-precision input comes out float32
# (issue #2: `jax.nn.softmax(bf16)` is f32; torch's CPU list keeps bf16, its CUDA list gives f32).
@pytest.mark.parametrize("in_dtype", [BF16, F16], ids=_id)
def test_jit_autocast_softmax(in_dtype):
    x = rand(0, dtype=in_dtype)
    fn = jax.jit(transform(lambda x: jax.nn.softmax(x, axis=0)))
    fn(x)
    y = fn(x)
    assert y.dtype == F32
    chex.assert_trees_all_close(jnp.sum(y, axis=0), jnp.ones(2), rtol=1e-2)


# ports test_ignore_amp: a function can be excluded from autocast, by a policy rule on its scope
# or by decorating it with autocast(enabled=False); no casts are inserted for it.
def test_ignore_amp():
    inp = rand(0, (10, 10))

    def foo(x):
        with jax.named_scope("foo"):
            return x @ x

    ignored = transform(foo, jamp.Policy(rules=(("foo", None),)))
    assert ignored(inp).dtype == F32
    assert not eqns_named(jax.make_jaxpr(ignored)(inp), "convert_element_type")

    decorated = transform(lambda x: jamp.autocast(enabled=False)(lambda x: x @ x)(x))
    assert decorated(inp).dtype == F32
    assert not eqns_named(jax.make_jaxpr(decorated)(inp), "convert_element_type")


# ==============================================================================================
# test_jit_autocast.py :: TestJitTraceAutocast (models)
# ==============================================================================================

class _ConvBN(nn.Module):
    """torch's convbn, channels-last and scaled down for the CPU."""
    bias: bool = True
    dtype: Any = None

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(8, (7, 7), strides=2, use_bias=self.bias, dtype=self.dtype)(x)
        return nn.BatchNorm(use_running_average=True, dtype=self.dtype)(x)


class _MnistNet(nn.Module):
    """torch's jit.test_models.MnistNet in Flax (dropout in eval mode)."""
    dtype: Any = None

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.max_pool(nn.Conv(10, (5, 5), padding="VALID", dtype=self.dtype)(x),
                                (2, 2), (2, 2)))
        x = nn.relu(nn.max_pool(nn.Conv(20, (5, 5), padding="VALID", dtype=self.dtype)(x),
                                (2, 2), (2, 2)))
        x = x.reshape(x.shape[0], -1)
        x = nn.relu(nn.Dense(50, dtype=self.dtype)(x))
        x = nn.Dense(10, dtype=self.dtype)(x)
        return jax.nn.log_softmax(x, axis=1)


MODELS = {
    "mnist": (_MnistNet, {}, (5, 28, 28, 1)),
    "convbn_bias": (_ConvBN, {"bias": True}, (4, 32, 32, 3)),
    "convbn_nobias": (_ConvBN, {"bias": False}, (4, 32, 32, 3)),
}


# ports test_generate_autocast_jit_trace_model and test_nchw_autocast_jit_trace_model: the jitted
# autocast model agrees with the eager one, and with the same model written by hand in bf16.
@pytest.mark.parametrize("name", [  # fast twins of the mnist net: the convbn models
    pytest.param(name, marks=pytest.mark.slow) if name == "mnist" else name for name in MODELS])
def test_autocast_jit_trace_model(name):
    cls, kwargs, shape = MODELS[name]
    x = jax.device_put(np.random.default_rng(0).standard_normal(shape, dtype=np.float32))
    variables = cls(**kwargs).init(jax.random.PRNGKey(1), x)
    apply = transform(cls(**kwargs).apply)
    eager, traced = apply(variables, x), jax.jit(apply)(variables, x)
    assert eager.dtype == traced.dtype
    # (jit fuses ops and may skip intermediate bf16 roundings: agreement to bf16 precision)
    chex.assert_trees_all_close(traced, eager, rtol=2e-2, atol=2e-2)
    by_hand = jax.jit(cls(dtype=jnp.bfloat16, **kwargs).apply)(variables, x)
    chex.assert_trees_all_close(eager.astype(F32), by_hand.astype(F32), rtol=5e-2, atol=5e-2)
    full = jax.jit(cls(**kwargs).apply)(variables, x)
    chex.assert_trees_all_close(eager.astype(F32), full, rtol=1e-1, atol=1e-1)


# ports test_nhwc_autocast_jit_trace_model: the layout does not change dtypes or values.
def test_nhwc_and_nchw_autocast():
    x_nchw = np.random.default_rng(0).standard_normal((2, 3, 16, 16), dtype=np.float32)
    w_oihw = np.random.default_rng(1).standard_normal((8, 3, 3, 3), dtype=np.float32)

    def nchw(x, w):
        return lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                        dimension_numbers=("NCHW", "OIHW", "NCHW"))

    def nhwc(x, w):
        return lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))

    a = jax.jit(transform(nchw))(jax.device_put(x_nchw), jax.device_put(w_oihw))
    b = jax.jit(transform(nhwc))(jax.device_put(x_nchw.transpose(0, 2, 3, 1)),
                                 jax.device_put(w_oihw.transpose(2, 3, 1, 0)))
    assert a.dtype == b.dtype == BF16
    chex.assert_trees_all_close(a.transpose(0, 2, 3, 1).astype(F32), b.astype(F32),
                                rtol=1e-2, atol=1e-2)


# ports test_cat_promote: concatenating mixed precisions runs in the widest, with a cast.
def test_cat_promote():
    a = rand(0, (3, 4, 4))
    b = rand(1, (3, 4, 4), BF16)
    fn = transform(lambda a, b: jnp.concatenate([a, b], 0))
    for traced in (fn, jax.jit(fn)):
        for _ in range(3):
            c = traced(a, b)
        assert c.dtype == F32
    assert converts_to(jax.make_jaxpr(fn)(a, b), F32)

    # The autocast-specific case: a lowered matmul output meets a float32 value.
    w = rand(2, (4, 4))
    mixed = transform(lambda a, w: jnp.concatenate([a @ w, a], 0))(a, w)
    assert mixed.dtype == F32


# ports test_script_autocast_cpu / test_script_autocast_cuda: is_autocast_enabled() at trace time.
def test_script_autocast_is_enabled():
    def fn(x):
        if jamp.is_autocast_enabled():
            return jax.nn.relu(x)
        return jnp.sin(x)

    x = jax.device_put(host_rand(0, (4, 4)) - np.float32(0.5))
    chex.assert_trees_all_close(transform(fn)(x), jax.nn.relu(x))
    chex.assert_trees_all_close(jax.jit(transform(fn))(x), jax.nn.relu(x))
    chex.assert_trees_all_close(fn(x), jnp.sin(x))
    chex.assert_trees_all_close(jax.jit(fn)(x), jnp.sin(x))


# ports test_script_autocast_enable_and_check and test_scripted_aliasing: the query answers for
# the region it is asked in, before, inside and after nested regions.
def test_script_autocast_enable_and_check():
    x, y = rand(0), rand(1)
    flags: list[bool] = []

    def fn(x, y):
        flags.append(jamp.is_autocast_enabled())
        v1 = x @ y
        with jamp.autocast(enabled=True):
            flags.append(jamp.is_autocast_enabled())
            v2 = x @ y
            with jamp.autocast(enabled=False):
                flags.append(jamp.is_autocast_enabled())
                v3 = x @ y
        flags.append(jamp.is_autocast_enabled())
        return v1, v2, v3

    outs = transform(fn)(x, y)
    assert flags == [True, True, False, True]
    for v, b in zip(outs, flags):
        assert (v.dtype == F32) != b
    assert not jamp.is_autocast_enabled()  # and nothing leaks out of the transform


# ==============================================================================================
# test_autocast.py :: TestAutocastCPU (op lists)
# ==============================================================================================

# torch_fp32 / nn_fp32: these run in float32 whatever low precision their input has.
FP32_OPS = {
    "exp": jnp.exp, "log": jnp.log, "log1p": jnp.log1p, "expm1": jnp.expm1, "tan": jnp.tan,
    "arcsin": jnp.arcsin, "arccos": jnp.arccos, "sinh": jnp.sinh, "cosh": jnp.cosh,
    "erfinv": special.erfinv, "lgamma": special.gammaln, "digamma": special.digamma,
    "pow": lambda x: jnp.power(x, 2.5), "rsqrt": lax.rsqrt, "exp2": jnp.exp2,
    "log2": jnp.log2, "log10": jnp.log10,
    "cumsum": lambda x: jnp.cumsum(x, axis=0), "cumprod": lambda x: jnp.cumprod(x, axis=0),
    "cumlogsumexp": lambda x: lax.cumlogsumexp(x, axis=0),
    "logsumexp": special.logsumexp, "softmax": jax.nn.softmax, "log_softmax": jax.nn.log_softmax,
    "softplus": jax.nn.softplus,
}

# jnp reductions that compute low-precision inputs in float32 and, by jnp's contract, cast the
# result back (`convert -> reduce_sum -> convert`). jamp keeps the program's own casts, so these
# return the input dtype for low-precision *inputs*, and float32 for activations that became
# low precision through autocast (the traced program has no casts there).
UPCASTING_REDUCTIONS = {
    "sum": jnp.sum, "sum_axis": lambda x: jnp.sum(x, axis=0), "prod": jnp.prod,
    "norm": jnp.linalg.norm,
}


@pytest.mark.parametrize("in_dtype, compute",
                         [(BF16, BF16), (F16, F16), (BF16, F16), (F32, BF16)], ids=_id)
@pytest.mark.parametrize("name", FP32_OPS)
def test_autocast_fp32_ops(name, in_dtype, compute):
    x = host_cast(host_rand(0, (4, 4)) * 0.8 + 0.1, in_dtype)  # in (0.1, 0.9): inside every domain
    op = FP32_OPS[name]
    result = transform(op, dtype=compute)(x)
    assert result.dtype == F32
    chex.assert_trees_all_close(result, op(x.astype(F32)), rtol=2e-2, atol=1e-2)


@pytest.mark.parametrize("name", UPCASTING_REDUCTIONS)
def test_autocast_upcasting_reductions(name):
    op = UPCASTING_REDUCTIONS[name]
    x = host_cast(host_rand(0, (4, 4)) * 0.8 + 0.1, F32)
    eye = jax.device_put(np.eye(4, dtype=np.float32))
    fed_by_matmul = transform(lambda x, eye: op(x @ eye))
    assert fed_by_matmul(x, eye).dtype == F32  # torch: sum(mm(a, b)) is float32
    jaxpr = jax.make_jaxpr(fed_by_matmul)(x, eye)
    reductions = [e for e in iter_eqns(jaxpr) if e.primitive.name in ("reduce_sum", "reduce_prod")]
    assert reductions and all(e.invars[0].aval.dtype == F32 for e in reductions)
    low = host_cast(x, BF16)
    result = transform(op)(low)
    assert result.dtype == BF16  # the program's own downcast is kept
    chex.assert_trees_all_close(result.astype(F32), op(host_cast(low, F32)), rtol=2e-2, atol=1e-2)


_dense = nn.Dense(6)
_dense_nobias = nn.Dense(6, use_bias=False)
_conv = nn.Conv(4, (3, 3))
_conv_nobias = nn.Conv(4, (3, 3), use_bias=False)


def _flax(module: nn.Module, shape: tuple[int, ...]) -> tuple[Callable, tuple[Any, ...]]:
    x = rand(11, shape)
    return module.apply, (module.init(jax.random.PRNGKey(0), x), x)


def _conv_nhwc(x, w):
    return lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                    dimension_numbers=("NHWC", "HWIO", "NHWC"))


# torch_16 / nn_16: matmuls and convolutions run in (and return) the compute dtype.
LOWER_OPS = {
    "matmul": lambda: (jnp.matmul, (rand(0, (4, 8)), rand(1, (8, 5)))),
    "matvec": lambda: (jnp.matmul, (rand(0, (4, 8)), rand(1, (8,)))),
    "bmm": lambda: (jnp.matmul, (rand(0, (3, 4, 8)), rand(1, (3, 8, 5)))),
    "dot": lambda: (jnp.dot, (rand(0, (4, 8)), rand(1, (8, 5)))),
    "einsum": lambda: (functools.partial(jnp.einsum, "bij,bjk->bik"),
                       (rand(0, (3, 4, 8)), rand(1, (3, 8, 5)))),
    "tensordot": lambda: (functools.partial(jnp.tensordot, axes=1),
                          (rand(0, (4, 8)), rand(1, (8, 5)))),
    "conv_general_dilated": lambda: (_conv_nhwc, (rand(0, (2, 8, 8, 3)), rand(1, (3, 3, 3, 4)))),
    "conv_transpose": lambda: (functools.partial(lax.conv_transpose, strides=(2, 2), padding="SAME",
                                                 dimension_numbers=("NHWC", "HWIO", "NHWC")),
                               (rand(0, (2, 8, 8, 3)), rand(1, (3, 3, 3, 4)))),
    "flax_dense": lambda: _flax(_dense, (4, 8)),
    "flax_dense_nobias": lambda: _flax(_dense_nobias, (4, 8)),
    "flax_conv": lambda: _flax(_conv, (2, 8, 8, 3)),
    "flax_conv_nobias": lambda: _flax(_conv_nobias, (2, 8, 8, 3)),
}


@pytest.mark.parametrize("in_dtype, compute", [(F32, BF16), (F32, F16), (F16, BF16)], ids=_id)
@pytest.mark.parametrize("name", LOWER_OPS)
def test_autocast_lower_ops(name, in_dtype, compute):
    op, args = LOWER_OPS[name]()
    args = host_cast(args, in_dtype)
    result = transform(op, dtype=compute)(*args)
    assert result.dtype == compute
    f32_args = host_cast(args, F32)
    chex.assert_trees_all_close(result.astype(F32), op(*f32_args), rtol=5e-2, atol=1e-1)


# Everything else runs in the dtype its input arrives in.
KEEP_OPS = {
    "tanh": jnp.tanh, "relu": jax.nn.relu, "sigmoid": jax.nn.sigmoid, "gelu": jax.nn.gelu,
    "reshape": lambda x: x.reshape(-1), "transpose": jnp.transpose, "abs": jnp.abs,
    "sqrt": jnp.sqrt, "sin": jnp.sin, "max": jnp.max, "sort": jnp.sort,
    "max_pool": lambda x: nn.max_pool(x[None, :, :, None], (2, 2)),
    "clip": lambda x: jnp.clip(x, 0.2, 0.7), "where": lambda x: jnp.where(x > 0.5, x, 0.0),
}


@pytest.mark.parametrize("in_dtype", [BF16, F16, F32], ids=_id)
@pytest.mark.parametrize("name", KEEP_OPS)
def test_autocast_keep_ops(name, in_dtype):
    x = rand(0, (4, 4), in_dtype)
    op = KEEP_OPS[name]
    result = transform(op)(x)
    assert result.dtype == in_dtype
    chex.assert_trees_all_close(result, op(x))  # no cast at all: bitwise the untransformed op


# torch_need_autocast_promote: ops between a lowered matmul output and a float32 operand run in
# float32; against a Python scalar (a weak constant) they stay in the compute dtype.
PROMOTE_OPS = {
    "add": jnp.add, "sub": jnp.subtract, "mul": jnp.multiply, "div": jnp.divide,
    "maximum": jnp.maximum, "minimum": jnp.minimum, "arctan2": jnp.arctan2,
    "remainder": jnp.remainder,
    "where": lambda e, c: jnp.where(c > 0.5, e, c),
    "concatenate": lambda e, c: jnp.concatenate([e, c]),
    "stack": lambda e, c: jnp.stack([e, c]),
    "addcmul": lambda e, c: e + 0.1 * c * c,
    "lerp": lambda e, c: e + 0.3 * (c - e),
    "clamp": lambda e, c: lax.clamp(c - 1.0, e, c + 1.0),
    "index_put": lambda e, c: c.at[jnp.array([0, 2])].set(e[:2]),
    "index_add": lambda e, c: c.at[jnp.array([0, 2])].add(e[:2]),
    "index_mul": lambda e, c: c.at[jnp.array([0, 2])].mul(e[:2]),
    "dynamic_update_slice": lambda e, c: lax.dynamic_update_slice(c, e[:2], (1, 0)),
}


# Exact comparisons with a hand-written eager reference run op by op (jax.disable_jit()): eager
# calls are compiled like jax.jit, where XLA may keep a bfloat16 matmul result in float32 when the
# program converts it to float32 straight away (excess precision), so only the op-by-op program
# rounds exactly where the hand-written reference does.
@pytest.mark.parametrize("name", PROMOTE_OPS)
def test_autocast_promote_ops(name):
    a, b, c = rand(0, (4, 4)), rand(1, (4, 4)), rand(2, (4, 4))
    op = PROMOTE_OPS[name]
    with jax.disable_jit():
        result = transform(lambda a, b, c: op(a @ b, c))(a, b, c)
    assert result.dtype == F32
    e = (a.astype(BF16) @ b.astype(BF16)).astype(F32)
    chex.assert_trees_all_close(result, op(e, c), rtol=1e-5, atol=1e-6)


WEAK_PROMOTE_OPS = ["add", "sub", "mul", "div", "maximum", "minimum", "arctan2", "remainder"]


@pytest.mark.parametrize("name", WEAK_PROMOTE_OPS)
def test_autocast_promote_ops_with_python_scalar(name):
    a, b = rand(0, (4, 4)), rand(1, (4, 4))
    op = PROMOTE_OPS[name]
    assert transform(lambda a, b: op(a @ b, 2.0))(a, b).dtype == BF16


# torch_expect_builtin_promote: comparisons give bool, computed in the widest operand's dtype.
@pytest.mark.parametrize("op", [jnp.less, jnp.greater_equal, jnp.equal, jnp.not_equal])
def test_autocast_builtin_promote_comparisons(op):
    a, b = rand(0, (4, 4)), rand(1, (4, 4))

    def by_hand(a, b):  # the product autocast computes
        return (a.astype(BF16) @ b.astype(BF16)).astype(F32)

    # c holds the bfloat16 product or the float32 one in a checkerboard, so that the comparison's
    # answer tells which product ran (a random c equals neither: equal and not_equal told
    # nothing). The reference is the hand-written program compiled whole, as the transform's is:
    # XLA may keep the bfloat16 product's excess precision inside it.
    c = jnp.where(np.indices((4, 4)).sum(0) % 2 == 0, jax.jit(by_hand)(a, b), a @ b)
    expected = jax.jit(lambda a, b, c: op(by_hand(a, b), c))(a, b, c)
    assert not np.array_equal(expected, jax.jit(lambda a, b, c: op(a @ b, c))(a, b, c))
    result = transform(lambda a, b, c: op(a @ b, c))(a, b, c)
    assert result.dtype == np.dtype(bool)
    np.testing.assert_array_equal(result, expected)


# ports test_autocast_disabled_with_fp32_dtype: a disabled region may name float32.
def test_autocast_disabled_with_fp32_dtype():
    def fn(x):
        with jamp.autocast(dtype=jnp.float32, enabled=False):
            return jnp.ones(10) + x @ x

    assert transform(fn)(rand(0, (10, 10))).dtype == F32


# ports test_cpu_autocast_deprecated_warning: what used to be a misuse (a region outside a
# transform) is now the main use; it warns about nothing and takes effect.
def test_region_outside_a_transform_warns_nothing_and_takes_effect():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with jamp.autocast():
            y = jnp.ones((4, 4)) @ jnp.ones((4, 4))
    assert y.dtype == BF16


# ==============================================================================================
# test_autocast.py :: TestAutocastGPU (cast cache) and TestTorchAutocast (dtypes, errors)
# ==============================================================================================

def _converts_of(jaxpr: Any, var: Any, dtype: Any) -> list[Any]:
    return [e for e in converts_to(jaxpr, dtype) if e.invars[0] is var]


# ports test_cast_cache_is_global: a weight used by three matmuls is converted exactly once, in
# the forward program and in the forward+backward program.
def test_cast_cache_is_global():
    w, x1, x2, x3 = (rand(i, (4, 4)) for i in range(4))

    def f(w, x1, x2, x3):
        return jnp.sum(x1 @ w) + jnp.sum(x2 @ w) + jnp.sum(x3 @ w)

    closed = jax.make_jaxpr(transform(f))(w, x1, x2, x3)
    weight = closed.jaxpr.invars[0]
    assert len(_converts_of(closed.jaxpr, weight, BF16)) == 1
    assert len(converts_to(closed, BF16)) == 4  # w, x1, x2, x3: once each

    grad_closed = jax.make_jaxpr(jax.grad(transform(f)))(w, x1, x2, x3)
    assert len(_converts_of(grad_closed.jaxpr, grad_closed.jaxpr.invars[0], BF16)) == 1


# ports test_cast_cache_is_global across regions: the cache is keyed on (value, dtype), so a weight
# used in a float16 region and outside it is converted once to each dtype.
def test_cast_cache_across_dtypes():
    w, x = rand(0, (4, 4)), rand(1, (4, 4))

    def f(w, x):
        with jamp.autocast(dtype=jnp.float16):
            h1 = x @ w
            h2 = w @ x
        return h1, h2, x @ w, w @ x

    closed = jax.make_jaxpr(transform(f))(w, x)
    weight = closed.jaxpr.invars[0]
    assert len(_converts_of(closed.jaxpr, weight, F16)) == 1
    assert len(_converts_of(closed.jaxpr, weight, BF16)) == 1


# ports test_autocast_fast_dtype: the default compute dtype, and the query inside regions.
def test_autocast_fast_dtype():
    assert jamp.get_autocast_dtype() == BF16
    seen: list[Any] = []

    def fn(x):
        seen.append(jamp.get_autocast_dtype())
        with jamp.autocast(dtype=jnp.float16):
            seen.append(jamp.get_autocast_dtype())
        return x

    transform(fn)(rand(0))
    transform(fn, dtype=jnp.float16)(rand(0))
    assert seen == [BF16, F16, F16, F16]
    assert jamp.Policy().compute_dtype == BF16


# ports test_invalid_device / test_non_string_device: bad arguments get clear errors.
def test_argument_errors():
    with pytest.raises(TypeError, match="callable"):
        transform(42)
    with pytest.raises(TypeError):
        transform("not a function")
    with pytest.raises(ValueError):
        transform(lambda x: x, dtype=jnp.int32)
    with pytest.raises(ValueError):
        jamp.Policy(jnp.int8)
    with pytest.raises(ValueError):
        jamp.Policy().replace(compute_dtype=jnp.bool_)
    with pytest.raises(ValueError):
        jamp.autocast(dtype=jnp.int32)
    with pytest.raises(TypeError, match="no_such_field"):
        jamp.Policy().replace(no_such_field=1)
    with pytest.raises(TypeError):
        jamp.autocast(enabled="yes")


# ==============================================================================================
# Jit and eager agree (torch's _test_autocast compares scripted and eager outputs)
# ==============================================================================================

def _minimal(a, b, c, d):
    x = a @ b
    return x, jnp.sum(x)


def _promote(a, b, c, d):
    e = a @ b
    return e, e + 0.1 * c * d


def _regions(a, b, c, d):
    with jamp.autocast(enabled=False):
        e = a @ b
        with jamp.autocast(dtype=jnp.float16):
            f = e @ c
    return e, f, jax.nn.softmax(f @ d, axis=0)


def _callee(a, b, c, d):
    helper = jax.jit(lambda x, y: jnp.tanh(x @ y))
    return helper(a, b), jnp.log(helper(c, d) + 1.0)


class JitAndEagerAgree(chex.TestCase):
    """The same transformed function, with and without jit: same values, same dtypes."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_values_and_dtypes(self):
        args = tuple(rand(i, (4, 4)) for i in range(4))
        expected_dtypes = {
            _minimal: (BF16, F32), _promote: (BF16, F32), _regions: (F32, F16, F32),
            _callee: (BF16, F32),
        }
        for fn, expected in expected_dtypes.items():
            eager = transform(fn)(*args)
            out = self.variant(transform(fn))(*args)
            self.assertEqual(dtypes(out), expected, fn.__name__)
            chex.assert_trees_all_close(out, eager, rtol=1e-2, atol=1e-2)

    @chex.variants(with_jit=True, without_jit=True)
    def test_grads(self):
        args = tuple(rand(i, (4, 4)) for i in range(4))

        def loss(a, b, c, d):
            e, f = _promote(a, b, c, d)
            return jnp.sum(f) + jnp.sum(e)

        grads = self.variant(jax.grad(transform(loss), argnums=(0, 1, 2, 3)))(*args)
        eager = jax.grad(transform(loss), argnums=(0, 1, 2, 3))(*args)
        self.assertEqual(dtypes(grads), (F32,) * 4)
        chex.assert_trees_all_close(grads, eager, rtol=1e-2, atol=1e-2)
