"""The fast loop (``-m "not slow"``) runs every property test on a few examples; the full suite
runs each with its own count (tests/hypothesis_profiles.py, tests/conftest.py)."""
import os

from hypothesis import settings

from tests.hypothesis_profiles import FAST_EXAMPLES, examples


def test_the_profile_follows_the_mark_expression(request):
    fast_loop = "not slow" in (request.config.option.markexpr or "")
    name = os.environ.get("HYPOTHESIS_PROFILE", "fast" if fast_loop else "ci")
    assert settings.default.max_examples == settings.get_profile(name).max_examples
    assert settings.get_profile("fast").max_examples == FAST_EXAMPLES
    assert settings.get_profile("fast").derandomize and settings.get_profile("ci").derandomize
    # a test's own count holds in the full suite and is capped in the fast loop
    assert examples(25) == (min(25, FAST_EXAMPLES) if name == "fast" else 25)
