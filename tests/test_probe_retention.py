"""``find_nonfinite``, ``value_ranges`` and ``tune`` keep nothing of a call alive.

Their checked programs are cached per function, policy and argument shapes, and a program holds
the arrays its function closes over as constants. The cache held the function itself (and the
counts of a jaxpr's equations held the jaxpr, which from jax 0.12 on holds its constants), so
a function and what it captured stayed in memory after the caller dropped them. What a call
traced or saw must go when the caller drops it, by reference counting
(docs/development.md), while a second call with the same live function still finds its program.
"""

import gc
import weakref

import jax.numpy as jnp
import numpy as np

import jamp

F16 = jamp.Policy(jnp.float16)


def _params():
    return {"w": jnp.full((8, 8), 0.5)}


X = jnp.full((4, 8), 0.25)


def _loss_closing_over_an_array():
    captured = jnp.full((256, 256), 2.0)

    def loss(params, x):
        return jnp.mean(jnp.tanh(x @ params["w"])) + jnp.sum(captured) * 0.0

    return loss, (weakref.ref(loss), weakref.ref(captured))


def _dropped_with_collector_off(check):
    """Whether the function ``check`` is given, and the array it closes over, are freed when
    the caller drops them, with the garbage collector off: by reference counting alone."""
    gc.collect()
    gc.disable()
    try:
        loss, refs = _loss_closing_over_an_array()
        result = check(loss)
        del loss, result
        alive = [r() is not None for r in refs]
    finally:
        gc.enable()
    return {"function": alive[0], "captured array": alive[1]}


def _assert_freed(check):
    alive = _dropped_with_collector_off(check)
    assert alive == {"function": False, "captured array": False}, alive


def test_find_nonfinite_frees_the_function_and_what_it_captured():
    _assert_freed(lambda loss: jamp.find_nonfinite(loss, _params(), X, policy=F16))


def test_find_nonfinite_that_finds_an_overflow_frees_them_too():
    """A finding traces the program again under each remedy's policy."""

    def check(loss):
        overflowing = lambda params, x: loss(params, x) + jnp.sum(jnp.exp(x @ params["w"]))
        found = jamp.find_nonfinite(overflowing, {"w": jnp.full((8, 8), 60.0)}, X, policy=F16)
        assert found is not None  # (else the remedies were never traced)
        return found

    _assert_freed(check)


def test_value_ranges_frees_the_function_and_what_it_captured():
    _assert_freed(lambda loss: jamp.value_ranges(loss, _params(), X, policy=F16))
    _assert_freed(lambda loss: jamp.value_ranges(loss, _params(), X, policy=F16, grad=True))


def test_tune_frees_the_function_and_what_it_captured():
    """On jax 0.12 the count of the traced jaxpr's equations kept the jaxpr, and so the array."""
    _assert_freed(lambda loss: jamp.tune(loss, _params(), X, candidates=(jnp.bfloat16,)))


class _Model:
    def __init__(self):
        self.table = jnp.full((256, 256), 2.0)
        self.traces = 0

    def loss(self, params, x):
        self.traces += 1  # (runs when traced, not when a cached program runs)
        return jnp.mean(jnp.tanh(x @ params["w"])) + jnp.sum(self.table) * 0.0


def test_a_bound_methods_object_is_freed():
    """A bound method is cached by its object and function, held weakly."""
    gc.collect()
    gc.disable()
    try:
        model = _Model()
        refs = weakref.ref(model), weakref.ref(model.table)
        jamp.find_nonfinite(model.loss, _params(), X, policy=F16)
        jamp.value_ranges(model.loss, _params(), X, policy=F16)
        del model
        alive = [r() is not None for r in refs]
    finally:
        gc.enable()
    assert alive == [False, False]


def test_a_second_call_with_the_same_function_is_not_traced_again():
    traces = []

    def loss(params, x):
        traces.append(None)
        return jnp.mean(jnp.tanh(x @ params["w"]))

    first = jamp.value_ranges(loss, _params(), X, policy=F16)
    traced_once = len(traces)
    assert traced_once > 0
    again = jamp.value_ranges(loss, _params(), X, policy=F16)
    assert jamp.find_nonfinite(loss, _params(), X, policy=F16) is None
    jamp.find_nonfinite(loss, _params(), X, policy=F16)
    assert len(traces) == traced_once  # (both analyses check the same program)
    np.testing.assert_array_equal(
        [e.max_abs for e in first.entries], [e.max_abs for e in again.entries]
    )


def test_a_bound_method_taken_again_finds_its_program():
    """``model.loss`` is a new object at every attribute access: the cache must still hit."""
    model = _Model()
    jamp.value_ranges(model.loss, _params(), X, policy=F16)
    traced_once = model.traces
    assert traced_once > 0
    jamp.value_ranges(model.loss, _params(), X, policy=F16)
    assert model.traces == traced_once
    other = _Model()  # (another object's method is another function)
    jamp.value_ranges(other.loss, _params(), X, policy=F16)
    assert other.traces == traced_once
