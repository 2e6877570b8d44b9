"""What crosses the network: every collective of a sharded program, its dtype and its bytes.

``jamp.explain(fn, *args, compiled=True)`` compiles the rewritten program for the arguments'
shardings and reads it right after XLA's SPMD partitioner, where the collectives are decided
(``_compat.compile_partitioned``): each all-gather, all-reduce, reduce-scatter, all-to-all and
collective-permute with its dtype, elements and bytes per device, how many times a step runs it
(a loop body's collectives times the loop's trip count), and what it moves: the parameter path
of an argument it gathers, else the operation (and source line) whose result it sums. The final
program is read too: where the backend runs a collective in another dtype (the CPU widens
bfloat16 to float32, as it emulates bfloat16) the report says so.

Bytes are per device and per run: the larger of the collective's input and output buffers (an
all-gather's gathered result, a reduce-scatter's full input, an all-reduce's buffer). What a ring
algorithm sends is (n-1)/n of that; the ratio between dtypes is the same either way.

Example::

    report = jamp.explain(train_step, sharded_params, sharded_batch, compiled=True)
    report.collectives.bytes_by_dtype         # {"bfloat16": 4096, "float32": 8192}
    print(report.collectives)
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import _compat as compat
from .hlo import Instruction, Module, parse

# HLO opcodes of the collectives -> the name shown (async forms read as their kind).
KINDS = {
    "all-gather": "all-gather",
    "all-reduce": "all-reduce",
    "reduce-scatter": "reduce-scatter",
    "all-to-all": "all-to-all",
    "collective-permute": "collective-permute",
    "all-gather-start": "all-gather",
    "all-reduce-start": "all-reduce",
    "collective-permute-start": "collective-permute",
}
# HLO element types -> numpy names (jnp.dtype(name) reads them back).
_DTYPES = {
    "pred": "bool",
    "bf16": "bfloat16",
    "f16": "float16",
    "f32": "float32",
    "f64": "float64",
    "s8": "int8",
    "s16": "int16",
    "s32": "int32",
    "s64": "int64",
    "u8": "uint8",
    "u16": "uint16",
    "u32": "uint32",
    "u64": "uint64",
    "f8e4m3fn": "float8_e4m3fn",
    "f8e5m2": "float8_e5m2",
    "f8e4m3fnuz": "float8_e4m3fnuz",
    "f8e5m2fnuz": "float8_e5m2fnuz",
}
# Ops a gathered argument passes through on its way to the collective (a cast, a reshape).
_THROUGH = frozenset({"convert", "bitcast", "reshape", "transpose", "copy", "bitcast-convert"})
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")


def dtype_name(hlo_dtype: str) -> str:
    """``bf16`` -> ``bfloat16`` (an unknown HLO type is returned as it is)."""
    return _DTYPES.get(hlo_dtype, hlo_dtype)


def _arrays(type_text: str) -> list[tuple[str, int]]:
    """(element type, elements) of each array in an HLO type (a tuple has several)."""
    out = []
    for dtype, dims in _ARRAY.findall(type_text):
        sizes = [d.strip().lstrip("<=") for d in dims.split(",") if d.strip()]
        out.append((dtype, math.prod(int(d) for d in sizes if d.isdigit())))
    return out


def _bytes(type_text: str) -> int:
    return sum(n * np.dtype(dtype_name(t)).itemsize for t, n in _arrays(type_text) if t in _DTYPES)


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of the partitioned program.

    Attributes:
      kind: ``"all-gather"``, ``"all-reduce"``, ``"reduce-scatter"``, ``"all-to-all"`` or
        ``"collective-permute"``.
      dtype: what it moves, as a numpy name (``"bfloat16"``).
      shape: its result's shape on one device.
      elements: elements of its larger buffer (input or output) on one device.
      bytes: those elements' bytes, per device and run.
      runs: how many times one call of the program runs it (loop trip counts multiplied); None
        where a trip count could not be read (counted once in the totals).
      moves: the parameter path of the argument it gathers (``"params['Dense_0']['kernel']"``),
        else the operation whose result it moves (``"transpose(jvp(Dense_0))/dot_general"``).
      line: the user's source line of that operation, where the program records one.
      backend_dtype: the dtype the compiled program runs it in where the backend changed it
        (the CPU runs bfloat16 collectives in float32), else None.
    """

    kind: str
    dtype: str
    shape: tuple[int, ...]
    elements: int
    bytes: int
    runs: int | None
    moves: str
    line: str | None = None
    backend_dtype: str | None = None

    def __str__(self) -> str:
        runs = "" if self.runs == 1 else f" x{self.runs if self.runs is not None else '?'}"
        where = f" at {self.line}" if self.line else ""
        backend = f" (the backend runs it in {self.backend_dtype})" if self.backend_dtype else ""
        return (
            f"{self.kind:<18} {self.dtype:<13} {list(self.shape)!s:<16} "
            f"{self.bytes:>12,} B{runs}  {self.moves}{where}{backend}"
        )


