"""A region decides an operation once per signature and replays that decision (issue 33).

The replay must give exactly what deciding again gives: every test here compares with the
region deciding every operation (``_decide_every_time``), on programs where the decision depends
on more than the operand types (a bias add against a residual add, a softmax's shift, constants).
"""

import functools
import gc
import weakref

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.linen.dtypes import promote_dtype
from jax import lax

import jamp
from jamp import _compat as compat
from jamp import region_trace
from jamp.interpreter import Rewriter
from tests.jaxpr_utils import fresh, iter_eqns

BF16, F16, F32 = (np.dtype(d) for d in (jnp.bfloat16, jnp.float16, jnp.float32))
# Test data made on the host: jax.device_put hands it over as a device array without compiling
# (jnp.asarray of a numpy array, or a jax.random call, compiles a program per shape).
_RNG = np.random.default_rng(0)
X = jax.device_put(_RNG.standard_normal((8, 16), dtype=np.float32))
W = jax.device_put(_RNG.standard_normal((16, 16), dtype=np.float32) * np.float32(0.25))
B = jax.device_put(np.linspace(-1.0, 1.0, 16, dtype=np.float32))


def _decide_every_time(monkeypatch):
    """Every operation decided by its rule, as before issue 33's decisions (jnp's functions
    walked afresh too: their kept rewrites were made while decisions were replayed)."""
    monkeypatch.setattr(region_trace, "_decision_key", lambda *args: None)
    monkeypatch.setattr(region_trace, "_CALLS", {})


def _count_rules(monkeypatch):
    """The primitives whose rule ran, one entry per run."""
    ran = []
    apply = Rewriter.apply

    def counted(self, step):
        if self.region:
            ran.append(step.eqn.primitive.name)
        return apply(self, step)

    monkeypatch.setattr(Rewriter, "apply", counted)
    return ran


def mixed_adds(x, w, b, x16):
    """The same primitive on the same operand types, decided three ways by the operands' tags."""
    with jamp.autocast():
        bias = lax.broadcast_in_dim(b, (x.shape[0], w.shape[1]), (1,))
        lowered = lax.add(lax.dot(x, w), bias)  # a matmul's output: the bias adapts, bf16
        arrived = lax.add(x16, bias)  # the same types, but an input: promotes, f32
        again = lax.add(lax.dot(x * 2, w), bias)  # the first decision again
        with jamp.autocast(enabled=False):
            off = lax.add(lax.dot(x, w), bias)  # autocast off: f32 matmul, f32 add
    return lowered, arrived, again, off


@pytest.mark.parametrize("jit", [False, True])
def test_an_operation_is_decided_by_its_operands_tags_not_only_their_types(monkeypatch, jit):
    run = jax.jit(mixed_adds) if jit else mixed_adds
    args = (X, W, B, jax.device_put(np.asarray(X).astype(BF16)))
    monkeypatch.setattr(region_trace, "_DECISIONS", {})  # (none kept from other tests)
    ran = _count_rules(monkeypatch)
    outs = run(*args)
    assert [np.dtype(o.dtype) for o in outs] == [BF16, F32, BF16, F32]
    assert ran.count("dot_general") == 2  # on and off; the third matmul replays the first
    ran.clear()
    # a new trace (eagerly: the same code again) replays them all
    (jax.jit(lambda *a: mixed_adds(*a)) if jit else mixed_adds)(*args)
    assert "add" not in ran and "dot_general" not in ran
    with monkeypatch.context() as m:
        _decide_every_time(m)
        chex.assert_trees_all_close(
            (jax.jit(fresh(mixed_adds)) if jit else mixed_adds)(*args), outs
        )


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, train):
        h = nn.LayerNorm()(x)
        h = nn.Dense(16)(h)
        h = nn.BatchNorm(use_running_average=not train)(h)
        h = jax.nn.gelu(h) + x
        logits = nn.Dense(16)(h)
        return jax.nn.log_softmax(logits), jnp.mean(h**2)


@functools.cache
def block_variables():
    """Block's variables for X, initialised in one program (not op by op), shared by the tests."""
    return jax.jit(Block().init, static_argnums=2)(jax.random.PRNGKey(2), X, False)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_replayed_decisions_give_the_program_deciding_every_operation_gives(monkeypatch, dtype):
    model = Block()
    variables = block_variables()

    def forward(v, x):
        with jamp.autocast(dtype=dtype):
            return model.apply(v, x, True, mutable=["batch_stats"])

    def loss(v, x):
        with jamp.autocast(dtype=dtype):
            (logp, square), _ = model.apply(v, x, True, mutable=["batch_stats"])
        return -logp.astype(jnp.float32).mean() + square

    programs = [(forward, (variables, X)), (jax.grad(loss), (variables, X))]
    # (a new function object every time: make_jaxpr shares jax.jit's trace cache)
    replayed = [str(jax.make_jaxpr(fresh(f))(*a)) for f, a in programs for _ in range(2)][1::2]
    with monkeypatch.context() as m:
        _decide_every_time(m)
        decided = [str(jax.make_jaxpr(fresh(f))(*a)) for f, a in programs]
    assert replayed == decided


