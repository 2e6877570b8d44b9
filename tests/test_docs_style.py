"""Code blocks of the documentation fit the site's content column: at most 88 characters a line.

docs/_static/jamp.css sizes the column so that 88 monospace characters fit at a 1280 px window
(./scripts/docs-check measures the built pages); a longer line makes the reader scroll sideways.
Checked on every page whose blocks tests/test_docs_blocks.py runs (docs/**/*.md and README.md),
for every fenced code block of any language (```python, ```bash, ```text, ```{code-block}); the
other MyST directives (```{toctree}, ```{eval-rst}, :::{note}) hold no displayed code lines.
"""
import re

import pytest

from tests.test_docs_blocks import PAGES, ROOT

MAX_CODE_LINE = 88
# A fence: three or more backticks or tildes, then the info string (language or {directive}).
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`]*?)[ \t]*$")
CODE_DIRECTIVES = ("{code-block}", "{code}", "{sourcecode}")


def code_lines(text):
    """(line number, line) for each line inside a fenced code block, its fence's indent removed."""
    lines, fence, indent, is_code = [], None, "", False
    for number, line in enumerate(text.splitlines(), start=1):
        match = FENCE.match(line)
        if fence is None:
            if match:
                fence, indent = match["fence"], match["indent"]
                info = match["info"]
                is_code = not info.startswith("{") or info.startswith(CODE_DIRECTIVES)
            continue
        # Closed by the same character, at least as many of them, and no info string.
        if (match and match["fence"][0] == fence[0] and len(match["fence"]) >= len(fence)
                and not match["info"]):
            fence = None
            continue
        if is_code:
            lines.append((number, line[len(indent):] if line.startswith(indent) else line))
    return lines


def long_code_lines(page, root=ROOT):
    """``page:line: N characters: line`` for each code line over MAX_CODE_LINE characters."""
    where = page.relative_to(root)
    return [f"{where}:{number}: {len(line)} characters: {line.strip()[:60]}"
            for number, line in code_lines(page.read_text(encoding="utf-8"))
            if len(line) > MAX_CODE_LINE]


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_code_lines_fit_the_content_column(page):
    too_long = long_code_lines(page)
    if too_long:
        pytest.fail(f"code lines over {MAX_CODE_LINE} characters (wrap them):\n"
                    + "\n".join(too_long), pytrace=False)


def test_code_lines_of_every_fenced_block_are_found():
    text = ("intro, not code " + "x" * 100 + "\n"
            "```python\na = 1\n```\n"
            "```{toctree}\nguides/a-page-name\n```\n"
            "  ```bash\n  ls -l\n  ```\n"
            "````text\n```\ninner\n````\n"
            "```{code-block} python\nb = 2\n```\n")
    assert code_lines(text) == [(3, "a = 1"), (9, "ls -l"), (12, "```"), (13, "inner"),
                                (16, "b = 2")]


def test_a_long_code_line_is_named_by_page_and_line(tmp_path):
    page = tmp_path / "docs" / "page.md"
    page.parent.mkdir()
    page.write_text("# t\n\n```python\nshort = 1\n" + "y = " + "1" * 90 + "\n```\n")
    assert long_code_lines(page, root=tmp_path) == [
        f"docs/page.md:5: 94 characters: y = {'1' * 56}"]
