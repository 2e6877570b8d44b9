"""The sides of ``region_overhead.py`` counted in CPU instructions, where wall time cannot tell.

On a shared virtual machine (this project's: 2 cores) the same trace takes 180 ms in one minute and
320 ms in the next, and the time the hypervisor takes away counts as the process's own CPU time, so
neither wall time nor ``time.thread_time`` separates a 5% difference from noise without very many
samples. The instructions a process executes do not depend on that: counted by valgrind's callgrind
(a CPU simulator), the same trace gives the same count to within 0.1%. Instructions are not time
(a cache miss costs more than an add), so this is a diagnostic beside ``region_overhead.py``'s
timings, never a replacement for them: it says how much more work each side does, exactly, and
lets a change to jamp's per-operation code be judged by one run.

What is counted, per side (the sides of ``region_overhead.py``, (a), (a') and (c)):

- tracing the transformer stack (``make_jaxpr``) at each ``--blocks``: "plain" (float32), "hand
  bf16" (the model written in bfloat16), "region" (``with jamp.autocast():``), "transform"
  (``jamp.autocast_transform``), "transform, no rule" (the ablation of (a'): every equation
  re-emitted as traced, the floor of a rewrite that re-emits the program), and the second pass
  alone, from a program traced beforehand: "rewrite alone" (``jamp.autocast_jaxpr``) and
  "re-emitted by JAX" (``make_jaxpr`` of JAX's own interpreter, ``jaxpr_as_fun``);
- an eager forward step of the digits CNN (``--eager``): "plain", "hand bf16", "region", counted
  in Python function calls instead (below); ``--eager-modes forward "train step"`` adds the eager
  train step of ``region_overhead.py``'s part (c) (``jax.value_and_grad`` and an optax update).

Each side runs in its own process under ``valgrind --tool=callgrind --instr-atstart=no``: the
process builds the side and runs it twice uncounted (imports, JAX's caches, jamp's decisions: the
steady state of (a)), then this script switches counting on (``callgrind_control -i on``), the
process runs the side ``--calls`` times, and counting goes off. Fresh function objects every call,
as in (a). The garbage collector stays on (its work is counted), after a ``gc.collect()`` that
ends the warm-up, as (a) collects before every sample. ``PYTHONHASHSEED=0`` gives every run the
same dictionary and set layouts: the counts of two runs of a side then agree to within 0.1-0.2%.
Processes run two at a time.

Eager calls are not counted under callgrind: there the count depends on how valgrind schedules
XLA's threads (its worker threads' spinning is a seventh of the count, and a region's forward
counted 76M instructions a call over 5 calls, 67M over 10), and it put the region at 1.03x hand
bf16 where natively it runs Python code 1.27x hand's. What is counted eagerly is the Python
function calls of one forward (``cProfile``'s call count, in this process, after warm-up calls):
the same number at every call, and what an eager forward's time goes to on this machine (XLA's
own work is a few percent of it).

``--simulate-caches`` adds callgrind's simulation of the caches and the branch predictor
(``--cache-sim=yes --branch-sim=yes``): misses and mispredicted branches per side, and a rough
cycle estimate (``CYCLE_WEIGHTS``), for asking whether a side's extra time beyond its extra
instructions comes from the memory hierarchy or branches. A simulation of a simple machine, not
this one's: it can rule a cause in, never out. ``--by-function N`` (two ``--sides``) then lists the
N native functions (CPython's, JAX's C++; callgrind_annotate) where the second side misses the
simulated last level most more often than the first: misses in CPython's evaluation loop are those
of every Python function it runs, which callgrind cannot tell apart. ``--keep FOLDER`` keeps each
side's callgrind output for reading it further.

Needs valgrind (``apt-get install valgrind``); about a minute per side and size.

Usage::

    JAX_PLATFORMS=cpu .venv/bin/python    benchmarks/instructions.py
    JAX_PLATFORMS=cpu .venv312/bin/python benchmarks/instructions.py --blocks 4 12 --eager
    JAX_PLATFORMS=cpu .venv/bin/python    benchmarks/instructions.py --blocks --eager --eager-modes forward "train step"
    JAX_PLATFORMS=cpu .venv/bin/python    benchmarks/instructions.py --blocks 12 --sides "hand bf16" region --simulate-caches
    JAX_PLATFORMS=cpu .venv/bin/python    benchmarks/instructions.py --blocks 12 --sides "hand bf16" region \
        --simulate-caches --simulated-last-level 1048576,8,64
    JAX_PLATFORMS=cpu .venv/bin/python    benchmarks/instructions.py --blocks 12 --sides "hand bf16" region \
        --simulate-caches --simulated-last-level 1048576,8,64 --by-function 15
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gc
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

TRACE_SIDES = ("plain", "hand bf16", "region", "transform", "transform, no rule",
               "rewrite alone", "re-emitted by JAX")
FLOOR_ONLY = ("transform, no rule", "rewrite alone", "re-emitted by JAX")  # (a')'s own sides
EAGER_SIDES = ("plain", "hand bf16", "region")
# (numerator, denominator, goal of issue 33 or None)
TRACE_RATIOS = (
    ("region", "hand bf16", 1.1),
    ("transform", "plain", 1.1),
    ("transform, no rule", "plain", None),
    ("rewrite alone", "plain", None),
    ("re-emitted by JAX", "plain", None),
    ("region", "plain", None),
    ("hand bf16", "plain", None),
)
EAGER_RATIOS = (("region", "plain", 1.2), ("region", "hand bf16", None))


def side_callable(kind: str, side: str, blocks: int) -> Callable[[], object]:
    """What one call of ``side`` runs (in the counted process)."""
    import jax
    import region_overhead as ro
    from common import BF16, Transformer
    from rewrite_overhead import stack_case

    make_fn, args = stack_case(blocks, d=ro.D, heads=ro.HEADS, seq=ro.SEQ, batch=ro.BATCH)
    if side in FLOOR_ONLY:
        return ro.floor_sides(make_fn, args)[side]
    sides = ro.trace_sides(make_fn, args,
                           hand=Transformer(blocks, d=ro.D, heads=ro.HEADS, dtype=BF16))
    return sides[side]


def child(kind: str, side: str, blocks: int, calls: int, signals: str) -> None:
    """The counted process: warm up, then run ``calls`` calls between the parent's switches."""
    fn = side_callable(kind, side, blocks)
    for _ in range(2):
        fn()
    gc.collect()  # (as region_overhead.py's samples start: no garbage of the warm-up counted)

    def signal(name: str) -> None:
        open(os.path.join(signals, name), "w").close()

    def wait(name: str) -> None:
        while not os.path.exists(os.path.join(signals, name)):
            time.sleep(0.05)

    signal("ready")
    wait("counting")
    for _ in range(calls):
        fn()
    signal("done")
    wait("stopped")


