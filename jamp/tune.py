"""``jamp.tune``: each scope's precision chosen from its measured sensitivity and modelled cost.

Example::

    result = jamp.tune(loss_fn, params, batch, candidates=(jnp.bfloat16,), tolerance=1e-2)
    print(result)                   # scope, FLOPs share, sensitivity per candidate, chosen, why
    loss_fn = jamp.autocast_transform(loss_fn, result.policy)   # an ordinary Policy with rules

Decisions, and why:

- **Scopes** are what ``Policy(rules=...)`` matches, so the answer is an ordinary, editable policy:
  the scope path of every matmul/convolution (the lower table; Flax linen module paths and
  ``jax.named_scope`` names, ``jnp.einsum``'s own scope included). A matmul outside any scope
  (a plain function, a Flax NNX module, which pushes none) is tuned per source line: the
  innermost line of your own code it was traced from (outside installed packages), named by a
  ``"@file.py:12"`` rule (``Policy.rules`` matches those against the frames an operation was
  traced from). Two layers called on one line share that line's rule; a ``jax.named_scope``
  tells them apart. Scopes already decided by a rule of ``policy`` or by a ``jamp.autocast``
  region are left as they are, and ``scopes=`` restricts tuning to some scopes.
- **Sensitivity** of a scope to a candidate dtype: ``fn`` runs with only that scope lowered
  (``Policy(float32, rules=((scope, dtype),))``, the base policy's tables kept) and is compared
  with the float32 program: the relative error ``||y - y32|| / ||y32||`` over all floating
  outputs, and with ``grad`` the same over the gradients (a vector-Jacobian product with a fixed
  cotangent: 1 for a scalar loss, a fixed normal draw for other outputs); the larger of the two
  counts. inf or NaN anywhere makes the candidate infeasible for that scope.
- **Cost** of a scope in a dtype: each matmul/convolution's FLOPs and bytes (operands and output,
  in the dtypes the rewrite gives them: the analysis of ``jamp.explain``) through a roofline,
  ``max(FLOPs / peak(dtype), bytes / bandwidth)``, with the device's speed table
  (:class:`DeviceSpeeds`, ``DEVICE_SPEEDS``: NVIDIA's datasheet peaks, dense tensor-core
  FLOP/s, float32 at JAX's default TF32 matmul precision). On a CPU (or an unknown device) the
  H100 table is used: CPU times of 16-bit code mean nothing (XLA emulates bfloat16 there). The
  backward matmuls of ``grad`` have the forward's dtypes and twice its FLOPs, so they scale
  every cost alike and are left out. Elementwise work is not modelled.
- **Selection**: greedy under an additive error model. Starting from float32 everywhere, take
  the move (a scope to a cheaper candidate) with the largest cost saving per added sensitivity
  while the sum of the chosen sensitivities stays within ``tolerance``; the same with the
  largest saving first (which finds a big scope whose cheap option fills the budget alone);
  keep the cheaper of the two estimates. Then **verify**: run the
  combined policy and measure its error (on ``example_args``, and on ``check_args`` when given);
  while it exceeds ``tolerance`` or is not finite, **back off**: demote the scopes saving least
  per unit of error to their next more precise option until the additive estimate falls by the
  measured overshoot (at least one scope a step), and verify again.
- **Complexity**: ``n * |candidates|`` sensitivity runs for ``n`` scopes (fewer: a candidate that
  saves nothing for a scope, or that runs exactly as another one there, e.g. float8 on a matmul
  below ``Policy.min_float8_flops``, is not run), one float32 reference, and at most
  ``n * |candidates|`` verification runs, one in practice; the greedy itself is arithmetic.
  Never the ``(|candidates| + 1) ** n`` assignments. Every run is a compiled forward (and
  backward) of ``fn``, so the wall time is about that many compilations of it.

The tuned policy computes in float32 wherever no rule lowers a scope, and keeps every other
field of the base policy; ``estimated_speedup`` compares its matmul/convolution time with the
base policy's (``Policy()``, bfloat16 everywhere, by default), ``speedup_over_float32`` with
float32's.

``tune_weights`` makes the same choice for the weights of a frozen program
(``tracing.freeze(..., weights=result)``): the options are int8, int4 or float8 storage or the
kernel as frozen, the cost is stored bytes (scales included), a scope's sensitivity is the
frozen program's output error with only that scope's kernels quantized, and the same greedy
search, verification and back-off pick the fewest bytes within the tolerance.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import numbers
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _compat as compat
from .call_args import CallSignature, split_leaves
from .interpreter import F32, Step, is_float, matmul_flops
from .policy import FLOAT8_COMPUTE, LINE_RULE, Policy, is_float8, own_frame
from .probe import count_sites, normalize_argnums
from .report import Recorder, _compute_dtype

F16 = np.dtype(jnp.float16)
BF16 = np.dtype(jnp.bfloat16)
CANDIDATE_DTYPES = (BF16, F16, FLOAT8_COMPUTE)
# Sensitivity variants compiled together: up to about this many equations (forward and backward
# counted as three times the forward) in one program.
_EQUATIONS_PER_PROGRAM = 20_000
_SHORT = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "float8_e4m3fn": "f8"}


# --- the device's speed table -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DeviceSpeeds:
    """Peak speeds of one device, for the roofline cost of a matmul/convolution.

    ``flops_per_second`` maps a dtype name (the dtype the product computes in: ``"float32"``,
    ``"bfloat16"``, ``"float16"``, ``"float8_e4m3fn"``, ``"float8_e5m2"``) to dense peak FLOP/s;
    ``bytes_per_second`` is the memory bandwidth. A dtype missing from the table runs at
    float32's speed.

    Example::

        mine = jamp.DeviceSpeeds(
            "my-gpu", {"float32": 60e12, "bfloat16": 120e12}, 1e12, "measured")
        jamp.tune(loss_fn, params, batch, device=mine)
    """

    name: str
    flops_per_second: Mapping[str, float]
    bytes_per_second: float
    source: str = ""

    def seconds(self, flops: float, nbytes: float, dtype: Any) -> float:
        """Roofline time of one product: ``max(flops / peak(dtype), bytes / bandwidth)``."""
        table = self.flops_per_second
        peak = table.get(np.dtype(dtype).name, table.get("float32", math.inf))
        return max(flops / peak, nbytes / self.bytes_per_second)


_H100 = "NVIDIA H100 Tensor Core GPU datasheet, SXM5, dense (half the with-sparsity figures)"
# float32 at JAX's default matmul precision, which uses TF32 tensor cores on these GPUs.
DEVICE_SPEEDS: dict[str, DeviceSpeeds] = {
    "h100": DeviceSpeeds(
        "NVIDIA H100 SXM",
        {
            "float32": 494.7e12,
            "bfloat16": 989.4e12,
            "float16": 989.4e12,
            "float8_e4m3fn": 1978.9e12,
            "float8_e5m2": 1978.9e12,
        },
        3.35e12,
        _H100,
    ),
    "h200": DeviceSpeeds(
        "NVIDIA H200 SXM",
        {
            "float32": 494.7e12,
            "bfloat16": 989.4e12,
            "float16": 989.4e12,
            "float8_e4m3fn": 1978.9e12,
            "float8_e5m2": 1978.9e12,
        },
        4.8e12,
        "NVIDIA H200 datasheet, SXM, dense; the H100's tensor cores with HBM3e",
    ),
    "a100": DeviceSpeeds(
        "NVIDIA A100 SXM 80GB",
        # No float8 tensor cores: XLA runs float8 products as bfloat16 GEMMs there.
        {
            "float32": 156e12,
            "bfloat16": 312e12,
            "float16": 312e12,
            "float8_e4m3fn": 312e12,
            "float8_e5m2": 312e12,
        },
        2.039e12,
        "NVIDIA A100 datasheet, SXM 80GB, dense",
    ),
}
_DEFAULT_DEVICE = "h100"


def _device_speeds(device: str | DeviceSpeeds | None) -> tuple[DeviceSpeeds, str]:
    """The speed table, and a note on how it was chosen."""
    if isinstance(device, DeviceSpeeds):
        return device, "given"
    if device is not None:
        if not isinstance(device, str) or device.lower() not in DEVICE_SPEEDS:
            raise ValueError(
                f"tune(device=...) must be one of {sorted(DEVICE_SPEEDS)}, a jamp.DeviceSpeeds "
                f"or None (this machine's), got {device!r}"
            )
        return DEVICE_SPEEDS[device.lower()], "given"
    here = jax.devices()[0]
    kind = str(getattr(here, "device_kind", "")).lower()
    for key in DEVICE_SPEEDS:
        if key in kind:
            return DEVICE_SPEEDS[key], f"detected ({here.device_kind})"
    why = (
        "the CPU's times of 16-bit code mean nothing"
        if here.platform == "cpu"
        else f"no table for {here.device_kind!r}"
    )
    return DEVICE_SPEEDS[_DEFAULT_DEVICE], f"default: {why}"


# --- what runs where: one rewrite per policy, recorded (jamp.explain's analysis) ------------------


@dataclasses.dataclass(frozen=True)
class _Op:
    """One matmul/convolution of the rewritten program."""

    path: tuple[str, ...]
    frames: tuple[tuple[str, int], ...]
    decided_by: str
    flops: int
    dtype: np.dtype  # what it computes in
    nbytes: int


class _OpRecorder(Recorder):
    def __init__(self, policy: Policy):
        super().__init__(policy)
        self.matmuls: list[_Op] = []

    def equation(self, step: Step, outs: list[Any]) -> None:
        super().equation(step, outs)
        if step.eqn.primitive.name not in step.policy.lower or not outs:
            return
        dtype = _compute_dtype(step)
        operands = sum(compat.aval_of(a).size for a in step.args[:2])
        out = compat.aval_of(outs[0])
        self.matmuls.append(
            _Op(
                tuple(step.state.path),
                compat.frame_lines(step.eqn.source_info),
                step.state.decided_by,
                matmul_flops(step.eqn) * step.rewriter.repeats,  # (a scan body: per iteration)
                np.dtype(dtype),
                step.rewriter.repeats
                * (operands * np.dtype(dtype).itemsize + out.size * np.dtype(out.dtype).itemsize),
            )
        )


class _Traced:
    """``fn`` traced once (under the float32 base policy); rewritten per policy for analysis."""

    def __init__(self, fn: Callable, policy: Policy, args: tuple, kwargs: dict):
        from .transform import trace_call

        # (the signature names a bad argument as tune's: ``tune(loss): argument batch['x']``)
        signature = CallSignature.of(fn, label="tune")
        _, flat, tracer, refuse_untraceable = trace_call(
            fn, policy, args, kwargs, signature=signature
        )
        refuse_untraceable()  # (before the programs tune compiles, which refuse it unnamed)
        traced = tracer()
        self.closed, self.kept_dtypes = traced.closed, traced.kept_dtypes
        self.jaxpr = compat.open_and_consts(self.closed)[0]
        self.avals = [compat.aval_of(x) for x in flat]
        self.shape: list[tuple[tuple[str, ...], int]] | None = None

    def matmuls(self, policy: Policy) -> list[_Op]:
        """The program's matmuls/convolutions under ``policy``, in program order (the same
        equations under every policy: a policy changes dtypes, never which products run)."""
        from .transform import rewrite_and_eval

        recorder = _OpRecorder(policy)
        compat.trace_to_closed(
            lambda *a: rewrite_and_eval(
                self.closed, policy, a, recorder, kept_dtypes=self.kept_dtypes
            ),
            self.avals,
        )
        if self.shape is None:
            self.shape = [(op.path, op.flops) for op in recorder.matmuls]
        elif [(op.path, op.flops) for op in recorder.matmuls] != self.shape:
            raise RuntimeError(  # would be a jamp bug: the analysis pairs products by position
                f"jamp.tune: the rewrite under {policy!r} ran other matmuls than under float32"
            )
        return recorder.matmuls


def _seconds(ops: Iterable[_Op], speeds: DeviceSpeeds) -> float:
    return sum(speeds.seconds(op.flops, op.nbytes, op.dtype) for op in ops)


# --- scopes ---------------------------------------------------------------------------------------


def _escape(name: str) -> str:
    """A literal name as a glob that ``Policy`` accepts: glob characters bracketed, and the
    characters ``Policy`` takes for signs of a regular expression replaced by ``?``."""
    name = re.sub(r"([*?\[])", r"[\1]", name)
    return re.sub(r"[\^$|\\+]", "?", name)


@dataclasses.dataclass
class _Unit:
    """One tunable scope: a scope path, or a source line for matmuls outside any scope."""

    name: str  # as shown: "Model/Dense_0" or "@model.py:12"
    rule: str  # the glob of its rule
    path: tuple[str, ...] | None
    line: tuple[str, int] | None
    ops: list[int]  # indices into the analysis' matmul list
    fixed: str | None = None  # why tune leaves it alone
    costs: dict[np.dtype, float] = dataclasses.field(default_factory=dict)
    errors: dict[np.dtype, float] = dataclasses.field(default_factory=dict)
    same_as: dict[np.dtype, np.dtype] = dataclasses.field(default_factory=dict)
    skipped: dict[np.dtype, str] = dataclasses.field(default_factory=dict)
    backed_off: str = ""


def _units(ops: list[_Op]) -> list[_Unit]:
    """Group the float32 program's matmuls into scopes (paths) and, outside scopes, lines."""
    lines = {own_frame(op.frames) for op in ops if not op.path}
    basenames: dict[str, set[str]] = {}
    for line in lines:
        if line is not None:
            basenames.setdefault(os.path.basename(line[0]), set()).add(line[0])
    units: dict[Any, _Unit] = {}
    for i, op in enumerate(ops):
        if op.path:
            key: Any = op.path
            if key not in units:
                units[key] = _Unit(
                    "/".join(op.path), "/".join(map(_escape, op.path)), op.path, None, []
                )
        else:
            frame = own_frame(op.frames)
            key = ("line", frame)
            if key not in units:
                if frame is None:
                    units[key] = _Unit("(no scope, no source line)", "", None, None, [])
                    units[key].fixed = "no scope and no source line: follows the compute dtype"
                else:
                    file, number = frame
                    shown = file if len(basenames[os.path.basename(file)]) > 1 else None
                    name = f"{LINE_RULE}{shown or os.path.basename(file)}:{number}"
                    units[key] = _Unit(name, _escape(name), None, frame, [])
        units[key].ops.append(i)
        if op.decided_by != "policy" and units[key].fixed is None:
            units[key].fixed = (
                "set by a jamp.autocast region"
                if op.decided_by == "region"
                else f"set by your {op.decided_by}"
            )
    return list(units.values())


