"""Shared pytest configuration.

Hypothesis profiles (tests/hypothesis_profiles.py): ``ci`` for the full suite, ``fast`` (a few
examples a property) when the run deselects slow tests (``-m "not slow"``, the fast loop), or the
one named by ``HYPOTHESIS_PROFILE``. ``JAMP_TESTS_SETTINGS`` chooses instead of the mark
expression: ``full`` keeps the full suite's settings (compile flags, example counts) in a run that
deselects slow tests, ``fast`` gives the fast loop's to a run that does not.
"""
import os
import subprocess
import sys

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # tests run on the CPU (DESIGN.md conventions)

# Most of the suite's time is XLA compiling small programs. Two XLA switches cut it (the tests
# judge what programs compute, not how fast; XLA_FLAGS given by the caller win):
# - Compiling without LLVM's optimisation passes (XLA's HLO passes still run): the suite and the
#   zoo take about a third less time (the zoo on jax 0.10 155 s against 358 s).
# - XLA's older CPU fusion emitters compile a small program about twice as fast as the newer ones
#   (~15 against ~33 ms on jaxlib 0.10) where XLA still has the switch. Newer XLA aborts the
#   process on an unknown flag, so a child process tries it first, once a run: pytest-xdist's
#   workers inherit the environment, answer included.
# Both together take the fast loop on jax 0.10 from 3.7 to 2.2 minutes. But jaxlib 0.10.2 with both
# can compute a value XLA duplicates into two fusions differently in the last bit: a maximum's
# gradient mask (``q == max(q, x)``) came out false, the gradient 60% off, where users' default
# flags give the right one (tests/test_suite_flags.py). So the full suite (and CI) compiles with
# the first switch only, and only the fast loop (-m "not slow") with both: it is for speed, CI for
# verdicts.
_FAST_COMPILE = "--xla_backend_optimization_level=0"
_LEGACY_FUSION = "--xla_cpu_use_fusion_emitters=false"


def _xla_accepts(flag: str) -> bool:
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {flag}"}
    probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                           capture_output=True, timeout=120)
    return probe.returncode == 0


def _set_compile_flags(fast_loop: bool) -> None:
    """Before JAX starts its backend (pytest_configure: test modules are imported after it)."""
    given = os.environ.get("XLA_FLAGS", "")
    switches = ("xla_cpu_use_fusion_emitters", "xla_backend_optimization_level")
    if "JAMP_TESTS_XLA_FLAGS" in os.environ or any(name in given for name in switches):
        return  # the caller's flags, or a worker inheriting its controller's choice
    chosen = [_FAST_COMPILE]
    if fast_loop and _xla_accepts(_LEGACY_FUSION):
        chosen.append(_LEGACY_FUSION)
    os.environ["XLA_FLAGS"] = " ".join([given, *chosen]).strip()
    os.environ["JAMP_TESTS_XLA_FLAGS"] = " ".join(chosen)


try:
    from hypothesis import settings

    import tests.hypothesis_profiles  # noqa: F401  (registers the profiles)
except ImportError:  # hypothesis is a test extra; property tests are skipped without it
    settings = None


SETTINGS_VARIABLE = "JAMP_TESTS_SETTINGS"


def uses_fast_loop_settings(markexpr: str, environ=os.environ) -> bool:
    """The fast loop's settings (both XLA switches, a few examples a property) go with
    ``-m "not slow"``; ``JAMP_TESTS_SETTINGS`` (``fast`` or ``full``) chooses instead."""
    chosen = environ.get(SETTINGS_VARIABLE, "")
    if chosen not in ("", "fast", "full"):
        raise pytest.UsageError(f"{SETTINGS_VARIABLE}={chosen!r}: expected 'fast' or 'full'")
    return chosen == "fast" if chosen else "not slow" in markexpr


def pytest_configure(config):
    # Runs before test modules are imported, so their @settings see the profile loaded here.
    fast_loop = uses_fast_loop_settings(config.option.markexpr or "")
    _set_compile_flags(fast_loop)
    if settings is not None:
        default = "fast" if fast_loop else "ci"
        settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", default))


@pytest.fixture(params=["quiet_remove_frames", "remove_frames"])
def traceback_filtering(request):
    """JAX's traceback filtering set to each mode that removes frames, for the test's length
    (tests/user_frames.py reads what a traceback shows then)."""
    import jax  # (here: the compile flags above are set before JAX is imported)

    before = jax.config.jax_traceback_filtering
    jax.config.update("jax_traceback_filtering", request.param)
    yield request.param
    jax.config.update("jax_traceback_filtering", before)
