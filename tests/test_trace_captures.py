"""What a trace captures (constants, module state) is fixed when traced; the checks see what
the function reads from state, and a call never changes what the caller owns."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tracing
from tests.host_data import ones

# Inputs are built on the host and transferred (tests/host_data.py): jnp.ones compiles a program
# per shape and dtype.
X = ones(3)


# --- constants are the values seen when traced ---

@pytest.mark.parametrize("read", [lambda w: w, jnp.asarray, jnp.array],
                         ids=["numpy", "jnp.asarray", "jnp.array"])
def test_a_closed_over_numpy_array_written_after_tracing_does_not_change_the_program(read):
    w = np.ones(3, np.float32)
    traced = tracing.trace(lambda x: x * read(w), (X,))
    w[:] = 5.0
    chex.assert_trees_all_close(traced(X), X)
    chex.assert_trees_all_close(tracing.load(traced.export())(X), X)
    chex.assert_trees_all_close(np.asarray(traced.jaxpr.consts[0]), np.ones(3, np.float32))


def test_the_program_and_its_export_agree_when_the_array_is_written_between_calls():
    w = np.ones(3, np.float32)
    traced = tracing.trace(lambda x: x * w, (X,))
    traced(X)
    w[:] = 7.0
    chex.assert_trees_all_close(traced(X), X)
    chex.assert_trees_all_close(tracing.load(traced.export())(X), traced(X))


def test_a_function_that_writes_the_global_array_it_reads_is_a_differing_constant():
    table = np.ones(3, np.float32)

    def bump(x):
        table[0] += 1.0
        return x * table

    with pytest.raises(tracing.TracingCheckError, match="Constants differed") as err:
        tracing.trace(bump, (X,))
    assert "float32[3]" in str(err.value)


# --- a polymorphic export traces again: with the state seen when traced ---

def test_a_polymorphic_export_after_a_global_setting_changed_names_the_constant():
    config = {"temperature": 1.0}
    x = ones(4, 3)
    traced = tracing.trace(lambda v: v / config["temperature"], (x,))
    config["temperature"] = 10.0
    with pytest.raises(tracing.TracingCheckError,
                       match="changed since it was traced") as err:
        traced.export(polymorphic_shapes="b, 3")
    assert "1.0 in the first trace, 10.0" in str(err.value)
    config["temperature"] = 1.0                        # as traced: the export is made
    served = tracing.load(traced.export(polymorphic_shapes="b, 3"))
    chex.assert_trees_all_close(served(x), traced(x))


def test_an_nnx_module_updated_after_tracing_exports_the_state_it_was_traced_with():
    from flax import nnx

    x = ones(4, 3)
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    traced = tracing.trace(model, (x,))
    expected = model(x)
    model.kernel[...] = jnp.ones((3, 2))
    chex.assert_trees_all_close(traced(x), expected)
    served = tracing.load(traced.export(polymorphic_shapes="b, 3"))
    chex.assert_trees_all_close(served(x), expected, atol=1e-6)
    chex.assert_trees_all_close(served(x[:2]), expected[:2], atol=1e-6)


# --- the checks never change the caller's inputs ---

def test_a_function_updating_its_input_dict_leaves_the_callers_dict_as_it_was():
    def normalize_in_place(batch):
        batch["img"] = batch["img"] / 255.0
        return batch["img"].sum()

    image = jnp.full((2, 3), 255.0)
    batch = {"img": image}
    check = {"img": jnp.full((4, 3), 255.0)}
    traced = tracing.trace(normalize_in_place, (batch,), check_inputs=[(check,)])
    assert batch["img"] is image and check["img"].shape == (4, 3)
    chex.assert_trees_all_close(float(check["img"][0, 0]), 255.0)
    chex.assert_trees_all_close(traced(batch), normalize_in_place({"img": image}))


# --- jax.ShapeDtypeStruct inputs: the output check draws values ---

def test_shape_dtype_structs_as_example_and_check_inputs_trace_and_check():
    spec = jax.ShapeDtypeStruct((3,), jnp.float32)
    traced = tracing.trace(lambda x, i: x * 2 + x[i], (spec, jax.ShapeDtypeStruct((), jnp.int32)),
                           check_inputs=[(jax.ShapeDtypeStruct((5,), jnp.float32), jnp.int32(1))])
    chex.assert_trees_all_close(traced(X, jnp.int32(0)), jnp.full(3, 3.0))


def test_the_output_check_at_shape_dtype_structs_compares_drawn_values():
    def host_noise(x):
        noise = lambda v: np.asarray(v) + np.random.rand(*v.shape).astype(v.dtype)  # noqa: E731
        return jax.pure_callback(noise, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

    with pytest.warns(tracing.TracerWarning, match="does not match"):
        tracing.trace(host_noise, (jax.ShapeDtypeStruct((3,), jnp.float32),))


# --- Python numbers (weakly typed) and typed scalars are told apart ---

@pytest.mark.parametrize("example, other", [(2.0, jnp.float32(3.0)), (jnp.float32(2.0), 3.0),
                                            (2, np.int32(3))])
def test_a_check_input_typed_unlike_the_example_scalar_is_refused_naming_it(example, other):
    x = ones(4, 3)
    with pytest.raises(TypeError, match=r"check_inputs\[0\]: inputs\[1\] is .*Make them agree"):
        tracing.check_trace(lambda v, s: v * s, (x, example), check_inputs=[(x, other)])


def test_a_call_typed_unlike_the_traced_scalar_is_refused_where_it_would_change_the_dtype():
    x = ones(2, dtype=jnp.bfloat16)
    scale = lambda v, s: v * s  # noqa: E731
    weak = tracing.trace(scale, (x, 2.0))
    assert weak(x, 3.0).dtype == scale(x, 3.0).dtype == jnp.bfloat16
    with pytest.raises(TypeError, match=r"inputs\[1\] is a typed float32 array .* Python number"):
        weak(x, jnp.float32(3.0))
    strong = tracing.trace(scale, (x, jnp.float32(2.0)))
    assert strong(x, jnp.float32(3.0)).dtype == scale(x, jnp.float32(3.0)).dtype == jnp.float32
    with pytest.raises(TypeError, match=r"inputs\[1\] is a Python number .* jnp.float32"):
        strong(x, 3.0)


# --- leaked tracers in what a callable object reaches ---

LEAK_LOG = []


class _LogsToAGlobal:
    def __call__(self, x):
        LEAK_LOG.append(x.sum())
        return x + 1


class _CachesOnItsClass:
    cache = {}

    def __call__(self, x):
        self.cache["last"] = x * 2
        return x + 1


class _InheritsTheCache(_CachesOnItsClass):
    pass


@pytest.mark.parametrize("make, where", [
    (_LogsToAGlobal, r"`LEAK_LOG\[0\]` \(a global of"),
    (_CachesOnItsClass, r"`_CachesOnItsClass.cache\['last'\]`"),
    (_InheritsTheCache, r"`_CachesOnItsClass.cache\['last'\]`"),
])
def test_a_tracer_a_callable_object_stores_in_a_global_or_class_attribute_is_reported(make, where):
    LEAK_LOG.clear()
    _CachesOnItsClass.cache.clear()
    for check in (True, False):
        with pytest.raises(tracing.TracingCheckError, match=where):
            tracing.trace(make(), (X,), check_trace=check)
    LEAK_LOG.clear()
    _CachesOnItsClass.cache.clear()


# --- state returned as an output is a differing constant too ---

def test_a_counter_returned_as_an_output_is_a_differing_constant_naming_the_output():
    calls = [0]

    def step(x):
        calls[0] += 1
        return x * 2, calls[0]

    with pytest.raises(tracing.TracingCheckError, match="Constants differed") as err:
        tracing.trace(step, (X,))
    assert "1 in the first trace, 2" in str(err.value) and "output nr 2" in str(err.value)


def test_numpy_randomness_returned_as_an_output_names_the_output():
    with pytest.raises(tracing.TracingCheckError, match="Constants differed") as err:
        tracing.trace(lambda x: (x, np.random.rand(3).astype(np.float32)), (X,))
    assert "float32[3], first used at output nr 2" in str(err.value)


# --- errors name the user's input, not JAX's flattened argument ---

def test_python_control_flow_on_an_input_names_its_path():
    def gated(x, options):
        if options["flag"]:
            return x * 2
        return x

    with pytest.raises(tracing.TracingCheckError,
                       match=r"concrete value of a traced input \(inputs\[1\]\['flag'\]\)"):
        tracing.trace(gated, (X, {"flag": True}))


# --- the constant-key warning names the user's line, not the library's ---

def test_a_captured_key_drawn_inside_a_flax_layer_is_reported_at_the_users_line():
    import flax.linen as nn

    key = jax.random.key(5)

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dropout(0.5, deterministic=False)(x)  # the user's line of the draw

    net, x = Net(), ones(2, 4)
    with pytest.warns(tracing.TracerWarning, match="PRNG key") as caught:
        tracing.trace(lambda x: net.apply({}, x, rngs={"dropout": key}), (x,))
    where = str(caught[0].message).split(" drawn from at ")[1]
    assert where.split(" ")[0].startswith(__file__.removesuffix("c"))  # (not a .pyc)
    assert "Net.__call__), inside" in where and "stochastic.py" in where
