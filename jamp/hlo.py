"""Reading XLA's HLO text: instructions by computation, operands, attributes and metadata.

Shared by the float8 GEMM check (float8_check.py) and the collective report (collectives.py).
Everything is a pure function of the text, so both run on hand-written HLO in the tests.

Example::

    module = jamp.hlo.parse(jax.jit(f).lower(x).compile().as_text())
    [i.opcode for i in module.computations[module.entry].values()]
"""

from __future__ import annotations

import dataclasses
import re


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    type: str  # as printed, e.g. "f8e4m3fn[16,32]{1,0}" or "(f32[16,16]{1,0}, s8[8]{0})"
    opcode: str
    operands: tuple[str, ...]  # operand names (no %), or a parameter's number
    attributes: str  # everything after the operand list
    computation: str

    @property
    def dtype(self) -> str:
        return array_type(self.type)[0]

    @property
    def shape(self) -> tuple[int, ...]:
        return array_type(self.type)[1]

    def attribute(self, pattern: str) -> str | None:
        match = re.search(pattern, self.attributes)
        return match.group(1) if match else None

    @property
    def op_name(self) -> str:
        return self.attribute(r'op_name="([^"]*)"') or ""


_TYPE = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")


def array_type(text: str) -> tuple[str, tuple[int, ...]]:
    """Element type and dimensions of an array type, or of a tuple's first element."""
    match = _TYPE.search(text)
    if match is None:
        return "", ()
    dims = [d.strip().lstrip("<=") for d in match.group(2).split(",") if d.strip()]
    return match.group(1), tuple(int(d) for d in dims if d.isdigit())


