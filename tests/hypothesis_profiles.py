"""Hypothesis profiles, and the per-test example counts that follow them.

``ci`` (the default) is derandomized and keeps no example database, so a property failure
reproduces on every run and machine; ``dev`` searches randomly and remembers failures locally;
``fast`` is ``ci`` with at most ``FAST_EXAMPLES`` examples a test, loaded by tests/conftest.py for
the fast loop (``-m "not slow"``): every property still runs there, on a few examples, and the
full suite searches with each test's own count. Pick a profile with ``HYPOTHESIS_PROFILE=dev``.
"""
from hypothesis import settings

# Compiling and running a random program costs ~0.3-1 s a example on 2 cores; three examples
# (derandomized: the simplest program first, then two drawn ones) keep each property < ~3 s.
FAST_EXAMPLES = 3

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("dev", print_blob=True)
settings.register_profile("fast", parent=settings.get_profile("ci"), max_examples=FAST_EXAMPLES)


def examples(n: int) -> int:
    """``n`` examples under the loaded profile: ``n`` in the full suite, fewer in the fast loop.

    A test's explicit ``@settings(max_examples=...)`` overrides the profile, so tests pass their
    count through here. Decorators run at import, after conftest's ``pytest_configure`` has loaded
    the profile.
    """
    return min(n, settings.default.max_examples)
