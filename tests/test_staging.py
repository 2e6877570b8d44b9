"""jamp stages equations straight into the program being built.

Inside ``jax.jit`` or ``jax.make_jaxpr``, ``autocast_transform`` re-emits the traced program
into the caller's trace. Most equations are staged directly (``compat.stage_like``: the
equation is added as JAX's own staging would add it, without a full ``bind``); the rest are
bound. Either way the program must be the same, down to name stacks, source lines and equation
contexts. A region's operations (``compat.bind_on``) are staged the same way. These tests
compare a staged program with the one binding every equation builds
(``tests.jaxpr_utils.bound_only``), on Flax models, under named scopes, XLA metadata and a mesh,
and check that staging does happen. Property (10) in test_properties.py checks random programs.
"""
from __future__ import annotations

import contextlib
import functools

import flax.linen as nn
import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.xla_metadata import set_xla_metadata

import jamp
from jamp import _compat as compat
from tests.host_data import ones as _ones
from tests.jaxpr_utils import bound_only, fresh, fresh_region_caches, program_record


class Block(nn.Module):
    """A pre-LN transformer block and a conv + BatchNorm head: attention (softmax, masks from
    Python constants), layer norm, gelu, reshapes and broadcasts, a conv."""

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        h = nn.MultiHeadDotProductAttention(num_heads=2)(h, h, mask=nn.make_causal_mask(x[..., 0]))
        x = x + h
        x = x + nn.Dense(16)(jax.nn.gelu(nn.Dense(32)(nn.LayerNorm()(x))))
        y = nn.Conv(8, (3,))(x)
        y = nn.BatchNorm(use_running_average=True)(y)
        return jnp.mean(nn.relu(y), axis=(1, 2))


@functools.cache
def _variables_and_input():
    """Shared by the tests (one compiled init; an eager one compiles each of its operations)."""
    x = jax.device_put(np.random.default_rng(0).normal(size=(2, 6, 16)).astype(np.float32))
    return jax.jit(Block().init)(jax.random.PRNGKey(0), x), x


def _model():
    model = Block()  # a new function each call: JAX's and jamp's caches start afresh
    return (lambda v, x: model.apply(v, x)), _variables_and_input()


def _both(make_program):
    """``make_program()`` with equations staged directly, and with every one bound (called from
    the same line: a program's source locations hold the whole Python stack). Each call must
    trace new function objects: a second ``jax.jit`` or ``make_jaxpr`` of the same function
    would return the first one's program from JAX's cache; and a region's kept decisions and
    jnp rewrites start afresh under each (``fresh_region_caches``)."""
    records = []
    for staging in (contextlib.nullcontext(), bound_only()):
        with fresh_region_caches(), staging:
            records.append(make_program())
    return records


def test_a_flax_models_program_is_the_one_binding_builds():
    f, args = _model()
    staged, bound = _both(lambda: program_record(jax.make_jaxpr(jamp.autocast_transform(f))(*args)))
    assert staged == bound
    assert any(name == "dot_general" for name, *_ in staged[1])


def test_a_jitted_train_step_lowers_to_the_same_module():
    """What XLA receives, op names (the name stacks) and source locations included."""
    f, (variables, x) = _model()

    def lowered():
        def loss(v, x):
            return jnp.sum(jamp.autocast_transform(f)(v, x) ** 2)

        return jax.jit(jax.value_and_grad(loss)).lower(variables, x).as_text(debug_info=True)

    staged, bound = _both(lowered)
    assert staged == bound


def test_the_callers_name_scopes_prefix_the_staged_equations():
    w = _ones(4, 4)

    def f(x):
        with jax.named_scope("inner"):
            return jnp.tanh(x @ w) + 1.0

    def record():
        def outer(x):
            with jax.named_scope("outer"):
                return jamp.autocast_transform(f)(x)

        return program_record(jax.make_jaxpr(outer)(_ones(2, 4)))

    staged, bound = _both(record)
    assert staged == bound
    stacks = {stack for name, stack, *_ in staged[1] if name == "dot_general"}
    assert stacks == {"outer/inner"}, stacks


