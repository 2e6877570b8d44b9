"""``Policy.reduce_dtype``: the backward products of a 16-bit (or float8) matmul or convolution
accumulate in a wider dtype, so the gradient sums XLA partitions after them move that dtype.

JAX's transpose of ``dot_general``/``conv_general_dilated`` computes each cotangent with the
forward op's ``preferred_element_type`` (the compute dtype under a 16-bit policy) and converts it
to the operand's dtype. Under data parallelism or FSDP the gradient of a weight is a product whose
contracting dimension (the batch) is sharded: XLA's SPMD partitioner sums the per-device partial
products right after that product, in its output dtype. :func:`bind` binds the op under a
``jax.custom_vjp`` whose backward rule runs JAX's own transposes (every dimension-number,
padding and feature-group case, not re-derived here) with their products accumulating in
``reduce_dtype``: 16-bit operands in, float32 out, as a GEMM accumulates anyway, and the
sum after it in float32. The cotangent of each operand is then converted to the dtype that
operand arrived in (a float32 parameter gets its float32 gradient, never rounded to 16 bits).

The op's primal inputs are the operands as they arrived *and* their cast copies (the forward
runs on the copies, cast once per program by the rewriter, constants saturating); the cast
copies get no cotangent. ``jax.custom_vjp`` supports reverse mode only: ``jax.jvp`` of such an op
raises, which is why it is used only when ``Policy.reduce_dtype`` is set.

Example::

    policy = jamp.Policy(jnp.bfloat16, reduce_dtype=jnp.float32)
    grads = jax.grad(jamp.autocast_transform(loss, policy))(params, batch)   # float32 sums
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from . import _compat as compat

# Products whose transposes are products again: their preferred_element_type is widened.
PRODUCTS = frozenset({"dot_general", "conv_general_dilated"})


def bind(
    primitive: Any,
    params: dict[str, Any],
    arrived: Sequence[Any],
    cast: Sequence[Any],
    reduce_dtype: np.dtype,
) -> Any:
    """``primitive.bind(*cast, **params)``; its cotangents with respect to ``arrived`` come from
    JAX's transposes accumulating in ``reduce_dtype``, converted to the ``arrived`` dtypes."""
    dtypes = [np.dtype(compat.aval_of(a).dtype) for a in arrived]

    @jax.custom_vjp
    def product(arrived: Any, cast: Any) -> Any:
        return primitive.bind(*cast, **params)

    def forward(arrived: Any, cast: Any) -> tuple[Any, tuple]:
        return primitive.bind(*cast, **params), tuple(cast)

    def backward(operands: tuple, g: Any) -> tuple[tuple, tuple]:
        cotangents = tuple(
            compat.convert(_widened_transpose(primitive, params, operands, i, g, reduce_dtype), d)
            for i, d in enumerate(dtypes)
        )
        return cotangents, tuple(None for _ in operands)

    product.defvjp(forward, backward)
    return product(tuple(arrived), tuple(cast))


def _widened_transpose(
    primitive: Any, params: dict, operands: tuple, i: int, g: Any, reduce_dtype: np.dtype
) -> Any:
    """The cotangent of ``operands[i]``: JAX's transpose of the op (linear in that operand),
    evaluated with every product's output in ``reduce_dtype`` and the final narrowing convert
    left out."""

    def transposed(g: Any, *ops: Any) -> Any:
        def linear(x: Any) -> Any:
            return primitive.bind(*ops[:i], x, *ops[i + 1 :], **params)

        return jax.linear_transpose(linear, ops[i])(g)[0]

    closed = jax.make_jaxpr(transposed)(g, *operands)
    jaxpr, consts = compat.open_and_consts(closed)
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, (g, *operands)))
    read = lambda atom: atom.val if isinstance(atom, compat.Literal) else env[atom]  # noqa: E731
    for eqn in jaxpr.eqns:
        args = [read(v) for v in eqn.invars]
        params_ = compat.bind_params(eqn)
        name = eqn.primitive.name
        if name in PRODUCTS:
            params_["preferred_element_type"] = reduce_dtype
        if name == "convert_element_type" and _narrows(args[0], params_["new_dtype"], reduce_dtype):
            outs = [args[0]]  # JAX's cast of the product back to the operand's dtype
        else:
            out = eqn.primitive.bind(*args, **params_)
            outs = list(out) if eqn.primitive.multiple_results else [out]
        env.update(zip(eqn.outvars, outs))
    return read(jaxpr.outvars[0])


def _narrows(value: Any, new_dtype: Any, reduce_dtype: np.dtype) -> bool:
    old = np.dtype(compat.aval_of(value).dtype)
    new = np.dtype(new_dtype)
    return old == reduce_dtype and new.itemsize < old.itemsize and new.kind == old.kind