# Event weights of the cycle estimate of --simulate-caches: a rough model (a first-level cache
# miss ~10 cycles, a last-level one ~100, a mispredicted branch ~15), for comparing two sides only.
CYCLE_WEIGHTS = {"Ir": 1, "I1mr": 10, "D1mr": 10, "D1mw": 10, "ILmr": 100, "DLmr": 100,
                 "DLmw": 100, "Bcm": 15, "Bim": 15}


def count(kind: str, side: str, blocks: int, calls: int, simulate: bool = False,
          last_level: str | None = None, keep: str | None = None) -> dict:
    """callgrind's event totals of ``calls`` calls of ``side`` in a new process: instructions
    (``Ir``), and with ``simulate`` its cache and branch-predictor simulation's reads, writes,
    misses and mispredictions (``--cache-sim=yes --branch-sim=yes``; ``last_level``:
    valgrind's ``--LL=size,associativity,line`` for the simulated last level; ``keep``: a folder
    to copy callgrind's output into, for ``callgrind_annotate``)."""
    with tempfile.TemporaryDirectory() as signals:
        out = os.path.join(signals, "callgrind.out")
        simulation = ["--cache-sim=yes", "--branch-sim=yes"] if simulate else []
        if simulate and last_level:
            simulation.append(f"--LL={last_level}")
        command = ["valgrind", "--tool=callgrind", "--instr-atstart=no", *simulation,
                   f"--callgrind-out-file={out}", sys.executable, os.path.abspath(__file__),
                   "--child", kind, side, str(blocks), str(calls), signals]
        env = dict(os.environ, PYTHONHASHSEED="0")  # (the same dict and set layouts every run)
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                   text=True, env=env)

        def wait(name: str) -> None:
            while not os.path.exists(os.path.join(signals, name)):
                if process.poll() is not None:
                    raise RuntimeError(f"{kind} {side!r} exited early:\n{process.stderr.read()}")
                time.sleep(0.2)

        def switch(on: bool) -> None:
            subprocess.run(["callgrind_control", "-i", "on" if on else "off", str(process.pid)],
                           check=True, capture_output=True)

        wait("ready")
        switch(True)
        open(os.path.join(signals, "counting"), "w").close()
        wait("done")
        switch(False)
        open(os.path.join(signals, "stopped"), "w").close()
        process.communicate()
        if keep:
            os.makedirs(keep, exist_ok=True)
            shutil.copy(out, os.path.join(keep, kept_name(kind, side, blocks)))
        with open(out) as f:
            lines = f.read().splitlines()
        events = next(line for line in lines if line.startswith("events:")).split()[1:]
        totals = next(line for line in lines if line.startswith("totals:")).split()[1:]
        return dict(zip(events, map(int, totals)))


