"""Every ```python block of the documentation runs as written.

The blocks of one page run in order in one fresh namespace, as a reader would paste them: a block
may use what an earlier block of the same page defined, never a name the page does not show.
Tracebacks point at the page and its line. ``docs/api.md`` must list every public name.
"""
import pathlib
import re
import sys
import types
import warnings

import pytest

import jamp
import tracing

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

# Pages outside docs/ whose blocks must run too.
EXTRA_PAGES: list[pathlib.Path] = [ROOT / "README.md"]

PAGES = sorted(DOCS.glob("**/*.md")) + EXTRA_PAGES
PAGES = [page for page in PAGES if "_build" not in page.parts]

# A fence opens with ```python at the start of a line and closes with the next ``` line.
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def python_blocks(text):
    """(first line number of the code, code) for each ```python block, in order."""
    return [(text.count("\n", 0, match.start(1)) + 1, match.group(1))
            for match in FENCE.finditer(text)]


# A warning of jamp or tracing that a page does not expect (inside warnings.catch_warnings or
# pytest.warns) is a mistake in the page, such as a rule that matches nothing.
LIBRARY_WARNINGS = (jamp.AutocastWarning, jamp.UnmatchedRuleWarning,
                    jamp.UnsupportedPrimitiveWarning, jamp.Float8FallbackWarning,
                    tracing.TracerWarning)


def run_page(page):
    # "__main__", as in a script or a REPL: tracing's leak check walks the globals of user code
    # only, and a module name that is not imported would pass for a library's.
    # The page's module stands in for sys.modules["__main__"] while it runs: under
    # `python -m pytest` that entry is pytest's own module, which the leak check skips as a
    # library's.
    main = types.ModuleType("__main__")
    namespace = main.__dict__
    # Only that entry is swapped back (mock.patch.dict would drop the modules a page imports).
    saved_main = sys.modules["__main__"]
    sys.modules["__main__"] = main
    try:
        with warnings.catch_warnings():
            for category in LIBRARY_WARNINGS:
                warnings.simplefilter("error", category)
            for line, code in python_blocks(page.read_text()):
                # Padding keeps line numbers in tracebacks equal to the page's.
                exec(compile("\n" * (line - 1) + code, str(page), "exec"), namespace)
    finally:
        sys.modules["__main__"] = saved_main


@pytest.mark.slow  # a guide compiles many small programs (about 20 s on a busy 2-core machine)
@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_page_blocks_run_in_order(page):
    run_page(page)


def test_blocks_are_found_with_their_line_numbers():
    text = "intro\n```python\na = 1\n```\n\n```bash\nls\n```\n```python\nb = a + 1\n```\n"
    assert python_blocks(text) == [(3, "a = 1\n"), (10, "b = a + 1\n")]


def test_a_block_cannot_use_a_name_no_earlier_block_defines(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```python\nx = 1\n```\n\ntext\n\n```python\ny = x + undefined_name\n```\n")
    with pytest.raises(NameError, match="undefined_name") as info:
        run_page(page)
    assert info.traceback[-1].path == page and info.traceback[-1].lineno + 1 == 8  # 0-based


def test_an_unexpected_library_warning_fails_the_page(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```python\nimport jax.numpy as jnp, jamp\n"
                    "policy = jamp.Policy(rules=(('haed', None),))\n"
                    "jamp.autocast_transform(lambda x: x @ x, policy)(jnp.ones((2, 2)))\n```\n")
    with pytest.raises(jamp.UnmatchedRuleWarning, match="haed"):
        run_page(page)


def test_a_page_may_expect_a_warning(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```python\nimport pytest, jax.numpy as jnp, jamp\n"
                    "policy = jamp.Policy(rules=(('haed', None),))\n"
                    "with pytest.warns(jamp.UnmatchedRuleWarning):\n"
                    "    jamp.autocast_transform(lambda x: x @ x, policy)(jnp.ones((2, 2)))\n```\n")
    run_page(page)


def test_pages_are_collected():
    assert DOCS / "index.md" in PAGES
    assert ROOT / "README.md" in PAGES
    for page in ["guides/choosing-a-policy", "guides/training-with-flax",
                 "guides/debugging-precision", "guides/checking-traces", "guides/freezing",
                 "guides/tuning", "guides/many-devices", "guides/training-in-half-the-memory", "guides/float8", "performance",
                 "migration/from-torch", "migration/from-jmp", "migration/from-flax",
                 "reference/transforming", "reference/dtypes"]:
        assert DOCS / f"{page}.md" in PAGES


def test_api_reference_lists_every_public_name():
    listed = set(re.findall(r"^   ((?:jamp|tracing)\.\w+)$", (DOCS / "api.md").read_text(),
                            re.MULTILINE))
    public = {f"jamp.{name}" for name in jamp.__all__} | {f"tracing.{name}" for name in
                                                          tracing.__all__}
    assert sorted(public - listed) == [], "public names missing from docs/api.md"
    assert sorted(listed - public) == [], "docs/api.md lists names that are not public"
