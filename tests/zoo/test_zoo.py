"""Every zoo model under every policy, check by check (see harness.CHECKS and README "Model zoo")."""
import pytest

from .harness import CHECKS, POLICIES
from .models import MODELS


@pytest.mark.parametrize("check", list(CHECKS))
@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("model", MODELS, ids=[m.name for m in MODELS])
def test_zoo(model, policy, check, zoo_run):
    CHECKS[check](zoo_run)