def kept_name(kind: str, side: str, blocks: int) -> str:
    """The file ``--keep`` copies a side's callgrind output to."""
    return f"{kind}-{side}-{blocks}.callgrind".replace(" ", "_").replace(",", "")


def run_all(jobs: list[tuple[str, str, int]], calls: int, simulate: bool = False,
            last_level: str | None = None, keep: str | None = None) -> dict:
    results = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        futures = {pool.submit(count, kind, side, blocks, calls, simulate, last_level, keep):
                   (kind, side, blocks)
                   for kind, side, blocks in jobs}
        for future in concurrent.futures.as_completed(futures):
            results[futures[future]] = future.result()
    return results


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, nargs="*", default=[4, 12],
                        help="stack depths of the traced transformer (default 4 12; none: "
                             "eager only)")
    parser.add_argument("--calls", type=int, default=2, help="counted traces per side (default 2)")
    parser.add_argument("--eager", action="store_true",
                        help="also eager calls of the digits CNN (--eager-modes)")
    parser.add_argument("--eager-calls", type=int, default=3,
                        help="counted eager calls per side and mode (default 3)")
    parser.add_argument("--eager-modes", nargs="+", choices=("forward", "train step"),
                        default=["forward"],
                        help="with --eager: the eager calls counted (default: forward)")
    parser.add_argument("--sides", nargs="+", choices=TRACE_SIDES, default=TRACE_SIDES,
                        help="traced sides to count (default: all; the ratios need theirs)")
    parser.add_argument("--simulate-caches", action="store_true",
                        help="also callgrind's cache and branch simulation (~1.5x slower): "
                             "misses, mispredictions and a rough cycle estimate per side")
    parser.add_argument("--simulated-last-level", metavar="SIZE,ASSOC,LINE", default=None,
                        help="with --simulate-caches: the simulated last level (valgrind's "
                             "--LL; default: valgrind's guess for this CPU), e.g. 1048576,8,64 "
                             "for a core's second level")
    parser.add_argument("--keep", metavar="FOLDER", default=None,
                        help="copy each traced side's callgrind output into FOLDER, to read "
                             "per function with callgrind_annotate")
    parser.add_argument("--by-function", metavar="N", type=int, default=0,
                        help="with --simulate-caches and two --sides: the N native functions "
                             "(CPython's, JAX's C++) where the second side misses the last level "
                             "most more often than the first (callgrind_annotate)")
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)  # the counted process
    args = parser.parse_args()
    if args.by_function and not (args.simulate_caches and len(args.sides) == 2):
        parser.error("--by-function compares two sides' simulated misses: add "
                     "--simulate-caches and name two --sides")
    if args.simulated_last_level and not args.simulate_caches:
        parser.error("--simulated-last-level sets the simulation's last level: add "
                     "--simulate-caches")
    if args.child:
        kind, side, blocks, calls, signals = args.child
        child(kind, side, int(blocks), int(calls), signals)
        return
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        sys.exit("instructions.py needs valgrind (apt-get install valgrind)")
    from common import environment

    started = time.perf_counter()
    jobs = [("trace", side, n) for n in args.blocks for side in args.sides]
    if args.by_function and args.keep is None:
        args.keep = tempfile.mkdtemp(prefix="jamp-callgrind-")
    results = run_all(jobs, args.calls, args.simulate_caches, args.simulated_last_level,
                      args.keep)
    if args.eager:
        results.update(eager_calls(args.eager_calls, args.eager_modes))
    print(f"# jamp: instructions per side (callgrind)\n\n{environment()}\n")
    if args.blocks:
        report_traces(results, args)
    if args.eager:
        report_eager(results, args)
    print(f"\n{time.perf_counter() - started:.0f} s in all.")


