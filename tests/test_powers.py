"""square / integer_pow / x * x: float32 where summed, else the arriving dtype (issue 11 item 2)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jamp
from tests.jaxpr_utils import eqns_named, operand_dtypes

BF16, F16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32)
POLICIES = [jamp.Policy(jnp.bfloat16), jamp.Policy(jnp.float16)]
IDS = ["bfloat16", "float16"]


def one_pass_batch_norm(x, w, square):
    """Haiku's training-mode BatchNorm statistics, hand-written: var = E[x^2] - E[x]^2."""
    h = x @ w
    mean = jnp.mean(h, axis=0)
    mean_of_squares = jnp.mean(square(h), axis=0)
    var = mean_of_squares - jnp.square(mean)
    return (h - mean) * lax.rsqrt(var + 1e-5)


SQUARES = {"square": jnp.square, "power": lambda h: h ** 2, "mul": lambda h: h * h}
# Activations with a large mean and unit spread: their squares need float32. (Drawn on the host
# and transferred: jax.random and eager jnp ops would each compile a program.)
_RNG = np.random.default_rng(0)
HOST_X = np.float32(300.0) + _RNG.standard_normal((64, 16), dtype=np.float32)
HOST_W = np.eye(16, dtype=np.float32) + np.float32(0.01) * _RNG.standard_normal((16, 16),
                                                                              dtype=np.float32)
X, W = jax.device_put(HOST_X), jax.device_put(HOST_W)


@pytest.mark.parametrize("square", sorted(SQUARES))
@pytest.mark.parametrize("policy", POLICIES, ids=IDS)
def test_one_pass_variance_is_finite(policy, square):
    fn = lambda x, w: one_pass_batch_norm(x, w, SQUARES[square])
    out = jamp.autocast_transform(fn, policy)(X, W)
    assert bool(jnp.all(jnp.isfinite(out)))
    assert bool(jnp.all(jnp.isfinite(jax.jit(jamp.autocast_transform(fn, policy))(X, W))))
    closed = jax.make_jaxpr(jamp.autocast_transform(fn, policy))(X, W)
    squares = [e for e in eqns_named(closed, "square") + eqns_named(closed, "integer_pow")
               + eqns_named(closed, "mul") if e.invars[0] is e.invars[-1]]
    assert squares and all(e.outvars[0].aval.dtype == F32 for e in squares)


def test_one_pass_variance_with_squares_taken_out_of_the_fp32_table_is_nan():
    """What the table entry buys: the same program with bfloat16 squares."""
    policy = jamp.Policy(jnp.bfloat16)
    policy = policy.replace(fp32=policy.fp32 - {"square"})
    fn = lambda x, w: one_pass_batch_norm(x, w, jnp.square)
    with jax.disable_jit():  # eager calls compile; XLA on the CPU may keep bf16 values in f32
        assert not bool(jnp.all(jnp.isfinite(jamp.autocast_transform(fn, policy)(X, W))))


@pytest.mark.parametrize("approximate", [True, False])
@pytest.mark.parametrize("policy", POLICIES, ids=IDS)
def test_gelu_of_a_matmul_stays_in_the_compute_dtype(policy, approximate):
    fn = jamp.autocast_transform(lambda x, w: jax.nn.gelu(x @ w, approximate=approximate), policy)
    x, w = jax.device_put(HOST_X / np.float32(300.0)), W
    assert fn(x, w).dtype == policy.compute_dtype
    if approximate:
        assert operand_dtypes(jax.make_jaxpr(fn)(x, w), "integer_pow") == \
            [(policy.compute_dtype.name,)]
    reference = jax.jit(lambda x, w: jax.nn.gelu(x @ w, approximate=approximate))(x, w)
    np.testing.assert_allclose(np.asarray(fn(x, w), np.float32), reference, rtol=5e-2, atol=5e-2)


def test_squares_that_are_not_summed_run_in_the_arriving_dtype():
    f = jamp.autocast_transform(lambda x, w: (jnp.square(x @ w), (x @ w) ** 3, (x @ w) * x))
    assert [o.dtype for o in f(X, W)] == [BF16, BF16, F32]  # the last mixes in float32 x


def test_squares_summed_inside_loop_bodies_and_callees():
    def f(x, w):
        def body(c, row):
            return c + jnp.sum(jnp.square(row)), None
        total, _ = lax.scan(body, jnp.zeros((), x.dtype), x @ w)
        return total, jax.jit(lambda h: jnp.mean(h ** 2))(x @ w)
    closed = jax.make_jaxpr(jamp.autocast_transform(f))(X, W)
    squares = eqns_named(closed, "square") + eqns_named(closed, "integer_pow")
    assert len(squares) == 2 and all(e.outvars[0].aval.dtype == F32 for e in squares)
    total, mean = jamp.autocast_transform(f)(X, W)
    np.testing.assert_allclose(mean, np.mean((HOST_X @ HOST_W) ** 2), rtol=1e-2)


def test_squares_follow_the_region():
    def f(x, w):
        with jamp.autocast(enabled=False):
            h = (x @ w).astype(jnp.bfloat16)
            return jnp.sum(jnp.square(h))
    closed = jax.make_jaxpr(jamp.autocast_transform(f))(X, W)
    assert operand_dtypes(closed, "square") == [("bfloat16",)]


@pytest.mark.parametrize("check_vma", [True, False])
def test_squares_summed_across_devices_in_a_shard_map(check_vma):
    # With check_vma (shard_map's default) JAX binds lax.psum of a value varying over the axis
    # as `psum_invariant`: such squares stayed bfloat16, in both forms.
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    spec = jax.sharding.PartitionSpec

    def body(x, w):
        h = x @ w
        return lax.psum(h * h, "data"), lax.psum(h ** 2, "data")

    summed = jax.shard_map(body, mesh=mesh, in_specs=(spec("data"), spec()),
                           out_specs=spec(), check_vma=check_vma)

    def region(x, w):
        with jamp.autocast():
            return summed(x, w)

    for outputs in (jamp.autocast_transform(summed)(X, W), jax.jit(region)(X, W)):
        assert [o.dtype for o in outputs] == [F32, F32]


def test_a_square_passed_to_a_custom_derivative_function_in_a_region():
    # jnp.logaddexp(v ** 2, 0.0) in a jitted region: the region handed logaddexp's custom_jvp the
    # square recomputed in float32 beside the 0.0 it was traced with in bfloat16, and its body's
    # lax.max failed ("an operand is bfloat16 because the region computed it", which it was not);
    # on jax 0.12 jax.nn.softplus of a square failed the same way, under jax.grad in its JVP rule.
    v = jax.device_put(np.linspace(-1, 1, 8, dtype=np.float32).astype(BF16))

    def f(v):
        with jamp.autocast():
            return jnp.logaddexp(v ** 2, 0.0), jax.nn.softplus(lax.integer_pow(v, 2))

    expected = [jax.jit(lambda v: jnp.logaddexp(v.astype(F32) ** 2, 0.0))(v)] * 2
    for form in (f, jax.jit(f), jax.vmap(f)):
        for out, want in zip(form(v), expected):
            np.testing.assert_allclose(out.astype(F32), want, rtol=1e-2)
    grad = jax.grad(lambda v: sum(o.astype(F32).sum() for o in f(v)))(v)
    assert grad.dtype == BF16 and bool(jnp.isfinite(grad.astype(F32)).all())
