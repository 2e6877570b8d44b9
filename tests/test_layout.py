"""The layout DESIGN.md asks for: no import circles in ``jamp/`` or ``tracing/`` (a module imports
only what stands below it), counting imports inside functions too (a deferred import hides a
circle, it does not remove it). Package ``__init__`` files only re-export and are left out."""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("jamp", "tracing")


def module_imports() -> dict[str, set[str]]:
    """module -> the project modules it imports (anywhere in its body)."""
    files = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = here.split(".")[: len(here.split(".")) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                found.update(t for t in [target] + [f"{target}.{a.name}" for a in node.names])
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
        graph[name] = {t for t in found if t in files and t != name}
    packages = {n for n, p in files.items() if p.name == "__init__.py"}
    return {n: deps - packages for n, deps in graph.items() if n not in packages}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        for dep in sorted(graph.get(node, ())):
            if dep in path:
                return path[path.index(dep):] + [dep]
            if dep not in done:
                cycle = visit(dep, path + [dep])
                if cycle:
                    return cycle
        done.add(node)
        return None

    for start in sorted(graph):
        if start not in done:
            cycle = visit(start, [start])
            if cycle:
                return cycle
    return None


def test_no_import_circles_in_jamp_or_tracing():
    graph = module_imports()
    assert {"jamp.interpreter", "jamp.region_trace", "tracing.program", "tracing.export"} <= set(graph)
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


@pytest.mark.parametrize("circular", [False, True])
def test_the_check_finds_a_circle(circular):
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"} if circular else set()}
    assert (find_cycle(graph) is not None) == circular


def test_one_registry_every_program_carrying_rule_says_how_the_probe_walks_it():
    """The rewriter, the region trace and the instrumented evaluator of find_nonfinite and
    value_ranges read one registry: a primitive whose rewrite rule enters programs (calls,
    control flow, custom derivatives, shard_map) also says how the evaluator walks it, or that
    it runs whole (opaque), so a new rule cannot leave the evaluator silently blind."""
    from jamp import interpreter, probe

    families = {"jamp.rules.calls", "jamp.rules.control_flow", "jamp.rules.custom_ad",
                "jamp.rules.parallel"}
    carrying = {name: entry for name, entry in interpreter.RULES.items()
                if entry.rewrite is not None and entry.rewrite.__module__ in families}
    assert {"jit", "scan", "while", "cond", "custom_vjp_call", "shard_map"} <= set(carrying)
    undecided = [name for name, e in carrying.items() if e.walk is None and not e.opaque]
    assert not undecided, f"no instrumented walk and not declared opaque: {undecided}"
    for name in ("scan", "while", "cond", "jit"):
        assert probe.walk_rules(name) is interpreter.RULES[name]  # the probe reads this registry
    assert probe.walk_rules("shard_map") is None  # opaque: one site
