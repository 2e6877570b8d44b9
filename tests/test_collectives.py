"""Policy.reduce_dtype and the collective report (jamp/reduce_dtype.py, jamp/collectives.py,
jamp/hlo.py). The dtypes that cross between devices are checked on 8 host devices in a
subprocess (tests/collective_checks.py); here, on one device: the backward products' dtypes in
the program, gradients' dtypes and values, errors, and the HLO reader on hand-written text."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jamp
from jamp import collectives, hlo
from tests.check_modules import run_check_module
from tests.host_data import linspace
from tests.jaxpr_utils import eqns_named

F32, BF16 = np.dtype(jnp.float32), np.dtype(jnp.bfloat16)
REDUCE_F32 = jamp.Policy(reduce_dtype=jnp.float32)


def grad(fn):
    """Gradient with respect to the parameters and the input: both backward products."""
    return jax.grad(fn, argnums=(0, 1))


@pytest.mark.slow  # one device: test_backward_products_*, test_report_read_from_hand_written_hlo
def test_eight_devices_partitioned_program():
    run_check_module("collective_checks", "collective checks passed")


def _loss(params, x):
    return jnp.mean(jnp.tanh(x @ params["w"]) ** 2)


def _conv_loss(params, x):
    y = jax.lax.conv_general_dilated(x, params["w"], (2, 1), "SAME",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                     feature_group_count=2)
    return jnp.mean(y ** 2)


def _backward_products(fn, *args):
    """(operand dtypes, output dtype) of the products of a gradient's program that have a
    16-bit operand."""
    found = []
    for name in ("dot_general", "conv_general_dilated"):
        for eqn in eqns_named(jax.make_jaxpr(fn)(*args), name):
            operands = tuple(v.aval.dtype.name for v in eqn.invars)
            if "bfloat16" in operands:
                found.append((operands, eqn.outvars[0].aval.dtype.name))
    return found


# Built on the host and transferred (tests/host_data.py): jnp.linspace compiles.
_DENSE = ({"w": jax.device_put(np.full((4, 3), 0.5, np.float32))}, linspace(-1, 1, 8, 4))
_CONV = ({"w": linspace(-1, 1, 3, 3, 2, 4)}, linspace(-1, 1, 2, 5, 5, 4))


@pytest.mark.parametrize("loss, args", [(_loss, _DENSE), (_conv_loss, _CONV)],
                         ids=["dot", "conv"])
def test_backward_products_accumulate_in_reduce_dtype(loss, args):
    plain = _backward_products(grad(jamp.autocast_transform(loss)), *args)
    wide = _backward_products(grad(jamp.autocast_transform(loss, REDUCE_F32)), *args)
    # forward product, then the two backward ones (cotangents of the input and the weight)
    assert [out for _, out in plain] == ["bfloat16"] * 3
    assert [out for _, out in wide] == ["bfloat16", "float32", "float32"]
    assert all(ops == ("bfloat16", "bfloat16") for ops, _ in wide)  # 16-bit operands still
    exact = jax.jit(grad(loss))(*args)  # (eagerly: a program per operation)
    grads = grad(jamp.autocast_transform(loss, REDUCE_F32))(*args)
    chex.assert_trees_all_equal_dtypes(grads, exact)
    chex.assert_trees_all_close(grads, exact, rtol=5e-2, atol=5e-3)
    # the same rounding of operands: only the cotangents' accumulation differs
    rounded = grad(jamp.autocast_transform(loss))(*args)
    chex.assert_trees_all_close(grads, rounded, rtol=5e-2, atol=5e-3)


def test_region_float8_scan_and_transform_of_grad():
    params, x = _DENSE

    def region(params, x):
        with jamp.autocast(REDUCE_F32):
            return _loss(params, x)

    wide = _backward_products(grad(region), params, x)
    assert sorted(out for _, out in wide) == ["bfloat16", "float32", "float32"]
    assert grad(region)(params, x)[0]["w"].dtype == F32
    # autocast_transform(grad(f)): the backward products are the program's own equations
    wide = _backward_products(jamp.autocast_transform(grad(_loss), REDUCE_F32), params, x)
    assert sorted(out for _, out in wide) == ["bfloat16", "float32", "float32"]

    def scanned(ws, x):
        return jnp.mean(jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0] ** 2)

    ws = jax.device_put(np.full((2, 4, 4), 0.3, np.float32))
    for fn in (grad(jamp.autocast_transform(scanned, REDUCE_F32)),
               jamp.autocast_transform(grad(scanned), REDUCE_F32)):
        wide = _backward_products(fn, ws, x)
        assert sorted(out for _, out in wide) == ["bfloat16", "float32", "float32"], wide
        assert all(g.dtype == F32 for g in fn(ws, x))
    # float8: the backward products of the scaled dot output float32
    fp8 = jamp.Policy(jnp.float8_e4m3fn, min_float8_flops=0, reduce_dtype=jnp.float32)
    outs = [e.outvars[0].aval.dtype for e in eqns_named(
        jax.make_jaxpr(grad(jamp.autocast_transform(_loss, fp8)))(params, x), "dot_general")]
    assert outs.count(F32) == 2 and outs.count(BF16) == 1, outs
    grads = grad(jamp.autocast_transform(_loss, fp8))(params, x)
    assert grads[0]["w"].dtype == F32 and bool(jnp.all(jnp.isfinite(grads[0]["w"])))


def test_transform_of_grad_of_a_whole_loss_in_a_shard_map():
    # The transposed shard_map's body carries no transpose name and received jax.grad's seed
    # directly: reduce_dtype did nothing there (and float8 scaled its cotangent to e4m3fn).
    params, x = _DENSE
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    spec = jax.sharding.PartitionSpec
    sharded = jax.shard_map(lambda p, x: jax.lax.pmean(_loss(p, x), "data"), mesh=mesh,
                            in_specs=(spec(), spec("data")), out_specs=spec())
    for policy, expected in ((jamp.Policy(), ["bfloat16"] * 3),
                             (REDUCE_F32, ["bfloat16", "float32", "float32"])):
        fn = jamp.autocast_transform(grad(sharded), policy)
        assert [out for _, out in _backward_products(fn, params, x)] == expected
    fp8 = jamp.Policy(jnp.float8_e4m3fn, min_float8_flops=0)
    program = jax.make_jaxpr(jamp.autocast_transform(grad(sharded), fp8))(params, x)
    assert "float8_e5m2" in str(program)  # the gradient format, for the cotangent
    # A constant a forward product also reads (jnp.eye) is no seed: that product stays forward.
    eye_loss = lambda p, x: jnp.mean(jnp.tanh(x @ p["w"] @ jnp.eye(3)) ** 2)  # noqa: E731
    products = _backward_products(jamp.autocast_transform(grad(eye_loss), REDUCE_F32), params, x)
    assert sorted(out for _, out in products).count("bfloat16") == 2, products


def test_a_matmul_reading_updated_parameters_is_a_forward_one():
    # A train step that reads its updated weights (eval after update, an inner loop): w - lr*g
    # is a primal, so its matmul is not a backward product (neither widened by reduce_dtype
    # nor quantized to the gradient format e5m2 under float8).
    def loss(w, x):
        return jnp.sum((x @ w) ** 2)

    def step(w, x, x2):
        w = w - 0.1 * jax.grad(loss)(w, x)
        return x2 @ w

    args = (jnp.ones((4, 4)), jnp.ones((2, 4)), jnp.ones((2, 4)))
    policy = jamp.Policy(jnp.bfloat16, reduce_dtype=jnp.float32)
    assert jamp.autocast_transform(step, policy)(*args).dtype == BF16
    fp8 = jamp.Policy(jnp.float8_e4m3fn, min_float8_flops=0)
    jaxpr = jax.make_jaxpr(jamp.autocast_transform(step, fp8))(*args)
    converts = [np.dtype(e.outvars[0].aval.dtype)
                for e in eqns_named(jaxpr, "convert_element_type")]
    # the gradient's one cotangent product takes e5m2; x @ w, the dgrad's w and x2 @ w_new e4m3fn
    assert converts.count(np.dtype(jnp.float8_e5m2)) == 1
    assert converts.count(np.dtype(jnp.float8_e4m3fn)) == 5


def test_sixteen_bit_params_get_sixteen_bit_grads():
    params = {"w": jnp.ones((4, 3), BF16)}
    grads = jax.grad(jamp.autocast_transform(_loss, REDUCE_F32))(params, _DENSE[1])
    assert grads["w"].dtype == BF16


@pytest.mark.parametrize("bad, match", [
    (jnp.float16, "not at least as wide as the bfloat16"),
    (jnp.int32, "floating dtype"),
    (jnp.float8_e5m2, "float8 is only a compute dtype"),
])
def test_reduce_dtype_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        jamp.Policy(reduce_dtype=bad)


def test_reduce_dtype_repr_and_explain():
    policy = jamp.Policy(jnp.float16, reduce_dtype=jnp.float32)
    assert repr(policy) == "Policy(jnp.float16, reduce_dtype=jnp.float32)"
    assert policy.replace(reduce_dtype=None) == jamp.Policy(jnp.float16)
    assert jamp.Policy(jnp.float8_e4m3fn, reduce_dtype=jnp.bfloat16).reduce_dtype == BF16
    report = jamp.explain(jax.grad(_loss), *_DENSE, policy=policy)
    assert "float32 (Policy.reduce_dtype)" in str(report)


def test_unsharded_compile_reports_one_device():
    report = jamp.explain(jax.grad(_loss), *_DENSE, compiled=True)
    assert report.collectives.devices == 1 and report.collectives.collectives == ()
    assert "one device" in str(report)


_PARTITIONED = """HloModule jit_step, num_partitions=8

