"""Softmax-family composites take float32 inputs under both forms (issue 32, item 2)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jamp
from jamp import _compat as compat
from tests.jaxpr_utils import eqns_named, sub_jaxprs

F16, F32 = np.dtype(jnp.float16), np.dtype(jnp.float32)
POLICY = jamp.Policy(jnp.float16)
# float16 logits of +-40,000: x - max(x) is -80,000, past float16's 65,504. (Built on the host and
# transferred: jnp.array would compile a cast.)
LOGITS = jax.device_put(np.array([[40000.0, -40000.0, 1.0, 2.0], [-40000.0, 40000.0, 2.0, 3.0]],
                                 np.float16))
LABELS = jax.device_put(np.array([1, 0], np.int32))


def int_labels(logits):
    return optax.softmax_cross_entropy_with_integer_labels(logits, LABELS)


def one_hot(logits):
    return optax.softmax_cross_entropy(logits, jax.nn.one_hot(LABELS, 4))


def by_hand(logits):
    return -jnp.sum(jax.nn.log_softmax(logits) * jax.nn.one_hot(LABELS, 4), axis=-1)


LOSSES = {"int_labels": int_labels, "one_hot": one_hot, "log_softmax": by_hand}
def in_region(fn):
    """``fn`` with a ``with jamp.autocast(float16):`` block around its body (a region trace:
    the decorator form outside a region applies autocast_transform instead)."""
    def region_fn(*args):
        with jamp.autocast(jnp.float16):
            return fn(*args)
    return region_fn


FORMS = {
    "transform": lambda fn: jamp.autocast_transform(fn, POLICY),
    "decorator": lambda fn: jamp.autocast(jnp.float16)(fn),
    "region": in_region,
    "region_jit": lambda fn: jax.jit(in_region(fn)),
}


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_float16_logits_of_40000_give_a_finite_loss(loss, form):
    out = FORMS[form](LOSSES[loss])(LOGITS)
    # torch's cross_entropy on these logits: 80,000 per example (the label's logit is 80,000
    # below the max), in float32.
    np.testing.assert_allclose(np.asarray(out, np.float32), [80000.0, 80000.0], rtol=1e-6)
    assert out.dtype == F32


@pytest.mark.parametrize("form", ["transform", "region"])
def test_loss_and_grads_finite_when_a_float16_matmul_makes_the_logits(form):
    w = jax.device_put(np.array([[40000.0, -40000.0, 1.0, 2.0]], np.float32))
    x = jax.device_put(np.array([[1.0], [-1.0]], np.float32))

    def loss(w, x):
        return jnp.mean(by_hand(x @ w))

    fn = FORMS[form](loss)
    value, grads = jax.value_and_grad(fn)(w, x)
    assert float(value) == 80000.0
    np.testing.assert_allclose(grads, [[1.0, -1.0, 0.0, 0.0]], atol=1e-6)
    # without the rule the shift runs in float16 and overflows
    plain = jamp.autocast_transform(loss, POLICY.replace(fp32=POLICY.fp32 - {"exp"}))
    assert not np.isfinite(float(plain(w, x)))


@pytest.mark.parametrize("composite", [jax.nn.softmax, jax.nn.log_softmax,
                                       lambda x: jax.nn.logsumexp(x, axis=-1)],
                         ids=["softmax", "log_softmax", "logsumexp"])
def test_the_shift_and_exp_run_in_float32_and_explain_says_why(composite):
    host_x = np.linspace(-3.0, 3.0, 8, dtype=np.float32).reshape(2, 4)
    x = jax.device_put(host_x)
    fn = lambda x: composite(x.astype(jnp.float16))
    report = jamp.explain(fn, x, policy=POLICY)
    assert report.float32_reasons[("sub", "softmax shift (x - max(x) before exp)")] == 1
    assert report.ops["exp"] == {"float32": 1}
    with jamp.autocast(jnp.float16):
        out = fn(x)
    assert out.dtype == F32
    reference = jax.jit(composite)(jax.device_put(host_x.astype(np.float16).astype(np.float32)))
    np.testing.assert_allclose(out, reference, rtol=1e-6, atol=1e-6)


def test_a_rank_one_log_softmax_is_caught_too():
    """A rank-0 max broadcasts as a scalar would, which the promote table lets adapt (it would
    run in float16): the rule still takes both operands in float32."""
    x = jnp.array([40000.0, -40000.0], jnp.float16)
    for fn in (jamp.autocast_transform(jax.nn.log_softmax, POLICY),
               jamp.autocast(jnp.float16)(jax.nn.log_softmax)):
        np.testing.assert_allclose(np.asarray(fn(x), np.float32), [0.0, -80000.0])


def test_other_subtractions_keep_the_promote_table():
    x = jax.device_put(np.ones((2, 4), np.float16))
    y = jax.device_put(np.ones((2, 1), np.float16))
    assert jamp.autocast_transform(lambda x, y: jnp.exp(x - y), POLICY)(x, y).dtype == F32
    report = jamp.explain(lambda x, y: jnp.exp(x - y), x, y, policy=POLICY)
    assert report.ops["sub"] == {"float16": 1}
    # the max of another value is not this value's shift
    report = jamp.explain(lambda x, y: jnp.exp(x - jnp.max(y, -1, keepdims=True)), x, y,
                          policy=POLICY)
    assert report.ops["sub"] == {"float16": 1}


def test_softmax_as_a_custom_jvp_call_is_caught_too():
    """Under jax.softmax_custom_jvp(True) softmax arrives as a custom_jvp_call: the rule works
    inside its body, and its JVP, in both forms."""
    x = LOGITS[:, :3]
    with jax.softmax_custom_jvp(True):
        assert "custom_jvp_call" in str(jax.make_jaxpr(jax.nn.softmax)(x))
        report = jamp.explain(jax.nn.softmax, x, policy=POLICY)
        assert report.float32_reasons[("sub", "softmax shift (x - max(x) before exp)")] == 1
        for form in ("transform", "region"):
            fn = FORMS[form](lambda x: jax.nn.softmax(x)[:, 0].sum())
            value, grad = jax.value_and_grad(fn)(x)
            assert np.isfinite(float(value)) and bool(jnp.all(jnp.isfinite(grad)))


@pytest.mark.parametrize("composite", [
    lambda x: x - x.max(-1, keepdims=True), jax.nn.softmax, jax.nn.log_softmax,
    lambda x: jax.nn.logsumexp(x, axis=-1)], ids=["by_hand", "softmax", "log_softmax",
                                                  "logsumexp"])
def test_a_region_shifts_in_float32_on_every_call(composite):
    # A region decides jnp's inline jits (jnp.max, the `-` operator) once and reuses the
    # rewrite: the reused call must carry what the softmax rule learned (max_of) to the `sub`.
    for _ in range(3):
        jaxpr = jax.make_jaxpr(in_region(composite))(LOGITS)
        subs = [np.dtype(e.outvars[0].aval.dtype) for e in eqns_named(jaxpr, "sub")]
        assert subs and all(d == F32 for d in subs[:1]), subs
    with jamp.autocast(jnp.float16):
        shifted = LOGITS - LOGITS.max(-1, keepdims=True)
    np.testing.assert_array_equal(np.asarray(shifted[0]), [0.0, -80000.0, -39999.0, -39998.0])


def _shifts(closed):
    """Per ``x - max(x)`` in the program (each jaxpr and sub-jaxpr on its own): the dtype its max
    was reduced in and whether that max was reduced from the very operand the shift subtracts
    it from (a max computed in float32 from the float32 ``x``), else from something converted."""
    through = {"broadcast_in_dim", "reshape", "max", "stop_gradient", "expand_dims", "squeeze",
               "copy", "convert_element_type"}
    found = []

    def walk(jaxpr):
        jaxpr = compat.open_and_consts(jaxpr)[0]
        producer = {v: e for e in jaxpr.eqns for v in e.outvars}
        for eqn in jaxpr.eqns:
            for value in eqn.params.values():
                for sub in sub_jaxprs(value):
                    walk(sub)
            if eqn.primitive.name != "sub":
                continue
            atom, converted = eqn.invars[1], False
            while isinstance(atom, compat.Var) and atom in producer:
                source = producer[atom]
                if source.primitive.name == "reduce_max":
                    found.append((np.dtype(source.outvars[0].aval.dtype),
                                  source.invars[0] is eqn.invars[0] and not converted))
                    break
                if source.primitive.name not in through:
                    break
                converted |= source.primitive.name == "convert_element_type"
                atom = next(v for v in source.invars if isinstance(v, compat.Var))

    walk(closed)
    return found


def _softmax_loss(w, x):
    return jnp.sum(jax.nn.softmax(x @ w) ** 2)


_COMPOSITES = {
    "by_hand": lambda form: FORMS[form](lambda x: x - x.max(-1, keepdims=True)),
    "softmax": lambda form: FORMS[form](jax.nn.softmax),
    "log_softmax": lambda form: FORMS[form](jax.nn.log_softmax),
    # (the form inside jax.grad, as a train step has it)
    "softmax_grad": lambda form: jax.grad(FORMS[form](_softmax_loss)),
}


@pytest.mark.parametrize("form", ["transform", "region"])
@pytest.mark.parametrize("composite", sorted(_COMPOSITES))
def test_the_shift_computes_its_max_again_in_float32(composite, form):
    """The shift's max is not the 16-bit max converted but the float32 max of the float32
    operand, as a softmax written in float32 has it (XLA's CPU compiler took 1-2% longer on the
    converted one); the same number, since a max rounds nothing. Every call, replays too."""
    w = jax.device_put(np.eye(4, dtype=np.float32))
    args = (w, LOGITS) if composite == "softmax_grad" else (LOGITS,)
    for _ in range(3):
        closed = jax.make_jaxpr(_COMPOSITES[composite](form))(*args)
        assert _shifts(closed) and set(_shifts(closed)) == {(F32, True)}, _shifts(closed)


def test_the_shift_converts_a_max_it_cannot_compute_again():
    """logsumexp's max passes a select_n on whether it is finite (a value, not a constant): the
    shift converts the 16-bit max instead, still in float32."""
    lse = lambda x: jax.nn.logsumexp(x, axis=-1)  # noqa: E731
    for form in ("transform", "region"):
        closed = jax.make_jaxpr(FORMS[form](lse))(LOGITS)
        assert _shifts(closed) == [], _shifts(closed)  # (its max reaches the sub past a select)
        subs = [np.dtype(e.outvars[0].aval.dtype) for e in eqns_named(closed, "sub")]
        assert subs[:1] == [F32], subs


def test_shifts_over_different_axes_each_compute_their_own_max():
    """Two softmaxes of one square value, over either axis: the same shapes and types all
    along, so only what the recipe holds (the reduction's axes, the broadcast's dimensions)
    tells their maxes apart; a replay that mixed them up would subtract the wrong max."""
    x = jax.device_put(np.arange(16, dtype=np.float16).reshape(4, 4) * np.float16(3.5))
    both = lambda x: jax.nn.softmax(x, axis=0) + 2.0 * jax.nn.softmax(x, axis=1)  # noqa: E731
    host = np.asarray(x, np.float32)
    expected = jax.nn.softmax(host, axis=0) + 2.0 * jax.nn.softmax(host, axis=1)
    for form in ("transform", "region", "region_jit"):
        for _ in range(3):
            out = FORMS[form](both)(x)
            np.testing.assert_allclose(np.asarray(out, np.float32), expected, rtol=1e-3)
