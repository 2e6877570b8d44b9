"""The rewriting evaluator: categories, constants, the cast cache, errors."""
import re
import warnings

import jax
import jax.experimental
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jamp
from jamp import interpreter
from tests.jaxpr_utils import eqns_named, in_region, iter_eqns, operand_dtypes

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
KEY = jax.random.PRNGKey(0)


# Test data is drawn on the host and transferred: jax.random and eager jnp ops would each compile
# a program per shape.
def _host_rand(*shape, key=0):
    return np.random.default_rng(key).standard_normal(shape, dtype=np.float32) * np.float32(0.5)


def _rand(*shape, dtype=F32, key=0):
    return jax.device_put(_host_rand(*shape, key=key).astype(dtype))


def test_lower_ops_return_compute_dtype_not_a_downcast_float32():
    a, b = _rand(4, 4), _rand(4, 4, key=1)
    f = jamp.autocast_transform(lambda a, b: (a @ b, jnp.sum(a @ b)))
    x, y = f(a, b)
    assert (x.dtype, y.dtype) == (BF16, F32)
    jaxpr = jax.make_jaxpr(f)(a, b)
    for eqn in eqns_named(jaxpr, "dot_general"):
        assert eqn.params["preferred_element_type"] == BF16
        assert eqn.outvars[0].aval.dtype == BF16


def test_accumulate_dtype_gives_float32_matmul_outputs():
    a = _rand(4, 4)
    f = jamp.autocast_transform(lambda a: a @ a, jamp.Policy(accumulate_dtype=F32))
    assert f(a).dtype == F32
    assert operand_dtypes(jax.make_jaxpr(f)(a), "dot_general") == [("bfloat16", "bfloat16")]


def test_explicit_preferred_element_type_is_kept():
    a = _rand(4, 4).astype(BF16)
    f = jamp.autocast_transform(lambda a: lax.dot(a, a, preferred_element_type=F32))
    assert f(a).dtype == F32


@pytest.mark.parametrize("wrap", [jamp.autocast_transform, in_region], ids=["transform", "region"])
def test_an_explicit_dot_algorithm_keeps_the_operand_types_it_names(wrap):
    """``precision=lax.DotAlgorithmPreset.F32_F32_F32`` names the types the dot computes in,
    and XLA converts other operands to them: cast to bfloat16 first, the operands were rounded
    and then multiplied in float32 anyway (neither the program's product nor the policy's). An
    algorithm that accepts the policy's dtype (``BF16_BF16_F32``) is the policy's to use."""
    a, b = _rand(16, 16), _rand(16, 16, key=1)

    def f32_algorithm(a, b):
        return lax.dot(a, b, precision=lax.DotAlgorithmPreset.F32_F32_F32)

    g = wrap(f32_algorithm)
    assert operand_dtypes(jax.make_jaxpr(g)(a, b), "dot_general") == [("float32", "float32")]
    np.testing.assert_array_equal(jax.jit(g)(a, b), jax.jit(f32_algorithm)(a, b))

    def bf16_algorithm(a, b):
        return lax.dot(a, b, precision=lax.DotAlgorithmPreset.BF16_BF16_F32)

    program = jax.make_jaxpr(wrap(bf16_algorithm))(a, b)
    assert operand_dtypes(program, "dot_general") == [("bfloat16", "bfloat16")]

    def f16_algorithm(a, b):  # (traced only: this CPU cannot run F16_F16_F32)
        return lax.dot(a, b, precision=lax.DotAlgorithmPreset.F16_F16_F32, preferred_element_type=F32)

    program = jax.make_jaxpr(wrap(f16_algorithm))(a.astype(F16), b.astype(F16))
    assert operand_dtypes(program, "dot_general") == [("float16", "float16")]
    assert program.out_avals[0].dtype == F32


def test_conv_runs_in_compute_dtype():
    x, k = _rand(1, 3, 8, 8), _rand(4, 3, 3, 3, key=1)
    f = jamp.autocast_transform(lambda x, k: lax.conv_general_dilated(x, k, (1, 1), "SAME"))
    assert f(x, k).dtype == BF16
    assert operand_dtypes(jax.make_jaxpr(f)(x, k), "conv_general_dilated") == [("bfloat16",) * 2]


@pytest.mark.parametrize("fn", [jnp.exp, jnp.log1p, jnp.expm1, jax.lax.rsqrt, jnp.sum, jnp.cumsum,
                                jnp.prod, jax.scipy.special.erfinv, jax.nn.softmax,
                                jax.nn.log_softmax, jax.nn.logsumexp])
