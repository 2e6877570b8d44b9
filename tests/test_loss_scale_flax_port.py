"""Port of flax's DynamicScale test (``DynamicScaleTest.test_dynamic_scale``, tests/optim_test.py
in google/flax until the optim package was removed, commit 948ee260), plus a side-by-side run
against the installed ``flax.training.dynamic_scale.DynamicScale``.

Mapping: flax's ``DynamicScale(growth_interval=n)`` grows on the (n+1)-th consecutive finite step
(it compares ``fin_steps == growth_interval`` before counting the step) where jamp/jmp's
``period`` grows on the ``period``-th, so ``period = growth_interval + 1``; flax's default
``minimum_scale`` (the smallest normal float32) is jamp's ``min_loss_scale=None``; flax's
``scale=65536`` start and float32-maximum growth cap are jamp's ``loss_scale`` and
``max_loss_scale``.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.training.dynamic_scale import DynamicScale
from hypothesis import given, settings
from hypothesis import strategies as st

import jamp


def _loss_fn(p):
    return jnp.asarray(p, jnp.float16) ** 2


def test_dynamic_scale():
    p = jnp.array(1., jnp.float32)
    dyn_scale = jamp.DynamicLossScale(loss_scale=65536.0, period=3, factor=2,
                                      min_loss_scale=None)
    step = jax.jit(jamp.scaled_value_and_grad(_loss_fn))
    inf = float("inf")
    # flax's expected (is_fin, loss, scale, grad). The first loss differs by design: flax returns
    # the scaled loss divided by the scale, nan once the float16 product overflowed; jamp returns
    # the loss the function computed, 1.0.
    expected_values = [
        (False, 1.0, 32768.0, inf),
        (False, 1.0, 16384.0, inf),
        (True, 1.0, 16384.0, 2.0),
        (True, 1.0, 16384.0, 2.0),
        (True, 1.0, 32768.0, 2.0),
        (False, 1.0, 16384.0, inf),
    ]
    for expected in expected_values:
        loss, grad, dyn_scale, is_fin = step(dyn_scale, p)
        values = np.array((is_fin, loss, dyn_scale.loss_scale, grad))
        np.testing.assert_allclose(values, expected)


def _flax_history(scale, growth_interval, finite_flags):
    """Scales flax's DynamicScale goes through for a given overflow pattern."""
    ds = DynamicScale(growth_interval=growth_interval, scale=scale)
    history = []
    for finite in finite_flags:
        # a gradient that is finite or not as asked; DynamicScale decides from it alone
        grad_fn = ds.value_and_grad(lambda w: w * (1.0 if finite else jnp.inf))
        ds, _, _, _ = grad_fn(jnp.float32(1.0))
        history.append(float(ds.scale))
    return history


def _jamp_history(scale, period, finite_flags):
    ls = jamp.DynamicLossScale(loss_scale=scale, period=period, min_loss_scale=None)
    history = []
    for finite in finite_flags:
        ls = ls.adjust(jnp.asarray(finite))
        history.append(float(ls.loss_scale))
    return history


@settings(max_examples=25, deadline=None)
@given(growth_interval=st.integers(0, 3),
       start=st.sampled_from([1.0, 2.0 ** 15, 2.0 ** 126]),
       flags=st.lists(st.booleans(), min_size=1, max_size=12))
def test_same_scales_as_flax(growth_interval, start, flags):
    assert _jamp_history(start, growth_interval + 1, flags) == \
        _flax_history(start, growth_interval, flags)


@pytest.mark.parametrize("flags", [[True] * 6])
def test_growth_cap_matches_flax(flags):
    # flax caps growth at the float32 maximum; so does jamp's default max_loss_scale
    assert _jamp_history(2.0 ** 126, 1, flags) == _flax_history(2.0 ** 126, 0, flags)
    assert _jamp_history(2.0 ** 126, 1, flags)[-1] == float(np.finfo(np.float32).max)
