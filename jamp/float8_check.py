"""Does a float8 policy compile to float8 GEMMs? The fallback check behind
``jamp.explain(fn, *args, compiled=True)``.

XLA's GPU GEMM rewriter turns a ``dot_general`` of two float8 tensors into one cuBLASLt float8
GEMM (the custom call ``__cublas$lt$matmul$f8``, also used for hipBLASLt on AMD GPUs) only when
its pattern matches; otherwise it converts the operands to a wider type and the product runs as
a bfloat16/float16 GEMM, with no message. This module reads the optimized HLO text of a compiled
program and says, for every matrix multiply, which kernel runs it and whether float8 data reaches
it. Everything here is a pure function of that text plus the backend's name, so the tests run on
the CPU, on hand-written GPU HLO (tests/data/gpu_*.hlo).

Two ways to use it:

- tagged (``jamp.explain(..., compiled=True)``): while recording, jamp compiles each float8 dot
  under a scope ``jamp_float8_dot_<n>``, which XLA carries into the ``op_name`` metadata of the
  instruction that replaces the dot (a GEMM custom call keeps the dot's metadata). A dot whose
  metadata was lost is matched to a float8-reading GEMM of the same operand sizes instead.
- untagged (:func:`check_hlo` / :func:`check_compiled` on any program, as the benchmarks do):
  every GEMM is listed, with the float8 types found upstream of its operands (through converts,
  reshapes, transposes and fusion boundaries), so a float8 tensor upcast before a bfloat16 GEMM
  shows up as a fallback.

Limits: the reasons given for a fallback are inferred from the requirements in XLA's GEMM
rewriter (compute capability 8.9+, one e4m3 operand, one contracting dimension, at most 65535
batched matrices; dimensions not multiples of 16 made older XLA give up, newer XLA pads),
not read from XLA. XLA may drop a dot whose result is unused or merge two identical dots: such a
dot is reported as not found. Under ``jax.vmap`` outside the transform the shapes are one
example's.

Example::

    report = jamp.explain(loss_fn, params, batch, policy=fp8, compiled=True)
    report.float8_check.fallbacks          # the float8 dots that run as wider GEMMs, and why
    print(report.float8_check)
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import jax

from .hlo import Instruction, Module, array_type, parse
from .policy import user_stacklevel


class Float8FallbackWarning(UserWarning):
    """A float8 policy compiled to GEMMs in a wider dtype on a GPU (once per program)."""


F8_GEMM = "__cublas$lt$matmul$f8"
# Custom-call targets and fusion kinds that run a matrix multiply -> the name shown.
KERNELS = {
    F8_GEMM: "cuBLASLt float8",
    "__cublas$lt$matmul": "cuBLASLt",
    "__cublas$gemm": "cuBLAS",
    "__triton_gemm": "Triton",
    "__triton_nested_gemm_fusion": "Triton",  # XLA's name for a Triton GEMM since jax 0.11
    "__cudnn$fusion": "cuDNN",
    "__onednn$matmul": "oneDNN",
    "__ynn_fusion": "XLA:CPU (YNNPACK)",
}
XLA_DOT = "XLA dot emitter"  # a dot XLA codegens itself (in a loop fusion or unfused)
# A Triton GEMM whose dot receives both matrices in float8: XLA's autotuner picks it over the
# cuBLASLt float8 GEMM where it times faster (seen on an H200, jax 0.11: 1024-sized backward
# products, 8192x8192x2048 forward ones, dimensions not multiples of 16). Triton compiles a dot
# of float8 inputs to float8 tensor-core instructions on compute capability 8.9+ and upcasts
# them below (the PTX was not read here: XLA's dump held none for these modules).
TRITON_F8 = "Triton float8"
FLOAT8_KERNELS = frozenset({KERNELS[F8_GEMM], TRITON_F8})
GPU_PLATFORMS = frozenset({"gpu", "cuda", "rocm"})
TAG = "jamp_float8_dot_"
# Ops a float8 value passes through on its way to a GEMM's operand (upcasts, layout, scaling).
_UPSTREAM = frozenset(
    {
        "convert",
        "bitcast",
        "bitcast-convert",
        "copy",
        "transpose",
        "reshape",
        "broadcast",
        "slice",
        "dynamic-slice",
        "pad",
        "multiply",
        "divide",
        "select",
        "get-tuple-element",
    }
)


# --- GEMMs in the optimized program ------------------------------------------------------------


def is_float8(hlo_dtype: str) -> bool:
    return hlo_dtype.startswith("f8")


@dataclasses.dataclass(frozen=True)
class Gemm:
    """One matrix multiply of the optimized program.

    Attributes:
      name: the instruction (a GEMM custom call, or the ``dot`` inside a fusion).
      kernel: who runs it: ``"cuBLASLt float8"``, ``"cuBLASLt"``, ``"cuBLAS"``, ``"Triton"``,
        ``"XLA dot emitter"``, ... (``KERNELS``), else the custom-call target or fusion kind.
      operands: the HLO types of its two matrix operands as the kernel receives them.
      float8_sources: for each operand, the float8 type found upstream of it, or None.
      op_name: the ``op_name`` metadata ("" when absent).
      contracting: contracting dimensions of the two operands.
      batch: batch dimensions of the two operands.
    """

    name: str
    kernel: str
    operands: tuple[str, ...]
    output: str
    float8_sources: tuple[str | None, ...]
    op_name: str
    contracting: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
    batch: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())

    @property
    def float8(self) -> bool:
        """Whether it is a float8 GEMM: the cuBLASLt/hipBLASLt float8 custom call, or a Triton
        GEMM whose dot multiplies float8 operands."""
        return self.kernel in FLOAT8_KERNELS

    @property
    def reads_float8(self) -> bool:
        return self.float8 or any(s is not None for s in self.float8_sources)

    @property
    def operand_sizes(self) -> tuple[int, ...]:
        return tuple(math.prod(array_type(t)[1]) for t in self.operands)

    def describe(self) -> str:
        types = " x ".join(t.split("{")[0] for t in self.operands)
        upcast = [s for s in self.float8_sources if s]
        via = f" (from {' x '.join(upcast)})" if upcast and not self.float8 else ""
        return f"{self.kernel} {self.name} on {types}{via}"


def _dims(text: str | None) -> tuple[int, ...]:
    return tuple(int(d) for d in re.findall(r"\d+", text or ""))


def _dimension_numbers(instr: Instruction) -> tuple[tuple, tuple]:
    if instr.opcode == "dot":
        get = lambda key: _dims(instr.attribute(key + r"s=\{([^}]*)\}"))
    else:  # the GEMM backend config's JSON
        get = lambda key: _dims(instr.attribute('"' + key + r'ensions"\s*:\s*\[([^\]]*)\]'))
    return (
        (get("lhs_contracting_dim"), get("rhs_contracting_dim")),
        (get("lhs_batch_dim"), get("rhs_batch_dim")),
    )


def _float8_upstream(module: Module, computation: str, name: str, depth: int = 0) -> str | None:
    """The float8 type a value was converted from, through upcasts, layout ops, scaling and
    fusion boundaries (a bounded walk), or None."""
    instr = module.producer(computation, name)
    if instr is None or depth > 16:
        return None
    if is_float8(instr.dtype):
        return instr.dtype
    if instr.opcode == "parameter":
        caller = module.callers.get(computation)
        index = int(instr.operands[0]) if instr.operands and instr.operands[0].isdigit() else -1
        if caller is None or not 0 <= index < len(caller.operands):
            return None
        return _float8_upstream(module, caller.computation, caller.operands[index], depth + 1)
    if instr.opcode == "fusion":
        called = instr.attribute(r"\bcalls=%?([\w.\-]+)")
        root = module.roots.get(called or "")
        return _float8_upstream(module, called, root, depth + 1) if called and root else None
    if instr.opcode in _UPSTREAM:
        for operand in instr.operands:
            found = _float8_upstream(module, computation, operand, depth + 1)
            if found is not None:
                return found
    return None


def _kernel_of_fusion(fusion: Instruction | None) -> str:
    if fusion is None or fusion.opcode != "fusion":
        return XLA_DOT
    kind = fusion.attribute(r'"?kind"?\s*:\s*"(__[\w$]+)"')
    return KERNELS.get(kind, kind) if kind else XLA_DOT


def find_gemms(module: Module) -> list[Gemm]:
    """Every GEMM custom call, and every ``dot`` (named by the fusion that runs it)."""
    gemms = []
    for computation, instrs in module.computations.items():
        for instr in instrs.values():
            target = instr.attribute(r'custom_call_target="([^"]+)"')
            if instr.opcode == "custom-call" and target is not None:
                if target not in KERNELS and not re.search("matmul|gemm", target, re.I):
                    continue
                kernel = KERNELS.get(target, target)
            elif instr.opcode == "dot":
                kernel = _kernel_of_fusion(module.callers.get(computation))
            else:
                continue
            matrices = instr.operands[:2]
            types = tuple(getattr(module.producer(computation, o), "type", "?") for o in matrices)
            if kernel == KERNELS["__triton_gemm"] and all(
                is_float8(array_type(t)[0]) for t in types
            ):
                kernel = TRITON_F8
            contracting, batch = _dimension_numbers(instr)
            gemms.append(
                Gemm(
                    instr.name,
                    kernel,
                    types,
                    instr.type,
                    tuple(_float8_upstream(module, computation, o) for o in matrices),
                    instr.op_name,
                    contracting,
                    batch,
                )
            )
    return gemms


# --- jamp's float8 dots and the verdict on each ------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Float8Dot:
    """A ``dot_general`` jamp emitted on float8 operands (recorded by ``jamp.explain``)."""

    index: int
    where: str  # the user's source line
    scope: str  # scope path ("" at the top)
    formats: tuple[str, str]  # e.g. ("float8_e4m3fn", "float8_e4m3fn")
    shapes: tuple[tuple[int, ...], tuple[int, ...]]
    contracting: tuple[tuple[int, ...], tuple[int, ...]]
    batch: tuple[tuple[int, ...], tuple[int, ...]]
    flops: int

    @property
    def tag(self) -> str:
        return f"{TAG}{self.index}"

    def describe(self) -> str:
        operands = " x ".join(
            f"{fmt.replace('float8_', '')}{list(shape)}"
            for fmt, shape in zip(self.formats, self.shapes)
        )
        scope = f" [{self.scope}]" if self.scope else ""
        return f"#{self.index} {self.where}{scope}: {operands}"


def tag_scope(index: int) -> contextlib.AbstractContextManager:
    """The named scope a recorded float8 dot is compiled under (read back from ``op_name``)."""
    return jax.named_scope(f"{TAG}{index}")


@dataclasses.dataclass(frozen=True)
class DotVerdict:
    """What one float8 dot compiled to.

    ``status``: ``"float8 GEMM"``; ``"fallback"`` (a GPU ran it as a wider GEMM); ``"emulated"``
    (a backend without float8 GEMMs, such as the CPU); ``"unchecked"`` (a backend this check does
    not know); ``"not found"`` (no instruction of the program could be matched to it).
    """

    dot: Float8Dot
    status: str
    gemms: tuple[Gemm, ...]
    reason: str

    def __str__(self) -> str:
        runs = "; ".join(g.describe() for g in self.gemms) or "no GEMM found"
        why = f" ({self.reason})" if self.reason else ""
        return f"{self.dot.describe()} -> {self.status}: {runs}{why}"


@dataclasses.dataclass(frozen=True)
class Float8Check:
    """The GEMMs of one compiled program, and (from ``jamp.explain``) a verdict per float8 dot.

    Attributes:
      platform: the backend (``"cpu"``, ``"gpu"``, ...).
      device: the device kind, e.g. ``"NVIDIA H100 80GB HBM3"``.
      compute_capability: a CUDA device's, e.g. ``"9.0"``; None elsewhere.
      dots: one :class:`DotVerdict` per float8 dot jamp emitted (empty for an untagged check).
      gemms: every matrix multiply of the optimized program (:class:`Gemm`).
    """

    platform: str
    device: str
    compute_capability: str | None
    dots: tuple[DotVerdict, ...]
    gemms: tuple[Gemm, ...]

    def counts(self) -> dict[str, int]:
        """Kernel -> number of GEMMs, e.g. ``{"cuBLASLt float8": 96, "cuBLASLt": 48}``."""
        counts: dict[str, int] = {}
        for gemm in self.gemms:
            counts[gemm.kernel] = counts.get(gemm.kernel, 0) + 1
        return counts

    def runs_float8(self, gemm: Gemm) -> bool:
        """Whether ``gemm`` multiplies in float8 on this device."""
        return _multiplies_in_float8(gemm, self.compute_capability)

    @property
    def float8_gemms(self) -> int:
        return sum(self.runs_float8(g) for g in self.gemms)

    @property
    def fallback_gemms(self) -> tuple[Gemm, ...]:
        """GEMMs that read float8 data upcast to a wider type (on any backend)."""
        return tuple(g for g in self.gemms if g.reads_float8 and not self.runs_float8(g))

    @property
    def fallbacks(self) -> tuple[DotVerdict, ...]:
        """The float8 dots a GPU runs as wider GEMMs."""
        return tuple(v for v in self.dots if v.status == "fallback")

    @property
    def on_gpu(self) -> bool:
        return self.platform in GPU_PLATFORMS

    def __str__(self) -> str:
        capability = self.compute_capability
        parts = (
            self.platform,
            self.device if self.device != self.platform else "",
            f"compute capability {capability}" if capability else "",
        )
        where = ", ".join(p for p in parts if p)
        counts = ", ".join(f"{k} {n}" for k, n in sorted(self.counts().items())) or "none"
        lines = [f"float8 check ({where}): GEMMs {counts}"]
        if self.dots:
            done = sum(v.status == "float8 GEMM" for v in self.dots)
            if self.platform == "cpu":
                lines.append(
                    f"  the CPU backend emulates float8: its {len(self.dots)} float8 dot(s) run "
                    "as wider multiplies (a GPU of compute capability 8.9+ runs them as "
                    "cuBLASLt float8 GEMMs)"
                )
            else:
                lines.append(f"  {done} of {len(self.dots)} float8 dots run as float8 GEMMs")
                lines.extend(f"  {v}" for v in self.dots)
        elif self.on_gpu and self.fallback_gemms:
            lines.append(f"  {len(self.fallback_gemms)} GEMM(s) read float8 data upcast:")
            lines.extend(f"    {g.describe()}" for g in self.fallback_gemms)
        return "\n".join(lines)


def _capability(text: str | None) -> tuple[int, ...] | None:
    try:
        return tuple(int(p) for p in str(text).split(".")[:2]) if text else None
    except ValueError:
        return None


def _before_ada(compute_capability: str | None) -> bool:
    """A GPU without float8 tensor cores (compute capability below 8.9): a Triton GEMM on float8
    operands upcasts them there."""
    cc = _capability(compute_capability)
    return cc is not None and cc < (8, 9)


def _multiplies_in_float8(gemm: Gemm, compute_capability: str | None) -> bool:
    return gemm.float8 and not (gemm.kernel == TRITON_F8 and _before_ada(compute_capability))


def fallback_reasons(
    dot: Float8Dot, gemms: Sequence[Gemm], compute_capability: str | None = None
) -> list[str]:
    """Why XLA's GEMM rewriter likely did not make ``dot`` a float8 GEMM (its documented
    requirements, checked against the dot's shapes and formats and the device)."""
    reasons = []
    if _before_ada(compute_capability):
        reasons.append(
            f"backend: compute capability {compute_capability} has no float8 GEMMs "
            "(cuBLASLt's need 8.9, Ada, or newer)"
        )
    if all("e5m2" in f for f in dot.formats):
        reasons.append(
            "dtype pair: both operands float8_e5m2; cuBLASLt float8 GEMMs need one "
            "float8_e4m3fn operand"
        )
    for side, (shape, contracting, batch) in enumerate(zip(dot.shapes, dot.contracting, dot.batch)):
        free = len(shape) - len(contracting) - len(batch)
        if len(contracting) != 1 or free > 1:
            reasons.append(
                f"layout: operand {side} has {len(contracting)} contracting and {free} other "
                "non-batch dimensions; XLA's float8 GEMM rewrite takes exactly one of each "
                "(unless XLA reshapes them into one)"
            )
    batch_count = math.prod(dot.shapes[0][d] for d in dot.batch[0]) if dot.batch[0] else 0
    if batch_count > 65535:
        reasons.append(f"batch: {batch_count} matrices, over cuBLASLt's 65535")
    matrix_dims = {
        d
        for shape, batch in zip(dot.shapes, dot.batch)
        for i, d in enumerate(shape)
        if i not in batch
    }
    odd = sorted(d for d in matrix_dims if d % 16)
    if odd:
        reasons.append(
            f"shape: dimensions {odd} are not multiples of 16 (cuBLASLt float8 kernels need "
            "them: recent XLA pads, older XLA falls back)"
        )
    if any(g.kernel == XLA_DOT for g in gemms):
        reasons.append("size: XLA emitted the dot itself instead of calling a GEMM library")
    if not reasons:
        reasons.append(
            "unknown: XLA's GEMM rewriter did not match the float8 pattern (an op it cannot "
            "move sits between the float8 cast and the dot?); TF_CPP_VMODULE=gemm_rewriter=1 "
            "logs 'not rewritten into FP8 Custom Call' with the cause"
        )
    return reasons