def test_a_softmax_shift_is_replayed_by_its_facts_and_constants_by_value(monkeypatch):
    """An operand a tracker knows something of (a softmax's max) is keyed by that knowledge,
    relative to the operands, and a replay sets what the tracker learned of the outputs again;
    a constant is keyed by its value (cast from it, saturating): ±40,000 float16 logits stay
    finite however often the code runs, as when every operation is decided."""
    logits = jax.device_put(np.array([[40000.0, -40000.0, 0.0]] * 4, np.float32))
    labels = jax.device_put(np.array([0, 1, 2, 0], np.int32))

    def losses():
        out = []
        for _ in range(3):
            with jamp.autocast(dtype=jnp.float16):
                h = lax.dot(logits, jnp.eye(3))
                loss = optax.softmax_cross_entropy_with_integer_labels(h, labels)
                scaled = h * 0.5  # a weak constant: cast once from its value
            assert np.isfinite(np.asarray(loss, np.float32)).all()
            assert scaled.dtype == F16
            out.append(np.asarray(loss))
        return out

    ran = _count_rules(monkeypatch)
    replayed = losses()
    assert ran.count("stop_gradient") == 1  # the shift's max: decided once, then replayed
    with monkeypatch.context() as m:
        _decide_every_time(m)
        decided = losses()
    for a, b in zip(replayed, decided):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)


def test_a_shift_is_replayed_by_what_its_max_is_of(monkeypatch):
    """In a region as under the transform: ``s - max(s)`` runs in float32, ``t - max(s)`` of
    the same types does not, whether decided or replayed (the max's fact keyed relative to
    the operands reading it, and set again on ``stop_gradient``'s replayed output)."""
    w = jnp.full((16, 16), 0.1)

    def shifted_twice(w, x):
        with jamp.autocast(dtype=jnp.float16):
            s = x @ w
            t = (x * 2.0) @ w
            m = lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
            return jnp.exp(s - m) + jnp.exp(t - m)

    def subs(jaxpr):
        return [str(e.outvars[0].aval.dtype) for e in iter_eqns(jaxpr) if e.primitive.name == "sub"]

    x = jnp.ones((4, 16))
    ran = _count_rules(monkeypatch)
    first = jax.make_jaxpr(fresh(shifted_twice))(w, x)
    again = jax.make_jaxpr(fresh(shifted_twice))(w, x)
    assert ran.count("stop_gradient") == 1  # replayed in the second trace
    with monkeypatch.context() as m:
        _decide_every_time(m)
        decided = jax.make_jaxpr(fresh(shifted_twice))(w, x)
    assert subs(first) == subs(again) == subs(decided) == ["float32", "float16"], subs(again)


@pytest.mark.parametrize("jit", [False, True])
def test_an_operation_with_a_small_constant_is_decided_once_per_value(monkeypatch, jit):
    """A small numpy or Python constant operand is part of the key by its value: the rule runs
    once per value, and the replay casts the constant from its value as the rule did, so the
    programs are those of deciding every operation. (A device array is decided every time:
    keying it would copy it to the host at every operation.)"""

    def scaled(v):
        outs = []
        with jamp.autocast(dtype=jnp.float16):
            d = lax.dot(v, v)  # float16[]
            for constant in (np.float32(3.0), np.float32(3.0), np.float32(1e4), np.float32(1e4)):
                outs.append(lax.mul(d, constant))
            outs.append(lax.mul(d, jnp.float32(2.0)))  # a device array: decided
        return outs

    v = jax.device_put(np.linspace(-1e-3, 2e-3, 16, dtype=np.float32))
    fn = jax.jit(scaled) if jit else scaled
    monkeypatch.setattr(region_trace, "_DECISIONS", {})
    ran = _count_rules(monkeypatch)
    replayed = fn(v)
    assert ran.count("mul") == 3  # one per numpy value and one for the device array, not five
    with monkeypatch.context() as m:
        _decide_every_time(m)
        decided = (jax.jit(fresh(scaled)) if jit else scaled)(v)
    for a, b in zip(replayed, decided):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_a_replayed_constant_cast_is_bound_as_jax_binds_it(monkeypatch):
    """A replay that casts a constant on the host (numpy) binds through ``Primitive.bind``,
    which canonicalizes it, as the rule's own bind does (jax 0.12 refuses a numpy constant
    handed to a trace as it is). The program that first showed it, from the property tests: a
    convolution, then a jitted ``h + 0.1 * jnp.sum(h)``, traced twice."""
    from tests.test_properties import check_region_equals_transform

    monkeypatch.setattr(region_trace, "_DECISIONS", {})
    for seed in (1, 1):
        check_region_equals_transform((("conv1d",), ("jit", (("reduce", "sum", 0),))), seed)


