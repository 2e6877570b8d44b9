"""Sphinx configuration for the jamp documentation (built by ./scripts/docs with -W)."""
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # document the checkout being built, not another installed copy
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jamp  # noqa: E402  (after the path and platform are set)
from sphinx.util.inspect import TypeAliasForwardRef  # noqa: E402

project = "jamp"
author = "the jamp authors"
copyright = "the jamp authors"
release = jamp.__version__
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build", "_templates"]
root_doc = "index"

# API reference: one generated page per public name (docs/api.md lists jamp.__all__ and
# tracing.__all__; tests/test_docs_blocks.py checks that the lists agree).
autosummary_generate = True
templates_path = ["_templates"]  # autosummary/class.rst: a class page lists its members once
autodoc_member_order = "bysource"
autodoc_typehints = "description"
# Keep jax.typing.DTypeLike by name (``policy: Policy | DTypeLike | None``) instead of expanding
# it to ``str | type[Any] | dtype | SupportsDType``; the modules' annotations are strings.
autodoc_type_aliases = {"DTypeLike": "DTypeLike"}
# Inside a union, Sphinx 9 prints the alias's stand-in by its repr,
# "TypeAliasForwardRef('DTypeLike')": print its name, as it does outside unions.
TypeAliasForwardRef.__repr__ = lambda self: self.name
autoclass_content = "class"  # the class docstring documents the constructor's arguments
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3

html_theme = "sphinx_book_theme"
html_title = f"jamp {release}"
nitpicky = True  # every cross-reference must resolve, except the ones listed here
nitpick_ignore_regex = [
    # Types from numpy, jax and the standard library in type hints: the build runs offline, so
    # there is no intersphinx inventory to resolve them against. (collections.abc: what ruff's
    # pyupgrade rules write for typing.Callable, Sequence and Iterable.)
    ("py:class", r"(numpy|jax|jaxlib|inspect|collections\.abc)\..*"),
    ("py:class", r"Signature"),
    # jax.typing.DTypeLike, imported by name: autodoc prints the bare alias.
    ("py:class", r"DTypeLike"),
    # Report.unmatched_rules holds these; the class is not public (not in jamp.__all__).
    ("py:class", r"jamp\.policy\.UnmatchedRule"),
    # NonFinite.remedies and Ranges.entries hold these records; they are not public either.
    ("py:class", r"jamp\.nonfinite\.Remedy"),
    ("py:class", r"jamp\.ranges\.RangeEntry"),
    # Records held by public results, not public themselves: Report.float8_kept and
    # .float8_check, TuneResult.scopes, and the re-trace callback type of traced programs.
    ("py:class", r"(jamp\.report\.)?KeptDot"),
    ("py:class", r"jamp\.float8_check\.Float8Check"),
    ("py:class", r"(jamp\.tune\.)?ScopeChoice"),
    ("py:class", r"(tracing\.program\.)?Retrace"),
    # NonFinite.produced_by, Report.collectives and WeightsTuneResult.scopes hold these records;
    # not public either.
    ("py:class", r"(jamp\.nonfinite\.)?Producer"),
    ("py:class", r"jamp\.collectives\.CollectiveReport"),
    ("py:class", r"(jamp\.tune\.)?WeightsScope"),
    # optax's own name for what its constructors return (no intersphinx offline).
    ("py:class", r"optax\..*"),
]

html_theme_options = {"show_toc_level": 2}
# Wrapped table cells and a content column that holds 88-character code lines at 1280 px
# (./scripts/docs-check measures both).
html_static_path = ["_static"]
html_css_files = ["jamp.css"]