_START = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(?=\(|[a-z][a-z0-9]*\[)")
_HEADER = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\))?\s*(?:->.*)?\{\s*$")


def _closing(text: str, start: int) -> int:
    """Index just past the bracket that closes the one at ``start``."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] in "([{":
            depth += 1
        elif text[i] in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1
    return len(text)


def _depth(text: str) -> int:
    """How many brackets ``text`` leaves open, outside string literals."""
    depth, quoted, escaped = 0, False, False
    for ch in text:
        if quoted:
            escaped, quoted = (not escaped and ch == "\\"), quoted and (escaped or ch != '"')
        elif ch == '"':
            quoted = True
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
    return depth


def _split_top(text: str) -> list[str]:
    parts: list[str] = []
    current: list[str] = []
    depth = 0
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    if "".join(current).strip():
        parts.append("".join(current))
    return parts


def _instruction(line: str, computation: str) -> Instruction | None:
    match = _START.match(line)
    if match is None:
        return None
    rest = line[match.end() :]
    typed = None if rest.startswith("(") else _TYPE.match(rest)
    if typed is None and not rest.startswith("("):
        return None
    end = typed.end() if typed is not None else _closing(rest, 0)
    if rest[end : end + 1] == "{":  # a layout
        end = _closing(rest, end)
    type_text, rest = rest[:end], rest[end:].lstrip()
    opcode = re.match(r"[\w\-]+", rest)
    if opcode is None or rest[opcode.end() : opcode.end() + 1] != "(":
        return None
    close = _closing(rest, opcode.end())
    operand_text = re.sub(r"/\*.*?\*/", "", rest[opcode.end() + 1 : close - 1])
    operands = tuple(
        part.split()[-1].lstrip("%") for part in _split_top(operand_text) if part.split()
    )
    return Instruction(
        match.group(1), type_text, opcode.group(), operands, rest[close:], computation
    )


@dataclasses.dataclass
class Module:
    """The instructions of an HLO module by computation, and which fusion calls which."""

    computations: dict[str, dict[str, Instruction]]
    roots: dict[str, str]
    callers: dict[str, Instruction]  # called computation -> the fusion/call instruction
    entry: str = ""  # the ENTRY computation's name
    # Every instruction that runs a computation (while body/condition, call, conditional
    # branch, fusion, a reduction's to_apply): computation -> (instruction, attribute name).
    uses: dict[str, list[tuple[Instruction, str]]] = dataclasses.field(default_factory=dict)
    # A pass dump's stack-frame tables: stack_frame_id -> "file:line" of its innermost frame.
    frames: dict[str, str] = dataclasses.field(default_factory=dict)

    def producer(self, computation: str, name: str) -> Instruction | None:
        return self.computations.get(computation, {}).get(name)

    def source_line(self, instr: Instruction) -> str | None:
        """The user's ``file:line`` for ``instr``: its ``source_file``/``source_line`` metadata,
        or its ``stack_frame_id`` looked up in the dump's tables."""
        file, line = (
            instr.attribute(r'source_file="([^"]*)"'),
            instr.attribute(r"source_line=(\d+)"),
        )
        if file is not None and line is not None:
            return f"{file}:{line}"
        frame = instr.attribute(r"stack_frame_id=(\d+)")
        return self.frames.get(frame) if frame is not None else None

    def trip_count(self, loop: Instruction) -> int | None:
        """How many times a ``while`` runs its body: XLA's ``known_trip_count`` annotation, else
        that of an integer counter (how ``lax.scan``/``fori_loop`` lower) that starts at a
        constant, steps by a constant each run and is compared with a constant; None otherwise
        (a float or data-dependent condition, whose count only running it tells)."""
        known = loop.attribute(r'known_trip_count"?\s*[:=]\s*\{\s*"?n"?\s*[:=]\s*"?(\d+)')
        if known is not None:
            return int(known)
        condition = loop.attribute(r"\bcondition=%?([\w.\-]+)")
        body = loop.attribute(r"\bbody=%?([\w.\-]+)")
        root = self.producer(condition or "", self.roots.get(condition or "", ""))
        direction = root.attribute(r"direction=(\w+)") if root is not None else None
        if root is None or root.opcode != "compare" or len(root.operands) != 2 or not direction:
            return None
        sides = [self._element(condition or "", ref) for ref in root.operands]
        if _integer(sides[0][0]) is not None:  # `bound > i`: read as `i < bound`
            sides.reverse()
            direction = {"GT": "LT", "GE": "LE", "LT": "GT", "LE": "GE"}.get(direction, "")
        (counter, index), (bound_instr, _) = sides
        bound = _integer(bound_instr)
        if counter is None or counter.opcode != "parameter" or bound is None:
            return None
        # The body's new counter: the old one plus a constant step.
        update, rest = self._element(body or "", self.roots.get(body or "", ""), index)
        if update is None or rest or update.opcode != "add" or len(update.operands) != 2:
            return None
        terms = [self._element(body or "", ref) for ref in update.operands]
        steps = [_integer(i) for i, _ in terms]
        olds = [i is not None and i.opcode == "parameter" and at == index for i, at in terms]
        step = steps[1] if olds[0] else steps[0] if olds[1] else None
        start_instr, rest = self._element(loop.computation, loop.operands[0], index)
        start = _integer(start_instr) if not rest else None
        if step is None or start is None:
            return None
        if direction in ("LT", "LE") and step > 0:
            span = bound - start + (direction == "LE")
        elif direction in ("GT", "GE") and step < 0:
            span, step = start - bound + (direction == "GE"), -step
        else:
            return None
        return max(0, -(-span // step))

    def _element(
        self, computation: str, ref: str, index: tuple[int, ...] = ()
    ) -> tuple[Instruction | None, tuple[int, ...]]:
        """What element ``index`` of operand ``ref`` (``x``, or ``x#1`` in newer HLO text) is:
        the instruction it comes from, looking through tuples, get-tuple-element and copies,
        and the tuple index left to take of it (a loop parameter's element)."""
        for _ in range(64):
            name, *picks = ref.split("#")
            index = tuple(int(p) for p in picks if p.isdigit()) + index
            instr = self.producer(computation, name)
            if instr is None or not instr.operands:
                return instr, index
            if instr.opcode == "get-tuple-element":
                picked = instr.attribute(r"\bindex=(\d+)")
                if picked is None:
                    return None, index
                ref, index = instr.operands[0], (int(picked), *index)
            elif instr.opcode == "tuple" and index and index[0] < len(instr.operands):
                ref, index = instr.operands[index[0]], index[1:]
            elif instr.opcode in ("copy", "bitcast") and len(instr.operands) == 1:
                ref = instr.operands[0]
            else:
                return instr, index
        return None, index

    def runs(self, computation: str, depth: int = 0) -> int | None:
        """How many times ``computation`` runs per call of the entry computation (loop bodies
        times their trip counts; None where a trip count is unknown)."""
        if computation == self.entry or depth > 32:
            return 1
        total = 0
        for instr, attr in self.uses.get(computation, ()):
            if attr == "to_apply" or attr == "condition":
                continue
            outer = self.runs(instr.computation, depth + 1)
            each = self.trip_count(instr) if instr.opcode == "while" and attr == "body" else 1
            if outer is None or each is None:
                return None
            total += outer * each
        return total or 1


def _integer(instr: Instruction | None) -> int | None:
    """The value of an integer scalar constant, else None (a float bound like ``100.0`` is no
    counter's)."""
    if instr is None or instr.opcode != "constant" or instr.shape or not instr.operands:
        return None
    if not re.fullmatch(r"[su]\d+", instr.dtype):
        return None
    value = instr.operands[0]
    return int(value) if re.fullmatch(r"-?\d+", value) else None


def parse(text: str) -> Module:
    """Parse HLO text: ``Compiled.as_text()`` (one instruction a line) or hand-written HLO whose
    instructions continue over several lines."""
    computations: dict[str, dict[str, Instruction]] = {}
    roots: dict[str, str] = {}
    current: str | None = None
    entry: str | None = None
    pending: list[str] = []

    def flush() -> None:
        if current is not None and pending:
            joined = " ".join(s.strip() for s in pending)
            instr = _instruction(joined, current)
            if instr is not None:
                computations[current][instr.name] = instr
                if joined.startswith("ROOT"):
                    roots[current] = instr.name
        pending.clear()

    for line in text.splitlines():
        stripped = line.strip()
        if current is None:
            header = _HEADER.match(line)
            if header is not None and not stripped.startswith("HloModule"):
                current = header.group(1)
                if stripped.startswith("ENTRY"):
                    entry = current
                computations[current] = {}
            continue
        if pending and _depth(" ".join(pending)) > 0:
            pending.append(line)  # inside a bracket an instruction opened (a backend config)
        elif stripped.startswith("}"):
            flush()
            current = None
        elif _START.match(line):
            flush()
            pending.append(line)
        elif pending:
            pending.append(line)  # attributes continued on the next line
    flush()
    callers = {}
    uses: dict[str, list[tuple[Instruction, str]]] = {}
    for instrs in computations.values():
        for instr in instrs.values():
            called = instr.attribute(r"\bcalls=%?([\w.\-]+)")
            if called is not None:
                callers[called] = instr
            for attr, names in _CALLED.findall(instr.attributes):
                for name in re.findall(r"%?([\w.\-]+)", names):
                    uses.setdefault(name, []).append((instr, attr))
    return Module(computations, roots, callers, entry or "", uses, _frames(text))


# Attributes naming the computations an instruction runs.
_CALLED = re.compile(
    r"\b(calls|body|condition|to_apply|true_computation|false_computation|branch_computations)"
    r"=(\{[^}]*\}|%?[\w.\-]+)"
)


def _frames(text: str) -> dict[str, str]:
    """A pass dump's ``FileNames``/``FileLocations``/``StackFrames`` tables as
    stack_frame_id -> ``file:line``: the innermost frame outside installed packages (the
    user's line, not Flax's ``Dense``), else the innermost one. Empty for text without them."""
    tables: dict[str, dict[str, str]] = {}
    table: dict[str, str] | None = None
    for line in text.splitlines():
        stripped = line.strip()
        if stripped in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            table = tables.setdefault(stripped, {})
        elif table is not None and re.match(r"\d+ ", stripped):
            key, _, value = stripped.partition(" ")
            table[key] = value
        elif stripped:
            table = None
    names, locations = tables.get("FileNames", {}), tables.get("FileLocations", {})
    stack = tables.get("StackFrames", {})

    def where(frame: str) -> tuple[str, str | None]:
        """(file:line of the frame, its parent frame's id)."""
        value = stack.get(frame, "")
        location = locations.get(_field(value, "file_location_id") or "", "")
        file = names.get(_field(location, "file_name_id") or "", "?").strip('"')
        # The dump prints each parent as its id + 1 (0, "no parent", prints as 1).
        parent = int(_field(value, "parent_frame_id") or 1) - 1
        return f"{file}:{_field(location, 'line')}", str(parent) if parent else None

    frames = {}
    for frame in stack:
        chain: list[str] = []
        current: str | None = frame
        while current is not None and current in stack and len(chain) < 64:
            text_, current = where(current)
            chain.append(text_)
        if chain:
            own = [c for c in chain if not re.search(r"[/\\](site|dist)-packages[/\\]", c)]
            frames[frame] = (own or chain)[0]
    return frames


def _field(text: str, name: str) -> str | None:
    match = re.search(rf"\b{name}=(\d+)", text)
    return match.group(1) if match else None
