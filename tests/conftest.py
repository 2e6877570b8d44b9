"""Shared pytest configuration.

Hypothesis profiles (tests/hypothesis_profiles.py): ``ci`` for the full suite, ``fast`` (a few
examples a property) when the run deselects slow tests (``-m "not slow"``, the fast loop), or the
one named by ``HYPOTHESIS_PROFILE``. ``JAMP_TESTS_SETTINGS`` chooses instead of the mark
expression: ``full`` keeps the full suite's settings (compile flags, example counts) in a run that
deselects slow tests, ``fast`` gives the fast loop's to a run that does not.
"""
import contextlib
import os
import shutil
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
# the fast loop on jax 0.10 from 240 to 156 s, 99.5% of its programs found in the cache; a fresh
# clone's first run fills it at no cost to its own time (benchmarks/README.md, issue 33's
# thirty-second pass). Keys hold the program, the XLA flags and jaxlib's version, so both JAX
# versions share the folders. An entry is the executable XLA would build again: the tests judge
# what programs compute, and count compilations by JAX's backend-compile event, which a cache hit
# records too (tests/jaxpr_utils.count_compiles).
# Each test process writes a folder of its own (an xdist worker's name): JAX writes an entry in
# place, unlocked, so a process reading an entry another is writing would find it damaged (JAX
# then warns and compiles); its eviction (a size limit) locks, but scans the whole folder at every
# write, which took the fast loop past 7 minutes. Which tests a worker runs changes from run to
# run, so before the workers start, the run's first process links every entry of any folder into
# each worker's (share_compilation_cache_entries): JAX never rewrites an entry, so a linked file
# is only ever read; past 1 GiB in all it starts over. A test's own processes use its folder
# while it waits on them (tests/test_distributed.py, whose processes run together, turns the
# cache off for them).
# JAX_COMPILATION_CACHE_DIR given by the caller wins; JAMP_TESTS_COMPILATION_CACHE names another
# folder, or is ``off``.
CACHE_VARIABLE = "JAMP_TESTS_COMPILATION_CACHE"
# (The last: no XLA GPU autotuning cache, which JAX otherwise puts in a folder inside the cache's
# and jaxlib 0.10 hashes that folder's path into every key: each worker's folder gave its own
# keys, and an entry made on one worker was never found on another.)
CACHE_VARIABLES = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
                   "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES",
                   "JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES")
_DEFAULT_CACHE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                              ".cache", "jax-compilation")
_ENTRY_SUFFIX = "-cache"  # (JAX's file cache: <key>-cache)
# Nothing evicts an entry (JAX's eviction scans its folder at every write, above), so past this
# size the cache starts over: a full CI run on both versions leaves ~200 MB.
_CACHE_MOST_BYTES = 1 << 30


def compilation_cache_root(environ=os.environ) -> str | None:
    """The folder whose subfolders the tests' processes cache in; None where the caller chose
    a cache of their own, or ``off``."""
    chosen = environ.get(CACHE_VARIABLE, "")
    if chosen == "off" or "JAX_COMPILATION_CACHE_DIR" in environ:
        return None
    return chosen or _DEFAULT_CACHE


def compilation_cache_environment(environ=os.environ) -> dict[str, str]:
    """The JAX_* variables that turn the persistent compilation cache on for this test process
    (none where the caller chose a cache, or ``off``)."""
    root = compilation_cache_root(environ)
    if root is None:
        return {}
    folder = os.path.join(root, environ.get("PYTEST_XDIST_WORKER", "main"))
    wanted = dict(zip(CACHE_VARIABLES, (folder, "0", "0", "none")))
    return {name: value for name, value in wanted.items() if name not in environ}


def share_compilation_cache_entries(root: str, folders: list[str],
                                    most_bytes: int = _CACHE_MOST_BYTES) -> None:
    """Every entry any folder under ``root`` holds, linked into each of ``folders`` (names under
    ``root``) that lacks it; past ``most_bytes`` of entries in all, the cache starts over."""
    entries: dict[str, str] = {}
    for folder in sorted(os.scandir(root), key=lambda f: f.name) if os.path.isdir(root) else ():
        for entry in os.scandir(folder.path) if folder.is_dir() else ():
            if entry.name.endswith(_ENTRY_SUFFIX):
                entries.setdefault(entry.name, entry.path)
    if sum(os.stat(path).st_size for path in entries.values()) > most_bytes:
        shutil.rmtree(root, ignore_errors=True)  # (programs of tests since changed, mostly)
        entries = {}
    for name in folders:
        folder = os.path.join(root, name)
        os.makedirs(folder, exist_ok=True)
        present = set(os.listdir(folder))
        for entry_name, source in entries.items():
            if entry_name not in present:
                try:
                    os.link(source, os.path.join(folder, entry_name))
                except FileExistsError:  # (another test run, at the same moment)
                    pass
                except OSError:  # a filesystem without hard links: each folder keeps its own
                    return


@contextlib.contextmanager
def compilation_cache_options(**options):
    """JAX's compilation-cache options (``jax_compilation_cache_dir=...``) set for the block,
    then restored; JAX decides once a process whether it uses the cache, so it is made to decide
    again at both ends."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    before = {name: getattr(jax.config, name) for name in options}
    for name, value in options.items():
        jax.config.update(name, value)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        for name, value in before.items():
            jax.config.update(name, value)
        compilation_cache.reset_cache()


# What this test process set (read by tests/test_fast_loop.py).
compilation_cache_chosen: dict[str, str] = {}


def _use_compilation_cache(config) -> None:
    root = compilation_cache_root()
    # (off, or a worker: the run's first process has shared the entries)
    if root is not None and "PYTEST_XDIST_WORKER" not in os.environ:
        if getattr(config.option, "numprocesses", None):  # an xdist controller: compiles nothing
            share_compilation_cache_entries(root, [f"gw{i}" for i in range(len(config.option.tx))])
            return
        share_compilation_cache_entries(root, ["main"])
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
