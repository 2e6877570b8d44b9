"""The fast loop (``-m "not slow"``) runs every property test on a few examples; the full suite
runs each with its own count, and so does a run of the fast tests with
``JAMP_TESTS_SETTINGS=full``; ``JAMP_TESTS_SETTINGS=fast`` gives any run the fast loop's settings
(tests/hypothesis_profiles.py, tests/conftest.py)."""
import os

import pytest
from hypothesis import settings

import tests.conftest
from tests.conftest import (
    CACHE_VARIABLE,
    compilation_cache_environment,
    compilation_cache_options,
    share_compilation_cache_entries,
    uses_fast_loop_settings,
)
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


def test_the_persistent_compilation_cache_is_on_unless_the_caller_chose_one_or_off():
    default = compilation_cache_environment({})
    assert default["JAX_COMPILATION_CACHE_DIR"].endswith(
        os.path.join(".cache", "jax-compilation", "main"))
    assert default["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "0"  # every program
    # each xdist worker a folder of its own: JAX writes an entry unlocked, in place
    worker = compilation_cache_environment({"PYTEST_XDIST_WORKER": "gw1"})
    assert worker["JAX_COMPILATION_CACHE_DIR"].endswith(os.path.join("jax-compilation", "gw1"))
    elsewhere = compilation_cache_environment({CACHE_VARIABLE: "/tmp/elsewhere"})
    assert elsewhere["JAX_COMPILATION_CACHE_DIR"] == os.path.join("/tmp/elsewhere", "main")
    assert compilation_cache_environment({CACHE_VARIABLE: "off"}) == {}
    assert compilation_cache_environment({"JAX_COMPILATION_CACHE_DIR": "/mine"}) == {}
    # a threshold the caller set is theirs
    kept = compilation_cache_environment({"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "1"})
    assert "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in kept


def test_this_run_compiles_with_the_cache_its_environment_chose():
    """The variables are set before JAX compiles (pytest_configure), and JAX reads them."""
    import jax

    chosen = tests.conftest.compilation_cache_chosen
    assert bool(chosen) is (os.environ.get(CACHE_VARIABLE) != "off"
                            and jax.config.jax_compilation_cache_dir == chosen.get(
                                "JAX_COMPILATION_CACHE_DIR"))  # else off, or the caller's own
    for name, value in chosen.items():
        current = getattr(jax.config, name.lower())
        assert current == type(current)(value)
    if chosen:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        assert os.path.basename(chosen["JAX_COMPILATION_CACHE_DIR"]) == worker


def test_every_folder_a_run_uses_gets_every_entry_any_folder_holds_as_a_link(tmp_path):
    """An xdist worker runs other tests from one run to the next: before the workers start, each
    worker's folder gets (links to) what every folder has cached, and keeps what it had."""
    for folder, entries in {"gw0": ["a-cache", "b-cache"], "gw1": ["b-cache", "c-cache"],
                            "main": ["d-cache", "notes.txt"]}.items():
        (tmp_path / folder).mkdir()
        for entry in entries:
            (tmp_path / folder / entry).write_text(f"{folder}/{entry}")
    share_compilation_cache_entries(str(tmp_path), ["gw0", "gw1", "gw2"])
    for folder in ("gw0", "gw1", "gw2"):
        cached = sorted(path.name for path in (tmp_path / folder).iterdir())
        assert cached == ["a-cache", "b-cache", "c-cache", "d-cache"]
        assert (tmp_path / folder / "d-cache").samefile(tmp_path / "main" / "d-cache")
    assert (tmp_path / "gw1" / "b-cache").read_text() == "gw1/b-cache"  # its own, kept
    assert sorted(path.name for path in (tmp_path / "main").iterdir()) == ["d-cache", "notes.txt"]
    share_compilation_cache_entries(str(tmp_path / "none yet"), ["gw0"])  # a fresh clone
    assert not any((tmp_path / "none yet" / "gw0").iterdir())


def test_past_its_size_the_cache_starts_over(tmp_path):
    for folder in ("gw0", "gw1"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / f"{folder}-cache").write_bytes(bytes(600))
    share_compilation_cache_entries(str(tmp_path), ["gw0", "gw1"], most_bytes=1000)
    assert [path.name for path in (tmp_path / "gw1").iterdir()] == []  # emptied, then made
    (tmp_path / "gw0" / "new-cache").write_bytes(bytes(600))
    share_compilation_cache_entries(str(tmp_path), ["gw0", "gw1"], most_bytes=1000)
    assert [path.name for path in (tmp_path / "gw1").iterdir()] == ["new-cache"]


def test_a_program_cached_from_two_folders_has_one_key(tmp_path):
    """What one xdist worker cached, another finds (the entries are shared between their folders
    before a run): the key must not depend on the folder, as jaxlib 0.10's did through XLA's GPU
    autotuning cache, which JAX puts inside the folder unless told not to."""
    import jax
    import numpy as np

    if not tests.conftest.compilation_cache_chosen:
        pytest.skip(f"the tests' compilation cache is off ({CACHE_VARIABLE} or the caller's own)")
    x = jax.device_put(np.ones((3, 5), np.float32))
    keys = []
    for folder in ("gw0", "gw1"):
        with compilation_cache_options(jax_compilation_cache_dir=str(tmp_path / folder)):
            jax.jit(lambda a: a * 7 - 2)(x).block_until_ready()  # a new function: compiled again
        keys.append(sorted(path.name for path in (tmp_path / folder).iterdir()))
    assert keys[0] and keys[0] == keys[1]
