"""Shared pytest configuration.

Hypothesis profiles: ``ci`` (the default) is derandomized and keeps no example database, so a
property failure reproduces on every run and machine; ``dev`` searches randomly and remembers
failures locally. Pick one with ``HYPOTHESIS_PROFILE=dev pytest``.
"""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # tests run on the CPU (DESIGN.md conventions)

# Most of the suite's time is XLA compiling small programs, and most of that is LLVM optimising
# the CPU code. The tests judge what programs compute, not how fast, so they compile without
# LLVM's optimisation passes (XLA's HLO passes still run): the suite and the zoo take about a
# third less time. Set before JAX starts its backend; XLA_FLAGS given by the caller win.
_FAST_COMPILE = "--xla_backend_optimization_level=0"
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FAST_COMPILE}".strip()

try:
    from hypothesis import settings
except ImportError:  # hypothesis is a test extra; property tests are skipped without it
    settings = None

if settings is not None:
    settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
    settings.register_profile("dev", print_blob=True)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
