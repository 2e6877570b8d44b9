"""The zoo needs the ``zoo`` extra (Haiku, Equinox, diffrax, Keras): ``pip install -e .[test,zoo]``.

It is its own CI job (``EXTRAS=test,zoo ./scripts/test tests/zoo``); the default test run does not
collect this folder (``norecursedirs`` in pyproject.toml), so a missing extra fails here, loudly,
only when the zoo is asked for.
"""
import os

os.environ.setdefault("KERAS_BACKEND", "jax")  # before anything imports keras

import pytest

from .harness import ZooRun
from .models import MODELS

_RUNS: dict[tuple[str, str], ZooRun] = {}


@pytest.fixture
def zoo_run(request):
    """The (model, policy) run shared by that pair's checks (computed once per process)."""
    model, policy = request.node.callspec.params["model"], request.node.callspec.params["policy"]
    key = (model.name, policy)
    if key not in _RUNS:
        _RUNS[key] = ZooRun(model, policy)
    return _RUNS[key]


def pytest_collection_modifyitems(items):
    # One xdist worker per model: its checks share its runs and float32 references (--dist loadgroup).
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if "model" in params and "policy" in params:
            item.add_marker(pytest.mark.xdist_group(params["model"].name))
            if params["model"].slow:
                item.add_marker(pytest.mark.slow)
