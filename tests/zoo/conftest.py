"""The zoo needs the ``zoo`` extra (Haiku, Equinox, diffrax, Keras): ``pip install -e .[test,zoo]``.

It is its own CI job (``EXTRAS=test,zoo ./scripts/test tests/zoo``); the default test run does not
collect this folder (``norecursedirs`` in pyproject.toml), so a missing extra fails here, loudly,
only when the zoo is asked for.
"""
import os

os.environ.setdefault("KERAS_BACKEND", "jax")  # before anything imports keras

import gc

import jax
import pytest

from . import harness
from .harness import ZooRun
from .models import MODELS

_RUNS: dict[tuple[str, str], ZooRun] = {}


@pytest.fixture
def zoo_run(request):
    """The (model, policy) run shared by that pair's checks (computed once per process)."""
    model, policy = request.cls.zoo_model, request.node.callspec.params["policy"]
    key = (model.name, policy)
    if any(name != model.name for name, _ in _RUNS):
        _forget_other_models(model.name)
    if key not in _RUNS:
        _RUNS[key] = ZooRun(model, policy)
    return _RUNS[key]


def _forget_other_models(name):
    """A worker runs one model's checks together (``--dist loadscope``, see test_zoo.py): when
    the next model starts, drop the last one's runs, float32 references and JAX's compiled
    programs, so that a worker holds one model's programs at a time, not all it has run."""
    for key in [k for k in _RUNS if k[0] != name]:
        del _RUNS[key]
    for other in [k for k in harness._FLOAT32_RUNS if k != name]:
        del harness._FLOAT32_RUNS[other]
    jax.clear_caches()
    gc.collect()