def test_fp32_ops_run_in_float32(fn):
    # The input reaches the op as bfloat16 (a matmul output), as activations do in a model.
    x = jax.device_put(np.abs(_host_rand(4, 8)) * np.float32(0.5))
    eye = jax.device_put(np.eye(8, dtype=np.float32))
    f = jamp.autocast_transform(lambda x, eye: fn(x @ eye))
    assert f(x, eye).dtype == F32


def test_fp32_op_on_a_bfloat16_input_runs_in_float32():
    assert jamp.autocast_transform(jnp.log)(jnp.ones(4, BF16)).dtype == F32


def test_float64_is_never_narrowed():
    with jax.enable_x64(True):
        x = jnp.ones((4, 4), jnp.float64)
        f = jamp.autocast_transform(lambda x: (x @ x, jnp.log(x), x * 0.1 + x))
        assert [o.dtype for o in f(x)] == [jnp.float64] * 3
        mixed = jamp.autocast_transform(lambda x, y: (x @ x) + y)
        assert mixed(jnp.ones((4, 4), F32), x).dtype == jnp.float64


def test_a_complex_product_keeps_its_real_operand_in_both_forms():
    # JAX multiplies complex64 by float32 as it is (no promotion in the program), in complex64:
    # the real operand narrowed to the compute dtype would only be rounded, as with float64.
    x = jax.device_put((_host_rand(4, 4) + 1j * _host_rand(4, 4, key=1)).astype(np.complex64))
    w = jax.device_put(np.full((4, 4), 1.001, np.float32))  # (no bfloat16 value)

    def f(x, w):
        return x @ w, jnp.einsum("ij,jk->ik", w, x), jnp.abs(x) @ w

    expected = f(x, w)
    for form in (jamp.autocast_transform(f), in_region(f)):
        assert operand_dtypes(jax.make_jaxpr(form)(x, w), "dot_general") == [
            ("complex64", "float32"), ("float32", "complex64"), ("bfloat16", "bfloat16")]
        for run in (form, jax.jit(form)):
            got = run(x, w)
            assert [o.dtype for o in got] == [jnp.complex64, jnp.complex64, BF16]
            for g, e in zip(got[:2], expected[:2]):
                np.testing.assert_allclose(g, e, rtol=1e-6)
    flops = jamp.explain(f, x, w).flops
    assert set(flops) == {"complex64", "bfloat16"} and flops["complex64"] == 2 * flops["bfloat16"]


def test_promote_runs_in_widest_and_scalars_adapt():
    a, b, c, d = (_rand(4, 4, key=k) for k in range(4))
    f = jamp.autocast_transform(lambda a, b, c, d: ((e := a @ b), e + 0.1 * c * d))
    e, out = f(a, b, c, d)
    assert (e.dtype, out.dtype) == (BF16, F32)
    # A rank-0 strong constant created with the traced dtype adapts (jax.nn.gelu builds these).
    g = jamp.autocast_transform(lambda w, x: (x @ w) * np.float32(np.sqrt(2 / np.pi)))
    assert g(a, b).dtype == BF16


def test_gelu_of_matmul_stays_compute_dtype():
    w, x = _rand(8, 8), _rand(4, 8, key=1)
    for approximate in (True, False):
        f = jamp.autocast_transform(lambda w, x: jax.nn.gelu(x @ w, approximate=approximate))
        assert f(w, x).dtype == BF16


def test_other_ops_keep_arriving_dtype_and_user_casts_are_kept():
    x = _rand(4, 4)
    f = jamp.autocast_transform(lambda x: (jnp.tanh(x @ x), (x @ x).astype(F16), x.reshape(16)))
    t, cast, r = f(x)
    assert (t.dtype, cast.dtype, r.dtype) == (BF16, F16, F32)
    ints = jamp.autocast_transform(lambda i: i @ i + 1)(jnp.ones((3, 3), jnp.int32))
    assert ints.dtype == jnp.int32


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_constants_saturate_so_fully_masked_rows_have_no_nan(dtype):
    q, k = _rand(4, 8), _rand(4, 8, key=1)
    mask = np.zeros((4, 4), bool)
    mask[0] = True
    mask = jax.device_put(mask)

    def attention(q, k, mask):
        logits = q @ k.T
        return jax.nn.softmax(jnp.where(mask, logits, jnp.finfo(F32).min))

    out = jamp.autocast_transform(attention, dtype=dtype)(q, k, mask)
    assert jnp.all(jnp.isfinite(out))
    np.testing.assert_allclose(out[1:], 0.25, rtol=1e-6)
    # The masked value is cast once at rewrite time, to the finite minimum of the dtype.
    jaxpr = jax.make_jaxpr(jamp.autocast_transform(attention, dtype=dtype))(q, k, mask)
    literals = [v.val for e in iter_eqns(jaxpr) for v in e.invars if hasattr(v, "val")]
    assert any(np.asarray(v).dtype == dtype and float(v) == float(jnp.finfo(dtype).min)
               for v in literals)