def _governs(unit: _Unit, op: _Op) -> bool:
    """Whether ``unit``'s rule would decide ``op`` where nothing narrower does: a scope rule the
    ops at and below its path, a line rule the scope-less operations traced from that line."""
    if unit.path is not None:
        return op.path[: len(unit.path)] == unit.path
    return unit.line in op.frames


def _rules(units: list[_Unit], choice: Mapping[str, np.dtype], ops: list[_Op]) -> tuple:
    """The rules of an assignment: each lowered unit's, and float32 for a unit left in float32
    that a lowered one would otherwise govern (a layer inside a lowered scope)."""
    lowered = [u for u in units if choice.get(u.name, F32) != F32]
    rules = []
    for unit in units:
        dtype = choice.get(unit.name, F32)
        if dtype != F32:
            rules.append((unit.rule, dtype))
        elif unit.fixed is None and any(
            other is not unit and _governs(other, ops[i]) for other in lowered for i in unit.ops
        ):
            rules.append((unit.rule, F32))
    return tuple(rules)


# --- running fn: outputs and gradients, and their error against float32 -----------------------


class _Call:
    """One set of arguments (``example_args`` or ``check_args``) and how to run ``fn`` on them
    under a policy: outputs and the gradient of the ``argnums`` arguments, compiled per policy."""

    def __init__(self, fn: Callable, args: tuple, kwargs: dict, argnums: tuple[int, ...] | None):
        self.fn, self.argnums = fn, argnums
        self.flat, self.in_tree = jax.tree.flatten((args, kwargs))
        self.traced_at, _ = split_leaves(
            self.flat, self.in_tree, None, numbers_are_static=False, tokens_are_static=True
        )
        self.leaves = [self.flat[i] for i in self.traced_at]
        self.programs: dict[Policy, Callable] = {}
        # The outputs' and gradients' leaf names, filled in place by the traced programs: they
        # close over these lists, not over this object, which keeps the programs (a reference
        # from them back would be a cycle holding the arguments until a full collection).
        self.names: tuple[list[str], list[str]] = ([], [])
        self.runs = 0

    def run(self, policy: Policy) -> tuple[list[Any], list[Any]]:
        program = self.programs.get(policy)
        if program is None:
            program = self.programs[policy] = jax.jit(self._program(policy))
        self.runs += 1
        return program(*self.leaves)

    def run_many(self, policies: Sequence[Policy]) -> list[tuple[list[Any], list[Any]]]:
        """Several policies in one compiled program: a small program's compile time is mostly
        fixed cost (six variants of a tiny model compile in under twice one's time)."""
        programs = [self._program(p) for p in policies]
        self.runs += len(programs)
        return jax.jit(lambda *leaves: [program(*leaves) for program in programs])(*self.leaves)

    def _program(self, policy: Policy) -> Callable:
        from .transform import autocast_transform

        mixed = autocast_transform(self.fn, policy)
        flat, in_tree, traced_at, argnums = self.flat, self.in_tree, self.traced_at, self.argnums
        out_names, grad_names = self.names

        def program(*leaves: Any) -> tuple[list[Any], list[Any]]:
            full = list(flat)
            for i, leaf in zip(traced_at, leaves):
                full[i] = leaf
            args, kwargs = jax.tree.unflatten(in_tree, full)
            grads: Sequence[Any] = ()
            if argnums is None:
                out = mixed(*args, **kwargs)
            else:

                def differentiated(*diff: Any) -> Any:
                    call = list(args)
                    for i, value in zip(argnums, diff):
                        call[i] = value
                    return mixed(*call, **kwargs)

                out, pullback = jax.vjp(differentiated, *(args[i] for i in argnums))
                grads = pullback(_cotangent(out))
            outs_named = _floating_leaves(out, "output")
            grads_named = [
                pair
                for i, g in zip(argnums or (), grads)
                for pair in _floating_leaves(g, f"gradient of args[{i}]")
            ]
            out_names[:] = [n for n, _ in outs_named]
            grad_names[:] = [n for n, _ in grads_named]
            return [x for _, x in outs_named], [x for _, x in grads_named]

        return program