FileNames
1 "model.py"

FunctionNames
1 "layer"

FileLocations
1 {file_name_id=1 function_name_id=1 line=12 end_line=12 column=1 end_column=2}

StackFrames
1 {file_location_id=1 parent_frame_id=1}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

%body (carry: (s32[], bf16[2,16])) -> (s32[], bf16[2,16]) {
  %carry = (s32[], bf16[2,16]) parameter(0)
  %w = bf16[2,16]{1,0} get-tuple-element(%carry), index=1
  %gathered = bf16[16,16]{1,0} all-gather(%w), channel_id=1, dimensions={0}, metadata={op_name="jit(step)/while/body/dot_general" stack_frame_id=1}
  %i = s32[] get-tuple-element(%carry), index=0
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %out = (s32[], bf16[2,16]) tuple(%next, %w)
}

%cond (carry.1: (s32[], bf16[2,16])) -> pred[] {
  %carry.1 = (s32[], bf16[2,16]) parameter(0)
  %i.1 = s32[] get-tuple-element(%carry.1), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i.1, %n), direction=LT
}

ENTRY %main (param: f32[2,16], param.1: f32[4,8]) -> f32[4,16] {
  %param = f32[2,16]{1,0} parameter(0), sharding={devices=[8,1]<=[8]}, metadata={op_name="a[0]"}
  %cast = bf16[2,16]{1,0} convert(%param)
  %kernel = bf16[16,16]{1,0} all-gather(%cast), channel_id=2, dimensions={0}, metadata={op_name="jit(step)/dot_general"}
  %param.1 = f32[4,8]{1,0} parameter(1), metadata={op_name="a[1]"}
  %partial = f32[4,16]{1,0} dot(%param.1, %param.1), lhs_contracting_dims={0}, rhs_contracting_dims={0}
  %summed = f32[4,16]{1,0} all-reduce(%partial), channel_id=3, to_apply=%add, metadata={op_name="jit(step)/transpose(jvp(Dense_0))/dot_general"}
  %scattered = f32[1,16]{1,0} reduce-scatter(%partial), channel_id=4, dimensions={0}, to_apply=%add
  %zero = s32[] constant(0)
  %init = (s32[], bf16[2,16]) tuple(%zero, %cast)
  %loop = (s32[], bf16[2,16]) while(%init), condition=%cond, body=%body
  ROOT %r = f32[4,16]{1,0} copy(%summed)
}
"""

_FINAL = """HloModule jit_step
ENTRY %main (p: f32[2,16]) -> f32[4,16] {
  %p = f32[2,16]{1,0} parameter(0)
  %kernel = f32[16,16]{1,0} all-gather(%p), channel_id=2, dimensions={0}
  %g = f32[16,16]{1,0} all-gather(%p), channel_id=1, dimensions={0}
  %summed = (f32[4,16]{1,0}, f32[1,16]{1,0}) all-reduce(%p, %p), channel_id=3, to_apply=%add
  ROOT %s = f32[1,16]{1,0} reduce-scatter(%p), channel_id=4, dimensions={0}, to_apply=%add
}
"""


def test_report_read_from_hand_written_hlo():
    report = collectives.read_collectives(_PARTITIONED, _FINAL, ["params['w']", "batch"])
    assert report.devices == 8
    got = [(c.kind, c.dtype, c.shape, c.runs, c.moves) for c in report.collectives]
    assert sorted(got) == [
        ("all-gather", "bfloat16", (16, 16), 1, "params['w']"),  # through the cast
        ("all-gather", "bfloat16", (16, 16), 4, "while/body/dot_general"),
        ("all-reduce", "float32", (4, 16), 1, "transpose(jvp(Dense_0))/dot_general"),
        ("reduce-scatter", "float32", (1, 16), 1, "scattered"),  # no metadata: its name
    ]
    by_kind = {(c.kind, c.runs): c for c in report.collectives}
    loop = by_kind[("all-gather", 4)]
    assert loop.line == "model.py:12" and loop.bytes == 16 * 16 * 2
    assert loop.backend_dtype == "float32"  # the CPU-style widening is noticed
    assert by_kind[("all-gather", 1)].moves == "params['w']"
    scatter = by_kind[("reduce-scatter", 1)]
    assert scatter.bytes == 4 * 16 * 4 and scatter.elements == 64  # its input, the larger
    assert by_kind[("all-reduce", 1)].backend_dtype is None
    assert report.bytes_by_dtype == {"bfloat16": 16 * 16 * 2 * 5, "float32": 2 * 4 * 16 * 4}
    assert report.bytes_by("all-gather") == {"bfloat16": 16 * 16 * 2 * 5}
    assert "x4" in str(report) and "bytes crossing per call" in str(report)


def test_hlo_reader_loops_and_frames():
    module = hlo.parse(_PARTITIONED)
    assert module.entry == "main"
    assert module.runs("body") == 4 and module.runs("main") == 1
    loop = module.computations["main"]["loop"]
    assert module.trip_count(loop) == 4
    assert module.frames == {"1": "model.py:12"}
    unknown = _PARTITIONED.replace("%n = s32[] constant(4)", "%n = s32[] parameter(1)")
    assert hlo.parse(unknown).runs("body") is None


def _loop(condition, step="1", start="0", counter="s32"):
    """A module whose loop counts from ``start`` by ``step`` while ``condition`` holds, in the
    ``%param#0`` operand syntax newer XLA prints."""
    return f"""HloModule loop
%body (carry: ({counter}[], f32[4])) -> ({counter}[], f32[4]) {{
  %carry = ({counter}[], f32[4]{{0}}) parameter(0)
  %step = {counter}[] constant({step})
  %next = {counter}[] add(%carry#0, %step)
  %sum = f32[4]{{0}} all-reduce(%carry#1), channel_id=1, to_apply=%add
  ROOT %out = ({counter}[], f32[4]{{0}}) tuple(%next, %sum)
}}

%cond (carry.1: ({counter}[], f32[4])) -> pred[] {{
  %carry.1 = ({counter}[], f32[4]{{0}}) parameter(0)
  %bound = {condition}
}}

ENTRY %main (p: f32[4]) -> f32[4] {{
  %p = f32[4]{{0}} parameter(0)
  %start = {counter}[] constant({start})
  %init = ({counter}[], f32[4]{{0}}) tuple(%start, %p)
  %loop = ({counter}[], f32[4]{{0}}) while(%init), condition=%cond, body=%body
  ROOT %r = f32[4]{{0}} get-tuple-element(%loop), index=1
}}
"""


