"""float8 matmuls and convolutions: ``Policy(jnp.float8_e4m3fn)``.

A lower-table op with two floating operands, one of them a weight (see ``_qualifies``), and at
least ``Policy.min_float8_flops`` FLOPs (smaller ones stay bfloat16) runs on float8 copies of
its operands, each scaled per tensor from its current absolute maximum
(``scale = amax / finfo(fp8).max``: the largest magnitude maps to the format's largest finite
value, nothing saturates to inf). Forward operands use ``float8_e4m3fn``, cotangents
``float8_e5m2`` (TransformerEngine's HYBRID recipe):

- ``dot_general`` becomes ``scaled_dot``: the two float8 tensors go straight into the dot, which
  accumulates in bfloat16 (or ``accumulate_dtype``) and is multiplied by the product of the scales,
  the shape XLA's GPU GEMM rewriter turns into one cuBLASLt float8 GEMM. It is a ``custom_vjp``:
  under ``jax.grad(autocast_transform(f))`` its backward rule scales the cotangent to e5m2 and
  computes both transposed products from the saved float8 operands.
- ``conv_general_dilated`` needs operands of one dtype, so it keeps the QDQ form: quantize,
  dequantize to bfloat16, convolve; ``gradient_qdq`` on its output passes the cotangent through
  e5m2. float8 numerics, bfloat16 kernels.
- Under ``autocast_transform(jax.grad(f))`` the transposed products are ordinary equations: an
  operand computed by a transposed equation (``Env.cotangent``) is scaled to e5m2.

Quantization is straight-through for gradients (as in Flax and TransformerEngine); through the
``custom_vjp`` gradients come back in the operands' own dtypes (in the rewritten gradient
program, in their last op's: a kernel's in bfloat16). Every other op follows the bfloat16 tables
(``Policy.value_dtype``). Scales come from the tensor itself on every call ("current scaling"):
no state to carry, one max-reduction per operand. Under ``jax.vmap`` a tensor is one example's
slice.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from .. import _compat as compat
from ..interpreter import (
    F32,
    F64,
    SCALED_FORMATS,
    Step,
    _output_type,
    bind_lower,
    matmul_flops,
    reduce_dtype_for,
)
from ..policy import FLOAT8_COMPUTE

FORWARD_FORMAT = FLOAT8_COMPUTE  # activations and weights
GRADIENT_FORMAT = np.dtype(jnp.float8_e5m2)  # cotangents: more range, less precision
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


# --- dot_general: float8 operands straight into the dot ----------------------------------------
# XLA's GPU GEMM rewriter turns a dot_general of two float8 operands whose output is multiplied by
# a scalar into one cuBLASLt float8 GEMM (measured on an H100 with jax 0.11.2: the QDQ form above,
# with bfloat16 operands into the dot, stayed a bfloat16 GEMM). Flax's Fp8DirectDotGeneralOp has
# this shape too.


def _kept(ndim: int, *used: Sequence[int]) -> list[int]:
    taken = {d for dims in used for d in dims}
    return [d for d in range(ndim) if d not in taken]


def _transpose_lhs(
    g: Any,
    lhs_ndim: int,
    rhs: Any,
    dims: Any,
    out_dtype: np.dtype,
    swap: bool = False,
    like: Any = None,
) -> Any:
    """The cotangent of a dot_general's lhs, as a dot_general of ``g`` and ``rhs`` accumulating
    in ``out_dtype``, laid out as ``like`` (the lhs's sharding, where the forward dot named its
    own: an explicit-axes mesh needs one for a sharded contraction). JAX's own transpose rule
    returns the primal operand's dtype (float8 here) and its helpers are private, so this
    re-derives the same dimension bookkeeping."""
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dims
    lhs_kept = _kept(lhs_ndim, lhs_contract, lhs_batch)
    rhs_kept = _kept(rhs.ndim, rhs_contract, rhs_batch)
    n_batch = len(lhs_batch)
    if swap:  # g's dims are (batch, rhs_kept..., lhs_kept...) when lhs is the dot's rhs
        g_rhs = list(range(n_batch, n_batch + len(rhs_kept)))
    else:  # (batch, lhs_kept..., rhs_kept...)
        g_rhs = list(range(n_batch + len(lhs_kept), n_batch + len(lhs_kept) + len(rhs_kept)))
    contract_in_rhs_order = list(np.take(lhs_contract, np.argsort(rhs_contract)))
    order = list(lhs_batch) + lhs_kept + contract_in_rhs_order  # the lhs dim of each out dim
    out_sharding = None
    if like is not None:
        spec = tuple(like.spec) + (None,) * (lhs_ndim - len(like.spec))
        out_sharding = NamedSharding(like.mesh, PartitionSpec(*(spec[d] for d in order)))
    out = jax.lax.dot_general(
        g,
        rhs,
        ((g_rhs, rhs_kept), (list(range(n_batch)), list(rhs_batch))),
        preferred_element_type=out_dtype,
        out_sharding=out_sharding,
    )
    return jax.lax.transpose(out, tuple(np.argsort(order)))


def _transpose_rhs(
    g: Any, lhs: Any, rhs_ndim: int, dims: Any, out_dtype: np.dtype, like: Any = None
) -> Any:
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dims
    swapped = ((rhs_contract, lhs_contract), (rhs_batch, lhs_batch))
    return _transpose_lhs(g, rhs_ndim, lhs, swapped, out_dtype, swap=True, like=like)


def _sharding(x: Any) -> Any:
    """``x``'s sharding as its type carries it (an explicit-axes mesh's), else None."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    return sharding if isinstance(sharding, NamedSharding) else None


