"""jamp.stochastic_round: exact on representable values, unbiased, deterministic per key, astype's
edge values, straight-through derivative, jit/vmap, a mesh of explicit axes; errors in the
caller's terms. (Arrays sharded over 8 devices, and shard_map: tests/optim_sharding_checks.py,
run by test_optim.py.)"""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jamp
from jamp.rounding import FORMATS

DTYPES = list(FORMATS)
IDS = [d.name for d in DTYPES]
round_jit = jax.jit(jamp.stochastic_round, static_argnums=1)


# Test data is built on the host and put with jax.device_put, which compiles nothing: eager jnp
# operations, and jnp.asarray of a numpy array, compile a program per shape and dtype.
def as_f32(x):
    # on the host too (ml_dtypes widens every format exactly)
    return np.asarray(x).astype(np.float32)


def representable(dtype):
    info = ml_dtypes.finfo(dtype)
    values = [0.0, -0.0, float(info.smallest_subnormal), float(info.tiny), 1.0, -1.5, 3.0,
              float(info.max), -float(info.max), float(info.tiny) * 3, np.inf, -np.inf, np.nan]
    # the format's own values, cast back: exact in float32 (and -0.0 / inf where it has none
    # become what astype makes of them, which stochastic_round must match too)
    return np.asarray(values, np.float32).astype(dtype).astype(np.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_representable_values_come_back_unchanged_whatever_the_bits(dtype):
    values = np.tile(representable(dtype), 64)
    x = jax.device_put(values)
    # astype's answer, on the host: ml_dtypes rounds these values as XLA does, bit for bit
    expected = values.astype(dtype).astype(np.float32)
    for seed in range(4):
        got = round_jit(x, dtype, jax.random.key(seed))
        assert got.dtype == dtype
        np.testing.assert_array_equal(as_f32(got), expected)


# Binomial test of unbiasedness. Each checked value sits between two neighbours `down < up`;
# the number k of n draws that went up must be within Z standard deviations of n*p, with
# p = (x - down) / (up - down). With Z = 5 a correct implementation fails one check with
# probability about 5.7e-7 (normal approximation); over the 9 formats x 5 values here, the
# false-alarm rate of the whole test is below 3e-5. (The keys are fixed, so a run is
# reproducible; the rate says how unlikely a correct implementation is to trip it.)
Z = 5.0
N = 40_000


def between(dtype):
    """Values strictly between two neighbours of ``dtype``: in the normal range, in the
    subnormal range, below the smallest subnormal (exact region |x| >= s * 2**-9), negative."""
    info = ml_dtypes.finfo(dtype)
    step = 2.0 ** -int(info.nmant)
    s = float(info.smallest_subnormal)
    return np.asarray([1 + 0.3 * step, -(2 + 1.7 * step), 2.37 * s, 0.41 * s, -0.013 * s],
                      np.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_unbiased_binomial_test(dtype):
    x = between(dtype)
    draws = as_f32(round_jit(jax.device_put(np.broadcast_to(x[:, None], (len(x), N))), dtype,
                             jax.random.key(7))).astype(np.float64)
    for value, row in zip(x.astype(np.float64), draws):
        outcomes = np.unique(row)
        assert len(outcomes) == 2, (dtype, value, outcomes)  # its two neighbours, both drawn
        down, up = (outcomes if value > 0 else outcomes[::-1])
        assert min(down, up) < value < max(down, up)
        p = (value - down) / (up - down)
        k = np.count_nonzero(row == up)
        assert abs(k - N * p) <= Z * np.sqrt(N * p * (1 - p)), (dtype, value, k, N * p)


def test_deterministic_per_key_and_different_across_keys():
    x = jax.device_put(np.linspace(1.0, 2.0, 4096, dtype=np.float32) + np.float32(2.0**-12))
    a = round_jit(x, jnp.bfloat16, jax.random.key(3))
    b = jamp.stochastic_round(x, jnp.bfloat16, jax.random.key(3))  # eager = jit
    c = round_jit(x, jnp.bfloat16, jax.random.key(4))
    raw = round_jit(x, jnp.bfloat16, jax.random.PRNGKey(3))  # a raw uint32 key works too
    np.testing.assert_array_equal(as_f32(a), as_f32(b))
    assert np.any(as_f32(a) != as_f32(c))
    assert raw.dtype == jnp.bfloat16


def test_overflow_nan_and_inf_follow_astype():
    key = jax.random.key(0)
    f16 = jamp.stochastic_round(jax.device_put(np.asarray([7e4, -1e6, np.nan, np.inf], np.float32)),
                               jnp.float16, key)
    f16 = as_f32(f16)
    assert np.isposinf(f16[0]) and np.isneginf(f16[1]) and np.isnan(f16[2]) and np.isposinf(f16[3])
    # float8_e4m3fn has no inf: astype makes an overflow NaN, and so does stochastic_round
    e4 = jamp.stochastic_round(jax.device_put(np.asarray([1000.0, -460.0 * 3], np.float32)),
                              jnp.float8_e4m3fn, key)
    assert np.all(np.isnan(as_f32(e4)))
    # between float16's max (65504) and the next power of two: max or inf, unbiased either way
    near = as_f32(round_jit(jnp.full((4000,), 65504.0 + 8.0), jnp.float16, key))
    assert set(np.unique(near)) == {65504.0, np.inf}
    # a NaN whose payload is in the low bits stays NaN (the added bits must not carry it away)
    payload = jax.device_put(np.asarray([0x7F800001, 0x7FFFFFFF], np.uint32).view(np.float32))
    assert np.all(np.isnan(as_f32(jamp.stochastic_round(payload, jnp.bfloat16, key))))


def test_straight_through_gradient_jit_and_vmap():
    x = jax.device_put(np.linspace(-3.0, 3.0, 64, dtype=np.float32) + np.float32(2.0**-11))
    key = jax.random.key(1)
    grad = jax.jit(jax.grad(lambda v: jnp.sum(
        jamp.stochastic_round(v, jnp.bfloat16, key).astype(jnp.float32) * 3.0)))(x)
    np.testing.assert_array_equal(grad, np.full(64, 3.0, np.float32))
    _, tangent = jax.jvp(lambda v: jamp.stochastic_round(v, jnp.float16, key), (x,),
                         (jax.device_put(np.ones(64, np.float32)),))
    assert tangent.dtype == jnp.float16
    # vmap with a batch of keys: each example as if rounded alone
    keys = jax.random.split(key, 4)
    host_rows = np.asarray(x).reshape(4, 16)
    batched = jax.vmap(lambda r, k: jamp.stochastic_round(r, jnp.bfloat16, k))(
        jax.device_put(host_rows), keys)
    for i in range(4):
        np.testing.assert_array_equal(as_f32(batched)[i], as_f32(jamp.stochastic_round(
            jax.device_put(host_rows[i]), jnp.bfloat16, keys[i])))


def test_16_bit_inputs_and_float32_target():
    key = jax.random.key(0)
    x = jax.device_put(np.asarray([1.0, 1.0 + 2.0**-9, 3.0], np.float16))
    y = jamp.stochastic_round(x, jnp.bfloat16, key)
    assert y.dtype == jnp.bfloat16
    assert as_f32(y)[0] == 1.0 and as_f32(y)[2] == 3.0
    assert as_f32(y)[1] in (1.0, 1.0078125)
    same = jamp.stochastic_round(x, jnp.float32, key)
    np.testing.assert_array_equal(same, as_f32(x))


ONES_3 = jax.device_put(np.ones(3, np.float32))


@pytest.mark.parametrize("dtype, error, words", [
    (jnp.int8, ValueError, "int8 is not a floating dtype"),
    (jnp.float64, ValueError, "float64 is wider than float32"),
    ("nonsense", TypeError, "must be a dtype"),
    (None, TypeError, "got None"),  # was "float64 is wider than float32" (np.dtype(None))
])
def test_bad_dtype_is_named(dtype, error, words):
    with pytest.raises(error, match=words):
        jamp.stochastic_round(ONES_3, dtype, jax.random.key(0))


def test_bad_x_and_key_are_named():
    with pytest.raises(TypeError, match=r"x=\.\.\.\) must be a floating array, got int32"):
        jamp.stochastic_round(jax.device_put(np.arange(3, dtype=np.int32)), jnp.bfloat16,
                              jax.random.key(0))
    with pytest.raises(TypeError, match="key=...\\) must be one PRNG key"):
        jamp.stochastic_round(ONES_3, jnp.bfloat16, 0)
    with pytest.raises(TypeError, match="batch of keys"):
        jamp.stochastic_round(ONES_3, jnp.bfloat16, jax.random.split(jax.random.key(0), 3))


def test_raw_keys_of_the_configured_prng_impl_are_accepted():
    """Under jax_default_prng_impl="rbg", jax.random.PRNGKey(0) is uint32[4]: it was rejected
    by a message that asked for jax.random.PRNGKey(0)."""
    x = jnp.full((64,), 1.0 + 2.0**-10)
    with jax.default_prng_impl("rbg"):
        key = jax.random.PRNGKey(0)
        assert key.shape == (4,)
        y = jamp.stochastic_round(x, jnp.bfloat16, key)
        assert set(np.asarray(y, np.float32).tolist()) <= {1.0, 1.0078125}
        with pytest.raises(TypeError, match=r"uint32\[4\] under jax_default_prng_impl='rbg'"
                                            r"\), got uint32\[2\]"):
            jamp.stochastic_round(x, jnp.bfloat16, jax.device_put(np.zeros(2, np.uint32)))
    with pytest.raises(TypeError, match=r"uint32\[2\] under .*got uint32\[4\]"):
        jamp.stochastic_round(x, jnp.bfloat16, jax.device_put(np.zeros(4, np.uint32)))


def test_salts_give_arrays_hashed_alike_their_own_bits():
    """stochastic_round_many with one key: array i of two calls drew the same bits unless
    salted (jamp.optim salts with each leaf's pytree path)."""
    from jamp.rounding import stochastic_round_many
    x = jnp.full((4096,), 1.0 + 2.0**-8)  # half a bfloat16 step up: up with probability 1/2
    key = jax.random.key(0)

    def up(salts):
        (y,) = stochastic_round_many([x], [jnp.bfloat16], key, salts)
        return np.asarray(y, np.float32) > 1

    assert np.array_equal(up(None), up(None))
    a, b = up([(1, 2)]), up([(3, 4)])
    assert abs(a.mean() - 0.5) < 0.05 and abs(b.mean() - 0.5) < 0.05  # still unbiased
    assert abs(np.mean(a == b) - 0.5) < 0.05  # unrelated, not identical


def test_hashed_bits_are_uniform_and_unrelated_to_their_neighbours():
    """The one-round keyed hash behind the bits: each 16-bit half (bfloat16 uses the low one)
    is uniform (chi-square over 64 bins) and uncorrelated with the next element's and the next
    row's (z-test on the correlation, |z| <= 5). Each of the 2 keys x 2 halves x 3 checks false
    alarms with probability at most 1e-6, so the whole test with probability below 1.2e-5."""
    from scipy import stats

    from jamp.rounding import hashed_bits

    n = 1 << 18
    for seed in (0, 1):
        words = jax.random.bits(jax.random.key(seed), (2,), jnp.uint32)
        bits = np.asarray(hashed_bits(words, (n // 512, 512))).ravel()
        for half in (bits & 0xFFFF, bits >> 16):
            counts = np.bincount(half >> 10, minlength=64)
            chi2 = float(np.sum((counts - n / 64) ** 2 / (n / 64)))
            assert stats.chi2.sf(chi2, 63) > 1e-6, (seed, chi2)
            u = half.astype(np.float64)
            for lag in (1, 512):
                z = np.corrcoef(u[:-lag], u[lag:])[0, 1] * np.sqrt(n - lag)
                assert abs(z) <= 5, (seed, lag, z)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_explicit_mesh_with_the_key_on_the_mesh(dtype):
    """On a mesh of explicit axes (jax.make_mesh's default), a key placed on the mesh (as a
    jitted step's own output is) raised ShardingTypeError for float16 and float8: a select
    mixed bits made replicated with the value's shards. One device's mesh shows it; the bits
    are the same as off the mesh (8 devices: tests/optim_sharding_checks.py)."""
    mesh = jax.make_mesh((1,), ("data",))
    x = jax.device_put(between(dtype)[:, None] * np.linspace(1.0, 3.0, 16, dtype=np.float32))
    key = jax.random.key(2)
    on_mesh = jax.device_put(x, NamedSharding(mesh, P("data")))
    key_on_mesh = jax.device_put(key, NamedSharding(mesh, P()))
    got = round_jit(on_mesh, dtype, key_on_mesh)
    np.testing.assert_array_equal(as_f32(got), as_f32(round_jit(x, dtype, key)))
    assert got.sharding.spec == P("data", None)
