"""tracing's graph comparison abstracts the sizes held in equation parameters (issue 25).

One case per primitive family: a shape-generic program whose parameter holds a size passes
``check_trace`` at two batch sizes (the case first shows that the parameter does differ between
the two traces), and a parameter that differs in something other than a size (a dtype or rank in
a callback's ``result_avals``, an axis, a stride) is still reported. Between traces at the same
avals every size is compared exactly. Equinox's ``error_if`` and diffrax: tests/zoo.
"""
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import tracing
from tests.jaxpr_utils import eqns_named
from tracing import graph as graphs

# Drawn with numpy and transferred: jax.device_put compiles nothing, where jax.random does.
SMALL = jax.device_put(np.random.default_rng(0).standard_normal((4, 6), np.float32))
# odd: SAME padding at stride 2 differs
LARGE = jax.device_put(np.random.default_rng(1).standard_normal((7, 6), np.float32))


def host_copy(x):
    return np.asarray(x)


def pure_callback_copy(x):
    return jax.pure_callback(host_copy, jax.ShapeDtypeStruct(x.shape, x.dtype), x)


def io_callback_copy(x):
    return jax.experimental.io_callback(host_copy, jax.ShapeDtypeStruct(x.shape, x.dtype), x)


def vmapped_callback(x):  # a sequential vmap of a callback is a scan over the batch
    call = functools.partial(jax.pure_callback, host_copy, jax.ShapeDtypeStruct((6,), x.dtype),
                             vmap_method="sequential")
    return jax.vmap(call)(x)