def _floating_leaves(tree: Any, prefix: str) -> list[tuple[str, Any]]:
    """``(name, leaf)`` of the floating leaves of ``tree``, named ``prefix[...]`` for messages."""
    return [
        (prefix + jax.tree_util.keystr(path), leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
        if hasattr(leaf, "dtype") and is_float(leaf.dtype)
    ]


def _cotangent(out: Any) -> Any:
    """The fixed cotangent of ``fn``'s outputs: 1 for a scalar, a fixed normal draw (the same
    for every policy) for an array, float0 zeros for an integer output."""
    leaves, tree = jax.tree.flatten(out)
    cts: list[Any] = []
    for i, x in enumerate(leaves):
        if not is_float(x.dtype):
            cts.append(np.zeros(np.shape(x), jax.dtypes.float0))
        elif np.ndim(x) == 0:
            cts.append(jnp.ones((), x.dtype))
        else:
            draw = jax.random.normal(jax.random.fold_in(jax.random.key(0), i), np.shape(x))
            cts.append(draw.astype(x.dtype))
    return jax.tree.unflatten(tree, cts)


@jax.jit
def _relative_error(values: list[Any], refs: list[Any]) -> Any:
    """``||values - refs|| / ||refs||`` over all leaves together (inf if a value is not finite),
    scaled by the largest reference magnitude so the sums cannot overflow."""
    if not refs:
        return jnp.float32(0)
    wide = jnp.result_type(jnp.float32, *(r.dtype for r in refs))
    scale = jnp.max(jnp.stack([jnp.max(jnp.abs(r.astype(wide)), initial=0) for r in refs]))
    scale = jnp.where(scale > 0, scale, 1)
    num = sum(
        jnp.sum(jnp.square((v.astype(wide) - r.astype(wide)) / scale)) for v, r in zip(values, refs)
    )
    den = sum(jnp.sum(jnp.square(r.astype(wide) / scale)) for r in refs)
    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(v)) for v in values]))
    rel = jnp.sqrt(jnp.where(den > 0, num / jnp.where(den > 0, den, 1), num))
    return jnp.where(finite, rel, jnp.inf)


