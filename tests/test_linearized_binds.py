"""``jax.grad`` of a function calling ``autocast_transform`` binds the rewrite's operations into
JAX's linearize trace as calls of one-operation jitted functions (issue 33, forty-first pass).

JAX linearizes a bare primitive by tracing its JVP rule into a program, for every operation
(its fallback rule), and a jit call by a rule that reuses the linearization of the call's
program: ``jnp``'s jitted functions take that rule, and so the rewrite now does too
(``_compat.bind_to_linearize``). That must be invisible: the program ``jax.grad`` builds, its
equations' name stacks, source lines and contexts, and the values it computes are those that
binding each operation gives. Each test compares the two (``bind_to_linearize`` switched off
by ``plain_binds``) and checks that the calls were made.
"""

import collections
import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jamp
from jamp import _compat
from tests.jaxpr_utils import program_record
from tests.test_transform_decisions import Stack, X

MODEL = Stack(blocks=2)  # (test_transform_decisions' transformer blocks: a bias add, a softmax)
PARAMS = MODEL.init(jax.random.key(0), X)


def forward(params, x):
    return MODEL.apply(params, x)


def scanned(w, x):
    """A scan (a program the rewrite enters), relu (a custom JVP), a literal operand."""

    def body(h, _):
        return jax.nn.relu(h @ w) * 0.5 + h, None

    h, _ = jax.lax.scan(body, x, None, length=3)
    return jnp.tanh(h)


def with_callback(w, x):
    """An operation with effects (a debug callback), bound as before."""
    y = x @ w
    jax.debug.callback(lambda v: None, y)
    return jnp.exp(y)


CASES = {
    "transformer": (forward, (PARAMS, X), None),
    "transformer_float16": (forward, (PARAMS, X), jamp.Policy(compute_dtype=jnp.float16)),
    "scanned": (scanned, (jnp.eye(16) * 0.3, X[0]), None),
    "with_callback": (with_callback, (jnp.eye(16) * 0.3, X[0]), None),
}


@contextlib.contextmanager
def counted_calls(monkeypatch):
    """How many operations ``bind_to_linearize`` bound as jitted calls (a list of one count)."""
    made = [0]
    bind = _compat.bind_to_linearize

    def counting(*args, **kwargs):
        outs = bind(*args, **kwargs)
        made[0] += outs is not None
        return outs

    monkeypatch.setattr(_compat, "bind_to_linearize", counting)
    yield made


@contextlib.contextmanager
def plain_binds(monkeypatch):
    """Every operation bound into the linearize trace as a bare primitive (the same decisions,
    a view of a parameter cast through the parameter too)."""
    with monkeypatch.context() as m:
        m.setattr(_compat, "bind_to_linearize", lambda *args: None)
        m.setattr(_compat, "convert_to_linearize", lambda *args: None)
        yield


def _loss(fn, policy):
    transformed = jamp.autocast_transform(fn, policy) if policy else jamp.autocast_transform(fn)

    def loss(params, x):
        return jnp.sum(transformed(params, x).astype(jnp.float32) ** 2)

    return loss


def _built(fn, args, policy):
    """The record of ``jax.value_and_grad``'s program, and its values under jit."""
    step = jax.value_and_grad(_loss(fn, policy), argnums=(0, 1))
    return program_record(jax.make_jaxpr(step)(*args)), jax.jit(step)(*args)


@pytest.mark.parametrize("case", sorted(CASES))
def test_grad_builds_the_program_binding_each_operation_builds(case, monkeypatch):
    fn, args, policy = CASES[case]
    with counted_calls(monkeypatch) as made:
        record, values = _built(fn, args, policy)
    with plain_binds(monkeypatch):
        plain_record, plain_values = _built(fn, args, policy)
    assert made[0] > 0
    assert record == plain_record
    for got, want in zip(jax.tree.leaves(values), jax.tree.leaves(plain_values), strict=True):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_the_calls_are_made_once_per_signature_and_reused():
    """A model's repeated blocks bind the same few jitted functions: the second block, and a
    second trace, make none (the rewrite's operations reuse JAX's linearization)."""
    _compat._one_operation_jit.cache_clear()
    loss = _loss(forward, None)
    jax.make_jaxpr(jax.grad(loss))(PARAMS, X)
    made = _compat._one_operation_jit.cache_info()
    assert made.misses > 0 and made.hits > made.misses  # (two blocks alike: mostly reused)
    jax.make_jaxpr(jax.grad(_loss(forward, None)))(PARAMS, X)
    again = _compat._one_operation_jit.cache_info()
    assert again.misses == made.misses


def test_vjp_linearize_and_second_order_build_the_same_programs(monkeypatch):
    w, x = jnp.eye(16) * 0.3, X[0]
    transformed = jamp.autocast_transform(lambda w, x: jnp.tanh(x @ w) * 2.0)

    def scalar(w):
        return jnp.sum(transformed(w, x).astype(jnp.float32))

    def programs():
        return [
            program_record(jax.make_jaxpr(lambda w: jax.vjp(scalar, w)[1](1.0))(w)),
            program_record(jax.make_jaxpr(lambda w: jax.linearize(scalar, w)[1](w))(w)),
            program_record(jax.make_jaxpr(jax.hessian(scalar))(w)),
        ]

    with counted_calls(monkeypatch) as made:
        got = programs()
    with plain_binds(monkeypatch):
        want = programs()
    assert made[0] > 0
    assert got == want
    np.testing.assert_array_equal(
        np.asarray(jax.jit(jax.hessian(scalar))(w)),
        np.asarray(jax.hessian(scalar)(w)),
    )


def test_outside_a_linearize_trace_nothing_is_bound_as_a_call(monkeypatch):
    """make_jaxpr, vmap and eager calls of the transform (and a region) never take the path."""
    with counted_calls(monkeypatch) as made:
        transformed = jamp.autocast_transform(forward)
        jax.make_jaxpr(transformed)(PARAMS, X)
        jax.vmap(transformed, in_axes=(None, 0))(PARAMS, X)
        transformed(PARAMS, X)
        with jamp.autocast():
            jax.grad(lambda p: jnp.sum(forward(p, X).astype(jnp.float32)))(PARAMS)
    assert made[0] == 0


def test_operations_under_xla_metadata_keep_their_context(monkeypatch):
    """The calls are made under the operation's context: what ``set_xla_metadata`` marks keeps
    its mark, forward and backward. (On jax 0.12 the backward pass may list its cotangent sums
    in another order: the same equations, compared as a multiset.)"""
    from jax.experimental.xla_metadata import set_xla_metadata

    def f(w, x):
        y = jnp.tanh(x @ w)
        with set_xla_metadata(tag="marked"):
            y = jnp.tanh(y @ w) * 2.0
        return jnp.tanh(y @ w)

    w, x = jnp.eye(16) * 0.3, X[0]

    def built():
        transformed = jamp.autocast_transform(f)
        grad = jax.grad(lambda w: jnp.sum(transformed(w, x).astype(jnp.float32)))
        return program_record(jax.make_jaxpr(grad)(w))[1], jax.jit(grad)(w)

    with counted_calls(monkeypatch) as made:
        record, value = built()
    with plain_binds(monkeypatch):
        plain_record, plain_value = built()
    assert made[0] > 0
    assert collections.Counter(map(repr, record)) == collections.Counter(map(repr, plain_record))
    assert any("marked" in repr(ctx) for *_, ctx in record)
    np.testing.assert_array_equal(np.asarray(value), np.asarray(plain_value))
