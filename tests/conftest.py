"""Shared pytest configuration.

Hypothesis profiles (tests/hypothesis_profiles.py): ``ci`` for the full suite, ``fast`` (a few
examples a property) when the run deselects slow tests (``-m "not slow"``, the fast loop), or the
one named by ``HYPOTHESIS_PROFILE``.
"""
import os
import subprocess
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # tests run on the CPU (DESIGN.md conventions)

# Most of the suite's time is XLA compiling small programs, and most of that is LLVM optimising
# the CPU code. The tests judge what programs compute, not how fast, so they compile without
# LLVM's optimisation passes (XLA's HLO passes still run): the suite and the zoo take about a
# third less time. Set before JAX starts its backend; XLA_FLAGS given by the caller win.
_FAST_COMPILE = "--xla_backend_optimization_level=0"
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FAST_COMPILE}".strip()

# XLA's newer CPU fusion emitters compile a small program about twice as slowly as the older ones
# (~33 against ~15 ms on jaxlib 0.10): the older ones take ~40% off the suite where XLA still has
# the switch. Newer XLA aborts the process on an unknown flag, so a child process tries it first,
# once a run: pytest-xdist's workers inherit the environment, answer included.
_LEGACY_FUSION = "--xla_cpu_use_fusion_emitters=false"


def _xla_accepts(flag: str) -> bool:
    env = {**os.environ, "XLA_FLAGS": f"{os.environ['XLA_FLAGS']} {flag}"}
    probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                           capture_output=True, timeout=120)
    return probe.returncode == 0


if "xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"] and \
        "JAMP_TESTS_FUSION_PROBED" not in os.environ:
    os.environ["JAMP_TESTS_FUSION_PROBED"] = "1"
    if _xla_accepts(_LEGACY_FUSION):
        os.environ["XLA_FLAGS"] += f" {_LEGACY_FUSION}"

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
