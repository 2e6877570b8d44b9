"""A user's ``jax.jit`` called eagerly in a region keeps what the jit sets beyond its program:
donated operands, output shardings and memory kinds (docs/reference/dtypes.md, "Higher-order
primitives": "the jit (shardings, donation, name) is kept"), as calling it outside the region
does. On jax 0.12 every jit reaches the region as an inline one (its ``inline`` is truthy), whose
eager run of the rewritten jaxpr once dropped them all."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding

import jamp
from tests.check_modules import ROOT

BF16 = np.dtype(jnp.bfloat16)
# Test data made on the host: jax.device_put hands it over as a new device array without
# compiling (jnp.asarray of a numpy array, or a jax.random call, compiles a program per shape).
_RNG = np.random.default_rng(0)
X = jax.device_put(_RNG.standard_normal((4, 8), dtype=np.float32))
_STRONG = _RNG.standard_normal((8, 8), dtype=np.float32) * np.float32(0.25)


def _update(w, x):
    return w - 0.1 * jnp.sum(jnp.tanh(x @ w))


def _params():
    return {
        # the weight a training step updates in place
        "strong": lambda: jax.device_put(_STRONG),
        # jnp.full of a Python float is weak-typed: a constant to the rules (cast from its
        # value), which a call once walked op by op when it had over 16 elements
        "weak": lambda: jnp.full((8, 8), 0.1),
    }


@pytest.mark.parametrize("kind", ["strong", "weak"])
@pytest.mark.parametrize(
    "donate", [{"donate_argnums": 0}, {"donate_argnames": "w"}], ids=["argnums", "argnames"]
)
def test_donated_operand_is_donated_in_a_region(kind, donate):
    make = _params()[kind]
    step = jax.jit(_update, **donate)
    kept = jax.jit(_update)
    for _ in range(2):  # (the second call runs the kept rewrite)
        w, same = make(), make()
        with jamp.autocast():
            expected = kept(same, X)
            out = step(w, X)
        assert w.is_deleted(), "the donated weight is still alive, as if not donated"
        assert not same.is_deleted()
        # what the jit without donation computes, decided by the same rules (the weak weight's
        # call runs op by op there: XLA rounds the bfloat16 matmul's output between ops only)
        assert out.dtype == expected.dtype == np.dtype(jnp.float32)
        np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=1e-2)


def test_donated_constant_made_in_the_region():
    """``jnp.ones`` in the region: a constant with shape ops to the rules, donated all the same."""
    step = jax.jit(_update, donate_argnums=0)
    ones = jax.device_put(np.ones((8, 8), np.float32))
    expected = jax.jit(jamp.autocast_transform(_update))(ones, X)  # (the same both times round)
    for _ in range(2):
        with jamp.autocast():
            w = jnp.ones((8, 8))
            out = step(w, X)
        assert w.is_deleted()
        np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=1e-2)


def test_donation_as_plain_jax():
    """The region's run donates where plain JAX's does (the reference for the test above)."""
    w = _params()["strong"]()
    jax.jit(_update, donate_argnums=0)(w, X)
    assert w.is_deleted()


def test_output_memory_kind_kept_in_a_region():
    host = SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    to_host = jax.jit(lambda x, w: jnp.tanh(x @ w), out_shardings=host)
    w = jax.device_put(_STRONG)
    plain = to_host(X, w)
    with jamp.autocast():
        out = to_host(X, w)
        again = to_host(X, w)
    assert plain.sharding.memory_kind == "pinned_host"
    for result in (out, again):
        assert result.sharding.memory_kind == "pinned_host", result.sharding
        assert result.dtype == BF16  # (the region decided the matmul)


def test_jnp_functions_still_run_in_the_region():
    """A jnp function's jit sets nothing beyond its program: it runs as before, nothing of its
    operands donated."""
    x = jax.device_put(np.asarray(X).astype(BF16))
    with jamp.autocast():
        out = jnp.linalg.norm(x)
    assert not x.is_deleted()
    assert out.dtype == np.dtype(jnp.float32)


_SHARDED = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import jamp

    assert len(jax.devices()) == 2, jax.devices()
    mesh = jax.make_mesh((2,), ("x",))
    rows = NamedSharding(mesh, P("x"))
    x, w = jnp.ones((4, 8)), jnp.ones((8, 8))
    sharded = jax.jit(lambda x, w: jnp.tanh(x @ w), out_shardings=rows)
    plain = sharded(x, w)
    with jamp.autocast():
        out = sharded(x, w)
        again = sharded(x, w)
    for result in (out, again):
        assert isinstance(result.sharding, NamedSharding), result.sharding
        assert result.sharding.spec == P("x"), result.sharding
        assert result.sharding.is_equivalent_to(plain.sharding, 2)
        assert result.dtype == jnp.bfloat16, result.dtype
        np.testing.assert_allclose(np.asarray(result, np.float32), np.asarray(plain), atol=1e-2)
    print("sharded outputs kept")
    """
)


def test_output_sharding_kept_in_a_region_on_two_devices():
    """On two host devices (in a subprocess: the count is fixed when JAX starts)."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags}
    result = subprocess.run([sys.executable, "-c", _SHARDED], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "sharded outputs kept" in result.stdout


_ONES = jax.device_put(np.ones((4, 4), np.float32))
_DONATING = jax.jit(lambda w, x: w - 0.1 * jnp.tanh(x @ w), donate_argnums=0)


def _reads_a_view_after_donating(w):
    view = w.reshape(16).reshape(4, 4)
    _DONATING(w, _ONES)
    return _ONES @ view, (view * 2.0)[0, 0]


def test_a_view_of_a_donated_weak_constant_is_still_readable():
    """A region knows a weak-typed array's views by the array (to cast it saturating); after a
    jit donated that array, they were recomputed from its deleted buffer."""
    expected = _reads_a_view_after_donating(jnp.full((4, 4), 0.1))
    weak = jnp.full((4, 4), 0.1)
    with jamp.autocast():
        out = _reads_a_view_after_donating(weak)
    for got, want in zip(out, expected):
        np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=1e-2)
