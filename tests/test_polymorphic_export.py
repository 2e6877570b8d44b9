"""TracedFunction/FrozenFunction.export(polymorphic_shapes=...): one export, any batch size.

Each loaded program is compared with the same program made at the batch it is called with (a
trace or a freeze at that batch): the export is that program with a symbolic batch.
"""
import gc

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jamp
import tracing
from tests.host_data import normal


class CNN(nn.Module):
    """A small MNIST-style CNN with an inference BatchNorm and a flattening reshape."""

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(8, (3, 3))(x)
        x = nn.relu(nn.BatchNorm(use_running_average=True)(x))
        x = x.reshape((x.shape[0], -1))  # the batch size is a parameter of this reshape
        return nn.Dense(10)(x)


X = normal(1, (4, 12, 12, 1))


def trained_variables(model, x):
    """Variables whose BatchNorm statistics are not the initial 0 and 1, as after training."""
    variables = model.init(jax.random.key(0), x)
    rng = np.random.default_rng(2)

    def shifted(v):  # (float32 leaves)
        return jax.device_put(np.asarray(v) + 0.1 * rng.standard_normal(v.shape, np.float32))

    return jax.tree.map(shifted, variables)


def images(batch):
    return normal(batch, (batch,) + X.shape[1:])


def ops(closed):
    jaxpr = closed.jaxpr if hasattr(closed, "jaxpr") else closed
    return [e.primitive.name for e in jaxpr.eqns]


# --- freeze ------------------------------------------------------------------------------------

@pytest.mark.parametrize("policy", [None, jamp.Policy()], ids=["float32", "bfloat16"])
def test_frozen_cnn_with_batchnorm_serves_every_batch_size(policy):
    model = CNN()
    variables = trained_variables(model, X)
    frozen = tracing.freeze(model, variables, X, policy=policy)
    assert "rsqrt" not in ops(frozen.jaxpr)  # BatchNorm folded
    blob = frozen.export(polymorphic_shapes="b, ...")
    served = tracing.load(blob)
    assert served.__name__ == "tracing.load(freeze(CNN))"
    hlo = served.hlo
    assert "tensor<?x12x12x1x" in hlo and "rsqrt" not in hlo  # symbolic batch, still folded
    reference = jax.jit(model.apply)  # one program a batch size, not one an op
    for batch in (1, 3, 4, 9):
        x = images(batch)
        at_batch = tracing.freeze(model, variables, x, policy=policy)
        got = served(x)
        assert got.shape == (batch, 10) and got.dtype == at_batch(x).dtype
        chex.assert_trees_all_close(got, at_batch(x), atol=1e-6, rtol=1e-6)
        if policy is None:
            chex.assert_trees_all_close(got, reference(variables, x), atol=1e-4, rtol=1e-4)


def test_frozen_bf16_policy_stores_bf16_weights_in_the_polymorphic_export():
    model = CNN()
    variables = trained_variables(model, X)
    frozen = tracing.freeze(model, variables, X, policy=jamp.Policy())
    served = tracing.load(frozen.export(polymorphic_shapes="b, ..."))
    hlo = served.hlo
    assert "tensor<3x3x1x8xbf16>" in hlo and "tensor<3x3x1x8xf32>" not in hlo
    assert "stablehlo.convolution" in hlo