@dataclasses.dataclass(frozen=True)
class CollectiveReport:
    """Every collective of one compiled program (``Report.collectives``).

    Attributes:
      devices: devices the program was partitioned over (1: compiled for one device).
      collectives: each collective, in program order.
      note: why there is nothing to report, where there is not (arguments without shardings).
      hlo: the program's HLO text right after SPMD partitioning, which the report was read from
        ("" for one device): ``print(report.collectives.hlo)`` to read it yourself.
    """

    devices: int
    collectives: tuple[Collective, ...]
    note: str = ""
    hlo: str = dataclasses.field(default="", repr=False)

    @property
    def bytes_by_dtype(self) -> dict[str, int]:
        """Bytes per device crossing in one call of the program, per dtype moved."""
        total: collections.Counter = collections.Counter()
        for c in self.collectives:
            total[c.dtype] += c.bytes * (c.runs if c.runs is not None else 1)
        return dict(total)

    def bytes_by(self, kind: str) -> dict[str, int]:
        """``bytes_by_dtype`` of one kind of collective (``"all-gather"``)."""
        return CollectiveReport(
            self.devices, tuple(c for c in self.collectives if c.kind == kind)
        ).bytes_by_dtype

    def __str__(self) -> str:
        if not self.collectives:
            return f"collectives ({self.devices} device{'s' * (self.devices != 1)}): none" + (
                f"; {self.note}" if self.note else ""
            )
        lines = [f"collectives after SPMD partitioning ({self.devices} devices), per device:"]
        lines.extend(f"  {c}" for c in self.collectives)
        total = ", ".join(f"{d}: {n:,} B" for d, n in sorted(self.bytes_by_dtype.items()))
        lines.append(f"bytes crossing per call, per device: {total}")
        return "\n".join(lines)


SINGLE_DEVICE = (
    "no argument carries a sharding over several devices, so the program was compiled for one "
    "device; give the arguments NamedShardings (jax.device_put) to see what crosses the network"
)


def report_collectives(lowered: Any, arg_names: Sequence[str] = ()) -> tuple[Any, CollectiveReport]:
    """Compile ``lowered`` (a ``jax.stages.Lowered`` of a function of flat arguments ``*a``) and
    report its collectives; returns the compiled program too (the float8 check reads it).
    ``arg_names``: the user's pytree path of each flat argument, shown for ``a[i]``."""
    compiled, text = compat.compile_partitioned(lowered)
    if text is None:
        return compiled, CollectiveReport(1, (), SINGLE_DEVICE)
    return compiled, read_collectives(text, compiled.as_text(), arg_names)


def read_collectives(
    partitioned: str, final: str | None = None, arg_names: Sequence[str] = ()
) -> CollectiveReport:
    """The collectives of partitioned HLO text, with the dtypes ``final`` (the compiled
    program's text) runs them in where those differ."""
    module = parse(partitioned)
    devices = re.search(r"num_partitions=(\d+)", partitioned)
    found = [
        _collective(module, instr, arg_names)
        for name in module.computations
        for instr in module.computations[name].values()
        if instr.opcode in KINDS
    ]
    if final is not None:
        found = _backend_dtypes(found, final)
    return CollectiveReport(int(devices.group(1)) if devices else 1, tuple(found), hlo=partitioned)


def _collective(module: Module, instr: Instruction, arg_names: Sequence[str]) -> Collective:
    operands = [module.producer(instr.computation, o) for o in instr.operands]
    sizes = [instr.type] + [o.type for o in operands if o is not None]
    biggest = max(sizes, key=_bytes)
    arrays = _arrays(instr.type)
    dtype = arrays[0][0] if arrays else ""
    return Collective(
        kind=KINDS[instr.opcode],
        dtype=dtype_name(dtype),
        shape=instr.shape,
        elements=sum(n for _, n in _arrays(biggest)),
        bytes=_bytes(biggest),
        runs=module.runs(instr.computation),
        moves=_moves(module, instr, arg_names),
        line=module.source_line(instr),
    )


def _moves(module: Module, instr: Instruction, arg_names: Sequence[str]) -> str:
    """The argument whose value the collective moves, found upstream through operations of the
    same size (a cast, a reshape, float8's scaling), else the operation named in its metadata."""
    size = lambda i: sum(n for _, n in _arrays(i.type))  # noqa: E731
    start = [module.producer(instr.computation, o) for o in instr.operands]
    queue = [i for i in start if i is not None]
    seen: set[str] = set()
    while queue and len(seen) < 64:
        current = queue.pop(0)
        if current.name in seen:
            continue
        seen.add(current.name)
        if current.opcode == "parameter":
            if current.computation == module.entry and current.op_name:
                return _argument(current.op_name, arg_names)
            continue
        for name in current.operands:
            up = module.producer(current.computation, name)
            if up is not None and up.opcode != "constant" and size(up) == size(current):
                queue.append(up)
    op_name = re.sub(r"jamp_float8_dot_\d+/?", "", instr.op_name)
    return re.sub(r"^(jit|pjit)\([^)]*\)/", "", op_name) or instr.name


def _argument(op_name: str, arg_names: Sequence[str]) -> str:
    """A parameter's name: the user's pytree path for jamp's flat ``a[i]``, else JAX's name."""
    name = op_name.replace("\\'", "'").replace('\\"', '"')
    flat = re.fullmatch(r"\w+\[(\d+)\]", name)
    if flat is not None and int(flat.group(1)) < len(arg_names):
        return arg_names[int(flat.group(1))]
    return name


def _backend_dtypes(found: list[Collective], final: str) -> list[Collective]:
    """Match each collective to the final program's of the same kind and element count, in
    order; note the dtype where the backend changed it."""
    module = parse(final)
    pool: dict[tuple[str, int], list[str]] = collections.defaultdict(list)
    for instrs in module.computations.values():
        for instr in instrs.values():
            if instr.opcode in KINDS:
                arrays = _arrays(instr.type)
                # an async start's type is (operand, result); a combined all-reduce's, a tuple
                for dtype, n in arrays[-1:] if instr.opcode.endswith("-start") else arrays:
                    pool[(KINDS[instr.opcode], n)].append(dtype_name(dtype))
    out = []
    for c in found:
        candidates = pool.get((c.kind, math.prod(c.shape)), [])
        backend = candidates.pop(0) if candidates else None
        out.append(
            dataclasses.replace(c, backend_dtype=backend)
            if backend is not None and backend != c.dtype
            else c
        )
    return out
