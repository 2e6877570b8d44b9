"""Shared pytest configuration.

Hypothesis profiles: ``ci`` (the default) is derandomized and keeps no example database, so a
property failure reproduces on every run and machine; ``dev`` searches randomly and remembers
failures locally. Pick one with ``HYPOTHESIS_PROFILE=dev pytest``.
"""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # tests run on the CPU (DESIGN.md conventions)

try:
    from hypothesis import settings
except ImportError:  # hypothesis is a test extra; property tests are skipped without it
    settings = None

if settings is not None:
    settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
    settings.register_profile("dev", print_blob=True)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
