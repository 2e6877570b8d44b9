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
            jamp.MicroBatchLossScale, jamp.accumulate_micro_batches,
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


def _public_objects():
    for module in (jamp, tracing):
        for name in module.__all__:
            obj = getattr(module, name)
            yield f"{module.__name__}.{name}", obj
            for attr, member in vars(obj).items() if inspect.isclass(obj) else ():
                if callable(member) and not attr.startswith("_"):
                    yield f"{module.__name__}.{name}.{attr}", member


def test_no_example_uses_a_name_after_deleting_it():
    """A docstring example that deletes a name (``del variables``) must not use it again
    (tracing.freeze's did: issue 32)."""
    for where, obj in _public_objects():
        match = EXAMPLE.search((inspect.getdoc(obj) or "") + "\n")
        if not match:
            continue
        deleted = set()
        for line in textwrap.dedent(match.group(1)).splitlines():
            code = line.split("#", 1)[0]
            used = set(re.findall(r"\b[A-Za-z_]\w*\b", code))
            assert not (used & deleted), f"{where}: uses {used & deleted} after del: {line!r}"
            if code.strip().startswith("del "):
                deleted |= {n.strip() for n in code.strip()[4:].split(",")}