def test_decisions_are_kept_per_region_state(monkeypatch):
    """A decision under one region state (dtype, enabled) is not replayed under another."""
    outs = {}
    for dtype in (jnp.bfloat16, jnp.float16, jnp.bfloat16):
        with jamp.autocast(dtype=dtype):
            outs.setdefault(np.dtype(dtype), []).append(lax.dot(X, W).dtype)
    assert outs == {BF16: [BF16, BF16], F16: [F16]}


def test_an_eager_grad_step_stages_a_custom_jvp_call_once(monkeypatch):
    """``jax.nn.relu`` (a custom_jvp) in an eager ``jax.grad`` step is staged to its equation
    once, not at every step, and the gradients are those of staging it every time."""
    staged = []
    trace_to_closed = compat.trace_to_closed

    def counted(fn, avals, *rest, **kw):
        staged.append(len(avals))
        return trace_to_closed(fn, avals, *rest, **kw)

    def loss(w, x):
        with jamp.autocast():
            return jnp.sum(jax.nn.relu(x @ w).astype(jnp.float32) ** 2)

    first = jax.grad(loss)(W, X)
    monkeypatch.setattr(compat, "trace_to_closed", counted)
    grads = [jax.grad(loss)(W, X) for _ in range(3)]
    assert not staged  # neither the call nor its JVP rule traced again
    monkeypatch.setattr(compat, "custom_call_key", lambda *args: None)
    expected = jax.grad(loss)(W, X)
    assert staged  # (staged again without the key)
    for g in [first, *grads]:
        assert g.dtype == F32
        chex.assert_trees_all_close(g, expected)


def test_custom_jvps_sharing_a_function_keep_their_own_rules():
    """Two custom_jvp functions of the same Python function with different rules: a staged
    call of one is never reused for the other."""

    def body(x):
        return jnp.maximum(x, 0.0)

    def twin(scale):
        f = jax.custom_jvp(body)

        @f.defjvp
        def rule(primals, tangents):
            (x,), (t,) = primals, tangents
            return body(x), t * scale

        return f

    double, triple = twin(2.0), twin(3.0)

    def loss(f, w, x):
        with jamp.autocast():
            return jnp.sum(f(x @ w).astype(jnp.float32))

    for _ in range(2):
        g2 = jax.grad(lambda w: loss(double, w, X))(W)
        g3 = jax.grad(lambda w: loss(triple, w, X))(W)
        # (bfloat16 matmul outputs: the ratio is 1.5 up to their rounding, 1.0 if mixed up)
        chex.assert_trees_all_close(g3, g2 * 1.5, rtol=2e-2)


def test_an_eager_region_forgets_the_values_that_died():
    """A long eager loop in one region keeps no entry for values that died."""
    with jamp.autocast():
        trace = compat.current_trace()
        y = X
        for _ in range(50):
            y = jnp.tanh(y @ W)
        gc.collect()
        alive = len(trace.env._vars)
        ref = weakref.ref(y)
    del y
    gc.collect()
    assert ref() is None
    assert alive < 30  # (50 steps make hundreds of values)


@pytest.mark.parametrize("traced", [False, True])
def test_a_replayed_square_is_still_recomputed_where_a_sum_reads_it(monkeypatch, traced):
    """A 16-bit square's decision is replayed like any other, and the replay keeps what
    recomputes it in float32, so a sum that reads it gets float32 squares every time."""
    monkeypatch.setattr(region_trace, "_DECISIONS", {})
    ran = _count_rules(monkeypatch)

    def sums(x, w):
        with jamp.autocast():
            h = lax.dot(x, w)
            return lax.reduce_sum(lax.integer_pow(h, 2), (0, 1)), h

    def summed_squares():  # (decided the first time, replayed the second)
        if not traced:
            total, h = sums(X, W)
            np.testing.assert_allclose(total, np.sum(np.asarray(h, np.float32) ** 2), rtol=1e-6)
            return [total.dtype]
        live, _ = compat.dce_closed(jax.make_jaxpr(fresh(sums))(X, W))
        return [e.outvars[0].aval.dtype for e in live.eqns if e.primitive.name == "integer_pow"]

    assert summed_squares() == [F32]
    assert ran.count("integer_pow") == 1
    ran.clear()
    assert summed_squares() == [F32]
    assert "integer_pow" not in ran