@pytest.mark.parametrize("where", ["inside", "outside"])
def test_equations_under_xla_metadata_keep_their_context(where):
    """An equation traced under another context than the caller's (here XLA metadata set inside
    the function, or around the call) gets the context binding gives it."""
    w = _ones(4, 4)

    def f(x):
        with set_xla_metadata(fusion="a") if where == "inside" else contextlib.nullcontext():
            y = x @ w
        return jnp.tanh(y)

    def record():
        def call(x):
            with set_xla_metadata(stage="b") if where == "outside" else contextlib.nullcontext():
                return jamp.autocast_transform(f)(x)

        return program_record(jax.make_jaxpr(call)(_ones(2, 4)))

    staged, bound = _both(record)
    assert staged == bound
    contexts = {str(ctx.xla_metadata) for name, _, _, ctx in staged[1] if name == "dot_general"}
    assert contexts == ({"{'fusion': 'a'}"} if where == "inside" else {"{'stage': 'b'}"})


def test_a_program_traced_under_a_mesh_is_the_one_binding_builds():
    mesh = jax.make_mesh((1,), ("data",))
    f, args = _model()

    def traced():
        with jax.set_mesh(mesh):
            return program_record(jax.make_jaxpr(jamp.autocast_transform(f))(*args))

    staged, bound = _both(traced)
    assert staged == bound


@pytest.mark.parametrize("jitted", [False, True], ids=["make_jaxpr", "jit"])
def test_a_regions_program_is_the_one_binding_builds(jitted):
    """A region stages the operations it decides (or replays) into the caller's program the
    same way (``compat.bind_on``)."""
    f, (variables, x) = _model()

    def record():
        def in_region(v, x):
            with jax.named_scope("outer"), jamp.autocast():
                return f(v, x)

        if jitted:
            return jax.jit(in_region).lower(variables, x).as_text(debug_info=True)
        return program_record(jax.make_jaxpr(in_region)(variables, x))

    staged, bound = _both(record)
    assert staged == bound


class _CountBinds:
    """Counts ``Primitive.bind`` calls (JAX's public primitive class) while active."""

    def __init__(self):
        self.count = 0

    def __enter__(self):
        self.bind = jax.extend.core.Primitive.bind
        counter = self

        def counting(primitive, *args, **params):
            counter.count += 1
            return counter.bind(primitive, *args, **params)

        jax.extend.core.Primitive.bind = counting
        return self

    def __exit__(self, *exc):
        jax.extend.core.Primitive.bind = self.bind


def test_the_rewrite_of_a_dense_stack_binds_nothing_itself():
    """Tracing the transformed function binds what tracing the function binds (its own trace);
    the rewrite then stages every equation and cast, binding none (with staging off it binds
    one per equation and cast: the check can fail)."""
    args = ([jnp.full((8, 8), 0.1 * i) for i in range(3)], _ones(2, 8))

    def f(ws, x):
        for w in ws:
            x = jnp.tanh(x @ w) * x
        return x

    # (jamp looks at each primitive once; jnp's functions are traced once per autocast state,
    # part of JAX's jit cache key: region_stack.STATE_KEY)
    jax.make_jaxpr(jamp.autocast_transform(f))(*args)
    jax.make_jaxpr(fresh(f))(*args)
    with _CountBinds() as plain:
        jax.make_jaxpr(f)(*args)
    with _CountBinds() as transformed:
        jax.make_jaxpr(jamp.autocast_transform(f))(*args)
    with bound_only(), _CountBinds() as bound:
        jax.make_jaxpr(jamp.autocast_transform(f))(*args)
    assert transformed.count == plain.count
    assert bound.count > plain.count + 3 * 3  # three matmuls, tanhs and products at least


class _CountStagedByJax:
    """Counts the operations JAX's own program trace receives through a bind
    (``DynamicJaxprTrace.process_primitive``) while active: what was not staged directly.
    (Patching ``Primitive.bind`` itself would change the path a region takes: ``bind_on``
    binds a primitive with a ``bind`` of its own through it.)"""

    def __init__(self):
        self.names: list[str] = []

    def __enter__(self):
        cls = compat.ProgramTrace
        self.process = cls.process_primitive
        counter = self

        def counting(trace, primitive, tracers, params):
            counter.names.append(primitive.name)
            return counter.process(trace, primitive, tracers, params)

        cls.process_primitive = counting
        return self

    def __exit__(self, *exc):
        compat.ProgramTrace.process_primitive = self.process


