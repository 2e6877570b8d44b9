"""Every zoo model under every policy, check by check (see harness.CHECKS and README "Model zoo").

Each model's checks are a test class of their own, ``Test_<model>``: ``--dist loadscope`` then
gives each class to one xdist worker, where its checks share the model's runs and float32
references. (``--dist loadgroup`` with ``xdist_group`` marks would say the same, but it silently
stopped grouping with pytest 9.2: pytest-xdist issue #1386.) The slow models come first, so that
the quick ones fill both workers at the end.
"""
import pytest

from .harness import CHECKS, POLICIES, checks_for, policies_for
from .models import MODELS


def _checks_of(model):
    class ModelChecks:
        zoo_model = model

        @pytest.mark.parametrize("policy, check", [
            (policy, check) for policy in POLICIES for check in checks_for(model)
            if policy in policies_for(check)])
        def test_zoo(self, policy, check, zoo_run):
            CHECKS[check](zoo_run)

    ModelChecks.__name__ = ModelChecks.__qualname__ = f"Test_{model.name}"
    ModelChecks.__doc__ = f"{model.name}: {model.build.__doc__}"
    return pytest.mark.slow(ModelChecks) if model.slow else ModelChecks


for _model in sorted(MODELS, key=lambda m: not m.slow):
    globals()[f"Test_{_model.name}"] = _checks_of(_model)
