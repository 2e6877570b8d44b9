"""find_nonfinite names the matmul whose outputs overflowed later, fixes it there, and says in
words what each remedy changes (issue 32, item 3)."""
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import jamp

F16 = jamp.Policy(jnp.float16)


def model(params, x):
    h = jax.nn.relu(x @ params["w1"])
    return h @ params["w2"]  # lm-head


def loss_fn(params, x):
    return jnp.mean(model(params, x) * 2.0)  # doubled


def head_line() -> int:
    with open(__file__) as f:
        return next(n for n, text in enumerate(f, 1) if text.rstrip().endswith("# lm-head"))


@jax.jit
def _draw():
    # one program (drawn eagerly, each of its operations compiled a program of its own)
    keys = jax.random.split(jax.random.key(0), 3)
    return [jax.random.normal(k, shape) for k, shape in zip(keys, ((8, 16), (16, 4), (32, 8)))]


_W1, _W2, X = _draw()
# Scaled on the host, the float32 products an eager multiply gives (in the program XLA rounded
# some differently), and put with jax.device_put, which compiles nothing (jnp.asarray of a numpy
# array compiles a program per shape and dtype, as eager jnp operations do).
PARAMS = {"w1": jax.device_put(np.asarray(_W1) * np.float32(0.5)),
          # the head's outputs reach ~0.7 of float16's maximum: finite, but doubled they are not
          "w2": jax.device_put(np.asarray(_W2) * np.float32(2000.0))}


def test_the_matmul_that_made_the_operands_is_named_with_its_range():
    found = jamp.find_nonfinite(loss_fn, PARAMS, X, policy=F16)
    assert found.primitive == "mul"
    producer = found.produced_by
    assert (producer.primitive, producer.dtype) == ("dot_general", "float16")
    assert f"{os.path.basename(__file__)}:{head_line()}" in producer.source
    assert 0.5 < producer.share_of_max < 1.0
    assert producer.output.inf == 0
    text = str(found)
    assert "its operands came from `dot_general` -> float16" in text
    assert f"{producer.share_of_max:.2f} of float16's maximum" in text


def test_a_remedy_at_the_producer_is_verified():
    found = jamp.find_nonfinite(loss_fn, PARAMS, X, policy=F16)
    fix = found.producer_remedy
    assert fix.kind == "line rule"
    assert fix.policy.rules[-1] == (f"@{os.path.basename(__file__)}:{head_line()}",
                                    np.dtype(jnp.float32))
    assert np.isfinite(jamp.autocast_transform(loss_fn, fix.policy)(PARAMS, X))
    # only the head's line runs in float32: the first layer stays float16
    report = jamp.explain(loss_fn, PARAMS, X, policy=fix.policy)
    assert report.ops["dot_general"] == {"float16": 1, "float32": 1}
    assert "remedy at that producer (verified): line rule" in str(found)


def test_every_remedy_says_what_it_changes_and_why():
    found = jamp.find_nonfinite(loss_fn, PARAMS, X, policy=F16, grad=True)
    assert found.tried
    for remedy, _ in found.tried:
        assert len(remedy.why) > 40, remedy
        assert f"({remedy.why})" in str(remedy)
    text = str(found)
    for remedy in (found.remedy, found.producer_remedy):
        if remedy is not None:
            assert remedy.why in text


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(16)(x))
        return nn.Dense(4, name="head")(x) * 2.0


def test_a_flax_producer_is_fixed_by_its_module_path():
    model = MLP()
    params = model.init(jax.random.PRNGKey(0), X)
    params = jax.tree_util.tree_map_with_path(  # (scaled on the host, as PARAMS)
        lambda path, p: jax.device_put(np.asarray(p) * np.float32(2e4))
        if "head" in jax.tree_util.keystr(path) else p, params)
    found = jamp.find_nonfinite(model.apply, params, X, policy=F16)
    assert found.produced_by is not None and found.produced_by.scope.endswith("head")
    fix = found.producer_remedy
    assert fix.kind == "rule" and fix.policy.rules[-1][0].endswith("head")
    assert np.isfinite(jamp.autocast_transform(model.apply, fix.policy)(params, X)).all()


def test_no_producer_is_named_for_a_nan_from_small_values():
    def batch_norm(w, x):
        h = x @ w
        var = jnp.mean(jnp.square(h), axis=0) - jnp.square(jnp.mean(h, axis=0))
        return jnp.sum(jax.lax.rsqrt(var + 1e-5))

    policy = jamp.Policy(jnp.bfloat16)
    policy = policy.replace(fp32=policy.fp32 - {"square", "integer_pow"})
    # (built on the host: the same float32 operations, so the same values, as jnp's)
    w = jax.device_put(np.eye(4, dtype=np.float32) * np.float32(3.1))
    x = np.float32(1) + np.float32(1e-4) * np.arange(32, dtype=np.float32).reshape(8, 4)
    x = jax.device_put(x)
    found = jamp.find_nonfinite(batch_norm, w, x, policy=policy)
    assert found.primitive == "rsqrt" and found.output[0].nan > 0
    assert found.produced_by is None and found.producer_remedy is None
    assert "overflow" not in found.remedy.why


def gelu_mlp(w, x):
    h = x @ w  # gelu-matmul
    return jnp.mean(jax.nn.gelu(h, approximate=True))   # its x ** 3 overflows float16


def test_a_small_producer_is_still_tried_as_the_remedy_before_float32_throughout():
    """The matmul's outputs (100) are far below float16's maximum, so it is not named as what
    overflowed; but float32 at its line hands x ** 3 float32 operands, which then runs in
    float32: a narrower remedy than float32 throughout, which was all that was offered."""
    w = jax.device_put(np.eye(8, dtype=np.float32) * np.float32(100))
    x = jax.device_put(np.ones((2, 8), np.float32))
    found = jamp.find_nonfinite(gelu_mlp, w, x, policy=F16)
    assert found.primitive == "integer_pow" and found.produced_by is None
    with open(__file__) as f:
        line = next(n for n, text in enumerate(f, 1) if text.rstrip().endswith("# gelu-matmul"))
    assert found.remedy.kind == "line rule"
    assert found.remedy.policy.rules[-1] == (f"@{os.path.basename(__file__)}:{line}",
                                             np.dtype(jnp.float32))
    assert np.isfinite(jamp.autocast_transform(gelu_mlp, found.remedy.policy)(w, x))