def report_traces(results: dict, args: argparse.Namespace) -> None:
    print(f"## Tracing the transformer stack (`make_jaxpr`), {args.calls} counted traces a side\n")
    sides = [s for s in TRACE_SIDES if s in args.sides]
    ratios = [(a, b, goal) for a, b, goal in TRACE_RATIOS if a in sides and b in sides]
    rows = []
    for n in args.blocks:
        ir = {side: results["trace", side, n]["Ir"] / args.calls for side in sides}
        rows.append([f"{n} blocks", *(f"{ir[s] / 1e6:.1f}" for s in sides),
                     *(f"{ir[a] / ir[b]:.3f}x" for a, b, _ in ratios)])
    print(table(["stack", *(f"{s} (M instr.)" for s in sides),
                 *(f"{a} / {b}" for a, b, _ in ratios)], rows))
    print()
    for a, b, goal in ratios:
        if goal is not None:
            worst = max(results["trace", a, n]["Ir"] / results["trace", b, n]["Ir"]
                        for n in args.blocks)
            print(f"- {a} / {b} in instructions, worst size {worst:.3f}x (issue 33's goal in "
                  f"time: <= {goal}x)")
    if args.simulate_caches:
        report_simulation(results, args, sides, ratios)
    if args.by_function:
        for n in args.blocks:
            report_by_function(args.keep, args.sides, n, args.calls, args.by_function)


def estimated_cycles(events: dict[str, int]) -> float:
    """A rough cycle count from callgrind's simulated events (``CYCLE_WEIGHTS``)."""
    return sum(weight * events[event] for event, weight in CYCLE_WEIGHTS.items())