class _Measure:
    """Errors of policies against the float32 policy, on each set of arguments."""

    def __init__(self, calls: list[_Call], reference: Policy, fn_name: str):
        self.calls = calls
        self.refs = []
        for call in calls:
            outs, grads = call.run(reference)
            for names, values in zip(call.names, (outs, grads)):
                finite = [bool(np.all(np.isfinite(np.asarray(v)))) for v in values]
                if not all(finite):
                    raise ValueError(
                        f"tune: {fn_name}'s {names[finite.index(False)]} is not finite in "
                        "float32 already; tune measures every precision against the float32 "
                        "program, so fix the function or its inputs first"
                    )
            self.refs.append((outs, grads))

    def errors(self, policy: Policy, calls: Iterable[int] = (0,)) -> list[float]:
        """Per set of arguments: the larger of the output's and the gradients' relative error
        (inf if anything is not finite). Each policy compiles a program of its own: the same
        one ``jax.jit`` makes of ``autocast_transform(fn, policy)`` and its gradient."""
        return [self._error(self.calls[i].run(policy), i) for i in calls]

    def sensitivities(self, policies: Sequence[Policy], per_program: int) -> list[float]:
        """The error of each policy on ``example_args``, ``per_program`` policies compiled
        together."""
        found: list[float] = []
        for start in range(0, len(policies), per_program):
            chunk = policies[start : start + per_program]
            found += [self._error(ran, 0) for ran in self.calls[0].run_many(chunk)]
        return found

    def _error(self, ran: tuple[list[Any], list[Any]], call: int) -> float:
        (outs, grads), (ref_outs, ref_grads) = ran, self.refs[call]
        errs = [float(_relative_error(outs, ref_outs)), float(_relative_error(grads, ref_grads))]
        return max(errs) if all(map(math.isfinite, errs)) else math.inf

    @property
    def runs(self) -> int:
        return sum(call.runs for call in self.calls)


# --- the result ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ScopeChoice:
    """One row of :class:`TuneResult`: a scope, its cost share, sensitivities and the choice.

    ``sensitivity`` maps a candidate dtype name to the measured relative error with only this
    scope in that dtype (``inf``: inf/NaN; None: not run, see ``why``); ``runs_as`` maps a
    candidate that runs exactly as another one in this scope (float8 on a matmul below
    ``Policy.min_float8_flops`` runs as bfloat16) to that one, whose sensitivity it shares.
    ``chosen`` is the dtype the scope's matmuls compute in under the tuned policy.
    """

    scope: str
    rule: str
    flops: int
    flop_share: float
    sensitivity: dict[str, float | None]
    runs_as: dict[str, str]
    chosen: str
    why: str


@dataclasses.dataclass(frozen=True)
class TuneResult:
    """What :func:`jamp.tune` chose.

    Attributes:
      policy: the tuned ``jamp.Policy``: the base policy with compute dtype float32 and a rule
        per lowered scope; pass it to ``autocast_transform`` or ``autocast``.
      error: the measured relative error of ``policy`` on ``example_args`` (the larger of the
        output's and, with ``grad``, the gradients'), against the float32 program.
      check_error: the same on ``check_args``, or None.
      estimated_speedup: matmul/convolution time under the base policy over that under
        ``policy``, from the device table (>1: faster than the base policy).
      speedup_over_float32: the same against float32.
      low_precision_flop_share: share of matmul/convolution FLOPs ``policy`` runs below float32;
        ``float8_flop_share``: in float8.
      scopes: one :class:`ScopeChoice` per scope, in program order.
      tolerance, candidates, device, device_note: what was asked and which speed table was used.
      runs: compiled runs of ``fn`` (reference, sensitivities, verifications); ``verifications``:
        how many of them checked a combined policy.
    """

    policy: Policy
    error: float
    check_error: float | None
    estimated_speedup: float
    speedup_over_float32: float
    low_precision_flop_share: float
    float8_flop_share: float
    scopes: tuple[ScopeChoice, ...]
    tolerance: float
    candidates: tuple[str, ...]
    device: DeviceSpeeds
    device_note: str
    runs: int
    verifications: int

    def __str__(self) -> str:
        names = [_SHORT.get(c, c) for c in self.candidates]
        width = max([len(s.scope) for s in self.scopes] + [5])
        lines = [
            f"jamp.tune: tolerance {self.tolerance:g}, candidates {', '.join(self.candidates)}; "
            f"{self.device.name} speeds ({self.device_note})",
            f"error {self.error:.3g}"
            + (f", on check_args {self.check_error:.3g}" if self.check_error is not None else "")
            + f"; estimated speedup {self.estimated_speedup:.2f}x over the base policy, "
            f"{self.speedup_over_float32:.2f}x over float32; "
            f"{self.low_precision_flop_share:.0%} of matmul FLOPs below float32"
            + (f" ({self.float8_flop_share:.0%} in float8)" if self.float8_flop_share else ""),
            f"{'scope':<{width}}  {'FLOPs':>6}  "
            + "  ".join(f"{'sens ' + n:>10}" for n in names)
            + f"  {'chosen':<13}  why",
        ]
        for s in self.scopes:
            cells = []
            for c in self.candidates:
                same = s.runs_as.get(c)
                text = "=" + _SHORT.get(same, same) if same else _format_error(s.sensitivity.get(c))
                cells.append(f"{text:>10}")
            lines.append(
                f"{s.scope:<{width}}  {s.flop_share:>6.1%}  "
                + "  ".join(cells)
                + f"  {s.chosen:<13}  {s.why}"
            )
        lines.append(f"{self.runs} compiled runs of fn ({self.verifications} verifications)")
        return "\n".join(lines)

    def plot(self, ax: Any = None) -> Any:
        """A bar chart of each scope's sensitivity per candidate (log scale), the tolerance as a
        line and the chosen dtype beside each scope. Needs matplotlib; returns the Axes.

        Example::

            result.plot().figure.savefig("tune.png")
        """
        try:
            import matplotlib.pyplot as plt
        except ImportError as err:
            raise ImportError(
                "TuneResult.plot needs matplotlib (pip install matplotlib); str(result) shows "
                "the same table as text"
            ) from err
        if ax is None:
            _, ax = plt.subplots(figsize=(8, 0.45 * len(self.scopes) + 1.5))
        rows = np.arange(len(self.scopes))
        height = 0.8 / max(len(self.candidates), 1)
        floor = (
            min(
                [v for s in self.scopes for v in s.sensitivity.values() if v and math.isfinite(v)]
                + [self.tolerance if 0 < self.tolerance < math.inf else 1e-3]
            )
            / 10
        )
        for k, name in enumerate(self.candidates):
            values = [s.sensitivity.get(name) for s in self.scopes]
            shown = [
                floor if v is None else (v if math.isfinite(v) else 1.0) or floor for v in values
            ]
            ax.barh(rows + k * height, shown, height, label=name)
        if 0 < self.tolerance < math.inf:
            ax.axvline(self.tolerance, color="k", linestyle="--", label="tolerance")
        ax.set_xscale("log")
        ax.set_yticks(rows + 0.4 - height / 2)
        ax.set_yticklabels([f"{s.scope} -> {s.chosen}" for s in self.scopes])
        ax.invert_yaxis()
        ax.set_xlabel("relative error with only this scope lowered (inf/NaN drawn at 1)")
        ax.legend()
        return ax


def _computes_in(ops: list[_Op]) -> str:
    """The dtype most of these matmuls' FLOPs compute in."""
    flops: dict[str, int] = {}
    for op in ops:
        flops[op.dtype.name] = flops.get(op.dtype.name, 0) + op.flops
    return max(flops, key=lambda d: flops[d]) if flops else "-"


def _format_error(value: float | None) -> str:
    if value is None:
        return "-"
    return "inf/NaN" if not math.isfinite(value) else f"{value:.2e}"


# --- validation -----------------------------------------------------------------------------------


