"""A pytest plugin: where a test run's compile work goes, summed over its processes.

JAX reports each stage of compiling a program through ``jax.monitoring``: tracing to a jaxpr,
lowering it to MLIR, XLA's compilation (which includes a lookup in the persistent compilation
cache), and each hit of that cache. This plugin adds up those durations and counts in every test
process (each xdist worker hands its totals to the controller when it ends) and prints them after
the run, with the programs (by the name JAX compiles them under: ``jit_<function>``, or the
primitive of an eager operation) whose lowering and compiling took longest in all. Issue 33's
thirty-second pass used it to find that XLA's compilations and the lowering before them took ~70%
of the fast loop's test time.

Usage (from the repository root; any pytest arguments)::

    PYTHONPATH=$PWD .venv/bin/python -m pytest -n 2 -m "not slow" -q -p benchmarks.compile_events
"""
from __future__ import annotations

import collections
import json

import pytest

# JAX's event names (jax._src.dispatch, jax._src.compiler): the stages of a compilation.
STAGES = {
    "/jax/core/compile/jaxpr_trace_duration": "tracing to a jaxpr",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lowering to MLIR",
    "/jax/core/compile/backend_compile_duration": "XLA compiling (cache lookups included)",
    "/jax/compilation_cache/cache_retrieval_time_sec": "reading persistent-cache hits",
}
_LOWER_AND_COMPILE = ("/jax/core/compile/jaxpr_to_mlir_module_duration",
                      "/jax/core/compile/backend_compile_duration")
_OUTPUT_KEY = "jax_compile_events"
_COSTLIEST_SHOWN = 15
_seconds: collections.Counter[str] = collections.Counter()
_counts: collections.Counter[str] = collections.Counter()
_by_program: collections.Counter[str] = collections.Counter()  # lowering and compiling
_from_workers: list[dict] = []


def _listen(event: str, duration: float, fun_name: str = "?", **kwargs) -> None:
    if event in STAGES:
        _seconds[event] += duration
        _counts[event] += 1
    if event in _LOWER_AND_COMPILE:
        _by_program[fun_name] += duration


def pytest_configure(config):
    import jax.monitoring

    jax.monitoring.register_event_duration_secs_listener(_listen)


def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: its totals go to the controller
        workeroutput[_OUTPUT_KEY] = json.dumps(
            {"seconds": _seconds, "counts": _counts, "by_program": _by_program})


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    sent = getattr(node, "workeroutput", {}).get(_OUTPUT_KEY)
    if sent:
        _from_workers.append(json.loads(sent))


def pytest_terminal_summary(terminalreporter):
    seconds, counts = collections.Counter(_seconds), collections.Counter(_counts)
    by_program = collections.Counter(_by_program)
    for worker in _from_workers:
        seconds.update(worker["seconds"])
        counts.update(worker["counts"])
        by_program.update(worker["by_program"])
    terminalreporter.section("JAX compile work, summed over the test processes")
    for event, stage in STAGES.items():
        terminalreporter.write_line(
            f"{seconds[event]:9.1f} s {counts[event]:8d} x  {stage} ({event})")
    terminalreporter.write_line(f"costliest programs to lower and compile (of {len(by_program)}):")
    for name, total in by_program.most_common(_COSTLIEST_SHOWN):
        terminalreporter.write_line(f"{total:9.1f} s  {name}")