def report_simulation(results: dict, args: argparse.Namespace, sides: list[str],
                      ratios: list) -> None:
    """callgrind's simulated misses per side and a rough cycle estimate (``CYCLE_WEIGHTS``)."""
    print("\n### Simulated caches and branch prediction (callgrind), per counted trace\n")
    misses = {"first-level misses": ("I1mr", "D1mr", "D1mw"),
              "last-level misses": ("ILmr", "DLmr", "DLmw"), "mispredicted branches": ("Bcm", "Bim")}
    rows = []
    for n in args.blocks:
        for side in sides:
            events = results["trace", side, n]
            cells = [f"{sum(events[e] for e in names) / args.calls / 1e6:.2f}"
                     for names in misses.values()]
            cycles = estimated_cycles(events) / args.calls
            rows.append([f"{n} blocks", side, *cells, f"{cycles / 1e6:.0f}"])
    print(table(["stack", "side", *(f"{name} (M)" for name in misses), "estimated M cycles"],
                rows))
    print()
    for a, b, _ in ratios:
        cycles = {(side, n): estimated_cycles(results["trace", side, n])
                  for side in (a, b) for n in args.blocks}
        per_size = ", ".join(f"{cycles[a, n] / cycles[b, n]:.3f}x" for n in args.blocks)
        print(f"- {a} / {b} in estimated cycles: {per_size} (weights {CYCLE_WEIGHTS})")


# The events compared per function: last-level misses (data reads, data writes, instruction
# fetches) and instructions.
_BY_FUNCTION_EVENTS = ("DLmr", "DLmw", "ILmr", "Ir")


def misses_by_function(path: str) -> dict[str, list[int]]:
    """Per native function (file:function, as callgrind_annotate names it, CPython's build folder
    left out), its ``_BY_FUNCTION_EVENTS`` in a kept callgrind output."""
    text = subprocess.run(
        ["callgrind_annotate", f"--show={','.join(_BY_FUNCTION_EVENTS)}",
         f"--sort={_BY_FUNCTION_EVENTS[0]}", "--threshold=100", path],
        check=True, capture_output=True, text=True).stdout
    count = r"([\d,]+|\.)\s+(?:\([^)]*\)\s+)?"
    row = re.compile(r"\s*" + count * len(_BY_FUNCTION_EVENTS) + r"(\S.*)$")
    functions: dict[str, list[int]] = {}
    for line in text.splitlines():
        match = row.match(line)
        if match is None or "PROGRAM TOTALS" in line:
            continue
        *cells, name = match.groups()
        name = re.sub(r"^/tmp/python-build[^ ]*?/Python-[\d.]+/", "", name.split(" [")[0])
        counts = [0 if c == "." else int(c.replace(",", "")) for c in cells]
        functions[name] = [a + b for a, b in zip(functions.get(name, [0] * len(counts)), counts)]
    return functions


# The kinds of native function --by-function sums the extra misses by first (name fragments).
_MISS_KINDS = {
    "CPython's evaluation loop (all its source files)": ("_PyEval_EvalFrameDefault",),
    "dictionary lookups, keys of any type": (":_Py_dict_lookup",),
    "dictionary lookups, string keys (attributes, globals)": ("unicodekeys_lookup",),
    "method lookups on types": ("_PyType_Lookup",),
    "equality of keys found": ("PyObject_RichCompare", "tuplerichcompare"),
    "frames, allocation, copies": ("_PyFrame_Push", "_PyObject_Malloc", "__memcpy", "__memset"),
}


