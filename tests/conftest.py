"""Shared pytest configuration.

Hypothesis profiles (tests/hypothesis_profiles.py): ``ci`` for the full suite, ``fast`` (a few
examples a property) when the run deselects slow tests (``-m "not slow"``, the fast loop), or the
one named by ``HYPOTHESIS_PROFILE``.
"""
import os
import subprocess
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # tests run on the CPU (DESIGN.md conventions)

# Most of the suite's time is XLA compiling small programs. Two XLA switches cut it, and the tests
# judge what programs compute, not how fast, so they use one of them (XLA_FLAGS given by the caller
# win; set before JAX starts its backend):
# - XLA's older CPU fusion emitters compile a small program about twice as fast as the newer ones
#   (~15 against ~33 ms on jaxlib 0.10), ~40% off the suite where XLA still has the switch. Newer
#   XLA aborts the process on an unknown flag, so a child process tries it first, once a run:
#   pytest-xdist's workers inherit the environment, answer included.
# - Elsewhere (jaxlib 0.12), compiling without LLVM's optimisation passes (XLA's HLO passes still
#   run) takes about a third off.
# Never both: jaxlib 0.10.2 with both miscompiles the backward pass of a bfloat16 convolution
# followed by a maximum (a gradient 60% off: tests/test_suite_flags.py).
_LEGACY_FUSION = "--xla_cpu_use_fusion_emitters=false"
_FAST_COMPILE = "--xla_backend_optimization_level=0"


def _xla_accepts(flag: str) -> bool:
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {flag}"}
    probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                           capture_output=True, timeout=120)
    return probe.returncode == 0


_given = os.environ.get("XLA_FLAGS", "")
if "JAMP_TESTS_XLA_FLAGS" not in os.environ and not any(
        name in _given for name in ("xla_cpu_use_fusion_emitters", "xla_backend_optimization_level")):
    _fast = _LEGACY_FUSION if _xla_accepts(_LEGACY_FUSION) else _FAST_COMPILE
    os.environ["XLA_FLAGS"] = f"{_given} {_fast}".strip()
    os.environ["JAMP_TESTS_XLA_FLAGS"] = _fast  # (the probe ran: workers inherit its answer)

try:
    from hypothesis import settings

    import tests.hypothesis_profiles  # noqa: F401  (registers the profiles)
except ImportError:  # hypothesis is a test extra; property tests are skipped without it
    settings = None


def pytest_configure(config):
    # Runs before test modules are imported, so their @settings see the profile loaded here.
    if settings is not None:
        fast_loop = "not slow" in (config.option.markexpr or "")
        default = "fast" if fast_loop else "ci"
        settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", default))