@pytest.mark.parametrize(
    "condition, step, start, runs",
    [
        ("s32[] constant(12)\n  ROOT %lt = pred[] compare(%carry.1#0, %bound), direction=LT",
         "3", "0", 4),  # i = 0, 3, 6, 9: not the bound, 12
        ("s32[] constant(9)\n  ROOT %lt = pred[] compare(%carry.1#0, %bound), direction=LT",
         "1", "2", 7),  # fori_loop(2, 9)
        ("s32[] constant(9)\n  ROOT %le = pred[] compare(%carry.1#0, %bound), direction=LE",
         "1", "2", 8),
        ("s32[] constant(12)\n  ROOT %gt = pred[] compare(%bound, %carry.1#0), direction=GT",
         "5", "0", 3),  # `12 > i`
        ("s32[] constant(0)\n  ROOT %gt = pred[] compare(%carry.1#0, %bound), direction=GT",
         "-2", "7", 4),  # counting down: 7, 5, 3, 1
        ("s32[] constant(12)\n  ROOT %lt = pred[] compare(%carry.1#0, %bound), direction=LT",
         "0", "0", None),  # never steps
        ("s32[] constant(12)\n  ROOT %lt = pred[] compare(%carry.1#0, %bound), direction=LT",
         "-1", "0", None),  # steps away from the bound
        ("s32[] parameter(1)\n  ROOT %lt = pred[] compare(%carry.1#0, %bound), direction=LT",
         "1", "0", None),  # a bound known at run time only
    ],
)
def test_a_loop_runs_as_often_as_its_counter_steps_to_the_bound(condition, step, start, runs):
    """A while's trip count was the constant its condition compared with, whatever the counter
    started at or stepped by: `i < 12` stepping by 3 ran x12, not x4."""
    module = hlo.parse(_loop(condition, step, start))
    assert module.trip_count(module.computations["main"]["loop"]) == runs
    [found] = collectives.read_collectives(_loop(condition, step, start)).collectives
    assert found.runs == runs
    assert (" x?" in str(found)) == (runs is None)


def test_a_float_condition_has_no_trip_count():
    """`while v[0] < 100.0` runs as often as the values say (3 times from 1, squaring): it was
    reported as running 100 times."""
    text = _loop("f32[] constant(100)\n  ROOT %lt = pred[] compare(%carry.1#0, %bound), "
                 "direction=LT", counter="f32", step="1", start="1")
    module = hlo.parse(text)
    assert module.trip_count(module.computations["main"]["loop"]) is None
    report = collectives.read_collectives(text)
    assert report.collectives[0].runs is None
    assert report.bytes_by_dtype == {"float32": 16}  # counted once, as documented