def test_nnx_module_in_eval_mode_freezes_and_serves_every_batch_size():
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(6, 8, rngs=rngs)
            self.norm = nnx.BatchNorm(8, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.drop(nnx.relu(self.norm(self.linear(x))))

    net = Net(nnx.Rngs(0))
    net.eval()
    x = jnp.ones((5, 6))
    served = tracing.load(tracing.freeze(net, None, x).export(polymorphic_shapes="b, 6"))
    for batch in (2, 7):
        xb = normal(batch, (batch, 6))
        chex.assert_trees_all_close(served(xb), net(xb), atol=1e-5, rtol=1e-5)


def test_traced_nnx_module_exports_its_captured_state_with_a_symbolic_batch():
    net = nnx.Sequential(nnx.Linear(6, 4, rngs=nnx.Rngs(0)), nnx.relu)
    served = tracing.load(tracing.trace(net, (jnp.ones((2, 6)),)).export("b, 6"))
    x = normal(3, (7, 6))
    chex.assert_trees_all_close(served(x), net(x), atol=1e-6)


def test_frozen_rngs_stay_the_last_input_with_a_fixed_shape():
    class Noisy(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dropout(0.5, deterministic=False)(nn.Dense(4)(x))

    model, x = Noisy(), jnp.ones((3, 4))
    variables = model.init(jax.random.key(0), x)
    rngs = {"dropout": jax.random.key(2)}
    frozen = tracing.freeze(model, variables, x, rngs=rngs)
    served = tracing.load(frozen.export(polymorphic_shapes=("b, 4", None)))
    xb = jnp.ones((6, 4))
    at_batch = tracing.freeze(model, variables, xb, rngs=rngs)
    chex.assert_trees_all_close(served(xb, rngs), at_batch(xb))
    with pytest.raises(ValueError, match=r"gives rngs\['dropout'\] \(shape \(\)\) the "
                                         r"shape 'b, \.\.\.'"):
        frozen.export(polymorphic_shapes="b, ...")  # one string for every input, the key too
    with pytest.raises(TypeError, match=r"rngs\['dropout'\] has dtype float32, but"):
        frozen(x, rngs={"dropout": jnp.ones(())})
    with pytest.raises(TypeError, match=r"takes the example input positionally and the rngs by "
                                        r"keyword, got 2 positional arguments: call it as "
                                        r"frozen\(x, rngs=rngs\)"):
        frozen(x, rngs)


def test_polymorphic_export_needs_the_variables_alive_and_says_so():
    model = CNN()
    variables = trained_variables(model, X)
    frozen = tracing.freeze(model, variables, X)
    del variables
    gc.collect()
    with pytest.raises(ValueError, match=r"^freeze\(CNN\)\.export\(polymorphic_shapes=\.\.\.\): "
                                         r"freeze\(CNN\) was frozen from variables that have "
                                         r"since been freed .* export before freeing them") as info:
        frozen.export(polymorphic_shapes="b, ...")
    assert "Hint" not in str(info.value)
    chex.assert_trees_all_close(tracing.load(frozen.export())(X), frozen(X))  # fixed shapes


def _apply(variables, x):
    return x @ variables["w"]


def test_polymorphic_export_refuses_numpy_variables_changed_in_place_after_the_freeze():
    w = np.ones((3, 3), np.float32)
    x = np.ones((2, 3), np.float32)
    frozen = tracing.freeze(_apply, {"w": w}, x)
    w[:] = 5.0  # a training loop writing into the caller's weights
    np.testing.assert_allclose(frozen(x), np.full((2, 3), 3.0))  # the frozen copy
    with pytest.raises(tracing.program.CannotRetrace,
                       match=r"variables\['w'\] has changed since the freeze.*export before "
                             r"changing it, or freeze again") as info:
        frozen.export(polymorphic_shapes="b, ...")
    assert "Hint" not in str(info.value)
    w[:] = 1.0  # the same bytes as at the freeze again
    served = tracing.load(frozen.export(polymorphic_shapes="b, ..."))
    np.testing.assert_allclose(served(np.ones((5, 3), np.float32)), np.full((5, 3), 3.0))


def test_polymorphic_export_of_deleted_jax_variables_says_they_were_freed():
    w = jnp.ones((3, 3))
    frozen = tracing.freeze(_apply, {"w": w}, np.ones((2, 3), np.float32))
    w.delete()
    with pytest.raises(tracing.program.CannotRetrace, match=r"since been freed \(.*deleted"):
        frozen.export(polymorphic_shapes="b, ...")


def test_frozen_call_at_another_batch_says_to_freeze_again_or_export_polymorphic():
    model = CNN()
    frozen = tracing.freeze(model, trained_variables(model, X), X)
    with pytest.raises(ValueError, match=r"freeze\(CNN\): inputs\[0\] has shape \(2, 12, 12, 1\).*"
                                         r"\(4, 12, 12, 1\); freeze it again at the new shapes, "
                                         r"or export it with polymorphic_shapes="):
        frozen(X[:2])


# --- trace -------------------------------------------------------------------------------------

def test_traced_apply_exports_with_the_variables_fixed_and_the_batch_symbolic():
    model = CNN()
    variables = trained_variables(model, X)
    traced = tracing.trace(model.apply, (variables, X))
    served = tracing.load(traced.export(polymorphic_shapes=(None, "b, ...")))
    new_vars = jax.tree.map(lambda v: v * 1.1, variables)  # the variables stay inputs
    for batch in (2, 6):
        x = images(batch)
        chex.assert_trees_all_close(served(new_vars, x), model.apply(new_vars, x),
                                    atol=1e-4, rtol=1e-4)


def test_autocast_functions_and_regions_export_with_a_symbolic_batch():
    w = normal(5, (6, 3))
    b = jnp.ones(3)

    def layer(x, w):
        return jax.nn.relu(x @ w + b)

    def region(x, w):
        with jamp.autocast():
            return jnp.tanh(x @ w) + b

    x = jnp.ones((4, 6))
    for fn in (jamp.autocast_transform(layer), region):
        traced = tracing.trace(fn, (x, w))
        served = tracing.load(traced.export(polymorphic_shapes=("b, 6", None)))
        for batch in (1, 7):
            xb = normal(batch, (batch, 6))
            want = tracing.trace(fn, (xb, w))(xb, w)
            got = served(xb, w)
            assert got.dtype == want.dtype and "bf16" in served.hlo
            chex.assert_trees_all_close(got, want)


def test_traced_call_at_another_batch_says_to_trace_again_or_export_polymorphic():
    traced = tracing.trace(lambda x: x * 2, (jnp.ones((3, 2)),))
    with pytest.raises(ValueError, match=r"trace it again at the new shapes, or export it with "
                                         r"polymorphic_shapes="):
        traced(jnp.ones((5, 2)))


def test_symbolic_dimensions_shared_between_inputs_and_in_outputs():
    def fn(tokens, mask):
        return {"sum": (tokens * mask).sum(1), "rows": jnp.arange(tokens.shape[0])}

    traced = tracing.trace(fn, (jnp.ones((2, 5)), jnp.ones((2, 5))))
    served = tracing.load(traced.export(polymorphic_shapes=("b, t", "b, t")))
    out = served(jnp.ones((3, 7)), jnp.ones((3, 7)))
    assert out["sum"].shape == (3,) and list(out["rows"]) == [0, 1, 2]
    with pytest.raises(ValueError, match=r"inputs\[1\] has shape \(4, 7\).*dimension 0 is b, "
                                         r"which inputs\[0\] dimension 0 sets to 3"):
        served(jnp.ones((3, 7)), jnp.ones((4, 7)))


# --- the loaded function's errors ----------------------------------------------------------------

@pytest.fixture(scope="module")
def served_cnn():
    model = CNN()
    variables = trained_variables(model, X)  # alive while exporting: freezing again reads them
    frozen = tracing.freeze(model, variables, X)
    return tracing.load(frozen.export(polymorphic_shapes="b, ..."))


@pytest.mark.parametrize("shape, message", [
    ((3, 12, 11, 1), r"inputs\[0\] has shape \(3, 12, 11, 1\), but the export takes inputs\[0\] "
                     r"with shape \(b, 12, 12, 1\): dimension 2 must be 12"),
    ((3, 12, 12), r"inputs\[0\] has shape \(3, 12, 12\), of 3 dimension\(s\), but the export "
                  r"takes inputs\[0\] with shape \(b, 12, 12, 1\)"),
    ((0, 12, 12, 1), r"inputs\[0\] has shape \(0, 12, 12, 1\), but the export takes inputs\[0\] "
                     r"with shape \(b, 12, 12, 1\): dimension 0 is the symbolic b, which is at "
                     r"least 1"),
])
def test_a_call_the_export_cannot_take_names_input_dimension_and_shape(served_cnn, shape, message):
    with pytest.raises(ValueError, match=r"tracing.load\(freeze\(CNN\)\): " + message):
        served_cnn(jnp.ones(shape))


def test_wrong_dtype_or_structure_of_a_polymorphic_export_is_named():
    served = tracing.load(tracing.trace(lambda d: d["x"] + 1, ({"x": jnp.ones((2, 3))},))
                          .export(polymorphic_shapes="b, 3"))
    with pytest.raises(TypeError, match=r"inputs\[0\]\['x'\] has dtype int32"):
        served({"x": jnp.ones((5, 3), jnp.int32)})
    with pytest.raises(TypeError, match=r"inputs\[0\]\['y'\]"):
        served({"y": jnp.ones((5, 3))})


def test_constraints_pass_through_and_a_broken_one_is_named():
    traced = tracing.trace(lambda x: x.sum(0), (jnp.ones((4, 3)),))
    served = tracing.load(traced.export(polymorphic_shapes="b, 3",
                                        constraints=["b >= 2", "b <= 16"]))
    assert served(jnp.ones((16, 3))).shape == (3,)
    for size, broken in ((1, "b >= 2"), (17, "b <= 16")):
        with pytest.raises(ValueError, match=rf"b = {size} \(from inputs\[0\] dimension 0\) "
                                             rf"breaks the export's constraint '{broken}'"):
            served(jnp.ones((size, 3)))
    exported = jax.export.deserialize(traced.export("b, 3", constraints=["b >= 2"]))
    assert str(exported.in_avals[0].shape[0]) == "b"  # a plain jax.export blob


def test_a_constraint_holding_a_comma_is_kept_whole():
    traced = tracing.trace(lambda x, y: x.sum(0) + y.sum(0), (jnp.ones((4, 3)), jnp.ones((5, 3))))
    served = tracing.load(traced.export(polymorphic_shapes=("b, 3", "c, 3"),
                                        constraints=["max(b, c) <= 16", "b >= 2"]))
    assert served(jnp.ones((16, 3)), jnp.ones((2, 3))).shape == (3,)
    with pytest.raises(ValueError, match=r"c = 17 \(from inputs\[1\] dimension 0\) breaks the "
                                         r"export's constraint 'max\(b, c\) <= 16'"):
        served(jnp.ones((2, 3)), jnp.ones((17, 3)))
    with pytest.raises(ValueError, match=r"breaks the export's constraint 'b >= 2'"):
        served(jnp.ones((1, 3)), jnp.ones((2, 3)))


def test_a_size_that_must_be_a_multiple_is_checked_by_jax_in_the_users_terms():
    traced = tracing.trace(lambda x: x.reshape(-1, 2, 3).sum(1), (jnp.ones((4, 3)),))
    served = tracing.load(traced.export(polymorphic_shapes="2*b, 3"))
    assert served(jnp.ones((6, 3))).shape == (3, 3)
    with pytest.raises(ValueError, match=r"do not fit the export, which takes inputs\[0\] "
                                         r"\(2\*b, 3\): .*remainder .*inputs\[0\]\.shape"):
        served(jnp.ones((5, 3)))


# --- export-time errors --------------------------------------------------------------------------

TWO = tracing.trace(lambda x, w: x @ w, (jnp.ones((4, 3)), jnp.ones((3, 2))))


@pytest.mark.parametrize("shapes, error, message", [
    (("b, 3, 1", None), ValueError,
     r"polymorphic_shapes gives inputs\[0\] \(shape \(4, 3\)\) the shape 'b, 3, 1', which has "
     r"more dimensions than the input's 2"),
    (("b", None), ValueError,
     r"polymorphic_shapes gives .* the shape 'b', which has fewer dimensions than the input's 2"),
    (("b, 5", None), ValueError,
     r"polymorphic_shapes gives inputs\[0\] \(shape \(4, 3\)\) the shape 'b, 5': .*"
     r"different size 5"),
    (("b +, 3", None), ValueError, r"polymorphic_shapes gives .* the shape 'b \+, 3': .*syntax"),
    (("b, 3",), TypeError, r"polymorphic_shapes is one shape string .* does not match the inputs"),
    (("b, 3", 3), TypeError, r"polymorphic_shapes gives inputs\[1\] a int \(3\)"),
    ("", ValueError,
     r"polymorphic_shapes gives inputs\[0\] \(shape \(4, 3\)\) the shape '', which has fewer"),
])
def test_malformed_polymorphic_shapes_are_named(shapes, error, message):
    with pytest.raises(error, match=r"<lambda>\.export\(polymorphic_shapes=.*\): " + message):
        TWO.export(polymorphic_shapes=shapes)


def test_malformed_constraints_are_named():
    with pytest.raises(TypeError, match=r"constraints is a list of strings"):
        TWO.export(("b, 3", None), constraints="b >= 2")
    with pytest.raises(ValueError, match=r"constraints=\['b > 2'\]: .*'>='"):
        TWO.export(("b, 3", None), constraints=["b > 2"])
    with pytest.raises(TypeError, match="constraints need polymorphic_shapes"):
        TWO.export(constraints=["b >= 2"])


def test_a_list_of_per_input_strings_is_accepted():
    served = tracing.load(TWO.export(polymorphic_shapes=["b, 3", None]))
    assert served(jnp.ones((9, 3)), jnp.ones((3, 2))).shape == (9, 2)


def test_a_function_that_needs_a_concrete_batch_size_fails_the_export_with_a_hint():
    def unrolled(x):
        return sum(x[i] for i in range(x.shape[0]))  # a Python loop over the batch

    traced = tracing.trace(unrolled, (jnp.ones((3, 2)),))
    with pytest.raises(ValueError, match=r"unrolled\.export\(polymorphic_shapes='b, 2'\): tracing "
                                         r"it again at the symbolic shapes \(b, 2\) failed: "
                                         r"(.|\n)*Hint: a symbolic dimension has no value"):
        traced.export(polymorphic_shapes="b, 2")


def test_a_failure_unrelated_to_symbolic_sizes_keeps_its_whole_message_and_no_hint():
    calls = []

    def flaky(x):
        calls.append(x.shape)
        if len(calls) > 1:
            raise RuntimeError("weights file missing\nsecond line of the cause")
        return x * 2

    traced = tracing.trace(flaky, (jnp.ones((3, 2)),), check_trace=False)
    with pytest.raises(ValueError, match=r"flaky\.export\(polymorphic_shapes='b, 2'\): tracing "
                                         r"it again at the symbolic shapes \(b, 2\) failed: "
                                         r"RuntimeError: weights file missing\nsecond line") as info:
        traced.export(polymorphic_shapes="b, 2")
    assert "Hint" not in str(info.value)
    assert isinstance(info.value.__cause__, RuntimeError)


def test_one_string_for_every_input_says_so_when_the_retrace_fails():
    model = CNN()
    traced = tracing.trace(model.apply, (trained_variables(model, X), X))
    with pytest.raises(ValueError, match=r"applies to every input; give one entry per input, "
                                         r"None for those of fixed shape"):
        traced.export(polymorphic_shapes="b, ...")


def test_a_fixed_shape_export_names_itself_and_says_how_to_vary_sizes():
    served = tracing.load(TWO.export())
    assert served.__name__ == "tracing.load(<lambda>)"
    with pytest.raises(ValueError, match=r"export with polymorphic_shapes="):
        served(jnp.ones((5, 3)), jnp.ones((3, 2)))
    np.testing.assert_allclose(served(jnp.ones((4, 3)), jnp.ones((3, 2))), np.full((4, 2), 3.0))


def test_values_made_from_the_batch_size_stay_in_the_frozen_program():
    def fn(variables, x):  # iota and dim_as_value of the batch size: never folded to constants
        return x * variables["w"] + jnp.arange(x.shape[0])[:, None] / x.shape[0]

    variables = {"w": jnp.full(3, 2.0)}
    frozen = tracing.freeze(fn, variables, jnp.ones((4, 3)))
    served = tracing.load(frozen.export(polymorphic_shapes="b, 3"))
    for batch in (2, 5):
        x = normal(batch, (batch, 3))
        chex.assert_trees_all_close(served(x), fn(variables, x), atol=1e-6)


def test_export_with_two_symbolic_dims_under_a_policy_warns_nothing():
    """Sizes like b*s*64 were evaluated at b = s = 2**16 in int32 (RuntimeWarning: overflow
    encountered in scalar multiply, or an OverflowError): issue 32."""
    import warnings

    from jamp import _compat

    def layer(x, w, b):
        return jax.nn.relu(x @ w + b).sum(-1)

    x = jax.ShapeDtypeStruct(jax.export.symbolic_shape("b, s, 16"), jnp.float32)
    w, b = jax.ShapeDtypeStruct((16, 16), jnp.float32), jax.ShapeDtypeStruct((16,), jnp.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exported = jax.export.export(jax.jit(jamp.autocast_transform(layer)))(x, w, b)
    out = exported.call(jnp.ones((2, 3, 16)), jnp.ones((16, 16)), jnp.ones(16))
    assert out.shape == (2, 3)
    a, bb, s, m = jax.export.symbolic_shape("a, b, s, max(b, 2)")
    assert _compat.generic_size(64 * bb * s) == 64 * 2**32
    assert _compat.generic_size(s * m) == 2**32
    assert _compat.generic_size(a * a * bb * bb * s) == 2**63 - 1   # past int64: "huge"


@pytest.mark.parametrize("form", ["region", "transform"])
def test_a_symbolic_dimension_used_as_a_value_exports_under_both_forms(form):
    # A symbolic dimension passed as an operand (jnp.linspace(0, x.shape[0], n)) was taken for a
    # known constant, which the rules cast at rewrite time: JAX cannot evaluate one outside the
    # program (JAX's shape_poly_test under an identity region).
    w = jnp.linspace(-0.5, 0.5, 16).reshape(4, 4)

    def scaled_rows(x):
        return (x @ w) * jnp.linspace(0, x.shape[0], 4)

    def region(x):
        with jamp.autocast():
            return scaled_rows(x)

    fn = region if form == "region" else jamp.autocast_transform(scaled_rows)
    (batch,) = jax.export.symbolic_shape("b")
    exported = jax.export.export(jax.jit(fn))(jax.ShapeDtypeStruct((batch, 4), jnp.float32))
    assert "bf16" in exported.mlir_module()  # (the matmul; its product with the float32
    for rows in (3, 5):                        # linspace promotes, as in torch)
        x = jnp.linspace(-1.0, 1.0, rows * 4).reshape(rows, 4)
        np.testing.assert_allclose(exported.call(x), scaled_rows(x), rtol=3e-2, atol=3e-2)
