"""Float8 programs whose GPU compilation the fallback check reads (issue 35).

Shared by ``tests/test_float8_gpu.py`` (run where a GPU is present) and by the capture that
recorded their optimized HLO on a lent GPU for the CPU tests (``tests/data/gpu_h200_*.hlo``):

    python -m tests.float8_gpu_programs OUT_DIR    # on a GPU: OUT_DIR/<name>.hlo, verdicts.txt
"""
from __future__ import annotations

import dataclasses
import functools
import pathlib
import sys
from typing import Any, Callable

import jax
import jax.numpy as jnp

import jamp
from jamp import float8_check

F8 = jamp.Policy(jnp.float8_e4m3fn, min_float8_flops=0)  # every matmul in float8


def _normal(seed: int, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


@dataclasses.dataclass
class Program:
    """``fn(*args)``, under ``policy`` (None: as written), differentiated when ``grad``; the
    arguments are drawn when first used (the CPU suite only imports these)."""

    doc: str
    fn: Callable
    make_args: Callable[[], tuple]
    policy: jamp.Policy | None = F8
    grad: bool = False

    @functools.cached_property
    def args(self) -> tuple:
        return self.make_args()

    def jitted(self) -> Callable:
        fn = self.fn if self.policy is None else jamp.autocast_transform(self.fn, self.policy)
        return jax.jit(jax.grad(fn, argnums=(0, 1)) if self.grad else fn)

    def compiled(self) -> Any:
        return self.jitted().lower(*self.args).compile()

    def explain(self) -> jamp.Report:
        """``jamp.explain(..., compiled=True)``: a verdict per float8 dot jamp emitted."""
        fn = jax.grad(self.fn, argnums=(0, 1)) if self.grad else self.fn
        return jamp.explain(fn, *self.args, policy=self.policy, compiled=True)


def layer(m: int, k: int, n: int, grad: bool = False) -> Program:
    """``x @ w`` (bf16 activations, float32 weights) under float8 autocast; with ``grad`` the
    gradients of ``sum((x @ w) * c)``: the e4m3 forward dot and two backward dots on the e5m2
    cotangent."""
    def x_w():
        return _normal(0, (m, k), jnp.bfloat16), 0.02 * _normal(1, (k, n))

    if not grad:
        return Program(f"x @ w, {m}x{k}x{n}", lambda x, w: x @ w, x_w)
    return Program(f"gradients of sum((x @ w) * c), {m}x{k}x{n}",
                   lambda x, w, c: jnp.sum((x @ w).astype(jnp.float32) * c),
                   lambda: (*x_w(), _normal(2, (m, n), jnp.bfloat16)), grad=True)


def e5m2_pair(m: int, k: int, n: int) -> Program:
    """A dot of two e5m2 operands, written by hand: no cuBLASLt float8 GEMM takes that pair."""
    return Program(f"a dot of two e5m2 operands, {m}x{k}x{n}",
                   lambda a, b: jax.lax.dot(a, b, preferred_element_type=jnp.bfloat16),
                   lambda: (_normal(0, (m, k), jnp.float8_e5m2),
                            _normal(1, (k, n), jnp.float8_e5m2)),
                   policy=None)


PROGRAMS: dict[str, Program] = {
    "f8_forward_4096": layer(4096, 4096, 4096),
    "f8_gradients_4096": layer(4096, 4096, 4096, grad=True),
    "f8_gradients_1024": layer(1024, 1024, 1024, grad=True),
    "f8_forward_not_16": layer(4100, 4096, 4104),  # M and N not multiples of 16
    "f8_e5m2_pair": e5m2_pair(4096, 4096, 4096),
}


def capture(out: pathlib.Path) -> None:
    """Each program's optimized HLO and the check's readings of it, on the device it runs on."""
    out.mkdir(parents=True, exist_ok=True)
    lines = [str(float8_check.device_info())]
    for name, program in PROGRAMS.items():
        exe = program.compiled()
        (out / f"{name}.hlo").write_text(exe.as_text())
        check = float8_check.check_compiled(exe)
        lines.append(f"## {name} ({program.doc}): f8 GEMMs {check.float8_gemms}, fallback "
                     f"GEMMs {len(check.fallback_gemms)}\n{check}")
        if program.policy is not None:
            lines.append(f"explain:\n{program.explain().float8_check}")
    (out / "verdicts.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    capture(pathlib.Path(sys.argv[1]))
