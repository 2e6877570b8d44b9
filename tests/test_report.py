"""jamp.explain: counts on a known function."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jamp


def _known(a, b, c):
    e = a @ b                                  # bf16 dot, 2*4*16*8 = 1024 FLOPs
    with jamp.autocast(enabled=False):
        g = e @ c                              # f32 dot (region), 2*4*2*16 = 256 FLOPs
    return jnp.sum(jnp.exp(e)) + jnp.sum(g), jnp.tanh(e)


ARGS = (jnp.ones((4, 8)), jnp.ones((8, 16)), jnp.ones((16, 2)))


def test_counts_flops_and_reasons_on_a_known_function():
    report = jamp.explain(_known, *ARGS)
    assert report.ops["dot_general"] == {"bfloat16": 1, "float32": 1}
    assert report.ops["exp"] == {"float32": 1}
    assert report.ops["tanh"] == {"bfloat16": 1}
    assert report.ops["reduce_sum"] == {"float32": 2}
    assert report.flops == {"bfloat16": 1024, "float32": 256}
    assert report.low_precision_flop_share == pytest.approx(0.8)
    # a and b cast to bf16; e cast up for the region's f32 dot, which also feeds exp (cached).
    assert report.casts == 3
    assert report.float32_reasons[("dot_general", "region")] == 1
    assert report.float32_reasons[("exp", "fp32 table")] == 1
    assert report.float32_reasons[("add", "inputs arrived in float32")] == 1
    text = str(report)
    assert "dot_general" in text and "80.0%" in text and "region" in text


def test_a_square_is_float32_by_the_table_only_where_it_is_summed():
    """An unsummed square of a float32 value runs in the dtype it arrives in (docs/reference/
    dtypes.md, Squares): explain gave the fp32 table as the reason all the same."""
    x = jnp.ones((4, 4))
    report = jamp.explain(lambda x: (jnp.tanh(x) + x ** 3, jnp.sum(x ** 2)), x)
    assert report.float32_reasons[("integer_pow", "inputs arrived in float32")] == 1  # x ** 3
    assert report.float32_reasons[("integer_pow", "fp32 table")] == 1  # x ** 2, summed


def test_rules_float64_and_accumulate_reasons():
    policy = jamp.Policy(rules=(("head", None),), accumulate_dtype=jnp.float32)

    def f(a, b):
        with jax.named_scope("head"):
            h = a @ b
        return a @ b, h
    report = jamp.explain(f, *ARGS[:2], policy=policy)
    assert report.float32_reasons[("dot_general", "rule 'head'")] == 1
    assert report.float32_reasons[("dot_general", "accumulate_dtype")] == 1
    with jax.enable_x64(True):
        x = jnp.ones((3, 3), jnp.float64)
        assert jamp.explain(lambda x: x @ x, x).float32_reasons == {("dot_general", "float64"): 1}


def test_loop_bodies_and_calls_are_counted_once_each_and_nothing_runs():
    calls = []

    def f(w, xs):
        calls.append(1)
        return jax.lax.scan(lambda h, x: (jnp.tanh(h @ w + x), None), jnp.zeros(8), xs)[0]
    report = jamp.explain(f, jnp.ones((8, 8)), jnp.ones((5, 8)))
    assert report.calls == {"scan": 1}
    assert report.ops["dot_general"] == {"bfloat16": 1}
    assert len(calls) == 1
    with pytest.raises(TypeError, match="callable"):
        jamp.explain(3)


@pytest.mark.parametrize("mask_first", [True, False])
def test_an_integer_mask_matmul_counts_in_the_dtype_it_computes_in(mask_first):
    """BERT's head mask: an int32 mask einsum with bfloat16 activations is a bfloat16 matmul."""
    def masked(x, w, mask):
        h = x @ w                                               # 2*4*8*16*16 = 16384 FLOPs
        spec = "bs,bsd->bd" if mask_first else "bsd,bs->bd"
        operands = (mask, h) if mask_first else (h, mask)
        return jnp.einsum(spec, *operands)                      # 2*4*16*8 = 1024 FLOPs

    report = jamp.explain(masked, jnp.ones((4, 8, 16)), jnp.ones((16, 16)),
                          jnp.ones((4, 8), jnp.int32))
    assert "int32" not in report.flops
    assert report.flops == {"bfloat16": 16384 + 1024}
    assert report.low_precision_flop_share == 1.0


def test_an_integer_only_matmul_counts_as_integer():
    report = jamp.explain(lambda a, b: a @ b, jnp.ones((4, 8), jnp.int32),
                          jnp.ones((8, 2), jnp.int32))
    assert report.flops == {"int32": 2 * 4 * 2 * 8}
    assert report.low_precision_flop_share == 0.0