def test_an_eager_region_forgets_the_squares_that_died():
    """A square's recomputation record (and the operand it holds) goes with the square: a long
    eager loop summing squares in one region keeps none of them."""
    with jamp.autocast():
        trace = compat.current_trace()
        y, total = X, 0.0
        for _ in range(50):
            y = jnp.tanh(y @ W)
            total = total + jnp.sum(y**2)  # (a 16-bit square, recomputed in float32)
        gc.collect()
        kept = len(trace.env.lazy_squares)
    assert total.dtype == F32
    assert kept < 3


@pytest.mark.parametrize("square_first", [False, True])
def test_a_value_times_itself_is_not_replayed_as_a_product_of_two(monkeypatch, square_first):
    """``x * x`` is a square (summed in float32); ``x * y`` with the same types and tags is
    not: which operands are the same value is part of the decision's key."""
    monkeypatch.setattr(region_trace, "_DECISIONS", {})

    def total(a, b):
        return lax.reduce_sum(lax.mul(a, b), (0, 1))

    with jamp.autocast():
        h, g = lax.dot(X, W), lax.dot(X * 2, W)
        if square_first:
            square, product = total(h, h), total(h, g)
        else:
            product, square = total(h, g), total(h, h)
    h32, g32 = np.asarray(h, np.float32), np.asarray(g, np.float32)
    np.testing.assert_allclose(square, np.sum(h32 * h32), rtol=1e-6)  # the square in float32
    np.testing.assert_allclose(product, np.sum(np.asarray(h * g, np.float32)), rtol=1e-6)
    assert abs(float(product) - float(np.sum(h32 * g32))) > 1e-6 * abs(float(product))


def reads_promotions(x, w, b, dtype):
    """Operations on a float32 promotion of a value the policy made 16-bit (as Flax's
    ``promote_dtype`` makes before a Dense layer), which the rules read as that 16-bit value: a
    matmul (no cast back down), an fp32-table op (the promotion itself), a bias add and a square."""
    with jamp.autocast(dtype=dtype):
        h = lax.dot(x, w)
        up, _ = promote_dtype(h, b)  # (a cast the code asks for, h.astype(f32), is its own)
        bias = lax.broadcast_in_dim(b, h.shape, (1,))
        return lax.dot(up, w), lax.exp(up), lax.add(up, bias), lax.mul(up, up)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("jit", [False, True])
def test_operations_reading_a_promotion_replay_what_their_rule_decided(monkeypatch, jit, dtype):
    """The promotion and the operations that read through it are decided once (issue 33: the
    attention's output projection of every block took the rule's path) and replayed as deciding
    again would: the same program, the same values and dtypes."""
    monkeypatch.setattr(region_trace, "_DECISIONS", {})
    ran = _count_rules(monkeypatch)
    args = (X, W, B)

    def run(*args):
        program = fresh(functools.partial(reads_promotions, dtype=dtype))
        return jax.jit(program)(*args) if jit else program(*args)

    def program():
        return str(jax.make_jaxpr(fresh(functools.partial(reads_promotions, dtype=dtype)))(*args))

    first = run(*args)
    assert ran.count("convert_element_type") == 1 and ran.count("dot_general") == 2
    ran.clear()
    replayed_program, replayed = program(), run(*args)
    assert ran == []
    # (the square of the promotion: float32, from the promotion itself)
    assert [np.dtype(o.dtype) for o in replayed] == [np.dtype(dtype), F32, np.dtype(dtype), F32]
    with monkeypatch.context() as m:
        _decide_every_time(m)
        decided_program, decided = program(), run(*args)
    assert "exp" in ran and replayed_program == decided_program
    chex.assert_trees_all_close(replayed, decided)
    chex.assert_trees_all_close(first, decided)