def test_a_python_number_beyond_float16_saturates_in_a_region_as_under_the_transform():
    """jnp converts a Python number to a 16-bit operand's dtype before the region sees the
    operation: ``-1e9`` became ``-inf`` there (a fully masked row NaN) and ``h + 7e4`` inf, where
    the transform saturates its float32 program's constant."""
    q, k = _rand(2, 4), _rand(3, 4, key=1)
    mask = jax.device_put(np.array([[True, True, False],
                                    [False, False, False]]))  # row 1 fully masked

    def attention(q, k, fill):
        return jax.nn.softmax(jnp.where(mask, q @ k.T, fill), axis=-1)

    def region(q, k, fill, shift):
        with jamp.autocast(dtype=F16):
            return attention(q, k, fill), q @ k.T + shift

    for form in (region, jax.jit(region, static_argnums=(2, 3))):
        for fill, shift in ((-1e9, 7e4), (-1.0, 3.0), (-1e9, -7e4)):  # (a replay per value)
            probs, shifted = form(q, k, fill, shift)
            reference = jax.jit(attention)(q, k, fill)
            np.testing.assert_allclose(probs, reference, atol=2e-3)
            expected = np.clip((q @ k.T) + shift, -65504, 65504)
            assert shifted.dtype == F16
            np.testing.assert_allclose(shifted.astype(F32), expected, rtol=2e-3, atol=2e-3)


def test_an_additive_mask_taken_for_a_bias_is_clipped_not_inf():
    """An additive float32 mask (-1e9 where masked) passed as an argument or closed over and
    broadcast over the batch adapts to float16 like a bias; it became -inf and a fully masked
    row NaN, in both forms (eagerly and jitted in a region). Finite values clip to float16's
    range now; inf stays inf (an overflow must still show)."""
    mask = np.zeros((4, 4), np.float32)
    mask[3] = -1e9
    closed_over = mask.copy()

    def attention(q, k, mask):
        return jax.nn.softmax(jnp.einsum("bqd,bkd->bqk", q, k) + mask, axis=-1)

    q = jax.device_put(np.linspace(-1, 1, 2 * 4 * 8, dtype=np.float32).reshape(2, 4, 8))

    def region(q, mask):
        with jamp.autocast(dtype=F16):
            return attention(q, q, mask), attention(q, q, closed_over)

    forms = (jamp.autocast_transform(lambda q, m: (attention(q, q, m),) * 2, dtype=F16),
             region, jax.jit(region))
    for form in forms:
        for out in form(q, mask):
            np.testing.assert_allclose(out[:, 3], 0.25, rtol=1e-3)
    inf_mask = mask.copy()
    inf_mask[0, 0] = -np.inf
    inf_mask = jax.device_put(inf_mask)
    out = jamp.autocast_transform(lambda q, m: jnp.einsum("bqd,bkd->bqk", q, q) + m,
                                  dtype=F16)(q, inf_mask)
    assert out.dtype == F16 and bool(jnp.isneginf(out[:, 0, 0]).all())
    assert bool(jnp.isfinite(out[:, 3]).all())


def test_captured_constants_are_cast_at_rewrite_time_saturating():
    big = np.full((4, 4), 1e6, np.float32)
    f = jamp.autocast_transform(lambda x: x @ big, dtype=F16)
    jaxpr = jax.make_jaxpr(f)(jnp.ones((4, 4)))
    converts = eqns_named(jaxpr, "convert_element_type")
    assert len(converts) == 1  # only the argument; the constant arrives already float16
    assert np.isfinite(np.asarray(jaxpr.consts[0])).all() and jaxpr.consts[0].dtype == F16


def test_cast_cache_converts_a_shared_weight_once():
    w, x = _rand(8, 8), _rand(4, 8, key=1)
    f = jamp.autocast_transform(lambda w, x: (x @ w) @ w + (x @ w))
    jaxpr = jax.make_jaxpr(f)(w, x)
    converted = [e.invars[0] for e in eqns_named(jaxpr, "convert_element_type")]
    assert converted.count(jaxpr.jaxpr.invars[0]) == 1
    assert converted.count(jaxpr.jaxpr.invars[1]) == 1


def test_keep_traced_primitives_see_their_traced_dtypes():
    x = _rand(4, 4)
    f = jamp.autocast_transform(lambda x: lax.bitcast_convert_type(x @ x, jnp.int32))
    with jax.disable_jit():  # bitwise comparison with an eager reference: op by op (no XLA
        out = f(x)           # excess precision for the bf16 product)
    np.testing.assert_array_equal(
        out, lax.bitcast_convert_type((x.astype(BF16) @ x.astype(BF16)).astype(F32), jnp.int32))