def report_by_function(folder: str, sides: Sequence[str], blocks: int, calls: int,
                       top: int) -> None:
    """The native functions where ``sides[1]`` misses the simulated last level most more often
    than ``sides[0]``, per counted trace. Native only: misses in CPython's evaluation loop are
    those of every Python function it runs, which callgrind cannot tell apart."""
    first, second = (misses_by_function(os.path.join(folder, kept_name("trace", side, blocks)))
                     for side in sides)
    zero = [0] * len(_BY_FUNCTION_EVENTS)

    def misses(counts: list[int]) -> int:
        return sum(counts[:3])

    extra = {name: misses(second.get(name, zero)) - misses(first.get(name, zero))
             for name in set(first) | set(second)}
    total = sum(extra.values())
    print(f"\n### Where {sides[1]} misses the last level more than {sides[0]}, {blocks} blocks, "
          f"per counted trace\n\n{total / calls / 1e3:.0f}k more last-level misses in all; by kind "
          f"of native function, then the functions with most extra misses first:\n")
    kinds = []
    left = dict(extra)
    for kind, fragments in _MISS_KINDS.items():
        names = [n for n in left if any(f in n for f in fragments)]
        reads = [sum(side.get(n, zero)[0] for n in names) for side in (first, second)]
        instructions = [sum(side.get(n, zero)[3] for n in names) for side in (first, second)]
        misses_of_kind = sum(left.pop(n) for n in names)
        kinds.append([kind, f"{misses_of_kind / calls / 1e3:.1f}",
                      f"{misses_of_kind / total:.0%}" if total else "-",
                      f"{reads[0] / calls / 1e3:.0f} / {reads[1] / calls / 1e3:.0f}",
                      f"{instructions[1] / max(instructions[0], 1):.2f}x"])
    rest = sum(left.values())
    kinds.append(["the rest", f"{rest / calls / 1e3:.1f}",
                  f"{rest / total:.0%}" if total else "-", "", ""])
    print(table(["kind", "extra misses (k)", "share of the extra",
                 f"DLmr (k) {sides[0]} / {sides[1]}", f"Ir {sides[1]} / {sides[0]}"], kinds))
    print()
    rows = []
    for name in sorted(extra, key=extra.get, reverse=True)[:top]:
        a, b = first.get(name, zero), second.get(name, zero)
        rows.append([f"`{name[:90]}`", f"{extra[name] / calls / 1e3:.1f}",
                     f"{extra[name] / total:.0%}" if total else "-",
                     *(f"{x / calls / 1e3:.1f} / {y / calls / 1e3:.1f}"
                       for x, y in zip(a[:3], b[:3])),
                     f"{a[3] / calls / 1e6:.1f} / {b[3] / calls / 1e6:.1f}"])
    print(table(["function", "extra misses (k)", "share of the extra",
                 *(f"{e} (k) {sides[0]} / {sides[1]}" for e in _BY_FUNCTION_EVENTS[:3]),
                 f"Ir (M) {sides[0]} / {sides[1]}"], rows))


def eager_calls(calls: int, modes: Sequence[str] = ("forward",)) -> dict:
    """Python function calls of one eager call of the digits CNN (each of ``modes``: the
    forward, the train step) per side (``cProfile``'s count, after two warm-up calls), ``calls``
    times each, sorted (they agree to a few calls: a garbage collection's weakref callbacks)."""
    import cProfile
    import pstats

    import jax
    import region_overhead as ro

    results = {}
    for mode in modes:
        new, args = ro.eager_case(mode)
        for side in EAGER_SIDES:
            fn = new(side)
            for _ in range(2):
                jax.block_until_ready(fn(*args))
            counts = []
            for _ in range(calls):
                profile = cProfile.Profile()
                profile.enable()
                jax.block_until_ready(fn(*args))
                profile.disable()
                counts.append(pstats.Stats(profile).total_calls)
            results["eager", side, mode] = sorted(counts)
    return results


def report_eager(results: dict, args: argparse.Namespace) -> None:
    for mode in args.eager_modes:
        counts = {side: results["eager", side, mode] for side in EAGER_SIDES}
        n = {side: c[len(c) // 2] for side, c in counts.items()}  # the median
        print(f"\n## Eager {mode} of the digits CNN, in Python function calls (natively, one "
              "call)\n")
        print(table([*(f"{s} (calls)" for s in EAGER_SIDES),
                     *(f"{a} / {b}" for a, b, _ in EAGER_RATIOS)],
                    [[*(f"{n[s]}" for s in EAGER_SIDES),
                      *(f"{n[a] / n[b]:.3f}x" for a, b, _ in EAGER_RATIOS)]]))
        spread = ", ".join(f"{side} {c[0]}-{c[-1]}" for side, c in counts.items())
        print(f"\n(Medians of {args.eager_calls} calls a side, ranges: {spread}. XLA's execution "
              "of the operations is not in it: a few percent of an eager call's time here.)")


if __name__ == "__main__":
    main()