def _scaled_dot_fwd_impl(
    a: Any, b: Any, dims: Any, formats: tuple, out_dtype: np.dtype, out_sharding: Any
) -> tuple[Any, tuple]:
    sa, sb = scale_for(a, formats[0]), scale_for(b, formats[1])
    qa, qb = quantize(a, formats[0], sa), quantize(b, formats[1], sb)
    y = jax.lax.dot_general(
        qa, qb, dims, preferred_element_type=out_dtype, out_sharding=out_sharding
    )
    return y * (sa * sb).astype(out_dtype), (qa, sa, qb, sb)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6, 7))
def scaled_dot(
    a: Any,
    b: Any,
    dims: Any,
    formats: tuple,
    out_dtype: np.dtype,
    operand_dtypes: tuple,
    grad_dtype: np.dtype | None = None,
    out_sharding: Any = None,
) -> Any:
    """``dot_general(a, b)`` on per-tensor scaled float8 operands, output in ``out_dtype`` laid
    out as ``out_sharding`` (the original dot's: under an explicit-axes mesh JAX asks for one
    where a contraction is sharded); the backward products accumulate in ``grad_dtype``
    (``Policy.reduce_dtype``; None: ``out_dtype``)."""
    return _scaled_dot_fwd_impl(a, b, dims, formats, out_dtype, out_sharding)[0]


def _scaled_dot_fwd(
    a: Any,
    b: Any,
    dims: Any,
    formats: tuple,
    out_dtype: np.dtype,
    operand_dtypes: tuple,
    grad_dtype: np.dtype | None = None,
    out_sharding: Any = None,
) -> tuple[Any, tuple]:
    return _scaled_dot_fwd_impl(a, b, dims, formats, out_dtype, out_sharding)


def _scaled_dot_bwd(
    dims: Any,
    formats: tuple,
    out_dtype: np.dtype,
    operand_dtypes: tuple,
    grad_dtype: np.dtype | None,
    out_sharding: Any,
    res: tuple,
    g: Any,
) -> tuple[Any, Any]:
    qa, sa, qb, sb = res
    wide = grad_dtype or out_dtype
    sg = scale_for(g, GRADIENT_FORMAT)
    qg = quantize(g, GRADIENT_FORMAT, sg)
    # (where the forward dot named its layout, each cotangent takes its operand's)
    like_a, like_b = (None, None) if out_sharding is None else (_sharding(qa), _sharding(qb))
    da = _transpose_lhs(qg, qa.ndim, qb, dims, wide, like=like_a) * (sg * sb).astype(wide)
    db = _transpose_rhs(qg, qa, qb.ndim, dims, wide, like=like_b) * (sg * sa).astype(wide)
    return da.astype(operand_dtypes[0]), db.astype(operand_dtypes[1])


scaled_dot.defvjp(_scaled_dot_fwd, _scaled_dot_bwd)


# A key at which forward products decided differently: the transposed product cannot tell which
# one it derives from there (see ``_qualifies``).
_MIXED = "mixed"


def _record(decisions: dict, key: tuple, qualifies: bool) -> None:
    if decisions.setdefault(key, qualifies) != qualifies:
        decisions[key] = _MIXED


def _site_keys(step: Step, site: tuple, operand: int, product_shape: tuple) -> list[tuple]:
    """Where a forward product at ``site`` (whose operand ``operand`` gives a value of
    ``product_shape``) records its decision and a transposed product reading that operand looks
    it up, most specific first: the operand's variable (a transposed product in the same jaxpr
    reads the forward one's; kept only where the jaxpr has a backward pass, so an eager region's
    values leave no records), the operand's and product's shapes (a backward pass in another
    jaxpr: a scan body, a jitted callee), then the source site alone (a transposed convolution
    reads its kernel reversed or regrouped)."""
    atom = step.eqn.invars[operand]
    shapes = site + (tuple(atom.aval.shape), tuple(product_shape))
    if isinstance(atom, compat.Var) and step.env.cotangent:
        return [shapes + (atom,), shapes, site]
    return [shapes, site]


