"""The README's "Policies and per-module rules" snippet runs, and the reprs it shows are exact."""
import ast
import pathlib
import re
import types

import jax.numpy as jnp

import jamp

README = (pathlib.Path(__file__).parents[1] / "README.md").read_text()


def _block(heading):
    section = README.split(heading, 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_policy_snippet_runs_and_its_reprs_are_what_it_says():
    code = _block("### Policies and per-module rules")
    lines = code.splitlines()
    namespace = {"jamp": jamp, "jnp": jnp, "model": types.SimpleNamespace(apply=lambda *a: a)}
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


def test_readme_spells_primitives_as_jaxprs_print_them():
    # `lax.scatter_add` is the function; the primitive is `scatter-add`
    assert not re.search(r"(?<!lax\.)`scatter_(add|sub|mul|min|max)`", README)
    for name in re.findall(r"`(scatter-\w+)`", README):
        jamp.Policy(promote=jamp.policy.PROMOTE | {name})  # known primitive names
