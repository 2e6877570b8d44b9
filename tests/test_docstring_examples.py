"""Docstring examples that run as written.

The ``Example::`` block of each object listed here runs in a fresh namespace holding only
``jax``, ``jnp``, ``np``, ``optax``, ``jamp`` and ``tracing``, as a reader would paste it after
those imports. Examples that show a fragment of a larger program (a ``model`` defined elsewhere)
are not listed.
"""

import inspect
import re
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jamp
import tracing

RUNNABLE = [jamp.scaled_value_and_grad, jamp.DynamicLossScale, jamp.Policy.from_string,
            jamp.stochastic_round, jamp.optim.state_dtype, jamp.optim.master_weights,
            jamp.optim.stochastic_rounding, jamp.optim.compensated]

# The literal block after "Example::": its indented lines (and blank lines between them).
EXAMPLE = re.compile(r"Example::\n\n((?:[ \t]+\S.*\n|\n)+)")


def example(obj):
    match = EXAMPLE.search(inspect.getdoc(obj) + "\n")
    assert match, f"{obj.__qualname__} has no Example:: block"
    return textwrap.dedent(match.group(1))


@pytest.mark.parametrize("obj", RUNNABLE, ids=lambda obj: obj.__qualname__)
def test_docstring_example_runs_as_written(obj):
    namespace = {"jax": jax, "jnp": jnp, "np": np, "optax": optax, "jamp": jamp,
                 "tracing": tracing}
    exec(compile(example(obj), f"<{obj.__qualname__} docstring>", "exec"), namespace)


def test_scaled_value_and_grad_example_trains_and_keeps_dtypes():
    namespace = {"jax": jax, "jnp": jnp, "np": np, "optax": optax, "jamp": jamp}
    exec(example(jamp.scaled_value_and_grad), namespace)
    assert bool(namespace["finite"])
    assert namespace["params"]["w"].dtype == jnp.float32
    assert not np.allclose(namespace["params"]["w"], 0.1)  # the update was applied
    assert int(namespace["loss_scale"].counter) == 1


def test_dynamic_loss_scale_example_backs_off():
    namespace = {"jax": jax, "jnp": jnp, "jamp": jamp}
    exec(example(jamp.DynamicLossScale), namespace)
    assert float(namespace["scale"].loss_scale) == 2.0**14
    assert int(namespace["scale"].counter) == 0