def _qualifies(step: Step) -> bool:
    """Two floating (not float64) operands, one of them a weight: a function input or constant
    seen through reshapes and broadcasts (``Env.input_view``). Products of two activations
    (attention's ``q @ k`` and ``p @ v``) stay bfloat16, as in TransformerEngine: their per-tensor
    amax and quantization passes over the score matrix cost more than float8 saves (measured on
    an H100, benchmarks/README.md). A transposed dot of a ``jax.grad`` program (an operand that
    is a cotangent) follows the decision made at its forward dot: the one at the same source line
    and scope that read its other operand and made a value of its cotangent's shape."""
    floating = step.floating()
    if not (
        step.eqn.primitive.name in SCALED_PRIMITIVES
        and len(step.args) == 2
        and floating == [0, 1]
        and all(step.aval(i).dtype != F64 for i in floating)
    ):
        return False
    qualifies = any(step.has_tag(i, "input_view") for i in range(2))
    decisions = step.rewriter.site_decisions
    cotangents = [i for i in range(2) if step.has_tag(i, "cotangent")]
    site = ("float8", compat.scope_names(step.eqn), compat.source_line(step.eqn))
    if not cotangents:
        for operand in range(2):
            for key in _site_keys(step, site, operand, step.eqn.outvars[0].aval.shape):
                _record(decisions, key, qualifies)
        return qualifies
    # JAX gives transposed equations tracebacks of their own, but the user's source position
    # and scope path survive. One line can hold several products (a helper ``mm(a, b)``), so
    # the link also takes the forward operand the transposed product reads and the forward
    # product's shape (its cotangent's). The most specific record decides; a mixed one (forward
    # products alike in all of that) leaves the decision to the operands.
    if len(cotangents) == 1:
        cotangent = cotangents[0]
        keys = _site_keys(step, site, 1 - cotangent, step.eqn.invars[cotangent].aval.shape)
    else:  # two cotangents (a second-order product): the site alone
        keys = [site]
    for key in keys:
        found = decisions.get(key)
        if found is not None:
            return qualifies if found is _MIXED else found
    return qualifies


def _float8_dot(step: Step, formats: list, out_dtype: np.dtype) -> list[Any]:
    a, b = step.args
    dims = tuple(
        tuple(tuple(int(d) for d in side) for side in pair)
        for pair in step.params["dimension_numbers"]
    )
    operand_dtypes = (np.dtype(a.dtype), np.dtype(b.dtype))
    if any(step.has_tag(i, "cotangent") for i in range(2)):  # a backward product: no custom_vjp
        out_dtype = reduce_dtype_for(step) or out_dtype
    grad_dtype = reduce_dtype_for(step)
    return [
        scaled_dot(
            a,
            b,
            dims,
            tuple(formats),
            np.dtype(out_dtype),
            operand_dtypes,
            grad_dtype,
            step.params.get("out_sharding"),
        )
    ]


def _float8_qdq(step: Step, formats: list, out_dtype: np.dtype) -> list[Any]:
    value = step.state.value_dtype
    operands = [quantize_dequantize(a, fmt, value) for a, fmt in zip(step.args, formats)]
    outs = bind_lower(step, operands, preferred_element_type=out_dtype)
    return [gradient_qdq(y) for y in outs]


# How each primitive runs in float8: convolutions keep the QDQ form, since lax.conv_general_dilated
# needs equal operand dtypes (an e5m2 cotangent against an e4m3 kernel has no direct form).
FLOAT8_FORMS = {"dot_general": _float8_dot, "conv_general_dilated": _float8_qdq}


def float8_rule(step: Step) -> Sequence[Any] | None:
    """A lower-table op on per-tensor scaled float8 operands; None where it does not qualify
    (no weight operand, an integer operand, ``ragged_dot_general``, fewer FLOPs than
    ``Policy.min_float8_flops``): it then runs in bfloat16.

    The size test applies to every product on its own: the three GEMMs of a matmul (forward and
    both transposes) have the same FLOPs, so a transposed dot follows its forward dot. A
    convolution's gradient convolutions do not always: with strides (or dilation) their FLOPs
    differ from the forward's, so near the threshold a gradient convolution of an
    ``autocast_transform(jax.grad(f))`` program may fall on the other side of it (float8 forward,
    bfloat16 gradient, or the reverse). A symbolic size (a polymorphic export) counts at its
    generic value (``matmul_flops``)."""
    if not _qualifies(step):
        return None
    if matmul_flops(step.eqn) < step.policy.min_float8_flops:
        step.scaled_skip = "min_float8_flops"
        return None
    formats = [
        GRADIENT_FORMAT if step.has_tag(i, "cotangent") else FORWARD_FORMAT for i in range(2)
    ]
    default = step.policy.accumulate_for(step.state.dtype, step.state.value_dtype)
    out_dtype = _output_type(step, default).get("preferred_element_type") or default
    step.flop_dtype = GRADIENT_FORMAT if GRADIENT_FORMAT in formats else FORWARD_FORMAT
    name = step.eqn.primitive.name
    # jamp.explain(compiled=True) compiles each float8 dot under a scope of its own, which XLA
    # keeps in the op_name of the GEMM that runs it (float8_check.py).
    record = getattr(step.rewriter.recorder, "float8_dot", None)
    scope = record(step, formats) if callable(record) and name == "dot_general" else None
    with compat.equation_context(step.eqn), scope or contextlib.nullcontext():
        return FLOAT8_FORMS[name](step, formats, np.dtype(out_dtype))


SCALED_FORMATS[FORWARD_FORMAT] = float8_rule
