"""autocast_transform's static_argnums / static_argnames (jax.jit's meaning) and Python numbers."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jamp

BF16, F32 = jnp.bfloat16, jnp.float32
# Built on the host and transferred: jnp.linspace and jnp.eye compile programs of their own.
X = jax.device_put(np.linspace(-1.0, 1.0, 12, dtype=np.float32).reshape(3, 4))
W = jax.device_put(np.eye(4, dtype=np.float32) * np.float32(0.5))


def _powers(x, n, w=W):
    """Multiplies by ``w`` ``n`` times with a Python loop: ``n`` must be a Python int."""
    assert type(n) is int, f"n arrived as {type(n).__name__}"
    for _ in range(n):
        x = x @ w
    return x


def _expected(n):
    return _powers(X, n)


@pytest.mark.parametrize("static", [dict(static_argnums=1), dict(static_argnums=-2),
                                    dict(static_argnums=(1,)), dict(static_argnames="n"),
                                    dict(static_argnames=("n",))])
def test_static_loop_count_is_a_python_int_positionally_and_by_keyword(static):
    traces = []

    def g(x, n, w=W):
        traces.append(n)
        return _powers(x, n, w)

    f = jamp.autocast_transform(g, **static)
    out = f(X, 3)
    assert out.dtype == BF16
    np.testing.assert_allclose(out.astype(F32), _expected(3), rtol=1e-2)
    # numbers and names are inferred from each other through the signature, as in jax.jit
    np.testing.assert_allclose(f(X, n=2).astype(F32), _expected(2), rtol=1e-2)
    f(X, 3)  # cached: same static value
    assert traces == [3, 2]


def test_each_static_value_is_a_cache_entry_and_types_are_part_of_the_key():
    seen = []

    def g(x, scale):
        seen.append(type(scale))
        return x * scale

    f = jamp.autocast_transform(g, static_argnums=1)
    assert f(X, 2).dtype == F32 and f(X, 2.0).dtype == F32 and f(X, True).dtype == F32
    f(X, 2)
    assert seen == [int, float, bool]  # 2, 2.0 and True compare equal but trace differently


def test_a_static_tuple_stays_a_tuple_of_python_ints():
    def zeros_like_shape(x, shape):
        return x.sum() + jnp.zeros(shape)

    f = jamp.autocast_transform(zeros_like_shape, static_argnames="shape")
    assert f(X, shape=(2, 3)).shape == (2, 3)
    assert f(X, (4,)).shape == (4,)


def test_negative_argnums_with_varargs_count_from_the_end_of_each_call():
    def g(x, *rest):
        *arrays, n = rest
        assert type(n) is int
        return _powers(x + sum(arrays), n)

    f = jamp.autocast_transform(g, static_argnums=-1)
    np.testing.assert_allclose(f(X, 2).astype(F32), _expected(2), rtol=1e-2)
    np.testing.assert_allclose(f(X, X * 0, 1).astype(F32), _expected(1), rtol=1e-2)


def test_jit_with_static_argnums_around_a_plain_transform():
    # Under jax.jit the 3 is a constant of the outer program: passed on as the Python int.
    f = jax.jit(jamp.autocast_transform(_powers), static_argnums=1)
    out = f(X, 3)
    assert out.dtype == BF16
    np.testing.assert_allclose(out.astype(F32), _expected(3), rtol=1e-2)


def test_grad_and_vmap_with_a_static_argument():
    f = jamp.autocast_transform(lambda x, n: jnp.sum(_powers(x, n).astype(F32)), static_argnums=1)
    g = jax.grad(f)(X, 2)
    assert g.dtype == F32
    np.testing.assert_allclose(g, jax.grad(lambda x: jnp.sum(_powers(x, 2)))(X), rtol=1e-2)
    batched = jax.vmap(jamp.autocast_transform(_powers, static_argnums=1), in_axes=(0, None))(
        X[:, None], 2)
    assert batched.shape == (3, 1, 4)


def test_python_numbers_are_traced_in_eager_calls():
    # Eagerly a Python number is traced (as jax.jit does): no new trace per value...
    traces = []

    def g(x, lr):
        traces.append(lr)
        return x * lr

    f = jamp.autocast_transform(g)
    f(X, 0.1)
    f(X, 0.2)
    assert len(traces) == 1 and isinstance(traces[0], jax.core.Tracer)
    # ... so a loop count must be marked static, and the error says where it came from.
    def unrolled(x, n):
        for _ in range(n):
            x = x @ W
        return x

    with pytest.raises(jax.errors.TracerIntegerConversionError, match=r"unrolled at .*argument n"):
        jamp.autocast_transform(unrolled)(X, 3)


def test_unhashable_static_argument_names_the_parameter():
    def g(x, sizes):
        return x

    with pytest.raises(TypeError, match=r"autocast_transform\(.*g\): static argument 'sizes' "
                                        r"\(static_argnums\) must be hashable.*got list"):
        jamp.autocast_transform(g, static_argnums=1)(X, [1, 2])
    with pytest.raises(TypeError, match=r"static argument 'sizes' \(static_argnames\).*got dict"):
        jamp.autocast_transform(g, static_argnames="sizes")(X, sizes={"a": 1})


def test_unhashable_leaf_without_static_marking_names_its_path():
    def loss(params, batch):
        return params["w"]

    f = jamp.autocast_transform(loss)
    with pytest.raises(TypeError, match=r"loss\): argument batch\['ids'\] is a set"):
        f({"w": X}, {"ids": {1, 2}})


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(static_argnums=2), ValueError, r"static_argnums=\(2,\) but the function takes 2 "
                                         r"positional argument\(s\) \(x, n\)"),
    (dict(static_argnums=-3), ValueError, r"static_argnums=\(-3,\)"),
    (dict(static_argnames="m"), ValueError, r"static_argnames names 'm', which is not a parameter.*\(x, n\)"),
    (dict(static_argnums="n"), TypeError, r"static_argnums must be an int or a sequence of ints"),
    (dict(static_argnames=1), TypeError, r"static_argnames must be a parameter name"),
])
def test_bad_static_specifications_fail_at_transform_time(kwargs, error, message):
    def g(x, n):
        return x

    with pytest.raises(error, match=r"autocast_transform\(.*g\): " + message):
        jamp.autocast_transform(g, **kwargs)


def test_positional_only_parameter_cannot_be_a_static_argname():
    def g(x, n, /):
        return x

    with pytest.raises(ValueError, match="'n', a positional-only parameter; use static_argnums"):
        jamp.autocast_transform(g, static_argnames="n")
    assert jamp.autocast_transform(g, static_argnums=1)(X, 1) is not None


def test_kwargs_function_accepts_any_static_argname():
    def g(x, **options):
        assert type(options["n"]) is int
        return _powers(x, options["n"])

    f = jamp.autocast_transform(g, static_argnames="n")
    np.testing.assert_allclose(f(X, n=2).astype(F32), _expected(2), rtol=1e-2)


def test_functools_partial_and_builtins_without_signature():
    f = jamp.autocast_transform(functools.partial(_powers, w=W * 2), static_argnums=1)
    np.testing.assert_allclose(f(X, 1).astype(F32), X @ (W * 2), rtol=1e-2)
    assert jamp.autocast_transform(jnp.tanh)(X).dtype == F32


def test_nnx_module_with_a_static_argument():
    nnx = pytest.importorskip("flax.nnx")
    model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))

    def apply(m, x, n):
        assert type(n) is int
        for _ in range(n):
            x = m(x)
        return x

    out = jamp.autocast_transform(apply, static_argnums=2)(model, X, 2)
    assert out.dtype == BF16
    np.testing.assert_allclose(out.astype(F32), model(model(X)), rtol=3e-2, atol=3e-2)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["w", "rate"], meta_fields=[])
@dataclasses.dataclass
class _Dropout:
    """Equinox-style: a layer whose Python float field is a pytree leaf, which its code branches
    on as eqx.nn.Dropout does (``if self.rate == 0``)."""
    w: jax.Array
    rate: float

    def __call__(self, x):
        if isinstance(self.rate, float) and self.rate == 0:
            return x @ self.w
        raise RuntimeError("a traced rate needs a key")


def test_python_numbers_inside_pytree_arguments_are_static():
    traces = []

    def apply(layer, x, lr):
        traces.append((layer.rate, lr))
        return layer(x) * lr

    f = jamp.autocast_transform(apply)
    layer = _Dropout(W, 0.0)
    # Eagerly (it failed: the rate was traced), and, as Equinox users call it, under jit and
    # grad with the float outside the traced arguments (eqx.filter_jit, eqx.partition).
    for out in (f(layer, X, 0.5), jax.jit(lambda w, x: f(_Dropout(w, 0.0), x, 0.5))(W, X)):
        assert out.dtype == BF16
        np.testing.assert_allclose(out.astype(F32), X @ W * 0.5, rtol=1e-2)
    grad = jax.grad(lambda w: f(_Dropout(w, 0.0), X, 0.5).astype(F32).sum())(W)
    assert grad.dtype == F32
    assert type(jamp.explain(apply, layer, X, 0.5).low_precision_flop_share) is float
    # The number nested in the pytree reached the function as itself; the whole-argument
    # learning rate was traced eagerly (no new trace per value), as jax.jit does.
    eager = [t for t in traces if not isinstance(t[1], float)]
    assert eager and all(rate == 0.0 and type(rate) is float for rate, _ in eager)
    before = len(traces)
    f(layer, X, 0.25)
    assert len(traces) == before
    with pytest.raises(RuntimeError, match="traced rate"):  # a new value traces again
        f(_Dropout(W, 0.1), X, 0.5)
    assert len(traces) == before + 1 and traces[-1][0] == 0.1


class _Weights:  # a plain object (not a pytree), hashed by identity
    def __init__(self, w):
        self.w, self.name = w, "layer"


def test_an_object_holding_arrays_is_refused_not_baked_in_by_identity():
    # As a static leaf its arrays became constants, and the cache answered by the object's
    # identity: `model.w = new_w` silently returned the old result. jax.jit refuses it.
    f = jamp.autocast_transform(lambda model, x: x @ model.w)
    model = _Weights(W)
    for weights in (W, np.asarray(W)):
        model.w = weights
        with pytest.raises(TypeError, match=r"<lambda>\): argument model is a _Weights holding "
                                            r"arrays \(\.w\) but it is not a pytree.*"
                                            r"register_dataclass"):
            f(model, X)
    with pytest.raises(TypeError, match=r"argument batch\['layers'\]\[1\] is a _Weights"):
        jamp.autocast_transform(lambda batch: batch["x"])({"x": X, "layers": [0, model]})
    # Marked static, or hashed by value, it is the caller's choice (jax.jit's static meaning).
    assert jamp.autocast_transform(lambda m, x: x @ m.w, static_argnums=0)(model, X).dtype == BF16

    @dataclasses.dataclass(frozen=True)
    class Config:
        table: np.ndarray

        def __hash__(self):
            return 0

    assert jamp.autocast_transform(lambda c, x: x * c.table[0])(Config(np.ones(4)), X).shape == X.shape
    # Registered as a pytree, its arrays are traced and a new value is seen.
    registered = _RegisteredWeights(W)
    first = f(registered, X)
    registered.w = W * 2
    np.testing.assert_allclose(f(registered, X).astype(F32), 2 * first.astype(F32))


@jax.tree_util.register_pytree_node_class
class _RegisteredWeights(_Weights):
    def tree_flatten(self):
        return (self.w,), None

    @classmethod
    def tree_unflatten(cls, _, children):
        return cls(*children)


def test_an_output_object_holding_traced_values_is_refused():
    def make(x):
        return x, {"box": _Weights(x * 2)}

    with pytest.raises(TypeError, match=r"autocast_transform\(.*make\): its output\[1\]\['box'\] "
                                        r"is a _Weights holding values computed from the "
                                        r"arguments \(\.w\)"):
        jamp.autocast_transform(make)(X)
    # An object holding arrays that came from outside passes through, as it came.
    outside = _Weights(W)
    assert jamp.autocast_transform(lambda x: (x, outside))(X)[1] is outside


def test_float_leaves_in_a_pytree_are_keyed_by_their_bits():
    """0.0 == -0.0, so one program answered both (the signs of x / -0.0 came back as of 0.0);
    NaN equals nothing, so every call missed the cache and added an entry."""
    traces = []

    def divide(x, cfg):
        traces.append(cfg["eps"])
        return x / cfg["eps"]

    f = jamp.autocast_transform(divide)
    assert bool(jnp.all(f(X[0], {"eps": 0.0}) != f(X[0], {"eps": -0.0})))
    assert len(traces) == 2
    for _ in range(3):
        f(X[0], {"eps": float("nan")})
    assert len(traces) == 3
