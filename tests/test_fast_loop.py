"""The fast loop (``-m "not slow"``) runs every property test on a few examples; the full suite
runs each with its own count, and so does a run of the fast tests with
``JAMP_TESTS_SETTINGS=full``; ``JAMP_TESTS_SETTINGS=fast`` gives any run the fast loop's settings
(tests/hypothesis_profiles.py, tests/conftest.py)."""
import os

import pytest
from hypothesis import settings

from tests.conftest import uses_fast_loop_settings
from tests.hypothesis_profiles import FAST_EXAMPLES, examples


def test_the_profile_follows_the_mark_expression(request):
    fast_loop = uses_fast_loop_settings(request.config.option.markexpr or "")
    name = os.environ.get("HYPOTHESIS_PROFILE", "fast" if fast_loop else "ci")
    assert settings.default.max_examples == settings.get_profile(name).max_examples
    assert settings.get_profile("fast").max_examples == FAST_EXAMPLES
    assert settings.get_profile("fast").derandomize and settings.get_profile("ci").derandomize
    # a test's own count holds in the full suite and is capped in the fast loop
    assert examples(25) == (min(25, FAST_EXAMPLES) if name == "fast" else 25)


@pytest.mark.parametrize("markexpr, variable, fast", [
    ("", None, False),
    ("not slow", None, True),
    ("not slow", "full", False),  # the fast tests with the suite's settings
    ("", "fast", True),  # CI's zoo on its older JAX version: the fast loop's settings
    ("slow", None, False),
])
def test_the_settings_follow_the_mark_expression_unless_the_variable_chooses(markexpr, variable,
                                                                            fast):
    environ = {} if variable is None else {"JAMP_TESTS_SETTINGS": variable}
    assert uses_fast_loop_settings(markexpr, environ) is fast


def test_an_unknown_settings_name_is_refused_naming_the_variable():
    with pytest.raises(pytest.UsageError, match="JAMP_TESTS_SETTINGS='quick'"):
        uses_fast_loop_settings("not slow", {"JAMP_TESTS_SETTINGS": "quick"})
