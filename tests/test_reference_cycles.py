"""jamp's calls leave nothing in reference cycles (issue 33).

What a call built or saw (a traced program's tracers and equations, eager arrays, compiled
programs) is freed when the caller drops it, by reference counting, not kept in memory until
the garbage collector next collects the oldest generation: on an accelerator that is device
memory, and a region inside a large trace otherwise left ~11 000 objects a trace for those full
collections to walk. Each case runs once to fill caches, then again with the collector off; what
a collection then finds unreachable is what the call left in cycles.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jamp
import tracing
from tests.collector import left_in_cycles

# (numpy + device_put: no compile at import, in every test process)
X = jax.device_put(np.random.default_rng(0).standard_normal((8, 16), np.float32))
W = jax.device_put(np.random.default_rng(1).standard_normal((16, 16), np.float32) * 0.25)


def _assert_no_cycles(run):
    run()  # (warm: what caches keep is not garbage)
    left = left_in_cycles(run)
    kinds = sorted({type(o).__qualname__ for o in left})
    assert not left, f"{len(left)} objects left in reference cycles: {kinds}"


def _region_loss(x, w):
    with jamp.autocast():
        return jnp.tanh(x @ w).sum()


def _grad_in_region(x, w):
    with jamp.autocast():
        return jax.value_and_grad(lambda w: jnp.tanh(x @ w).sum())(w)


@pytest.mark.parametrize(
    "run",
    [
        # (a new function each time: make_jaxpr caches what it traced per function)
        lambda: jax.make_jaxpr(lambda x, w: _region_loss(x, w))(X, W),
        lambda: jax.make_jaxpr(jax.grad(_region_loss, argnums=1))(X, W),
        lambda: jax.grad(_region_loss, argnums=1)(X, W),
        lambda: _region_loss(X, W),
        lambda: jax.vmap(_region_loss, (0, None))(X[None], W),
        lambda: _grad_in_region(X, W),
        lambda: jax.make_jaxpr(lambda x, w: _grad_in_region(x, w))(X, W),
    ],
    ids=[
        "make_jaxpr",
        "make_jaxpr of grad",
        "eager grad",
        "eager",
        "vmap",
        "grad inside, eager",
        "grad inside, make_jaxpr",
    ],
)
def test_a_region_is_freed_when_it_ends(run):
    """A region's references to the values it saw once called back through a bound method of
    the region, and the region deciding for a ``jax.grad`` inside one and that grad's trace held
    each other: the program and arrays a region saw stayed until a full collection."""
    _assert_no_cycles(run)


@pytest.mark.parametrize(
    "run",
    [
        lambda: jamp.autocast_transform(lambda x, w: jnp.tanh(x @ w).sum())(X, W),
        lambda: jax.make_jaxpr(jamp.autocast_transform(lambda x, w: jnp.tanh(x @ w).sum()))(X, W),
        lambda: jax.grad(jamp.autocast_transform(lambda x, w: jnp.tanh(x @ w).sum()))(X, W),
        lambda: jamp.explain(lambda x, w: jnp.tanh(x @ w).sum(), X, W),
    ],
    ids=["eager", "make_jaxpr", "eager grad", "explain"],
)
def test_the_transform_is_freed_when_dropped(run):
    """(jamp.explain asked, per equation, a recursive closure whether it carries programs: a
    small cycle a call.)"""
    _assert_no_cycles(run)


def _overflowing(w, x):
    return jnp.sum(jnp.exp(x @ w) ** 2)


def test_find_nonfinite_keeps_no_traceback_of_its_search():
    """The search stops at the first non-finite value by raising; the exception it returns the
    finding from once kept its traceback, whose frames held it and the program's arrays."""
    w, x = W * 40.0, X

    def run():
        found = jamp.find_nonfinite(_overflowing, w, x, policy=jnp.float16)
        assert found is not None  # (the case must find something, or nothing was searched)

    _assert_no_cycles(run)


def test_tune_holds_no_cycle_through_its_compiled_programs():
    """The programs ``jamp.tune`` compiles per policy wrote the leaf names back onto the object
    that keeps them, a cycle holding the arguments."""
    params = {"a": W, "b": W}

    def loss(params, x):
        with jax.named_scope("a"):
            h = jnp.tanh(x @ params["a"])
        with jax.named_scope("b"):
            return jnp.mean((h @ params["b"]) ** 2)

    _assert_no_cycles(lambda: jamp.tune(loss, params, X, candidates=(jnp.bfloat16,)))


def test_a_traced_program_is_freed_when_dropped():
    """``tracing.trace``'s program once jitted its own bound method: a cycle holding its
    constants."""
    const = np.linspace(0.0, 1.0, 16, dtype=np.float32)

    def run():
        traced = tracing.trace(lambda x: jnp.tanh(x @ W) + const, X)
        assert traced(X).shape == (8, 16)

    _assert_no_cycles(run)
