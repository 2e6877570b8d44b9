"""What a policy has no dtype for passes through jamp as JAX computes it.

Property: a program over integers, booleans or typed PRNG keys (``jax.random.key``), drawn as a
chain of the operations users write on them (indexing and ``.at`` updates, sorts, scans, conds,
reductions, key splits), returns exactly what plain JAX returns, values and dtypes, from
``autocast_transform`` and from a region, eager and jitted, under any policy. No rule may cast,
rebuild or refuse such an operation (the transform's scatter rule asked numpy for a key array's
dtype and raised; JAX's random_test under an identity policy found it).
"""
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

import jamp
from tests.hypothesis_profiles import examples

POLICIES = [jamp.Policy(), jamp.Policy(jnp.float16), jamp.Policy(jnp.float32)]
N = 6
PICK = np.array([5, 0, 0, 3, 2, 1])
TWICE = np.array([1, 1])

# Each step maps a length-N array to a length-N array of an integer dtype (which may change).
INTEGER_STEPS = {
    "add reversed": lambda x: x + x[::-1],
    "scale": lambda x: x * 3 - 1,
    "floor divide": lambda x: x // 2,
    "remainder": lambda x: x % 3,
    "shift": lambda x: x >> 1,
    "clip": lambda x: jnp.clip(x, -5, 5),
    "at set": lambda x: x.at[TWICE].set(x[:2]),
    "at add, repeated index": lambda x: x.at[TWICE].add(x[:2]),
    "at max": lambda x: x.at[PICK].max(x[::-1]),
    "at min, mask": lambda x: x.at[np.arange(N) % 2 == 0].min(x[0]),
    "gather": lambda x: x[PICK],
    "dynamic index": lambda x: x[x[0] % N] + x,
    "dynamic update slice": lambda x: lax.dynamic_update_slice(x, x[:2], (jnp.int32(3),)),
    "cumsum": lambda x: jnp.cumsum(x),
    "sort": lambda x: jnp.sort(x),
    "argsort": lambda x: jnp.argsort(x),
    "where": lambda x: jnp.where(x > 0, x, -x),
    "max minus": lambda x: x - jnp.max(x),
    "sum broadcast": lambda x: x + jnp.sum(x),
    "roll": lambda x: jnp.roll(x, 2),
    "cond": lambda x: lax.cond(x[0] > 0, lambda v: v + 1, lambda v: v * 2, x),
    "scan": lambda x: lax.scan(lambda c, v: (c + v, c * v), x[0], x)[1],
    "fori loop": lambda x: lax.fori_loop(0, 3, lambda i, v: v * 2 - i, x),
    "segment sum": lambda x: jax.ops.segment_sum(x, PICK % 3, num_segments=N),
    "bitwise": lambda x: (x & 7) | (x ^ 3),
    "compare count": lambda x: jnp.cumsum(x > x[::-1]),
}

BOOLEAN_STEPS = {
    "not": lambda b: ~b,
    "and reversed": lambda b: b & b[::-1],
    "xor rolled": lambda b: b ^ jnp.roll(b, 1),
    "at set": lambda b: b.at[TWICE].set(True),
    "gather": lambda b: b[PICK],
    "where": lambda b: jnp.where(b, b[::-1], ~b),
    "any broadcast": lambda b: b | jnp.any(b),
    "cond": lambda b: lax.cond(b[0], lambda v: ~v, lambda v: v, b),
}

KEY_STEPS = {
    "split each": lambda k: jax.vmap(lambda key: jax.random.split(key)[0])(k),
    "fold in": lambda k: jax.vmap(jax.random.fold_in)(k, jnp.arange(N)),
    "at set": lambda k: k.at[TWICE].set(k[0]),
    "at set, mask": lambda k: k.at[np.arange(N) % 2 == 1].set(k[-1]),
    "gather": lambda k: k[PICK],
    "reverse": lambda k: k[::-1],
    "where": lambda k: jnp.where(np.arange(N) < 3, k, k[::-1]),
    "concatenate": lambda k: jnp.concatenate([k[1:], k[:1]]),
    "dynamic update slice": lambda k: lax.dynamic_update_slice(k, k[:2], (jnp.int32(2),)),
    "cond": lambda k: lax.cond(True, lambda v: v[::-1], lambda v: v, k),
    "scan": lambda k: lax.scan(lambda c, v: (v, c), k[0], k)[1],
}

FAMILIES = {
    "int32": (INTEGER_STEPS, lambda rng: rng.integers(-50, 50, N).astype(np.int32)),
    "int8": (INTEGER_STEPS, lambda rng: rng.integers(-20, 20, N).astype(np.int8)),
    "uint32": (INTEGER_STEPS, lambda rng: rng.integers(0, 50, N).astype(np.uint32)),
    "bool": (BOOLEAN_STEPS, lambda rng: rng.integers(0, 2, N).astype(bool)),
    "key": (KEY_STEPS, None),
}


def _comparable(x):
    """Typed keys as their key data (keys have no equality with numpy)."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        return np.asarray(jax.random.key_data(x)), str(x.dtype)
    return np.asarray(x), str(x.dtype)


@st.composite
def programs(draw):
    family = draw(st.sampled_from(sorted(FAMILIES)))
    steps, make = FAMILIES[family]
    names = draw(st.lists(st.sampled_from(sorted(steps)), min_size=1, max_size=5))
    seed = draw(st.integers(0, 2**16))
    if make is None:
        value = jax.random.split(jax.random.key(seed), N)
    else:
        value = jax.device_put(make(np.random.default_rng(seed)))

    def program(x):
        for name in names:
            x = steps[name](x)
        return x

    return family, names, program, value


@settings(max_examples=examples(15), deadline=None)
@given(drawn=programs(), policy=st.sampled_from(range(len(POLICIES))))
def test_a_program_over_integers_booleans_or_keys_runs_as_jax_runs_it(drawn, policy):
    family, names, program, value = drawn
    policy = POLICIES[policy]

    def in_region(x):
        with jamp.autocast(policy):
            return program(x)

    want = _comparable(jax.jit(program)(value))
    transformed = jamp.autocast_transform(program, policy)
    for form in (transformed, jax.jit(transformed), in_region, jax.jit(in_region)):
        got = _comparable(form(value))
        assert got[1] == want[1], (family, names, form)
        np.testing.assert_array_equal(got[0], want[0], err_msg=f"{family} {names} {form}")