def _check_candidates(candidates: Any) -> tuple[np.dtype, ...]:
    if isinstance(candidates, (str, type, np.dtype)) or not isinstance(candidates, Iterable):
        candidates = (candidates,)
    out: list[np.dtype] = []
    allowed = ", ".join(f"jnp.{d.name}" for d in CANDIDATE_DTYPES)
    for value in candidates:
        try:
            dtype = np.dtype(jnp.dtype(value))
        except TypeError:
            dtype = None
        if dtype == F32:
            raise ValueError(
                "tune: float32 is not a candidate: it is the reference every scope is measured "
                f"against and the choice where no candidate fits; candidates are {allowed}"
            )
        if dtype not in CANDIDATE_DTYPES:
            hint = (
                " (float8 computes in float8_e4m3fn; e5m2 is its gradient format)"
                if (dtype is not None and is_float8(dtype))
                else ""
            )
            raise ValueError(
                f"tune: unknown candidate dtype {value!r}{hint}; candidates are {allowed}"
            )
        if dtype not in out:
            out.append(dtype)
    if not out:
        raise ValueError(f"tune: candidates is empty; give at least one of {allowed}")
    return tuple(out)


def _check_tolerance(tolerance: Any) -> float:
    if (
        isinstance(tolerance, jax.Array)
        and tolerance.shape == ()
        and (
            jnp.issubdtype(tolerance.dtype, jnp.floating)
            or jnp.issubdtype(tolerance.dtype, jnp.integer)
        )
    ):
        tolerance = tolerance.item()  # (jnp.float32(1e-2) is an array, numpy's a number)
    if isinstance(tolerance, bool) or not isinstance(tolerance, numbers.Real):
        raise TypeError(
            f"tune: tolerance must be a number (a relative error such as 1e-2), got "
            f"{type(tolerance).__name__} {tolerance!r}"
        )
    value = float(tolerance)
    if math.isnan(value) or value < 0:
        raise ValueError(
            f"tune: tolerance must be >= 0 (a relative error of the output and gradients "
            f"against float32; 0 keeps every scope float32, math.inf allows any finite error), "
            f"got {tolerance!r}"
        )
    return value


def _integer_leaf(x: Any) -> bool:
    """An integer or bool array (a string or object array is named by the trace's own check)."""
    dtype = getattr(x, "dtype", None)
    return isinstance(dtype, np.dtype) and dtype.kind in "biu"


def _check_args_tuple(check_args: Any, example_args: tuple) -> tuple | None:
    if check_args is None:
        return None
    if not isinstance(check_args, (tuple, list)):
        raise TypeError(
            "tune: check_args must be a tuple of fn's positional arguments, as example_args "
            f"(held-out inputs), got {type(check_args).__name__}"
        )
    if len(check_args) != len(example_args):
        raise ValueError(
            f"tune: check_args has {len(check_args)} positional arguments, example_args "
            f"{len(example_args)}; give the same arguments with held-out values"
        )
    return tuple(check_args)


def _select_scopes(units: list[_Unit], scopes: Any) -> None:
    if scopes is None:
        return
    globs = (scopes,) if isinstance(scopes, str) else tuple(scopes)
    if not all(isinstance(g, str) for g in globs):
        raise TypeError(f"tune: scopes must be globs (str) over scope names, got {scopes!r}")
    for glob in globs:
        if not any(fnmatch.fnmatchcase(u.name, glob) for u in units):
            names = ", ".join(repr(u.name) for u in units[:12])
            raise ValueError(
                f"tune: scopes glob {glob!r} matches no scope of fn; its scopes with matmuls or "
                f"convolutions are {names}{' ...' if len(units) > 12 else ''}"
            )
    for unit in units:
        if unit.fixed is None and not any(fnmatch.fnmatchcase(unit.name, g) for g in globs):
            unit.fixed = "not in scopes="


# --- the search -----------------------------------------------------------------------------------


def _options(unit: _Unit) -> list[tuple[np.dtype, float, float]]:
    """``(dtype, cost, error)`` of every finite option, float32 included."""
    out = [(F32, unit.costs[F32], 0.0)]
    out += [
        (d, unit.costs[d], e)
        for d, e in unit.errors.items()
        if math.isfinite(e) and d not in unit.same_as  # the same program as another candidate
    ]
    return out


def _greedy(
    units: list[_Unit], budget: float, priority: Callable[[float, float], float]
) -> dict[str, np.dtype]:
    """Moves to cheaper options by ``priority(saving, added error)``, while the summed errors
    fit ``budget``."""
    choice = {u.name: F32 for u in units}
    cost = {u.name: u.costs.get(F32, 0.0) for u in units}
    error = {u.name: 0.0 for u in units}
    used = 0.0
    while True:
        best: tuple | None = None
        for unit in units:
            if unit.fixed is not None:
                continue
            for dtype, c, e in _options(unit):
                extra, saving = e - error[unit.name], cost[unit.name] - c
                if saving <= 0 or used + extra > budget:
                    continue
                score = (priority(saving, extra), saving, -e)
                if best is None or score > best[0]:
                    best = (score, unit, dtype, c, e)
        if best is None:
            return choice
        _, unit, dtype, c, e = best
        used += e - error[unit.name]
        choice[unit.name], cost[unit.name], error[unit.name] = dtype, c, e


# Orders of the greedy search (a multiple-choice knapsack): saving per added error, the usual
# choice, misses a large scope whose one cheap option fills the budget alone; largest saving
# first finds that one. Both are tried and the cheaper estimate kept.
_PRIORITIES: tuple[Callable[[float, float], float], ...] = (
    lambda saving, extra: saving / extra if extra > 0 else math.inf,
    lambda saving, extra: saving,
)


def _choose(units: list[_Unit], budget: float) -> dict[str, np.dtype]:
    """The cheapest of the greedy assignments by estimated cost (then estimated error)."""
    by_name = {u.name: u for u in units}
    estimate = lambda choice: (
        sum(by_name[n].costs.get(d, 0.0) for n, d in choice.items()),
        sum(by_name[n].errors.get(d, 0.0) for n, d in choice.items() if d != F32),
    )
    return min((_greedy(units, budget, p) for p in _PRIORITIES), key=estimate)


def _back_off(
    units: list[_Unit], choice: dict[str, np.dtype], measured: float, tolerance: float
) -> bool:
    """Demote the scopes that save least per unit of error to their next more precise option,
    until the additive estimate falls by the measured overshoot; False if nothing is lowered."""
    by_name = {u.name: u for u in units}
    estimate = lambda: sum(by_name[n].errors.get(d, 0.0) for n, d in choice.items() if d != F32)
    current = estimate()
    shrink = tolerance / measured if math.isfinite(measured) and measured > 0 else 0.5
    target = current * min(shrink, 0.999)
    demoted = False
    while any(d != F32 for d in choice.values()) and (not demoted or estimate() > target):
        steps = []
        for name, dtype in choice.items():
            if dtype == F32:
                continue
            unit = by_name[name]
            e, c = unit.errors[dtype], unit.costs[dtype]
            better = [o for o in _options(unit) if o[2] < e and o[1] > c]
            to = min(better, key=lambda o: o[1]) if better else (F32, unit.costs[F32], 0.0)
            steps.append(((to[1] - c) / max(e - to[2], 1e-30), name, to[0], dtype))
        _, name, to_dtype, from_dtype = min(steps, key=lambda s: s[0])
        by_name[name].backed_off = (
            f"backed off from {from_dtype.name}: the combined error measured "
            f"{_format_error(measured)} > tolerance {tolerance:g}"
        )
        choice[name] = to_dtype
        demoted = True
    return demoted