def ref_prefix(x):  # a Ref written through ``ref[:n // 2]``: sizes in the indexer's PyTreeDef
    ref = jax.new_ref(jnp.zeros_like(x))
    ref[: x.shape[0] // 2] = x[: x.shape[0] // 2]
    return ref[...]


def pooled(x, window, padding):
    return lax.reduce_window(x, -jnp.inf, lax.max, window, (2, 1), padding)


def conv_same(x):
    kernel = jnp.ones((1, 1, 3, 3)) / 9
    return lax.conv_general_dilated(x[None, None], kernel, (2, 1), "SAME")[0, 0]


# (id, function of x (and a key), primitive, the parameter that holds a size)
GENERIC = [
    # shapes of new arrays
    ("broadcast_in_dim", lambda x: jnp.broadcast_to(x, (2,) + x.shape), "broadcast_in_dim",
     "shape"),
    ("reshape", lambda x: x.reshape(-1), "reshape", "new_sizes"),
    ("iota", lambda x: jnp.arange(x.shape[0])[:, None] * x, "iota", "shape"),
    ("tile", lambda x: jnp.tile(x, (x.shape[0], 1)), "tile", "reps"),
    ("random_bits", lambda x, key: x + jax.random.normal(key, x.shape), "random_bits", "shape"),
    ("random_split", lambda x, key: jax.random.key_data(jax.random.split(key, x.shape[0])),
     "random_split", "shape"),
    ("rng_bit_generator", lambda x, key: lax.rng_bit_generator(
        jnp.tile(jax.random.key_data(key), 2), x.shape)[1], "rng_bit_generator", "shape"),
    # slices, paddings and windows
    ("slice", lambda x: x[1:-1], "slice", "limit_indices"),
    ("dynamic_slice", lambda x: lax.dynamic_slice_in_dim(x, jnp.argmax(x[0] > 9), x.shape[0] - 1),
     "dynamic_slice", "slice_sizes"),
    ("gather", lambda x: x[:, jnp.array([0, 2])], "gather", "slice_sizes"),
    ("pad", lambda x: jnp.pad(x, ((0, x.shape[0]), (1, 1))), "pad", "padding_config"),
    ("split", lambda x: jnp.split(x, [1]), "split", "sizes"),
    ("conv_same_padding", conv_same, "conv_general_dilated", "padding"),
    ("pool_same_padding", lambda x: pooled(x, (3, 1), "SAME"), "reduce_window_max", "padding"),
    ("pool_whole_dimension", lambda x: pooled(x, (x.shape[0], 1), "VALID"), "reduce_window_max",
     "window_dimensions"),
    ("pool_gradient", jax.grad(lambda x: pooled(x, (3, 1), "SAME").sum()),
     "select_and_scatter_add", "padding"),
    ("ref_indexer", ref_prefix, "swap", "tree"),
    # loops and counts
    ("scan", lambda x: lax.scan(lambda c, r: (c + r, c * r), jnp.zeros(6), x), "scan", "length"),
    ("fori_loop", lambda x: lax.fori_loop(0, x.shape[0], lambda i, c: c + x[i], jnp.zeros(6)),
     "scan", "length"),
    ("top_k", lambda x: lax.top_k(x.T, x.shape[0] // 2)[0], "top_k", "k"),
    ("fft", lambda x: jnp.fft.irfft(jnp.fft.rfft(x, axis=0), n=x.shape[0], axis=0), "fft",
     "fft_lengths"),
    ("lu_permutation", lambda x: lax.linalg.lu_pivots_to_permutation(
        jnp.argsort(x[:2, 0]).astype(jnp.int32), x.shape[0]), "lu_pivots_to_permutation",
     "permutation_size"),
    # host callbacks: avals in parameters
    ("pure_callback", pure_callback_copy, "pure_callback", "result_avals"),
    ("io_callback", io_callback_copy, "io_callback", "result_avals"),
    ("vmapped_pure_callback", vmapped_callback, "scan", "length"),
]


def inputs(fn, x):
    """``(x,)``, or ``(x, key)`` for the cases that draw random numbers (a key as an input)."""
    return (x, jax.random.key(2)) if fn.__code__.co_argcount == 2 else (x,)


def only_equation(closed, primitive):
    found = eqns_named(closed, primitive)
    assert found, f"no {primitive} equation in\n{closed}"
    return found[0]


@pytest.mark.parametrize("case", GENERIC, ids=[c[0] for c in GENERIC])
def test_sizes_in_parameters_are_abstracted_across_batch_sizes(case):
    _, fn, primitive, param = case
    small = jax.make_jaxpr(fn)(*inputs(fn, SMALL))
    large = jax.make_jaxpr(fn)(*inputs(fn, LARGE))
    # the parameter holds a size: it differs between the two traces ...
    assert only_equation(small, primitive).params[param] != \
        only_equation(large, primitive).params[param]
    # ... and the check at the other batch size passes, outputs included
    with warnings.catch_warnings():
        warnings.simplefilter("error", tracing.TracerWarning)
        tracing.check_trace(fn, inputs(fn, SMALL), check_inputs=[inputs(fn, LARGE)])


def test_avals_in_parameters_print_abstracted_with_dtype_and_rank():
    closed = jax.make_jaxpr(pure_callback_copy)(SMALL)
    (line,) = [ln.text for ln in graphs.canonicalize(closed).lines if "pure_callback" in ln.text]
    assert "result_avals=(float32[?,?])" in line
    exact = graphs.canonicalize(closed, sizes=True)
    assert any("result_avals=(float32[4,6])" in ln.text for ln in exact.lines)


def test_ffi_call_result_avals_are_abstracted_but_their_dtype_compared():
    """``ffi_call`` binds its ``result_avals`` like a callback (compared here without running:
    the target is not registered)."""
    def ffi(dtype):
        def fn(x):
            return jax.ffi.ffi_call("jamp_test_target", jax.ShapeDtypeStruct(x.shape, dtype))(x)
        return fn

    small = graphs.canonicalize(jax.make_jaxpr(ffi(jnp.float32))(SMALL))
    assert only_equation(jax.make_jaxpr(ffi(jnp.float32))(SMALL), "ffi_call").params[
        "result_avals"] != only_equation(jax.make_jaxpr(ffi(jnp.float32))(LARGE),
                                         "ffi_call").params["result_avals"]
    assert graphs.first_difference(small, graphs.canonicalize(
        jax.make_jaxpr(ffi(jnp.float32))(LARGE))) is None
    other_dtype = graphs.canonicalize(jax.make_jaxpr(ffi(jnp.float16))(LARGE))
    i = graphs.first_difference(small, other_dtype)
    assert i is not None and "result_avals=(float16[?,?])" in other_dtype.lines[i].text


def by_batch(small, large):
    """``small`` at the small batch, ``large`` at any other: a program that is not generic."""
    return lambda x: small if x.shape[0] == SMALL.shape[0] else large


def callback_of_dtype(x):
    dtype = by_batch(jnp.float32, jnp.float16)(x)
    return jax.pure_callback(lambda v: np.asarray(v, dtype), jax.ShapeDtypeStruct(x.shape, dtype),
                             x)


def callback_of_rank(x):
    shape = by_batch(x.shape, (x.size,))(x)
    return jax.pure_callback(lambda v: np.asarray(v).reshape(shape),
                             jax.ShapeDtypeStruct(shape, x.dtype), x)


NOT_SIZES = [
    ("callback_result_dtype", callback_of_dtype, "result_avals=(float16[?,?])"),
    ("callback_result_rank", callback_of_rank, "result_avals=(float32[?])"),
    ("cumsum_axis", lambda x: jnp.cumsum(x, axis=by_batch(0, 1)(x)), "axis=1"),
    ("conv_strides", lambda x: lax.conv_general_dilated(
        x[None, None], jnp.ones((1, 1, 3, 3)), by_batch((1, 1), (2, 1))(x), "VALID"),
     "window_strides=(2,1)"),
    ("top_k_operand_rank", lambda x: lax.top_k(by_batch(x, x.reshape(-1))(x), 2)[0],
     "float32[?] v3:int32[?] = top_k["),
]


@pytest.mark.parametrize("case", NOT_SIZES, ids=[c[0] for c in NOT_SIZES])
def test_parameters_that_differ_in_more_than_sizes_are_reported(case):
    _, fn, expected = case
    with pytest.raises(tracing.TracingCheckError,
                       match="Graphs differed across invocations!") as err:
        tracing.check_trace(fn, (SMALL,), check_inputs=[(LARGE,)])
    message = str(err.value)
    assert "check_inputs[0]" in message and "sizes abstracted as ?" in message
    assert expected in message
    if case[0].startswith("callback"):
        assert "test_graph_params.py" in message  # the user's source line


def test_sizes_are_compared_exactly_between_traces_at_the_same_avals():
    """A size read from state at trace time: the second trace at the example inputs differs
    only in a size, which the comparison at the same avals keeps."""
    calls = [0]

    def counted_top_k(x):
        calls[0] += 1
        return lax.top_k(x, calls[0])[0]

    with pytest.raises(tracing.TracingCheckError,
                       match="Graphs differed across invocations!") as err:
        tracing.check_trace(counted_top_k, (SMALL,))
    message = str(err.value)
    assert "trace at the example inputs (float32[4,6])" in message
    assert "top_k[axis=-1" in message or "top_k[axis=1" in message
    assert "k=1" in message and "k=2" in message and "sizes abstracted" not in message

    sizes = iter([(2, 12), (3, 8)])

    def reshaped(x):
        return x.reshape(next(sizes))

    with pytest.raises(tracing.TracingCheckError, match="new_sizes=\\(3,8\\)"):
        tracing.trace(reshaped, (SMALL,))


def test_same_avals_traces_of_a_generic_program_still_pass():
    fn = lambda x: (jnp.broadcast_to(x, (2,) + x.shape).reshape(-1), lax.top_k(x, 3)[0])
    traced = tracing.trace(fn, (SMALL,), check_inputs=[(SMALL + 1,), (LARGE,)])
    np.testing.assert_allclose(traced(SMALL)[1], lax.top_k(SMALL, 3)[0])