@pytest.mark.parametrize("compiled", [False, True])
def test_shape_dtype_structs_are_explained_at_their_shapes_and_dtypes(compiled):
    """explain's docstring says to pass jax.ShapeDtypeStructs: they reached the function as they
    were (``TypeError: unsupported operand type(s) for @: 'ShapeDtypeStruct'``)."""
    def loss(params, x):
        return jnp.mean(jnp.tanh(x @ params["w"]) ** 2)

    structs = ({"w": jax.ShapeDtypeStruct((16, 8), jnp.float32)},
               jax.ShapeDtypeStruct((4, 16), jnp.bfloat16))
    arrays = ({"w": jnp.ones((16, 8))}, jnp.ones((4, 16), jnp.bfloat16))
    got = jamp.explain(jax.grad(loss), *structs, compiled=compiled)
    want = jamp.explain(jax.grad(loss), *arrays, compiled=compiled)
    assert got.ops == want.ops and got.flops == want.flops and got.casts == want.casts
    assert got.flops == {"bfloat16": 2 * 2 * 4 * 16 * 8}  # forward, and the gradient of w
    # also as a keyword argument, beside arrays
    assert jamp.explain(loss, arrays[0], x=structs[1], compiled=compiled).ops == \
        jamp.explain(loss, arrays[0], x=arrays[1], compiled=compiled).ops
    if compiled:
        assert got.collectives.devices == 1


def test_a_shape_dtype_struct_of_keys_is_named():
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
    with pytest.raises(TypeError, match=r"argument rng is a jax.ShapeDtypeStruct of key"):
        jamp.explain(lambda x, rng: x * jax.random.normal(rng), jnp.ones(3), rng=key)


def test_matmuls_in_a_scan_count_once_per_iteration():
    """A scan-over-layers body's matmuls were counted once, not ``length`` times: explain's FLOP
    shares (and jamp.tune's costs) were skewed against the common transformer layout."""
    def stack(ws, head, x):
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)
        with jamp.autocast(enabled=False):
            return h @ head

    ws, head, x = jnp.ones((16, 8, 8)) / 8, jnp.ones((8, 32)), jnp.ones((4, 8))
    report = jamp.explain(stack, ws, head, x)
    per_layer, head_flops = 2 * 4 * 8 * 8, 2 * 4 * 8 * 32
    assert report.flops == {"bfloat16": 16 * per_layer, "float32": head_flops}
    assert report.low_precision_flop_share == 16 * per_layer / (16 * per_layer + head_flops)


@pytest.mark.parametrize(
    ("start", "test", "step", "trips"),
    [(0, lambda i: i < 10, 1, 10), (0, lambda i: i < 10, 3, 4), (1, lambda i: i <= 9, 2, 5),
     (10, lambda i: i > 0, -1, 10), (7, lambda i: i >= 1, -3, 3), (0, lambda i: i != 6, 2, 3),
     (5, lambda i: i < 5, 1, 0)],
)
def test_a_while_loop_of_known_length_counts_its_body_per_iteration(start, test, step, trips):
    """A ``while_loop`` whose counter runs from a literal to a literal bound counts its body's
    matmuls once per iteration, as a scan's: the same loop written either way gave FLOP shares
    of 0.909 and 0.500; casts back into the carry count as casts inserted."""
    def loop(w, x):
        def body(carry):
            i, h = carry
            return i + step, jnp.tanh(h @ w)

        h = jax.lax.while_loop(lambda c: test(c[0]), body, (start, x))[1]
        with jamp.autocast(enabled=False):
            return h @ w

    w, x = jnp.ones((8, 8)) / 8, jnp.ones((4, 8))
    report = jamp.explain(loop, w, x)
    one = 2 * 4 * 8 * 8
    assert report.flops == {"bfloat16": trips * one, "float32": one}
    assert report.loops_of_unknown_length == 0
    converts = str(jax.make_jaxpr(jamp.autocast_transform(loop))(w, x)).count(
        "convert_element_type"
    )
    assert report.casts == converts


def test_a_while_loop_of_traced_length_is_counted_once_and_said_so():
    def loop(w, x, n):
        return jax.lax.fori_loop(0, n, lambda i, h: jnp.tanh(h @ w), x)

    report = jamp.explain(loop, jnp.ones((8, 8)), jnp.ones((4, 8)), 10)
    assert report.flops == {"bfloat16": 2 * 4 * 8 * 8}
    assert report.loops_of_unknown_length == 1
    assert "counting 1 while loop(s) of unknown length once" in str(report)