def _why(unit: _Unit, dtype: np.dtype, candidates: tuple[np.dtype, ...]) -> str:
    if unit.fixed is not None:
        return unit.fixed
    same = "; ".join(f"{d.name} runs as {s.name} here" for d, s in unit.same_as.items())
    if unit.backed_off:
        reason = unit.backed_off
    elif dtype != F32:
        cheaper = [d for d in candidates if unit.costs.get(d, math.inf) < unit.costs[dtype]]
        over = lambda d: "inf/NaN" if not math.isfinite(unit.errors[d]) else "would exceed it"
        reason = (
            "within the budget (" + ", ".join(f"{d.name}: {over(d)}" for d in cheaper) + ")"
            if cheaper
            else "cheapest candidate, within the budget"
        )
    elif all(d in unit.skipped for d in candidates):
        reason = unit.skipped[candidates[0]]
    elif all(not math.isfinite(e) for e in unit.errors.values()):
        reason = "inf/NaN in " + ", ".join(d.name for d in unit.errors)
    else:
        reason = "sensitivity over the remaining budget"
    return f"{reason}; {same}" if same else reason


def _check_float32_fields(base: Policy) -> None:
    """The tuned policy computes in float32 wherever a scope stays float32 (its reference is the
    base in float32): an accumulation or gradient reduction narrower than float32 would apply
    there too (Policy refuses the reduction outright), and the reference would not be float32."""
    for field in ("accumulate_dtype", "reduce_dtype"):
        dtype = getattr(base, field)
        if dtype is not None and np.dtype(dtype).itemsize < 4:
            raise ValueError(
                f"tune: policy.{field}={np.dtype(dtype).name} is narrower than float32, but the "
                "tuned policy runs in float32 every scope that stays float32 (and measures "
                "errors against float32), where it would apply too. Tune with "
                f"{field}=None (or jnp.float32); the tuned scopes' rules choose their 16-bit "
                "dtypes"
            )