@pytest.mark.parametrize("callback", ["pure", "io"])
def test_host_callbacks_get_the_dtypes_they_declared(callback):
    # A host function returning its input's dtype (np.tanh) failed at run time: jamp handed it
    # the bfloat16 matmul output while its declared result (traced from float32) said float32.
    x, w = _rand(8, 4), _rand(4, 4, key=1)
    seen = []

    def host(h):
        seen.append(h.dtype)
        return np.tanh(h)

    def f(a):
        h = a @ w
        shape = jax.ShapeDtypeStruct(h.shape, h.dtype)
        if callback == "pure":
            return jax.pure_callback(host, shape, h)
        return jax.experimental.io_callback(host, shape, h, ordered=True)

    out = jamp.autocast_transform(f)(x)
    assert out.dtype == F32 and seen[-1] == np.float32
    np.testing.assert_allclose(out, np.tanh(x @ w), atol=2e-2)


def test_a_reduce_with_a_computation_of_its_own_runs_in_its_init_values_dtype():
    """lax.reduce / reduce_window with a computation JAX cannot name (max |y|) carry it traced at
    the init value's dtype: a region, which sees the matmul's output bfloat16, failed with JAX's
    "reduce operand dtypes should match corresponding initial value dtypes"."""
    x, w = _rand(2, 4), _rand(4, 4, key=1)

    def absmax(x, w):
        y = x @ w
        rows = lax.reduce(y, jnp.float32(0), lambda a, b: jnp.maximum(jnp.abs(a), jnp.abs(b)),
                          (1,))
        windows = lax.reduce_window(y, jnp.float32(0),
                                    lambda a, b: jnp.maximum(jnp.abs(a), jnp.abs(b)),
                                    (1, 2), (1, 1), "VALID")
        return rows, windows

    def region(x, w):
        with jamp.autocast():
            return absmax(x, w)

    expected = absmax(x.astype(BF16).astype(F32), w.astype(BF16).astype(F32))
    for form in (jamp.autocast_transform(absmax), region, jax.jit(region)):
        for out, want in zip(form(x, w), expected):
            assert out.dtype == F32
            np.testing.assert_allclose(out, want, rtol=1e-2)


def test_typed_operations_keep_the_types_they_declare():
    """On jax 0.12 jnp.ldexp/frexp are typed operations storing their operands' types: rebound on
    a bfloat16 matmul output they declared float32 and returned bfloat16 (an ill-typed program;
    its gradient failed in lax.mul). They run in their traced dtypes now."""
    x, w = _rand(4, 8), _rand(8, 8, key=1)

    def f(x, w):
        mantissa, exponent = jnp.frexp(x @ w)
        return jnp.ldexp((x @ w) ** 2, 2), mantissa, exponent

    t = jamp.autocast_transform(f)
    jamp._compat.check_closed_jaxpr(jax.make_jaxpr(t)(x, w))
    declared = [o.dtype for o in jax.eval_shape(t, x, w)]
    assert [o.dtype for o in t(x, w)] == [o.dtype for o in jax.jit(t)(x, w)] == declared
    grad = jax.grad(lambda x: jnp.sum(t(x, w)[0].astype(F32)))(x)
    assert grad.dtype == F32 and bool(jnp.isfinite(grad).all())


