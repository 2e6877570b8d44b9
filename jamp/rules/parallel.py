"""``shard_map``: the per-shard body is rewritten under the call site's region;
``custom_partitioning``: the call keeps its traced dtypes.

The body is re-entered through the public ``jax.shard_map`` with the equation's mesh and specs, so
JAX binds the mesh axes for the body's collectives (``psum``, ``all_gather``, ...); collectives
themselves run in the dtype their operands arrive in, like any other op. The instrumented
evaluator (probe.py) runs a ``shard_map`` whole, as one site: its body needs the mesh.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .. import _compat as compat
from ..interpreter import Step, keep_traced_rule, register, register_opaque


@register("shard_map")
def shard_map_rule(step: Step) -> Sequence[Any]:
    params = step.params
    jaxpr, consts = compat.open_and_consts(compat.as_closed(params["jaxpr"]))
    rewriter = step.rewriter.child(step.state)
    hints = step.hints()

    def body(*args: Any) -> tuple[Any, ...]:
        return tuple(rewriter.run(jaxpr, consts, args, hints))

    mapped = compat.shard_map(
        body,
        mesh=params["mesh"],
        in_specs=tuple(params["in_specs"]),
        out_specs=tuple(params["out_specs"]),
        axis_names=params.get("newly_manual_axes"),
        check_vma=params.get("check_vma", True),
    )
    with compat.equation_context(step.eqn):
        return list(mapped(*step.args))


@register("custom_partitioning")
def custom_partitioning_rule(step: Step) -> Sequence[Any]:
    """``jax.experimental.custom_partitioning``: a partitioned program runs, per shard, the
    function the user's ``partition`` callback returns, not the traced body, so no rewrite of the
    body would reach it. The call runs as the user wrote it, in its traced dtypes (its operands
    cast back to them), like a kernel: no warning, since there is nothing for the user to add."""
    return keep_traced_rule(step)


register_opaque("shard_map", "custom_partitioning")