@pytest.mark.parametrize("jit", [False, True])
def test_a_convert_to_16_bits_is_decided_where_it_was_traced(monkeypatch, jit):
    """A float32 value converted to bfloat16 in the user's code is converted; the same convert
    inside jnp's reduction of a value the policy made 16-bit is left out (the sum stays float32):
    the rule reads where the convert was traced, so neither replays the other's decision."""
    monkeypatch.setattr(region_trace, "_DECISIONS", {})

    def both(x):
        with jamp.autocast():
            y = jnp.mean(x).astype(jnp.bfloat16)  # first: the user's own convert, of a scalar
            return y, jnp.sum(x @ W)  # then jnp's, of the float32 sum of a bfloat16 matmul

    y, total = (jax.jit(both) if jit else both)(X)
    assert (y.dtype, total.dtype) == (BF16, F32)


def test_a_users_convert_to_16_bits_is_decided_once(monkeypatch):
    """Where a convert was traced is part of its decision's key, not a reason to decide it
    again: the user's ``astype(bfloat16)`` of a float32 value runs its rule once."""
    monkeypatch.setattr(region_trace, "_DECISIONS", {})
    ran = _count_rules(monkeypatch)
    for _ in range(3):
        with jamp.autocast():
            y = (X * 2).astype(jnp.bfloat16)
        assert y.dtype == BF16
    assert ran.count("convert_element_type") == 1


def test_jnps_calls_leave_no_dead_promotions_in_the_program():
    """jnp promotes the bfloat16 matmul to float32 for the bias add, and the rules read through
    that promotion (the add runs in bfloat16): the promotion is left out of the call's reused
    rewrite once, rather than bound at every call and left for XLA."""

    def dense(x, w, b):
        with jamp.autocast():
            h = jnp.dot(x, w) + b
            return jnp.mean(jax.nn.relu(h) * h, axis=-1)

    closed = jax.make_jaxpr(dense)(X, W, B)
    live, _ = compat.dce_closed(closed)
    assert len(live.eqns) == len(compat.open_and_consts(closed)[0].eqns)
    chex.assert_trees_all_close(jax.jit(dense)(X, W, B), dense(X, W, B), rtol=1e-2)


@pytest.mark.parametrize("square_first", [False, True])
@pytest.mark.parametrize("jit", [False, True])
def test_jnps_value_times_itself_is_a_square_as_under_the_transform(square_first, jit):
    """jnp's ``h * h`` hands the same value to its inline jit twice: the rewrite reused for
    that jit is keyed and walked with which operands are the same value, so it is the square
    the transform sees (float32 before a sum), and ``h * g`` with the same types is not."""

    def loss(x, w):
        h, g = x @ w, (x * 2) @ w
        if square_first:
            return jnp.sum(h * h), h * g, h
        product = h * g
        return jnp.sum(h * h), product, h

    def in_region(x, w):
        with jamp.autocast():
            return loss(x, w)

    squares = [
        e
        for e in jax.make_jaxpr(in_region)(X, W).jaxpr.eqns
        if e.primitive.name == "mul"
        and e.invars[0] is e.invars[1]
        and not isinstance(e.outvars[0], compat.DropVar)  # (unread: XLA drops it)
    ]
    assert [e.outvars[0].aval.dtype for e in squares] == [F32]
    total, product, h = (jax.jit(in_region) if jit else in_region)(X, W)
    assert (product.dtype, h.dtype) == (BF16, BF16)
    if jit:  # the same program as the transform's (XLA may skip rounding h between ops)
        chex.assert_trees_all_close((total, product, h), jamp.autocast_transform(loss)(X, W))
    else:  # op by op: the square of the bfloat16 h in float32 (in bfloat16 it is ~1e-3 off)
        np.testing.assert_allclose(total, np.sum(np.square(np.asarray(h, np.float32))), rtol=1e-6)


class Stack(nn.Module):
    @nn.compact
    def __call__(self, x):
        for _ in range(3):
            x = nn.Dense(16)(x)
        return x


def test_blocks_share_decisions_and_rules_still_decide_per_module(monkeypatch):
    """Modules differ in their scope path only: they share one table of decisions. A per-module
    rule turns one off: its state differs, and nothing decided elsewhere is replayed there."""
    model = Stack()
    variables = jax.jit(model.init)(jax.random.PRNGKey(3), X)
    monkeypatch.setattr(region_trace, "_DECISIONS", {})
    with jamp.autocast():
        out = model.apply(variables, X)
    assert out.dtype == BF16
    (tables,) = region_trace._DECISIONS.values()
    assert len(tables) == 1  # not one per module path (Dense_0, Dense_1, Dense_2)
    policy = jamp.Policy(jnp.bfloat16, rules=(("*/Dense_2", None),))
    with jamp.autocast(policy):
        out = model.apply(variables, X)
    assert out.dtype == F32  # the last Dense runs in float32, as its rule says