@compat.api_boundary  # (fn's errors show fn's frames, as under jax.jit)
def tune(
    fn: Callable,
    *example_args: Any,
    candidates: Any = (jnp.bfloat16,),
    tolerance: float = 1e-2,
    policy: Policy | Any = None,
    check_args: tuple | None = None,
    grad: Any = True,
    scopes: str | Sequence[str] | None = None,
    device: str | DeviceSpeeds | None = None,
    **kwargs: Any,
) -> TuneResult:
    """Choose each scope's precision: the cheapest assignment whose error stays in ``tolerance``.

    Every scope with matmuls or convolutions (Flax module paths, ``jax.named_scope`` names; a
    source line for code without scopes) runs in float32 or one of ``candidates``, chosen from
    its measured sensitivity (the error of ``fn(*example_args, **kwargs)`` with only that scope
    lowered) and its cost on ``device`` (FLOPs and bytes, as ``jamp.explain`` counts them, over
    the device's speed table). The combined policy is then run and backed off until its
    measured error is within ``tolerance`` and finite, on ``example_args`` and on
    ``check_args`` (held-out positional arguments). Cost: one compiled run of ``fn`` (forward
    and gradients) per scope and candidate, a float32 reference and usually one verification;
    the guide "Tuning precision per scope" and the ``jamp/tune.py`` docstring give the method.

    Args:
      fn: the function, as you would pass it to ``autocast_transform``.
      example_args: its positional arguments; ``kwargs`` its keyword arguments.
      candidates: lower-precision dtypes to choose from: ``jnp.bfloat16``, ``jnp.float16``,
        ``jnp.float8_e4m3fn``.
      tolerance: the largest relative error ``||y - y32|| / ||y32||`` of the outputs and (with
        ``grad``) of the gradients against float32; ``0`` keeps every scope float32,
        ``math.inf`` takes each scope's cheapest finite candidate. Every floating output counts,
        in one norm, and the gradient is of all of them: tune a ``(loss, aux)`` function as
        ``lambda *a: fn(*a)[0]`` to measure the loss and the gradient you train with (a large
        aux output would hide the loss's error).
      policy: the base policy (tables, ``min_float8_flops``, your rules; ``None``:
        ``jamp.Policy()``); the result keeps its fields, with compute dtype float32 and the
        tuned rules added. Scopes your rules or ``jamp.autocast`` regions decide are kept. An
        ``accumulate_dtype`` or ``reduce_dtype`` narrower than float32 raises ``ValueError``:
        it would apply to the scopes that stay float32.
      check_args: held-out positional arguments the tuned policy must also meet ``tolerance`` on.
      grad: also measure the gradients of argument 0 (``True``), of the given argument index or
        indices, or not (``False``).
      scopes: globs over scope names (as printed in the result) restricting which are tuned.
      device: ``"h100"``, ``"h200"``, ``"a100"`` or a :class:`DeviceSpeeds`; ``None`` detects
        the GPU and otherwise uses the H100 table.

    Example::

        result = jamp.tune(loss_fn, params, batch, candidates=(jnp.bfloat16,), tolerance=1e-2)
        step = jax.jit(jax.grad(jamp.autocast_transform(loss_fn, result.policy)))
    """
    from .transform import resolve_policy

    if not callable(fn):
        raise TypeError(f"tune expects a callable, got {type(fn).__name__} {fn!r}")
    dtypes = _check_candidates(candidates)
    tolerance = _check_tolerance(tolerance)
    base = resolve_policy(policy, where="tune")
    _check_float32_fields(base)
    try:
        argnums = normalize_argnums(grad)
    except TypeError as err:
        raise TypeError(f"tune: {err}") from None
    n_args = len(example_args)
    for i in argnums or ():
        if not -n_args <= i < n_args:
            raise ValueError(
                f"tune: grad={grad!r} names argument {i} but {n_args} positional example_args "
                "were given"
            )
        leaves = jax.tree.leaves(example_args[i])
        if leaves and all(map(_integer_leaf, leaves)):
            # (jax.grad refuses it; tune measured no gradient and passed any policy)
            raise ValueError(
                f"tune: grad={grad!r} differentiates argument {i}, which has no floating leaf "
                "(token ids, a step count): there is no gradient to measure. Pass grad= the "
                "index of the parameters (e.g. grad=1 for fn(tokens, params))"
            )
    held_out = _check_args_tuple(check_args, example_args)
    speeds, device_note = _device_speeds(device)
    fn_name = getattr(fn, "__name__", type(fn).__name__)
    reference = base.replace(compute_dtype=F32)

    traced = _Traced(fn, reference, example_args, kwargs)
    ops = traced.matmuls(reference)
    if not ops:
        raise ValueError(
            f"tune: {fn_name} has no matmul or convolution (the lower table: "
            f"{', '.join(sorted(base.lower))}), so there is no precision to choose"
        )
    units = _units(ops)
    _select_scopes(units, scopes)
    tunable = [u for u in units if u.fixed is None]
    with_rules = lambda choice: reference.replace(
        rules=reference.rules + _rules(units, choice, ops)
    )

    # Cost of every scope in float32 and in each candidate, from one rewrite per candidate.
    for unit in units:
        unit.costs[F32] = _seconds((ops[i] for i in unit.ops), speeds)
    signatures: dict[np.dtype, list[_Op]] = {}
    for dtype in dtypes:
        lowered = traced.matmuls(with_rules({u.name: dtype for u in tunable}))
        signatures[dtype] = lowered
        for unit in tunable:
            unit.costs[dtype] = _seconds((lowered[i] for i in unit.ops), speeds)

    calls = [_Call(fn, example_args, kwargs, argnums)]
    if held_out is not None:
        calls.append(_Call(fn, held_out, kwargs, argnums))
    measure = _Measure(calls, reference, fn_name)

    # Sensitivity: only this scope lowered, against float32 (compiled a few variants at a time).
    pending: list[tuple[_Unit, np.dtype]] = []
    for unit in tunable:
        runs_as: dict[tuple, np.dtype] = {}
        for dtype in sorted(dtypes, key=lambda d: -d.itemsize):  # an alias names the wider one
            if unit.costs[dtype] >= unit.costs[F32]:
                unit.skipped[dtype] = f"no saving on {speeds.name}"
                continue
            signature = tuple(
                (signatures[dtype][i].dtype, signatures[dtype][i].nbytes) for i in unit.ops
            )
            if signature in runs_as:  # e.g. float8 below min_float8_flops: runs as bfloat16
                unit.same_as[dtype] = runs_as[signature]
                continue
            runs_as[signature] = dtype
            pending.append((unit, dtype))
    per_program = max(1, _EQUATIONS_PER_PROGRAM // (3 * count_sites(traced.jaxpr)[0] + 1))
    found = measure.sensitivities([with_rules({u.name: d}) for u, d in pending], per_program)
    for (unit, dtype), measured in zip(pending, found):
        unit.errors[dtype] = measured
    for unit in tunable:
        unit.errors.update({d: unit.errors[s] for d, s in unit.same_as.items()})

    # Choose, then verify the combined policy and back off until it is within tolerance.
    choice = _choose(units, tolerance)
    verifications = 0
    while True:
        verifications += 1
        errors = measure.errors(with_rules(choice), range(len(calls)))
        worst = max(errors)
        if worst <= tolerance:  # inf/NaN never is
            break
        if not _back_off(units, choice, worst, tolerance):
            break
    tuned = with_rules(choice)

    final_ops = traced.matmuls(tuned)
    base_seconds = _seconds(traced.matmuls(base), speeds)
    tuned_seconds = _seconds(final_ops, speeds) or 1.0
    total_flops = sum(op.flops for op in ops) or 1
    rows = tuple(
        ScopeChoice(
            scope=unit.name,
            rule=unit.rule,
            flops=sum(ops[i].flops for i in unit.ops),
            flop_share=sum(ops[i].flops for i in unit.ops) / total_flops,
            sensitivity={d.name: unit.errors.get(d) for d in dtypes},
            runs_as={d.name: s.name for d, s in unit.same_as.items()},
            chosen=_computes_in([final_ops[i] for i in unit.ops]),
            why=_why(unit, choice.get(unit.name, F32), dtypes),
        )
        for unit in units
    )
    return TuneResult(
        policy=tuned,
        error=errors[0],
        check_error=errors[1] if held_out is not None else None,
        estimated_speedup=base_seconds / tuned_seconds,
        speedup_over_float32=_seconds(ops, speeds) / tuned_seconds,
        low_precision_flop_share=sum(op.flops for op in final_ops if op.dtype.itemsize < 4)
        / total_flops,
        float8_flop_share=sum(op.flops for op in final_ops if op.dtype.itemsize == 1) / total_flops,
        scopes=rows,
        tolerance=tolerance,
        candidates=tuple(d.name for d in dtypes),
        device=speeds,
        device_note=device_note,
        runs=measure.runs,
        verifications=verifications,
    )


# --- weights: which kernels a frozen program stores in 8 or 4 bits -------------------------------


@dataclasses.dataclass(frozen=True)
class WeightsScope:
    """One row of :class:`WeightsTuneResult`: a scope's kernels, their bytes and the choice.

    ``nbytes`` maps ``"frozen"`` and each candidate's name to the scope's kernel bytes stored
    so (scales included); ``sensitivity`` each candidate to the relative output error with only
    this scope's kernels quantized; ``chosen`` is a candidate's name or ``"frozen"`` (kept)."""

    scope: str
    rule: str
    nbytes: dict[str, int]
    sensitivity: dict[str, float]
    chosen: str
    why: str


@dataclasses.dataclass(frozen=True)
class WeightsTuneResult:
    """What :func:`jamp.tune_weights` chose; pass it as ``tracing.freeze(..., weights=result)``.

    Attributes:
      weights_rules: the ``(glob, dtype or None)`` rules of the choice, one per scope (what
        ``weights=`` takes; editable).
      error: the relative output error of the choice on the calibration inputs, against the
        frozen program; ``check_error`` the same on ``check_inputs``, or None.
      nbytes: the kernels' bytes stored as chosen (scales included); ``frozen_nbytes`` as frozen.
      scopes: one :class:`WeightsScope` per scope with kernels, in program order.
      tolerance, candidates, runs: what was asked; compiled runs of the frozen program.
    """

    weights_rules: tuple[tuple[str, np.dtype | None], ...]
    error: float
    check_error: float | None
    nbytes: int
    frozen_nbytes: int
    scopes: tuple[WeightsScope, ...]
    tolerance: float
    candidates: tuple[str, ...]
    runs: int

    def __str__(self) -> str:
        width = max([len(s.scope) for s in self.scopes] + [5])
        lines = [
            f"jamp.tune_weights: tolerance {self.tolerance:g}, candidates "
            f"{', '.join(self.candidates)}",
            f"error {self.error:.3g}"
            + (f", on check_inputs {self.check_error:.3g}" if self.check_error is not None else "")
            + f"; kernels {self.nbytes:,} bytes, {self.nbytes / max(self.frozen_nbytes, 1):.2f}x "
            f"of {self.frozen_nbytes:,} as frozen",
            f"{'scope':<{width}}  {'bytes':>10}  "
            + "  ".join(f"{'sens ' + c:>16}" for c in self.candidates)
            + "  chosen         why",
        ]
        for s in self.scopes:
            cells = "  ".join(f"{_format_error(s.sensitivity.get(c)):>16}" for c in self.candidates)
            lines.append(
                f"{s.scope:<{width}}  {s.nbytes['frozen']:>10,}  {cells}  {s.chosen:<13}  {s.why}"
            )
        lines.append(f"{self.runs} compiled runs of the frozen program")
        return "\n".join(lines)


def _check_inputs_tuple(check_inputs: Any, inputs: tuple) -> tuple | None:
    if check_inputs is None:
        return None
    if not isinstance(check_inputs, (tuple, list)) or len(check_inputs) != len(inputs):
        raise TypeError(
            f"tune_weights: check_inputs must be a tuple of {len(inputs)} held-out input(s), as "
            f"the calibration inputs, got {type(check_inputs).__name__}"
        )
    return tuple(check_inputs)


def _weights_tolerance(tolerance: Any) -> float:
    """``tolerance`` checked as ``tune`` checks its own, the errors in tune_weights' terms."""
    try:
        return _check_tolerance(tolerance)
    except TypeError:
        raise TypeError(
            "tune_weights: tolerance must be a number (a relative output error such as 1e-2), "
            f"got {type(tolerance).__name__} {tolerance!r}"
        ) from None
    except ValueError:
        raise ValueError(
            "tune_weights: tolerance must be >= 0 (the largest relative error of the outputs "
            "against the frozen program's; 0 keeps every kernel as frozen, math.inf allows any "
            f"finite error), got {tolerance!r}"
        ) from None


def tune_weights(
    frozen: Any,
    *calibration_inputs: Any,
    candidates: Any = (jnp.int8, jnp.int4),
    tolerance: float = 1e-2,
    check_inputs: tuple | None = None,
) -> WeightsTuneResult:
    """Choose each scope's weight format for ``tracing.freeze(..., weights=...)``.

    ``frozen`` is a ``tracing.freeze`` result without ``weights=``. Each scope with kernels (the
    Flax module path of a Dense/Conv; a source line outside scopes) is measured with only its
    kernels quantized to each candidate: the relative error ``||y - y0|| / ||y0||`` of the
    outputs on ``calibration_inputs`` against the frozen program's own ``y0``. The cheapest
    assignment (fewest stored bytes) whose summed errors fit ``tolerance`` is taken by
    ``jamp.tune``'s greedy search, then verified as a whole (and on ``check_inputs``) and backed
    off until the measured error is within ``tolerance``. Cost: one compiled run per scope and
    candidate, a reference and usually one verification.

    Args:
      frozen: the frozen program (``tracing.freeze(model, variables, x, policy=...)``).
      calibration_inputs: its inputs, as you call it.
      candidates: weight formats: ``jnp.int8``, ``jnp.int4``, ``jnp.float8_e4m3fn``.
      tolerance: the largest relative output error; ``0`` keeps every kernel as frozen.
      check_inputs: held-out inputs (a tuple, as ``calibration_inputs``) the choice must also
        meet ``tolerance`` on.

    Example::

        frozen = tracing.freeze(model, variables, x)
        chosen = jamp.tune_weights(frozen, x, candidates=(jnp.int8, jnp.int4), tolerance=2e-2)
        served = tracing.freeze(model, variables, x, weights=chosen)
    """
    from tracing.passes.quantize_weights import kernels, quantize_weights, weight_dtype

    closed, signature = getattr(frozen, "jaxpr", None), getattr(frozen, "signature", None)
    if closed is None or signature is None or not hasattr(frozen, "kernels"):
        raise TypeError(
            "tune_weights: frozen must be a tracing.freeze(...) result (frozen without weights=), "
            f"got {type(frozen).__name__}"
        )
    if any(k.stored != k.dtype for k in frozen.kernels):
        raise ValueError(
            "tune_weights: frozen was frozen with weights= already; freeze without weights= and "
            "tune that, then freeze again with weights=result"
        )
    if isinstance(candidates, (str, type, np.dtype)) or not isinstance(candidates, Iterable):
        candidates = (candidates,)
    checked = [weight_dtype(c, "tune_weights: candidates") for c in candidates]
    dtypes = tuple(dict.fromkeys(d for d in checked if d is not None))
    if not dtypes or len(dtypes) != len(set(checked)):
        raise ValueError(
            "tune_weights: candidates must be one or more of jnp.int8, jnp.int4, "
            f"jnp.float8_e4m3fn (keeping a scope as frozen is always an option), got {candidates!r}"
        )
    tolerance = _weights_tolerance(tolerance)
    held_out = _check_inputs_tuple(check_inputs, calibration_inputs)
    # (a float8 policy's 8-bit kernels are listed too, and stay as they are: not a choice here)
    found = [k for k in kernels(closed) if np.dtype(k.dtype).itemsize >= 2]
    if not found:
        raise ValueError(
            f"tune_weights: {frozen.__name__} has no kernel to quantize (no matmul or "
            "convolution reads a 16- or 32-bit floating constant at the top level)"
        )

    units: dict[str, _Unit] = {}
    for k in found:
        rule = "/".join(map(_escape, k.path)) if k.path else _escape(k.scope)
        units.setdefault(k.scope, _Unit(k.scope, rule, k.path or None, None, []))
    order = list(units.values())
    as_rules = lambda choice: tuple(
        (u.rule, None if choice.get(u.name, F32) == F32 else choice[u.name]) for u in order
    )

    def quantized(choice: Mapping[str, np.dtype], log: list | None = None) -> Any:
        return quantize_weights(closed, as_rules(choice), "tune_weights", log)

    for unit in order:
        unit.costs[F32] = float(sum(k.nbytes for k in found if k.scope == unit.name))
    for dtype in dtypes:
        log: list = []
        quantized({u.name: dtype for u in order}, log)
        for unit in order:
            unit.costs[dtype] = float(sum(k.nbytes for k in log if k.scope == unit.name))

    name = frozen.__name__
    remedy = (
        "tune_weights runs the program as it was frozen: calibrate at those shapes, or freeze "
        "again at the new shapes and tune that"
    )
    leaf_sets = [signature.flatten(calibration_inputs, f"tune_weights({name})", remedy)]
    if held_out is not None:
        leaf_sets.append(signature.flatten(held_out, f"tune_weights({name}, check_inputs)", remedy))
    runs = 0

    def outputs(program: Any, leaves: list) -> list[Any]:
        nonlocal runs
        runs += 1
        jaxpr, consts = compat.open_and_consts(program)
        outs = jax.jit(lambda *xs: compat.eval_jaxpr(jaxpr, consts, xs))(*leaves)
        return [o for o in outs if is_float(o.dtype)]

    refs = [outputs(closed, leaves) for leaves in leaf_sets]

    def errors(choice: Mapping[str, np.dtype], sets: Iterable[int] = (0,)) -> list[float]:
        program = quantized(choice)
        measured = [float(_relative_error(outputs(program, leaf_sets[i]), refs[i])) for i in sets]
        return [e if math.isfinite(e) else math.inf for e in measured]

    for unit in order:
        for dtype in dtypes:
            unit.errors[dtype] = errors({unit.name: dtype})[0]

    choice = _choose(order, tolerance)
    while True:
        measured = errors(choice, range(len(leaf_sets)))
        if max(measured) <= tolerance or not _back_off(order, choice, max(measured), tolerance):
            break
    final_log: list = []
    quantized(choice, final_log)
    frozen_bytes = int(sum(k.frozen_nbytes for k in final_log))

    def why(unit: _Unit) -> str:
        dtype = choice.get(unit.name, F32)
        if unit.backed_off:
            return unit.backed_off
        if dtype != F32:
            return "cheapest within the budget"
        return "every candidate over the remaining budget"

    rows = tuple(
        WeightsScope(
            scope=u.name,
            rule=u.rule,
            nbytes={"frozen": int(u.costs[F32]), **{d.name: int(u.costs[d]) for d in dtypes}},
            sensitivity={d.name: u.errors[d] for d in dtypes},
            chosen="frozen" if choice.get(u.name, F32) == F32 else choice[u.name].name,
            why=why(u),
        )
        for u in order
    )
    return WeightsTuneResult(
        weights_rules=as_rules(choice),
        error=measured[0],
        check_error=measured[1] if held_out is not None else None,
        nbytes=int(sum(k.nbytes for k in final_log)),
        frozen_nbytes=frozen_bytes,
        scopes=rows,
        tolerance=tolerance,
        candidates=tuple(d.name for d in dtypes),
        runs=runs,
    )