def _padded_size(shape: Sequence[int], batch: Sequence[int]) -> int:
    return math.prod(d if i in batch else -(-d // 16) * 16 for i, d in enumerate(shape))


def _matches_by_size(dot: Float8Dot, gemm: Gemm) -> bool:
    sizes = sorted(gemm.operand_sizes)
    plain = sorted(math.prod(s) for s in dot.shapes)
    padded = sorted(_padded_size(s, b) for s, b in zip(dot.shapes, dot.batch))
    return gemm.reads_float8 and sizes in (plain, padded)


def _claim(dots: Sequence[Float8Dot], gemms: Sequence[Gemm]) -> dict[int, list[Gemm]]:
    """The GEMMs of each dot: by its tag in ``op_name``, else by operand sizes."""
    # The scope may sit inside a transformation's name: "jit(f)/jvp(jamp_float8_dot_0)/...".
    pattern = re.compile(rf"(?:^|[/(]){TAG}(\d+)(?:[/)]|$)")
    claimed: dict[int, list[Gemm]] = {d.index: [] for d in dots}
    unclaimed = []
    for gemm in gemms:
        found = pattern.search(gemm.op_name)
        if found is not None and int(found.group(1)) in claimed:
            claimed[int(found.group(1))].append(gemm)
        else:
            unclaimed.append(gemm)
    for dot in dots:
        if claimed[dot.index]:
            continue
        for gemm in unclaimed:
            if _matches_by_size(dot, gemm):
                claimed[dot.index].append(gemm)
                unclaimed.remove(gemm)
                break
    return claimed


def _verdict(
    dot: Float8Dot, gemms: list[Gemm], platform: str, compute_capability: str | None
) -> DotVerdict:
    if not gemms:
        return DotVerdict(
            dot,
            "not found",
            (),
            "no instruction carries its scope or operand sizes: XLA removed it (result "
            "unused) or merged it with an identical dot",
        )
    if platform == "cpu":
        wide = sorted({array_type(t)[0] for g in gemms for t in g.operands} - {""})
        return DotVerdict(
            dot,
            "emulated",
            tuple(gemms),
            f"the CPU backend has no float8 GEMMs: XLA converts the float8 operands to "
            f"{'/'.join(wide) or 'a wider type'} and multiplies in that type",
        )
    if platform not in GPU_PLATFORMS:
        return DotVerdict(
            dot,
            "unchecked",
            tuple(gemms),
            f"this check knows the float8 GEMMs of NVIDIA and AMD GPUs, not {platform}'s",
        )
    if all(_multiplies_in_float8(g, compute_capability) for g in gemms):
        dims = {d for s, b in zip(dot.shapes, dot.batch) for i, d in enumerate(s) if i not in b}
        padded = any(d % 16 for d in dims) and any(g.kernel == KERNELS[F8_GEMM] for g in gemms)
        note = "padded to multiples of 16 (a pad and a slice)" if padded else ""
        return DotVerdict(dot, "float8 GEMM", tuple(gemms), note)
    reasons = "; ".join(fallback_reasons(dot, gemms, compute_capability))
    return DotVerdict(dot, "fallback", tuple(gemms), f"likely {reasons}")


def check_hlo(
    hlo_text: str,
    dots: Iterable[Float8Dot] = (),
    *,
    platform: str,
    device: str = "",
    compute_capability: str | None = None,
) -> Float8Check:
    """Read an optimized HLO module (``Compiled.as_text()``): its GEMMs, and a verdict for each
    of ``dots`` (recorded by ``jamp.explain``). A pure function of its arguments.

    Example::

        check = check_hlo(compiled.as_text(), platform="gpu", compute_capability="9.0")
        check.counts()      # {"cuBLASLt float8": 96, "cuBLASLt": 48}
    """
    gemms = find_gemms(parse(hlo_text))
    dots = tuple(dots)
    claimed = _claim(dots, gemms)
    verdicts = tuple(_verdict(d, claimed[d.index], platform, compute_capability) for d in dots)
    return Float8Check(platform, device, compute_capability, verdicts, tuple(gemms))


def device_info(device: Any = None) -> dict[str, Any]:
    """``platform``, ``device`` and ``compute_capability`` of ``device`` (default: the default
    backend's first device), as :func:`check_hlo` takes them."""
    device = jax.devices()[0] if device is None else device
    capability = getattr(device, "compute_capability", None)
    return {
        "platform": device.platform,
        "device": getattr(device, "device_kind", ""),
        "compute_capability": str(capability) if capability else None,
    }


def check_compiled(
    compiled: Any, dots: Iterable[Float8Dot] = (), device: Any = None
) -> Float8Check:
    """:func:`check_hlo` on a ``jax.stages.Compiled`` (``jax.jit(f).lower(...).compile()``),
    for the device it runs on (default: the default backend's first device)."""
    return check_hlo(compiled.as_text(), dots, **device_info(device))


_warned: set[tuple] = set()


def warn_fallbacks(check: Float8Check, where: str = "") -> None:
    """Warn once per program (``where`` and what fell back) when float8 dots run as wider GEMMs
    on a GPU. Emulation on the CPU never warns."""
    if not check.on_gpu:
        return
    fallbacks = check.fallbacks
    if check.dots:
        if not fallbacks:
            return
        listed: list[Any] = list(fallbacks)
        total = len(check.dots)
    else:
        listed = list(check.fallback_gemms)
        total = len(listed) + check.float8_gemms
        if not listed:
            return
    key = (where, tuple(str(x) for x in listed))
    if key in _warned:
        return
    _warned.add(key)
    shown = "\n  ".join(str(x) if isinstance(x, DotVerdict) else x.describe() for x in listed[:5])
    more = f"\n  ... and {len(listed) - 5} more" if len(listed) > 5 else ""
    warnings.warn(
        f"{len(listed)} of {total} float8 matmuls{' of ' + where if where else ''} compiled "
        f"to no float8 GEMM on {check.device or check.platform}: they run as wider GEMMs, "
        f"at bfloat16 speed or slower.\n  {shown}{more}",
        Float8FallbackWarning,
        stacklevel=user_stacklevel(),
    )
