"""float8 matmuls and convolutions: ``Policy(jnp.float8_e4m3fn)``.

Each lower-table op (``dot_general``, ``conv_general_dilated``) with two floating operands runs
on float8 copies of them, each scaled per tensor from its current absolute maximum
(``scale = amax / finfo(fp8).max``, so the largest magnitude maps to the format's largest finite
value and nothing saturates to inf). Forward operands use ``float8_e4m3fn``; operands that the
backward pass computed (cotangents) use ``float8_e5m2``, TransformerEngine's HYBRID recipe:

- under ``jax.grad(autocast_transform(f))`` the op's output carries ``gradient_qdq``, whose
  backward rule scales the incoming cotangent to e5m2, so the transposed dots JAX derives read
  an e5m2 cotangent and the e4m3 forward operands;
- under ``autocast_transform(jax.grad(f))`` the transposed dots are ordinary equations of the
  program: an operand computed by a transposed equation (``Env.cotangent``) is scaled to e5m2.

The emitted program has the shape of Flax's ``fp8_ops`` (quantize: divide by the scale, clamp,
convert to float8; dequantize: convert back, multiply by the scale; then the dot), which XLA's GPU
GEMM rewriter turns into one cuBLASLt float8 GEMM with the scales as its operands. Quantization is
straight-through for gradients (its derivative is taken as the identity, as in Flax and
TransformerEngine), and gradients come back in the operands' own dtypes (float32 parameters get
float32 gradients). Every other op follows the bfloat16 tables: the fp32 table runs in float32,
the rest in bfloat16 (``Policy.value_dtype``).

Scales are computed from the tensor itself on every call ("current scaling"): no state to carry,
at the cost of one max-reduction per operand. Under ``jax.vmap`` a tensor is one example's slice.
"""
from __future__ import annotations

import functools
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .. import _compat as compat
from ..interpreter import F32, F64, SCALED_FORMATS, Step, _output_type
from ..policy import FLOAT8_COMPUTE

FORWARD_FORMAT = FLOAT8_COMPUTE                 # activations and weights
GRADIENT_FORMAT = np.dtype(jnp.float8_e5m2)     # cotangents: more range, less precision
SCALED_PRIMITIVES = frozenset({"dot_general", "conv_general_dilated"})


def scale_for(x: Any, fmt: np.dtype) -> Any:
    """float32 ``amax(|x|) / finfo(fmt).max``; 1 for an all-zero tensor. A non-finite amax gives a
    non-finite scale, so an inf or NaN in ``x`` propagates instead of being clamped away."""
    amax = jnp.max(jnp.abs(x)).astype(F32)
    return jnp.where(amax == 0, jnp.float32(1), amax / jnp.float32(jnp.finfo(fmt).max))


def quantize(x: Any, fmt: np.dtype, scale: Any) -> Any:
    """``x / scale``, clamped to the format's finite range, in ``fmt`` (computed in float32)."""
    limit = jnp.float32(jnp.finfo(fmt).max)
    return jax.lax.clamp(-limit, x.astype(F32) / scale, limit).astype(fmt)


def dequantize(q: Any, dtype: np.dtype, scale: Any) -> Any:
    return q.astype(dtype) * scale.astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def quantize_dequantize(x: Any, fmt: np.dtype, dtype: np.dtype) -> Any:
    """``x`` through ``fmt`` with its own per-tensor scale, returned in ``dtype``."""
    scale = scale_for(x, fmt)
    return dequantize(quantize(x, fmt, scale), dtype, scale)


def _qdq_fwd(x: Any, fmt: np.dtype, dtype: np.dtype) -> tuple[Any, Any]:
    # The residual is a zero-size array of x's dtype: the backward rule needs only the dtype.
    return quantize_dequantize(x, fmt, dtype), jnp.zeros((0,), x.dtype)


def _qdq_bwd(fmt: np.dtype, dtype: np.dtype, like: Any, g: Any) -> tuple[Any]:
    return (g.astype(like.dtype),)  # straight through, in the operand's own dtype


quantize_dequantize.defvjp(_qdq_fwd, _qdq_bwd)


@jax.custom_vjp
def gradient_qdq(y: Any) -> Any:
    """The identity; its cotangent goes through e5m2 with the cotangent's own scale."""
    return y


def _gradient_fwd(y: Any) -> tuple[Any, None]:
    return y, None


def _gradient_bwd(_: None, g: Any) -> tuple[Any]:
    scale = scale_for(g, GRADIENT_FORMAT)
    return (dequantize(quantize(g, GRADIENT_FORMAT, scale), g.dtype, scale),)


gradient_qdq.defvjp(_gradient_fwd, _gradient_bwd)


def _qualifies(step: Step) -> bool:
    floating = step.floating()
    return (step.eqn.primitive.name in SCALED_PRIMITIVES and len(step.args) == 2
            and floating == [0, 1]
            and all(step.aval(i).dtype != F64 for i in floating))


def float8_rule(step: Step) -> Optional[Sequence[Any]]:
    """A lower-table op on per-tensor scaled float8 operands; None where it does not qualify
    (an integer operand, ``ragged_dot_general``): the op then runs in bfloat16."""
    if not _qualifies(step):
        return None
    value = step.state.value_dtype
    formats = [GRADIENT_FORMAT if step.has_tag(i, "cotangent") else FORWARD_FORMAT
               for i in range(2)]
    with compat.equation_context(step.eqn):
        operands = [quantize_dequantize(a, fmt, value) for a, fmt in zip(step.args, formats)]
    outs = step.bind(operands, **_output_type(step, step.policy.accumulate_dtype or value))
    step.flop_dtype = GRADIENT_FORMAT if GRADIENT_FORMAT in formats else FORWARD_FORMAT
    with compat.equation_context(step.eqn):
        return [gradient_qdq(y) for y in outs]


SCALED_FORMATS[FORWARD_FORMAT] = float8_rule
