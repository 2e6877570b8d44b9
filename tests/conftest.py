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


# JAX's persistent compilation cache (jax.config's jax_compilation_cache_dir), every program
# cached: nearly half of the fast loop's time is XLA compiling ~8,700 programs (the rest of the
# compile work, lowering to MLIR, JAX does before it can look a program up), and the same programs
# come back on every run of an unchanged test (hypothesis is derandomized here). A second run took
# the fast loop on jax 0.10 from 289 to 198 s; a fresh clone's first run fills the cache at no
# cost to its own time (benchmarks/README.md, issue 33's thirty-second pass). Keys hold the
# program, the XLA flags and jaxlib's version, so both JAX versions share the folders. An entry is
# the executable XLA would build again: the tests judge what programs compute, and count
# compilations by JAX's backend-compile event, which a cache hit records too
# (tests/jaxpr_utils.count_compiles). Each test process has a folder of its own (an xdist
# worker's name): JAX writes an entry in place, unlocked, so a process reading an entry another
# is writing would find it damaged (JAX then warns and compiles); its eviction (a size limit)
# locks, but scans the whole folder at every write, which took the fast loop past 7 minutes. A
# test's own processes use its folder while it waits on them (tests/test_distributed.py, whose
# processes run together, turns the cache off for them). JAX_COMPILATION_CACHE_DIR given by the
# caller wins; JAMP_TESTS_COMPILATION_CACHE names another folder, or is ``off``.
CACHE_VARIABLE = "JAMP_TESTS_COMPILATION_CACHE"
CACHE_VARIABLES = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                   "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES")
_DEFAULT_CACHE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                              ".cache", "jax-compilation")


def compilation_cache_environment(environ=os.environ) -> dict[str, str]:
    """The JAX_* variables that turn the persistent compilation cache on for this test process
    (none where the caller chose a cache, or ``off``)."""
    chosen = environ.get(CACHE_VARIABLE, "")
    if chosen == "off" or "JAX_COMPILATION_CACHE_DIR" in environ:
        return {}
    folder = os.path.join(chosen or _DEFAULT_CACHE, environ.get("PYTEST_XDIST_WORKER", "main"))
    wanted = dict(zip(CACHE_VARIABLES, (folder, "0", "0")))
    return {name: value for name, value in wanted.items() if name not in environ}


# What this test process set (read by tests/test_fast_loop.py).
compilation_cache_chosen: dict[str, str] = {}


def _use_compilation_cache(config) -> None:
    if getattr(config.option, "numprocesses", None):
        return  # an xdist controller: its workers compile, each choosing its folder
    chosen = compilation_cache_environment()
    compilation_cache_chosen.update(chosen)
    # The processes tests start inherit these, and JAX reads them at import; a plugin
    # (jaxtyping's) has imported JAX in this process already, so its options are set too.
    os.environ.update(chosen)
    jax = sys.modules.get("jax")
    for name, value in chosen.items() if jax is not None else ():
        option = name.lower()
        current = getattr(jax.config, option)
        jax.config.update(option, value if current is None else type(current)(value))


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
    _use_compilation_cache(config)
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