def test_unknown_higher_order_primitive_runs_in_traced_dtypes_and_warns_once(monkeypatch):
    monkeypatch.delitem(interpreter.RULES, "while")
    monkeypatch.setattr(interpreter, "_warned", set())
    f = jamp.autocast_transform(
        lambda w: lax.while_loop(lambda c: c[1] < 2, lambda c: (c[0] @ w, c[1] + 1), (w, 0))[0])
    w = _rand(4, 4)
    with pytest.warns(jamp.UnsupportedPrimitiveWarning, match="`while`"):
        out = f(w)
    assert out.dtype == F32
    np.testing.assert_allclose(out, w @ w @ w, rtol=1e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jamp.autocast_transform(lambda w: lax.while_loop(lambda c: c < 1, lambda c: c + 1, 0))(w)


def test_rewrite_failure_names_primitive_and_source_line(monkeypatch):
    # A failure inside jamp's own code is a RewriteError naming the primitive and user's line.
    monkeypatch.setitem(interpreter.RULES, "tanh", interpreter.RULES["scan"])  # wrong params
    f = jamp.autocast_transform(lambda x: jnp.tanh(x))  # this line is named in the error
    with pytest.raises(jamp.RewriteError, match=r"`tanh`.*test_interpreter.py:\d+.*KeyError"):
        f(jnp.ones(3))


def _jamp_notes(err):
    return [n for n in getattr(err, "__notes__", []) if "jamp" in n]  # JAX adds its own


def test_exceptions_from_user_code_keep_their_type(monkeypatch):
    # Raised by the user's code (here a rule outside jamp) or by JAX: the type is kept, so
    # `except NotImplementedError:` still fires; a note names the primitive and the line.
    def broken(step):
        raise NotImplementedError("boom")
    monkeypatch.setitem(interpreter.RULES, "tanh", interpreter.PrimitiveRules(rewrite=broken))
    f = jamp.autocast_transform(lambda x: jnp.tanh(x))  # this line is named in the note
    with pytest.raises(NotImplementedError, match="boom") as info:
        jax.jit(f)(jnp.ones(3))
    assert not isinstance(info.value, jamp.RewriteError)
    notes = _jamp_notes(info.value)
    assert len(notes) == 1 and re.search(r"`tanh`.*test_interpreter.py:\d+", notes[0])
    nested = jamp.autocast_transform(lambda x: lax.cond(x.sum() > 0, jnp.tanh, jnp.sin, x))
    with pytest.raises(NotImplementedError) as info:
        nested(jnp.ones(3))
    notes = _jamp_notes(info.value)
    assert len(notes) == 1 and "`tanh`" in notes[0]  # the innermost equation, once


def test_custom_jvp_rule_exceptions_propagate_unchanged():
    @jax.custom_jvp
    def f(x):
        return jnp.sin(x)

    @f.defjvp
    def f_jvp(primals, tangents):
        raise NotImplementedError("no derivative here")

    g = jamp.autocast_transform(lambda x: f(x) * 2.0, jamp.Policy(F32))
    try:  # what a caller falling back to another path writes
        jax.grad(g)(1.0)
    except NotImplementedError as err:
        assert "no derivative here" in str(err)
    else:
        pytest.fail("NotImplementedError did not propagate")


def test_scatters_equalize_operands_and_rebuild_their_combiner():
    x = _rand(4, 4)

    def scatters(x):
        return (
            (x @ x).at[0].add(1.0),          # weak scalar update adapts: bf16
            (x @ x).at[0].set(x[0]),         # f32 update: promoted to f32
            (x @ x).at[:, 1].max(x[0]),
            (x @ x).at[0].apply(jnp.sin),    # user combiner: traced dtypes
        )

    f = jamp.autocast_transform(scatters)
    outs = f(x)
    assert [o.dtype for o in outs] == [BF16, F32, F32, F32]
    ref = jax.jit(scatters)(x)
    for got, want in zip(outs, ref):
        np.testing.assert_allclose(got.astype(F32), want, rtol=2e-2, atol=2e-2)
    jax.jit(f)(x)  # lowers (a combiner traced for float32 would not)


def test_a_scatter_into_a_fresh_buffer_keeps_the_buffers_dtype_in_both_forms():
    """``jnp.zeros(...).at[i].add(u)`` with ``u`` a matmul's bfloat16 output: the zeros are a
    broadcast scalar, which adapts elsewhere, but here they are the result's storage: float32,
    as JAX's ``.at`` and the region form keep it (the transform made it bfloat16, and 256
    duplicates of an index summed in bfloat16)."""
    x, w = _rand(256, 8), _rand(8, 8)
    idx = jax.device_put(np.zeros(256, np.int32))

    def f(x, w):
        return jnp.zeros((4, 8)).at[idx].add(x @ w), jnp.zeros_like(x).at[idx].set(x @ w)

    def in_region(x, w):
        with jamp.autocast():
            return f(x, w)

    want = jax.jit(f)(x, w)
    for form in (jamp.autocast_transform(f), in_region, jax.jit(in_region)):
        summed, stored = form(x, w)
        assert (summed.dtype, stored.dtype) == (F32, F32), form
        np.testing.assert_allclose(summed, want[0], rtol=2e-2, atol=0.05)


def test_a_scatter_of_typed_prng_keys_runs_as_traced_in_both_forms():
    """``keys.at[i].set(key)`` of typed keys (``jax.random.key``): a scatter of an extended
    dtype, which no policy casts. The transform's scatter rule asked numpy for the keys' dtype
    and raised "Cannot interpret 'key<fry>' as a data type" (JAX's random_test under an
    identity policy); it now runs as traced, as the region form did, eager and jitted."""
    keys, key = jax.random.split(jax.random.key(123), 3), jax.random.key(7)

    def set_keys(keys, key):
        return keys.at[0].set(key), keys.at[np.array([False, True, True])].set(key)

    def in_region(keys, key):
        with jamp.autocast():
            return set_keys(keys, key)

    want = [jax.random.key_data(k) for k in set_keys(keys, key)]
    transformed = jamp.autocast_transform(set_keys)
    for form in (transformed, jax.jit(transformed), in_region, jax.jit(in_region)):
        got = form(keys, key)
        assert [k.dtype for k in got] == [keys.dtype, keys.dtype], form
        for k, w in zip(got, want):
            np.testing.assert_array_equal(jax.random.key_data(k), w)


def test_a_float32_contraction_of_16_bit_operands_differs_between_the_forms_as_documented():
    """docs/reference/dtypes.md, "Regions": a region sees bfloat16 operands with
    ``preferred_element_type=float32`` and keeps the request; the transform sees float32
    operands, where the request is no different from the default, and lowers."""
    x, w = _rand(4, 8), _rand(8, 8)

    def f(x, w):
        q = x @ w
        return jnp.einsum("td,sd->ts", q, q, preferred_element_type=jnp.float32)

    with jamp.autocast():
        in_region = f(x, w)
    assert (in_region.dtype, jamp.autocast_transform(f)(x, w).dtype) == (F32, BF16)


def test_an_integer_or_bool_mask_differs_between_the_forms_as_documented():
    x, w = _rand(8, 4), _rand(4, 4, key=1)
    int_mask, bool_mask = jnp.ones((8, 4), jnp.int32), jnp.ones((8, 4), bool)
    for f in (lambda x: (x @ w) * int_mask, lambda x: (x @ w) * bool_mask,
              lambda x: jnp.where(bool_mask, x @ w, int_mask)):
        with jamp.autocast():
            assert f(x).dtype == BF16
        assert jamp.autocast_transform(f)(x).dtype == F32


def test_float32_updates_into_a_16_bit_buffer_differ_between_the_forms_as_documented():
    """docs/reference/dtypes.md, "Regions": in a region jnp's ``.at`` casts float32 updates to
    the buffer the policy made bfloat16 (JAX's FutureWarning says so); the transform sees a
    float32 scatter and promotes."""
    x = _rand(4, 4)

    def f(x):
        return (x @ x).at[0].set(x[0])

    with pytest.warns(FutureWarning, match="scatter inputs have incompatible types"):
        with jamp.autocast():
            in_region = f(x)
    assert (in_region.dtype, jamp.autocast_transform(f)(x).dtype) == (BF16, F32)


@pytest.mark.parametrize("name,fn", [
    ("random", lambda x: jax.random.normal(jax.random.PRNGKey(0), (4,)) * (x @ x)),
    ("solve", lambda x: jnp.linalg.solve(x @ x.T + 3 * jnp.eye(4), x[0])),
    ("fft", lambda x: jnp.abs(jnp.fft.rfft(x @ x))),
    ("max_pool_grad", lambda x: jax.grad(
        lambda y: jnp.max((y @ y).reshape(2, 2, 2, 2), axis=(1, 3)).astype(F32).sum())(x)),
    ("sort_topk", lambda x: (jnp.sort(x @ x), lax.top_k(x @ x, 2)[0])),
])
def test_common_ops_rewrite_without_warnings_and_match(name, fn):
    x = _rand(4, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = jamp.autocast_transform(fn)(x)
        jitted = jax.jit(jamp.autocast_transform(fn))(x)
    want = jax.jit(fn)(x)
    for g, j, w in zip(jax.tree.leaves(got), jax.tree.leaves(jitted), jax.tree.leaves(want)):
        assert g.dtype == j.dtype
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   rtol=5e-2, atol=5e-2)


def test_bias_add_after_matmul_or_conv_is_part_of_the_lower_op():
    import flax.linen as nn
    for module, shape in ((nn.Dense(6), (3, 4)), (nn.Conv(4, (3, 3)), (1, 6, 6, 3))):
        x = _rand(*shape)
        params = module.init(jax.random.PRNGKey(0), x)
        assert jamp.autocast_transform(module.apply)(params, x).dtype == BF16
        hand = jax.jit(module.clone(dtype=BF16).apply)(params, x)
        np.testing.assert_allclose(jamp.autocast_transform(module.apply)(params, x).astype(F32),
                                   hand.astype(F32), rtol=2e-2, atol=2e-2)
    # A full-size float32 operand is not a bias: it still promotes, whatever its rank.
    a, c = _rand(4, 4), _rand(4, 4, key=1)
    assert jamp.autocast_transform(lambda a, c: a @ a + c)(a, c).dtype == F32
    v, b = _rand(8), _rand(8, 16, key=2)
    f = lambda a, b, c, d: a @ b + 0.1 * c * d
    assert jamp.autocast_transform(f)(v, b, _rand(16), _rand(16)).dtype == F32
    # vmap in either order agrees for a residual add.
    g = lambda x, w, r: x @ w + r
    x, w, r = _rand(4, 16), _rand(16, 16, key=3), _rand(4, 16, key=4)
    assert jamp.autocast_transform(jax.vmap(g, (0, None, 0)))(x, w, r).dtype == F32
    assert jax.vmap(jamp.autocast_transform(g), (0, None, 0))(x, w, r).dtype == F32


PIECES_OF_PARAMETERS = {  # a fused bias split, sliced or joined is a bias still
    "concatenated": lambda x, w, b: x @ w + jnp.concatenate([b[:8], b[8:]]).reshape(1, -1),
    "sliced": lambda x, w, b: x @ w[:, :8] + b[:8],
    "joined to a constant": lambda x, w, b: x @ w + jnp.concatenate([b[:8], jnp.zeros(8)]),
    "split": lambda x, w, b: sum(x @ wi + bi for wi, bi in zip(jnp.split(w, 2, axis=1),
                                                             jnp.split(b, 2))),
}


@pytest.mark.parametrize("form", ["transform", "region"])
@pytest.mark.parametrize("piece", PIECES_OF_PARAMETERS)
def test_a_bias_made_of_pieces_of_parameters_is_a_bias(piece, form):
    """Flax's OptimizedLSTMCell concatenates its four gates' biases: the bias add promoted, so
    its gates ran in float32 where hand-written bfloat16 (and torch's lstm_cell) run bfloat16."""
    fn, args = PIECES_OF_PARAMETERS[piece], (_rand(2, 8), _rand(8, 16, key=1), _rand(16, key=2))
    if form == "transform":
        out = jamp.autocast_transform(fn)(*args)
    else:
        with jamp.autocast():
            out = fn(*args)
    assert out.dtype == BF16
    np.testing.assert_allclose(out.astype(F32), fn(*args), rtol=2e-2, atol=5e-2)


@pytest.mark.parametrize("form", ["transform", "region"])
def test_a_parameter_joined_to_a_computed_value_is_no_bias(form):
    fn = lambda x, w, b: x @ w + jnp.concatenate([b[:8], jnp.tanh(x[0, :8])])  # noqa: E731
    args = (_rand(2, 8), _rand(8, 16, key=1), _rand(16, key=2))
    if form == "transform":
        out = jamp.autocast_transform(fn)(*args)
    else:
        with jamp.autocast():
            out = fn(*args)
    assert out.dtype == F32


def in_form(fn, form):
    """``fn`` under ``autocast_transform`` or in a region (``form``)."""
    return jamp.autocast_transform(fn) if form == "transform" else in_region(fn)


@pytest.mark.parametrize("form", ["transform", "region"])
def test_a_16_bit_checkpoint_run_by_float32_code_keeps_its_bias_add_in_the_compute_dtype(form):
    """bfloat16 parameters (``param_dtype=``, or a checkpoint cast to save memory) in a float32
    model: Flax promotes the bias to float32 before the add, and the promoted bias was no
    parameter to the bias-add rule, so every layer returned float32, where the same layer with
    float32 parameters (and torch's linear of bfloat16 weights) returns the compute dtype."""
    import flax.linen as nn
    for module, shape in (
        (nn.Dense(6, param_dtype=BF16), (3, 4)),
        (nn.Conv(4, (3, 3), param_dtype=BF16), (1, 6, 6, 3)),
    ):
        x = _rand(*shape)
        params = module.init(jax.random.PRNGKey(0), x)
        out = in_form(module.apply, form)(params, x)
        assert out.dtype == BF16
        hand = module.clone(dtype=BF16).apply(params, x)
        np.testing.assert_allclose(out.astype(F32), hand.astype(F32), rtol=2e-2, atol=2e-2)

    def haiku_linear(w, b, x):  # (hk.Linear: the bias broadcast first, then jnp promotes it)
        out = jnp.dot(x, w)
        return out + jnp.broadcast_to(b, out.shape)

    w, b, x = _rand(4, 6, dtype=BF16), _rand(6, dtype=BF16, key=1), _rand(3, 4, key=2)
    assert in_form(haiku_linear, form)(w, b, x).dtype == BF16


def test_optimized_lstm_cell_gates_run_in_bfloat16():
    import flax.linen as nn
    cell = nn.OptimizedLSTMCell(16)
    x = _rand(4, 8)
    carry = cell.initialize_carry(jax.random.PRNGKey(0), x.shape)
    variables = cell.init(jax.random.PRNGKey(1), carry, x)
    closed = jax.make_jaxpr(jamp.autocast_transform(cell.apply))(variables, carry, x)
    gates = [e.outvars[0].aval.dtype for e in closed.jaxpr.eqns
             if e.primitive.name in ("logistic", "tanh")]
    assert gates and BF16 in gates  # the gates on the matmul's output (the carry's tanh: float32)
    assert sum(d == F32 for d in gates) <= 1


def test_broadcast_scalars_keep_adapting_inside_jitted_callees():
    # jnp code often broadcasts a scalar and passes it to a jitted helper (`_where`).
    where = jax.jit(lambda m, a, b: jnp.where(m, a, b))
    f = lambda x: where(x > 0, x @ x, jnp.broadcast_to(np.float32(2.0), (4, 4)))
    assert jamp.autocast_transform(f)(_rand(4, 4)).dtype == BF16


# Issue 11 item 5: a layer's output dtype must not depend on sizes that happen to coincide
# (a batch of one made the bias "as large as the output" and the add promoted to float32).
from hypothesis import given, settings, strategies as st  # noqa: E402

from tests.hypothesis_profiles import examples  # noqa: E402


@settings(max_examples=examples(12), deadline=None)
@given(batch=st.lists(st.integers(1, 3), min_size=1, max_size=3), features=st.integers(1, 5),
       out=st.integers(1, 5))
def test_dense_output_dtype_is_independent_of_batch_shape(batch, features, out):
    import flax.linen as nn
    dense = nn.Dense(out)
    x = _rand(*batch, features)
    params = dense.init(KEY, x)
    y = jamp.autocast_transform(dense.apply)(params, x)
    assert y.dtype == BF16 and y.shape == (*batch, out)
    hand = jax.jit(dense.clone(dtype=BF16).apply)(params, x)
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(hand, np.float32),
                               rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("spatial", [1, 3])
def test_conv_output_dtype_is_independent_of_batch_and_spatial_size(batch, spatial):
    import flax.linen as nn
    conv = nn.Conv(4, (3, 3))
    x = _rand(batch, spatial, spatial, 2)
    params = conv.init(KEY, x)
    assert jamp.autocast_transform(conv.apply)(params, x).dtype == BF16


def test_a_full_size_input_of_batch_one_is_still_a_residual():
    x, w = _rand(1, 4), _rand(4, 4, key=1)
    assert jamp.autocast_transform(lambda x, w: x @ w + x)(x, w).dtype == F32
    # ... and a parameter reshaped rather than broadcast ((4,) -> (2, 2)) is not spread over a batch
    v = _rand(4, key=2)
    assert jamp.autocast_transform(lambda y, w, v: y @ w + v.reshape(2, 2))(
        _rand(2, 2), _rand(2, 2, key=3), v).dtype == F32


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_strict_dtype_promotion_leaves_jamps_own_casts_working(dtype):
    # jamp's casts are explicit: a caller's jax.numpy_dtype_promotion("strict") must not reject
    # the promotion of a bf16 matmul output with a float32 residual, nor the lower rule.
    x, w = _rand(4, 8), _rand(8, 8)

    def block(x, w):
        h = x @ w + x[:, :8]                                  # add: bf16 with a float32 residual
        h = lax.dot_general(h, w, (((1,), (0,)), ((), ())), preferred_element_type=F32)
        return jnp.where(h > 0, h, jnp.finfo(F32).min).max(axis=-1) + jnp.exp(h).sum(axis=-1)

    def runs():  # a new transform each time: nothing cached from the other promotion mode
        f = jamp.autocast_transform(block, dtype=dtype)
        return f, jax.jit(f)

    refs = [run(x, w) for run in runs()]  # standard promotion
    with jax.numpy_dtype_promotion("strict"):
        f = runs()[0]
        for run, ref in zip(runs(), refs):
            out = run(x, w)
            assert out.dtype == ref.dtype == F32
            np.testing.assert_array_equal(out, ref)
        grads = jax.grad(lambda w: f(x, w).sum())(w)
        assert grads.dtype == F32 and np.isfinite(grads).all()
        # The user's own implicit promotions stay as strict as they asked.
        with pytest.raises(jax.dtypes.TypePromotionError):
            jamp.autocast_transform(lambda x: x + x.astype(BF16))(x)


def test_widest_follows_the_x64_flag_after_a_cached_answer():
    # widest() is cached; float32 with float64 promotes to float32 with x64 off, float64 on.
    from jamp.interpreter import widest

    f32, f64 = np.dtype(np.float32), np.dtype(np.float64)
    before = jax.config.jax_enable_x64
    try:
        jax.config.update("jax_enable_x64", False)
        assert widest(f32, f64) == f32
        jax.config.update("jax_enable_x64", True)
        assert widest(f32, f64) == f64
    finally:
        jax.config.update("jax_enable_x64", before)
