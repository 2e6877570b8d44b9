"""The "Policies and per-module rules" snippet (docs/reference/transforming.md) runs, and the
reprs it shows are exact; the README and the docs spell primitives as jaxprs print them."""
import ast
import pathlib
import re

import jamp

ROOT = pathlib.Path(__file__).parents[1]
PAGE = (ROOT / "docs" / "reference" / "transforming.md").read_text()
PAGES = [ROOT / "README.md"] + sorted(page for page in (ROOT / "docs").glob("**/*.md")
                                      if "_build" not in page.parts)


def _block(heading):
    section = PAGE.split(heading, 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_policy_snippet_runs_and_its_reprs_are_what_it_says():
    code = _block("## Policies and per-module rules")
    lines = code.splitlines()
    namespace: dict = {}
    exec(compile(_block("## Transform a function"), "transforming.md", "exec"), namespace)
    checked = 0
    for node in ast.parse(code).body:
        segment = ast.get_source_segment(code, node)
        if isinstance(node, ast.Expr):
            value = eval(segment, namespace)
            following = lines[node.end_lineno] if node.end_lineno < len(lines) else ""
            if following.startswith("# Policy("):
                assert repr(value) == following[2:]
                checked += 1
        else:
            exec(segment, namespace)
    assert checked == 2


def test_docs_spell_primitives_as_jaxprs_print_them():
    # `lax.scatter_add` is the function; the primitive is `scatter-add`
    for page in PAGES:
        text = page.read_text()
        assert not re.search(r"(?<!lax\.)`scatter_(add|sub|mul|min|max)`", text), page
        for name in re.findall(r"`(scatter-\w+)`", text):
            jamp.Policy(promote=jamp.policy.PROMOTE | {name})  # known primitive names