def test_a_region_stages_everything_it_passes_on():
    """A region stages what its policy decided, its casts and its rewrites of jnp's functions
    (inlined as JAX's staging rule inlines them) straight into the program being built: none
    reaches JAX's program trace through a bind (with staging off, every operation, cast and
    jnp call does: the check can fail)."""
    args = ([jnp.full((8, 8), 0.1 * i) for i in range(3)], _ones(2, 8))

    def f(ws, x):
        for w in ws:
            x = jnp.tanh(jax.lax.dot(x, w)) * x + 1.0  # (lax: decided by the region itself)
        return jnp.mean(x @ ws[0], axis=-1)  # (jnp's matmul: its rewrite inlined)

    def in_region(ws, x):
        with jamp.autocast():
            return f(ws, x)

    jax.make_jaxpr(in_region)(*args)  # (decisions and jnp rewrites made once)
    # (new functions below: JAX's trace cache would answer for one traced before)
    with _CountStagedByJax() as plain:
        jax.make_jaxpr(fresh(f))(*args)
    with _CountStagedByJax() as region:
        program = jax.make_jaxpr(fresh(in_region))(*args)
    with bound_only(), _CountStagedByJax() as bound:
        jax.make_jaxpr(fresh(in_region))(*args)
    casts = sum(e.primitive.name == "convert_element_type" for e in program.jaxpr.eqns)
    assert casts >= 4 and "jit" in plain.names  # (the matmuls' operands at least; jnp's calls)
    assert region.names == []
    assert bound.names.count("dot_general") == 3
    assert bound.names.count("convert_element_type") >= 3  # (the lax.dot operands' casts)
    assert bound.names.count("jit") >= 3 * 2 + 2  # (jnp's *, + per layer, matmul and mean)


def test_a_regions_inlined_calls_keep_their_scopes_and_contexts():
    """A jitted function JAX inlines (``inline=True``, as jnp's are) with a named scope and
    literals in its body, traced once under XLA metadata before a region calls it under a named
    scope of its own: the region's inlining of its rewrite gives the program JAX's own inlining
    gives (each equation's scopes under the caller's, its context, its literals)."""

    @functools.partial(jax.jit, inline=True)
    def scaled_tanh(x, w):
        with jax.named_scope("inner"):
            y = jnp.tanh(x @ w) * 2.0
        return y + jnp.float32(1.0) * 0.5

    args = (_ones(2, 8), _ones(8, 8))
    with set_xla_metadata(stage="traced"):
        jax.make_jaxpr(scaled_tanh)(*args)  # (the callee's jaxpr, cached under the metadata)

    def record():
        def f(x, w):
            with jamp.autocast(), jax.named_scope("outer"):
                return scaled_tanh(x, w)

        return program_record(jax.make_jaxpr(f)(*args))

    staged, bound = _both(record)
    assert staged == bound


def test_an_equation_with_empty_effects_of_another_type_is_staged_with_them():
    """``jax.free_ref``'s abstract evaluation gives ``{}`` for no effects, and
    ``jax_enable_checks`` compares an equation's effects with it by type too: jamp staged it with
    ``frozenset()``, and every program freeing a reference failed JAX's check (jax 0.10, 0.12).
    Also a mutable array reference passed to a transformed function, under a trace and eagerly."""

    def fn(x):
        ref = jax.empty_ref(jax.ShapeDtypeStruct((), "float32"))
        ref[...] = 2.0 * x
        result = ref[...]
        jax.free_ref(ref)
        return result

    traces = []

    def writes(ref, x):
        traces.append(x)
        ref[...] = jnp.sin(x)
        return ref[...] * 2.0

    with jax.enable_checks(True):
        transformed = jamp.autocast_transform(fn)
        assert float(transformed(3.0)) == 6.0
        assert float(jax.grad(transformed)(3.0)) == 2.0
        ref = jax.new_ref(jnp.float32(0.0))
        got = jax.jit(jamp.autocast_transform(writes))(ref, jnp.float32(1.0))
    np.testing.assert_allclose(got, 2 * np.sin(1.0), rtol=1e-6)
    np.testing.assert_allclose(ref[...], np.sin(1.0), rtol=1e-6)
    # Eagerly a reference is an argument too, as jax.jit takes it: traced once for both calls,
    # never baked into the program as a constant.
    eager = jamp.autocast_transform(writes)
    traces.clear()
    for value in (1.0, 2.0):
        ref = jax.new_ref(jnp.float32(0.0))
        np.testing.assert_allclose(eager(ref, jnp.float32(value)), 2 * np.sin(value), rtol=1e-6)
        np.testing.assert_allclose(ref[...], np.sin(value), rtol=1e-6)
    assert len(traces) == 1, traces
